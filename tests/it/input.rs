//! Strict, bounded input (issue 27, items 1a and 7), over HTTP against a real server on both
//! store backends: tool schemas that would never finish validating are refused at create (and
//! fail their calls plainly when they come from elsewhere), a deep but legal recursive schema
//! works; duplicate JSON keys, idempotency keys, the client-tool cap, `stop`, blank
//! instructions, a session's model without its provider, bodies on body-less POSTs and
//! `next_cursor` on every list.

use crate::support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use behest::config::{Config, HttpToolConfig};
use behest::tools::{ToolError, ToolRegistry};
use serde_json::{Value, json};
use support::db::Backend;
use support::fake_openai::{FakeOpenAi, Reply, text_stream, tool_calls_stream};
use support::server::{Frame, TestServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

/// Asserts a problem+json answer with `status` and `code` (and `field`, when given).
fn assert_problem(got: &(u16, String, Value), status: u16, code: &str, field: Option<&str>) {
    let (got_status, content_type, json) = got;
    assert_eq!(*got_status, status, "{json}");
    assert_eq!(content_type, "application/problem+json", "{json}");
    assert_eq!(json["code"], code, "{json}");
    if let Some(field) = field {
        assert_eq!(json["field"], field, "{json}");
    }
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

async fn client_tools_are_capped_at_128(backend: Backend) {
    let Some((fake, server)) = start(backend).await else {
        return;
    };
    let tools = |n: usize| -> Vec<Value> {
        (0..n)
            .map(|i| json!({"name": format!("t{i}"), "description": "A tool.", "parameters": {"type": "object"}}))
            .collect()
    };
    let body = |n: usize| json!({"provider": "fake", "model": "fake-model", "input": "hi", "tools": tools(n)});
    let (status, problem) = post(&server, "/runs", &body(129)).await;
    assert_eq!(status, 422, "{problem}");
    assert_eq!(problem["code"], "invalid_field");
    assert_eq!(problem["field"], "tools");
    assert!(
        problem["detail"].as_str().unwrap().contains("at most 128"),
        "{problem}"
    );
    assert_eq!(run_count(&server).await, 0);
    fake.push(Reply::sse(&text_stream(&["ok"])));
    let (status, created) = post(&server, "/runs", &body(128)).await;
    assert_eq!(status, 202, "{created}");
    let run = server
        .finished_run(created["run_id"].as_str().unwrap())
        .await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(
        fake.requests()[0].body["tools"].as_array().unwrap().len(),
        128
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

// ---------------------------------------------------------------------------------------------
// Item 7: strict, bounded input

async fn duplicate_keys_are_malformed_json(backend: Backend) {
    let Some((_fake, server)) = start(backend).await else {
        return;
    };
    let bodies = [
        (
            "/runs",
            r#"{"provider": "fake", "model": "fake-model", "input": "a", "input": "b"}"#,
        ),
        (
            "/runs",
            r#"{"provider": "fake", "model": "fake-model", "input": "a", "metadata": {"k": 1, "k": 2}}"#,
        ),
        ("/sessions", r#"{"title": "a", "title": "b"}"#),
        (
            "/sessions",
            r#"{"defaults": {"parameters": {"stop": ["x"], "stop": []}}}"#,
        ),
    ];
    for (path, body) in bodies {
        let got = send(&server, reqwest::Method::POST, path, Some(body), &[]).await;
        assert_problem(&got, 400, "malformed_json", None);
        assert!(
            got.2["detail"].as_str().unwrap().contains("given twice"),
            "{}",
            got.2
        );
    }
    let got = send(
        &server,
        reqwest::Method::PATCH,
        "/compaction",
        Some(r#"{"auto": true, "auto": false}"#),
        &[],
    )
    .await;
    assert_problem(&got, 400, "malformed_json", None);
    assert_eq!(run_count(&server).await, 0);
    assert!(
        server.get_json("/sessions").await["sessions"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    server.stop().await;
}

async fn idempotency_keys_are_bounded_visible_ascii(backend: Backend) {
    let Some((fake, server)) = start(backend).await else {
        return;
    };
    let body = r#"{"provider": "fake", "model": "fake-model", "input": "hi"}"#;
    let long = "k".repeat(256);
    let bad_headers: [&[u8]; 5] = [long.as_bytes(), b"", b"a b", b"a\tb", "clé".as_bytes()];
    for key in bad_headers {
        let got = send(
            &server,
            reqwest::Method::POST,
            "/runs",
            Some(body),
            &[("idempotency-key", key)],
        )
        .await;
        assert_problem(&got, 400, "invalid_header", Some("Idempotency-Key"));
        assert!(
            got.2["detail"].as_str().unwrap().contains("255"),
            "{}",
            got.2
        );
    }
    for key in [long.as_str(), "a b", "a\u{7f}", "clé", "a\tb"] {
        let got = send(
            &server,
            reqwest::Method::POST,
            "/runs",
            Some(&json!({"provider": "fake", "model": "fake-model", "input": "hi", "client_request_id": key}).to_string()),
            &[],
        )
        .await;
        assert_problem(&got, 422, "invalid_field", Some("client_request_id"));
    }
    assert_eq!(run_count(&server).await, 0);
    // The longest key, every visible character: accepted and kept as given.
    let visible: String = (b'!'..=b'~').map(char::from).collect();
    let key: String = visible.chars().cycle().take(255).collect();
    fake.push(Reply::sse(&text_stream(&["ok"])));
    let (status, _, created) = send(
        &server,
        reqwest::Method::POST,
        "/runs",
        Some(body),
        &[("idempotency-key", key.as_bytes())],
    )
    .await;
    assert_eq!(status, 202, "{created}");
    let run = server
        .finished_run(created["run_id"].as_str().unwrap())
        .await;
    assert_eq!(run["client_request_id"], key.as_str());
    // A control character in a header never reaches the app: under `axum::serve` (this test
    // server) hyper answers a bare 400; the binary's accept loop answers problem+json
    // (`net::refused_heads_and_repeated_headers_are_problem_json`).
    let mut stream = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let request = format!(
        "POST /runs HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         idempotency-key: a\u{1}b\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert_eq!(run_count(&server).await, 1);
    server.stop().await;
}

async fn newline_stop_is_accepted_except_for_anthropic(backend: Backend) {
    let Some((fake, server)) = start(backend).await else {
        return;
    };
    fake.push(Reply::sse(&text_stream(&["ok"])));
    let (status, created) = post(
        &server,
        "/runs",
        &json!({"provider": "fake", "model": "fake-model", "input": "hi", "stop": ["\n", "END"]}),
    )
    .await;
    assert_eq!(status, 202, "{created}");
    let run = server
        .finished_run(created["run_id"].as_str().unwrap())
        .await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(fake.requests()[0].body["stop"], json!(["\n", "END"]));
    let (status, problem) = post(
        &server,
        "/runs",
        &json!({"provider": "claude", "model": "fake-model", "input": "hi", "stop": ["\n"]}),
    )
    .await;
    assert_eq!(status, 422, "{problem}");
    assert_eq!(problem["code"], "invalid_field");
    assert_eq!(problem["field"], "stop");
    assert!(
        problem["detail"].as_str().unwrap().contains("Anthropic"),
        "{problem}"
    );
    let (status, problem) = post(
        &server,
        "/runs",
        &json!({"provider": "fake", "model": "fake-model", "input": "hi", "stop": [""]}),
    )
    .await;
    assert_eq!((status, problem["field"].as_str()), (422, Some("stop")));
    assert_eq!(run_count(&server).await, 1);
    server.stop().await;
}

async fn blank_instructions_and_a_model_without_provider_are_refused(backend: Backend) {
    let Some((_fake, server)) = start(backend).await else {
        return;
    };
    for blank in [" ", "\n\t "] {
        let (status, problem) = post(
            &server,
            "/runs",
            &json!({"provider": "fake", "model": "fake-model", "input": "hi", "instructions": blank}),
        )
        .await;
        assert_eq!(status, 422, "{problem}");
        assert_eq!(problem["code"], "invalid_field");
        assert_eq!(problem["field"], "instructions");
        let (status, problem) = post(
            &server,
            "/sessions",
            &json!({"defaults": {"instructions": blank}}),
        )
        .await;
        assert_eq!((status, problem["field"].as_str()), (422, Some("defaults")));
    }
    assert_eq!(run_count(&server).await, 0);
    let (status, problem) = post(
        &server,
        "/sessions",
        &json!({"defaults": {"model": "fake-model"}}),
    )
    .await;
    assert_eq!(status, 422, "{problem}");
    assert_eq!(problem["code"], "invalid_field");
    assert_eq!(problem["field"], "defaults");
    assert!(
        problem["detail"].as_str().unwrap().contains("provider"),
        "{problem}"
    );
    assert!(
        server.get_json("/sessions").await["sessions"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    let (status, session) = post(
        &server,
        "/sessions",
        &json!({"defaults": {"provider": "fake", "model": "fake-model", "instructions": ""}}),
    )
    .await;
    assert_eq!(status, 201, "{session}");
    server.stop().await;
}

async fn bodies_on_bodiless_posts_are_refused(backend: Backend) {
    let Some((fake, server)) = start(backend).await else {
        return;
    };
    fake.push(Reply::sse(&text_stream(&["ok"])));
    let (_, created) = post(
        &server,
        "/runs",
        &json!({"provider": "fake", "model": "fake-model", "input": "hi"}),
    )
    .await;
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    let session_id = created["session_id"].as_str().unwrap().to_owned();
    server.finished_run(&run_id).await;
    let paths = [
        format!("/runs/{run_id}/cancel"),
        format!("/sessions/{session_id}/compact"),
        "/compaction/circuit-breaker/reset".to_owned(),
    ];
    for path in &paths {
        for body in ["{}", "x", " "] {
            let got = send(&server, reqwest::Method::POST, path, Some(body), &[]).await;
            assert_problem(&got, 400, "unexpected_body", None);
        }
    }
    // Without a body each one answers as before.
    let answers = [409, 409, 200];
    for (path, expected) in paths.iter().zip(answers) {
        let (status, _, json) = send(&server, reqwest::Method::POST, path, None, &[]).await;
        assert_eq!(status, expected, "{path}: {json}");
    }
    server.stop().await;
}

async fn next_cursor_is_on_every_list(backend: Backend) {
    let Some((fake, server)) = start(backend).await else {
        return;
    };
    fake.push(Reply::sse(&text_stream(&["ok"])));
    fake.push(Reply::sse(&text_stream(&["ok"])));
    let mut session_id = String::new();
    for _ in 0..2 {
        let (_, created) = post(
            &server,
            "/runs",
            &json!({"provider": "fake", "model": "fake-model", "input": "hi"}),
        )
        .await;
        server
            .finished_run(created["run_id"].as_str().unwrap())
            .await;
        session_id = created["session_id"].as_str().unwrap().to_owned();
    }
    let lists = [
        "/runs",
        "/sessions",
        "/snapshots",
        &format!("/sessions/{session_id}/messages"),
    ];
    for list in lists {
        let last = server.get_json(list).await;
        assert!(
            last.get("next_cursor").is_some_and(Value::is_null),
            "{list}: {last}"
        );
        let first = server.get_json(&format!("{list}?limit=1")).await;
        assert!(first["next_cursor"].is_string(), "{list}: {first}");
    }
    server.stop().await;
}

on_both_backends!(
    cyclic_schemas_are_refused_at_create,
    recursive_schema_is_accepted_and_validates,
    client_tools_are_capped_at_128,
    duplicate_keys_are_malformed_json,
    idempotency_keys_are_bounded_visible_ascii,
    newline_stop_is_accepted_except_for_anthropic,
    blank_instructions_and_a_model_without_provider_are_refused,
    bodies_on_bodiless_posts_are_refused,
    next_cursor_is_on_every_list,
);

/// A path segment that is not UTF-8 once percent-decoded is `400 invalid_path` problem+json on
/// every route with an id (axum's own answer is plain text without a `code`).
#[tokio::test]
async fn non_utf8_path_segments_are_problems() {
    let Some((_fake, server)) = start(Backend::Sqlite).await else {
        return;
    };
    use reqwest::Method;
    for (method, path) in [
        (Method::GET, "/runs/%ff"),
        (Method::GET, "/runs/%ff/events"),
        (Method::GET, "/runs/%C0%AF/output"),
        (Method::POST, "/runs/%ff/cancel"),
        (Method::GET, "/sessions/%ff"),
        (Method::DELETE, "/sessions/%ff"),
        (Method::GET, "/snapshots/%ff"),
        (Method::GET, "/chat/%ff/stream"),
        (Method::POST, "/chat/%ff/stop"),
    ] {
        let got = send(&server, method.clone(), path, None, &[]).await;
        assert_eq!(got.2["code"], "invalid_path", "{method} {path}: {got:?}");
        assert_problem(&got, 400, "invalid_path", None);
    }
    server.stop().await;
}
