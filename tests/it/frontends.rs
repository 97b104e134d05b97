//! Issue 25 item 6 (the event-stream part): the real `ai` 6, `ai` 7 and `@ag-ui/client` 1.0
//! readers (`tests/frontends/run.mjs`) against `behest serve` with the demo model: a text run, a
//! server-tool run, a client-tool run and an approval, each read live, replayed, cut after
//! every frame (inside multi-frame events too) and resumed with `Last-Event-ID`; the message
//! each library builds equals `GET /runs/{id}/output`, and any library validation error fails.
//! Skipped unless `tests/frontends/node_modules` exists (`npm ci` there) or
//! `BEHEST_TEST_REQUIRE_FRONTENDS=1` (then it fails when it cannot run). And item 4's shutdown:
//! these formats are aborted, behest's own ends cleanly.

use crate::support;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::json;
use tokio::process::Command;

use support::demo::DemoServer;
use support::process::ServerProcess;

fn package() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/frontends"))
}

#[tokio::test]
async fn the_real_ai_sdk_and_ag_ui_readers_rebuild_each_run_from_any_cut() {
    if !package().join("node_modules").exists() {
        assert!(
            std::env::var("BEHEST_TEST_REQUIRE_FRONTENDS").is_err(),
            "BEHEST_TEST_REQUIRE_FRONTENDS is set but tests/frontends/node_modules is missing \
             (npm ci in tests/frontends)"
        );
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "SKIPPED frontends: tests/frontends/node_modules is missing (npm ci in tests/frontends)"
        );
        return;
    }
    // The demo model's default pace, so that the first read of each run is live.
    let server = DemoServer::start().await;
    let run = Command::new("node")
        .arg("run.mjs")
        .arg(&server.url)
        .current_dir(package())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(600), run)
        .await
        .expect("node run.mjs finishes within 10 minutes")
        .expect("node runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "node run.mjs failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    // Every run in every reader was checked.
    for run in ["text", "server_tool", "client_tool", "approval"] {
        for reader in [
            "ai-sdk (ai 6)",
            "ai-sdk (ai 7)",
            "ai-sdk-v7 (ai 7)",
            "ag-ui",
        ] {
            assert!(
                stdout.contains(&format!("{run} {reader}")),
                "{run} {reader} missing from:\n{stdout}"
            );
        }
    }
}

/// Item 4: at shutdown the projected formats are cut (no chunked terminator: both readers take
/// a clean end for a finished message), while behest's own format still ends cleanly.
#[tokio::test]
async fn at_shutdown_projected_streams_are_aborted_and_behests_own_ends_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("behest.db").display());
    let mut server = ServerProcess::start("formats", "", &db).await;
    let (status, _, run) = server
        .post(
            "/runs",
            &json!({"provider": "demo", "model": "demo", "input": "count to 2000"}),
        )
        .await;
    assert_eq!(status, 202, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_owned();
    let mut streams = Vec::new();
    for format in ["behest", "ai-sdk", "ai-sdk-v7", "ag-ui"] {
        let mut response = server
            .client
            .get(server.url(&format!("/runs/{run_id}/events?format={format}")))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{format}");
        let first = tokio::time::timeout(Duration::from_secs(10), response.chunk())
            .await
            .expect("a first frame")
            .expect("no error yet");
        assert!(first.is_some(), "{format}: a first frame");
        streams.push((format, response));
    }
    server.terminate().await;
    for (format, mut response) in streams {
        let end = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                match response.chunk().await {
                    Ok(Some(_)) => {}
                    Ok(None) => return Ok(()),
                    Err(error) => return Err(error),
                }
            }
        })
        .await
        .expect("the stream ends within the drain");
        if format == "behest" {
            assert!(end.is_ok(), "behest's own format ends cleanly: {end:?}");
        } else {
            assert!(end.is_err(), "{format} is aborted, not ended cleanly");
        }
    }
    assert!(server.wait_exit(Duration::from_secs(30)).await.is_some());
}
