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

/// Item 6's restart through `useChat`'s own routes: `tests/frontends/chat.mjs restart` streams
/// a run through `POST /chat` with the real `AbstractChat` (ai 7 in the `ai-sdk-v7` dialect,
/// then ai 6 in `ai-sdk`); when it prints `kill <run id>` the server is killed with SIGKILL and a
/// new process is started on the same database (it takes the run over), whose URL goes to the
/// script; the chat then calls `resumeStream()` (`GET /chat/{id}/stream`) and its message must
/// equal `GET /runs/{id}/output` (ai 6: end with it, it cannot retract the abandoned text).
#[tokio::test]
async fn a_chat_cut_by_kill_9_resumes_through_use_chats_own_resume() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    if !package().join("node_modules").exists() {
        assert!(
            std::env::var("BEHEST_TEST_REQUIRE_FRONTENDS").is_err(),
            "BEHEST_TEST_REQUIRE_FRONTENDS is set but tests/frontends/node_modules is missing"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("behest.db").display());
    let mut server = ServerProcess::start("chat-first", DEMO_CONFIG, &db).await;
    let mut node = Command::new("node")
        .args(["chat.mjs", &server.url(""), "restart"])
        .current_dir(package())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("node runs");
    let mut stdin = node.stdin.take().expect("stdin");
    let mut stdout = BufReader::new(node.stdout.take().expect("stdout")).lines();
    let mut said = String::new();
    let mut restarts = 0;
    let read = async {
        while let Some(line) = stdout.next_line().await.expect("node's stdout") {
            said.push_str(&line);
            said.push('\n');
            if let Some(run_id) = line.strip_prefix("kill ") {
                let (status, run) = server.get(&format!("/runs/{run_id}")).await;
                assert_eq!(
                    (status, &run["status"]),
                    (200, &json!("calling_model")),
                    "{run}"
                );
                server.kill().await;
                restarts += 1;
                server =
                    ServerProcess::start(&format!("chat-restarted-{restarts}"), DEMO_CONFIG, &db)
                        .await;
                let url = server.url("");
                stdin
                    .write_all(format!("{url}\n").as_bytes())
                    .await
                    .expect("write the new URL");
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(300), read)
        .await
        .expect("node chat.mjs restart finishes within 5 minutes");
    let output = node.wait_with_output().await.expect("node ends");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "node chat.mjs restart failed ({}):\n{said}\n{stderr}",
        output.status
    );
    assert_eq!(restarts, 2, "{said}");
    for reader in ["ai-sdk-v7 (ai 7)", "ai-sdk (ai 6)"] {
        assert!(
            said.contains(&format!("ok restart {reader}\n")),
            "{reader} missing from:\n{said}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Issue 25 item 5: ids frontends can keep, and approval decisions in the log.

mod ids {
    use std::time::Duration;

    use eventsource_stream::Eventsource;
    use futures::StreamExt;
    use serde_json::{Value, json};

    use crate::support::db::Backend;
    use crate::support::fake_openai::{FakeOpenAi, Reply, text_stream, tool_calls_stream};
    use crate::support::server::{TestServer, config_with};
    use crate::support::validate::validate_openai_request;

    const KEYS: [&str; 2] = ["frontends-key-zero", "frontends-key-one"];

    /// The built-in model as `demo`/`demo` with `current_time`, and two API keys.
    fn keyed_config() -> behest::config::Config {
        behest::config::Config::from_toml(&format!(
            "builtin_tools = [\"current_time\"]\n[auth]\nkeys = [\"{}\", \"{}\"]\n\
             [providers.demo]\nkind = \"scripted\"\ntoken_delay_ms = 1\n\
             [providers.demo.models.demo]\ncontext_window = 32768\nmax_output_tokens = 4096\n",
            KEYS[0], KEYS[1]
        ))
        .unwrap()
    }

    async fn send(
        server: &TestServer,
        key: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> reqwest::Response {
        let mut request = server
            .client
            .request(method, server.url(path))
            .bearer_auth(key)
            .timeout(Duration::from_secs(30));
        if let Some(body) = body {
            request = request.json(body);
        }
        request.send().await.unwrap()
    }

    async fn json_of(
        server: &TestServer,
        key: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> (u16, Value) {
        let response = send(server, key, method, path, body).await;
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    /// The `data:` of every frame of an SSE response read to its end (`[DONE]` left out).
    async fn frames(response: reqwest::Response) -> Vec<Value> {
        assert_eq!(response.status(), 200);
        let mut events = response.bytes_stream().eventsource();
        let mut out = Vec::new();
        let read = async {
            while let Some(event) = events.next().await {
                let event = event.unwrap();
                if event.data != "[DONE]" {
                    out.push(serde_json::from_str(&event.data).unwrap());
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(20), read)
            .await
            .expect("the stream ends");
        out
    }

    async fn run_until(server: &TestServer, run_id: &str, statuses: &[&str]) -> Value {
        for _ in 0..400 {
            let (_, run) = json_of(
                server,
                KEYS[0],
                reqwest::Method::GET,
                &format!("/runs/{run_id}"),
                None,
            )
            .await;
            if statuses.iter().any(|status| run["status"] == *status) {
                return run;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("run {run_id} never reached {statuses:?}");
    }

    /// behest's own events of a finished run.
    async fn events(server: &TestServer, run_id: &str) -> Vec<Value> {
        let response = send(
            server,
            KEYS[0],
            reqwest::Method::GET,
            &format!("/runs/{run_id}/events"),
            None,
        )
        .await;
        frames(response).await
    }

    fn of_type<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
        events.iter().filter(|e| e["type"] == kind).collect()
    }

    fn position(events: &[Value], kind: &str) -> usize {
        events
            .iter()
            .position(|e| e["type"] == kind)
            .unwrap_or_else(|| panic!("no {kind} in {events:?}"))
    }

    /// Every model call's announced message id is the one it commits, and the session's
    /// history has them all.
    async fn assert_message_ids(server: &TestServer, events: &[Value]) {
        let announced: Vec<&Value> = of_type(events, "model_started")
            .iter()
            .map(|e| &e["message_id"])
            .collect();
        let committed: Vec<&Value> = of_type(events, "assistant_message_committed")
            .iter()
            .map(|e| &e["message_id"])
            .collect();
        assert!(!committed.is_empty());
        assert_eq!(announced, committed, "{events:?}");
        let session = events[0]["session_id"].as_str().unwrap();
        let (_, messages) = json_of(
            server,
            KEYS[0],
            reqwest::Method::GET,
            &format!("/sessions/{session}/messages"),
            None,
        )
        .await;
        let stored: Vec<&Value> = messages["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| &m["id"])
            .collect();
        for id in committed {
            assert!(stored.contains(&id), "{id} in {stored:?}");
        }
    }

    /// The decisions of `POST /runs/{id}/approvals` (with `decided_by` and the key that sent
    /// them), of `/chat` and of AG-UI's `resume[]` are logged before the calls execute or are
    /// answered, and read back in every rendering; each model call's stored message id is
    /// known from its `model_started`.
    async fn approval_decisions_are_logged_with_who_decided(backend: Backend) {
        let Some(server) = TestServer::start(backend, keyed_config()).await else {
            return;
        };
        let body = json!({"provider": "demo", "model": "demo", "input": "What time is it?",
                          "approval": ["current_time"]});
        // 1. Approved through /approvals with the second key, by "alice".
        let (status, created) = json_of(
            &server,
            KEYS[1],
            reqwest::Method::POST,
            "/runs",
            Some(&body),
        )
        .await;
        assert_eq!(status, 202, "{created}");
        let run_id = created["run_id"].as_str().unwrap().to_owned();
        let run = run_until(&server, &run_id, &["requires_action"]).await;
        let call_id = run["required_action"]["tool_calls"][0]["call_id"].clone();
        let path = format!("/runs/{run_id}/approvals");
        let long_reason = "r".repeat(4097);
        for bad in [
            json!({"decided_by": ""}),
            json!({"decided_by": "x".repeat(256)}),
            json!({"decided_by": "a\u{0}b"}),
            json!({"decided_by": "alice\n"}),
            json!({"decided_by": "al\u{7f}ice"}),
            json!({"reason": long_reason}),
        ] {
            let mut approval = json!({"call_id": call_id, "approve": true});
            approval
                .as_object_mut()
                .unwrap()
                .extend(bad.as_object().unwrap().clone());
            let (status, problem) = json_of(
                &server,
                KEYS[1],
                reqwest::Method::POST,
                &path,
                Some(&json!({"approvals": [approval]})),
            )
            .await;
            assert_eq!(
                (status, problem["code"].as_str(), problem["field"].as_str()),
                (422, Some("invalid_field"), Some("approvals")),
                "{problem}"
            );
        }
        let (status, answer) = json_of(
            &server,
            KEYS[1],
            reqwest::Method::POST,
            &path,
            Some(&json!({"approvals": [{"call_id": call_id, "approve": true, "decided_by": "alice"}]})),
        )
        .await;
        assert_eq!(status, 202, "{answer}");
        run_until(&server, &run_id, &["completed"]).await;
        let log = events(&server, &run_id).await;
        let decided = of_type(&log, "tool_approval_decided");
        assert_eq!(decided.len(), 1, "{log:?}");
        assert_eq!(decided[0]["call_id"], call_id);
        assert_eq!(decided[0]["tool_name"], "current_time");
        assert_eq!(decided[0]["approved"], true);
        assert_eq!(decided[0]["decided_by"], "alice");
        assert_eq!(decided[0]["api_key"], 1);
        assert!(decided[0].get("reason").is_none(), "{}", decided[0]);
        let at = position(&log, "tool_approval_decided");
        assert!(position(&log, "tool_calls_required") < at);
        assert!(at < position(&log, "tool_execution_started"));
        assert_message_ids(&server, &log).await;

        // 2. Rejected with a reason, through /approvals with the first key.
        let (_, created) = json_of(
            &server,
            KEYS[0],
            reqwest::Method::POST,
            "/runs",
            Some(&body),
        )
        .await;
        let run_id = created["run_id"].as_str().unwrap().to_owned();
        let run = run_until(&server, &run_id, &["requires_action"]).await;
        let call_id = run["required_action"]["tool_calls"][0]["call_id"].clone();
        let (status, _) = json_of(
            &server,
            KEYS[0],
            reqwest::Method::POST,
            &format!("/runs/{run_id}/approvals"),
            Some(&json!({"approvals": [{"call_id": call_id, "approve": false, "reason": "not now"}]})),
        )
        .await;
        assert_eq!(status, 202);
        run_until(&server, &run_id, &["completed"]).await;
        let log = events(&server, &run_id).await;
        let decided = of_type(&log, "tool_approval_decided");
        assert_eq!(
            (
                &decided[0]["approved"],
                &decided[0]["reason"],
                &decided[0]["api_key"]
            ),
            (&json!(false), &json!("not now"), &json!(0))
        );
        assert!(decided[0].get("decided_by").is_none());
        assert!(of_type(&log, "tool_execution_started").is_empty());
        assert!(
            position(&log, "tool_approval_decided") < position(&log, "tool_execution_finished")
        );
        // The replay in ai 7's dialect says it as the AI SDK's approval response.
        let v7 = frames(
            send(
                &server,
                KEYS[0],
                reqwest::Method::GET,
                &format!(
                    "/runs/{run_id}/events?format=ai-sdk-v7&last_event_id={}",
                    position(&log, "tool_calls_required") + 1
                ),
                None,
            )
            .await,
        )
        .await;
        let response = of_type(&v7, "tool-approval-response");
        assert_eq!(response.len(), 1, "{v7:?}");
        assert_eq!(
            (&response[0]["approved"], &response[0]["reason"]),
            (&json!(false), &json!("not now"))
        );
        assert_eq!(of_type(&v7, "tool-output-denied").len(), 1);
        let notice = of_type(&v7, "data-behest-tool-approval-decided");
        assert_eq!(notice[0]["data"]["toolCallId"], response[0]["approvalId"]);

        // 3. Through /chat (the AI SDK's approval response): the key that sent it.
        let chat = "approvalIdsChat01";
        let first = frames(
            send(
                &server,
                KEYS[1],
                reqwest::Method::POST,
                "/chat?format=ai-sdk-v7",
                Some(
                    &json!({"id": chat, "messages": [{"id": "u1", "role": "user",
                    "parts": [{"type": "text", "text": "What time is it?"}]}],
                    "provider": "demo", "model": "demo", "approval": ["current_time"]}),
                ),
            )
            .await,
        )
        .await;
        let request = of_type(&first, "tool-approval-request")[0].clone();
        let run_id = first[0]["messageId"].as_str().unwrap().to_owned();
        let started = of_type(&first, "data-behest-model-started");
        assert_eq!(started.len(), 1, "{first:?}");
        let continued = frames(
            send(
                &server,
                KEYS[1],
                reqwest::Method::POST,
                "/chat?format=ai-sdk-v7",
                Some(&json!({"id": chat, "messageId": run_id, "messages": [{
                    "id": run_id, "role": "assistant", "parts": [
                        {"type": "tool-current_time", "toolCallId": request["toolCallId"],
                         "state": "approval-responded", "input": {},
                         "approval": {"id": request["approvalId"], "approved": false, "reason": "no"}}]}]})),
            )
            .await,
        )
        .await;
        let response = of_type(&continued, "tool-approval-response");
        assert_eq!(response.len(), 1, "{continued:?}");
        assert_eq!(response[0]["approvalId"], request["approvalId"]);
        let notice = of_type(&continued, "data-behest-tool-approval-decided");
        assert_eq!(notice[0]["data"]["api_key"], 1);
        assert_eq!(notice[0]["data"]["approved"], false);
        assert_eq!(notice[0]["data"]["reason"], "no");
        run_until(&server, &run_id, &["completed"]).await;
        let log = events(&server, &run_id).await;
        assert_message_ids(&server, &log).await;
        // The step's stored message id, announced at its start.
        assert_eq!(
            started[0]["data"]["messageId"],
            log[position(&log, "model_started")]["message_id"]
        );

        // 4. Through AG-UI's resume[], by "bob"; the assistant messages carry the stored ids.
        let thread = uuid::Uuid::new_v4().to_string();
        let first = frames(
            send(
                &server,
                KEYS[0],
                reqwest::Method::POST,
                "/ag-ui",
                Some(&json!({"threadId": thread, "runId": "r1",
                    "messages": [{"id": "u1", "role": "user", "content": "What time is it?"}],
                    "tools": [], "context": [],
                    "forwardedProps": {"provider": "demo", "model": "demo", "approval": ["current_time"]}})),
            )
            .await,
        )
        .await;
        let finished = of_type(&first, "RUN_FINISHED");
        // The thread the client named is echoed by its own id.
        assert_eq!(first[0]["threadId"], thread.as_str());
        assert_eq!(finished[0]["threadId"], thread.as_str());
        let interrupt = finished[0]["outcome"]["interrupts"][0].clone();
        let bad = send(
            &server,
            KEYS[0],
            reqwest::Method::POST,
            "/ag-ui",
            Some(&json!({"threadId": thread, "runId": "r2", "messages": [], "tools": [], "context": [],
                "resume": [{"interruptId": interrupt["id"], "status": "resolved",
                            "payload": {"approved": true, "decidedBy": ""}}]})),
        )
        .await;
        assert_eq!(bad.status(), 422);
        let continued = frames(
            send(
                &server,
                KEYS[0],
                reqwest::Method::POST,
                "/ag-ui",
                Some(&json!({"threadId": thread, "runId": "r2", "messages": [], "tools": [], "context": [],
                    "resume": [{"interruptId": interrupt["id"], "status": "resolved",
                                "payload": {"approved": true, "decidedBy": "bob"}}]})),
            )
            .await,
        )
        .await;
        let custom: Vec<&Value> = continued
            .iter()
            .filter(|e| e["type"] == "CUSTOM" && e["name"] == "behest.tool_approval_decided")
            .collect();
        assert_eq!(custom.len(), 1, "{continued:?}");
        assert_eq!(continued[0]["threadId"], thread.as_str());
        assert_eq!(custom[0]["value"]["decided_by"], "bob");
        assert_eq!(custom[0]["value"]["api_key"], 0);
        assert_eq!(custom[0]["value"]["toolCallId"], interrupt["toolCallId"]);
        let (_, runs) = json_of(
            &server,
            KEYS[0],
            reqwest::Method::GET,
            "/runs?limit=1",
            None,
        )
        .await;
        let run_id = runs["runs"][0]["id"].as_str().unwrap().to_owned();
        run_until(&server, &run_id, &["completed"]).await;
        let log = events(&server, &run_id).await;
        assert_message_ids(&server, &log).await;
        let replay = frames(
            send(
                &server,
                KEYS[0],
                reqwest::Method::GET,
                &format!("/runs/{run_id}/events?format=ag-ui"),
                None,
            )
            .await,
        )
        .await;
        assert_eq!(replay[0]["threadId"], thread.as_str());
        let mut text_ids: Vec<&Value> = of_type(&first, "TEXT_MESSAGE_START")
            .into_iter()
            .chain(of_type(&continued, "TEXT_MESSAGE_START"))
            .map(|e| &e["messageId"])
            .collect();
        text_ids.dedup();
        let announced: Vec<&Value> = of_type(&log, "model_started")
            .into_iter()
            .map(|e| &e["message_id"])
            .collect();
        assert!(!text_ids.is_empty());
        for id in text_ids {
            assert!(announced.contains(&id), "{id} in {announced:?}");
        }
        server.db.as_ref().unwrap().assert_logs_fold().await;
        server.stop().await;
    }

    /// A provider that says `call_1` in every turn: the session's stored calls get ids of their
    /// own (`call_1`, `call_1_2`, …), every request stays valid, and both renderings name each
    /// call once.
    async fn a_provider_reusing_call_1_keeps_ids_unique_in_the_session(backend: Backend) {
        let fake = FakeOpenAi::start().await;
        let Some(server) = TestServer::start(
            backend,
            config_with(&fake.base_url(), "builtin_tools = [\"current_time\"]\n"),
        )
        .await
        else {
            return;
        };
        let mut session: Option<String> = None;
        let mut rendered = Vec::new();
        for _ in 0..2 {
            for _ in 0..2 {
                fake.push(Reply::sse(&tool_calls_stream(&[(
                    "call_1",
                    "current_time",
                    json!({}),
                )])));
            }
            fake.push(Reply::sse(&text_stream(&["It is late."])));
            let mut body = json!({"provider": "fake", "model": "fake-model", "input": "time?"});
            if let Some(session) = &session {
                body["session_id"] = json!(session);
            }
            let created = server.create_run(body).await;
            let run_id = created["run_id"].as_str().unwrap().to_owned();
            session = Some(created["session_id"].as_str().unwrap().to_owned());
            assert_eq!(server.finished_run(&run_id).await["status"], "completed");
            for format in ["ai-sdk", "ag-ui"] {
                let response = server
                    .client
                    .get(server.url(&format!("/runs/{run_id}/events?format={format}")))
                    .send()
                    .await
                    .unwrap();
                rendered.push((format, frames(response).await));
            }
        }
        let session = session.unwrap();
        let messages = server
            .get_json(&format!("/sessions/{session}/messages"))
            .await;
        let ids: Vec<&str> = messages["messages"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|m| m["tool_calls"].as_array().into_iter().flatten())
            .map(|call| call["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["call_1", "call_1_2", "call_1_3", "call_1_4"]);
        for (n, request) in fake.requests().iter().enumerate() {
            let errors = validate_openai_request(&request.body);
            assert!(errors.is_empty(), "request {n}: {errors:?}");
        }
        let mut namespaced = std::collections::HashSet::new();
        for (format, frames) in &rendered {
            let field = if *format == "ag-ui" {
                "TOOL_CALL_START"
            } else {
                "tool-input-start"
            };
            for frame in frames.iter().filter(|f| f["type"] == field) {
                let id = frame["toolCallId"].as_str().unwrap().to_owned();
                assert!(
                    namespaced.insert(format!("{format} {id}")),
                    "{format}: {id} twice"
                );
            }
        }
        assert_eq!(namespaced.len(), 8, "{namespaced:?}");
        // AG-UI's tool results are the stored tool messages, by id.
        let stored: Vec<&Value> = messages["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] == "tool")
            .map(|m| &m["id"])
            .collect();
        let results: Vec<&Value> = rendered
            .iter()
            .filter(|(format, _)| *format == "ag-ui")
            .flat_map(|(_, frames)| frames.iter().filter(|f| f["type"] == "TOOL_CALL_RESULT"))
            .map(|f| &f["messageId"])
            .collect();
        assert_eq!(results, stored);
        server.db.as_ref().unwrap().assert_logs_fold().await;
        server.stop().await;
    }

    /// A `kill -9` while an approved tool runs: the process that takes the run over finds the
    /// decision in the log and does not log it again (the execution it cut off is answered as
    /// interrupted); the log folds.
    async fn a_decision_is_logged_once_across_a_restart(backend: Backend) {
        use crate::support::db::TestDb;
        use crate::support::process::{ServerProcess, ToolServer, config_toml};
        let Some(db) = TestDb::new(backend).await else {
            return;
        };
        let fake = FakeOpenAi::start().await;
        let tools = ToolServer::start().await;
        let toml = config_toml(&fake.base_url(), &tools, "");
        fake.push(Reply::sse(&tool_calls_stream(&[(
            "call_1",
            "slow",
            json!({"marker": "held", "sleep_ms": 60_000}),
        )])));
        fake.push(Reply::sse(&text_stream(&["Done."])));
        let mut first = ServerProcess::start("decision", &toml, &db.url).await;
        let (status, _, created) = first
            .post(
                "/runs",
                &json!({"provider": "fake", "model": "fake-model", "input": "go",
                        "approval": ["slow"]}),
            )
            .await;
        assert_eq!(status, 202, "{created}");
        let run_id = created["run_id"].as_str().unwrap().to_owned();
        let mut run = json!(null);
        for _ in 0..400 {
            run = first.get_json(&format!("/runs/{run_id}")).await;
            if run["status"] == "requires_action" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let call_id = run["required_action"]["tool_calls"][0]["call_id"].clone();
        let (status, _, answer) = first
            .post(
                &format!("/runs/{run_id}/approvals"),
                &json!({"approvals": [{"call_id": call_id, "approve": true, "decided_by": "alice"}]}),
            )
            .await;
        assert_eq!(status, 202, "{answer}");
        for _ in 0..400 {
            if tools.count("held") == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert_eq!(tools.count("held"), 1, "the approved tool runs");
        first.kill().await;
        tools.release();
        let second = ServerProcess::start("decision-restarted", &toml, &db.url).await;
        for _ in 0..400 {
            run = second.get_json(&format!("/runs/{run_id}")).await;
            if run["status"] == "completed" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert_eq!(run["status"], "completed", "{run}");
        let response = second
            .client
            .get(second.url(&format!("/runs/{run_id}/events")))
            .send()
            .await
            .unwrap();
        let log = frames(response).await;
        assert_eq!(of_type(&log, "run_resumed").len(), 1, "{log:?}");
        let decided = of_type(&log, "tool_approval_decided");
        assert_eq!(decided.len(), 1, "{log:?}");
        assert_eq!(decided[0]["decided_by"], "alice");
        assert_eq!(tools.count("held"), 1, "not executed again");
        db.assert_logs_fold().await;
        db.cleanup().await;
    }

    on_both_backends!(
        approval_decisions_are_logged_with_who_decided,
        a_provider_reusing_call_1_keeps_ids_unique_in_the_session,
        a_decision_is_logged_once_across_a_restart
    );
}
