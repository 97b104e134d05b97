//! The built-in model (`kind = "scripted"`) over HTTP, through the real run loop and event log:
//! a script file replayed turn by turn (text, a tool call answered by the built-in tool, an
//! error before any output, an error mid-stream), the built-in replies (a `call …` request,
//! `count to N`, pacing that leaves time to cancel), and `GET /providers`.

use crate::support;

use std::time::{Duration, Instant};

use behest::config::Config;
use serde_json::{Value, json};
use support::db::Backend;
use support::server::{Frame, TestServer};

fn config(script: Option<&std::path::Path>, token_delay_ms: u64) -> Config {
    let script = script.map_or(String::new(), |path| {
        format!("script = \"{}\"\n", path.display())
    });
    Config::from_toml(&format!(
        "builtin_tools = [\"current_time\"]\n\
         [providers.s]\nkind = \"scripted\"\ntoken_delay_ms = {token_delay_ms}\n{script}\
         [providers.s.retry]\nmax_attempts = 1\n\
         [providers.s.models.m]\ncontext_window = 1000\nmax_output_tokens = 500\n"
    ))
    .expect("config")
}

fn texts(frames: &[Frame]) -> String {
    frames
        .iter()
        .filter(|f| f.event == "text_delta")
        .map(|f| f.json()["delta"].as_str().unwrap().to_owned())
        .collect()
}

async fn run(server: &TestServer, input: &str, session: Option<&str>) -> (String, Vec<Frame>) {
    let mut body = json!({"provider": "s", "model": "m", "input": input});
    if let Some(session) = session {
        body["session_id"] = Value::from(session);
    }
    let created = server.create_run(body).await;
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    server.finished_run(&run_id).await;
    let frames = server.events(&run_id, None).await;
    (created["session_id"].as_str().unwrap().to_owned(), frames)
}

async fn a_script_replays_text_tool_calls_and_errors(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("turns.json");
    std::fs::write(
        &path,
        json!({"turns": [
            {"text": "Let me check.", "tool_calls": [{"name": "current_time"}]},
            {"text": "It is late."},
            {"delay_ms": 10, "error": {"class": "overloaded", "message": "scripted overload"}},
            {"text": "Partial answer", "error": {"class": "server", "message": "cut mid-stream"}}
        ]})
        .to_string(),
    )
    .unwrap();
    let Some(server) = TestServer::start(backend, config(Some(&path), 1)).await else {
        return;
    };

    let (session, frames) = run(&server, "anything", None).await;
    let types: Vec<&str> = frames.iter().map(|f| f.event.as_str()).collect();
    assert_eq!(texts(&frames), "Let me check.It is late.");
    let completed = frames
        .iter()
        .find(|f| f.event == "tool_call_completed")
        .unwrap()
        .json();
    assert_eq!(completed["call"]["name"], "current_time");
    assert_eq!(completed["call"]["arguments"], json!({}));
    let finished = frames
        .iter()
        .find(|f| f.event == "tool_execution_finished")
        .unwrap()
        .json();
    assert!(
        finished["result"]["Success"]["output"]["utc"].is_string(),
        "{finished}"
    );
    assert_eq!(types.last(), Some(&"run_completed"));
    assert_eq!(types.iter().filter(|t| **t == "usage_recorded").count(), 2);
    let usage = frames
        .iter()
        .find(|f| f.event == "usage_recorded")
        .unwrap()
        .json();
    // "anything" is one word in; three text tokens and one call out.
    assert_eq!(
        usage["usage"],
        json!({"input_tokens": 1, "output_tokens": 4, "total_tokens": 5,
               "reasoning_tokens": 0, "estimated": false})
    );

    let (_, frames) = run(&server, "again", Some(&session)).await;
    let failed = frames.last().unwrap().json();
    assert_eq!(failed["type"], "run_failed");
    assert_eq!(failed["error_class"], "overloaded");
    assert!(
        failed["error"]
            .as_str()
            .unwrap()
            .contains("scripted overload")
    );
    assert!(!frames.iter().any(|f| f.event == "text_delta"));

    let (_, frames) = run(&server, "and again", Some(&session)).await;
    assert_eq!(texts(&frames), "Partial answer");
    let failed = frames.last().unwrap().json();
    assert_eq!(failed["error_class"], "server");

    // After the last turn the script starts over.
    let (_, frames) = run(&server, "once more", Some(&session)).await;
    assert_eq!(texts(&frames), "Let me check.It is late.");
    server.stop().await;
}

async fn built_in_replies_call_tools_count_and_can_be_cancelled(backend: Backend) {
    let Some(server) = TestServer::start(backend, config(None, 20)).await else {
        return;
    };
    let (session, frames) = run(&server, "please call current_time {} now", None).await;
    let answer = texts(&frames);
    assert!(
        answer.starts_with("`current_time` answered {") && answer.ends_with("}."),
        "{answer}"
    );

    // A bad argument object is the call's invalid_arguments; the model sees the failure.
    let (_, frames) = run(&server, "call current_time {oops", Some(&session)).await;
    let completed = frames
        .iter()
        .find(|f| f.event == "tool_call_completed")
        .unwrap()
        .json();
    assert_eq!(completed["call"]["invalid_arguments"], "{oops");
    assert!(frames.iter().any(|f| f.event == "run_completed"));

    let (_, frames) = run(&server, "count to 5", Some(&session)).await;
    assert_eq!(texts(&frames), "1 2 3 4 5.");

    // 20 ms a token: 300 numbers take 6 s; cancel after the first ones.
    let created = server
        .create_run(
            json!({"provider": "s", "model": "m", "input": "count to 300",
                           "session_id": session}),
        )
        .await;
    let run_id = created["run_id"].as_str().unwrap();
    let started = Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let cancelled = server
        .client
        .post(server.url(&format!("/runs/{run_id}/cancel?wait=true")))
        .send()
        .await
        .unwrap();
    assert_eq!(cancelled.status(), 200);
    assert!(started.elapsed() < Duration::from_secs(3));
    let frames = server.events(run_id, None).await;
    assert_eq!(frames.last().unwrap().event, "run_cancelled");
    let partial = texts(&frames);
    assert!(
        partial.starts_with("1 2 3") && !partial.contains("300."),
        "{partial}"
    );

    let providers = server.get_json("/providers").await;
    assert_eq!(
        providers,
        json!({"providers": [{"id": "s", "kind": "scripted", "models": [
            {"name": "m", "context_window": 1000, "max_output_tokens": 500}]}]})
    );
    server.stop().await;
}

on_both_backends!(
    a_script_replays_text_tool_calls_and_errors,
    built_in_replies_call_tools_count_and_can_be_cancelled,
);

#[test]
fn a_bad_script_stops_startup_with_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("turns.toml");
    std::fs::write(&path, "[[turns]]\ntext = \"hi\"\nbogus = 1\n").unwrap();
    let config = config(Some(&path), 0);
    let error = behest::provider::build("s", &config.providers["s"])
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        error.contains("turns.toml") && error.contains("bogus"),
        "{error}"
    );
}

#[test]
fn the_shipped_script_example_loads() {
    let config = Config::from_toml(include_str!("../../examples/scripted.toml")).expect("config");
    let provider = &config.providers["script"];
    assert!(behest::provider::build("script", provider).is_ok());
    assert_eq!(config.builtin_tools, vec!["current_time".to_owned()]);
}
