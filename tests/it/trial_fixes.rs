//! Findings of a new user's trial that have no better home: the frontend routes' body errors
//! name the field (its path in `detail`), as `POST /runs` does.

use crate::support;

use serde_json::{Value, json};
use support::db::Backend;
use support::server::{TestServer, config_for};

async fn post(server: &TestServer, path: &str, body: &Value) -> (u16, Value) {
    let response = server
        .client
        .post(server.url(path))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// `POST /chat` and `POST /ag-ui` with a required field missing or of the wrong type: 422
/// `invalid_body` with `field` the top-level field and `detail` naming its path, without
/// serde's words.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frontend_body_errors_name_the_field() {
    let Some(server) = TestServer::start(Backend::Sqlite, config_for("http://127.0.0.1:9")).await
    else {
        return;
    };
    let user = json!({"id": "m1", "role": "user", "parts": [{"type": "text", "text": "Hi"}]});
    let thread = json!({"id": "u1", "role": "user", "content": "Hi"});
    for (path, body, field, named) in [
        ("/chat", json!({"messages": [user]}), "id", "`id`"),
        ("/chat", json!({"id": "chat1"}), "messages", "`messages`"),
        ("/chat", json!({"id": 5, "messages": [user]}), "id", "`id`"),
        (
            "/chat",
            json!({"id": "chat1", "messages": {}}),
            "messages",
            "`messages`",
        ),
        (
            "/chat",
            json!({"id": "chat1", "messages": [user], "trigger": 1}),
            "trigger",
            "`trigger`",
        ),
        (
            "/ag-ui",
            json!({"runId": "r1", "messages": [thread]}),
            "threadId",
            "`threadId`",
        ),
        (
            "/ag-ui",
            json!({"threadId": "t1", "messages": [thread]}),
            "runId",
            "`runId`",
        ),
        (
            "/ag-ui",
            json!({"threadId": "t1", "runId": "r1", "messages": [thread],
                   "resume": [{"status": "resolved"}]}),
            "resume",
            "`resume[0].interruptId`",
        ),
        (
            "/ag-ui",
            json!({"threadId": "t1", "runId": "r1", "messages": [thread],
                   "context": [{"description": 1}]}),
            "context",
            "`context[0].description`",
        ),
    ] {
        let (status, problem) = post(&server, path, &body).await;
        assert_eq!(
            (status, problem["code"].as_str()),
            (422, Some("invalid_body")),
            "{path} {body}: {problem}"
        );
        assert_eq!(problem["field"], field, "{path} {body}: {problem}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains(named), "{path} {body}: {detail}");
        assert!(!detail.contains("invalid type"), "{detail}");
    }
    server.stop().await;
}

/// `POST /ag-ui` whose `context`, appended to the run's instructions, does not fit the model's
/// window: 422 `input_too_large` naming `context` (what the client sent), not `instructions`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ag_ui_context_too_large_names_context() {
    let Some(server) = TestServer::start(Backend::Sqlite, config_for("http://127.0.0.1:9")).await
    else {
        return;
    };
    let thread = json!({"id": "u1", "role": "user", "content": "Hi"});
    // About 175,000 tokens of words against a window of 128,000, under the 1 MiB body limit.
    let value = "lorem ipsum dolor sit amet ".repeat(35_000);
    let body = json!({"threadId": uuid::Uuid::new_v4().to_string(), "runId": "r1",
                      "messages": [thread], "tools": [], "state": {},
                      "context": [{"description": "notes", "value": value}],
                      "forwardedProps": {"provider": "fake", "model": "fake-model"}});
    let (status, problem) = post(&server, "/ag-ui", &body).await;
    assert_eq!(
        (status, problem["code"].as_str(), problem["field"].as_str()),
        (422, Some("input_too_large"), Some("context")),
        "{problem}"
    );
    assert!(
        !problem["detail"]
            .as_str()
            .unwrap()
            .contains("`instructions`"),
        "{problem}"
    );
    server.stop().await;
}

/// A body over the limit: 413 `payload_too_large` naming the limit; on `/chat` and `/ag-ui`,
/// whose clients send the whole history, the detail says to send only the last message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_names_it() {
    let Some(server) = TestServer::start(Backend::Sqlite, config_for("http://127.0.0.1:9")).await
    else {
        return;
    };
    let long = "a long chat ".repeat(100_000);
    let user = |id: usize| {
        json!({"id": format!("m{id}"), "role": "user",
                                  "parts": [{"type": "text", "text": long}]})
    };
    for (path, body, history) in [
        ("/runs", json!({"input": long}), false),
        (
            "/chat",
            json!({"id": "long-chat", "messages": [user(1), user(2)]}),
            true,
        ),
        (
            "/ag-ui",
            json!({"threadId": "t1", "runId": "r1",
                   "messages": [{"id": "u1", "role": "user", "content": long}]}),
            true,
        ),
    ] {
        let (status, problem) = post(&server, path, &body).await;
        assert_eq!(
            (status, problem["code"].as_str()),
            (413, Some("payload_too_large")),
            "{path}: {problem}"
        );
        let detail = problem["detail"].as_str().unwrap();
        assert!(
            detail.contains("at most 1048576 bytes (`[runtime] max_body_bytes`)"),
            "{path}: {detail}"
        );
        assert_eq!(
            detail.contains("only the last message"),
            history,
            "{path}: {detail}"
        );
    }
    server.stop().await;
}

/// `POST /ag-ui` whose last user message's `content` is neither a string nor parts: 422
/// `invalid_field` on `messages` saying so (it read as an empty input).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ag_ui_content_of_another_type_is_refused() {
    let Some(server) = TestServer::start(Backend::Sqlite, config_for("http://127.0.0.1:9")).await
    else {
        return;
    };
    let body = json!({"threadId": uuid::Uuid::new_v4().to_string(), "runId": "r1",
                      "messages": [{"id": "u1", "role": "user", "content": 5}],
                      "forwardedProps": {"provider": "fake", "model": "fake-model"}});
    let (status, problem) = post(&server, "/ag-ui", &body).await;
    assert_eq!(
        (status, problem["code"].as_str(), problem["field"].as_str()),
        (422, Some("invalid_field"), Some("messages")),
        "{problem}"
    );
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("must be a string or an array of parts"),
        "{problem}"
    );
    server.stop().await;
}

/// `POST /ag-ui` with a bad client tool: the error names it by its index in the input's
/// `tools`, not in the run's (where the server tools come first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ag_ui_tool_error_names_the_tool_as_sent() {
    let Some(server) = TestServer::start(Backend::Sqlite, config_for("http://127.0.0.1:9")).await
    else {
        return;
    };
    let good = json!({"name": "good", "description": "fine",
                      "parameters": {"type": "object", "properties": {}}});
    let bad = json!({"name": "bad", "description": "a string schema",
                     "parameters": {"type": "string"}});
    let body = json!({"threadId": uuid::Uuid::new_v4().to_string(), "runId": "r1",
                      "messages": [{"id": "u1", "role": "user", "content": "hi"}],
                      "tools": [good, bad],
                      "forwardedProps": {"provider": "fake", "model": "fake-model"}});
    let (status, problem) = post(&server, "/ag-ui", &body).await;
    assert_eq!(
        (status, problem["code"].as_str(), problem["field"].as_str()),
        (422, Some("invalid_field"), Some("tools")),
        "{problem}"
    );
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("tools[1].parameters"), "{detail}");
    server.stop().await;
}
