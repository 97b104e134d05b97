//! The agent loop's guards over HTTP: idempotency, one active run per session, the sessions
//! API, doom loops, iteration limits.

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::db::Backend;
use support::fake_openai::{FakeOpenAi, Reply, text_stream, tool_calls_stream};
use support::server::{TestServer, collect_frames, config_for, config_with};

/// A Chat Completions stream in which the model calls `name` with `arguments`.
fn tool_call_stream(id: &str, name: &str, arguments: &Value) -> Vec<u8> {
    tool_calls_stream(&[(id, name, arguments.clone())])
}

fn run_body(input: &str) -> Value {
    json!({"provider": "fake", "model": "fake-model", "input": input})
}

async fn post(
    server: &TestServer,
    path: &str,
    body: &Value,
    key: Option<&str>,
) -> reqwest::Response {
    let mut request = server.client.post(server.url(path)).json(body);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    request.send().await.unwrap()
}

async fn idempotent_creates_return_the_same_run(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let mut body = run_body("once");
    body["client_request_id"] = json!("req-42");
    let first = post(&server, "/runs", &body, None).await;
    assert_eq!(first.status(), 202);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first: Value = first.json().await.unwrap();
    let again = post(&server, "/runs", &body, None).await;
    assert_eq!(again.status(), 202);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.json::<Value>().await.unwrap(), first);
    // The header stands in for the field.
    let by_header = post(&server, "/runs", &run_body("once"), Some("req-42")).await;
    assert_eq!(by_header.json::<Value>().await.unwrap(), first);
    let mut other = run_body("something else");
    other["client_request_id"] = json!("req-42");
    let conflict = post(&server, "/runs", &other, None).await;
    assert_eq!(conflict.status(), 409);
    let problem: Value = conflict.json().await.unwrap();
    assert_eq!(problem["code"], "idempotency_key_reused");
    assert_eq!(problem["run_id"], first["run_id"]);
    server.finished_run(first["run_id"].as_str().unwrap()).await;
    assert_eq!(fake.requests().len(), 1, "one run, one model call");

    // Twenty concurrent identical requests create exactly one run.
    let body = run_body("race");
    let racers = (0..20).map(|_| {
        let client = server.client.clone();
        let url = server.url("/runs");
        let body = body.clone();
        async move {
            let response = client
                .post(url)
                .header("Idempotency-Key", "race-1")
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 202);
            response.json::<Value>().await.unwrap()["run_id"]
                .as_str()
                .unwrap()
                .to_owned()
        }
    });
    let ids = futures::future::join_all(racers).await;
    assert!(ids.iter().all(|id| *id == ids[0]), "{ids:?}");
    server.finished_run(&ids[0]).await;
    let runs = server.get_json("/runs").await;
    assert_eq!(runs["runs"].as_array().unwrap().len(), 2);

    // A streamed create retried with the same key attaches to the same run from sequence 1.
    let streamed = post(
        &server,
        "/runs/stream",
        &run_body("stream"),
        Some("stream-1"),
    )
    .await;
    let run_id = streamed.headers()["x-run-id"].to_str().unwrap().to_owned();
    let full = collect_frames(streamed).await;
    let retried = post(
        &server,
        "/runs/stream",
        &run_body("stream"),
        Some("stream-1"),
    )
    .await;
    assert_eq!(retried.headers()["x-run-id"], run_id.as_str());
    assert_eq!(collect_frames(retried).await, full);
    assert_eq!(full[0].id, "1");
    server.stop().await;
}

async fn a_busy_session_refuses_a_second_run(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    fake.push(
        Reply::sse(&text_stream(&["slow", " answer"]))
            .chunks_every(40)
            .delay(Duration::from_millis(40)),
    );
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let first = server.create_run(run_body("first")).await;
    let session = first["session_id"].as_str().unwrap();
    let mut second = run_body("second");
    second["session_id"] = json!(session);
    let busy = post(&server, "/runs", &second, None).await;
    assert_eq!(busy.status(), 409);
    let problem: Value = busy.json().await.unwrap();
    assert_eq!(problem["code"], "session_busy");
    assert_eq!(problem["run_id"], first["run_id"]);
    let delete = server
        .client
        .delete(server.url(&format!("/sessions/{session}")))
        .send()
        .await
        .unwrap();
    assert_eq!(delete.status(), 409);
    assert_eq!(
        delete.json::<Value>().await.unwrap()["code"],
        "session_busy"
    );

    server.finished_run(first["run_id"].as_str().unwrap()).await;
    let ok = post(&server, "/runs", &second, None).await;
    assert_eq!(ok.status(), 202);
    let second_id = ok.json::<Value>().await.unwrap()["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    server.finished_run(&second_id).await;

    let sessions = server.get_json("/sessions").await;
    assert_eq!(sessions["sessions"][0]["id"], session);
    assert_eq!(
        server.get_json(&format!("/sessions/{session}")).await["id"],
        session
    );
    let messages = server
        .get_json(&format!("/sessions/{session}/messages"))
        .await;
    let roles: Vec<&str> = messages["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, vec!["user", "assistant", "user", "assistant"]);
    assert_eq!(messages["messages"][1]["content"][0]["text"], "slow answer");
    let delete = server
        .client
        .delete(server.url(&format!("/sessions/{session}")))
        .send()
        .await
        .unwrap();
    assert_eq!(delete.status(), 204);
    let gone = server
        .client
        .get(server.url(&format!("/sessions/{session}")))
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status(), 404);
    let run_gone = server
        .client
        .get(server.url(&format!("/runs/{second_id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(run_gone.status(), 404);
    server.stop().await;
}

async fn a_doom_loop_ends_the_run_with_a_valid_history(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    for i in 0..3 {
        // Key order differs between calls: still the same call.
        let arguments = if i % 2 == 0 {
            json!({"city": "Paris", "unit": "c"})
        } else {
            json!({"unit": "c", "city": "Paris"})
        };
        fake.push(Reply::sse(&tool_call_stream(
            &format!("call_{i}"),
            "get_weather",
            &arguments,
        )));
    }
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let run_id = server.start_run("weather?", None).await;
    let frames = server.events(&run_id, None).await;
    let kinds: Vec<&str> = frames.iter().map(|f| f.event.as_str()).collect();
    assert_eq!(
        kinds.iter().filter(|k| **k == "doom_loop_detected").count(),
        1
    );
    assert_eq!(kinds.last(), Some(&"run_failed"));
    assert_eq!(frames.last().unwrap().json()["error_class"], "doom_loop");
    let doom = frames
        .iter()
        .find(|f| f.event == "doom_loop_detected")
        .unwrap()
        .json();
    assert!(
        doom["description"]
            .as_str()
            .unwrap()
            .contains("get_weather")
    );
    // The first two calls ran (an unknown tool is a Failure result the model sees).
    let failures: Vec<Value> = frames
        .iter()
        .filter(|f| f.event == "tool_execution_finished")
        .map(|f| f.json())
        .collect();
    assert_eq!(failures.len(), 2);
    assert!(
        failures[0]["result"]["Failure"]["error"]
            .as_str()
            .unwrap()
            .contains("get_weather")
    );
    assert_eq!(fake.requests().len(), 3);
    // The model saw the failure as a tool message answering its call.
    let second_request = &fake.requests()[1].body["messages"];
    assert_eq!(second_request[2]["role"], "tool");
    assert_eq!(second_request[2]["tool_call_id"], "call_0");
    // Every tool call in the session has its result.
    let run = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "failed");
    assert!(run["error"].as_str().unwrap().contains("doom loop"));
    let session = run["session_id"].as_str().unwrap();
    assert_every_call_answered(&server, session).await;
    server.stop().await;
}

async fn assert_every_call_answered(server: &TestServer, session: &str) {
    let messages = server
        .get_json(&format!("/sessions/{session}/messages"))
        .await;
    let messages = messages["messages"].as_array().unwrap();
    for message in messages {
        for call in message["tool_calls"].as_array().into_iter().flatten() {
            let answered = messages
                .iter()
                .filter(|m| m["tool_call_id"] == call["id"])
                .count();
            assert_eq!(answered, 1, "call {} has exactly one result", call["id"]);
        }
    }
}

async fn limits_on_iterations_are_enforced(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    for page in 0..5 {
        fake.push(Reply::sse(&tool_call_stream(
            &format!("call_{page}"),
            "read_page",
            &json!({"page": page}),
        )));
    }
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let mut body = run_body("read everything");
    body["max_iterations"] = json!(2);
    let created = server.create_run(body).await;
    let run_id = created["run_id"].as_str().unwrap();
    let run = server.finished_run(run_id).await;
    assert_eq!(run["status"], "failed");
    assert_eq!(run["max_iterations"], 2);
    assert!(
        run["error"]
            .as_str()
            .unwrap()
            .contains("max_iterations (2)"),
        "{run}"
    );
    let frames = server.events(run_id, None).await;
    assert_eq!(
        frames.last().unwrap().json()["error_class"],
        "limit_exceeded"
    );
    assert_eq!(
        fake.requests().len(),
        2,
        "different arguments are no doom loop"
    );
    assert_every_call_answered(&server, created["session_id"].as_str().unwrap()).await;
    for bad in [json!(0), json!(101)] {
        let mut body = run_body("x");
        body["max_iterations"] = bad;
        let response = post(&server, "/runs", &body, None).await;
        assert_eq!(response.status(), 422);
        assert_eq!(
            response.json::<Value>().await.unwrap()["field"],
            "max_iterations"
        );
    }
    let mut body = run_body("x");
    body["tools"] = json!(["no_such_tool"]);
    let response = post(&server, "/runs", &body, None).await;
    assert_eq!(
        response.json::<Value>().await.unwrap()["code"],
        "unknown_tool"
    );
    server.stop().await;
}

/// A Chat Completions stream whose one call has this argument text (not valid JSON).
fn malformed_call_stream(id: &str, name: &str, arguments: &str) -> Vec<u8> {
    use support::fake_openai::{DONE, chunk, usage_chunk};
    let mut body = chunk(json!({"role": "assistant", "content": null}), None);
    body.push_str(&chunk(
        json!({"tool_calls": [{"index": 0, "id": id, "type": "function",
                               "function": {"name": name, "arguments": arguments}}]}),
        None,
    ));
    body.push_str(&chunk(json!({}), Some("tool_calls")));
    body.push_str(&usage_chunk(20, 8, 0));
    body.push_str(DONE);
    body.into_bytes()
}

async fn polled_tools_are_allowed_and_invalid_repeats_are_a_doom_loop(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let config = config_with(
        &fake.base_url(),
        "[runtime.doom_loop]\nthreshold = 3\nallow = [\"check_status\"]\n",
    );
    let Some(server) = TestServer::start(backend, config).await else {
        return;
    };
    // An allowed tool polled 5 times with the same arguments: no doom loop.
    for i in 0..5 {
        fake.push(Reply::sse(&tool_call_stream(
            &format!("call_poll_{i}"),
            "check_status",
            &json!({"job": 7}),
        )));
    }
    fake.push(Reply::sse(&text_stream(&["The job is done."])));
    let run_id = server.start_run("wait for job 7", None).await;
    let run = server.finished_run(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["iterations"], 6);

    // The same invalid arguments three times: a doom loop; different ones would not be.
    for i in 0..3 {
        fake.push(Reply::sse(&malformed_call_stream(
            &format!("call_bad_{i}"),
            "get_weather",
            "{\"city\": \"Par",
        )));
    }
    let session = run["session_id"].as_str().unwrap();
    let run_id = server.start_run("weather?", Some(session)).await;
    let frames = server.events(&run_id, None).await;
    let last = frames.last().unwrap();
    assert_eq!(last.event, "run_failed");
    assert_eq!(last.json()["error_class"], "doom_loop");
    let doom = frames
        .iter()
        .find(|f| f.event == "doom_loop_detected")
        .unwrap()
        .json();
    assert!(
        doom["description"]
            .as_str()
            .unwrap()
            .contains("invalid arguments"),
        "{doom}"
    );
    assert_every_call_answered(&server, session).await;
    server.stop().await;
}

on_both_backends!(
    idempotent_creates_return_the_same_run,
    a_busy_session_refuses_a_second_run,
    a_doom_loop_ends_the_run_with_a_valid_history,
    limits_on_iterations_are_enforced,
    polled_tools_are_allowed_and_invalid_repeats_are_a_doom_loop,
);

#[tokio::test]
async fn doom_loop_detection_can_be_turned_off() {
    let fake = FakeOpenAi::start().await;
    for i in 0..3 {
        fake.push(Reply::sse(&tool_call_stream(
            &format!("call_{i}"),
            "ping",
            &json!({}),
        )));
    }
    fake.push(Reply::sse(&text_stream(&["done"])));
    let config = config_with(&fake.base_url(), "[runtime.doom_loop]\nenabled = false\n");
    let server = TestServer::start(Backend::Sqlite, config).await.unwrap();
    let run_id = server.start_run("ping thrice", None).await;
    let run = server.finished_run(&run_id).await;
    assert_eq!(run["status"], "completed");
    assert_eq!(run["iterations"], 4);
    server.stop().await;
}
