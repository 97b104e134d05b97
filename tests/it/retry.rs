//! Retries through `provider::build` against the fake provider: only retryable classes, only
//! before any output, bounded by `max_attempts`, honouring `retry-after`.

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use secrecy::SecretString;
use serde_json::json;

use behest::config::{
    AssistantToolCallContent, ModelConfig, ProviderConfig, ProviderKind, ReasoningReplay,
    RetryConfig, Secret, TimeoutConfig,
};
use behest::domain::{ContentPart, Message, MessageId, Role, RunId, SessionId, ToolChoice};
use behest::provider::{ErrorClass, ModelEvent, ModelRequest, Provider, ProviderError};
use support::fake_anthropic;
use support::fake_openai::{FakeOpenAi, Reply, text_stream};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn config(kind: ProviderKind, base_url: &str, retry: RetryConfig) -> ProviderConfig {
    ProviderConfig {
        kind,
        base_url: base_url.to_owned(),
        api_key_env: None,
        timeouts: TimeoutConfig {
            connect_ms: 2_000,
            first_byte_ms: 5_000,
            idle_ms: 5_000,
            total_ms: 30_000,
        },
        retry,
        models: BTreeMap::from([(
            "m".to_owned(),
            ModelConfig {
                context_window: 100_000,
                max_output_tokens: 1_000,
                text_only: false,
            },
        )]),
        max_tokens_field: None,
        assistant_tool_call_content: Some(AssistantToolCallContent::Null),
        reasoning_replay: ReasoningReplay::None,
        reasoning_effort: None,
        instructions_role: Default::default(),
        forced_tool_choice: Default::default(),
        thinking_budget_tokens: None,
        structured_output: Default::default(),
        token_delay_ms: None,
        script: None,
        api_key: Some(Secret(SecretString::from("sk-test-retry"))),
    }
}

fn fast(max_attempts: u32) -> RetryConfig {
    RetryConfig {
        max_attempts,
        initial_backoff_ms: 10,
        max_backoff_ms: 40,
        jitter: true,
        max_retry_after_ms: 1_000,
    }
}

fn provider(kind: ProviderKind, fake: &FakeOpenAi, retry: RetryConfig) -> Arc<dyn Provider> {
    match behest::provider::build("fake", &config(kind, &fake.base_url(), retry)) {
        Ok(provider) => provider,
        Err(error) => unreachable_provider(error),
    }
}

fn unreachable_provider(error: ProviderError) -> ! {
    panic!("provider builds: {error}")
}

fn hello() -> ModelRequest {
    ModelRequest {
        model: "m".to_owned(),
        messages: vec![Message {
            reasoning: Vec::new(),
            id: MessageId::new(),
            session_id: SessionId::new(),
            run_id: RunId::new(),
            role: Role::User,
            content: vec![ContentPart::Text {
                text: "Say hello".to_owned(),
            }],
            tool_calls: Vec::new(),
            tool_call_id: None,
            tool_name: None,
            created_at: chrono::Utc::now(),
            status: Default::default(),
        }]
        .into(),
        tools: Vec::new(),
        tool_choice: ToolChoice::default(),
        max_output_tokens: None,
        ..ModelRequest::default()
    }
}

/// The text of a call and the error that ended it, if any.
async fn call(provider: &dyn Provider) -> (String, Option<ProviderError>) {
    let mut stream = match provider.stream(hello()).await {
        Ok(stream) => stream,
        Err(error) => return (String::new(), Some(error)),
    };
    let mut text = String::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(ModelEvent::TextDelta(delta)) => text.push_str(&delta),
            Ok(_) => {}
            Err(error) => return (text, Some(error)),
        }
    }
    (text, None)
}

fn rate_limited() -> Reply {
    Reply::status(
        429,
        json!({"error": {"message": "Rate limit reached", "type": "requests", "param": null, "code": "rate_limit_exceeded"}}),
    )
}

#[tokio::test]
async fn rate_limited_with_retry_after_zero_then_success() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(rate_limited().header("retry-after", "0"));
    fake.push(Reply::sse(&text_stream(&["Hel", "lo"])));
    let provider = provider(ProviderKind::Openai, &fake, fast(3));
    let (text, error) = call(provider.as_ref()).await;
    assert_eq!(error, None);
    assert_eq!(text, "Hello");
    assert_eq!(fake.requests().len(), 2);
    Ok(())
}

#[tokio::test]
async fn auth_failure_is_not_retried() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::status(
        401,
        json!({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}}),
    ));
    let provider = provider(ProviderKind::Openai, &fake, fast(3));
    let (_, error) = call(provider.as_ref()).await;
    assert_eq!(error.map(|e| e.class), Some(ErrorClass::Auth));
    assert_eq!(fake.requests().len(), 1);
    Ok(())
}

#[tokio::test]
async fn failure_after_output_is_not_retried() -> TestResult {
    let fake = FakeOpenAi::start().await;
    let body = text_stream(&["Hel", "lo"]);
    let text = std::str::from_utf8(&body)?;
    let cut = text.find("\"stop\"").ok_or("no stop")?;
    let last_event = text
        .get(..cut)
        .and_then(|t| t.rfind("\n\n"))
        .ok_or("no event")?;
    fake.push(Reply::close_after(
        body.get(..last_event + 2).ok_or("short")?,
    ));
    let provider = provider(ProviderKind::Openai, &fake, fast(3));
    let (text, error) = call(provider.as_ref()).await;
    assert_eq!(text, "Hello", "the text is streamed once");
    assert_eq!(error.map(|e| e.class), Some(ErrorClass::Transport));
    assert_eq!(fake.requests().len(), 1);
    Ok(())
}

#[tokio::test]
async fn max_attempts_bound_the_retries() -> TestResult {
    let fake = FakeOpenAi::start().await;
    for _ in 0..4 {
        fake.push(Reply::status(
            503,
            json!({"error": {"message": "The engine is currently overloaded", "type": "server_error"}}),
        ));
    }
    let provider = provider(ProviderKind::Openai, &fake, fast(3));
    let (_, error) = call(provider.as_ref()).await;
    assert_eq!(error.map(|e| e.class), Some(ErrorClass::Overloaded));
    assert_eq!(fake.requests().len(), 3);
    Ok(())
}

#[tokio::test]
async fn one_attempt_means_no_retry() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(rate_limited().header("retry-after", "0"));
    let provider = provider(ProviderKind::Openai, &fake, fast(1));
    let (_, error) = call(provider.as_ref()).await;
    assert_eq!(error.map(|e| e.class), Some(ErrorClass::RateLimited));
    assert_eq!(fake.requests().len(), 1);
    Ok(())
}

#[tokio::test]
async fn retry_after_beyond_the_cap_is_not_waited_for() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(rate_limited().header("retry-after", "30"));
    let provider = provider(ProviderKind::Openai, &fake, fast(3));
    let started = Instant::now();
    let (_, error) = call(provider.as_ref()).await;
    assert_eq!(error.map(|e| e.class), Some(ErrorClass::RateLimited));
    assert_eq!(fake.requests().len(), 1);
    assert!(started.elapsed() < Duration::from_secs(5));
    Ok(())
}

#[tokio::test]
async fn anthropic_overloaded_in_stream_before_output_is_retried() -> TestResult {
    let fake = FakeOpenAi::start().await;
    let mut overloaded = fake_anthropic::message_start(10);
    overloaded.push_str(&fake_anthropic::event(&fake_anthropic::error_body(
        "overloaded_error",
        "Overloaded",
    )));
    fake.push(Reply::sse(overloaded.as_bytes()));
    fake.push(Reply::status(
        529,
        fake_anthropic::error_body("overloaded_error", "Overloaded"),
    ));
    fake.push(Reply::sse(&fake_anthropic::fixture("text.sse")));
    let provider = provider(ProviderKind::Anthropic, &fake, fast(3));
    let (text, error) = call(provider.as_ref()).await;
    assert_eq!(error, None);
    assert_eq!(text, "Héllo wörld — 你好 🌍!");
    let requests = fake.requests();
    assert_eq!(requests.len(), 3);
    assert!(requests.iter().all(|r| r.path == "/v1/messages"));
    assert!(
        requests.iter().all(|r| r.body == requests[0].body),
        "every attempt sends the same request"
    );
    Ok(())
}

#[tokio::test]
async fn anthropic_error_after_text_is_not_retried() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&fake_anthropic::fixture("error_in_stream.sse")));
    let provider = provider(ProviderKind::Anthropic, &fake, fast(3));
    let (text, error) = call(provider.as_ref()).await;
    assert_eq!(text, "The answer");
    assert_eq!(error.map(|e| e.class), Some(ErrorClass::Overloaded));
    assert_eq!(fake.requests().len(), 1);
    Ok(())
}

#[tokio::test]
async fn each_retry_is_an_event_before_the_answer() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(rate_limited().header("retry-after", "0"));
    fake.push(Reply::status(500, json!({"error": {"message": "boom"}})));
    fake.push(Reply::sse(&text_stream(&["Hi"])));
    let provider = provider(ProviderKind::Openai, &fake, fast(3));
    let mut stream = provider.stream(hello()).await?;
    let mut events = Vec::new();
    while let Some(item) = stream.next().await {
        events.push(item?);
    }
    let retries: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            ModelEvent::Retrying {
                attempt,
                error_class,
                delay,
                error,
            } => Some((*attempt, *error_class, *delay, error.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        retries.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>(),
        vec![(1, ErrorClass::RateLimited), (2, ErrorClass::Server)]
    );
    assert_eq!(retries.first().map(|r| r.2), Some(Duration::ZERO));
    assert_eq!(retries.get(1).map(|r| r.3.as_str()), Some("boom"));
    // The retries come first, then the successful attempt's events.
    assert!(matches!(events.first(), Some(ModelEvent::Retrying { .. })));
    assert!(matches!(events.get(1), Some(ModelEvent::Retrying { .. })));
    assert_eq!(events.get(2), Some(&ModelEvent::TextDelta("Hi".to_owned())));
    assert_eq!(fake.requests().len(), 3);
    Ok(())
}

#[tokio::test]
async fn last_attempt_error_ends_the_stream_after_its_retry_events() -> TestResult {
    let fake = FakeOpenAi::start().await;
    for _ in 0..2 {
        fake.push(rate_limited().header("retry-after", "0"));
    }
    let provider = provider(ProviderKind::Openai, &fake, fast(2));
    let mut stream = provider.stream(hello()).await?;
    let first = stream.next().await;
    assert!(
        matches!(first, Some(Ok(ModelEvent::Retrying { attempt: 1, .. }))),
        "{first:?}"
    );
    let second = stream.next().await;
    assert_eq!(
        second.and_then(Result::err).map(|e| e.class),
        Some(ErrorClass::RateLimited)
    );
    assert!(stream.next().await.is_none());
    Ok(())
}

#[tokio::test]
async fn a_page_that_is_not_a_stream_is_not_retried() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::raw(
        200,
        "text/html",
        b"<html><head><title>Captive portal</title></head></html>",
    ));
    let provider = provider(ProviderKind::Openai, &fake, fast(3));
    let (_, error) = call(provider.as_ref()).await;
    assert_eq!(error.map(|e| e.class), Some(ErrorClass::Server));
    assert_eq!(fake.requests().len(), 1);
    Ok(())
}
