//! Operators see what matters (issue 27, item 9): `/metrics` of the real `behest serve` binary
//! (its own recorder, so the figures are this test's alone), scraped after a completed, a
//! failed and a cancelled run and after runs that wait in `requires_action` and are answered,
//! cancelled or expire, on both backends: run duration by status, the waiting gauge, wait time
//! by outcome, expired waits, the error class of finished runs, a cut model call, the
//! process's resident memory and open file descriptors, and `behest_build_info`. A model call
//! a shutdown cuts is counted as `interrupted` (in process, under a model name of its own).

use crate::support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::db::{Backend, TestDb};
use support::fake_openai::{FakeOpenAi, Reply, chunk, text_stream, tool_calls_stream};
use support::process::{ServerProcess, ToolServer, config_toml};
use support::server::TestServer;

async fn scrape(server: &ServerProcess) -> prometheus_parse::Scrape {
    let text = server.get_text("/metrics").await;
    prometheus_parse::Scrape::parse(text.lines().map(|line| Ok(line.to_owned()))).unwrap()
}

/// The sum of the samples `name` whose labels include `labels` (a histogram's `_count`).
fn value(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for sample in scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
    {
        let v = match &sample.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => *v,
            prometheus_parse::Value::Histogram(buckets) => {
                buckets.iter().map(|b| b.count).fold(0.0, f64::max)
            }
            prometheus_parse::Value::Summary(_) => panic!("{name} is a summary"),
        };
        found = Some(found.unwrap_or(0.0) + v);
    }
    found
}

fn count(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    value(scrape, name, labels).unwrap_or(0.0)
}

/// Polls the run until its status is one of `statuses` (at most 20 s); returns the record.
async fn until(server: &ServerProcess, run_id: &str, statuses: &[&str]) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let run = server.get_json(&format!("/runs/{run_id}")).await;
        if statuses.iter().any(|s| run["status"] == *s) {
            return run;
        }
        assert!(Instant::now() < deadline, "never {statuses:?}: {run}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn start(server: &ServerProcess, body: Value) -> String {
    let (status, _, created) = server.post("/runs", &body).await;
    assert_eq!(status, 202, "{created}");
    created["run_id"].as_str().unwrap().to_owned()
}

fn client_run(input: &str, extra: &[(&str, Value)]) -> Value {
    let mut body = json!({"provider": "fake", "model": "fake-model", "input": input,
        "tools": [{"name": "get_location", "description": "Where the user is."}]});
    for (key, value) in extra {
        body[*key] = value.clone();
    }
    body
}

fn location_call() -> Reply {
    Reply::sse(&tool_calls_stream(&[(
        "call_loc",
        "get_location",
        json!({}),
    )]))
}

async fn metrics_after_every_kind_of_end(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let fake = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    let server = ServerProcess::start(
        "operators",
        &config_toml(&fake.base_url(), &tools, ""),
        &db.url,
    )
    .await;
    let before = scrape(&server).await;
    // Process metrics and the build are there from the first scrape.
    let resident = count(&before, "process_resident_memory_bytes", &[]);
    assert!(resident > 1_000_000.0, "resident memory {resident}");
    assert!(count(&before, "process_open_fds", &[]) >= 3.0);
    assert!(count(&before, "process_max_fds", &[]) >= 3.0);
    assert_eq!(
        value(
            &before,
            "behest_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        Some(1.0)
    );
    assert_eq!(count(&before, "behest_runs_waiting", &[]), 0.0);

    // Completed.
    fake.push(Reply::sse(&text_stream(&["Hello", " there."])));
    let completed = start(&server, client_run("hi", &[])).await;
    until(&server, &completed, &["completed"]).await;

    // Failed: the provider refuses the request.
    fake.push(Reply::status(
        400,
        json!({"error": {"message": "bad request", "type": "invalid_request_error"}}),
    ));
    let failed = start(&server, client_run("fail", &[])).await;
    let run = until(&server, &failed, &["failed"]).await;
    assert_eq!(run["error_class"], "invalid_request", "{run}");

    // Cancelled in the middle of a model call that streamed some text.
    let partial = format!(
        "{}{}",
        chunk(json!({"role": "assistant", "content": "Counting: 1"}), None),
        chunk(json!({"content": ", 2"}), None)
    );
    fake.push(Reply::stall_after(partial.as_bytes()));
    let cut = start(&server, client_run("count", &[])).await;
    until(&server, &cut, &["calling_model"]).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while fake.requests().len() < 3 {
        assert!(Instant::now() < deadline, "the third model call never came");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, _) = server.post_empty(&format!("/runs/{cut}/cancel")).await;
    assert!(status < 300, "cancel: {status}");
    until(&server, &cut, &["cancelled"]).await;

    // Waits: answered, cancelled, expired. The gauge counts the waiting run.
    fake.push(location_call());
    fake.push(Reply::sse(&text_stream(&["You are home."])));
    let answered = start(&server, client_run("where am I?", &[])).await;
    until(&server, &answered, &["requires_action"]).await;
    assert_eq!(
        count(&scrape(&server).await, "behest_runs_waiting", &[]),
        1.0
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, _, body) = server
        .post(
            &format!("/runs/{answered}/tool_outputs"),
            &json!({"tool_outputs": [{"call_id": "call_loc", "output": "home"}]}),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    until(&server, &answered, &["completed"]).await;

    fake.push(location_call());
    let dropped = start(&server, client_run("where?", &[])).await;
    until(&server, &dropped, &["requires_action"]).await;
    let (status, _) = server.post_empty(&format!("/runs/{dropped}/cancel")).await;
    assert!(status < 300, "cancel: {status}");
    until(&server, &dropped, &["cancelled"]).await;

    fake.push(location_call());
    let expired = start(
        &server,
        client_run("where, quickly?", &[("action_timeout_ms", json!(1000))]),
    )
    .await;
    let run = until(&server, &expired, &["failed"]).await;
    assert_eq!(run["error_class"], "action_expired", "{run}");

    let after = scrape(&server).await;
    let duration = |status| count(&after, "behest_run_duration_seconds", &[("status", status)]);
    assert_eq!(
        (
            duration("completed"),
            duration("failed"),
            duration("cancelled")
        ),
        (2.0, 2.0, 2.0)
    );
    // The expired run lived at least its second of waiting: of the two failed runs, only the
    // refused one is in the buckets below 1 s.
    let fast_failed: f64 = after
        .samples
        .iter()
        .filter(|s| s.metric == "behest_run_duration_seconds")
        .filter(|s| s.labels.get("status") == Some("failed"))
        .map(|s| match &s.value {
            prometheus_parse::Value::Histogram(buckets) => buckets
                .iter()
                .filter(|b| b.less_than < 1.0)
                .map(|b| b.count)
                .fold(0.0, f64::max),
            _ => panic!("behest_run_duration_seconds is a histogram"),
        })
        .sum();
    assert_eq!(fast_failed, 1.0, "failed runs faster than 1 s");
    let wait = |outcome| count(&after, "behest_run_wait_seconds", &[("outcome", outcome)]);
    assert_eq!(
        (wait("answered"), wait("cancelled"), wait("expired")),
        (1.0, 1.0, 1.0)
    );
    assert_eq!(count(&after, "behest_run_waits_expired_total", &[]), 1.0);
    assert_eq!(count(&after, "behest_runs_waiting", &[]), 0.0);
    let finished = |labels: &[(&str, &str)]| count(&after, "behest_runs_finished_total", labels);
    assert_eq!(
        finished(&[("status", "failed"), ("error_class", "action_expired")]),
        1.0
    );
    assert_eq!(
        finished(&[("status", "failed"), ("error_class", "invalid_request")]),
        1.0
    );
    assert_eq!(finished(&[("status", "completed")]), 2.0);
    assert_eq!(finished(&[("status", "cancelled")]), 2.0);
    let calls = |outcome| {
        count(
            &after,
            "behest_model_calls_total",
            &[("model", "fake-model"), ("outcome", outcome)],
        )
    };
    assert_eq!(
        (calls("ok"), calls("invalid_request"), calls("cancelled")),
        (5.0, 1.0, 1.0),
        "model calls by outcome"
    );
    let fds = count(&after, "process_open_fds", &[]);
    assert!(fds >= 3.0, "open fds {fds}");
    server.terminate().await;
    db.cleanup().await;
}

/// A model call cut by a shutdown is counted as `interrupted` (the run stays resumable).
async fn a_call_cut_by_a_shutdown_is_interrupted(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    // A model name no other test uses: the recorder is shared by the tests of this process.
    let model = format!("interrupt-{backend:?}").to_ascii_lowercase();
    // Long stream deadlines: the shutdown, not a timeout, cuts the call.
    let config = behest::config::Config::from_toml(&format!(
        "[providers.fake]\nkind = \"openai\"\nbase_url = \"{}\"\n\
         [providers.fake.timeouts]\nconnect_ms = 2000\nfirst_byte_ms = 60000\nidle_ms = 60000\ntotal_ms = 120000\n\
         [providers.fake.retry]\nmax_attempts = 1\n\
         [providers.fake.models.{model}]\ncontext_window = 128000\nmax_output_tokens = 1024\n",
        fake.base_url()
    ))
    .unwrap();
    let Some(server) = TestServer::start(backend, config).await else {
        return;
    };
    let handle = behest::telemetry::metrics::install().expect("the recorder");
    let interrupted = |text: &str| {
        text.lines()
            .filter(|l| l.starts_with("behest_model_calls_total{"))
            .filter(|l| l.contains(&format!("model=\"{model}\"")))
            .filter(|l| l.contains("outcome=\"interrupted\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    fake.push(Reply::stall_after(
        chunk(json!({"role": "assistant", "content": "Once upon"}), None).as_bytes(),
    ));
    let created = server
        .create_run(json!({"provider": "fake", "model": model, "input": "a story"}))
        .await;
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    let deadline = Instant::now() + Duration::from_secs(10);
    while fake.requests().is_empty() {
        assert!(Instant::now() < deadline, "no model call");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(interrupted(&handle.render()), 0.0);
    server.stop().await;
    assert_eq!(
        interrupted(&handle.render()),
        1.0,
        "run {run_id}: the cut call is counted once"
    );
}

on_both_backends!(
    metrics_after_every_kind_of_end,
    a_call_cut_by_a_shutdown_is_interrupted,
    resumed_runs_are_active_and_methods_are_bounded
);

/// The built-in model, one token every `token_delay_ms`.
fn scripted(token_delay_ms: u64) -> String {
    format!(
        "[providers.demo]\nkind = \"scripted\"\ntoken_delay_ms = {token_delay_ms}\n\
         [providers.demo.models.demo]\ncontext_window = 32768\nmax_output_tokens = 4096\n"
    )
}

/// A run resumed after a `kill -9` counts in `behest_runs_active` while it executes, and the
/// gauge is back at 0 (not below) once it ends; a made-up method name is counted under
/// `method="other"`, never as a series of its own.
async fn resumed_runs_are_active_and_methods_are_bounded(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let config = scripted(20);
    let mut first = ServerProcess::start("active-1", &config, &db.url).await;
    let run_id = start(
        &first,
        json!({"provider": "demo", "model": "demo", "input": "count to 150"}),
    )
    .await;
    until(&first, &run_id, &["calling_model"]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.kill().await;

    let second = ServerProcess::start("active-2", &config, &db.url).await;
    // Taken over at once on SQLite, after the dead process's lease on PostgreSQL.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let active = count(&scrape(&second).await, "behest_runs_active", &[]);
        if active == 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the resumed run is never active ({active})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    until(&second, &run_id, &["completed"]).await;
    // The gauge is decremented after the run's end is written: wait for it.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let active = count(&scrape(&second).await, "behest_runs_active", &[]);
        if active == 0.0 {
            break;
        }
        assert!(active > 0.0, "behest_runs_active fell to {active}");
        assert!(
            Instant::now() < deadline,
            "behest_runs_active stays {active}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A made-up method, sent raw (no HTTP client sends one).
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for method in ["XQJFOO", "XQJBAR"] {
        let mut socket = tokio::net::TcpStream::connect(second.addr).await.unwrap();
        let request = format!("{method} /runs HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        socket.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        socket.read_to_end(&mut answer).await.unwrap();
        assert!(
            answer.starts_with(b"HTTP/1.1 405"),
            "{}",
            String::from_utf8_lossy(&answer)
        );
    }
    let after = scrape(&second).await;
    assert!(
        !after
            .samples
            .iter()
            .any(|s| s.labels.get("method").is_some_and(|m| m.starts_with("XQJ"))),
        "no series per made-up method"
    );
    assert!(count(&after, "behest_http_requests_total", &[("method", "other")]) >= 2.0);
}
