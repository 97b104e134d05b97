//! Images in the input (issue #26, item 2): `input` as content parts reaches each wire format
//! in its own shape (OpenAI-compatible `image_url` parts, Anthropic `image` blocks with a
//! `base64` or `url` source), is stored with the user message and listed by
//! `GET /sessions/{id}/messages`; bad parts, oversized images and images for a `text_only`
//! model are refused at create, before any model call.

use crate::support;

use base64::Engine;
use behest::config::Config;
use serde_json::{Value, json};
use support::db::Backend;
use support::fake_anthropic;
use support::fake_openai::{self, FakeOpenAi, Reply};
use support::server::TestServer;
use support::validate::{validate_anthropic_request, validate_openai_request};

/// A 1×1 PNG.
const PNG: &[u8] = &[
    0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44, 0x52,
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x06, 0x00, 0x00, 0x00, 0x1f, 0x15, 0xc4,
    0x89, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9c, 0x63, 0xf8, 0xcf, 0xc0, 0xf0,
    0x1f, 0x00, 0x05, 0x00, 0x01, 0xff, 0x89, 0x99, 0x3d, 0x1d, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45,
    0x4e, 0x44, 0xae, 0x42, 0x60, 0x82,
];

fn png_base64() -> String {
    base64::engine::general_purpose::STANDARD.encode(PNG)
}

/// `fake` (OpenAI-compatible) with a vision model and a text-only one, `claude` (Anthropic)
/// on the same fake server.
fn config(base_url: &str, extra_runtime: &str) -> Config {
    let toml = format!(
        "[runtime]\n{extra_runtime}\n\
         [providers.fake]\nkind = \"openai\"\nbase_url = \"{base_url}\"\n\
         [providers.fake.retry]\nmax_attempts = 1\n\
         [providers.fake.models.vision]\ncontext_window = 128000\nmax_output_tokens = 1024\n\
         [providers.fake.models.text]\ncontext_window = 128000\nmax_output_tokens = 1024\ntext_only = true\n\
         [providers.claude]\nkind = \"anthropic\"\nbase_url = \"{base_url}\"\n\
         [providers.claude.retry]\nmax_attempts = 1\n\
         [providers.claude.models.vision]\ncontext_window = 128000\nmax_output_tokens = 1024\n"
    );
    Config::from_toml(&toml).unwrap()
}

async fn post(server: &TestServer, body: &Value) -> (u16, Value) {
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

fn parts() -> Value {
    json!([
        {"type": "text", "text": "What is in these pictures?"},
        {"type": "image", "media_type": "image/png", "data": png_base64()},
        {"type": "image", "url": "https://example.com/cat.jpg"},
    ])
}

async fn images_reach_both_wire_formats(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config(&fake.base_url(), "")).await else {
        return;
    };
    fake.push(Reply::sse(&fake_openai::text_stream(&["A dot and a cat."])));
    let (status, created) = post(
        &server,
        &json!({"provider": "fake", "model": "vision", "input": parts()}),
    )
    .await;
    assert_eq!(status, 202, "{created}");
    let run = server
        .finished_run(created["run_id"].as_str().unwrap())
        .await;
    assert_eq!(run["status"], "completed", "{run}");
    let session = created["session_id"].as_str().unwrap();

    // Stored with the message, listed as content parts.
    let stored = server
        .get_json(&format!("/sessions/{session}/messages"))
        .await["messages"][0]
        .clone();
    let data_url = format!("data:image/png;base64,{}", png_base64());
    assert_eq!(
        stored["content"],
        json!([
            {"type": "text", "text": "What is in these pictures?"},
            {"type": "image", "url": data_url, "media_type": "image/png"},
            {"type": "image", "url": "https://example.com/cat.jpg", "media_type": ""},
        ]),
        "{stored}"
    );

    // The same session continues on Anthropic: the history's images go as `image` blocks.
    fake.push(Reply::sse(&fake_anthropic::text_stream(&["Still a cat."])));
    let (status, created) = post(
        &server,
        &json!({"provider": "claude", "model": "vision", "session_id": session,
                "input": [{"type": "text", "text": "And now?"},
                          {"type": "image", "media_type": "image/png", "data": png_base64()}]}),
    )
    .await;
    assert_eq!(status, 202, "{created}");
    let run = server
        .finished_run(created["run_id"].as_str().unwrap())
        .await;
    assert_eq!(run["status"], "completed", "{run}");

    let requests = fake.requests();
    assert_eq!(requests.len(), 2);
    let openai = &requests[0].body;
    assert!(validate_openai_request(openai).is_empty(), "{openai}");
    let user = openai["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "user")
        .unwrap();
    assert_eq!(
        user["content"],
        json!([
            {"type": "text", "text": "What is in these pictures?"},
            {"type": "image_url", "image_url": {"url": data_url}},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
        ]),
        "{user}"
    );
    let anthropic = &requests[1].body;
    assert!(
        validate_anthropic_request(anthropic).is_empty(),
        "{anthropic}"
    );
    let first = &anthropic["messages"][0]["content"];
    assert_eq!(
        first[1],
        json!({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": png_base64()}}),
        "{first}"
    );
    assert_eq!(
        first[2],
        json!({"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}}),
        "{first}"
    );
    let last = anthropic["messages"].as_array().unwrap().last().unwrap();
    assert_eq!(last["content"][1]["type"], "image", "{last}");
    server.stop().await;
}

async fn bad_images_are_refused_at_create(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    // A body limit large enough for the oversized image (else 413 comes first).
    let Some(server) = TestServer::start(
        backend,
        config(&fake.base_url(), "max_body_bytes = 8388608"),
    )
    .await
    else {
        return;
    };
    let too_big =
        base64::engine::general_purpose::STANDARD
            .encode(vec![0u8; behest::domain::MAX_IMAGE_BYTES + 1]);
    let cases = [
        (json!([]), "at least one content part"),
        (json!([{"type": "text", "text": "  "}]), "non-whitespace"),
        (
            json!([{"type": "image", "data": png_base64()}]),
            "media_type",
        ),
        (
            json!([{"type": "image", "media_type": "image/tiff", "data": png_base64()}]),
            "media_type",
        ),
        (
            json!([{"type": "image", "media_type": "image/png", "data": "not base64!"}]),
            "not base64",
        ),
        (
            json!([{"type": "image", "media_type": "image/png", "data": too_big}]),
            "decoded",
        ),
        (
            json!([{"type": "image", "url": "file:///etc/passwd"}]),
            "http(s) URL",
        ),
        (
            json!([{"type": "image", "url": "https://a/b.png", "media_type": "image/png",
                    "data": png_base64()}]),
            "either",
        ),
        (json!([{"type": "audio", "data": "x"}]), "content parts"),
        (json!(12), "string or an array"),
    ];
    for (input, words) in cases {
        let (status, problem) = post(
            &server,
            &json!({"provider": "fake", "model": "vision", "input": input}),
        )
        .await;
        assert_eq!(status, 422, "{input}: {problem}");
        assert_eq!(problem["field"], "input", "{problem}");
        assert!(
            problem["detail"].as_str().unwrap().contains(words),
            "{words}: {problem}"
        );
    }
    // A text-only model refuses images with a clear 422, and takes text parts.
    let (status, problem) = post(
        &server,
        &json!({"provider": "fake", "model": "text", "input": parts()}),
    )
    .await;
    assert_eq!((status, problem["field"].as_str()), (422, Some("input")));
    assert!(
        problem["detail"].as_str().unwrap().contains("text_only"),
        "{problem}"
    );
    assert!(fake.requests().is_empty(), "refused runs call no model");
    fake.push(Reply::sse(&fake_openai::text_stream(&["ok"])));
    let (status, created) = post(
        &server,
        &json!({"provider": "fake", "model": "text",
                "input": [{"type": "text", "text": "only words"}]}),
    )
    .await;
    assert_eq!(status, 202, "{created}");
    server
        .finished_run(created["run_id"].as_str().unwrap())
        .await;
    assert_eq!(
        fake.requests()[0].body["messages"][0]["content"],
        "only words"
    );
    server.stop().await;
}

/// Beyond the request body limit (default 1 MiB) the answer is 413.
async fn a_body_over_the_limit_is_413(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config(&fake.base_url(), "")).await else {
        return;
    };
    let big = base64::engine::general_purpose::STANDARD.encode(vec![7u8; 1 << 20]);
    let (status, problem) = post(
        &server,
        &json!({"provider": "fake", "model": "vision",
                "input": [{"type": "image", "media_type": "image/png", "data": big}]}),
    )
    .await;
    assert_eq!(status, 413, "{problem}");
    server.stop().await;
}

/// A session whose history holds images goes on with a `text_only` model: each image reaches it
/// as a text placeholder (the stored message keeps it), and the request is valid; an image in
/// the new input is still refused at create.
async fn a_text_only_model_gets_the_historys_images_as_text(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config(&fake.base_url(), "")).await else {
        return;
    };
    fake.push(Reply::sse(&fake_openai::text_stream(&["A dot and a cat."])));
    let (status, created) = post(
        &server,
        &json!({"provider": "fake", "model": "vision", "input": parts()}),
    )
    .await;
    assert_eq!(status, 202, "{created}");
    let session = created["session_id"].as_str().unwrap().to_owned();
    server
        .finished_run(created["run_id"].as_str().unwrap())
        .await;
    fake.push(Reply::sse(&fake_openai::text_stream(&["Still a cat."])));
    let (status, created) = post(
        &server,
        &json!({"provider": "fake", "model": "text", "session_id": session, "input": "And now?"}),
    )
    .await;
    assert_eq!(status, 202, "{created}");
    let run = server
        .finished_run(created["run_id"].as_str().unwrap())
        .await;
    assert_eq!(run["status"], "completed", "{run}");
    let requests = fake.requests();
    let body = &requests.last().unwrap().body;
    assert!(validate_openai_request(body).is_empty(), "{body}");
    let first = body["messages"][0].to_string();
    assert!(first.contains("What is in these pictures?"), "{first}");
    assert_eq!(
        first.matches("[image omitted: text is text-only]").count(),
        2,
        "{first}"
    );
    assert!(!body.to_string().contains("image_url"), "{body}");
    let stored = server
        .get_json(&format!("/sessions/{session}/messages"))
        .await;
    assert_eq!(stored["messages"][0]["content"][1]["type"], "image");
    let (status, problem) = post(
        &server,
        &json!({"provider": "fake", "model": "text", "session_id": session, "input": parts()}),
    )
    .await;
    assert_eq!(status, 422, "{problem}");
    assert_eq!(problem["field"], "input", "{problem}");
    server.stop().await;
}

on_both_backends!(
    a_text_only_model_gets_the_historys_images_as_text,
    images_reach_both_wire_formats,
    bad_images_are_refused_at_create,
    a_body_over_the_limit_is_413,
);
