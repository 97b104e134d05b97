//! The OpenAI adapter against the fake provider over real HTTP: exact text across split
//! reads, error classes of HTTP answers and broken streams, timeouts, and the request JSON.

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use secrecy::SecretString;
use serde_json::{Value, json};

use behest::config::{
    AssistantToolCallContent, ModelConfig, ProviderConfig, ProviderKind, ReasoningEffort,
    ReasoningReplay, RetryConfig, Secret, TimeoutConfig,
};
use behest::domain::{FinishReason, Reasoning, Role, ToolCall, ToolChoice, ToolChoiceMode};
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
        // The adapter's own behaviour: one attempt per call (retries: tests/it/retry.rs).
        retry: RetryConfig {
            max_attempts: 1,
            ..RetryConfig::default()
        },
        models: BTreeMap::from([(
            "gpt-4o-mini".to_owned(),
            ModelConfig {
                context_window: 128_000,
                max_output_tokens: 16_384,
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
        api_key: Some(Secret(SecretString::from(API_KEY))),
    }
}

fn provider(base_url: &str) -> Result<std::sync::Arc<dyn Provider>, ProviderError> {
    behest::provider::build("fake", &config(base_url, timeouts()))
}

fn hello() -> ModelRequest {
    ModelRequest {
        model: "gpt-4o-mini".to_owned(),
        messages: vec![message(Role::User, "Say hello")].into(),
        tools: Vec::new(),
        tool_choice: ToolChoice::default(),
        max_output_tokens: None,
        ..ModelRequest::default()
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
        ]
        .into(),
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
        ..ModelRequest::default()
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
    // A local server: the limit goes in `max_tokens` (the default off api.openai.com).
    assert_eq!(body.get("max_tokens"), Some(&json!(256)));
    assert_eq!(body.get("max_completion_tokens"), None);
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

// ---------------------------------------------------------------------------------------------
// Real servers' streams (tests/fixtures/README.md) and their follow-up requests

fn tool_calls_of(events: &[ModelEvent]) -> Vec<ToolCall> {
    events
        .iter()
        .filter_map(|e| match e {
            ModelEvent::ToolCallCompleted(call) => Some(call.clone()),
            _ => None,
        })
        .collect()
}

fn reasoning_of(events: &[ModelEvent]) -> Vec<Reasoning> {
    events
        .iter()
        .filter_map(|e| match e {
            ModelEvent::ReasoningCompleted(block) => Some(block.clone()),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn llamacpp_tool_call_with_duplicate_function_call_is_parsed_once() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&fixture("llamacpp_reasoning_tool_call.sse")).chunks_every(97));
    let (events, error) = run(provider(&fake.base_url())?.as_ref(), hello()).await?;
    assert_eq!(error, None);
    assert_eq!(text_of(&events), "");
    assert_eq!(
        tool_calls_of(&events),
        vec![ToolCall {
            id: "Z9fKq2cVbN1m".to_owned(),
            name: "get_weather".to_owned(),
            arguments: json!({"location": "Paris, France"}),
            invalid_arguments: None,
        }]
    );
    assert_eq!(
        reasoning_of(&events).first().map(|r| r.text.as_str()),
        Some("The user wants the weather in Paris. I will call get_weather.")
    );
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Finished(FinishReason::ToolCalls))
    );
    Ok(())
}

#[tokio::test]
async fn deepseek_reasoning_goes_back_with_its_tool_turn() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&fixture("deepseek_reasoning_tool_call.sse")).chunks_every(61));
    fake.push(Reply::sse(&text_stream(&["It says hi."])));
    let mut config = config(&fake.base_url(), timeouts());
    config.reasoning_replay = ReasoningReplay::ToolTurns;
    config.reasoning_effort = Some(ReasoningEffort::High);
    let provider = behest::provider::build("fake", &config)?;
    let first = hello();
    let (events, error) = run(provider.as_ref(), first.clone()).await?;
    assert_eq!(error, None);
    assert!(events.iter().any(|e| matches!(
        e,
        ModelEvent::Usage { usage, .. } if usage.reasoning_tokens == 37 && !usage.estimated
    )));
    // The next request carries the turn as the run loop stores it.
    let mut assistant = message(Role::Assistant, "");
    assistant.content.clear();
    assistant.reasoning = reasoning_of(&events);
    assistant.tool_calls = tool_calls_of(&events);
    let mut result = message(Role::Tool, "hi");
    result.tool_call_id = Some("call_00_Vw9dEfHk2mXoP4rT".to_owned());
    let mut second = first;
    second.messages = [&second.messages[..], &[assistant, result]].concat().into();
    let (events, error) = run(provider.as_ref(), second).await?;
    assert_eq!((text_of(&events).as_str(), error), ("It says hi.", None));
    let requests = fake.requests();
    let body = &requests.get(1).ok_or("no second request")?.body;
    assert_eq!(body.get("reasoning_effort"), Some(&json!("high")));
    assert_eq!(
        body.pointer("/messages/1"),
        Some(&json!({
            "role": "assistant",
            "content": null,
            "reasoning_content": "I should look up the file first.",
            "tool_calls": [{"id": "call_00_Vw9dEfHk2mXoP4rT", "type": "function",
                "function": {"name": "read_file", "arguments": "{\"path\":\"notes.md\"}"}}],
        }))
    );
    Ok(())
}

#[tokio::test]
async fn refusal_is_text_and_content_filter() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&fixture("openai_refusal.sse")).chunks_every(40));
    let (events, error) = run(provider(&fake.base_url())?.as_ref(), hello()).await?;
    assert_eq!(error, None);
    assert_eq!(text_of(&events), "I'm sorry, I can't help with that.");
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Finished(FinishReason::ContentFilter))
    );
    Ok(())
}

#[tokio::test]
async fn done_without_finish_reason_is_unknown_and_no_usage_is_no_event() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&fixture("no_finish_reason.sse")));
    let (events, error) = run(provider(&fake.base_url())?.as_ref(), hello()).await?;
    assert_eq!(error, None);
    assert_eq!(text_of(&events), "The report covers three");
    assert!(!events.iter().any(|e| matches!(e, ModelEvent::Usage { .. })));
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Finished(FinishReason::Unknown))
    );
    Ok(())
}

#[tokio::test]
async fn garbled_arguments_complete_every_started_call() -> TestResult {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&fixture("garbled_tool_calls.sse")).chunks_every(33));
    let (events, error) = run(provider(&fake.base_url())?.as_ref(), hello()).await?;
    assert_eq!(error, None);
    let started = events
        .iter()
        .filter(|e| matches!(e, ModelEvent::ToolCallStarted { .. }))
        .count();
    let calls = tool_calls_of(&events);
    assert_eq!((started, calls.len()), (3, 3));
    let invalid: Vec<_> = calls
        .iter()
        .map(|c| c.invalid_arguments.is_some())
        .collect();
    assert_eq!(invalid, [false, true, true]);
    assert!(calls.iter().skip(1).all(|c| c.arguments == json!({})));
    Ok(())
}

#[tokio::test]
async fn answers_that_are_not_event_streams_say_what_arrived() -> TestResult {
    let fake = FakeOpenAi::start().await;
    let html = b"<!DOCTYPE html>\n<html><head><title>Sign in - Corporate Proxy</title></head><body>please log in</body></html>";
    let completion = json!({"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}]});
    let bad_gateway = format!(
        "<html><head><title>502 Bad Gateway</title></head><body>{}</body></html>",
        "x".repeat(50_000)
    );
    let cases: Vec<(Reply, ErrorClass, Option<u16>, &str)> = vec![
        (
            Reply::raw(200, "text/html; charset=utf-8", html),
            ErrorClass::Server,
            Some(200),
            "HTTP 200 text/html; charset=utf-8 instead of an event stream: an HTML page titled \"Sign in - Corporate Proxy\"",
        ),
        (
            Reply::raw(200, "application/json", completion.to_string().as_bytes()),
            ErrorClass::InvalidRequest,
            Some(200),
            "ignored `stream: true`",
        ),
        (
            Reply::raw(200, "application/json", br#"{"error":{"message":"This model's maximum context length is 8192 tokens","code":400}}"#),
            ErrorClass::ContextLengthExceeded,
            Some(200),
            "maximum context length",
        ),
        (
            Reply::raw(200, "text/plain", b""),
            ErrorClass::Server,
            Some(200),
            "an empty body",
        ),
        // An empty event stream is asked again without streaming (`local_models`).
        (
            Reply::raw(
                413,
                "text/html",
                b"<html><head><title>413 Request Entity Too Large</title></head><body></body></html>",
            ),
            ErrorClass::ContextLengthExceeded,
            Some(413),
            "413 Request Entity Too Large",
        ),
        (
            Reply::raw(502, "text/html", bad_gateway.as_bytes()),
            ErrorClass::Server,
            Some(502),
            "HTTP 502: an HTML page titled \"502 Bad Gateway\"",
        ),
    ];
    for (reply, class, status, says) in cases {
        fake.push(reply);
        let error = failure(provider(&fake.base_url())?.as_ref(), hello())
            .await
            .ok_or("the call succeeded")?;
        assert_eq!((error.class, error.status), (class, status), "{error:?}");
        assert!(error.message.contains(says), "{says}: {}", error.message);
        assert!(error.message.len() < 400, "{}", error.message);
    }
    Ok(())
}
