//! Against the real `behest serve` binary: a second server on one SQLite file refuses to start
//! (issue 27, item 6); secrets in query strings never reach the debug log (item 8).

use crate::support;

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::json;
use support::db::{Backend, TestDb};
use support::process::ServerProcess;

/// The built-in model, one token every `token_delay_ms`.
fn scripted(token_delay_ms: u64) -> String {
    format!(
        "[providers.demo]\nkind = \"scripted\"\ntoken_delay_ms = {token_delay_ms}\n\
         [providers.demo.models.demo]\ncontext_window = 32768\nmax_output_tokens = 4096\n"
    )
}

/// Secrets in query strings, in any case or percent-encoding, never reach the log at debug
/// level; `access%5Ftoken` authenticates the event stream like `access_token`.
async fn query_secrets_never_reach_the_log(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let key = "KEY-7f3a9c-the-api-key";
    let toml = format!("[auth]\nkeys = [\"{key}\"]\n\n{}", scripted(1));
    let server =
        ServerProcess::start_with_env("net", &toml, &db.url, &[("RUST_LOG", "debug")]).await;
    let created = server
        .client
        .post(server.url("/runs"))
        .bearer_auth(key)
        .json(&json!({"provider": "demo", "model": "demo", "input": "Hi"}))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 202);
    let run_id = created.json::<serde_json::Value>().await.unwrap()["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let get = |path: String| {
        let request = server
            .client
            .get(server.url(&path))
            .timeout(Duration::from_secs(10));
        async move { request.send().await.unwrap().status().as_u16() }
    };
    let events = format!("/runs/{run_id}/events");
    // The key authenticates through its percent-encoded name too.
    assert_eq!(get(format!("{events}?access%5Ftoken={key}")).await, 200);
    assert_eq!(
        get(format!("{events}?last_event_id=1&access_token={key}")).await,
        200
    );
    assert_eq!(get(format!("{events}?access_token=wrong")).await, 401);
    let secrets = [
        "SECRET-upper-case",
        "SECRET-api-key",
        "SECRET-client",
        "SECRET-password",
        "SECRET-auth",
    ];
    assert_eq!(
        get(format!("{events}?ACCESS_TOKEN={}", secrets[0])).await,
        401
    );
    assert_eq!(get(format!("/runs?Api%2DKey={}", secrets[1])).await, 401);
    assert_eq!(
        get(format!("/runs?client%5fsecret={}&limit=1", secrets[2])).await,
        401
    );
    assert_eq!(get(format!("/healthz?PassWord={}", secrets[3])).await, 200);
    assert_eq!(
        get(format!("/nowhere?Authorization={}", secrets[4])).await,
        404
    );
    // The log is written as requests end: give the last lines a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let log = server.log();
    assert!(
        log.contains("[redacted]"),
        "request URIs are logged at debug:\n{log}"
    );
    assert!(!log.contains(key), "the API key is in the log:\n{log}");
    for secret in secrets {
        assert!(!log.contains(secret), "{secret} is in the log:\n{log}");
    }
    db.cleanup().await;
}

/// A second `behest serve` on the SQLite file of a running one exits at once with a message
/// naming the file; the first keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_server_on_one_sqlite_file_refuses_to_start() {
    let db = TestDb::new(Backend::Sqlite).await.unwrap();
    let first = ServerProcess::start("first", &scripted(1), &db.url).await;
    let created = first
        .post(
            "/runs",
            &json!({"provider": "demo", "model": "demo", "input": "Hi"}),
        )
        .await;
    assert_eq!(created.0, 202, "{}", created.2);
    let second = tokio::process::Command::new(env!("CARGO_BIN_EXE_behest"))
        .args(["serve", "--bind", "127.0.0.1:0", "--database-url", &db.url])
        .env_remove("BEHEST_CONFIG")
        .env_remove("BEHEST_DATABASE_URL")
        .env_remove("BEHEST_BIND")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let output = tokio::time::timeout(Duration::from_secs(30), second.wait_with_output())
        .await
        .expect("the second server exits")
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    let path = db.url.trim_start_matches("sqlite://");
    assert!(
        stderr.contains("another behest process is using"),
        "{stderr}"
    );
    assert!(stderr.contains(path), "{stderr}");
    // The first one still serves, and its run was not taken over.
    assert_eq!(first.get("/healthz").await.0, 200);
    let run_id = created.2["run_id"].as_str().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let run = first.get_json(&format!("/runs/{run_id}")).await;
        if run["status"] == "completed" {
            break;
        }
        assert!(Instant::now() < deadline, "{run}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

on_both_backends!(query_secrets_never_reach_the_log);
