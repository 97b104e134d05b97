//! `/snapshots`, retention and the drain of a graceful shutdown, on a real server over both
//! backends, against the fake OpenAI server speaking the real wire format.

use crate::support;

use std::future::IntoFuture;
use std::time::{Duration, Instant};

use behest::api::{AppState, app};
use behest::domain::RunId;
use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::{Value, json};
use support::db::Backend;
use support::fake_openai::{FakeOpenAi, Reply, text_stream, tool_calls_stream};
use support::server::{TERMINAL, TestServer, config_with};
use tokio_util::sync::CancellationToken;

/// `builtin_tools = ["current_time"]` and these `[runtime]` settings.
fn extra(runtime: &str) -> String {
    format!("builtin_tools = [\"current_time\"]\n[runtime]\n{runtime}\n")
}

async fn setup(backend: Backend, runtime: &str) -> Option<(FakeOpenAi, TestServer)> {
    let fake = FakeOpenAi::start().await;
    let server = TestServer::start(backend, config_with(&fake.base_url(), &extra(runtime))).await?;
    Some((fake, server))
}

/// A text answer that streams for several seconds, a small piece every 150 ms (never idle long
/// enough for the provider's idle timeout): the run stays active meanwhile.
fn slow_text() -> Reply {
    let words = vec!["word "; 40];
    Reply::sse(&text_stream(&words))
        .chunks_every(100)
        .delay(Duration::from_millis(150))
}

async fn send(server: &TestServer, method: reqwest::Method, path: &str) -> (u16, Value) {
    let response = server
        .client
        .request(method, server.url(path))
        .send()
        .await
        .expect("request");
    let status = response.status().as_u16();
    let body = response.json().await.unwrap_or(Value::Null);
    (status, body)
}

async fn problem(
    server: &TestServer,
    method: reqwest::Method,
    path: &str,
    status: u16,
    code: &str,
) {
    let (got, body) = send(server, method.clone(), path).await;
    assert_eq!(got, status, "{method} {path}: {body}");
    assert_eq!(body["code"], code, "{method} {path}: {body}");
}

/// Polls `check` every 100 ms until it is true; fails after `secs` seconds.
async fn eventually<F, Fut>(secs: u64, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !check().await {
        assert!(Instant::now() < deadline, "not within {secs} s: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The run's logged event types, read from the store.
async fn logged_types(server: &TestServer, run_id: &str) -> Vec<String> {
    let id: RunId = run_id.parse().unwrap();
    server
        .runtime
        .store()
        .read_events(id, 0, 10_000)
        .await
        .unwrap()
        .iter()
        .map(|event| event.event_type.clone())
        .collect()
}

async fn a_finished_tool_run_keeps_its_snapshot(backend: Backend) {
    let Some((fake, server)) = setup(backend, "").await else {
        return;
    };
    fake.push(Reply::sse(&tool_calls_stream(&[(
        "call_1",
        "current_time",
        json!({}),
    )])));
    fake.push(Reply::sse(&text_stream(&["It is ", "now."])));
    let run_id = server.start_run("What time is it?", None).await;
    let run = server.finished_run(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(run["iterations"], 2, "{run}");
    let frames = server.events(&run_id, None).await;
    let last = frames.last().unwrap();
    assert_eq!(last.event, "run_completed");

    let snapshot = server.get_json(&format!("/snapshots/{run_id}")).await;
    assert_eq!(snapshot["run_id"], run_id.as_str(), "{snapshot}");
    assert_eq!(snapshot["session_id"], run["session_id"], "{snapshot}");
    assert_eq!(snapshot["status"], "completed", "{snapshot}");
    assert_eq!(snapshot["iteration"], run["iterations"], "{snapshot}");
    assert_eq!(snapshot["total_usage"], run["total_usage"], "{snapshot}");
    assert_eq!(snapshot["tool_calls"], 1, "{snapshot}");
    assert_eq!(snapshot["last_sequence"], last.sequence(), "{snapshot}");
    assert!(snapshot["timestamp"].as_str().is_some(), "{snapshot}");
    server.stop().await;
}

async fn snapshots_list_by_session_and_status_with_cursors(backend: Backend) {
    // A byte budget of one record per page: `limit` alone does not end a page.
    let Some((fake, server)) = setup(backend, "max_page_bytes = 1").await else {
        return;
    };
    for _ in 0..3 {
        fake.push(Reply::sse(&text_stream(&["Hi."])));
    }
    let first = server.start_run("one", None).await;
    let first_run = server.finished_run(&first).await;
    let session = first_run["session_id"].as_str().unwrap().to_owned();
    let second = server.start_run("two", Some(&session)).await;
    server.finished_run(&second).await;
    let third = server.start_run("three", None).await;
    server.finished_run(&third).await;

    // Newest first, one per page (the byte budget), cursors continuing to the end.
    let mut seen = Vec::new();
    let mut path = "/snapshots?limit=200".to_owned();
    loop {
        let page = server.get_json(&path).await;
        let snapshots = page["snapshots"].as_array().unwrap();
        assert_eq!(snapshots.len(), 1, "{page}");
        seen.push(snapshots[0]["run_id"].as_str().unwrap().to_owned());
        match page["next_cursor"].as_str() {
            Some(cursor) => path = format!("/snapshots?limit=200&cursor={cursor}"),
            None => break,
        }
    }
    assert_eq!(seen, vec![third.clone(), second.clone(), first.clone()]);

    let ids = |page: &Value| -> Vec<String> {
        page["snapshots"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["run_id"].as_str().unwrap().to_owned())
            .collect()
    };
    let by_session = server
        .get_json(&format!("/snapshots?session_id={session}&limit=1"))
        .await;
    assert_eq!(ids(&by_session), vec![second.clone()]);
    let cursor = by_session["next_cursor"].as_str().unwrap();
    let rest = server
        .get_json(&format!("/snapshots?session_id={session}&cursor={cursor}"))
        .await;
    assert_eq!(ids(&rest), vec![first.clone()]);
    assert_eq!(rest["next_cursor"], Value::Null);

    let completed = server.get_json("/snapshots?status=completed&limit=2").await;
    assert_eq!(
        ids(&completed),
        vec![third.clone()],
        "the byte budget ends the page"
    );
    let failed = server.get_json("/snapshots?status=failed").await;
    assert_eq!(failed, json!({"snapshots": [], "next_cursor": null}));

    for (path, code) in [
        ("/snapshots?limit=0", "invalid_query"),
        ("/snapshots?limit=abc", "invalid_query"),
        ("/snapshots?status=running", "invalid_query"),
        ("/snapshots?session_id=nope", "invalid_query"),
        ("/snapshots?colour=red", "invalid_query"),
        ("/snapshots?cursor=garbage", "invalid_cursor"),
    ] {
        problem(&server, reqwest::Method::GET, path, 400, code).await;
    }
    server.stop().await;
}

async fn deleting_a_snapshot(backend: Backend) {
    let Some((fake, server)) = setup(backend, "").await else {
        return;
    };
    fake.push(Reply::sse(&text_stream(&["Done."])));
    fake.push(slow_text());
    let finished = server.start_run("quick", None).await;
    server.finished_run(&finished).await;
    let path = format!("/snapshots/{finished}");
    let (status, _) = send(&server, reqwest::Method::DELETE, &path).await;
    assert_eq!(status, 204);
    problem(
        &server,
        reqwest::Method::GET,
        &path,
        404,
        "snapshot_not_found",
    )
    .await;
    problem(
        &server,
        reqwest::Method::DELETE,
        &path,
        404,
        "snapshot_not_found",
    )
    .await;
    // Only the snapshot went: the run and its events stay.
    let run = server.get_json(&format!("/runs/{finished}")).await;
    assert_eq!(run["status"], "completed");
    assert!(
        logged_types(&server, &finished)
            .await
            .contains(&"run_completed".to_owned())
    );

    // An active run's snapshot is what resuming it needs: 409 until the run ends.
    let active = server.start_run("slow", None).await;
    let path = format!("/snapshots/{active}");
    eventually(10, "the active run's snapshot", || async {
        send(&server, reqwest::Method::GET, &path).await.0 == 200
    })
    .await;
    let (status, body) = send(&server, reqwest::Method::DELETE, &path).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["code"], "run_active", "{body}");
    assert_eq!(body["run_id"], active.as_str(), "{body}");
    let snapshot = server.get_json(&path).await;
    assert_eq!(snapshot["status"], "calling_model", "{snapshot}");
    let (status, _) = send(
        &server,
        reqwest::Method::POST,
        &format!("/runs/{active}/cancel?wait=true"),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(server.get_json(&path).await["status"], "cancelled");
    let (status, _) = send(&server, reqwest::Method::DELETE, &path).await;
    assert_eq!(status, 204);
    server.stop().await;
}

async fn retention_removes_finished_runs_events(backend: Backend) {
    // One run per batch: a sweep goes on batch after batch until none is left.
    let runtime = "event_retention_secs = 1\nretention_batch_runs = 1";
    let Some((fake, server)) = setup(backend, runtime).await else {
        return;
    };
    fake.push(Reply::sse(&text_stream(&["Kept ", "forever?"])));
    fake.push(Reply::sse(&text_stream(&["Me ", "too."])));
    let finished = server.start_run("remember me", None).await;
    let run = server.finished_run(&finished).await;
    let session = run["session_id"].as_str().unwrap().to_owned();
    let other = server.start_run("and me", None).await;
    server.finished_run(&other).await;
    fake.push(slow_text());
    let active = server.start_run("still going", None).await;
    let active_started = Instant::now();

    let events = format!("/runs/{finished}/events");
    eventually(15, "the finished run's events answer 410", || async {
        server.watch(&finished, None).await.status() == 410
    })
    .await;
    let response = server.watch(&finished, None).await;
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["code"], "run_events_expired", "{body}");
    assert_eq!(body["run_id"], finished.as_str(), "{body}");
    problem(
        &server,
        reqwest::Method::GET,
        &events,
        410,
        "run_events_expired",
    )
    .await;
    eventually(15, "the other finished run's events answer 410", || async {
        server.watch(&other, None).await.status() == 410
    })
    .await;
    problem(
        &server,
        reqwest::Method::GET,
        &format!("/snapshots/{finished}"),
        404,
        "snapshot_not_found",
    )
    .await;
    assert!(logged_types(&server, &finished).await.is_empty());
    // The run record, its session and messages stay.
    let run = server.get_json(&format!("/runs/{finished}")).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert!(run["events_removed_at"].as_str().is_some(), "{run}");
    let (status, _) = send(
        &server,
        reqwest::Method::GET,
        &format!("/sessions/{session}"),
    )
    .await;
    assert_eq!(status, 200);
    let messages = server
        .get_json(&format!("/sessions/{session}/messages"))
        .await;
    assert_eq!(
        messages["messages"].as_array().unwrap().len(),
        2,
        "{messages}"
    );
    let output = server.get_json(&format!("/runs/{finished}/output")).await;
    assert_eq!(output["status"], "completed", "{output}");

    // The active run has lived through more than one sweep past the retention period: its
    // events are all there.
    let lived = Duration::from_millis(2500);
    tokio::time::sleep(lived.saturating_sub(active_started.elapsed())).await;
    let record = server.get_json(&format!("/runs/{active}")).await;
    let status = record["status"].as_str().unwrap();
    assert!(
        !["completed", "failed", "cancelled"].contains(&status),
        "{record}"
    );
    assert!(record.get("events_removed_at").is_none(), "{record}");
    let types = logged_types(&server, &active).await;
    assert_eq!(types[0], "run_started", "{types:?}");
    assert!(types.contains(&"model_started".to_owned()), "{types:?}");
    assert_eq!(
        server.get_json(&format!("/snapshots/{active}")).await["status"],
        "calling_model"
    );
    send(
        &server,
        reqwest::Method::POST,
        &format!("/runs/{active}/cancel?wait=true"),
    )
    .await;
    server.stop().await;
}

async fn shutdown_drains_with_the_server_answering_503(backend: Backend) {
    let Some((fake, server)) = setup(backend, "").await else {
        return;
    };
    // The first model call streams a tool call slowly; the run would then call the model again.
    fake.push(
        Reply::sse(&tool_calls_stream(&[("call_1", "current_time", json!({}))]))
            .chunks_every(60)
            .delay(Duration::from_millis(150)),
    );
    fake.push(Reply::sse(&text_stream(&["Never asked."])));
    let run_id = server.start_run("What time is it?", None).await;
    // A second app over the same runtime, whose event streams end when the drain begins, as
    // `behest serve` wires it.
    let streams_end = CancellationToken::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let watch_url = format!(
        "http://{}/runs/{run_id}/events",
        listener.local_addr().unwrap()
    );
    let state = AppState::new(server.runtime.clone(), streams_end.clone());
    tokio::spawn(axum::serve(listener, app(state)).into_future());
    // Mid-stream: the model's answer has begun.
    let response = server.client.get(&watch_url).send().await.unwrap();
    let mut frames = response.bytes_stream().eventsource();
    while let Some(frame) = frames.next().await {
        if frame.unwrap().event == "tool_call_started" {
            break;
        }
    }

    let runtime = server.runtime.clone();
    let ends = streams_end.clone();
    let drain = tokio::spawn(async move {
        behest::server::drain(&runtime, &ends, Duration::from_secs(15)).await;
    });
    // The open stream ends at once, without a terminal event (the run has none to send: it
    // stays non-terminal; without the drain this watch would go on).
    let rest = tokio::time::timeout(Duration::from_secs(10), frames.collect::<Vec<_>>())
        .await
        .expect("the event stream ends when the drain begins");
    for frame in rest {
        let event = frame.expect("a clean end of the stream").event;
        assert!(!TERMINAL.contains(&event.as_str()), "{event}");
    }
    eventually(5, "/readyz answers 503", || async {
        send(&server, reqwest::Method::GET, "/readyz").await.0 == 503
    })
    .await;
    let (status, body) = send(&server, reqwest::Method::GET, "/readyz").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("shutting_down"))
    );
    for path in ["/runs", "/runs/stream"] {
        let response = server
            .client
            .post(server.url(path))
            .json(&json!({"provider": "fake", "model": "fake-model", "input": "one more"}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 503, "{path}");
        assert!(response.headers().contains_key("retry-after"), "{path}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["code"], "shutting_down", "{path}: {body}");
    }
    // A new watch would end at once, empty: it is told to reconnect elsewhere instead.
    let response = server
        .client
        .get(server.url(&format!("/runs/{run_id}/events")))
        .header("Last-Event-ID", "1")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    assert!(response.headers().contains_key("retry-after"));

    drain.await.unwrap();
    // Stopped at its boundary: left non-terminal and resumable, nothing terminal logged, the
    // next model call never made.
    let run = server.get_json(&format!("/runs/{run_id}")).await;
    let status = run["status"].as_str().unwrap();
    assert!(
        !["completed", "failed", "cancelled"].contains(&status),
        "{run}"
    );
    let types = logged_types(&server, &run_id).await;
    assert!(
        !types.iter().any(|t| TERMINAL.contains(&t.as_str())),
        "{types:?}"
    );
    assert_eq!(
        fake.requests().len(),
        1,
        "no model call after the drain began"
    );
    assert_eq!(
        server.get_json("/runs").await["runs"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    server.stop().await;
}

on_both_backends!(
    a_finished_tool_run_keeps_its_snapshot,
    snapshots_list_by_session_and_status_with_cursors,
    deleting_a_snapshot,
    retention_removes_finished_runs_events,
    shutdown_drains_with_the_server_answering_503,
);
