//! The event log contract over real SSE: exact resume at every position (header and query),
//! identical streams for concurrent watchers, slow watchers that lose nothing, 204 at the end,
//! and watchers that never cancel runs.

use crate::support;

use std::time::Duration;

use futures::StreamExt;
use serde_json::json;
use support::db::Backend;
use support::fake_openai::{FakeOpenAi, Reply, text_stream};
use support::server::{Cursor, Frame, TestServer, collect_frames, config_for, config_with};

/// A paced answer: `n` deltas, one SSE event per network write, `gap` apart.
fn paced(fake: &FakeOpenAi, n: usize, gap: Duration) {
    let deltas: Vec<String> = (0..n).map(|i| format!("tok{i} ")).collect();
    let refs: Vec<&str> = deltas.iter().map(String::as_str).collect();
    let body = text_stream(&refs);
    let text = std::str::from_utf8(&body).unwrap();
    let cuts: Vec<usize> = text
        .match_indices("\n\n")
        .map(|(i, _)| i + 2)
        .filter(|&i| i < body.len())
        .collect();
    fake.push(Reply::sse(&body).split_at(cuts).delay(gap));
}

fn assert_contiguous(frames: &[Frame]) {
    for (index, frame) in frames.iter().enumerate() {
        assert_eq!(frame.sequence(), index as u64 + 1, "contiguous sequences");
    }
    assert_eq!(
        frames
            .iter()
            .filter(|f| f.event.starts_with("run_") && f.event != "run_started")
            .count(),
        1
    );
}

async fn resume_at_every_position_reproduces_the_log(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&text_stream(&[
        "One",
        " two",
        " three",
        " — four",
        " 🌍",
    ])));
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let run_id = server.start_run("count", None).await;
    server.finished_run(&run_id).await;
    let full = server.events(&run_id, None).await;
    assert_contiguous(&full);
    assert!(full.len() >= 10);
    for k in 0..full.len() as u64 {
        for cursor in [Cursor::Header, Cursor::Query] {
            let resumed = server.events(&run_id, Some((k, cursor))).await;
            assert_eq!(
                resumed,
                full[k as usize..],
                "resume after {k} via {cursor:?}"
            );
        }
    }
    // At or past the terminal event: 204, which makes EventSource stop reconnecting.
    for k in [full.len() as u64, full.len() as u64 + 5] {
        for cursor in [Cursor::Header, Cursor::Query] {
            assert_eq!(server.watch(&run_id, Some((k, cursor))).await.status(), 204);
        }
    }
    // The header wins over the query (EventSource resends the original URL).
    let both = server
        .client
        .get(server.url(&format!("/runs/{run_id}/events?last_event_id=1")))
        .header("Last-Event-ID", "3")
        .send()
        .await
        .unwrap();
    assert_eq!(collect_frames(both).await, full[3..]);
    for bad in ["abc", "-1", "1.5"] {
        let response = server.watch_raw(&run_id, bad).await;
        assert_eq!(response.status(), 400, "cursor {bad}");
        let problem: serde_json::Value = response.json().await.unwrap();
        assert_eq!(problem["code"], "invalid_cursor");
    }
    server.stop().await;
}

async fn concurrent_watchers_receive_identical_streams(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    paced(&fake, 60, Duration::from_millis(5));
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let run_id = server.start_run("go", None).await;
    let mut watchers = Vec::new();
    for i in 0..20u64 {
        let client = server.client.clone();
        let url = server.url(&format!("/runs/{run_id}/events"));
        watchers.push(tokio::spawn(async move {
            // Joining at different moments of the live run.
            tokio::time::sleep(Duration::from_millis(i * 7)).await;
            collect_frames(client.get(url).send().await.unwrap()).await
        }));
    }
    let streams: Vec<Vec<Frame>> = futures::future::join_all(watchers)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let full = server.events(&run_id, None).await;
    assert_contiguous(&full);
    assert!(full.len() > 60);
    for (i, stream) in streams.iter().enumerate() {
        assert_eq!(*stream, full, "watcher {i}");
    }
    server.stop().await;
}

async fn stalled_watcher_catches_up_from_the_store(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    paced(&fake, 120, Duration::from_millis(1));
    // A live feed of 4 events: a watcher that does not read overflows it at once.
    let config = config_with(&fake.base_url(), "[runtime]\nfeed_capacity = 4\n");
    let Some(server) = TestServer::start(backend, config).await else {
        return;
    };
    let run_id = server.start_run("go", None).await;
    let id: behest::domain::RunId = run_id.parse().unwrap();
    // Subscribed now, not polled until the run is over.
    let stalled = server.runtime.watch(id, 0);
    let over_http = server.watch(&run_id, None).await;
    server.finished_run(&run_id).await;
    let full = server.events(&run_id, None).await;
    assert!(full.len() > 120);
    let caught_up: Vec<u64> = stalled.map(|e| e.unwrap().sequence).collect().await;
    assert_eq!(caught_up, (1..=full.len() as u64).collect::<Vec<_>>());
    assert_eq!(collect_frames(over_http).await, full);
    server.stop().await;
}

async fn stream_create_sends_from_sequence_one_and_disconnect_never_cancels(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    paced(&fake, 30, Duration::from_millis(10));
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let response = server
        .client
        .post(server.url("/runs/stream"))
        .json(&json!({"provider": "fake", "model": "fake-model", "input": "stream it"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let headers = response.headers().clone();
    assert_eq!(headers["content-type"], "text/event-stream");
    assert_eq!(headers["cache-control"], "no-cache");
    assert_eq!(headers["x-accel-buffering"], "no");
    assert!(headers.get("content-encoding").is_none());
    let run_id = headers["x-run-id"].to_str().unwrap().to_owned();
    let mut stream = eventsource_stream::Eventsource::eventsource(response.bytes_stream());
    let first = stream.next().await.unwrap().unwrap();
    assert_eq!(
        (first.id.as_str(), first.event.as_str()),
        ("1", "run_started")
    );
    drop(stream); // the client goes away mid-run
    let run = server.finished_run(&run_id).await;
    assert_eq!(
        run["status"], "completed",
        "a watcher disconnect never cancels the run"
    );
    let full = server.events(&run_id, None).await;
    assert_contiguous(&full);
    server.stop().await;
}

/// A cursor past the last event of a live run is `400 invalid_cursor` (events are published
/// only once stored, so no client received it; a stream from there would wait in silence and
/// never see the terminal event), in every format; a cursor inside the log resumes exactly.
async fn a_cursor_past_the_end_of_a_live_run_is_refused(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    paced(&fake, 20, Duration::from_millis(100));
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let run_id = server.start_run("go", None).await;
    for (format, cursor) in [("behest", "1000"), ("ai-sdk", "1000"), ("ag-ui", "1000.1")] {
        let response = server
            .client
            .get(server.url(&format!("/runs/{run_id}/events?format={format}")))
            .header("Last-Event-ID", cursor)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400, "{format} {cursor}");
        let problem: serde_json::Value = response.json().await.unwrap();
        assert_eq!(problem["code"], "invalid_cursor", "{problem}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(
            detail.contains(&format!("the cursor {cursor} is beyond")),
            "the cursor as sent: {problem}"
        );
    }
    // Sequence 5 exists once the run has logged it: until then it too is ahead (400).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let early = loop {
        let response = server
            .client
            .get(server.url(&format!("/runs/{run_id}/events")))
            .header("Last-Event-ID", "5")
            .send()
            .await
            .unwrap();
        if response.status() == 200 {
            break response;
        }
        assert_eq!(response.status(), 400);
        assert!(
            std::time::Instant::now() < deadline,
            "sequence 5 never logged"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let early = tokio::time::timeout(Duration::from_secs(10), collect_frames(early))
        .await
        .expect("the stream ends");
    let full = server.events(&run_id, None).await;
    assert_eq!(early, full[5..]);
    server.stop().await;
}

/// What `POST /runs/stream` sends live is, frame for frame and byte for byte, what a replay of
/// the stored log sends later; with a caller's `traceparent` too (its trace id is not the run's).
async fn the_created_stream_is_the_stored_log(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    paced(&fake, 30, Duration::from_millis(2));
    paced(&fake, 30, Duration::from_millis(2));
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    for traceparent in [
        None,
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    ] {
        let mut request = server
            .client
            .post(server.url("/runs/stream"))
            .json(&json!({"provider": "fake", "model": "fake-model", "input": "stream it"}));
        if let Some(traceparent) = traceparent {
            request = request.header("traceparent", traceparent);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 200);
        let run_id = response.headers()["x-run-id"].to_str().unwrap().to_owned();
        let live = collect_frames(response).await;
        assert_contiguous(&live);
        assert!(live.len() > 30);
        if traceparent.is_some() {
            assert_eq!(
                live[0].json()["trace_id"],
                "4bf92f3577b34da6a3ce929d0e0e4736"
            );
        }
        assert_eq!(server.events(&run_id, None).await, live, "{traceparent:?}");
        assert_eq!(
            server.events(&run_id, Some((7, Cursor::Header))).await,
            live[7..]
        );
    }
    server.stop().await;
}

on_both_backends!(
    the_created_stream_is_the_stored_log,
    a_cursor_past_the_end_of_a_live_run_is_refused,
    resume_at_every_position_reproduces_the_log,
    concurrent_watchers_receive_identical_streams,
    stalled_watcher_catches_up_from_the_store,
    stream_create_sends_from_sequence_one_and_disconnect_never_cancels,
);

#[tokio::test]
async fn keep_alive_comments_flow_while_the_model_is_silent() {
    let fake = FakeOpenAi::start().await;
    let partial = text_stream(&["Hel", "lo"]);
    fake.push(
        Reply::sse(&partial)
            .split_at(vec![300])
            .delay(Duration::from_millis(700)),
    );
    let config = config_with(&fake.base_url(), "[runtime]\nkeep_alive_ms = 100\n");
    let server = TestServer::start(Backend::Sqlite, config).await.unwrap();
    let run_id = server.start_run("wait", None).await;
    let response = server.watch(&run_id, None).await;
    let body = response.text().await.unwrap();
    assert!(
        body.lines().any(|line| line.starts_with(':')),
        "keep-alive comment lines: {body}"
    );
    assert!(body.contains("event: run_completed"));
    server.stop().await;
}
