//! Issue 25 item 6 (the event-stream part): the real `ai` 6, `ai` 7 and `@ag-ui/client` 1.0
//! readers (`tests/frontends/run.mjs`) against `behest serve` with the demo model: a text run, a
//! server-tool run, a client-tool run and an approval (and a cancelled run), each read live, replayed, cut after
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

/// A server configuration with the built-in model as provider `demo`, model `demo`, and a
/// lease that a restarted process takes over after 1 s.
const DEMO_CONFIG: &str = "[runtime]\nlease_ttl_ms = 1000\n\n[providers.demo]\nkind = \"scripted\"\n\n\
                           [providers.demo.models.demo]\ncontext_window = 32768\nmax_output_tokens = 4096\n";

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
    for reader in [
        "ai-sdk (ai 6)",
        "ai-sdk (ai 7)",
        "ai-sdk-v7 (ai 7)",
        "ag-ui",
    ] {
        assert!(
            stdout.contains(&format!("cancelled {reader}: ok")),
            "the cancel in {reader} missing from:\n{stdout}"
        );
    }
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
    let mut server = ServerProcess::start("formats", DEMO_CONFIG, &db).await;
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

/// Reads `sse` (a saved UI message stream) through the real AI SDK reader `lib` (`ai6`/`ai7`);
/// the message it built, or what it failed with.
async fn read_ui_message(lib: &str, sse: &str) -> Result<serde_json::Value, String> {
    use tokio::io::AsyncWriteExt;
    let mut child = Command::new("node")
        .args(["read.mjs", lib])
        .current_dir(package())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("node runs");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin
        .write_all(sse.as_bytes())
        .await
        .expect("write the stream");
    drop(stdin);
    let output = child.wait_with_output().await.expect("node ends");
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).into_owned());
    }
    serde_json::from_slice(&output.stdout).map_err(|e| e.to_string())
}

/// Item 6's restart: a `kill -9` mid-text, a new process on the same database takes the run
/// over (`run_resumed` with the abandoned call), and the stream a reader cut at the kill goes
/// on from its last `id:`; the real readers accept prefix + continuation, and `ai` 7's
/// `reset-step` drops the abandoned text, so its message equals the run's output.
#[tokio::test]
async fn a_stream_cut_by_kill_9_resumes_at_the_next_process() {
    if !package().join("node_modules").exists() {
        assert!(
            std::env::var("BEHEST_TEST_REQUIRE_FRONTENDS").is_err(),
            "BEHEST_TEST_REQUIRE_FRONTENDS is set but tests/frontends/node_modules is missing"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("behest.db").display());
    let config = DEMO_CONFIG;
    let mut first = ServerProcess::start("first", config, &db).await;
    let (status, _, run) = first
        .post(
            "/runs",
            &json!({"provider": "demo", "model": "demo", "input": "count to 60"}),
        )
        .await;
    assert_eq!(status, 202, "{run}");
    let run_id = run["run_id"].as_str().unwrap().to_owned();
    let mut cut = std::collections::BTreeMap::new();
    let mut responses = Vec::new();
    for format in ["ai-sdk", "ai-sdk-v7"] {
        let response = first
            .client
            .get(first.url(&format!("/runs/{run_id}/events?format={format}")))
            .send()
            .await
            .unwrap();
        responses.push((format, response));
    }
    // Read until some text arrived, then kill the server mid-call.
    for (format, response) in &mut responses {
        let mut text = String::new();
        while !text.contains("\"text-delta\"") {
            let chunk = tokio::time::timeout(Duration::from_secs(10), response.chunk())
                .await
                .expect("a frame")
                .expect("no error before the kill")
                .expect("not ended");
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
        cut.insert(*format, text);
    }
    first.kill().await;
    for (format, mut response) in responses {
        // What the reader got before the connection died, in whole frames.
        let text = cut.get_mut(format).unwrap();
        while let Ok(Some(chunk)) = response.chunk().await {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
        let whole = text.rfind("\n\n").map_or(0, |end| end + 2);
        text.truncate(whole);
    }
    let second = ServerProcess::start("restarted", config, &db).await;
    let mut output = json!(null);
    for _ in 0..200 {
        let (status, body) = second.get(&format!("/runs/{run_id}/output")).await;
        if status == 200 {
            output = body;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(output["status"], "completed", "{output}");
    let want: String = output["messages"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
        .filter_map(|part| part["text"].as_str().map(str::to_owned))
        .collect();
    for (format, prefix) in cut {
        let last_id = prefix
            .lines()
            .filter_map(|line| line.strip_prefix("id: "))
            .next_back()
            .expect("an id before the kill")
            .to_owned();
        let rest = second
            .client
            .get(second.url(&format!("/runs/{run_id}/events?format={format}")))
            .header("last-event-id", &last_id)
            .send()
            .await
            .unwrap();
        assert_eq!(rest.status(), 200, "{format} resumed at {last_id}");
        let rest = rest.text().await.unwrap();
        assert!(rest.ends_with("data: [DONE]\n\n"), "{format}: {rest}");
        let joined = format!("{prefix}{rest}");
        for lib in ["ai6", "ai7"] {
            if format == "ai-sdk-v7" && lib == "ai6" {
                continue;
            }
            let message = read_ui_message(lib, &joined)
                .await
                .unwrap_or_else(|e| panic!("{lib} reading {format} cut at {last_id}: {e}"));
            let got: String = message["parts"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|part| part["type"] == "text")
                .filter_map(|part| part["text"].as_str())
                .collect();
            if format == "ai-sdk-v7" {
                assert!(rest.contains("reset-step"), "{rest}");
                assert_eq!(got, want, "{lib} {format}: the abandoned text is reset");
            } else {
                // ai 6 cannot retract text: the abandoned call's text stays before the rest.
                assert!(
                    got.ends_with(&want),
                    "{lib} {format}: {got:?} ends with {want:?}"
                );
            }
        }
    }
}
