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
