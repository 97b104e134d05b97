//! The Anthropic adapter against the fake provider over real HTTP: exact text across split
//! reads, tool_use blocks, error classes of HTTP answers and broken streams, timeouts, and the
//! exact request (headers and JSON).

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use secrecy::SecretString;
use serde_json::json;

use behest::config::{
    AssistantToolCallContent, ModelConfig, ProviderConfig, ProviderKind, ReasoningReplay,
    RetryConfig, Secret, TimeoutConfig,
};
use behest::domain::{ContentPart, FinishReason, Role, TokenUsage, ToolCall, ToolChoice};
use behest::events::CacheMetrics;
use behest::provider::anthropic::Anthropic;
use behest::provider::{ErrorClass, ModelEvent, ModelRequest, ProviderError, ToolSpec};
use support::fake_anthropic::{FakeProvider, Reply, error_body, fixture, text_stream};
use support::fake_openai::{failure, message, run, text_of, timeouts};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const API_KEY: &str = "sk-ant-test-0123456789";
const MODEL: &str = "claude-sonnet-4-20250514";
const FIXTURE_TEXT: &str = "Héllo wörld — 你好 🌍!";

fn config(base_url: &str, timeouts: TimeoutConfig) -> ProviderConfig {
    ProviderConfig {
        kind: ProviderKind::Anthropic,
        base_url: base_url.to_owned(),
        api_key_env: None,
        timeouts,
        retry: RetryConfig::default(),
        models: BTreeMap::from([(
            MODEL.to_owned(),
            ModelConfig {
                context_window: 200_000,
                max_output_tokens: 8192,
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

/// The adapter alone, without the retry wrapper of `provider::build`.
fn provider(base_url: &str) -> Result<Anthropic, ProviderError> {
    Anthropic::new("claude", &config(base_url, timeouts()))
}

fn hello() -> ModelRequest {
    ModelRequest {
        model: MODEL.to_owned(),
        messages: vec![message(Role::User, "Say hello")].into(),
        tools: Vec::new(),
        tool_choice: ToolChoice::default(),
        max_output_tokens: None,
        ..ModelRequest::default()
    }
}

fn header<'a>(
    request: &'a support::fake_anthropic::RecordedRequest,
    name: &str,
) -> Option<&'a str> {
    request.headers.get(name).and_then(|v| v.to_str().ok())
}

#[tokio::test]
async fn text_split_inside_utf8_and_json_arrives_exactly_with_the_documented_headers() -> TestResult
{
    let fake = FakeProvider::start().await;
    let body = fixture("text.sse");
    let text = std::str::from_utf8(&body)?;
    let mut cuts: Vec<usize> = ["ö", "你", "🌍", "\"delta\"", "event: ping", "message_stop"]
        .iter()
        .filter_map(|needle| text.find(needle).map(|at| at + 2))
        .collect();
    cuts.sort_unstable();
    fake.push(Reply::sse(&body).split_at(cuts));
    let provider = provider(&fake.base_url())?;
    let (events, error) = run(&provider, hello()).await?;
    assert_eq!(error, None);
    assert_eq!(text_of(&events), FIXTURE_TEXT);
    assert_eq!(
        events.get(events.len().saturating_sub(2)..),
        Some(
            &[
                ModelEvent::Usage {
                    usage: TokenUsage {
                        reasoning_tokens: 0,
                        estimated: false,
                        input_tokens: 12,
                        output_tokens: 15,
                        total_tokens: 27
                    },
                    cache: Some(CacheMetrics::default()),
                },
                ModelEvent::Finished(FinishReason::Stop)
            ][..]
        )
    );

    let requests = fake.requests();
    let request = requests.first().ok_or("no request recorded")?;
    assert_eq!(request.path, "/v1/messages");
    assert_eq!(header(request, "x-api-key"), Some(API_KEY));
    assert_eq!(header(request, "anthropic-version"), Some("2023-06-01"));
    assert_eq!(header(request, "content-type"), Some("application/json"));
    assert_eq!(header(request, "authorization"), None);
    assert_eq!(
        request.body,
        json!({
            "model": MODEL,
            "max_tokens": 8192,
            "stream": true,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello"}]}],
        }),
        "max_tokens comes from the model's configuration; no system, no tools"
    );
    Ok(())
}

#[tokio::test]
async fn fixture_in_small_reads_and_the_default_answer() -> TestResult {
    let fake = FakeProvider::start().await;
    fake.push(
        Reply::sse(&fixture("text.sse"))
            .chunks_every(61)
            .delay(Duration::from_millis(2)),
    );
    let provider = provider(&fake.base_url())?;
    let (events, error) = run(&provider, hello()).await?;
    assert_eq!(error, None);
    assert_eq!(text_of(&events), FIXTURE_TEXT);
    let (events, error) = run(&provider, hello()).await?;
    assert_eq!(error, None);
    assert_eq!(text_of(&events), "Hello");
    Ok(())
}

#[tokio::test]
async fn tool_use_request_and_parallel_answer() -> TestResult {
    let fake = FakeProvider::start().await;
    fake.push(Reply::sse(&fixture("parallel_tool_use.sse")).chunks_every(113));
    let mut assistant = message(Role::Assistant, "Checking both.");
    assistant.tool_calls = vec![
        ToolCall {
            invalid_arguments: None,
            id: "toolu_prev_a".to_owned(),
            name: "get_time".to_owned(),
            arguments: json!({"timezone": "Europe/Paris"}),
        },
        ToolCall {
            invalid_arguments: None,
            id: "toolu_prev_b".to_owned(),
            name: "get_weather".to_owned(),
            arguments: json!({"location": "Paris"}),
        },
    ];
    let mut time = message(Role::Tool, "");
    time.content = vec![ContentPart::Json {
        value: json!({"time": "09:00"}),
    }];
    time.tool_call_id = Some("toolu_prev_a".to_owned());
    time.tool_name = Some("get_time".to_owned());
    let mut weather = message(
        Role::Tool,
        "error: no tool named `get_weather` is available",
    );
    weather.tool_call_id = Some("toolu_prev_b".to_owned());
    weather.tool_name = Some("get_weather".to_owned());
    let request = ModelRequest {
        model: MODEL.to_owned(),
        messages: vec![
            message(Role::System, "You are helpful."),
            message(Role::User, "Time and weather in Paris?"),
            assistant,
            time,
            weather,
        ]
        .into(),
        tools: vec![ToolSpec {
            name: "get_weather".to_owned(),
            description: "Current weather of a place".to_owned(),
            parameters: json!({
                "type": "object",
                "properties": {"location": {"type": "string"}},
                "required": ["location"],
            }),
        }],
        tool_choice: ToolChoice::Tool {
            name: "get_weather".to_owned(),
        },
        max_output_tokens: Some(256),
        ..ModelRequest::default()
    };
    let provider = provider(&fake.base_url())?;
    let (events, error) = run(&provider, request).await?;
    assert_eq!(error, None);
    let completed: Vec<&ToolCall> = events
        .iter()
        .filter_map(|e| match e {
            ModelEvent::ToolCallCompleted(call) => Some(call),
            _ => None,
        })
        .collect();
    assert_eq!(
        completed,
        vec![
            &ToolCall {
                invalid_arguments: None,
                id: "toolu_01A09q90qw90lq917835lq9".to_owned(),
                name: "get_weather".to_owned(),
                arguments: json!({"location": "Paris"}),
            },
            &ToolCall {
                invalid_arguments: None,
                id: "toolu_01B19r91rx91mr028946mr0".to_owned(),
                name: "get_time".to_owned(),
                arguments: json!({}),
            },
        ]
    );
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Finished(FinishReason::ToolCalls))
    );

    let requests = fake.requests();
    let body = &requests.first().ok_or("no request recorded")?.body;
    assert_eq!(
        *body,
        json!({
            "model": MODEL,
            "max_tokens": 256,
            "stream": true,
            "system": "You are helpful.",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Time and weather in Paris?"}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking both."},
                    {"type": "tool_use", "id": "toolu_prev_a", "name": "get_time", "input": {"timezone": "Europe/Paris"}},
                    {"type": "tool_use", "id": "toolu_prev_b", "name": "get_weather", "input": {"location": "Paris"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_prev_a", "content": "{\"time\":\"09:00\"}"},
                    {"type": "tool_result", "tool_use_id": "toolu_prev_b", "content": "error: no tool named `get_weather` is available", "is_error": true},
                ]},
            ],
            "tools": [{
                "name": "get_weather",
                "description": "Current weather of a place",
                "input_schema": {
                    "type": "object",
                    "properties": {"location": {"type": "string"}},
                    "required": ["location"],
                },
            }],
            "tool_choice": {"type": "tool", "name": "get_weather"},
        })
    );
    Ok(())
}

#[tokio::test]
async fn single_tool_use_with_cache_read_tokens() -> TestResult {
    let fake = FakeProvider::start().await;
    fake.push(Reply::sse(&fixture("tool_use.sse")).chunks_every(37));
    let provider = provider(&fake.base_url())?;
    let (events, error) = run(&provider, hello()).await?;
    assert_eq!(error, None);
    assert!(events.contains(&ModelEvent::ToolCallCompleted(ToolCall {
        invalid_arguments: None,
        id: "toolu_01T1x1fJ34qAmk2tNTrN7Up6".to_owned(),
        name: "get_weather".to_owned(),
        arguments: json!({"location": "Paris, France", "unit": "celsius"}),
    })));
    assert!(events.contains(&ModelEvent::Usage {
        usage: TokenUsage {
            reasoning_tokens: 0,
            estimated: false,
            input_tokens: 472 + 2048,
            output_tokens: 89,
            total_tokens: 472 + 2048 + 89,
        },
        cache: Some(CacheMetrics {
            cache_creation_input_tokens: 0,
            cache_read_input_tokens: 2048,
            cached_input_tokens: 0,
        }),
    }));
    Ok(())
}

#[tokio::test]
async fn max_tokens_in_the_middle_of_a_tool_use_completes_the_call_as_invalid() -> TestResult {
    let fake = FakeProvider::start().await;
    fake.push(Reply::sse(&fixture("max_tokens_in_tool_use.sse")).chunks_every(50));
    let provider = provider(&fake.base_url())?;
    let (events, error) = run(&provider, hello()).await?;
    assert_eq!(error, None);
    let started = events
        .iter()
        .filter(|e| matches!(e, ModelEvent::ToolCallStarted { .. }))
        .count();
    let completed: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            ModelEvent::ToolCallCompleted(call) => Some(call),
            _ => None,
        })
        .collect();
    assert_eq!((started, completed.len()), (1, 1), "{events:?}");
    assert_eq!(completed.first().map(|c| &c.arguments), Some(&json!({})));
    assert!(
        completed
            .first()
            .and_then(|c| c.invalid_arguments.as_deref())
            .is_some_and(|raw| raw.ends_with("The first line of a long")),
        "{completed:?}"
    );
    assert_eq!(
        events.last(),
        Some(&ModelEvent::Finished(FinishReason::Length))
    );
    Ok(())
}

#[tokio::test]
async fn error_event_inside_a_200_stream() -> TestResult {
    let fake = FakeProvider::start().await;
    fake.push(Reply::sse(&fixture("error_in_stream.sse")));
    let provider = provider(&fake.base_url())?;
    let (events, error) = run(&provider, hello()).await?;
    assert_eq!(text_of(&events), "The answer");
    assert_eq!(error.map(|e| e.class), Some(ErrorClass::Overloaded));
    Ok(())
}

#[tokio::test]
async fn http_error_bodies_are_classified_without_the_key() -> TestResult {
    let fake = FakeProvider::start().await;
    let provider = provider(&fake.base_url())?;
    for (status, kind, message, class) in [
        (
            401,
            "authentication_error",
            "invalid x-api-key",
            ErrorClass::Auth,
        ),
        (
            403,
            "permission_error",
            "Your API key does not have permission to use the specified resource.",
            ErrorClass::Auth,
        ),
        (
            404,
            "not_found_error",
            "model: claude-nope",
            ErrorClass::InvalidRequest,
        ),
        (
            400,
            "invalid_request_error",
            "max_tokens: Field required",
            ErrorClass::InvalidRequest,
        ),
        (
            400,
            "invalid_request_error",
            "prompt is too long: 208000 tokens > 200000 maximum",
            ErrorClass::ContextLengthExceeded,
        ),
        (
            429,
            "rate_limit_error",
            "Number of request tokens has exceeded your per-minute rate limit",
            ErrorClass::RateLimited,
        ),
        (
            500,
            "api_error",
            "Internal server error",
            ErrorClass::Server,
        ),
        (
            529,
            "overloaded_error",
            "Overloaded",
            ErrorClass::Overloaded,
        ),
    ] {
        fake.push(
            Reply::status(status, error_body(kind, message))
                .header("request-id", "req_011CSHoEeqs5C35K2UUqR7Fy"),
        );
        let error = failure(&provider, hello()).await.ok_or("no error")?;
        assert_eq!(error.class, class, "{status} {kind}");
        assert_eq!(error.status, Some(status));
        assert_eq!(error.message, message);
        assert!(!error.to_string().contains(API_KEY));
    }
    fake.push(
        Reply::status(429, error_body("rate_limit_error", "slow down")).header("retry-after", "7"),
    );
    let error = failure(&provider, hello()).await.ok_or("no error")?;
    assert_eq!(error.retry_after, Some(Duration::from_secs(7)));
    Ok(())
}

#[tokio::test]
async fn connection_cut_before_the_end_is_transport() -> TestResult {
    let fake = FakeProvider::start().await;
    let body = text_stream(&["Hel", "lo"]);
    let text = std::str::from_utf8(&body)?;
    let cut = text
        .find("event: message_delta")
        .ok_or("no message_delta")?;
    fake.push(Reply::close_after(body.get(..cut).ok_or("short")?));
    let provider = provider(&fake.base_url())?;
    let (events, error) = run(&provider, hello()).await?;
    assert_eq!(text_of(&events), "Hello");
    assert_eq!(error.map(|e| e.class), Some(ErrorClass::Transport));
    Ok(())
}

#[tokio::test]
async fn stalled_stream_hits_the_idle_timeout() -> TestResult {
    let fake = FakeProvider::start().await;
    let body = text_stream(&["Hel", "lo"]);
    fake.push(Reply::stall_after(
        body.get(..body.len() / 2).ok_or("short")?,
    ));
    let short = TimeoutConfig {
        idle_ms: 300,
        ..timeouts()
    };
    let provider = Anthropic::new("claude", &config(&fake.base_url(), short))?;
    let started = std::time::Instant::now();
    let error = failure(&provider, hello()).await.ok_or("no error")?;
    assert_eq!(error.class, ErrorClass::Timeout);
    assert!(error.message.contains("idle timeout"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(3));
    Ok(())
}

#[tokio::test]
async fn extended_thinking_streams_and_is_replayed_first_with_its_tool_use() -> TestResult {
    let fake = FakeProvider::start().await;
    fake.push(Reply::sse(&fixture("thinking_interleaved_tool_use.sse")).chunks_every(71));
    fake.push(Reply::sse(&text_stream(&["Sunny, 14:00."])));
    let mut config = config(&fake.base_url(), timeouts());
    config.thinking_budget_tokens = Some(2048);
    let provider = Anthropic::new("claude", &config)?;
    let first = hello();
    let (events, error) = run(&provider, first.clone()).await?;
    assert_eq!(error, None);
    assert_eq!(text_of(&events), "Checking both.");
    let reasoning: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            ModelEvent::ReasoningCompleted(block) => Some(block.clone()),
            _ => None,
        })
        .collect();
    let calls: Vec<ToolCall> = events
        .iter()
        .filter_map(|e| match e {
            ModelEvent::ToolCallCompleted(call) => Some(call.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(reasoning.len(), 2);
    assert_eq!(
        calls
            .iter()
            .map(|c| c.arguments.clone())
            .collect::<Vec<_>>(),
        vec![
            json!({"location": "Paris"}),
            json!({"timezone": "Europe/Paris"})
        ]
    );

    let mut assistant = message(Role::Assistant, "Checking both.");
    assistant.reasoning = reasoning;
    assistant.tool_calls = calls.clone();
    let mut second = first;
    let mut messages = second.messages.to_vec();
    messages.push(assistant);
    for (call, output) in calls.iter().zip(["sunny", "14:00"]) {
        let mut result = message(Role::Tool, output);
        result.tool_call_id = Some(call.id.clone());
        messages.push(result);
    }
    second.messages = messages.into();
    let (events, error) = run(&provider, second).await?;
    assert_eq!((text_of(&events).as_str(), error), ("Sunny, 14:00.", None));

    let requests = fake.requests();
    let body = &requests.get(1).ok_or("no second request")?.body;
    assert_eq!(
        body.get("thinking"),
        Some(&json!({"type": "enabled", "budget_tokens": 2048}))
    );
    let kinds: Vec<_> = body
        .pointer("/messages/1/content")
        .and_then(|c| c.as_array())
        .map(|blocks| {
            blocks
                .iter()
                .filter_map(|b| b.get("type").and_then(|t| t.as_str()))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        kinds,
        [
            "thinking",
            "redacted_thinking",
            "text",
            "tool_use",
            "tool_use"
        ]
    );
    assert_eq!(
        body.pointer("/messages/1/content/0/signature"),
        Some(&json!(
            "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds"
        ))
    );
    Ok(())
}
