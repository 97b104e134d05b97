//! The OpenAI adapter against the fake provider over real HTTP: exact text across split
//! reads, error classes of HTTP answers and broken streams, timeouts, and the request JSON.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use secrecy::SecretString;
use serde_json::{Value, json};

use behest::config::{
    ModelConfig, ProviderConfig, ProviderKind, RetryConfig, Secret, TimeoutConfig,
};
use behest::domain::{FinishReason, Role, ToolCall, ToolChoice, ToolChoiceMode};
use behest::provider::{ErrorClass, ModelEvent, ModelRequest, Provider, ProviderError, ToolSpec};
use support::fake_openai::{
    FakeOpenAi, Reply, failure, fixture, message, refused_base_url, run, text_of, text_stream,
    timeouts,
};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const API_KEY: &str = "sk-test-0123456789";

fn config(base_url: &str, timeouts: TimeoutConfig) -> ProviderConfig {
    ProviderConfig {
        kind: ProviderKind::Openai,
        base_url: base_url.to_owned(),
        api_key_env: None,
        timeouts,
        // The adapter's own behaviour: one attempt per call (retries: tests/retry.rs).
        retry: RetryConfig {
            max_attempts: 1,
            ..RetryConfig::default()
        },
        models: BTreeMap::from([(
            "gpt-4o-mini".to_owned(),
            ModelConfig {
                context_window: 128_000,
                max_output_tokens: 16_384,
            },
        )]),
        token_delay_ms: None,
        script: None,
        api_key: Some(Secret(SecretString::from(API_KEY))),
    }
}

fn provider(base_url: &str) -> Result<std::sync::Arc<dyn Provider>, ProviderError> {
    behest::provider::build("fake", &config(base_url, timeouts()))
}

fn hello() -> ModelRequest {
    ModelRequest {
        model: "gpt-4o-mini".to_owned(),
        messages: vec![message(Role::User, "Say hello")],
        tools: Vec::new(),
        tool_choice: ToolChoice::default(),
        max_output_tokens: None,
    }
}

#[tokio::test]
async fn text_split_inside_utf8_and_json_arrives_exactly() -> TestResult {
    let fake = FakeOpenAi::start().await;
    let body = text_stream(&["Héllo ", "wörld — 你", "好 🌍!"]);
    // Cut inside "ö" (2 bytes), inside "你" (3 bytes), inside "🌍" (4 bytes) and inside JSON.
    let find = |needle: &str| {
        body.windows(needle.len())
            .position(|w| w == needle.as_bytes())
            .unwrap_or(0)
    };
    let cuts = vec![
        find("ö") + 1,
        find("你") + 2,
        find("🌍") + 3,
        find("\"choices\"") + 4,
        find("finish_reason\":\"stop") + 10,
        find("[DONE]") + 2,
    ];
    fake.push(Reply::sse(&body).split_at(cuts));
    let provider = provider(&fake.base_url())?;
    let (events, error) = run(provider.as_ref(), hello()).await?;
    assert_eq!(error, None);
    assert_eq!(text_of(&events), "Héllo wörld — 你好 🌍!");
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Finished(FinishReason::Stop))
    );
    assert!(
        events
            .iter()
            .any(|e| matches!(e, ModelEvent::Usage { usage, .. } if usage.input_tokens == 10 && usage.output_tokens == 3)),
        "{events:?}"
    );

    let requests = fake.requests();
    let request = requests.first().ok_or("no request recorded")?;
    assert_eq!(
        request
            .headers
            .get("authorization")
            .map(|v| v.to_str())
            .transpose()?,
        Some(format!("Bearer {API_KEY}").as_str())
    );
    assert_eq!(request.body.get("stream"), Some(&json!(true)));
    assert_eq!(
        request.body.get("stream_options"),
        Some(&json!({"include_usage": true}))
    );
    assert_eq!(request.body.get("model"), Some(&json!("gpt-4o-mini")));
    assert!(request.body.get("tools").is_none());
    assert!(request.body.get("tool_choice").is_none());
    Ok(())
}

#[tokio::test]
async fn recorded_text_fixture_in_small_reads() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(
        Reply::sse(&fixture("text.sse"))
            .chunks_every(97)
            .delay(Duration::from_millis(2)),
    );
    let provider = provider(&fake.base_url())?;
    let (events, error) = run(provider.as_ref(), hello()).await?;
    assert_eq!(error, None);
    assert_eq!(text_of(&events), "Héllo wörld — 你好 🌍!");
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Finished(FinishReason::Stop))
    );
    Ok(())
}

#[tokio::test]
async fn empty_queue_answers_the_default_text() -> TestResult {
    let fake = FakeOpenAi::start().await;
    let provider = provider(&fake.base_url())?;
    let (events, error) = run(provider.as_ref(), hello()).await?;
    assert_eq!(error, None);
    assert_eq!(text_of(&events), "Hello");
    Ok(())
}

#[tokio::test]
async fn unauthorized_is_auth_without_the_key() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::status(
        401,
        json!({"error": {"message": "Incorrect API key provided: sk-test-***********6789.", "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}}),
    ));
    let provider = provider(&fake.base_url())?;
    let error = failure(provider.as_ref(), hello())
        .await
        .ok_or("no error")?;
    assert_eq!(error.class, ErrorClass::Auth);
    assert_eq!(error.status, Some(401));
    assert!(
        error.message.starts_with("Incorrect API key provided"),
        "{error}"
    );
    assert!(!error.to_string().contains(API_KEY));
    Ok(())
}

#[tokio::test]
async fn server_error_is_server() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::status(
        500,
        json!({"error": {"message": "The server had an error while processing your request.", "type": "server_error", "param": null, "code": null}}),
    ));
    let provider = provider(&fake.base_url())?;
    let error = failure(provider.as_ref(), hello())
        .await
        .ok_or("no error")?;
    assert_eq!(error.class, ErrorClass::Server);
    assert_eq!(error.status, Some(500));
    Ok(())
}

#[tokio::test]
async fn too_many_requests_is_rate_limited_with_retry_after() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(
        Reply::status(
            429,
            json!({"error": {"message": "Rate limit reached for gpt-4o-mini on requests per min (RPM).", "type": "requests", "param": null, "code": "rate_limit_exceeded"}}),
        )
        .header("retry-after", "3"),
    );
    let provider = provider(&fake.base_url())?;
    let error = failure(provider.as_ref(), hello())
        .await
        .ok_or("no error")?;
    assert_eq!(error.class, ErrorClass::RateLimited);
    assert_eq!(error.retry_after, Some(Duration::from_secs(3)));
    Ok(())
}

#[tokio::test]
async fn context_length_answer_is_classified() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::status(
        400,
        json!({"error": {"message": "This model's maximum context length is 128000 tokens. However, your messages resulted in 130000 tokens.", "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}),
    ));
    let provider = provider(&fake.base_url())?;
    let error = failure(provider.as_ref(), hello())
        .await
        .ok_or("no error")?;
    assert_eq!(error.class, ErrorClass::ContextLengthExceeded);
    Ok(())
}

#[tokio::test]
async fn malformed_chunk_fails_the_stream() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&fixture("malformed.sse")).chunks_every(150));
    let provider = provider(&fake.base_url())?;
    let (events, error) = run(provider.as_ref(), hello()).await?;
    assert_eq!(text_of(&events), "Hello");
    let error = error.ok_or("no error")?;
    assert_eq!(error.class, ErrorClass::Server);
    assert!(error.message.starts_with("malformed chunk"), "{error}");
    Ok(())
}

#[tokio::test]
async fn error_inside_the_stream_fails_it() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&fixture("error_in_stream.sse")));
    let provider = provider(&fake.base_url())?;
    let (events, error) = run(provider.as_ref(), hello()).await?;
    assert_eq!(text_of(&events), "The answer");
    assert_eq!(error.map(|e| e.class), Some(ErrorClass::Server));
    Ok(())
}

#[tokio::test]
async fn stalled_stream_hits_the_idle_timeout() -> TestResult {
    let fake = FakeOpenAi::start().await;
    let body = text_stream(&["Hel", "lo"]);
    let half = body.len() / 2;
    fake.push(Reply::stall_after(body.get(..half).ok_or("short body")?));
    let short = TimeoutConfig {
        idle_ms: 300,
        ..timeouts()
    };
    let provider = behest::provider::build("fake", &config(&fake.base_url(), short))?;
    let started = std::time::Instant::now();
    let error = failure(provider.as_ref(), hello())
        .await
        .ok_or("no error")?;
    assert_eq!(error.class, ErrorClass::Timeout);
    assert!(error.message.contains("idle timeout"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(3));
    Ok(())
}

#[tokio::test]
async fn silent_stream_hits_the_first_byte_timeout() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::stall_after(b""));
    let short = TimeoutConfig {
        first_byte_ms: 300,
        ..timeouts()
    };
    let provider = behest::provider::build("fake", &config(&fake.base_url(), short))?;
    let error = failure(provider.as_ref(), hello())
        .await
        .ok_or("no error")?;
    assert_eq!(error.class, ErrorClass::Timeout);
    assert!(error.message.contains("first-byte timeout"), "{error}");
    Ok(())
}

#[tokio::test]
async fn connection_cut_early_is_transport() -> TestResult {
    let fake = FakeOpenAi::start().await;
    let body = text_stream(&["Hel", "lo"]);
    let cut = body
        .windows(6)
        .position(|w| w == b"\"stop\"")
        .ok_or("no stop")?;
    let until_stop = body.get(..cut).ok_or("short body")?;
    // Up to the last complete event before the finish chunk.
    let last_event = until_stop
        .windows(2)
        .rposition(|w| w == b"\n\n")
        .ok_or("no event")?;
    fake.push(Reply::close_after(
        body.get(..last_event + 2).ok_or("short")?,
    ));
    let provider = provider(&fake.base_url())?;
    let (events, error) = run(provider.as_ref(), hello()).await?;
    assert_eq!(text_of(&events), "Hello");
    assert_eq!(error.map(|e| e.class), Some(ErrorClass::Transport));
    Ok(())
}

#[tokio::test]
async fn refused_connection_is_transport() -> TestResult {
    let provider = provider(&refused_base_url().await)?;
    let error = failure(provider.as_ref(), hello())
        .await
        .ok_or("no error")?;
    assert_eq!(error.class, ErrorClass::Transport);
    Ok(())
}

#[tokio::test]
async fn tool_call_request_and_answer() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&fixture("tool_call.sse")).chunks_every(300));
    let mut assistant = message(Role::Assistant, "");
    assistant.content.clear();
    assistant.tool_calls = vec![ToolCall {
        invalid_arguments: None,
        id: "call_prev".to_owned(),
        name: "get_time".to_owned(),
        arguments: json!({"timezone": "Europe/Paris"}),
    }];
    let mut result = message(Role::Tool, "09:00");
    result.tool_call_id = Some("call_prev".to_owned());
    result.tool_name = Some("get_time".to_owned());
    let request = ModelRequest {
        model: "gpt-4o-mini".to_owned(),
        messages: vec![
            message(Role::System, "You are helpful."),
            message(Role::User, "Time and weather in Paris?"),
            assistant,
            result,
        ],
        tools: vec![ToolSpec {
            name: "get_weather".to_owned(),
            description: "Current weather of a place".to_owned(),
            parameters: json!({
                "type": "object",
                "properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["location"],
            }),
        }],
        tool_choice: ToolChoice::Mode(ToolChoiceMode::Required),
        max_output_tokens: Some(256),
    };
    let provider = provider(&fake.base_url())?;
    let (events, error) = run(provider.as_ref(), request).await?;
    assert_eq!(error, None);
    assert!(events.contains(&ModelEvent::ToolCallCompleted(ToolCall {
        invalid_arguments: None,
        id: "call_cVdX8QHtUQ6iNZCzCnUGfCRq".to_owned(),
        name: "get_weather".to_owned(),
        arguments: json!({"location": "Paris, France", "unit": "celsius"}),
    })));
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Finished(FinishReason::ToolCalls))
    );

    let requests = fake.requests();
    let body: &Value = &requests.first().ok_or("no request recorded")?.body;
    assert_eq!(body.get("tool_choice"), Some(&json!("required")));
    assert_eq!(body.get("max_completion_tokens"), Some(&json!(256)));
    assert_eq!(
        body.pointer("/tools/0"),
        Some(&json!({"type": "function", "function": {
            "name": "get_weather",
            "description": "Current weather of a place",
            "parameters": {
                "type": "object",
                "properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["location"],
            },
        }}))
    );
    assert_eq!(
        body.get("messages"),
        Some(&json!([
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Time and weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_prev", "type": "function", "function": {"name": "get_time", "arguments": "{\"timezone\":\"Europe/Paris\"}"}},
            ]},
            {"role": "tool", "tool_call_id": "call_prev", "content": "09:00"},
        ]))
    );
    Ok(())
}
