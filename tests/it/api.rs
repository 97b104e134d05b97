//! JSON routes driven in-process: errors are problem+json with stable codes, and no bad request
//! leaves a record behind.

use crate::support;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use behest::api::{AppState, app};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use support::db::{Backend, TestDb};
use support::server::config_for;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

struct Api {
    router: axum::Router,
    _db: TestDb,
}

impl Api {
    async fn new() -> Self {
        let db = TestDb::new(Backend::Sqlite).await.unwrap();
        // The provider is never reached by these tests.
        let config = config_for("http://127.0.0.1:9/v1");
        let tools = std::sync::Arc::new(behest::tools::ToolRegistry::default());
        let runtime = behest::server::runtime(&config, db.store().await, tools).unwrap();
        let router = app(AppState::new(runtime, CancellationToken::new()));
        Self { router, _db: db }
    }

    async fn call(
        &self,
        method: &str,
        uri: &str,
        body: Option<&str>,
    ) -> (StatusCode, String, Value) {
        let mut request = Request::builder().method(method).uri(uri);
        if body.is_some() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        let request = request
            .body(Body::from(body.unwrap_or("").to_owned()))
            .unwrap();
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (status, content_type, json)
    }

    async fn problem(
        &self,
        method: &str,
        uri: &str,
        body: Option<&str>,
        status: u16,
        code: &str,
    ) -> Value {
        let (got, content_type, json) = self.call(method, uri, body).await;
        assert_eq!(got.as_u16(), status, "{method} {uri}: {json}");
        assert_eq!(content_type, "application/problem+json", "{method} {uri}");
        assert_eq!(json["code"], code, "{method} {uri}: {json}");
        assert_eq!(json["status"], status);
        assert!(json["detail"].as_str().is_some_and(|d| !d.is_empty()));
        json
    }

    async fn run_count(&self) -> usize {
        let (_, _, json) = self.call("GET", "/runs", None).await;
        json["runs"].as_array().unwrap().len()
    }
}

#[tokio::test]
async fn unknown_runs_are_404_run_not_found() {
    let api = Api::new().await;
    let id = uuid::Uuid::now_v7();
    for uri in [
        format!("/runs/{id}"),
        format!("/runs/{id}/output"),
        format!("/runs/{id}/events"),
        "/runs/not-a-uuid".to_owned(),
    ] {
        api.problem("GET", &uri, None, 404, "run_not_found").await;
    }
    api.problem(
        "POST",
        &format!("/runs/{id}/cancel"),
        None,
        404,
        "run_not_found",
    )
    .await;
    for uri in [
        format!("/snapshots/{id}"),
        "/snapshots/not-a-uuid".to_owned(),
    ] {
        api.problem("GET", &uri, None, 404, "snapshot_not_found")
            .await;
        api.problem("DELETE", &uri, None, 404, "snapshot_not_found")
            .await;
    }
    api.problem("GET", "/no/such/route", None, 404, "not_found")
        .await;
    api.problem("DELETE", "/runs", None, 405, "method_not_allowed")
        .await;
    api.problem(
        "GET",
        &format!("/runs/{id}/cancel"),
        None,
        405,
        "method_not_allowed",
    )
    .await;
}

#[tokio::test]
async fn bad_create_requests_are_rejected_without_a_record() {
    let api = Api::new().await;
    api.problem(
        "POST",
        "/runs",
        Some(r#"{"provider": "fake","#),
        400,
        "malformed_json",
    )
    .await;
    for (body, field) in [
        (json!({"model": "fake-model", "input": "hi"}), "provider"),
        (json!({"provider": "fake", "input": "hi"}), "model"),
        (json!({"provider": "fake", "model": "fake-model"}), "input"),
    ] {
        let problem = api
            .problem(
                "POST",
                "/runs",
                Some(&body.to_string()),
                422,
                "missing_field",
            )
            .await;
        assert_eq!(problem["field"], field);
        assert!(problem["detail"].as_str().unwrap().contains(field));
    }
    // Present but empty or blank: invalid, not missing.
    for input in ["", " \n "] {
        let blank = json!({"provider": "fake", "model": "fake-model", "input": input}).to_string();
        let problem = api
            .problem("POST", "/runs", Some(&blank), 422, "invalid_field")
            .await;
        assert_eq!(problem["field"], "input");
    }
    let unknown = json!({"provider": "nope", "model": "m", "input": "hi"}).to_string();
    let problem = api
        .problem("POST", "/runs", Some(&unknown), 422, "unknown_provider")
        .await;
    assert_eq!(problem["field"], "provider");
    let model = json!({"provider": "fake", "model": "gpt-nope", "input": "hi"}).to_string();
    api.problem("POST", "/runs", Some(&model), 422, "unknown_model")
        .await;
    let typed = json!({"provider": "fake", "model": "fake-model", "input": 3}).to_string();
    let problem = api
        .problem("POST", "/runs", Some(&typed), 422, "invalid_body")
        .await;
    assert_eq!(problem["field"], "input");
    let forced = json!({"provider": "fake", "model": "fake-model", "input": "hi", "tool_choice": "required"}).to_string();
    let problem = api
        .problem("POST", "/runs", Some(&forced), 422, "invalid_field")
        .await;
    assert_eq!(problem["field"], "tool_choice");
    let extra =
        json!({"provider": "fake", "model": "fake-model", "input": "hi", "inptu": 1}).to_string();
    api.problem("POST", "/runs", Some(&extra), 422, "invalid_body")
        .await;
    let metadata =
        json!({"provider": "fake", "model": "fake-model", "input": "hi", "metadata": [1]})
            .to_string();
    api.problem("POST", "/runs", Some(&metadata), 422, "invalid_field")
        .await;
    let session = json!({"provider": "fake", "model": "fake-model", "input": "hi",
                         "session_id": uuid::Uuid::now_v7()})
    .to_string();
    api.problem("POST", "/runs", Some(&session), 404, "session_not_found")
        .await;
    let huge = json!({"provider": "fake", "model": "fake-model", "input": "x".repeat(2 << 20)})
        .to_string();
    api.problem("POST", "/runs", Some(&huge), 413, "payload_too_large")
        .await;
    assert_eq!(api.run_count().await, 0, "no rejected request left a run");
}

#[tokio::test]
async fn bad_cursors_and_queries_are_400() {
    let api = Api::new().await;
    api.problem("GET", "/runs?cursor=garbage", None, 400, "invalid_cursor")
        .await;
    api.problem("GET", "/runs?limit=0", None, 400, "invalid_query")
        .await;
    api.problem("GET", "/runs?limit=201", None, 400, "invalid_query")
        .await;
    api.problem("GET", "/runs?status=running", None, 400, "invalid_query")
        .await;
    // Readable, naming the parameter; never serde's words.
    for (uri, field) in [
        ("/runs?limit=abc", "limit"),
        ("/runs?limit=-1", "limit"),
        ("/runs?status=running", "status"),
        ("/runs?colour=red", "colour"),
        ("/sessions?limit=1.5", "limit"),
    ] {
        let problem = api.problem("GET", uri, None, 400, "invalid_query").await;
        assert_eq!(problem["field"], field, "{uri}");
        let detail = problem["detail"].as_str().unwrap();
        for internal in ["invalid digit", "variant", "expected"] {
            assert!(!detail.contains(internal), "{uri}: {detail}");
        }
    }
    api.problem("GET", "/runs?session_id=nope", None, 400, "invalid_query")
        .await;
    // `GET /snapshots` takes the same parameters, with the same answers.
    api.problem(
        "GET",
        "/snapshots?cursor=garbage",
        None,
        400,
        "invalid_cursor",
    )
    .await;
    for (uri, field) in [
        ("/snapshots?limit=0", "limit"),
        ("/snapshots?limit=201", "limit"),
        ("/snapshots?status=running", "status"),
        ("/snapshots?session_id=nope", "session_id"),
        ("/snapshots?colour=red", "colour"),
    ] {
        let problem = api.problem("GET", uri, None, 400, "invalid_query").await;
        assert_eq!(problem["field"], field, "{uri}");
    }
    let (status, _, json) = api.call("GET", "/snapshots?status=completed", None).await;
    assert_eq!(status, 200);
    assert_eq!(json, json!({"snapshots": [], "next_cursor": null}));
    let (status, _, json) = api
        .call("GET", "/runs?limit=200&status=completed", None)
        .await;
    assert_eq!(status, 200);
    assert_eq!(json, json!({"runs": [], "next_cursor": null}));
}

#[tokio::test]
async fn health_and_readiness() {
    let api = Api::new().await;
    let (status, _, json) = api.call("GET", "/healthz", None).await;
    assert_eq!(
        (status.as_u16(), json["status"].as_str()),
        (200, Some("ok"))
    );
    let (status, _, _) = api.call("GET", "/readyz", None).await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn served_openapi_is_the_checked_in_document() {
    let api = Api::new().await;
    let (status, content_type, served) = api.call("GET", "/openapi.json", None).await;
    assert_eq!(
        (status.as_u16(), content_type.as_str()),
        (200, "application/json")
    );
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/openapi.json");
    let checked_in: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(served, checked_in);
}
