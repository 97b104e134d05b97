//! A real behest server on `127.0.0.1:0` over a fresh database, and an SSE client that parses
//! frames with `eventsource-stream`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use behest::api::{AppState, app};
use behest::config::Config;
use behest::runtime::Runtime;
use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::db::{Backend, TestDb};

/// A configuration with one OpenAI-compatible provider `fake` (model `fake-model`).
pub fn config_for(base_url: &str) -> Config {
    config_with(base_url, "")
}

/// Like [`config_for`], with extra TOML (e.g. `[runtime]` settings) before the providers.
pub fn config_with(base_url: &str, extra: &str) -> Config {
    let toml = format!(
        "{extra}\n[providers.fake]\nkind = \"openai\"\nbase_url = \"{base_url}\"\n\
         [providers.fake.timeouts]\nconnect_ms = 2000\nfirst_byte_ms = 5000\nidle_ms = 1500\ntotal_ms = 20000\n\
         [providers.fake.retry]\nmax_attempts = 1\n\
         [providers.fake.models.fake-model]\ncontext_window = 128000\nmax_output_tokens = 1024\n"
    );
    Config::from_toml(&toml).expect("test config")
}

/// One SSE frame as a client sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub id: String,
    pub event: String,
    pub data: String,
}

impl Frame {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.data).expect("event data is JSON")
    }
    pub fn sequence(&self) -> u64 {
        self.id.parse().expect("numeric id")
    }
}

/// How a resuming client passes its cursor.
#[derive(Debug, Clone, Copy)]
pub enum Cursor {
    Header,
    Query,
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub runtime: Arc<Runtime>,
    pub client: reqwest::Client,
    pub db: Option<TestDb>,
    shutdown: CancellationToken,
}

impl TestServer {
    /// Starts a server over a fresh database of `backend`; `None` when that backend is skipped.
    pub async fn start(backend: Backend, config: Config) -> Option<Self> {
        let db = TestDb::new(backend).await?;
        let store = db.store().await;
        Some(Self::on_store(store, config, Some(db)).await)
    }

    pub async fn on_store(
        store: Arc<dyn behest::store::Store>,
        config: Config,
        db: Option<TestDb>,
    ) -> Self {
        let mut tools =
            behest::tools::ToolRegistry::connect(&config.mcp_servers, &config.http_tools)
                .await
                .expect("tools");
        tools
            .add_builtins(&config.builtin_tools)
            .expect("built-in tools");
        let runtime = behest::server::runtime(&config, store, Arc::new(tools)).expect("runtime");
        let shutdown = CancellationToken::new();
        let router = app(AppState::from_config(
            runtime.clone(),
            shutdown.clone(),
            &config,
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, router)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
        });
        Self {
            addr,
            runtime,
            client: behest::net::client().unwrap(),
            db,
            shutdown,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// `POST /runs`; returns the 202 body.
    pub async fn create_run(&self, body: Value) -> Value {
        let response = self
            .client
            .post(self.url("/runs"))
            .json(&body)
            .send()
            .await
            .expect("POST /runs");
        assert_eq!(response.status(), 202, "POST /runs");
        response.json().await.expect("JSON")
    }

    /// `POST path` with a JSON `body` → (status, JSON body or `Null`).
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let response = self
            .client
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .expect("POST");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    /// `POST path` with `body`, answered `status` with a problem of `code`; returns the problem.
    pub async fn refused(&self, path: &str, body: &Value, status: u16, code: &str) -> Value {
        let (answered, problem) = self.post(path, body).await;
        assert_eq!(answered, status, "POST {path} {body}: {problem}");
        assert_eq!(problem["code"], code, "{problem}");
        problem
    }

    /// Starts a run with input `input` on the `fake` provider; returns its id.
    pub async fn start_run(&self, input: &str, session_id: Option<&str>) -> String {
        let mut body =
            serde_json::json!({"provider": "fake", "model": "fake-model", "input": input});
        if let Some(session) = session_id {
            body["session_id"] = Value::from(session);
        }
        let created = self.create_run(body).await;
        created["run_id"].as_str().expect("run_id").to_owned()
    }

    /// Reads `/runs/{id}/events` after `cursor` to the end of the stream.
    pub async fn events(&self, run_id: &str, cursor: Option<(u64, Cursor)>) -> Vec<Frame> {
        let response = self.watch(run_id, cursor).await;
        assert_eq!(response.status(), 200, "watch status");
        collect_frames(response).await
    }

    /// The raw watch response.
    pub async fn watch(&self, run_id: &str, cursor: Option<(u64, Cursor)>) -> reqwest::Response {
        let mut request = self.client.get(self.url(&format!("/runs/{run_id}/events")));
        match cursor {
            Some((n, Cursor::Header)) => request = request.header("Last-Event-ID", n.to_string()),
            Some((n, Cursor::Query)) => {
                request = request.query(&[("last_event_id", n.to_string())])
            }
            None => {}
        }
        request.send().await.expect("GET events")
    }

    /// A watch with a raw `Last-Event-ID` header value.
    pub async fn watch_raw(&self, run_id: &str, last_event_id: &str) -> reqwest::Response {
        self.client
            .get(self.url(&format!("/runs/{run_id}/events")))
            .header("Last-Event-ID", last_event_id)
            .send()
            .await
            .expect("GET events")
    }

    /// Waits for the run's terminal event and returns the run record.
    pub async fn finished_run(&self, run_id: &str) -> Value {
        let frames = tokio::time::timeout(Duration::from_secs(20), self.events(run_id, None))
            .await
            .expect("run ends within 20 s");
        assert!(
            frames.last().is_some_and(|f| f.event.starts_with("run_")),
            "stream ends with a terminal event: {frames:?}"
        );
        self.get_json(&format!("/runs/{run_id}")).await
    }

    /// Cancels a run that is already cancelled: cancel is idempotent, so the answer is the
    /// first one's (`202` with the cancelled run) and nothing changes.
    pub async fn cancel_again(&self, run_id: &str) {
        let response = self
            .client
            .post(self.url(&format!("/runs/{run_id}/cancel")))
            .send()
            .await
            .expect("POST cancel");
        let status = response.status();
        let body: Value = response.json().await.expect("JSON");
        assert_eq!(status, 202, "{body}");
        assert_eq!(body["status"], "cancelled", "{body}");
    }

    pub async fn get_json(&self, path: &str) -> Value {
        self.client
            .get(self.url(path))
            .send()
            .await
            .expect("GET")
            .json()
            .await
            .expect("JSON")
    }

    /// `GET path` (e.g. `/metrics`), expecting 200; the body as text.
    pub async fn get_text(&self, path: &str) -> String {
        let response = self.client.get(self.url(path)).send().await.expect("GET");
        assert_eq!(response.status(), 200, "GET {path}");
        response.text().await.expect("text")
    }

    /// `GET path` with `Authorization: Bearer key`, as JSON.
    pub async fn get_json_with(&self, path: &str, key: &str) -> Value {
        self.client
            .get(self.url(path))
            .bearer_auth(key)
            .send()
            .await
            .expect("GET")
            .json()
            .await
            .expect("JSON")
    }

    /// Stops the server (its runs stay resumable) and checks that every run's log folds.
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.runtime.shutdown(Duration::from_secs(2)).await;
        super::db::assert_logs_fold(self.runtime.store().as_ref()).await;
        if let Some(db) = self.db {
            db.cleanup().await;
        }
    }
}

/// All SSE frames of a response, until the server closes it.
pub async fn collect_frames(response: reqwest::Response) -> Vec<Frame> {
    let mut stream = response.bytes_stream().eventsource();
    let mut frames = Vec::new();
    while let Some(event) = stream.next().await {
        let event = event.expect("well-formed SSE");
        frames.push(Frame {
            id: event.id,
            event: event.event,
            data: event.data,
        });
    }
    frames
}

pub const TERMINAL: [&str; 3] = ["run_completed", "run_failed", "run_cancelled"];
