//! The API contract against the running server: every constraint the OpenAPI document states
//! on the create body and on query parameters is probed at its boundary (just inside accepted,
//! just outside rejected naming the field), driven by the document itself; plus the limits the
//! document describes in words (metadata size, page byte budget, cursor grammar), NUL
//! characters on both backends, and concurrent cancels.

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::db::Backend;
use support::fake_openai::{FakeOpenAi, Reply, chunk, text_stream, tool_calls_stream};
use support::server::{TestServer, config_for, config_with};

fn spec() -> Value {
    serde_json::to_value(behest::api::openapi()).unwrap()
}

/// Resolves a `$ref` to `#/components/schemas/…`.
fn resolve<'a>(spec: &'a Value, schema: &'a Value) -> &'a Value {
    match schema["$ref"].as_str() {
        Some(reference) => {
            let name = reference.trim_start_matches("#/components/schemas/");
            &spec["components"]["schemas"][name]
        }
        None => schema,
    }
}

fn base_body() -> Value {
    json!({"provider": "fake", "model": "fake-model", "input": "hi"})
}

/// POSTs `body` to `/runs`; returns status and JSON.
async fn post_run(server: &TestServer, body: &Value) -> (u16, Value) {
    let response = server
        .client
        .post(server.url("/runs"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// Whether the answer rejects `field` for its shape (422 `missing_field`, `invalid_field` or
/// `invalid_body` naming it; `unknown_provider` and the like judge the value, not its shape).
fn rejects(status: u16, problem: &Value, field: &str) -> bool {
    let shape = ["missing_field", "invalid_field", "invalid_body"]
        .iter()
        .any(|code| problem["code"] == *code);
    status == 422 && shape && problem["field"] == field
}

/// Strings to try against a `pattern`: the regex decides which the server must accept.
const PATTERN_PROBES: [&str; 13] = [
    "", "0", "5", "42", "x", " x ", " ", "\t\n", "+5", " 5", "5.0", "-1", "1e3",
];

/// Every constraint of the create bodies (`CreateRunRequest` on `POST /runs`,
/// `CreateSessionRequest` on `POST /sessions`) in the document, at its boundaries: `required`,
/// `minLength`/`maxLength`, `minimum`/`maximum` (integers ±1, numbers also ±0.5), `pattern`,
/// `maxItems`.
async fn create_body_constraints_hold_at_their_boundaries(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    for _ in 0..64 {
        fake.push(Reply::sse(&text_stream(&["ok"])));
    }
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let spec = spec();
    let mut checked = 0;
    for (component, path, base) in [
        ("CreateRunRequest", "/runs", base_body()),
        ("CreateSessionRequest", "/sessions", json!({})),
    ] {
        let schema = &spec["components"]["schemas"][component];
        let post = |body: Value| {
            let server = &server;
            async move {
                let response = server
                    .client
                    .post(server.url(path))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                let status = response.status().as_u16();
                (
                    status,
                    response.json::<Value>().await.unwrap_or(Value::Null),
                )
            }
        };
        for required in schema["required"].as_array().into_iter().flatten() {
            let field = required.as_str().unwrap();
            let mut body = base.clone();
            body.as_object_mut().unwrap().remove(field);
            let (status, problem) = post(body).await;
            assert!(
                rejects(status, &problem, field),
                "{component} without {field}: {problem}"
            );
            assert_eq!(problem["code"], "missing_field");
            checked += 1;
        }
        for (field, property) in schema["properties"].as_object().unwrap() {
            let property = resolve(&spec, property);
            let number = property["type"] == "number"
                || property["type"]
                    .as_array()
                    .is_some_and(|types| types.contains(&json!("number")));
            let mut probes: Vec<(Value, bool)> = Vec::new();
            if let Some(min) = property["minLength"].as_u64() {
                let min = min as usize;
                probes.push((json!("x".repeat(min)), true));
                if min > 0 {
                    probes.push((json!("x".repeat(min - 1)), false));
                }
            }
            if let Some(max) = property["maxLength"].as_u64() {
                probes.push((json!("x".repeat(max as usize)), true));
                probes.push((json!("x".repeat(max as usize + 1)), false));
            }
            if let Some(min) = property["minimum"].as_i64() {
                probes.push((json!(min), true));
                probes.push((json!(min - 1), false));
                if number {
                    probes.push((json!(min as f64 + 0.5), true));
                    probes.push((json!(min as f64 - 0.5), false));
                }
            }
            if let Some(max) = property["maximum"].as_i64() {
                probes.push((json!(max), true));
                probes.push((json!(max + 1), false));
                if number {
                    probes.push((json!(max as f64 - 0.5), true));
                    probes.push((json!(max as f64 + 0.5), false));
                }
            }
            if let Some(pattern) = property["pattern"].as_str() {
                let regex = regex::Regex::new(pattern).unwrap();
                for probe in PATTERN_PROBES {
                    probes.push((json!(probe), regex.is_match(probe)));
                }
            }
            if let Some(max) = property["maxItems"].as_u64() {
                probes.push((json!(vec!["x"; max as usize]), true));
                probes.push((json!(vec!["x"; max as usize + 1]), false));
            }
            for (value, inside) in probes {
                let mut body = base.clone();
                body[field] = value.clone();
                let (status, problem) = post(body).await;
                assert_eq!(
                    !rejects(status, &problem, field),
                    inside,
                    "{component}.{field} = {value}: {status} {problem}"
                );
                checked += 1;
            }
        }
    }
    // input (required, minLength, pattern), provider and model (minLength), agent,
    // max_iterations, max_output_tokens, temperature and top_p (both as numbers),
    // action_timeout_ms, stop (maxItems); a session's title.
    assert!(
        checked >= 1 + 2 + PATTERN_PROBES.len() + 4 + 1 + 4 + 2 + 2 * 8 + 4 + 2 + 2,
        "{checked}"
    );
    server.stop().await;
}

/// Every query parameter of the document with `minimum`/`maximum`/`pattern`, at its
/// boundaries; rejected values are 400 naming the parameter.
async fn query_constraints_hold_at_their_boundaries(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&text_stream(&["ok"])));
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let run_id = server.start_run("hi", None).await;
    let session_id = server.finished_run(&run_id).await["session_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let spec = spec();
    let mut checked = 0;
    for (path, item) in spec["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            for parameter in operation["parameters"].as_array().into_iter().flatten() {
                if parameter["in"] != "query" {
                    continue;
                }
                let name = parameter["name"].as_str().unwrap();
                let schema = resolve(&spec, &parameter["schema"]);
                let mut probes: Vec<(String, bool)> = Vec::new();
                if let Some(min) = schema["minimum"].as_i64() {
                    probes.push((min.to_string(), true));
                    probes.push(((min - 1).to_string(), false));
                }
                if let Some(max) = schema["maximum"].as_i64() {
                    probes.push((max.to_string(), true));
                    probes.push(((max + 1).to_string(), false));
                }
                if let Some(pattern) = schema["pattern"].as_str() {
                    let regex = regex::Regex::new(pattern).unwrap();
                    for probe in PATTERN_PROBES {
                        probes.push((probe.to_owned(), regex.is_match(probe)));
                    }
                }
                let uri = path
                    .replace("{run_id}", &run_id)
                    .replace("{session_id}", &session_id);
                for (value, inside) in probes {
                    let request = match method.as_str() {
                        "get" => server.client.get(server.url(&uri)),
                        "post" => server.client.post(server.url(&uri)),
                        other => panic!("{other} with query parameters"),
                    };
                    let response = request.query(&[(name, &value)]).send().await.unwrap();
                    let status = response.status().as_u16();
                    let body = if status >= 400 {
                        response.json::<Value>().await.unwrap()
                    } else {
                        Value::Null
                    };
                    let rejected = status == 400 && body["field"] == name;
                    assert_eq!(
                        !rejected, inside,
                        "{method} {path}?{name}={value:?}: {status} {body}"
                    );
                    if !inside {
                        assert!(
                            operation["responses"]["400"].is_object(),
                            "{method} {path} documents its 400"
                        );
                    }
                    checked += 1;
                }
            }
        }
    }
    // limit on /runs, /sessions and /sessions/{id}/messages (4 each), last_event_id's pattern.
    assert!(checked >= 12 + PATTERN_PROBES.len(), "{checked}");
    server.stop().await;
}

/// The document says what it must: license identifier, problem+json on every error, the SSE
/// item schema, a named object form of `ToolChoice`.
#[test]
fn the_document_states_license_errors_events_and_tool_choice() {
    let spec = spec();
    assert_eq!(spec["info"]["license"]["identifier"], "MIT OR Apache-2.0");
    let schemas = &spec["components"]["schemas"];
    let choices: Vec<&str> = schemas["ToolChoice"]["oneOf"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["$ref"].as_str().unwrap())
        .collect();
    assert_eq!(
        choices,
        [
            "#/components/schemas/ToolChoiceMode",
            "#/components/schemas/ToolChoiceTool"
        ]
    );
    assert_eq!(schemas["ToolChoiceTool"]["required"], json!(["name"]));
    let mut streams = 0;
    let mut frontend_streams = 0;
    for (path, item) in spec["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            let responses = operation["responses"].as_object().unwrap();
            assert!(
                responses.contains_key("500"),
                "{method} {path} documents 500"
            );
            for (status, response) in responses {
                let content = response["content"].as_object();
                if status.starts_with('4') || status.starts_with('5') {
                    let problem = &content.unwrap()["application/problem+json"]["schema"];
                    assert_eq!(problem["$ref"], "#/components/schemas/Problem", "{path}");
                }
                if let Some(sse) = content.and_then(|c| c.get("text/event-stream")) {
                    let data = &sse["x-itemSchema"]["properties"]["data"];
                    if path == "/chat" || path.starts_with("/chat/") || path == "/ag-ui" {
                        // The AI SDK's and AG-UI's frames: `id` and `data`, no `event`.
                        assert_eq!(data["type"], "string", "{path}");
                        assert_eq!(sse["x-itemSchema"]["required"], json!(["data"]), "{path}");
                        frontend_streams += 1;
                        continue;
                    }
                    assert_eq!(data["contentMediaType"], "application/json");
                    assert_eq!(
                        data["contentSchema"]["$ref"],
                        "#/components/schemas/AgentEvent"
                    );
                    streams += 1;
                }
            }
        }
    }
    assert_eq!(streams, 2, "POST /runs/stream and GET /runs/{{id}}/events");
    assert_eq!(
        frontend_streams, 3,
        "POST /chat, GET /chat/{{chat_id}}/stream and POST /ag-ui"
    );
}

/// Readable errors: blank input, NUL characters, non-object bodies, wrong types; never serde's
/// words; no record left behind.
async fn bad_bodies_get_readable_422s(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let with = |field: &str, value: Value| {
        let mut body = base_body();
        body[field] = value;
        body
    };
    for (body, field) in [
        (with("input", json!(" \n\t")), "input"),
        (with("input", json!("a\u{0}b")), "input"),
        (
            with("client_request_id", json!("key\u{0}")),
            "client_request_id",
        ),
        (with("metadata", json!({"k\u{0}": 1})), "metadata"),
        (with("metadata", json!({"k": ["v\u{0}"]})), "metadata"),
        (with("metadata", json!("text")), "metadata"),
    ] {
        let (status, problem) = post_run(&server, &body).await;
        assert_eq!(
            (status, problem["code"].as_str()),
            (422, Some("invalid_field"))
        );
        assert_eq!(problem["field"], field, "{problem}");
    }
    for (body, field) in [
        (json!([base_body()]), None),
        (json!("hi"), None),
        (json!(null), None),
        (with("input", json!(3)), Some("input")),
        (with("tool_choice", json!(5)), Some("tool_choice")),
        (
            with("tool_choice", json!({"tool": "x"})),
            Some("tool_choice"),
        ),
        (with("max_iterations", json!(-1)), Some("max_iterations")),
        (with("max_iterations", json!("3")), Some("max_iterations")),
        (with("tools", json!("a")), Some("tools")),
        (with("inptu", json!("a")), Some("inptu")),
    ] {
        let (status, problem) = post_run(&server, &body).await;
        assert_eq!(
            (status, problem["code"].as_str()),
            (422, Some("invalid_body"))
        );
        assert_eq!(problem["field"].as_str(), field, "{body}: {problem}");
        let detail = problem["detail"].as_str().unwrap();
        for internal in [
            r"\buntagged\b",
            r"\bexpected u32\b",
            r"\binvalid type\b",
            r"\bstruct\b",
            r"\bvariant\b",
        ] {
            let serde_words = regex::Regex::new(internal).unwrap();
            assert!(!serde_words.is_match(detail), "{body}: {detail}");
        }
        if field.is_none() {
            assert!(detail.contains("JSON object"), "{detail}");
        }
    }
    let runs = server.get_json("/runs").await;
    assert_eq!(runs["runs"], json!([]), "no rejected request left a run");
    server.stop().await;
}

/// `metadata` is accepted up to 16384 bytes serialized, refused above; long client values are
/// not echoed whole.
async fn metadata_is_bounded_and_details_are_short(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&text_stream(&["ok"])));
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    // `{"k":"…"}` is the string plus 8 bytes.
    let limit = behest::domain::METADATA_MAX_BYTES;
    let at = |n: usize| {
        let mut body = base_body();
        body["metadata"] = json!({"k": "x".repeat(n - 8)});
        body
    };
    let (status, problem) = post_run(&server, &at(limit + 1)).await;
    assert_eq!((status, &problem["field"]), (422, &json!("metadata")));
    assert!(problem["detail"].as_str().unwrap().contains("16384"));
    let (status, created) = post_run(&server, &at(limit)).await;
    assert_eq!(status, 202, "{created}");
    let long = "y".repeat(10_000);
    let mut probes = vec![
        (
            "POST",
            "/runs".to_owned(),
            json!({"provider": long, "model": "m", "input": "hi"}),
        ),
        ("POST", "/runs".to_owned(), {
            let mut body = base_body();
            body[&long] = json!(1);
            body
        }),
    ];
    probes.push(("GET", format!("/runs/{long}"), Value::Null));
    probes.push(("GET", format!("/sessions/{long}"), Value::Null));
    probes.push(("GET", format!("/runs?cursor={long}"), Value::Null));
    for (method, uri, body) in probes {
        let request = if method == "POST" {
            server.client.post(server.url(&uri)).json(&body)
        } else {
            server.client.get(server.url(&uri))
        };
        let response = request.send().await.unwrap();
        assert!(response.status().is_client_error(), "{uri}");
        let problem: Value = response.json().await.unwrap();
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.len() <= 400, "{} bytes", detail.len());
        let field = problem["field"].as_str().unwrap_or_default();
        assert!(field.len() <= 100, "{} bytes", field.len());
    }
    server.stop().await;
}

/// A list page stops once its records pass the byte budget; the cursor walks all of them.
async fn list_pages_are_bounded_in_bytes(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    for _ in 0..8 {
        fake.push(Reply::sse(&text_stream(&["ok"])));
    }
    let config = config_with(&fake.base_url(), "[runtime]\nmax_page_bytes = 2000\n");
    let Some(server) = TestServer::start(backend, config).await else {
        return;
    };
    let mut created = Vec::new();
    for _ in 0..5 {
        let mut body = base_body();
        body["metadata"] = json!({"pad": "p".repeat(900)});
        let run = server.create_run(body).await;
        server.finished_run(run["run_id"].as_str().unwrap()).await;
        created.push(run["run_id"].as_str().unwrap().to_owned());
    }
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        pages += 1;
        let uri = match &cursor {
            Some(c) => format!("/runs?limit=200&cursor={c}"),
            None => "/runs?limit=200".to_owned(),
        };
        let page = server.get_json(&uri).await;
        let runs = page["runs"].as_array().unwrap();
        // Each record is ~1.4 KB: the one that passes 2000 bytes ends the page.
        assert!(!runs.is_empty() && runs.len() <= 2, "{}", runs.len());
        seen.extend(runs.iter().map(|r| r["id"].as_str().unwrap().to_owned()));
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    created.reverse();
    assert_eq!(seen, created, "newest first, each once");
    assert!(pages >= 3, "{pages} pages");
    // A session's history is bounded the same way, oldest first.
    let long_input = "i".repeat(900);
    let first = server.start_run(&long_input, None).await;
    let session = server.finished_run(&first).await["session_id"]
        .as_str()
        .unwrap()
        .to_owned();
    for _ in 0..2 {
        let run = server.start_run(&long_input, Some(&session)).await;
        server.finished_run(&run).await;
    }
    let mut roles = Vec::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        pages += 1;
        let uri = match &cursor {
            Some(c) => format!("/sessions/{session}/messages?cursor={c}"),
            None => format!("/sessions/{session}/messages"),
        };
        let page = server.get_json(&uri).await;
        let messages = page["messages"].as_array().unwrap();
        // ~1.1 KB user messages, ~250 B answers: the message passing 2000 bytes ends the page.
        assert!(!messages.is_empty());
        let before_last: usize = messages[..messages.len() - 1]
            .iter()
            .map(|m| m.to_string().len())
            .sum();
        assert!(before_last <= 2000, "{before_last}");
        roles.extend(
            messages
                .iter()
                .map(|m| m["role"].as_str().unwrap().to_owned()),
        );
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(
        roles,
        ["user", "assistant"].repeat(3),
        "each message once, in order"
    );
    assert_eq!(pages, 2, "u a u | a u a");
    let bad = server
        .client
        .get(server.url(&format!("/sessions/{session}/messages?cursor=nope")))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    server.stop().await;
}

/// `EventSource` needs: unknown query parameters ignored, an empty `Last-Event-ID` not
/// overriding `?last_event_id=`, and the cursor as decimal digits only. Other routes with
/// query parameters keep refusing unknown ones.
async fn the_events_route_is_what_event_source_needs(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&text_stream(&["a", "b", "c"])));
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let run_id = server.start_run("hi", None).await;
    server.finished_run(&run_id).await;
    let full = server.events(&run_id, None).await;
    let url = server.url(&format!("/runs/{run_id}/events"));
    let response = server
        .client
        .get(format!(
            "{url}?last_event_id=2&_=1733131313&access_token=abc"
        ))
        .header("Last-Event-ID", "")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(support::server::collect_frames(response).await, full[2..]);
    for bad in ["+5", " 5", "5.0", "-1", "0x5", "99999999999999999999999"] {
        // HTTP strips a header value's surrounding whitespace (RFC 9110 5.5): " 5" is only
        // testable in the query.
        let places: &[bool] = if bad.trim() == bad {
            &[true, false]
        } else {
            &[false]
        };
        for &header in places {
            let request = server.client.get(&url);
            let request = if header {
                request.header("Last-Event-ID", bad)
            } else {
                request.query(&[("last_event_id", bad)])
            };
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), 400, "{bad:?} header={header}");
            let problem: Value = response.json().await.unwrap();
            assert_eq!(problem["code"], "invalid_cursor");
        }
    }
    for uri in ["/runs?foo=1", "/sessions?foo=1"] {
        let response = server.client.get(server.url(uri)).send().await.unwrap();
        assert_eq!(response.status(), 400, "{uri}");
    }
    let cancel = server
        .client
        .post(server.url(&format!("/runs/{run_id}/cancel?foo=1")))
        .send()
        .await
        .unwrap();
    assert_eq!(cancel.status(), 400);
    server.stop().await;
}

/// NUL characters from outside (model text, a model-chosen tool call id and name, a provider's
/// error text) are stored on PostgreSQL as on SQLite, and the runs end normally.
async fn nul_characters_from_outside_are_stored(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&text_stream(&["a\u{0}b"])));
    fake.push(Reply::sse(&tool_calls_stream(&[(
        "call\u{0}1",
        "no\u{0}tool",
        json!({"q": "\u{0}"}),
    )])));
    fake.push(Reply::sse(&text_stream(&["done"])));
    fake.push(Reply::status(
        400,
        json!({"error": {"message": "bad\u{0}request", "type": "invalid_request_error"}}),
    ));
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let text_run = server.start_run("hi", None).await;
    assert_eq!(server.finished_run(&text_run).await["status"], "completed");
    let output = server.get_json(&format!("/runs/{text_run}/output")).await;
    assert_eq!(output["messages"][0]["content"][0]["text"], "a\u{0}b");
    let tool_run = server.start_run("call", None).await;
    let run = server.finished_run(&tool_run).await;
    assert_eq!(run["status"], "completed", "{run}");
    let session = run["session_id"].as_str().unwrap();
    let messages = server
        .get_json(&format!("/sessions/{session}/messages"))
        .await;
    let tool_message = messages["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "tool")
        .unwrap_or_else(|| panic!("a tool result is stored: {messages}"));
    assert_eq!(tool_message["tool_call_id"], "call\u{fffd}1");
    let failed_run = server.start_run("fail", None).await;
    let run = server.finished_run(&failed_run).await;
    assert_eq!(run["status"], "failed");
    let error = run["error"].as_str().unwrap();
    assert!(!error.contains('\u{0}'), "{error}");
    server.stop().await;
}

/// Sends `POST {path}` on `n` connections at once: each request is written but for its last
/// byte, then the last bytes go out together, so all have arrived before any can be answered.
/// Returns each answer's status and JSON body.
async fn simultaneous_posts(server: &TestServer, path: &str, n: usize) -> Vec<(u16, Value)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Length: 0\r\nConnection: close\r\n\r",
        server.addr
    );
    let mut streams = Vec::new();
    for _ in 0..n {
        let mut stream = tokio::net::TcpStream::connect(server.addr).await.unwrap();
        stream.write_all(head.as_bytes()).await.unwrap();
        streams.push(stream);
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    for stream in &mut streams {
        stream.write_all(b"\n").await.unwrap();
    }
    let mut answers = Vec::new();
    for mut stream in streams {
        let mut raw = String::new();
        stream.read_to_string(&mut raw).await.unwrap();
        let status = raw.split(' ').nth(1).unwrap().parse().unwrap();
        let body = raw.split_once("\r\n\r\n").unwrap().1;
        answers.push((status, serde_json::from_str(body).unwrap_or(Value::Null)));
    }
    answers
}

/// Ten concurrent cancels of one active run all get `202`; with `wait=true`, all `200`; a later
/// cancel of the cancelled run gets the same `202` (idempotent). A completed run's cancel gets
/// `409 run_finished`.
async fn concurrent_cancels_get_the_same_answer(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    for _ in 0..2 {
        let first = chunk(json!({"role": "assistant", "content": "slow"}), None);
        fake.push(Reply::stall_after(first.as_bytes()));
    }
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let mut last = String::new();
    for wait in [false, true] {
        let run_id = server.start_run("hang", None).await;
        // Started: the model call is streaming.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let path = format!("/runs/{run_id}/cancel?wait={wait}");
        for (status, body) in simultaneous_posts(&server, &path, 10).await {
            assert_eq!(status, if wait { 200 } else { 202 }, "wait={wait}: {body}");
            assert_eq!(body["id"], run_id.as_str());
            if wait {
                assert_eq!(body["status"], "cancelled");
            }
        }
        let run = server.finished_run(&run_id).await;
        assert_eq!(run["status"], "cancelled");
        let events = server.events(&run_id, None).await;
        let terminal = events.iter().filter(|f| f.event == "run_cancelled").count();
        assert_eq!(terminal, 1);
        last = run_id;
    }
    server.cancel_again(&last).await;
    fake.push(Reply::sse(&text_stream(&["done"])));
    let done = server.start_run("finish", None).await;
    assert_eq!(server.finished_run(&done).await["status"], "completed");
    let late = server
        .client
        .post(server.url(&format!("/runs/{done}/cancel")))
        .send()
        .await
        .unwrap();
    assert_eq!(late.status(), 409);
    let problem: Value = late.json().await.unwrap();
    assert_eq!(
        (problem["code"].as_str(), problem["run_status"].as_str()),
        (Some("run_finished"), Some("completed"))
    );
    server.stop().await;
}

on_both_backends!(
    create_body_constraints_hold_at_their_boundaries,
    query_constraints_hold_at_their_boundaries,
    bad_bodies_get_readable_422s,
    metadata_is_bounded_and_details_are_short,
    list_pages_are_bounded_in_bytes,
    the_events_route_is_what_event_source_needs,
    nul_characters_from_outside_are_stored,
    concurrent_cancels_get_the_same_answer,
);
