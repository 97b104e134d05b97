//! Safe to expose: API keys on every route the OpenAPI document lists (enumerated from it, so
//! a new route cannot be forgotten), `?access_token=` for event streams only, the per-key rate
//! of run creation, the caps on event streams and active runs, the CORS allow-list, the docs
//! page served from the binary, and the refusal to serve an open non-loopback address.

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::db::Backend;
use support::fake_openai::{FakeOpenAi, Reply, text_stream};
use support::server::{TestServer, config_with};

const KEY_A: &str = "key-a-0123456789";
const KEY_B: &str = "key-b-9876543210";

fn auth_toml(extra: &str) -> String {
    // One key plain, one as its SHA-256 (`printf %s key-b-9876543210 | sha256sum`).
    format!(
        "[auth]\nkeys = [\"{KEY_A}\", \"sha256:{}\"]\n{extra}\n",
        sha256_hex(KEY_B)
    )
}

fn sha256_hex(text: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

async fn server(extra: &str) -> (FakeOpenAi, TestServer) {
    let fake = FakeOpenAi::start().await;
    let config = config_with(&fake.base_url(), extra);
    let server = TestServer::start(Backend::Sqlite, config)
        .await
        .expect("SQLite");
    (fake, server)
}

fn body() -> Value {
    json!({"provider": "fake", "model": "fake-model", "input": "hi"})
}

/// Every operation of the document (method, path with `{…}` filled in) but the public probes.
fn protected_operations(spec: &Value) -> Vec<(String, String)> {
    let mut operations = Vec::new();
    let parameter = regex::Regex::new(r"\{[a-z_]+\}").unwrap();
    for (path, item) in spec["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            let security = operation["security"].as_array();
            if ["/healthz", "/readyz"].contains(&path.as_str()) {
                assert!(security.is_none(), "{path} is public in the document");
                continue;
            }
            assert!(
                security.is_some_and(|s| s.iter().any(|r| r.get("bearer_auth").is_some())),
                "{method} {path} states the bearer key"
            );
            assert!(
                operation["responses"]["401"].is_object(),
                "{method} {path} documents its 401"
            );
            let filled = parameter
                .replace_all(path, uuid::Uuid::now_v7().to_string().as_str())
                .into_owned();
            operations.push((method.clone(), filled));
        }
    }
    operations
}

fn request(server: &TestServer, method: &str, path: &str) -> reqwest::RequestBuilder {
    let method = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
    let builder = server.client.request(method.clone(), server.url(path));
    if method == reqwest::Method::POST || method == reqwest::Method::PUT {
        builder.json(&body())
    } else {
        builder
    }
}

async fn assert_unauthorized(response: reqwest::Response, what: &str, presented: bool) {
    assert_eq!(response.status(), 401, "{what}");
    let challenge = response.headers()["www-authenticate"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(challenge.starts_with("Bearer "), "{what}: {challenge}");
    assert_eq!(
        challenge.contains("invalid_token"),
        presented,
        "{what}: {challenge}"
    );
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json",
        "{what}"
    );
    let problem: Value = response.json().await.unwrap();
    assert_eq!(problem["code"], "unauthorized", "{what}: {problem}");
    assert!(
        !problem.to_string().contains("key-"),
        "no key echoed: {problem}"
    );
}

#[tokio::test]
async fn every_route_of_the_document_needs_a_key() {
    let (fake, server) = server(&auth_toml("")).await;
    fake.push(Reply::sse(&text_stream(&["ok"])));
    let spec: Value = serde_json::to_value(behest::api::openapi()).unwrap();
    let operations = protected_operations(&spec);
    assert!(operations.len() >= 15, "{operations:?}");
    for (method, path) in &operations {
        let what = format!("{method} {path}");
        let none = request(&server, method, path).send().await.unwrap();
        assert_unauthorized(none, &format!("{what} without a key"), false).await;
        let wrong = request(&server, method, path)
            .bearer_auth("not-a-key")
            .send()
            .await
            .unwrap();
        assert_unauthorized(wrong, &format!("{what} with a wrong key"), true).await;
        let prefix = request(&server, method, path)
            .bearer_auth(&KEY_A[..KEY_A.len() - 1])
            .send()
            .await
            .unwrap();
        assert_unauthorized(prefix, &format!("{what} with part of a key"), true).await;
        let basic = request(&server, method, path)
            .basic_auth(KEY_A, Some(""))
            .send()
            .await
            .unwrap();
        assert_unauthorized(basic, &format!("{what} with Basic auth"), true).await;
        if !path.contains("/events") {
            let query = request(&server, method, path)
                .query(&[("access_token", KEY_A)])
                .send()
                .await
                .unwrap();
            assert_unauthorized(query, &format!("{what} with ?access_token="), false).await;
        }
        for key in [KEY_A, KEY_B] {
            let status = request(&server, method, path)
                .bearer_auth(key)
                .send()
                .await
                .unwrap()
                .status();
            assert_ne!(status, 401, "{what} with a configured key");
        }
    }
    // The probes, the API description, the console and the docs page need none.
    for path in [
        "/healthz",
        "/readyz",
        "/openapi.json",
        "/",
        "/console/app.js",
        "/docs/",
    ] {
        let status = server
            .client
            .get(server.url(path))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status, 200, "{path}");
    }
    server.stop().await;
}

#[tokio::test]
async fn access_token_works_for_event_streams_only() {
    let (fake, server) = server(&auth_toml("")).await;
    fake.push(Reply::sse(&text_stream(&["Hello", " there"])));
    let created: Value = server
        .client
        .post(server.url("/runs"))
        .bearer_auth(KEY_A)
        .json(&body())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let run_id = created["run_id"].as_str().unwrap();
    let events = format!("/runs/{run_id}/events");
    let streamed = server
        .client
        .get(server.url(&events))
        .query(&[("access_token", KEY_B), ("cache_buster", "1")])
        .send()
        .await
        .unwrap();
    assert_eq!(streamed.status(), 200);
    let frames = support::server::collect_frames(streamed).await;
    assert_eq!(frames.last().unwrap().event, "run_completed", "{frames:?}");
    let wrong = server
        .client
        .get(server.url(&events))
        .query(&[("access_token", "nope")])
        .send()
        .await
        .unwrap();
    assert_unauthorized(wrong, "a wrong access_token", true).await;
    // The header wins over the query: a bad header is refused even with a good token.
    let both = server
        .client
        .get(server.url(&events))
        .bearer_auth("nope")
        .query(&[("access_token", KEY_A)])
        .send()
        .await
        .unwrap();
    assert_unauthorized(both, "a wrong header with a good access_token", true).await;
    for path in [format!("/runs/{run_id}"), "/runs".to_owned()] {
        let refused = server
            .client
            .get(server.url(&path))
            .query(&[("access_token", KEY_A)])
            .send()
            .await
            .unwrap();
        assert_unauthorized(refused, &format!("GET {path}?access_token="), false).await;
    }
    server.stop().await;
}

async fn post_run(server: &TestServer, key: &str) -> reqwest::Response {
    server
        .client
        .post(server.url("/runs"))
        .bearer_auth(key)
        .json(&body())
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn run_creation_is_rate_limited_per_key() {
    let (fake, server) = server(&auth_toml("[limits]\nruns_per_minute = 2")).await;
    for _ in 0..4 {
        fake.push(Reply::sse(&text_stream(&["ok"])));
    }
    for _ in 0..2 {
        assert_eq!(post_run(&server, KEY_A).await.status(), 202);
    }
    let refused = post_run(&server, KEY_A).await;
    assert_eq!(refused.status(), 429);
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=30).contains(&retry_after), "{retry_after}");
    let problem: Value = refused.json().await.unwrap();
    assert_eq!(problem["code"], "rate_limited");
    // The stream route shares the budget; another key has its own.
    let stream = server
        .client
        .post(server.url("/runs/stream"))
        .bearer_auth(KEY_A)
        .json(&body())
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 429);
    assert_eq!(post_run(&server, KEY_B).await.status(), 202);
    server.stop().await;
}

/// A reply that streams one token, then holds the call open until the run is cancelled.
fn held() -> Reply {
    let first = text_stream(&["still going"]);
    let cut = first.len() / 2;
    Reply::stall_after(&first[..cut])
}

#[tokio::test]
async fn event_streams_are_capped_per_key_and_in_total() {
    let (fake, server) = server(&auth_toml(
        "[limits]\nmax_watchers = 3\nmax_watchers_per_key = 2",
    ))
    .await;
    fake.push(held());
    let created: Value = post_run(&server, KEY_A).await.json().await.unwrap();
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    let watch = |key: &'static str| {
        server
            .client
            .get(server.url(&format!("/runs/{run_id}/events")))
            .bearer_auth(key)
            .send()
    };
    let a1 = watch(KEY_A).await.unwrap();
    let a2 = watch(KEY_A).await.unwrap();
    assert_eq!((a1.status().as_u16(), a2.status().as_u16()), (200, 200));
    let a3 = watch(KEY_A).await.unwrap();
    assert_eq!(a3.status(), 503, "a third stream for one key");
    assert!(a3.headers().contains_key("retry-after"));
    let problem: Value = a3.json().await.unwrap();
    assert_eq!(problem["code"], "too_many_watchers");
    let b1 = watch(KEY_B).await.unwrap();
    assert_eq!(b1.status(), 200);
    let b2 = watch(KEY_B).await.unwrap();
    assert_eq!(b2.status(), 503, "a fourth stream in total");
    // A refused `POST /runs/stream` starts no run.
    let runs_before = server.get_json_with("/runs", KEY_B).await["runs"]
        .as_array()
        .unwrap()
        .len();
    let stream = server
        .client
        .post(server.url("/runs/stream"))
        .bearer_auth(KEY_B)
        .json(&body())
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 503);
    let runs_after = server.get_json_with("/runs", KEY_B).await["runs"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(runs_before, runs_after);
    // A closed stream frees its place.
    drop(a1);
    let mut reopened = 0;
    for _ in 0..50 {
        let again = watch(KEY_A).await.unwrap();
        if again.status() == 200 {
            reopened += 1;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(reopened, 1, "the place of a closed stream is free again");
    let cancelled = server
        .client
        .post(server.url(&format!("/runs/{run_id}/cancel")))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(cancelled.status(), 202);
    server.stop().await;
}

#[tokio::test]
async fn active_runs_are_capped() {
    let (fake, server) = server("[runtime]\nmax_active_runs = 1").await;
    fake.push(held());
    fake.push(Reply::sse(&text_stream(&["ok"])));
    let first = server.create_run(body()).await;
    let refused = server
        .client
        .post(server.url("/runs"))
        .json(&body())
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["retry-after"], "1");
    let problem: Value = refused.json().await.unwrap();
    assert_eq!(problem["code"], "too_many_active_runs", "{problem}");
    let run_id = first["run_id"].as_str().unwrap();
    server
        .client
        .post(server.url(&format!("/runs/{run_id}/cancel?wait=true")))
        .send()
        .await
        .unwrap();
    // Once it ended, a new run is admitted.
    let mut admitted = false;
    for _ in 0..50 {
        let again = server
            .client
            .post(server.url("/runs"))
            .json(&body())
            .send()
            .await
            .unwrap();
        if again.status() == 202 {
            admitted = true;
            let id = again.json::<Value>().await.unwrap()["run_id"]
                .as_str()
                .unwrap()
                .to_owned();
            server.finished_run(&id).await;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(admitted);
    server.stop().await;
}

#[tokio::test]
async fn cors_preflight_is_answered_for_allowed_origins() {
    let (fake, server) = server(&auth_toml(
        "[limits]\ncors_allowed_origins = [\"https://app.example.com\"]",
    ))
    .await;
    fake.push(Reply::sse(&text_stream(&["ok"])));
    let preflight = |origin: &'static str, method: &'static str, path: &'static str| {
        server
            .client
            .request(reqwest::Method::OPTIONS, server.url(path))
            .header("origin", origin)
            .header("access-control-request-method", method)
            .header(
                "access-control-request-headers",
                "authorization, content-type, last-event-id, idempotency-key, traceparent",
            )
            .send()
    };
    // Answered without a key: a browser never sends one on a preflight.
    let allowed = preflight("https://app.example.com", "POST", "/runs")
        .await
        .unwrap();
    assert!(allowed.status().is_success(), "{}", allowed.status());
    let headers = allowed.headers();
    assert_eq!(
        headers["access-control-allow-origin"],
        "https://app.example.com"
    );
    let allow_headers = headers["access-control-allow-headers"]
        .to_str()
        .unwrap()
        .to_ascii_lowercase();
    for name in [
        "authorization",
        "content-type",
        "last-event-id",
        "idempotency-key",
        "traceparent",
    ] {
        assert!(allow_headers.contains(name), "{name} in {allow_headers}");
    }
    assert!(
        headers["access-control-allow-methods"]
            .to_str()
            .unwrap()
            .contains("POST")
    );
    let events = preflight("https://app.example.com", "GET", "/runs/x/events")
        .await
        .unwrap();
    assert!(events.status().is_success());
    let other = preflight("https://evil.example.net", "POST", "/runs")
        .await
        .unwrap();
    assert!(
        !other.headers().contains_key("access-control-allow-origin"),
        "an origin not on the list is not allowed"
    );
    // The real request: its answer exposes the headers a client reads.
    let created = server
        .client
        .post(server.url("/runs"))
        .header("origin", "https://app.example.com")
        .bearer_auth(KEY_A)
        .json(&body())
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 202);
    let exposed = created.headers()["access-control-expose-headers"]
        .to_str()
        .unwrap()
        .to_ascii_lowercase();
    for name in ["location", "x-run-id", "idempotent-replayed", "retry-after"] {
        assert!(exposed.contains(name), "{name} in {exposed}");
    }
    let run_id = created.json::<Value>().await.unwrap()["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let _ = server
        .get_json_with(&format!("/runs/{run_id}"), KEY_A)
        .await;
    server.stop().await;
}

#[tokio::test]
async fn the_docs_page_is_served_from_the_binary() {
    let (_fake, server) = server(&auth_toml("")).await;
    let client = behest::net::client_builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let redirect = client.get(server.url("/docs")).send().await.unwrap();
    assert!(redirect.status().is_redirection());
    assert_eq!(redirect.headers()["location"], "/docs/");
    let page = client.get(server.url("/docs/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let html = page.text().await.unwrap();
    let assets: Vec<String> = regex::Regex::new(r#"(?:src|href)="([^"]+)""#)
        .unwrap()
        .captures_iter(&html)
        .map(|c| c[1].to_owned())
        .collect();
    assert!(assets.len() >= 3, "{html}");
    for asset in &assets {
        // Nothing from elsewhere: every asset is this server's.
        assert!(
            !asset.contains("://") && !asset.starts_with("//"),
            "{asset} is fetched from another host"
        );
        let url = if asset.starts_with('/') {
            server.url(asset)
        } else {
            server.url(&format!("/docs/{}", asset.trim_start_matches("./")))
        };
        let status = client.get(&url).send().await.unwrap().status();
        assert_eq!(status, 200, "{url}");
        if asset.ends_with(".js") {
            let script = client.get(&url).send().await.unwrap().text().await.unwrap();
            assert!(!script.contains("https://unpkg.com"), "{asset}");
        }
    }
    let initializer = client
        .get(server.url("/docs/swagger-initializer.js"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(initializer.contains("/openapi.json"), "{initializer}");
    // Swagger UI's default validator badge asks validator.swagger.io about the document.
    assert!(
        initializer.contains(r#""validatorUrl": "none""#)
            || initializer.contains(r#""validatorUrl":"none""#),
        "{initializer}"
    );
    server.stop().await;
}

#[tokio::test]
async fn an_open_address_other_machines_reach_is_refused_without_keys() {
    let config = |toml: &str| behest::config::Config::from_toml(toml).unwrap();
    let refused = behest::server::refuse_unprotected(&config("bind = \"0.0.0.0:0\"")).await;
    let message = refused.unwrap_err().to_string();
    assert!(message.contains("--allow-unauthenticated"), "{message}");
    for allowed in [
        "bind = \"127.0.0.1:0\"",
        "bind = \"[::1]:0\"",
        "bind = \"localhost:0\"",
        "bind = \"0.0.0.0:0\"\n[auth]\nallow_unauthenticated = true",
        "bind = \"0.0.0.0:0\"\n[auth]\nkeys = [\"k\"]",
    ] {
        assert!(
            behest::server::refuse_unprotected(&config(allowed))
                .await
                .is_ok(),
            "{allowed}"
        );
    }
}

#[test]
fn key_settings_are_checked_without_printing_keys() {
    let error = |toml: &str| {
        behest::config::Config::from_toml(toml)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let bad_hash = error("[auth]\nkeys = [\"sha256:nothex-secret\"]");
    assert!(bad_hash.contains("64 hex digits"), "{bad_hash}");
    assert!(!bad_hash.contains("nothex-secret"), "{bad_hash}");
    let wrong_type = error("[auth]\nkeys = [12345678]");
    assert!(wrong_type.contains("auth.keys"), "{wrong_type}");
    let unset = error("[auth]\nkeys_env = \"BEHEST_SURELY_UNSET_KEYS\"");
    assert!(unset.contains("BEHEST_SURELY_UNSET_KEYS"), "{unset}");
    let config =
        behest::config::Config::from_toml("[auth]\nkeys = \"first-secret, second-secret\"")
            .unwrap();
    assert_eq!(config.auth.keys.0.len(), 2);
    assert!(!format!("{config:?}").contains("secret"));
    let shown = serde_json::to_string(&config).unwrap();
    assert!(
        !shown.contains("secret") && shown.contains("sha256:"),
        "{shown}"
    );
    for (toml, named) in [
        ("[limits]\nruns_per_minute = 0", "runs_per_minute"),
        ("[limits]\nruns_burst = 5", "runs_burst"),
        ("[limits]\nmax_watchers = 0", "max_watchers"),
        (
            "[limits]\ncors_allowed_origins = [\"app.example.com\"]",
            "cors_allowed_origins",
        ),
        ("[runtime]\nmax_active_runs = 0", "max_active_runs"),
        (
            "[telemetry]\notlp_endpoint = \"collector:4318\"",
            "otlp_endpoint",
        ),
    ] {
        let message = error(toml);
        assert!(message.contains(named), "{toml}: {message}");
    }
}
