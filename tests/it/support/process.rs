//! The real `behest serve` binary as a child process (started, SIGKILLed, SIGTERMed and
//! restarted on the same database by the crash/restart tests), its configuration, and an HTTP
//! tool server that records every execution.
//!
//! The server's log (stderr) is drained into a buffer all along; a test that fails while a
//! [`ServerProcess`] is alive (or kept, killed, for the record) prints that log.

use std::io::Write;
use std::net::SocketAddr;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, State};
use axum::routing::post;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// How long a server may take to log its listening address.
const START_TIMEOUT: Duration = Duration::from_secs(30);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A `behest serve` child process listening on `127.0.0.1:<free port>`.
pub struct ServerProcess {
    child: Child,
    pid: u32,
    /// Where it listens.
    pub addr: SocketAddr,
    pub client: reqwest::Client,
    /// A label for its log ("first", "restarted", …).
    name: String,
    log: Arc<Mutex<Vec<String>>>,
    _config: tempfile::NamedTempFile,
}

impl ServerProcess {
    /// Writes `config_toml` to a file and starts `behest serve --bind 127.0.0.1:0 --config FILE
    /// --database-url DB_URL`; returns once it logged its listening address.
    pub async fn start(name: &str, config_toml: &str, db_url: &str) -> Self {
        Self::start_with_env(name, config_toml, db_url, &[]).await
    }

    /// [`ServerProcess::start`] with these extra environment variables (e.g. a provider key,
    /// `RUST_LOG`, `OTEL_*`).
    pub async fn start_with_env(
        name: &str,
        config_toml: &str,
        db_url: &str,
        env: &[(&str, &str)],
    ) -> Self {
        let mut config = tempfile::Builder::new()
            .prefix("behest-")
            .suffix(".toml")
            .tempfile()
            .expect("config file");
        config
            .write_all(config_toml.as_bytes())
            .expect("write config");
        config.flush().expect("flush config");
        let mut child = Command::new(env!("CARGO_BIN_EXE_behest"))
            .arg("serve")
            .args(["--bind", "127.0.0.1:0"])
            .arg("--config")
            .arg(config.path())
            .arg("--database-url")
            .arg(db_url)
            .env_remove("BEHEST_CONFIG")
            .env_remove("BEHEST_DATABASE_URL")
            .env_remove("BEHEST_BIND")
            .env_remove("RUST_LOG_FORMAT")
            .env("RUST_LOG", "info,sqlx=warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start behest serve");
        let pid = child.id().expect("child pid");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = tokio::sync::oneshot::channel::<SocketAddr>();
        let lines_log = Arc::clone(&log);
        tokio::spawn(async move {
            let mut tx = Some(tx);
            let mut lines = BufReader::new(stderr).lines();
            // Drained to the end, so the server never blocks on a full pipe.
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(at) = line.find("address=")
                    && let Some(addr) = line[at + "address=".len()..]
                        .split_whitespace()
                        .next()
                        .and_then(|a| a.trim_matches('"').parse::<SocketAddr>().ok())
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(addr);
                }
                lock(&lines_log).push(line);
            }
        });
        let addr = match tokio::time::timeout(START_TIMEOUT, rx).await {
            Ok(Ok(addr)) => addr,
            Ok(Err(_)) => {
                let status = child.wait().await;
                panic!(
                    "behest serve ({name}) exited before listening ({status:?}); log:\n{}",
                    lock(&log).join("\n")
                )
            }
            Err(_) => panic!(
                "behest serve ({name}) did not log its address within {START_TIMEOUT:?}; log:\n{}",
                lock(&log).join("\n")
            ),
        };
        Self {
            child,
            pid,
            addr,
            client: behest::net::client().unwrap(),
            name: name.to_owned(),
            log,
            _config: config,
        }
    }

    /// `http://ADDR{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Its log so far, one line per line.
    pub fn log(&self) -> String {
        lock(&self.log).join("\n")
    }

    /// SIGKILL, and waits until it is gone.
    pub async fn kill(&mut self) {
        self.child.start_kill().expect("SIGKILL");
        let status = self.wait_exit(Duration::from_secs(10)).await;
        assert!(
            status.is_some(),
            "{} still running after SIGKILL",
            self.name
        );
    }

    /// SIGTERM (through `kill -TERM PID`); does not wait.
    pub async fn terminate(&self) {
        let status = Command::new("kill")
            .arg("-TERM")
            .arg(self.pid.to_string())
            .status()
            .await
            .expect("run kill -TERM");
        assert!(status.success(), "kill -TERM {} failed: {status}", self.pid);
    }

    /// Sends `signal` (a `kill` name: `STOP` freezes the process, `CONT` resumes it) through
    /// `kill -SIGNAL PID`; does not wait.
    pub async fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid.to_string())
            .status()
            .await
            .expect("run kill");
        assert!(
            status.success(),
            "kill -{signal} {} failed: {status}",
            self.pid
        );
    }

    /// Its exit status once it exits, or `None` when it is still running after `timeout`.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(status) => Some(status.expect("wait for behest serve")),
            Err(_) => None,
        }
    }

    /// `GET path` → (status, JSON body or `Null`).
    pub async fn get(&self, path: &str) -> (u16, Value) {
        self.try_get(path)
            .await
            .unwrap_or_else(|e| panic!("GET {path} ({}): {e}", self.name))
    }

    /// `GET path` → (status, JSON body or `Null`), or the transport error (e.g. connection
    /// refused once the listener closed).
    pub async fn try_get(&self, path: &str) -> Result<(u16, Value), reqwest::Error> {
        let response = self
            .client
            .get(self.url(path))
            .timeout(Duration::from_secs(10))
            .send()
            .await?;
        let status = response.status().as_u16();
        let body = response.json().await.unwrap_or(Value::Null);
        Ok((status, body))
    }

    /// `GET path`, expecting 200; the JSON body.
    pub async fn get_json(&self, path: &str) -> Value {
        let (status, body) = self.get(path).await;
        assert_eq!(status, 200, "GET {path} ({}): {body}", self.name);
        body
    }

    /// `GET path` (e.g. `/metrics`), expecting 200; the body as text.
    pub async fn get_text(&self, path: &str) -> String {
        let response = self.client.get(self.url(path)).send().await.expect("GET");
        assert_eq!(response.status(), 200, "GET {path} ({})", self.name);
        response.text().await.expect("text")
    }

    /// `POST path` without a body (cancel, compact, reset) → (status, JSON body or `Null`).
    pub async fn post_empty(&self, path: &str) -> (u16, Value) {
        let response = self
            .client
            .post(self.url(path))
            .timeout(Duration::from_secs(20))
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {path} ({}): {e}", self.name));
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Option<String>, Value) {
        let response = self
            .client
            .post(self.url(path))
            .json(body)
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {path} ({}): {e}", self.name));
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = response.json().await.unwrap_or(Value::Null);
        (status, retry_after, body)
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // A failing test: the server's side of the story.
            let _ = writeln!(
                std::io::stderr().lock(),
                "---- log of behest serve ({}, pid {}) ----\n{}\n---- end of log ({}) ----",
                self.name,
                self.pid,
                self.log(),
                self.name
            );
        }
    }
}

/// One execution of a tool the [`ToolServer`] received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Execution {
    /// The tool (`quick`, `slow` or `idem`).
    pub tool: String,
    /// The `marker` argument.
    pub marker: String,
    /// The tool answered (false: still running, or its caller went away first).
    pub finished: bool,
    /// Its `Idempotency-Key` header.
    pub idempotency_key: Option<String>,
}

/// An HTTP tool server on `127.0.0.1:0`: `POST /tools/{name}` with `{"marker", "sleep_ms"?}`
/// sleeps `sleep_ms` (cut short by [`ToolServer::release`]), then answers `{"tool", "marker",
/// "result": "<name> result for <marker>"}`. Every execution is recorded when it begins.
pub struct ToolServer {
    addr: SocketAddr,
    state: Arc<ToolState>,
    server: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct ToolState {
    executions: Mutex<Vec<Execution>>,
    released: std::sync::atomic::AtomicBool,
    release: tokio::sync::Notify,
}

impl ToolServer {
    pub async fn start() -> Self {
        let state = Arc::new(ToolState::default());
        let app = axum::Router::new()
            .route("/tools/{name}", post(execute))
            .with_state(Arc::clone(&state));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind tool server");
        let addr = listener.local_addr().expect("tool server address");
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            addr,
            state,
            server,
        }
    }

    /// Ends every sleep at once, now and from now on (e.g. once the process that called a
    /// held tool was killed, so a re-execution does not wait).
    pub fn release(&self) {
        self.state
            .released
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.state.release.notify_waiters();
    }

    /// The URL of tool `name`.
    pub fn url(&self, name: &str) -> String {
        format!("http://{}/tools/{name}", self.addr)
    }

    /// Every execution so far, in the order they began.
    pub fn executions(&self) -> Vec<Execution> {
        lock(&self.state.executions).clone()
    }

    /// How many times the call with this marker began executing.
    pub fn count(&self, marker: &str) -> usize {
        lock(&self.state.executions)
            .iter()
            .filter(|e| e.marker == marker)
            .count()
    }
}

impl Drop for ToolServer {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn execute(
    State(state): State<Arc<ToolState>>,
    Path(tool): Path<String>,
    headers: axum::http::HeaderMap,
    Json(arguments): Json<Value>,
) -> Json<Value> {
    let marker = arguments["marker"].as_str().unwrap_or_default().to_owned();
    let index = {
        let mut executions = lock(&state.executions);
        executions.push(Execution {
            tool: tool.clone(),
            marker: marker.clone(),
            finished: false,
            idempotency_key: headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
        });
        executions.len() - 1
    };
    if let Some(ms) = arguments["sleep_ms"].as_u64() {
        let released = state.release.notified();
        tokio::pin!(released);
        released.as_mut().enable();
        if !state.released.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(ms)) => {}
                () = released => {}
            }
        }
    }
    if let Some(execution) = lock(&state.executions).get_mut(index) {
        execution.finished = true;
    }
    Json(json!({
        "tool": tool,
        "marker": marker,
        "result": format!("{tool} result for {marker}"),
    }))
}

/// A configuration for [`ServerProcess::start`]: `[runtime] lease_ttl_ms = 1000` plus
/// `runtime_extra` lines; provider `fake` (kind `openai`, model `fake-model`) at
/// `provider_base_url` with long stream deadlines (a held reply is ended by the test, not by a
/// timeout) and no retries; HTTP tools `quick`, `slow` and `idem` (`idempotent = true`) of
/// `tools`, each taking `{"marker": string, "sleep_ms"?: integer}`.
pub fn config_toml(provider_base_url: &str, tools: &ToolServer, runtime_extra: &str) -> String {
    let parameters = "{ type = \"object\", properties = { marker = { type = \"string\" }, \
                      sleep_ms = { type = \"integer\" } }, required = [\"marker\"] }";
    let mut toml = format!(
        "[runtime]\nlease_ttl_ms = 1000\n{runtime_extra}\n\n\
         [providers.fake]\nkind = \"openai\"\nbase_url = \"{provider_base_url}\"\n\
         [providers.fake.timeouts]\nconnect_ms = 2000\nfirst_byte_ms = 60000\nidle_ms = 60000\ntotal_ms = 120000\n\
         [providers.fake.retry]\nmax_attempts = 1\n\
         [providers.fake.models.fake-model]\ncontext_window = 128000\nmax_output_tokens = 1024\n"
    );
    for (name, description, idempotent) in [
        ("quick", "Answers at once.", false),
        ("slow", "Answers after sleep_ms.", false),
        ("idem", "Answers after sleep_ms; safe to repeat.", true),
    ] {
        toml.push_str(&format!(
            "\n[http_tools.{name}]\ndescription = \"{description}\"\nurl = \"{}\"\nparameters = {parameters}\n",
            tools.url(name)
        ));
        if idempotent {
            toml.push_str("idempotent = true\n");
        }
    }
    toml
}
