//! Strict, bounded input (issue 27, item 1a), over HTTP against a real server on both store
//! backends: tool schemas that would never finish validating are refused at create (and fail
//! their calls plainly when they come from elsewhere), a deep but legal recursive schema works.

use crate::support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use behest::config::{Config, HttpToolConfig};
use behest::tools::{ToolError, ToolRegistry};
use serde_json::{Value, json};
use support::db::Backend;
use support::fake_openai::{FakeOpenAi, Reply, text_stream, tool_calls_stream};
use support::server::{Frame, TestServer};

/// Providers `fake` (OpenAI Chat Completions) and `claude` (Anthropic Messages) at the fake's
/// base URL, each with the model `fake-model`.
fn config(base_url: &str) -> Config {
    let provider = |id: &str, kind: &str| {
        format!(
            "[providers.{id}]\nkind = \"{kind}\"\nbase_url = \"{base_url}\"\n\
             [providers.{id}.timeouts]\nconnect_ms = 2000\nfirst_byte_ms = 5000\nidle_ms = 5000\ntotal_ms = 20000\n\
             [providers.{id}.retry]\nmax_attempts = 1\n\
             [providers.{id}.models.fake-model]\ncontext_window = 128000\nmax_output_tokens = 1024\n"
        )
    };
    let toml = format!(
        "{}{}",
        provider("fake", "openai"),
        provider("claude", "anthropic")
    );
    Config::from_toml(&toml).expect("test config")
}

async fn start(backend: Backend) -> Option<(FakeOpenAi, TestServer)> {
    let fake = FakeOpenAi::start().await;
    let server = TestServer::start(backend, config(&fake.base_url())).await?;
    Some((fake, server))
}

/// `method path` with a raw body (as JSON) and extra headers: status, content type, JSON.
async fn send(
    server: &TestServer,
    method: reqwest::Method,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &[u8])],
) -> (u16, String, Value) {
    let mut request = server.client.request(method, server.url(path));
    if let Some(body) = body {
        request = request
            .header("content-type", "application/json")
            .body(body.to_owned());
    }
    for (name, value) in headers {
        request = request.header(
            *name,
            reqwest::header::HeaderValue::from_bytes(value).unwrap(),
        );
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let json = response.json().await.unwrap_or(Value::Null);
    (status, content_type, json)
}

async fn post(server: &TestServer, path: &str, body: &Value) -> (u16, Value) {
    let (status, _, json) = send(
        server,
        reqwest::Method::POST,
        path,
        Some(&body.to_string()),
        &[],
    )
    .await;
    (status, json)
}

async fn run_count(server: &TestServer) -> usize {
    server.get_json("/runs").await["runs"]
        .as_array()
        .unwrap()
        .len()
}

async fn wait_for(server: &TestServer, run_id: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let run = server.get_json(&format!("/runs/{run_id}")).await;
        if done(&run) {
            return run;
        }
        assert!(Instant::now() < deadline, "the run never got there: {run}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn run_with_tool(parameters: Value) -> Value {
    json!({"provider": "fake", "model": "fake-model", "input": "go",
           "tools": [{"name": "walk", "description": "Walks a tree.", "parameters": parameters}]})
}

// ---------------------------------------------------------------------------------------------
// Item 1(a): no poison schemas

async fn cyclic_schemas_are_refused_at_create(backend: Backend) {
    let Some((_fake, server)) = start(backend).await else {
        return;
    };
    let cycles = [
        json!({"type": "object", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}),
        json!({"type": "object", "allOf": [{"$ref": "#"}]}),
        json!({"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
               "$defs": {"a": {"anyOf": [{"not": {"$ref": "#/$defs/a"}}]}}}),
    ];
    for schema in cycles {
        let (status, problem) = post(&server, "/runs", &run_with_tool(schema.clone())).await;
        assert_eq!(status, 422, "{schema}: {problem}");
        assert_eq!(problem["code"], "invalid_field", "{problem}");
        assert_eq!(problem["field"], "tools", "{problem}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains("cycle"), "{detail}");
        for internal in ["ValidationError", "{ ", "Error {", "kind:"] {
            assert!(!detail.contains(internal), "{detail}");
        }
    }
    // A schema that is not one at all says why in words too.
    let (status, problem) = post(
        &server,
        "/runs",
        &run_with_tool(json!({"type": "object", "properties": {"a": {"type": "wat"}}})),
    )
    .await;
    assert_eq!((status, problem["field"].as_str()), (422, Some("tools")));
    assert!(
        !problem["detail"]
            .as_str()
            .unwrap()
            .contains("ValidationError"),
        "{problem}"
    );
    // Too large.
    let many: serde_json::Map<String, Value> = (0..10_001)
        .map(|i| (format!("p{i}"), json!(true)))
        .collect();
    let (status, problem) = post(
        &server,
        "/runs",
        &run_with_tool(json!({"type": "object", "properties": many})),
    )
    .await;
    assert_eq!(status, 422, "{problem}");
    assert!(
        problem["detail"].as_str().unwrap().contains("10000"),
        "{problem}"
    );
    assert_eq!(run_count(&server).await, 0);
    server.stop().await;
}

async fn recursive_schema_is_accepted_and_validates(backend: Backend) {
    let Some((fake, server)) = start(backend).await else {
        return;
    };
    let tree = json!({
        "type": "object",
        "$ref": "#/$defs/node",
        "$defs": {"node": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}
            }
        }}
    });
    let mut deep = json!({"name": "leaf"});
    for depth in 0..40 {
        deep = json!({"name": format!("n{depth}"), "children": [deep]});
    }
    let bad = json!({"name": "root", "children": [{"name": "a", "children": [{"name": 7}]}]});
    fake.push(Reply::sse(&tool_calls_stream(&[
        ("call_ok", "walk", deep.clone()),
        ("call_bad", "walk", bad),
    ])));
    fake.push(Reply::sse(&text_stream(&["walked"])));
    let (status, created) = post(&server, "/runs", &run_with_tool(tree)).await;
    assert_eq!(status, 202, "{created}");
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    let run = wait_for(&server, &run_id, |run| run["status"] == "requires_action").await;
    let calls: Vec<&str> = run["required_action"]["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["call_id"].as_str().unwrap())
        .collect();
    assert_eq!(calls, ["call_ok"], "{run}");
    assert_eq!(run["required_action"]["tool_calls"][0]["arguments"], deep);
    let (status, answer) = post(
        &server,
        &format!("/runs/{run_id}/tool_outputs"),
        &json!({"tool_outputs": [{"call_id": "call_ok", "output": "done"}]}),
    )
    .await;
    assert_eq!(status, 202, "{answer}");
    let run = server.finished_run(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    let frames = server.events(&run_id, None).await;
    let failure = frames
        .iter()
        .filter(|f| f.event == "tool_execution_finished")
        .map(Frame::json)
        .find(|f| f["call_id"] == "call_bad")
        .unwrap();
    let error = failure["result"]["Failure"]["error"].as_str().unwrap();
    assert!(
        error.starts_with("invalid arguments for `walk`")
            && error.contains("/children/0/children/0/name"),
        "{error}"
    );
    server.stop().await;
}

/// An HTTP tool (the same path as an MCP server's) whose schema has a cycle: the server starts,
/// the tool is listed, and each call fails with the reason, without calling the tool.
#[tokio::test]
async fn a_configured_tool_with_a_cyclic_schema_fails_its_calls_plainly() {
    let tool = HttpToolConfig {
        idempotent: false,
        requires_approval: false,
        description: "Loops.".to_owned(),
        // Nothing listens there: the call must not get that far.
        url: "http://127.0.0.1:9/loop".to_owned(),
        parameters: json!({"type": "object", "allOf": [{"$ref": "#"}]}),
        headers: BTreeMap::new(),
    };
    let registry = ToolRegistry::connect(
        &BTreeMap::new(),
        &BTreeMap::from([("loop".to_owned(), tool)]),
    )
    .await
    .unwrap();
    assert!(registry.contains("loop"));
    let started = Instant::now();
    let result = registry.call("loop", &json!({"x": 1})).await;
    let Err(ToolError::InvalidArguments { tool, reason }) = result else {
        panic!("{result:?}");
    };
    assert_eq!(tool, "loop");
    assert!(reason.contains("cycle"), "{reason}");
    assert!(started.elapsed() < Duration::from_secs(1));
}

on_both_backends!(
    cyclic_schemas_are_refused_at_create,
    recursive_schema_is_accepted_and_validates,
);
