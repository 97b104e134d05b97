//! A second server on one SQLite file refuses to start (issue 27, item 6), against the real
//! `behest serve` binary.

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
