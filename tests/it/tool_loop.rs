//! The tool loop end to end: an MCP server over stdio (the `behest-mcp-fixture` binary) and an
//! HTTP tool, against the fake OpenAI server: multi-step loops, parallel calls committed in call
//! order, failures the model sees, truncation, allow-lists, and cancelling a hung tool.

use crate::support;

use std::path::Path;
use std::time::{Duration, Instant};

use axum::Json;
use axum::routing::post;
use serde_json::{Value, json};
use support::db::Backend;
use support::fake_openai::{FakeOpenAi, Reply, text_stream, tool_calls_stream};
use support::server::{Frame, TestServer, config_with};

const FIXTURE: &str = env!("CARGO_BIN_EXE_behest-mcp-fixture");

/// A local HTTP tool server: `POST /lookup {"key"}` → `{"key", "value"}`.
async fn lookup_server() -> String {
    let app = axum::Router::new().route(
        "/lookup",
        post(|Json(body): Json<Value>| async move {
            let key = body["key"].as_str().unwrap_or_default().to_owned();
            Json(json!({"key": key, "value": format!("value of {key}")}))
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/lookup")
}

fn tools_toml(log: &Path, lookup_url: &str, runtime: &str) -> String {
    format!(
        "[runtime]\n{runtime}\n\
         [mcp_servers.fixture]\ntransport = \"stdio\"\ncommand = \"{FIXTURE}\"\n\
         env = {{ BEHEST_MCP_FIXTURE_LOG = \"{}\" }}\n\
         [http_tools.lookup]\ndescription = \"Looks up a key.\"\nurl = \"{lookup_url}\"\n\
         parameters = {{ type = \"object\", properties = {{ key = {{ type = \"string\" }} }}, required = [\"key\"] }}\n",
        log.display()
    )
}

struct Setup {
    fake: FakeOpenAi,
    server: TestServer,
    log: tempfile::NamedTempFile,
}

async fn setup(backend: Backend, runtime: &str) -> Option<Setup> {
    let fake = FakeOpenAi::start().await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let extra = tools_toml(log.path(), &lookup_server().await, runtime);
    let server = TestServer::start(backend, config_with(&fake.base_url(), &extra)).await?;
    Some(Setup { fake, server, log })
}

fn kinds(frames: &[Frame]) -> Vec<String> {
    frames.iter().map(|f| f.event.clone()).collect()
}

fn by_call(frames: &[Frame], call: &str) -> Value {
    finished(frames)
        .into_iter()
        .find(|f| f["call_id"] == call)
        .unwrap()
}

fn finished(frames: &[Frame]) -> Vec<Value> {
    frames
        .iter()
        .filter(|f| f.event == "tool_execution_finished")
        .map(Frame::json)
        .collect()
}

async fn a_multi_step_loop_through_mcp_and_http_tools(backend: Backend) {
    let Some(Setup { fake, server, .. }) = setup(backend, "").await else {
        return;
    };
    fake.push(Reply::sse(&tool_calls_stream(&[(
        "call_add",
        "add",
        json!({"a": 2, "b": 3}),
    )])));
    fake.push(Reply::sse(&tool_calls_stream(&[(
        "call_lookup",
        "lookup",
        json!({"key": "k1"}),
    )])));
    fake.push(Reply::sse(&text_stream(&[
        "The sum is 5 ",
        "and k1 is known.",
    ])));

    let tools = server.get_json("/tools").await;
    let names: Vec<&str> = tools["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["add", "echo", "fail", "lookup", "sleep"]);
    let add = tools["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "add")
        .unwrap();
    assert_eq!(
        add["source"],
        json!({"kind": "mcp", "server": "fixture", "transport": "stdio"})
    );
    assert_eq!(add["parameters"]["required"], json!(["a", "b"]));

    let run_id = server.start_run("add 2 and 3, then look up k1", None).await;
    let frames = server.events(&run_id, None).await;
    let kinds = kinds(&frames);
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("run_completed"),
        "{kinds:?}"
    );
    assert_eq!(kinds.iter().filter(|k| *k == "model_started").count(), 3);
    let results = finished(&frames);
    assert_eq!(
        results[0]["result"],
        json!({"Success": {"output": {"sum": 5.0}}})
    );
    assert_eq!(
        results[1]["result"]["Success"]["output"],
        json!({"key": "k1", "value": "value of k1"})
    );
    for name in [
        "tool_call_started",
        "tool_call_completed",
        "tool_execution_started",
        "tool_message_committed",
    ] {
        assert_eq!(kinds.iter().filter(|k| *k == name).count(), 2, "{name}");
    }
    // Each call's arguments arrive in two fragments.
    assert_eq!(kinds.iter().filter(|k| *k == "tool_call_delta").count(), 4);
    let schema = support::schema::EventSchema::new();
    for frame in &frames {
        schema.check(&frame.json());
    }

    let requests = fake.requests();
    let offered: Vec<&str> = requests[0].body["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(offered, vec!["add", "echo", "fail", "lookup", "sleep"]);
    assert_eq!(requests[0].body["tool_choice"], "auto");
    let history = requests[2].body["messages"].as_array().unwrap();
    let roles: Vec<&str> = history
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(
        roles,
        vec!["user", "assistant", "tool", "assistant", "tool"]
    );
    assert_eq!(history[1]["tool_calls"][0]["function"]["name"], "add");
    assert_eq!(history[2]["tool_call_id"], "call_add");
    assert!(history[2]["content"].as_str().unwrap().contains("5"));
    assert_eq!(history[4]["tool_call_id"], "call_lookup");

    let run = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(
        (run["status"].as_str(), run["iterations"].as_u64()),
        (Some("completed"), Some(3))
    );
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(
        output["messages"].as_array().unwrap().len(),
        3,
        "three assistant messages"
    );
    server.stop().await;
}

async fn parallel_calls_are_committed_in_call_order(backend: Backend) {
    let Some(Setup { fake, server, .. }) = setup(backend, "").await else {
        return;
    };
    fake.push(Reply::sse(&tool_calls_stream(&[
        ("call_slow", "sleep", json!({"ms": 400})),
        ("call_fast", "add", json!({"a": 1, "b": 1})),
        ("call_bad", "add", json!({"a": "one"})),
        ("call_fail", "fail", json!({})),
        ("call_ghost", "no_such_tool", json!({})),
    ])));
    fake.push(Reply::sse(&text_stream(&["ok"])));
    let run_id = server.start_run("do all of it", None).await;
    let frames = server.events(&run_id, None).await;
    assert_eq!(
        frames.last().unwrap().event,
        "run_completed",
        "failures do not end the run"
    );
    let order: Vec<String> = finished(&frames)
        .iter()
        .map(|f| f["call_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        order.last().map(String::as_str),
        Some("call_slow"),
        "the slow call ran beside the others: {order:?}"
    );
    let results: Vec<Value> = finished(&frames);
    let by_id = |id: &str| results.iter().find(|r| r["call_id"] == id).unwrap()["result"].clone();
    assert!(
        by_id("call_bad")["Failure"]["error"]
            .as_str()
            .unwrap()
            .contains("invalid arguments")
    );
    assert!(
        by_id("call_fail")["Failure"]["error"]
            .as_str()
            .unwrap()
            .contains("always fails")
    );
    assert!(
        by_id("call_ghost")["Failure"]["error"]
            .as_str()
            .unwrap()
            .contains("no_such_tool")
    );
    assert_eq!(by_id("call_slow"), json!({"Success": {"output": "slept"}}));
    // The model gets the results in its own call order.
    let history = fake.requests()[1].body["messages"].clone();
    let answered: Vec<&str> = history
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["tool_call_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        answered,
        vec![
            "call_slow",
            "call_fast",
            "call_bad",
            "call_fail",
            "call_ghost"
        ]
    );
    server.stop().await;
}

async fn cancelling_a_hung_tool_leaves_a_usable_session(backend: Backend) {
    let Some(Setup { fake, server, log }) = setup(backend, "").await else {
        return;
    };
    fake.push(Reply::sse(&tool_calls_stream(&[
        ("call_hang", "sleep", json!({"ms": 60_000})),
        ("call_add", "add", json!({"a": 1, "b": 2})),
    ])));
    let run_id = server.start_run("hang", None).await;
    // Wait for the tool to be running.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let lines = std::fs::read_to_string(log.path()).unwrap_or_default();
        if lines.contains("called sleep") {
            break;
        }
        assert!(Instant::now() < deadline, "the sleep tool was called");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let started = Instant::now();
    let response = server
        .client
        .post(server.url(&format!("/runs/{run_id}/cancel?wait=true")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "cancelled within 1 s: {:?}",
        started.elapsed()
    );
    let record: Value = response.json().await.unwrap();
    assert_eq!(record["status"], "cancelled");
    let frames = server.events(&run_id, None).await;
    assert_eq!(
        frames.iter().filter(|f| f.event == "run_cancelled").count(),
        1
    );
    assert_eq!(frames.last().unwrap().event, "run_cancelled");
    // Every execution started has exactly one `tool_execution_finished`, the cancelled one's
    // (a cancelled Failure) before any tool message.
    for call in ["call_hang", "call_add"] {
        let count = |kind: &str| {
            frames
                .iter()
                .filter(|f| f.event == kind && f.json()["call_id"] == call)
                .count()
        };
        assert_eq!(count("tool_execution_started"), 1, "{call}");
        assert_eq!(count("tool_execution_finished"), 1, "{call}");
    }
    let position = |kind: &str| frames.iter().position(|f| f.event == kind).unwrap();
    assert!(
        position("tool_message_committed")
            > frames
                .iter()
                .rposition(|f| f.event == "tool_execution_finished")
                .unwrap()
    );
    assert!(
        by_call(&frames, "call_hang")["result"]["Failure"]["error"]
            .as_str()
            .unwrap()
            .starts_with("cancelled")
    );
    // The MCP server was told.
    let deadline = Instant::now() + Duration::from_secs(2);
    while !std::fs::read_to_string(log.path())
        .unwrap_or_default()
        .contains("cancelled")
    {
        assert!(
            Instant::now() < deadline,
            "the MCP server got notifications/cancelled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Every call has a result, marked cancelled where the tool did not finish.
    let session = record["session_id"].as_str().unwrap();
    let messages = server
        .get_json(&format!("/sessions/{session}/messages"))
        .await;
    let tool_messages: Vec<&Value> = messages["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .collect();
    assert_eq!(tool_messages.len(), 2);
    let hang = tool_messages
        .iter()
        .find(|m| m["tool_call_id"] == "call_hang")
        .unwrap();
    assert!(
        hang["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("cancelled")
    );
    // Another cancel of the cancelled run: the same answer (idempotent).
    server.cancel_again(&run_id).await;

    // The session's next run succeeds, and the model sees a valid history.
    fake.push(Reply::sse(&text_stream(&["Back again."])));
    let next = server.start_run("are you there?", Some(session)).await;
    let run = server.finished_run(&next).await;
    assert_eq!(run["status"], "completed");
    let history = fake.requests().last().unwrap().body["messages"].clone();
    let roles: Vec<&str> = history
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, vec!["user", "assistant", "tool", "tool", "user"]);
    server.stop().await;
}

async fn a_shutdown_leaves_a_run_mid_tool_resumable(backend: Backend) {
    let Some(Setup { fake, server, log }) = setup(backend, "").await else {
        return;
    };
    fake.push(Reply::sse(&tool_calls_stream(&[(
        "call_hang",
        "sleep",
        json!({"ms": 60_000}),
    )])));
    let run_id = server.start_run("hang", None).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(log.path())
        .unwrap_or_default()
        .contains("called sleep")
    {
        assert!(Instant::now() < deadline, "the sleep tool was called");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The grace passes with the tool still running: the run stops where it is, resumable —
    // nothing terminal is written.
    server.runtime.shutdown(Duration::from_millis(100)).await;
    let run = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "waiting_for_tools", "{run}");
    let store = server.runtime.store().clone();
    let logged = store
        .read_events(run_id.parse().unwrap(), 0, 1000)
        .await
        .unwrap();
    assert!(logged.iter().all(|e| !e.terminal), "no terminal event");

    // The next process takes it over: the cut-off call (not idempotent) is answered as
    // interrupted, not executed again, and the loop goes on to the model's answer.
    fake.push(Reply::sse(&text_stream(&[
        "Sorry, ",
        "the sleep was cut off.",
    ])));
    let extra = tools_toml(log.path(), &lookup_server().await, "");
    let next = TestServer::on_store(store, config_with(&fake.base_url(), &extra), None).await;
    assert_eq!(next.runtime.recover().await.unwrap(), 1);
    let frames = next.events(&run_id, None).await;
    let kinds = kinds(&frames);
    assert_eq!(frames.last().unwrap().event, "run_completed", "{kinds:?}");
    let resumed = kinds.iter().position(|k| k == "run_resumed").unwrap();
    assert_eq!(frames[resumed].json()["abandoned_after"], Value::Null);
    assert_eq!(frames[resumed].json()["iteration"], 2);
    let finished = kinds
        .iter()
        .position(|k| k == "tool_execution_finished")
        .expect("the cut-off execution gets its tool_execution_finished");
    assert!(resumed < finished, "{kinds:?}");
    let committed = kinds
        .iter()
        .position(|k| k == "tool_message_committed")
        .unwrap();
    assert!(finished < committed, "{kinds:?}");
    assert_eq!(
        kinds
            .iter()
            .filter(|k| *k == "tool_execution_started")
            .count(),
        1
    );
    assert!(
        by_call(&frames, "call_hang")["result"]["Failure"]["error"]
            .as_str()
            .unwrap()
            .starts_with("interrupted")
    );
    let calls = std::fs::read_to_string(log.path()).unwrap();
    assert_eq!(calls.matches("called sleep").count(), 1, "{calls}");
    for (at, frame) in frames.iter().enumerate() {
        assert_eq!(frame.sequence(), at as u64 + 1, "contiguous");
    }
    // The model's second request answers the call once, as interrupted.
    let history = fake.requests().last().unwrap().body["messages"].clone();
    let tool = history
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "tool")
        .unwrap()
        .clone();
    assert!(
        tool["content"].as_str().unwrap().contains("interrupted"),
        "{tool}"
    );
    next.stop().await;
    server.stop().await;
}

on_both_backends!(
    a_multi_step_loop_through_mcp_and_http_tools,
    parallel_calls_are_committed_in_call_order,
    cancelling_a_hung_tool_leaves_a_usable_session,
    a_shutdown_leaves_a_run_mid_tool_resumable,
);

#[tokio::test]
async fn timeouts_truncation_allow_lists_and_tool_choice() {
    let runtime = "tool_timeout_ms = 300\nmax_tool_output_bytes = 40\n";
    let Setup { fake, server, .. } = setup(Backend::Sqlite, runtime).await.unwrap();
    let long = "é".repeat(30); // 60 bytes: cut inside the budget on a character boundary
    fake.push(Reply::sse(&tool_calls_stream(&[
        ("call_sleep", "sleep", json!({"ms": 5_000})),
        ("call_echo", "echo", json!({"text": long})),
        ("call_lookup", "lookup", json!({"key": "k"})),
    ])));
    fake.push(Reply::sse(&text_stream(&["done"])));
    let body = json!({"provider": "fake", "model": "fake-model", "input": "go",
                      "tools": ["sleep", "echo"], "tool_choice": "required"});
    let run_id = server.create_run(body).await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let frames = server.events(&run_id, None).await;
    assert_eq!(frames.last().unwrap().event, "run_completed");
    let results = finished(&frames);
    let by_id = |id: &str| results.iter().find(|r| r["call_id"] == id).unwrap()["result"].clone();
    assert!(
        by_id("call_sleep")["Failure"]["error"]
            .as_str()
            .unwrap()
            .contains("timed out after 300 ms")
    );
    let echoed = by_id("call_echo")["Success"]["output"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(echoed.starts_with(&"é".repeat(20)), "{echoed}");
    assert!(
        echoed.contains("[truncated: 20 of 60 bytes cut]"),
        "{echoed}"
    );
    assert!(
        by_id("call_lookup")["Failure"]["error"]
            .as_str()
            .unwrap()
            .contains("is not available to")
    );
    // A failure is cut to the budget like an output.
    assert!(
        by_id("call_lookup")["Failure"]["error"]
            .as_str()
            .unwrap()
            .contains("[truncated: "),
        "{:?}",
        by_id("call_lookup")
    );
    let request = &fake.requests()[0].body;
    assert_eq!(request["tool_choice"], "required");
    // A forced choice applies to the first model call only.
    assert_eq!(fake.requests()[1].body["tool_choice"], "auto");
    let offered: Vec<&str> = request["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(offered, vec!["sleep", "echo"]);
    server.stop().await;
}

/// An Anthropic Messages stream in which the model calls `name` with `input`, the input
/// streamed as two `input_json_delta` pieces.
fn anthropic_tool_use(id: &str, name: &str, input: &Value) -> Vec<u8> {
    use support::fake_anthropic::{event, message_end, message_start};
    let text = input.to_string();
    let (head, tail) = text.split_at(text.len() / 2);
    let mut body = message_start(30);
    body.push_str(&event(&json!({"type": "content_block_start", "index": 0,
        "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}})));
    for piece in [head, tail] {
        body.push_str(&event(&json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": piece}})));
    }
    body.push_str(&event(&json!({"type": "content_block_stop", "index": 0})));
    body.push_str(&message_end("tool_use", 12));
    body.into_bytes()
}

#[tokio::test]
async fn a_tool_loop_over_the_anthropic_wire_format() {
    let fake = FakeOpenAi::start().await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let toml = format!(
        "{}\n[providers.claude]\nkind = \"anthropic\"\nbase_url = \"{}\"\n\
         [providers.claude.retry]\nmax_attempts = 1\n\
         [providers.claude.models.fake-model]\ncontext_window = 200000\nmax_output_tokens = 1024\n",
        tools_toml(log.path(), &lookup_server().await, ""),
        fake.base_url()
    );
    let config = behest::config::Config::from_toml(&toml).unwrap();
    let server = TestServer::start(Backend::Sqlite, config).await.unwrap();
    fake.push(Reply::sse(&anthropic_tool_use(
        "toolu_add",
        "add",
        &json!({"a": 20, "b": 22}),
    )));
    fake.push(Reply::sse(&support::fake_anthropic::text_stream(&[
        "It is ", "42.",
    ])));
    let body =
        json!({"provider": "claude", "model": "fake-model", "input": "20 + 22?", "tools": ["add"]});
    let run_id = server.create_run(body).await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let run = server.finished_run(&run_id).await;
    assert_eq!(
        (run["status"].as_str(), run["iterations"].as_u64()),
        (Some("completed"), Some(2))
    );
    let requests = fake.requests();
    assert_eq!(requests[0].path, "/v1/messages");
    assert_eq!(requests[0].body["tools"][0]["name"], "add");
    assert_eq!(
        requests[0].body["tools"][0]["input_schema"]["required"],
        json!(["a", "b"])
    );
    assert_eq!(requests[0].body["tool_choice"], json!({"type": "auto"}));
    let messages = &requests[1].body["messages"];
    assert_eq!(
        messages[1]["content"][0],
        json!({"type": "tool_use", "id": "toolu_add", "name": "add", "input": {"a": 20, "b": 22}})
    );
    let result = &messages[2]["content"][0];
    assert_eq!(
        (result["type"].as_str(), result["tool_use_id"].as_str()),
        (Some("tool_result"), Some("toolu_add"))
    );
    assert!(result["content"].to_string().contains("42"), "{result}");
    assert!(result.get("is_error").is_none());
    server.stop().await;
}
