//! The first hour: the real `behest serve` binary with no configuration offers the built-in demo
//! model and tool, logs plain text to a pipe, and its web console works in a real browser
//! (Debian's headless Chromium driven by playwright-core), through a proxy that cuts the event
//! stream mid-run, and answers a run that waits for the client (a tool output, an approval).

use crate::support;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::process::Command;

use support::demo::DemoServer;

#[tokio::test]
async fn serve_without_config_offers_the_demo_model_and_tool() {
    let mut server = DemoServer::start().await;
    let demo_lines = server
        .log
        .iter()
        .filter(|line| line.contains("built-in demo model"))
        .count();
    assert_eq!(demo_lines, 1, "one line says so: {:?}", server.log);
    assert!(
        server.log.iter().all(|line| !line.contains('\u{1b}')),
        "no colour escapes in a piped log: {:?}",
        server.log
    );
    assert!(
        server
            .log
            .iter()
            .any(|line| line.contains("applied migration")),
        "the migrations applied are logged: {:?}",
        server.log
    );
    let client = behest::net::client().unwrap();
    let providers: Value = client
        .get(format!("{}/providers", server.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        providers,
        json!({"providers": [{"id": "demo", "kind": "scripted", "models": [
            {"name": "demo", "context_window": 32768, "max_output_tokens": 4096}]}]})
    );
    let tools: Value = client
        .get(format!("{}/tools", server.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(tools["tools"][0]["name"], "current_time");
    assert_eq!(tools["tools"][0]["source"], json!({"kind": "builtin"}));

    let created: Value = client
        .post(format!("{}/runs", server.url))
        .json(&json!({"provider": "demo", "model": "demo", "input": "What time is it?"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let run_id = created["run_id"].as_str().unwrap();
    // The stream ends after the terminal event.
    let body = client
        .get(format!("{}/runs/{run_id}/events", server.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let types: Vec<&str> = body
        .lines()
        .filter_map(|line| line.strip_prefix("event: "))
        .collect();
    for expected in [
        "tool_call_started",
        "tool_call_delta",
        "tool_call_completed",
        "tool_execution_finished",
        "text_delta",
        "usage_recorded",
        "run_completed",
    ] {
        assert!(types.contains(&expected), "{expected} in {types:?}");
    }
    let output: Value = client
        .get(format!("{}/runs/{run_id}/output", server.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let messages = output["messages"].as_array().unwrap();
    let answer = messages.last().unwrap()["content"][0]["text"]
        .as_str()
        .unwrap();
    assert!(
        answer.starts_with("`current_time` answered {") && answer.contains("\"utc\""),
        "{answer}"
    );
    assert_eq!(output["iterations"], 2);
    assert!(output["total_usage"]["output_tokens"].as_u64().unwrap() > 0);

    let page = client.get(&server.url).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains("/console/app.js"));
    server.child.kill().await.unwrap();
}

/// The proxy's counts: event streams cut, and event streams resumed with `Last-Event-ID`.
#[derive(Default)]
struct ProxyCounts {
    cut: AtomicUsize,
    resumed: AtomicUsize,
}

struct ProxyState {
    upstream: String,
    client: reqwest::Client,
    counts: Arc<ProxyCounts>,
}

/// Forwards every request to `upstream`; the first event stream of a run (no `Last-Event-ID`)
/// that goes on for more than 1.2 s is cut there, mid-run, as a dropped connection.
async fn proxy(State(state): State<Arc<ProxyState>>, request: Request) -> Response {
    let path = request
        .uri()
        .path_and_query()
        .map(ToString::to_string)
        .unwrap_or_default();
    let is_events = path.starts_with("/runs/") && path.contains("/events");
    let resumed = request.headers().contains_key("last-event-id");
    if is_events && resumed {
        state.counts.resumed.fetch_add(1, Ordering::SeqCst);
    }
    let mut upstream = state.client.request(
        request.method().clone(),
        format!("{}{path}", state.upstream),
    );
    for (name, value) in request.headers() {
        if name != "host" {
            upstream = upstream.header(name, value);
        }
    }
    let body = axum::body::to_bytes(request.into_body(), 1 << 20)
        .await
        .unwrap();
    let answer = upstream.body(body).send().await.unwrap();
    let mut response = Response::builder().status(answer.status());
    for (name, value) in answer.headers() {
        response = response.header(name, value);
    }
    let stream = answer.bytes_stream();
    let body = if is_events && !resumed {
        let counts = state.counts.clone();
        let started = Instant::now();
        Body::from_stream(stream.map(move |chunk| {
            if started.elapsed() > Duration::from_millis(1200) {
                counts.cut.fetch_add(1, Ordering::SeqCst);
                return Err(std::io::Error::other("cut by the test proxy"));
            }
            chunk.map_err(std::io::Error::other)
        }))
    } else {
        Body::from_stream(stream)
    };
    response.body(body).unwrap()
}

async fn start_proxy(upstream: &str) -> (String, Arc<ProxyCounts>) {
    let counts = Arc::new(ProxyCounts::default());
    let state = Arc::new(ProxyState {
        upstream: upstream.to_owned(),
        client: behest::net::client().unwrap(),
        counts: counts.clone(),
    });
    let app = axum::Router::new().fallback(proxy).with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, counts)
}

/// Why the browser test cannot run here, if it cannot.
fn browser_missing(browser_dir: &Path) -> Option<String> {
    let chromium =
        std::env::var("BEHEST_TEST_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    if !Path::new(&chromium).exists() {
        return Some(format!(
            "no Chromium at {chromium} (apt-get install chromium)"
        ));
    }
    if std::process::Command::new("node")
        .arg("--version")
        .output()
        .is_err()
    {
        return Some("no `node` on PATH".to_owned());
    }
    if !browser_dir.join("node_modules/playwright-core").exists() {
        return Some("playwright-core is not installed (npm ci in tests/browser)".to_owned());
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_works_in_a_real_browser() {
    let browser_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser");
    if let Some(reason) = browser_missing(&browser_dir) {
        assert!(
            std::env::var("BEHEST_TEST_REQUIRE_BROWSER").is_err(),
            "BEHEST_TEST_REQUIRE_BROWSER is set but the browser test cannot run: {reason}"
        );
        eprintln!("SKIPPED console_works_in_a_real_browser: {reason}");
        return;
    }
    let mut server = DemoServer::start().await;
    let (proxy_url, counts) = start_proxy(&server.url).await;
    let mut command = Command::new("node");
    command
        .arg(browser_dir.join("console.mjs"))
        .arg(&server.url)
        .arg(&proxy_url)
        .kill_on_drop(true);
    // BEHEST_TEST_CONSOLE_SCREENSHOT=docs/console.png refreshes the README's screenshot.
    if let Ok(path) = std::env::var("BEHEST_TEST_CONSOLE_SCREENSHOT") {
        command.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join(path));
    }
    let output = tokio::time::timeout(Duration::from_secs(90), command.output())
        .await
        .expect("the browser test ends within 90 s")
        .expect("run node");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "browser test failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert_eq!(
        stdout
            .lines()
            .filter(|line| line.starts_with("ok: "))
            .count(),
        8,
        "{stdout}"
    );
    assert!(
        counts.cut.load(Ordering::SeqCst) >= 1,
        "the proxy cut a stream"
    );
    assert!(
        counts.resumed.load(Ordering::SeqCst) >= 1,
        "the page resumed with Last-Event-ID"
    );
    server.child.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_works_with_api_keys_in_a_real_browser() {
    let browser_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser");
    if let Some(reason) = browser_missing(&browser_dir) {
        assert!(
            std::env::var("BEHEST_TEST_REQUIRE_BROWSER").is_err(),
            "BEHEST_TEST_REQUIRE_BROWSER is set but the browser test cannot run: {reason}"
        );
        eprintln!("SKIPPED console_works_with_api_keys_in_a_real_browser: {reason}");
        return;
    }
    let key = "console-key-27182818";
    let mut server = DemoServer::start_with_env(&[("BEHEST_AUTH__KEYS", key)]).await;
    let refused = behest::net::client()
        .unwrap()
        .get(format!("{}/providers", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401, "the API needs the key");
    let output = tokio::time::timeout(
        Duration::from_secs(90),
        Command::new("node")
            .arg(browser_dir.join("console_auth.mjs"))
            .arg(&server.url)
            .arg(key)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the browser test ends within 90 s")
    .expect("run node");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "browser test failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert_eq!(
        stdout
            .lines()
            .filter(|line| line.starts_with("ok: "))
            .count(),
        6,
        "{stdout}"
    );
    server.child.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docs_page_works_in_a_real_browser_with_the_network_off() {
    let browser_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser");
    if let Some(reason) = browser_missing(&browser_dir) {
        assert!(
            std::env::var("BEHEST_TEST_REQUIRE_BROWSER").is_err(),
            "BEHEST_TEST_REQUIRE_BROWSER is set but the browser test cannot run: {reason}"
        );
        eprintln!("SKIPPED docs_page_works_in_a_real_browser_with_the_network_off: {reason}");
        return;
    }
    let key = "docs-key-16180339";
    let mut server = DemoServer::start_with_env(&[("BEHEST_AUTH__KEYS", key)]).await;
    let output = tokio::time::timeout(
        Duration::from_secs(90),
        Command::new("node")
            .arg(browser_dir.join("docs.mjs"))
            .arg(&server.url)
            .arg(key)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the browser test ends within 90 s")
    .expect("run node");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "browser test failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert_eq!(
        stdout
            .lines()
            .filter(|line| line.starts_with("ok: "))
            .count(),
        3,
        "{stdout}"
    );
    server.child.kill().await.unwrap();
}

#[tokio::test]
async fn migrate_says_what_it_applied_then_up_to_date() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("m.db").display());
    let mut logs = Vec::new();
    for _ in 0..2 {
        let output = Command::new(env!("CARGO_BIN_EXE_behest"))
            .args(["migrate", "--database-url", &url])
            .env_remove("BEHEST_CONFIG")
            .env("RUST_LOG", "info")
            .output()
            .await
            .unwrap();
        assert!(output.status.success());
        logs.push(String::from_utf8_lossy(&output.stderr).into_owned());
    }
    assert!(
        logs[0].contains("applied migration version=1 description=init"),
        "{}",
        logs[0]
    );
    assert!(!logs[0].contains('\u{1b}'), "plain text in a pipe");
    assert!(
        logs[1].contains("database schema up to date"),
        "{}",
        logs[1]
    );
    assert!(!logs[1].contains("applied migration"), "{}", logs[1]);
}

/// A second `behest serve` started by mistake on the address of one serving stops at once,
/// before it opens (or creates, or migrates) a database or takes over the runs in it.
#[tokio::test]
async fn a_second_server_on_a_taken_address_touches_no_database() {
    let server = DemoServer::start().await;
    let address = server.url.trim_start_matches("http://").to_owned();
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("second.db");
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        Command::new(env!("CARGO_BIN_EXE_behest"))
            .args(["serve", "--bind", &address, "--database-url"])
            .arg(format!("sqlite://{}", database.display()))
            .env_remove("BEHEST_CONFIG")
            .env_remove("BEHEST_DATABASE_URL")
            .env_remove("BEHEST_BIND")
            .output(),
    )
    .await
    .expect("the second server stops within 30 s")
    .expect("run behest serve");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("cannot listen"), "{stderr}");
    assert!(!database.exists(), "no database was opened: {stderr}");
}
