//! A run that kills its process cannot crash-loop the server (issue 27, item 1b): the real
//! `behest serve` binary is SIGKILLed every time it executes the run's model call, and
//! restarted on the same database, in a loop. Each restart takes the run over and resumes it,
//! until the run has been taken over `max_takeovers` (3) times without reaching a new
//! iteration: the next restart fails it (`run_failed`, error class `crash_loop`) instead of
//! resuming it, and the server stays up with the session usable. A shutdown's release is no
//! crash: a run suspended by SIGTERM is resumed however often that happens.

use crate::support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::db::{Backend, TestDb};
use support::fake_openai::{FakeOpenAi, Reply, text_stream};
use support::process::ServerProcess;
use support::validate::validate_openai_request;

fn config(base_url: &str) -> String {
    format!(
        "[runtime]\nlease_ttl_ms = 300\n\n\
         [providers.fake]\nkind = \"openai\"\nbase_url = \"{base_url}\"\n\
         [providers.fake.timeouts]\nconnect_ms = 2000\nfirst_byte_ms = 60000\nidle_ms = 60000\ntotal_ms = 120000\n\
         [providers.fake.retry]\nmax_attempts = 1\n\
         [providers.fake.models.fake-model]\ncontext_window = 128000\nmax_output_tokens = 1024\n"
    )
}

/// Waits until the fake provider has received `count` requests (the run's model call of the
/// `count`th process).
async fn requests_reach(fake: &FakeOpenAi, count: usize, server: &ServerProcess) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while fake.requests().len() < count {
        assert!(
            Instant::now() < deadline,
            "request {count} never came:\n{}",
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn terminal(server: &ServerProcess, run_id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let run = server.get_json(&format!("/runs/{run_id}")).await;
        if matches!(
            run["status"].as_str(),
            Some("completed" | "failed" | "cancelled")
        ) {
            return run;
        }
        assert!(Instant::now() < deadline, "the run never ended: {run}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn a_run_that_kills_its_process_is_failed_after_three_takeovers(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let fake = FakeOpenAi::start().await;
    let stalled = text_stream(&["Thinking", " hard"]);
    // Every process that executes the run gets a call that streams a little and then hangs:
    // the "crash" comes while the model call is in flight.
    for _ in 0..4 {
        fake.push(Reply::stall_after(&stalled[..stalled.len() / 2]));
    }
    let config = config(&fake.base_url());
    let mut server = ServerProcess::start("first", &config, &db.url).await;
    let (status, _, created) = server
        .post(
            "/runs",
            &json!({"provider": "fake", "model": "fake-model", "input": "think"}),
        )
        .await;
    assert_eq!(status, 202, "{created}");
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    let session_id = created["session_id"].as_str().unwrap().to_owned();
    let store = db.store().await;
    let run = behest::domain::RunId(uuid::Uuid::parse_str(&run_id).unwrap());
    for generation in 1..=4 {
        requests_reach(&fake, generation, &server).await;
        // The request goes out while its announcing events are written: wait for them, so
        // that each process dies with its takeover logged.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let events = store.read_events(run, 0, 1000).await.unwrap();
            let resumed = events
                .iter()
                .filter(|e| e.event_type == "run_resumed")
                .count();
            let started = events
                .iter()
                .filter(|e| e.event_type == "model_started")
                .count();
            if resumed + 1 >= generation && started >= generation {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "generation {generation}: {}",
                events.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        server.kill().await;
        server = ServerProcess::start(&format!("restart {generation}"), &config, &db.url).await;
    }
    // Takeovers 1 to 3 resumed the run (requests 2 to 4); the 4th fails it without a request.
    let run = terminal(&server, &run_id).await;
    assert_eq!(run["status"], "failed", "{run}");
    assert_eq!(run["error_class"], "crash_loop", "{run}");
    assert!(
        run["error"].as_str().unwrap().contains("max_takeovers"),
        "{run}"
    );
    assert_eq!(fake.requests().len(), 4, "no fifth model call");
    let (status, events) = {
        let response = server
            .client
            .get(server.url(&format!("/runs/{run_id}/events")))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    };
    assert_eq!(status, 200);
    assert_eq!(events.matches("event: run_resumed").count(), 3, "{events}");
    assert!(
        events.contains("\"error_class\":\"crash_loop\""),
        "{events}"
    );
    assert_eq!(server.get("/healthz").await.0, 200);
    // The session goes on: its next request is valid.
    fake.push(Reply::sse(&text_stream(&["Back."])));
    let (status, _, next) = server
        .post(
            "/runs",
            &json!({"provider": "fake", "model": "fake-model", "input": "again",
                    "session_id": session_id}),
        )
        .await;
    assert_eq!(status, 202, "{next}");
    let next = terminal(&server, next["run_id"].as_str().unwrap()).await;
    assert_eq!(next["status"], "completed", "{next}");
    for request in fake.requests() {
        let problems = validate_openai_request(&request.body);
        assert!(problems.is_empty(), "{problems:?}");
    }
    db.assert_logs_fold().await;
}

/// SIGTERM releases the run's lease: the next start resumes it without counting a takeover,
/// however many times a deploy stops the server in the middle of the same model call.
async fn a_run_suspended_by_shutdowns_is_always_resumed(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let fake = FakeOpenAi::start().await;
    let stalled = text_stream(&["Slow", " answer"]);
    for _ in 0..5 {
        fake.push(Reply::stall_after(&stalled[..stalled.len() / 2]));
    }
    fake.push(Reply::sse(&stalled));
    let config = format!("{}\n", config(&fake.base_url())).replace(
        "lease_ttl_ms = 300",
        "lease_ttl_ms = 300\nshutdown_grace_ms = 100",
    );
    let mut server = ServerProcess::start("first", &config, &db.url).await;
    let (status, _, created) = server
        .post(
            "/runs",
            &json!({"provider": "fake", "model": "fake-model", "input": "slowly"}),
        )
        .await;
    assert_eq!(status, 202, "{created}");
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    for generation in 1..=5 {
        requests_reach(&fake, generation, &server).await;
        server.terminate().await;
        assert!(
            server.wait_exit(Duration::from_secs(20)).await.is_some(),
            "SIGTERM stops the server"
        );
        server = ServerProcess::start(&format!("restart {generation}"), &config, &db.url).await;
    }
    let run = terminal(&server, &run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    db.assert_logs_fold().await;
}

on_both_backends!(
    a_run_that_kills_its_process_is_failed_after_three_takeovers,
    a_run_suspended_by_shutdowns_is_always_resumed,
);
