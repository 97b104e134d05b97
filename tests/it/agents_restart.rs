//! A run waiting for its client survives the server (issue 11): the real `behest serve` binary
//! pauses a run on client tool calls (`requires_action`), is killed with SIGKILL, and the
//! restarted process on the same database shows the same pending calls, takes the client's
//! outputs and completes the run without calling the model again for that turn; a SIGTERM
//! while a run waits drains at once (a waiting run is at a boundary), and the next process
//! resumes the wait, where a cancel ends it. On both store backends.

use crate::support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::db::{Backend, TestDb};
use support::fake_openai::{FakeOpenAi, text_stream, tool_calls_stream};
use support::process::{ServerProcess, ToolServer, config_toml};
use support::server::collect_frames;
use support::validate::validate_openai_request;

fn body(input: &str, session: Option<&str>) -> Value {
    let mut body = json!({
        "provider": "fake", "model": "fake-model", "input": input,
        "tools": [
            {"name": "get_location", "description": "Where the user is."},
            {"name": "get_weather", "description": "The weather in a city.",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
        ]
    });
    if let Some(session) = session {
        body["session_id"] = json!(session);
    }
    body
}

fn two_calls(tag: &str) -> Vec<u8> {
    tool_calls_stream(&[
        (&format!("call_{tag}_loc"), "get_location", json!({})),
        (
            &format!("call_{tag}_wx"),
            "get_weather",
            json!({"city": "Paris"}),
        ),
    ])
}

fn outputs(tag: &str) -> Value {
    json!({"tool_outputs": [
        {"call_id": format!("call_{tag}_loc"), "output": {"city": "Paris"}},
        {"call_id": format!("call_{tag}_wx"), "output": "sunny"}
    ]})
}

/// Polls `GET /runs/{id}` until `done` holds (at most 60 s: a PostgreSQL takeover waits for the
/// dead process's lease to expire).
async fn wait_for(server: &ServerProcess, run_id: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, run) = server.get(&format!("/runs/{run_id}")).await;
        if status == 200 && done(&run) {
            return run;
        }
        assert!(Instant::now() < deadline, "the run never got there: {run}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn event_types(server: &ServerProcess, run_id: &str) -> Vec<(u64, String)> {
    let response = server
        .client
        .get(server.url(&format!("/runs/{run_id}/events")))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap();
    collect_frames(response)
        .await
        .into_iter()
        .map(|f| (f.sequence(), f.event))
        .collect()
}

async fn a_wait_survives_the_server(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let fake = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    let toml = config_toml(&fake.base_url(), &tools, "");
    fake.push(support::fake_openai::Reply::sse(&two_calls("a")));
    fake.push(support::fake_openai::Reply::sse(&text_stream(&[
        "Sunny in Paris.",
    ])));

    // 1. SIGKILL while the run waits; the next process shows the same wait and takes the outputs.
    let mut first = ServerProcess::start("first", &toml, &db.url).await;
    let (status, _, created) = first.post("/runs", &body("weather here?", None)).await;
    assert_eq!(status, 202, "{created}");
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    let session = created["session_id"].as_str().unwrap().to_owned();
    let before = wait_for(&first, &run_id, |run| run["status"] == "requires_action").await;
    first.kill().await;
    let second = ServerProcess::start("restarted", &toml, &db.url).await;
    let after = wait_for(&second, &run_id, |run| run["status"] == "requires_action").await;
    assert_eq!(after["required_action"], before["required_action"]);
    let (status, _, answer) = second
        .post(&format!("/runs/{run_id}/tool_outputs"), &outputs("a"))
        .await;
    assert_eq!(status, 202, "{answer}");
    let run = wait_for(&second, &run_id, |run| {
        ["completed", "failed", "cancelled"].contains(&run["status"].as_str().unwrap_or(""))
    })
    .await;
    assert_eq!(run["status"], "completed", "{run}\n{}", second.log());
    let events = event_types(&second, &run_id).await;
    let sequences: Vec<u64> = events.iter().map(|(s, _)| *s).collect();
    assert_eq!(
        sequences,
        (1..=events.len() as u64).collect::<Vec<_>>(),
        "contiguous"
    );
    let types: Vec<&str> = events.iter().map(|(_, t)| t.as_str()).collect();
    let count = |kind: &str| types.iter().filter(|t| **t == kind).count();
    assert_eq!(
        count("tool_calls_required"),
        1,
        "the wait is not announced twice: {types:?}"
    );
    assert_eq!(count("run_resumed"), 1, "{types:?}");
    assert_eq!(
        count("model_started"),
        2,
        "the paused turn's model call is not made again"
    );
    assert_eq!(count("run_completed"), 1);
    let required = types
        .iter()
        .position(|t| *t == "tool_calls_required")
        .unwrap();
    let resumed = types.iter().position(|t| *t == "run_resumed").unwrap();
    assert!(required < resumed, "{types:?}");
    assert_eq!(fake.requests().len(), 2);
    let results: Vec<Value> = fake.requests()[1].body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["content"].clone())
        .collect();
    assert_eq!(results, [json!("{\"city\":\"Paris\"}"), json!("sunny")]);

    // 2. SIGTERM while a run waits: the drain does not wait its grace for it.
    fake.push(support::fake_openai::Reply::sse(&two_calls("b")));
    fake.push(support::fake_openai::Reply::sse(&text_stream(&[
        "Still sunny.",
    ])));
    let (status, _, created) = second
        .post("/runs", &body("and now?", Some(&session)))
        .await;
    assert_eq!(status, 202, "{created}");
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    wait_for(&second, &run_id, |run| run["status"] == "requires_action").await;
    let mut second = second;
    let stopping = Instant::now();
    second.terminate().await;
    assert!(
        second.wait_exit(Duration::from_secs(8)).await.is_some(),
        "a waiting run does not hold the drain for its 10 s grace"
    );
    let drained = stopping.elapsed();
    let third = ServerProcess::start("third", &toml, &db.url).await;
    let run = wait_for(&third, &run_id, |run| run["status"] == "requires_action").await;
    assert_eq!(
        run["required_action"]["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    let (status, _, _) = third
        .post(&format!("/runs/{run_id}/tool_outputs"), &outputs("b"))
        .await;
    assert_eq!(status, 202);
    let run = wait_for(&third, &run_id, |run| run["status"] == "completed").await;
    assert_eq!(run["iterations"], 2);

    // 3. A cancel reaches a wait the restarted process resumed.
    fake.push(support::fake_openai::Reply::sse(&two_calls("c")));
    let (_, _, created) = third
        .post("/runs", &body("once more", Some(&session)))
        .await;
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    wait_for(&third, &run_id, |run| run["status"] == "requires_action").await;
    let (status, run) = third
        .post_empty(&format!("/runs/{run_id}/cancel?wait=true"))
        .await;
    assert_eq!(
        (status, run["status"].as_str()),
        (200, Some("cancelled")),
        "{run}"
    );
    let (status, _, problem) = third
        .post(&format!("/runs/{run_id}/tool_outputs"), &outputs("c"))
        .await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (409, Some("run_not_waiting"))
    );

    // The session's history stayed one the provider accepts.
    fake.push(support::fake_openai::Reply::sse(&text_stream(&["Bye."])));
    let (_, _, created) = third
        .post(
            "/runs",
            &json!({"session_id": session, "provider": "fake", "model": "fake-model", "input": "bye"}),
        )
        .await;
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    wait_for(&third, &run_id, |run| run["status"] == "completed").await;
    for (n, request) in fake.requests().iter().enumerate() {
        let errors = validate_openai_request(&request.body);
        assert!(errors.is_empty(), "request {n}: {errors:?}");
    }
    println!("{backend:?}: SIGTERM with a waiting run drained in {drained:?}");
    drop(third);
    db.assert_logs_fold().await;
    db.cleanup().await;
}

on_both_backends!(a_wait_survives_the_server);
