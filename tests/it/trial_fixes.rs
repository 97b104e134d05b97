//! Findings of a new user's trial that have no better home: the frontend routes' body errors
//! name the field (its path in `detail`), as `POST /runs` does.

use crate::support;

use serde_json::{Value, json};
use support::db::Backend;
use support::server::{TestServer, config_for};

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
        let (status, problem) = server.post(path, &body).await;
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
        let (status, problem) = server.post(path, &body).await;
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

/// `POST /ag-ui` refusals name what the client sent: a `context` that, appended to the run's
/// instructions, does not fit the window (not `instructions`); a `content` that is neither a
/// string nor parts (it read as an empty input); a bad client tool by its index in the input's
/// `tools` (the run's index counts the server tools first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ag_ui_refusals_name_what_the_client_sent() {
    let Some(server) = TestServer::start(Backend::Sqlite, config_for("http://127.0.0.1:9")).await
    else {
        return;
    };
    let input = |messages: Value, extra: Value| {
        let mut body = json!({"threadId": uuid::Uuid::new_v4().to_string(), "runId": "r1",
                              "messages": messages,
                              "forwardedProps": {"provider": "fake", "model": "fake-model"}});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let hi = json!([{"id": "u1", "role": "user", "content": "Hi"}]);
    // About 175,000 tokens of words against a window of 128,000, under the 1 MiB body limit.
    let notes = "lorem ipsum dolor sit amet ".repeat(35_000);
    let good = json!({"name": "good", "description": "fine",
                      "parameters": {"type": "object", "properties": {}}});
    let bad = json!({"name": "bad", "description": "a string schema",
                     "parameters": {"type": "string"}});
    for (body, code, field, said) in [
        (
            input(
                hi.clone(),
                json!({"context": [{"description": "notes", "value": notes}]}),
            ),
            "input_too_large",
            "context",
            "shorten `context`",
        ),
        (
            input(
                json!([{"id": "u1", "role": "user", "content": 5}]),
                json!({}),
            ),
            "invalid_field",
            "messages",
            "must be a string or an array of parts",
        ),
        (
            input(hi.clone(), json!({"tools": [good, bad]})),
            "invalid_field",
            "tools",
            "tools[1].parameters",
        ),
    ] {
        let problem = server.refused("/ag-ui", &body, 422, code).await;
        assert_eq!(problem["field"], field, "{problem}");
        assert!(
            problem["detail"].as_str().unwrap().contains(said),
            "{problem}"
        );
    }
    server.stop().await;
}
