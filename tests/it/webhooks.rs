//! Issue 26 item 3: webhooks. A real HTTP receiver on 127.0.0.1 that answers 500, then sleeps
//! past the timeout, then 200 gets one delivery three times with the same `webhook-id`, each
//! signed (checked here with HMAC-SHA256 computed independently); a client-tool run is
//! delivered when it starts waiting and when it ends; private addresses, hosts not allowed and
//! a server without a secret are refused at create; a run without a webhook writes nothing to
//! the outbox, and one with `"webhook": null` has none, not even the preset's or the server's. Across a restart: the real `behest serve` binary ends a run while the receiver
//! is down, is killed, restarts, and the receiver brought up then gets the delivery; an attempt
//! cut by a kill in the middle is listed as `interrupted` before the next. On both store
//! backends.

use crate::support;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use base64::Engine;
use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::Sha256;
use support::db::{Backend, TestDb};
use support::process::ServerProcess;
use support::server::TestServer;

/// 32 key bytes, Standard Webhooks form.
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSwMfKQ9r8GKYo=";

const DEMO: &str = "[providers.demo]\nkind = \"scripted\"\ntoken_delay_ms = 1\n\
                    [providers.demo.models.demo]\ncontext_window = 32768\nmax_output_tokens = 4096\n";

/// What the receiver does with the next request.
#[derive(Debug, Clone, Copy)]
enum Answer {
    Status(u16),
    /// Sleeps this long, then answers 200 (past the server's timeout: the attempt failed).
    Sleep(Duration),
}

#[derive(Debug, Clone)]
struct Received {
    headers: HeaderMap,
    body: Bytes,
}

#[derive(Default)]
struct ReceiverState {
    script: Mutex<VecDeque<Answer>>,
    received: Mutex<Vec<Received>>,
}

/// A webhook receiver: answers from its script, then 200.
struct Receiver {
    addr: SocketAddr,
    state: Arc<ReceiverState>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    async fn start(script: &[Answer]) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::on(listener, script)
    }

    fn on(listener: tokio::net::TcpListener, script: &[Answer]) -> Self {
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(ReceiverState::default());
        state.script.lock().unwrap().extend(script.iter().copied());
        let app = axum::Router::new()
            .route("/hook", axum::routing::post(receive))
            .with_state(state.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { addr, state, task }
    }

    fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    fn received(&self) -> Vec<Received> {
        self.state.received.lock().unwrap().clone()
    }

    async fn wait_for(&self, count: usize) -> Vec<Received> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let received = self.received();
            if received.len() >= count {
                return received;
            }
            assert!(
                Instant::now() < deadline,
                "the receiver got {} of {count} requests",
                received.len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn receive(
    State(state): State<Arc<ReceiverState>>,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    state
        .received
        .lock()
        .unwrap()
        .push(Received { headers, body });
    let answer = state.script.lock().unwrap().pop_front();
    match answer {
        None => StatusCode::OK,
        Some(Answer::Status(code)) => StatusCode::from_u16(code).unwrap(),
        Some(Answer::Sleep(pause)) => {
            tokio::time::sleep(pause).await;
            StatusCode::OK
        }
    }
}

/// Checks a request the way a receiver following Standard Webhooks does; returns its
/// `webhook-id` and the parsed body.
fn verify(request: &Received) -> (String, Value) {
    let header = |name: &str| {
        request
            .headers
            .get(name)
            .unwrap_or_else(|| panic!("{name} header"))
            .to_str()
            .unwrap()
            .to_owned()
    };
    let id = header("webhook-id");
    let timestamp = header("webhook-timestamp");
    let signature = header("webhook-signature");
    let sent: i64 = timestamp.parse().unwrap();
    let now = chrono::Utc::now().timestamp();
    assert!(
        (now - sent).abs() < 300,
        "timestamp {sent} is near now {now}"
    );
    assert_eq!(
        request.headers.get("content-type").unwrap(),
        "application/json"
    );
    let key = base64::engine::general_purpose::STANDARD
        .decode(SECRET.strip_prefix("whsec_").unwrap())
        .unwrap();
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(&request.body);
    let expected = format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
    );
    assert!(
        signature.split(' ').any(|s| s == expected),
        "signature {signature} is {expected}"
    );
    (id, serde_json::from_slice(&request.body).unwrap())
}

fn config(extra_webhooks: &str) -> behest::config::Config {
    behest::config::Config::from_toml(&format!(
        "[webhooks]\nsecret = \"{SECRET}\"\n{extra_webhooks}\n\n{DEMO}"
    ))
    .unwrap()
}

async fn wait_terminal(server: &TestServer, run_id: &str) -> Value {
    wait_run(server, run_id, |run| {
        matches!(
            run["status"].as_str(),
            Some("completed" | "failed" | "cancelled")
        )
    })
    .await
}

async fn wait_run(server: &TestServer, run_id: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let run: Value = server
            .client
            .get(server.url(&format!("/runs/{run_id}")))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if done(&run) {
            return run;
        }
        assert!(Instant::now() < deadline, "run {run_id}: {run}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn deliveries(client: &reqwest::Client, url: String) -> Value {
    let response = client.get(url).send().await.unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

/// Polls the run's deliveries until `done` holds.
async fn wait_deliveries(
    client: &reqwest::Client,
    url: String,
    done: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let list = deliveries(client, url.clone()).await["deliveries"]
            .as_array()
            .unwrap()
            .clone();
        if done(&list) {
            return list;
        }
        assert!(Instant::now() < deadline, "deliveries: {list:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn a_receiver_that_fails_then_times_out_then_accepts(backend: Backend) {
    let receiver = Receiver::start(&[
        Answer::Status(500),
        Answer::Sleep(Duration::from_millis(1500)),
    ])
    .await;
    let config = config(
        "allow_private_addresses = true\ntimeout_ms = 500\nschedule_ms = [0, 100, 100, 100]",
    );
    let Some(server) = TestServer::start(backend, config).await else {
        return;
    };
    let created = server
        .create_run(json!({
            "provider": "demo", "model": "demo", "input": "hello",
            "webhook": {"url": receiver.url()}
        }))
        .await;
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    let run = wait_terminal(&server, &run_id).await;
    assert_eq!(run["webhook"]["url"], receiver.url(), "{run}");
    let url = server.url(&format!("/runs/{run_id}/webhook-deliveries"));
    let list = wait_deliveries(&server.client, url.clone(), |list| {
        list.first().is_some_and(|d| d["status"] == "delivered")
    })
    .await;
    assert_eq!(list.len(), 1, "one delivery: {list:?}");
    let delivery = &list[0];
    assert_eq!(delivery["event_type"], "run.completed");
    assert_eq!(delivery["url"], receiver.url());
    let attempts = delivery["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 3, "{attempts:?}");
    assert_eq!(attempts[0]["status_code"], 500);
    assert_eq!(attempts[0]["outcome"], "retry");
    assert_eq!(
        attempts[1]["status_code"],
        Value::Null,
        "a timeout has no status"
    );
    assert_eq!(attempts[1]["outcome"], "retry");
    assert!(
        attempts[1]["error"].as_str().unwrap().contains("timed out"),
        "{attempts:?}"
    );
    assert!(attempts[1]["duration_ms"].as_u64().unwrap() >= 450);
    assert_eq!(attempts[2]["status_code"], 200);
    assert_eq!(attempts[2]["outcome"], "delivered");
    assert_eq!(delivery["next_attempt_at"], Value::Null);
    // Three requests arrived, each signed, with the delivery's id.
    let received = receiver.wait_for(3).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(receiver.received().len(), 3, "nothing after the delivery");
    for request in &received {
        let (id, body) = verify(request);
        assert_eq!(id, delivery["id"].as_str().unwrap());
        assert_eq!(body["type"], "run.completed");
        assert_eq!(body["data"]["id"], run_id.as_str());
        assert_eq!(body["data"]["status"], "completed");
        assert_eq!(body["data"]["finish_reason"], "stop");
        assert!(body["timestamp"].as_str().is_some());
    }
    // An unknown run is 404.
    let response = server
        .client
        .get(server.url(&format!(
            "/runs/{}/webhook-deliveries",
            uuid::Uuid::now_v7()
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    if let Some(db) = &server.db {
        db.assert_logs_fold().await;
    }
    // Retention removes a finished delivery with the run's events.
    let removed = server
        .runtime
        .store()
        .remove_expired_events(chrono::Utc::now() + chrono::Duration::hours(1), 10)
        .await
        .unwrap();
    assert_eq!(removed, 1);
    let list = deliveries(&server.client, url).await;
    assert_eq!(list["deliveries"], json!([]));
}

async fn a_waiting_run_is_delivered_when_it_waits_and_when_it_ends(backend: Backend) {
    let receiver = Receiver::start(&[]).await;
    let Some(server) = TestServer::start(backend, config("allow_private_addresses = true")).await
    else {
        return;
    };
    let created = server
        .create_run(json!({
            "provider": "demo", "model": "demo", "input": "call lookup {}",
            "tools": [{"name": "lookup", "description": "Looks something up."}],
            "webhook": {"url": receiver.url()}
        }))
        .await;
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    let waiting = wait_run(&server, &run_id, |run| run["status"] == "requires_action").await;
    let received = receiver.wait_for(1).await;
    let (first_id, body) = verify(&received[0]);
    assert_eq!(body["type"], "run.requires_action");
    assert_eq!(body["data"]["status"], "requires_action");
    assert_eq!(
        body["data"]["required_action"], waiting["required_action"],
        "the payload is the run as it waits"
    );
    let call_id = waiting["required_action"]["tool_calls"][0]["call_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let response = server
        .client
        .post(server.url(&format!("/runs/{run_id}/tool_outputs")))
        .json(&json!({"tool_outputs": [{"call_id": call_id, "output": "found"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202, "{:?}", response.text().await);
    wait_terminal(&server, &run_id).await;
    let received = receiver.wait_for(2).await;
    let (second_id, body) = verify(&received[1]);
    assert_ne!(first_id, second_id);
    assert_eq!(body["type"], "run.completed");
    assert_eq!(body["data"]["status"], "completed");
    let list = wait_deliveries(
        &server.client,
        server.url(&format!("/runs/{run_id}/webhook-deliveries")),
        |list| list.len() == 2 && list.iter().all(|d| d["status"] == "delivered"),
    )
    .await;
    assert_eq!(list[0]["event_type"], "run.requires_action");
    assert_eq!(list[0]["id"], first_id.as_str());
    assert_eq!(list[1]["event_type"], "run.completed");
}

async fn webhooks_not_allowed_are_refused_and_runs_without_one_write_nothing(backend: Backend) {
    let Some(server) = TestServer::start(
        backend,
        config("allowed_hosts = [\"hooks.example.com\", \"localhost\"]"),
    )
    .await
    else {
        return;
    };
    let long = format!("https://hooks.example.com/{}", "a".repeat(2048));
    let refused = [
        ("http://127.0.0.1:9/hook", "invalid_webhook", "webhook.url"),
        ("http://localhost:9/hook", "invalid_webhook", "webhook.url"),
        ("http://[::1]:9/hook", "invalid_webhook", "webhook.url"),
        (
            "http://[64:ff9b::7f00:1]:9/hook",
            "invalid_webhook",
            "webhook.url",
        ),
        ("http://198.18.0.1:9/hook", "invalid_webhook", "webhook.url"),
        ("http://[3fff::1]:9/hook", "invalid_webhook", "webhook.url"),
        (
            "http://[::ffff:0:7f00:1]:9/hook",
            "invalid_webhook",
            "webhook.url",
        ),
        (
            "http://hooks.example.com:0/hook",
            "invalid_webhook",
            "webhook.url",
        ),
        (
            "https://other.example.com/hook",
            "invalid_webhook",
            "webhook.url",
        ),
        (
            "ftp://hooks.example.com/hook",
            "invalid_webhook",
            "webhook.url",
        ),
        ("not a url", "invalid_webhook", "webhook.url"),
        // The shape, checked like any field's: a URL parser would strip these quietly.
        (
            " https://hooks.example.com/hook",
            "invalid_field",
            "webhook.url",
        ),
        (
            "https://hooks.example.com/hook\t",
            "invalid_field",
            "webhook.url",
        ),
        (
            "https://hooks.example.com/\u{0}",
            "invalid_field",
            "webhook.url",
        ),
        ("", "invalid_field", "webhook.url"),
        (long.as_str(), "invalid_field", "webhook.url"),
    ];
    for (url, code, field) in refused {
        let body = json!({"provider": "demo", "model": "demo", "input": "hi",
                          "webhook": {"url": url}});
        let problem = server.refused("/runs", &body, 422, code).await;
        assert_eq!(problem["field"], field, "{problem}");
    }
    // A bad shape is the body's error.
    let (status, _) = server
        .post(
            "/runs",
            &json!({"provider": "demo", "model": "demo", "input": "hi",
                    "webhook": "https://hooks.example.com"}),
        )
        .await;
    assert_eq!(status, 422);
    // No webhook: nothing in the outbox.
    let created = server
        .create_run(json!({"provider": "demo", "model": "demo", "input": "hello"}))
        .await;
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    wait_terminal(&server, &run_id).await;
    let list = deliveries(
        &server.client,
        server.url(&format!("/runs/{run_id}/webhook-deliveries")),
    )
    .await;
    assert_eq!(list["deliveries"], json!([]));
    let outbox = server.runtime.store().webhook_outbox().await.unwrap();
    assert_eq!(outbox.pending, 0);

    // A server without a secret refuses every webhook.
    let plain = behest::config::Config::from_toml(DEMO).unwrap();
    let Some(off) = TestServer::start(backend, plain).await else {
        return;
    };
    let response = off
        .client
        .post(off.url("/runs"))
        .json(&json!({"provider": "demo", "model": "demo", "input": "hi",
                      "webhook": {"url": "https://hooks.example.com/x"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert_eq!(problem["code"], "webhooks_disabled", "{problem}");
}

/// `"webhook": null` opts a run out of every webhook: the preset's and the server's default
/// `[webhooks] url` (a health probe, a test run). The run shows none, writes no delivery and
/// the receiver gets nothing; a run leaving the field out still gets the default, and the two
/// are different bodies for an idempotency key. A server without a secret accepts `null`.
async fn a_run_with_a_null_webhook_opts_out_of_the_default(backend: Backend) {
    let receiver = Receiver::start(&[]).await;
    let toml = format!(
        "[webhooks]\nsecret = \"{SECRET}\"\nallow_private_addresses = true\nurl = \"{url}\"\n\n\
         {DEMO}\n[agents.probe]\nprovider = \"demo\"\nmodel = \"demo\"\n\
         [agents.probe.webhook]\nurl = \"{url}\"\n",
        url = receiver.url()
    );
    let config = behest::config::Config::from_toml(&toml).unwrap();
    let Some(server) = TestServer::start(backend, config).await else {
        return;
    };
    let mut opted_out = Vec::new();
    for body in [
        json!({"provider": "demo", "model": "demo", "input": "hello", "webhook": null}),
        json!({"agent": "probe", "input": "hello", "webhook": null}),
    ] {
        let created = server.create_run(body).await;
        let run_id = created["run_id"].as_str().unwrap().to_owned();
        let run = wait_terminal(&server, &run_id).await;
        assert_eq!(run["status"], "completed", "{run}");
        assert!(run.get("webhook").is_none(), "no webhook: {run}");
        opted_out.push(run_id);
    }
    // Left out: the server's default, delivered to the same receiver.
    let created = server
        .create_run(json!({"provider": "demo", "model": "demo", "input": "hello"}))
        .await;
    let default_run = created["run_id"].as_str().unwrap().to_owned();
    let run = wait_terminal(&server, &default_run).await;
    assert_eq!(run["webhook"]["url"], receiver.url(), "{run}");
    wait_deliveries(
        &server.client,
        server.url(&format!("/runs/{default_run}/webhook-deliveries")),
        |list| list.first().is_some_and(|d| d["status"] == "delivered"),
    )
    .await;
    for run_id in &opted_out {
        let list = deliveries(
            &server.client,
            server.url(&format!("/runs/{run_id}/webhook-deliveries")),
        )
        .await;
        assert_eq!(list["deliveries"], json!([]), "run {run_id}");
    }
    let outbox = server.runtime.store().webhook_outbox().await.unwrap();
    assert_eq!(outbox.pending, 0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let received = receiver.received();
    assert_eq!(received.len(), 1, "only the default run's delivery");
    assert_eq!(verify(&received[0]).1["data"]["id"], default_run.as_str());

    // `null` and absent are different bodies under one idempotency key.
    let keyed = json!({"provider": "demo", "model": "demo", "input": "hi",
                       "client_request_id": "probe-1", "webhook": null});
    server.create_run(keyed).await;
    let unkeyed = json!({"provider": "demo", "model": "demo", "input": "hi",
                         "client_request_id": "probe-1"});
    server
        .refused("/runs", &unkeyed, 409, "idempotency_key_reused")
        .await;

    // Without a secret, `null` asks for nothing the server lacks.
    let plain = behest::config::Config::from_toml(DEMO).unwrap();
    let Some(off) = TestServer::start(backend, plain).await else {
        return;
    };
    let created = off
        .create_run(json!({"provider": "demo", "model": "demo", "input": "hi", "webhook": null}))
        .await;
    let run = wait_terminal(&off, created["run_id"].as_str().unwrap()).await;
    assert!(run.get("webhook").is_none(), "{run}");
}

async fn a_delivery_survives_a_restart_and_a_receiver_that_was_down(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    // The receiver's port, not listening yet: every attempt is refused.
    let reserved = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = reserved.local_addr().unwrap().port();
    drop(reserved);
    let hook = format!("http://127.0.0.1:{port}/hook");
    let schedule = std::iter::once("0".to_owned())
        .chain(std::iter::repeat_n("400".to_owned(), 49))
        .collect::<Vec<_>>()
        .join(", ");
    let toml = format!(
        "[runtime]\nlease_ttl_ms = 1000\n\n[webhooks]\nsecret = \"{SECRET}\"\n\
         allow_private_addresses = true\ntimeout_ms = 1000\nschedule_ms = [{schedule}]\n\n{DEMO}"
    );
    let mut first = ServerProcess::start("first", &toml, &db.url).await;
    let (status, _, created) = first
        .post(
            "/runs",
            &json!({"provider": "demo", "model": "demo", "input": "hello",
                    "webhook": {"url": hook}}),
        )
        .await;
    assert_eq!(status, 202);
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    let url = first.url(&format!("/runs/{run_id}/webhook-deliveries"));
    // The run ended while the receiver is down: attempts fail and are retried.
    let list = wait_deliveries(&first.client, url, |list| {
        list.first().is_some_and(|d| {
            d["attempts"].as_array().is_some_and(|a| a.len() >= 2) && d["status"] == "pending"
        })
    })
    .await;
    let delivery_id = list[0]["id"].as_str().unwrap().to_owned();
    assert_eq!(list[0]["event_type"], "run.completed");
    assert!(
        list[0]["attempts"][0]["status_code"].is_null(),
        "{:?}",
        list[0]
    );
    first.kill().await;

    let second = ServerProcess::start("restarted", &toml, &db.url).await;
    // Restarted, still down: still pending.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let receiver = Receiver::on(listener, &[]);
    let received = receiver.wait_for(1).await;
    let url = second.url(&format!("/runs/{run_id}/webhook-deliveries"));
    let list = wait_deliveries(&second.client, url, |list| {
        list.first().is_some_and(|d| d["status"] == "delivered")
    })
    .await;
    assert_eq!(list.len(), 1);
    let attempts = list[0]["attempts"].as_array().unwrap();
    assert!(attempts.len() >= 3, "{attempts:?}");
    let last = attempts.last().unwrap();
    assert_eq!(last["status_code"], 200);
    assert_eq!(last["outcome"], "delivered");
    // (The kill may have cut an attempt in the middle: that one is `interrupted`.)
    assert!(
        attempts[..attempts.len() - 1]
            .iter()
            .all(
                |a| (a["outcome"] == "retry" || a["outcome"] == "interrupted")
                    && a["error"].is_string()
            ),
        "{attempts:?}"
    );
    // Once delivered, nothing more arrives; every request was the same signed delivery.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let all = receiver.received();
    assert_eq!(all.len(), received.len().max(1), "{} requests", all.len());
    for request in &all {
        let (id, body) = verify(request);
        assert_eq!(id, delivery_id);
        assert_eq!(body["data"]["id"], run_id.as_str());
        assert_eq!(body["data"]["status"], "completed");
    }
    let metrics = second.get_text("/metrics").await;
    assert!(
        metrics.contains("behest_webhook_deliveries_total{outcome=\"delivered\"} 1"),
        "{metrics}"
    );
    drop(second);
    db.cleanup().await;
}

/// An attempt cut by `kill -9` is listed: the claim wrote it, `in_progress` while the process
/// lives, and after the restart `interrupted` (no status, no duration), followed by the next
/// attempt of the same delivery once the dead process's claim expired. Interrupted attempts
/// count in the schedule: with two, two cut attempts fail the delivery, and no third request
/// is made. The receiver got both requests, with one `webhook-id`.
async fn an_attempt_cut_by_a_kill_is_listed_as_interrupted(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    // Every request is held past the kill that follows it.
    let held = Answer::Sleep(Duration::from_secs(60));
    let receiver = Receiver::start(&[held, held, held]).await;
    let toml = format!(
        "[runtime]\nlease_ttl_ms = 1000\n\n[webhooks]\nsecret = \"{SECRET}\"\n\
         allow_private_addresses = true\ntimeout_ms = 5000\nschedule_ms = [0, 100]\n\n{DEMO}"
    );
    let mut first = ServerProcess::start("first", &toml, &db.url).await;
    let (status, _, created) = first
        .post(
            "/runs",
            &json!({"provider": "demo", "model": "demo", "input": "hello",
                    "webhook": {"url": receiver.url()}}),
        )
        .await;
    assert_eq!(status, 202);
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    let path = format!("/runs/{run_id}/webhook-deliveries");
    // Attempt 1 is being made (its timeout is 5 s away) when the process is killed.
    receiver.wait_for(1).await;
    let list = deliveries(&first.client, first.url(&path)).await["deliveries"].clone();
    let attempts = &list[0]["attempts"];
    assert_eq!(attempts.as_array().map(Vec::len), Some(1), "{list}");
    assert_eq!(attempts[0]["attempt"], 1);
    assert_eq!(attempts[0]["outcome"], "in_progress", "{list}");
    assert!(attempts[0]["duration_ms"].is_null(), "{list}");
    first.kill().await;

    // Restarted: attempt 2 follows once the dead claim expired; it is killed too.
    let mut second = ServerProcess::start("second", &toml, &db.url).await;
    receiver.wait_for(2).await;
    let list = deliveries(&second.client, second.url(&path)).await["deliveries"].clone();
    let attempts = list[0]["attempts"].as_array().unwrap().clone();
    assert_eq!(attempts.len(), 2, "{list}");
    assert_eq!(attempts[0]["outcome"], "interrupted", "{list}");
    assert_eq!(attempts[1]["attempt"], 2);
    assert_eq!(attempts[1]["outcome"], "in_progress", "{list}");
    // The claim that found attempt 1's expired counted it.
    assert_eq!(interrupted_counted(&second).await, Some(1));
    second.kill().await;

    // The schedule's two attempts were made: the delivery failed, no third one is made.
    let third = ServerProcess::start("third", &toml, &db.url).await;
    let list = wait_deliveries(&third.client, third.url(&path), |list| {
        list.first().is_some_and(|d| d["status"] != "pending")
    })
    .await;
    assert_eq!(list[0]["status"], "failed", "{list:?}");
    assert!(list[0]["finished_at"].is_string(), "{list:?}");
    let attempts = list[0]["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    for (number, attempt) in (1..).zip(attempts) {
        assert_eq!(attempt["attempt"], number);
        assert_eq!(attempt["outcome"], "interrupted", "{attempts:?}");
        assert!(attempt["status_code"].is_null(), "{attempts:?}");
        assert!(attempt["duration_ms"].is_null(), "{attempts:?}");
        assert!(
            attempt["error"]
                .as_str()
                .is_some_and(|e| e.contains("stopped")),
            "{attempts:?}"
        );
    }
    // The claim that failed the delivery counted attempt 2.
    assert_eq!(interrupted_counted(&third).await, Some(1));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let received = receiver.received();
    assert_eq!(received.len(), 2, "no third request");
    let ids: Vec<String> = received.iter().map(|r| verify(r).0).collect();
    assert_eq!(ids, vec![list[0]["id"].as_str().unwrap().to_owned(); 2]);
    drop(third);
    db.cleanup().await;
}

/// `behest_webhook_deliveries_total{outcome="interrupted"}` of `server`, if it has counted one.
async fn interrupted_counted(server: &ServerProcess) -> Option<u64> {
    let metrics = server.get_text("/metrics").await;
    metrics.lines().find_map(|line| {
        line.strip_prefix("behest_webhook_deliveries_total{outcome=\"interrupted\"} ")?
            .parse()
            .ok()
    })
}

on_both_backends!(
    a_receiver_that_fails_then_times_out_then_accepts,
    a_waiting_run_is_delivered_when_it_waits_and_when_it_ends,
    webhooks_not_allowed_are_refused_and_runs_without_one_write_nothing,
    a_run_with_a_null_webhook_opts_out_of_the_default,
    a_delivery_survives_a_restart_and_a_receiver_that_was_down,
    an_attempt_cut_by_a_kill_is_listed_as_interrupted,
);
