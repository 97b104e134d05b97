//! `tool_progress`: an MCP server's `notifications/progress` (the `behest-mcp-fixture`
//! binary's `progress` tool) and an HTTP tool's streamed answers (`text/event-stream`,
//! NDJSON) become `tool_progress` events that a watcher sees live, between the call's
//! `tool_execution_started` and `tool_execution_finished`, rate-limited per call; the result is
//! the one a plain JSON answer gives.

use crate::support;

use std::convert::Infallible;
use std::path::Path;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use axum::routing::post;
use eventsource_stream::Eventsource as _;
use futures::StreamExt as _;
use serde_json::{Value, json};
use support::db::Backend;
use support::fake_openai::{FakeOpenAi, Reply, text_stream, tool_calls_stream};
use support::server::{Frame, TestServer, config_with};

const FIXTURE: &str = env!("CARGO_BIN_EXE_behest-mcp-fixture");

/// The fixture with its `progress` tool; `gate`, when given, is the file it waits for before
/// it returns.
fn mcp_toml(runtime: &str, gate: Option<&Path>) -> String {
    let gate = gate.map_or_else(String::new, |path| {
        format!(", BEHEST_MCP_FIXTURE_GATE = \"{}\"", path.display())
    });
    format!(
        "[runtime]\n{runtime}\n\
         [mcp_servers.fixture]\ntransport = \"stdio\"\ncommand = \"{FIXTURE}\"\n\
         env = {{ BEHEST_MCP_FIXTURE_PROGRESS_TOOL = \"1\"{gate} }}\n"
    )
}

fn progress_of(frames: &[Frame], call: &str) -> Vec<Value> {
    frames
        .iter()
        .filter(|f| f.event == "tool_progress")
        .map(Frame::json)
        .filter(|event| event["call_id"] == call)
        .collect()
}

fn finished_of(frames: &[Frame], call: &str) -> Value {
    frames
        .iter()
        .filter(|f| f.event == "tool_execution_finished")
        .map(Frame::json)
        .find(|event| event["call_id"] == call)
        .unwrap()
}

async fn mcp_progress_reaches_a_watcher_live(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let gate = dir.path().join("gate");
    let fake = FakeOpenAi::start().await;
    let extra = mcp_toml("tool_progress_interval_ms = 0", Some(&gate));
    let Some(server) = TestServer::start(backend, config_with(&fake.base_url(), &extra)).await
    else {
        return;
    };
    fake.push(Reply::sse(&tool_calls_stream(&[(
        "call_p",
        "progress",
        json!({"steps": 3, "interval_ms": 30}),
    )])));
    fake.push(Reply::sse(&text_stream(&["done"])));
    let run_id = server.start_run("work slowly", None).await;
    let response = server.watch(&run_id, None).await;
    assert_eq!(response.status(), 200);
    let mut events = response.bytes_stream().eventsource();
    let mut frames: Vec<Frame> = Vec::new();
    // Every report arrives while the tool still waits for its gate: live, not at the end.
    while progress_of(&frames, "call_p").len() < 3 {
        let event = tokio::time::timeout(Duration::from_secs(10), events.next())
            .await
            .expect("progress within 10 s")
            .expect("the stream goes on")
            .expect("well-formed SSE");
        assert_ne!(
            event.event, "tool_execution_finished",
            "the tool returned before its gate opened"
        );
        frames.push(Frame {
            id: event.id,
            event: event.event,
            data: event.data,
        });
    }
    assert!(!gate.exists());
    std::fs::write(&gate, b"go").unwrap();
    while let Some(event) = tokio::time::timeout(Duration::from_secs(10), events.next())
        .await
        .expect("the run goes on within 10 s")
    {
        let event = event.expect("well-formed SSE");
        frames.push(Frame {
            id: event.id,
            event: event.event,
            data: event.data,
        });
    }
    let progress = progress_of(&frames, "call_p");
    let reported: Vec<(f64, f64, &str)> = progress
        .iter()
        .map(|p| {
            (
                p["progress"].as_f64().unwrap(),
                p["total"].as_f64().unwrap(),
                p["message"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        reported,
        [
            (1.0, 3.0, "step 1"),
            (2.0, 3.0, "step 2"),
            (3.0, 3.0, "step 3")
        ]
    );
    // Between the call's start and its finish, which is the tool's own result.
    let position = |kind: &str| frames.iter().position(|f| f.event == kind).unwrap();
    let first_progress = position("tool_progress");
    assert!(position("tool_execution_started") < first_progress);
    assert!(first_progress < position("tool_execution_finished"));
    assert_eq!(
        finished_of(&frames, "call_p")["result"],
        json!({"Success": {"output": "done after 3 steps"}})
    );
    assert_eq!(frames.last().unwrap().event, "run_completed");
    // The model sees the result only, as without progress.
    let history = fake.requests()[1].body["messages"].clone();
    let tool = history
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "tool")
        .unwrap();
    assert_eq!(tool["content"], "done after 3 steps");
    // A replay (from the store) is what the live watcher saw.
    assert_eq!(server.events(&run_id, None).await, frames);
    server.stop().await;
}

async fn a_chatty_tool_is_rate_limited(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    // The default interval, 250 ms.
    let extra = mcp_toml("", None);
    let Some(server) = TestServer::start(backend, config_with(&fake.base_url(), &extra)).await
    else {
        return;
    };
    fake.push(Reply::sse(&tool_calls_stream(&[(
        "call_chatty",
        "progress",
        json!({"steps": 1000, "interval_ms": 1}),
    )])));
    fake.push(Reply::sse(&text_stream(&["done"])));
    let run_id = server.start_run("chatter", None).await;
    let frames = server.events(&run_id, None).await;
    assert_eq!(frames.last().unwrap().event, "run_completed");
    let finished = finished_of(&frames, "call_chatty");
    assert_eq!(
        finished["result"],
        json!({"Success": {"output": "done after 1000 steps"}})
    );
    let duration_ms = finished["duration_ms"].as_u64().unwrap();
    let progress = progress_of(&frames, "call_chatty");
    assert!(
        progress.len() as u64 <= duration_ms / 250 + 1,
        "{} tool_progress events in {duration_ms} ms",
        progress.len()
    );
    assert!(
        progress.len() >= 2,
        "a report at once and more as the interval passes: {} in {duration_ms} ms",
        progress.len()
    );
    // The tool reports a step a millisecond: the first report is logged at once (a step or
    // two in, on a loaded machine: the latest wins), not after the 250 ms interval (~250).
    let first = progress[0]["progress"].as_f64().unwrap();
    assert!(
        (1.0..50.0).contains(&first),
        "the first report is logged at once: step {first}"
    );
    // The latest wins: later events carry later steps.
    let steps: Vec<f64> = progress
        .iter()
        .map(|p| p["progress"].as_f64().unwrap())
        .collect();
    assert!(steps.windows(2).all(|w| w[0] < w[1]), "{steps:?}");
    server.stop().await;
}

/// A body sent in `chunks` 40 ms apart, with `content_type`.
fn streamed(content_type: &'static str, chunks: Vec<String>) -> Response {
    let body = futures::stream::iter(chunks).then(|chunk| async move {
        tokio::time::sleep(Duration::from_millis(40)).await;
        Ok::<_, Infallible>(chunk)
    });
    Response::builder()
        .header("content-type", content_type)
        .body(Body::from_stream(body))
        .unwrap()
}

/// HTTP tools that answer the same result plainly, as an event stream, as NDJSON, and an
/// event stream that ends in an error.
async fn streaming_tools() -> String {
    let app = axum::Router::new()
        .route(
            "/plain",
            post(|| async { axum::Json(json!({"answer": 42})) }),
        )
        .route(
            "/sse",
            post(|| async {
                streamed(
                    "text/event-stream",
                    vec![
                        "event: progress\ndata: {\"progress\":1,\"total\":2,\"message\":\"half\"}\n\n"
                            .to_owned(),
                        // Reports that do not read are skipped, never the result.
                        "event: progress\ndata: {\"progress\":1e999}\n\n".to_owned(),
                        "event: progress\ndata: not json\n\n".to_owned(),
                        ": a comment\n\nevent: progress\ndata: {\"progress\":2,\"total\":2}\n\n"
                            .to_owned(),
                        "event: result\ndata: {\"answer\":42}\n\n".to_owned(),
                    ],
                )
            }),
        )
        .route(
            "/ndjson",
            post(|| async {
                streamed(
                    "application/x-ndjson",
                    vec![
                        "{\"progress\":1,\"total\":2,\"message\":\"half\"}\n".to_owned(),
                        "{\"progress\":1e999}\n{\"progress\":\"NaN\"}\n".to_owned(),
                        "\n{\"progress\":2,\"total\":2}\n".to_owned(),
                        "{\"result\":{\"answer\":42}}\n".to_owned(),
                    ],
                )
            }),
        )
        .route(
            "/broken",
            post(|| async {
                streamed(
                    "text/event-stream",
                    vec![
                        "event: progress\ndata: {\"progress\":1,\"total\":2,\"message\":\"half\"}\n\n"
                            .to_owned(),
                        "event: error\ndata: disk full\n\n".to_owned(),
                    ],
                )
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let mut toml = "[runtime]\ntool_progress_interval_ms = 5\n".to_owned();
    for name in ["plain", "sse", "ndjson", "broken"] {
        toml.push_str(&format!(
            "[http_tools.{name}]\ndescription = \"Answers 42.\"\nurl = \"http://{addr}/{name}\"\n"
        ));
    }
    toml
}

async fn http_tools_stream_progress_and_the_same_result(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let extra = streaming_tools().await;
    let Some(server) = TestServer::start(backend, config_with(&fake.base_url(), &extra)).await
    else {
        return;
    };
    fake.push(Reply::sse(&tool_calls_stream(&[
        ("call_plain", "plain", json!({})),
        ("call_sse", "sse", json!({})),
        ("call_ndjson", "ndjson", json!({})),
        ("call_broken", "broken", json!({})),
    ])));
    fake.push(Reply::sse(&text_stream(&["42"])));
    let run_id = server.start_run("ask all four", None).await;
    let frames = server.events(&run_id, None).await;
    assert_eq!(frames.last().unwrap().event, "run_completed");
    let plain = finished_of(&frames, "call_plain")["result"].clone();
    assert_eq!(plain, json!({"Success": {"output": {"answer": 42}}}));
    assert!(progress_of(&frames, "call_plain").is_empty());
    for call in ["call_sse", "call_ndjson"] {
        assert_eq!(finished_of(&frames, call)["result"], plain, "{call}");
        let progress: Vec<Value> = progress_of(&frames, call)
            .into_iter()
            .map(|mut p| {
                for key in ["sequence", "run_id", "timestamp", "trace_id", "span_id"] {
                    p.as_object_mut().unwrap().remove(key);
                }
                p
            })
            .collect();
        assert_eq!(
            progress,
            [
                json!({"type": "tool_progress", "call_id": call, "progress": 1.0, "total": 2.0,
                       "message": "half"}),
                json!({"type": "tool_progress", "call_id": call, "progress": 2.0, "total": 2.0}),
            ],
            "{call}"
        );
    }
    let broken = finished_of(&frames, "call_broken");
    assert_eq!(progress_of(&frames, "call_broken").len(), 1);
    assert_eq!(
        broken["result"]["Failure"]["error"],
        "HTTP tool `broken`: disk full"
    );
    server.stop().await;
}

/// The built-in `wait` reports progress with the built-in model: what the README shows.
async fn the_built_in_wait_reports_progress(backend: Backend) {
    let config = behest::config::Config::from_toml(
        "builtin_tools = [\"wait\"]\n\
         [runtime]\ntool_progress_interval_ms = 50\n\
         [providers.demo]\nkind = \"scripted\"\ntoken_delay_ms = 1\n\
         [providers.demo.models.demo]\ncontext_window = 32768\nmax_output_tokens = 4096\n",
    )
    .unwrap();
    let Some(server) = TestServer::start(backend, config).await else {
        return;
    };
    let run = server
        .create_run(json!({
            "provider": "demo", "model": "demo",
            "input": "call wait {\"ms\": 600, \"steps\": 4}"
        }))
        .await;
    let run_id = run["run_id"].as_str().unwrap().to_owned();
    let frames = server.events(&run_id, None).await;
    assert_eq!(frames.last().unwrap().event, "run_completed");
    let call = frames
        .iter()
        .find(|f| f.event == "tool_execution_started")
        .unwrap()
        .json()["call_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let steps: Vec<(f64, String)> = progress_of(&frames, &call)
        .iter()
        .map(|p| {
            (
                p["progress"].as_f64().unwrap(),
                p["message"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    // Steps 150 ms apart, an interval of 50 ms: each is logged, but the last may be cut by
    // the result.
    assert!(steps.len() >= 3, "{steps:?}");
    assert_eq!(steps[0], (1.0, "waited 150 ms".to_owned()));
    assert_eq!(
        finished_of(&frames, &call)["result"],
        json!({"Success": {"output": {"waited_ms": 600}}})
    );
    server.stop().await;
}

on_both_backends!(
    the_built_in_wait_reports_progress,
    mcp_progress_reaches_a_watcher_live,
    a_chatty_tool_is_rate_limited,
    http_tools_stream_progress_and_the_same_result,
);
