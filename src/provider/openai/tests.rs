//! Unit tests of the OpenAI adapter: recorded streams split at awkward boundaries, tool-call
//! fragment shapes, errors, and the request mapping.

use std::convert::Infallible;

use futures::StreamExt;
use serde_json::{Value, json};

use std::time::Duration;

use reqwest::header::HeaderMap;

use super::*;
use crate::config::TimeoutConfig;
use crate::provider::ToolSpec;
use crate::provider::http::{Deadlines, EXCERPT_CHARS, error_message, retry_after, with_timeouts};
use crate::provider::testing::*;

type TestResult = Result<(), Box<dyn std::error::Error>>;
const TEXT: &str = include_str!("../../../tests/fixtures/openai/text.sse");
const TOOL_CALL: &str = include_str!("../../../tests/fixtures/openai/tool_call.sse");
const PARALLEL: &str = include_str!("../../../tests/fixtures/openai/parallel_tool_calls.sse");
const ERROR_IN_STREAM: &str = include_str!("../../../tests/fixtures/openai/error_in_stream.sse");
const MALFORMED: &str = include_str!("../../../tests/fixtures/openai/malformed.sse");

fn parse_reads(reads: Vec<Vec<u8>>) -> Vec<Item> {
    parse_reads_with(parse_stream, reads)
}

fn parse(body: &str) -> Vec<Item> {
    parse_reads(vec![body.as_bytes().to_vec()])
}

/// A `data:` line of a chunk with one choice.
fn chunk(delta: Value, finish: Option<&str>) -> String {
    let chunk = json!({
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        "usage": null,
    });
    format!("data: {chunk}\n\n")
}

fn done() -> String {
    "data: [DONE]\n\n".to_owned()
}

fn usage(input: u64, output: u64, cached: Option<u64>) -> Item {
    Ok(ModelEvent::Usage {
        usage: TokenUsage {
            reasoning_tokens: 0,
            estimated: false,
            input_tokens: input,
            output_tokens: output,
            total_tokens: input + output,
        },
        cache: cached.map(|cached| CacheMetrics {
            cached_input_tokens: cached,
            ..CacheMetrics::default()
        }),
    })
}

fn text_events() -> Vec<Item> {
    let mut events: Vec<Item> = ["H", "éllo", " wö", "rld", " —", " 你", "好", " 🌍", "!"]
        .into_iter()
        .map(text)
        .collect();
    events.push(usage(19, 11, Some(0)));
    events.push(finished(FinishReason::Stop));
    events
}

fn error_of(events: &[Item]) -> Option<&ProviderError> {
    events.last().and_then(|e| e.as_ref().err())
}

#[test]
fn text_stream_gives_exact_events() {
    let events = parse(TEXT);
    assert_eq!(events, text_events());
    assert_eq!(joined_text(&events), "Héllo wörld — 你好 🌍!");
}

#[test]
fn text_stream_split_at_every_offset_gives_the_same_events() {
    let body = TEXT.as_bytes();
    for at in 0..=body.len() {
        assert_eq!(parse_reads(split(body, at)), text_events(), "split at {at}");
    }
}

#[test]
fn text_stream_one_byte_per_read_gives_the_same_events() {
    assert_eq!(parse_reads(bytewise(TEXT.as_bytes())), text_events());
}

#[test]
fn crlf_comments_and_data_without_space_are_accepted() {
    let body = TEXT
        .replace("data: ", "data:")
        .replace('\n', "\r\n")
        .replace("data:[DONE]", ": keep-alive\r\n\r\ndata:[DONE]");
    let body = format!(": OPENROUTER PROCESSING\r\n\r\n{body}");
    assert_eq!(parse(&body), text_events());
    for at in 0..=body.len() {
        assert_eq!(
            parse_reads(split(body.as_bytes(), at)),
            text_events(),
            "split at {at}"
        );
    }
}

fn tool_call_events() -> Vec<Item> {
    let id = "call_cVdX8QHtUQ6iNZCzCnUGfCRq";
    let mut events = vec![started(id, "get_weather")];
    for piece in [
        "{\"", "location", "\":\"", "Paris", ",", " France", "\",\"", "unit", "\":\"", "c",
        "elsius", "\"}",
    ] {
        events.push(delta(id, piece));
    }
    events.push(completed(
        id,
        "get_weather",
        json!({"location": "Paris, France", "unit": "celsius"}),
    ));
    events.push(usage(82, 24, Some(64)));
    events.push(finished(FinishReason::ToolCalls));
    events
}

#[test]
fn tool_call_fragments_are_assembled() {
    assert_eq!(parse(TOOL_CALL), tool_call_events());
}

#[test]
fn tool_call_stream_split_anywhere_gives_the_same_events() {
    let body = TOOL_CALL.as_bytes();
    for at in (0..=body.len()).step_by(7) {
        assert_eq!(
            parse_reads(split(body, at)),
            tool_call_events(),
            "split at {at}"
        );
    }
    assert_eq!(parse_reads(bytewise(body)), tool_call_events());
}

#[test]
fn parallel_tool_calls_interleave() {
    let a = "call_Lz7vQh3fWZ1sPj0hM9kB2aDx";
    let b = "call_Qm2cR8uXn4tYe6VbG1wK7sJo";
    assert_eq!(
        parse(PARALLEL),
        vec![
            started(a, "get_weather"),
            delta(a, "{\"location\":"),
            started(b, "get_time"),
            delta(b, "{\"timezone\":"),
            delta(a, " \"Tokyo\"}"),
            delta(b, " \"Asia/Tokyo\"}"),
            completed(a, "get_weather", json!({"location": "Tokyo"})),
            completed(b, "get_time", json!({"timezone": "Asia/Tokyo"})),
            usage(95, 47, Some(0)),
            finished(FinishReason::ToolCalls),
        ]
    );
}

#[test]
fn fragments_without_index_follow_ids_then_the_last_call() {
    let body = [
        chunk(
            json!({"tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{\"x\""}}]}),
            None,
        ),
        chunk(json!({"tool_calls": [{"function": {"arguments": ":1}"}}]}), None),
        chunk(
            json!({"tool_calls": [{"id": "b", "function": {"name": "g", "arguments": "{"}}]}),
            None,
        ),
        chunk(json!({"tool_calls": [{"id": "", "function": {"arguments": "}"}}]}), None),
        chunk(json!({}), Some("tool_calls")),
        done(),
    ]
    .concat();
    assert_eq!(
        parse(&body),
        vec![
            started("a", "f"),
            delta("a", "{\"x\""),
            delta("a", ":1}"),
            started("b", "g"),
            delta("b", "{"),
            delta("b", "}"),
            completed("a", "f", json!({"x": 1})),
            completed("b", "g", json!({})),
            finished(FinishReason::ToolCalls),
        ]
    );
}

#[test]
fn whole_call_in_one_chunk_with_its_finish_reason() {
    let body = [
        chunk(
            json!({"role": "assistant", "tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"q\":\"é\"}"}}]}),
            Some("tool_calls"),
        ),
        done(),
    ]
    .concat();
    assert_eq!(
        parse(&body),
        vec![
            started("c1", "f"),
            delta("c1", "{\"q\":\"é\"}"),
            completed("c1", "f", json!({"q": "é"})),
            finished(FinishReason::ToolCalls),
        ]
    );
}

#[test]
fn parameterless_calls_get_an_empty_object() {
    let body = [
        chunk(
            json!({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "now"}}]}),
            None,
        ),
        chunk(
            json!({"tool_calls": [{"index": 1, "id": "c2", "function": {"name": "today", "arguments": ""}}]}),
            None,
        ),
        chunk(json!({}), Some("tool_calls")),
        done(),
    ]
    .concat();
    assert_eq!(
        parse(&body),
        vec![
            started("c1", "now"),
            completed("c1", "now", json!({})),
            started("c2", "today"),
            completed("c2", "today", json!({})),
            finished(FinishReason::ToolCalls),
        ]
    );
}

#[test]
fn cumulative_arguments_replace_the_text_so_far() {
    let body = [
        chunk(
            json!({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{\"a\""}}]}),
            None,
        ),
        chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":1"}}]}), None),
        chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":1}"}}]}), None),
        chunk(json!({}), Some("tool_calls")),
        done(),
    ]
    .concat();
    assert_eq!(
        parse(&body),
        vec![
            started("c1", "f"),
            delta("c1", "{\"a\""),
            delta("c1", ":1"),
            delta("c1", "}"),
            completed("c1", "f", json!({"a": 1})),
            finished(FinishReason::ToolCalls),
        ]
    );
}

#[test]
fn call_starts_with_its_arguments_and_a_late_id_is_ignored() {
    let body = [
        chunk(json!({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{\"a\":"}}]}), None),
        chunk(json!({"tool_calls": [{"index": 0, "id": "late", "function": {"arguments": "2}"}}]}), None),
        chunk(json!({}), Some("tool_calls")),
        done(),
    ]
    .concat();
    assert_eq!(
        parse(&body),
        vec![
            started("call_0", "f"),
            delta("call_0", "{\"a\":"),
            delta("call_0", "2}"),
            completed("call_0", "f", json!({"a": 2})),
            finished(FinishReason::ToolCalls),
        ]
    );
}

#[test]
fn calls_without_ids_get_synthesized_ones() {
    let body = [
        chunk(
            json!({"function_call": {"name": "f", "arguments": "{}"}}),
            None,
        ),
        chunk(json!({}), Some("function_call")),
        done(),
    ]
    .concat();
    assert_eq!(
        parse(&body),
        vec![
            started("call_0", "f"),
            delta("call_0", "{}"),
            completed("call_0", "f", json!({})),
            finished(FinishReason::ToolCalls),
        ]
    );
}

#[test]
fn reused_index_with_a_new_id_opens_a_new_call() {
    let body = [
        chunk(json!({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f", "arguments": "{}"}}]}), None),
        chunk(json!({"tool_calls": [{"index": 0, "id": "b", "function": {"name": "g", "arguments": "{}"}}]}), None),
        chunk(json!({}), Some("tool_calls")),
        done(),
    ]
    .concat();
    assert_eq!(
        parse(&body),
        vec![
            started("a", "f"),
            delta("a", "{}"),
            started("b", "g"),
            delta("b", "{}"),
            completed("a", "f", json!({})),
            completed("b", "g", json!({})),
            finished(FinishReason::ToolCalls),
        ]
    );
}

#[test]
fn call_cut_off_by_length_completes_with_its_invalid_arguments() {
    let body = [
        chunk(json!({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{\"a\":\"lo"}}]}), None),
        chunk(json!({}), Some("length")),
        done(),
    ]
    .concat();
    assert_eq!(
        parse(&body),
        vec![
            started("c1", "f"),
            delta("c1", "{\"a\":\"lo"),
            invalid("c1", "f", "{\"a\":\"lo"),
            finished(FinishReason::Length),
        ]
    );
}

#[test]
fn stop_with_calls_reports_tool_calls() {
    let body = [
        chunk(json!({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{}"}}]}), None),
        chunk(json!({}), Some("stop")),
        done(),
    ]
    .concat();
    assert_eq!(
        parse(&body).last(),
        Some(&finished(FinishReason::ToolCalls))
    );
}

#[test]
fn missing_finish_reason_is_unknown_or_tool_calls() {
    let text_only = [chunk(json!({"content": "hi"}), None), done()].concat();
    assert_eq!(
        parse(&text_only),
        vec![text("hi"), finished(FinishReason::Unknown)]
    );
    let with_call = [
        chunk(json!({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{}"}}]}), None),
        done(),
    ]
    .concat();
    assert_eq!(
        parse(&with_call),
        vec![
            started("c1", "f"),
            delta("c1", "{}"),
            completed("c1", "f", json!({})),
            finished(FinishReason::ToolCalls),
        ]
    );
}

#[test]
fn finish_reasons_map() {
    for (raw, reason) in [
        ("stop", FinishReason::Stop),
        ("length", FinishReason::Length),
        ("content_filter", FinishReason::ContentFilter),
        ("tool_calls", FinishReason::ToolCalls),
        ("function_call", FinishReason::ToolCalls),
        ("something_new", FinishReason::Unknown),
    ] {
        let body = [chunk(json!({"content": "x"}), Some(raw)), done()].concat();
        assert_eq!(parse(&body).last(), Some(&finished(reason)), "{raw}");
    }
}

#[test]
fn empty_null_and_absent_choices_and_content_are_skipped() {
    let body = [
        "data: {\"choices\":null,\"usage\":null}\n\n".to_owned(),
        "data: {\"id\":\"x\"}\n\n".to_owned(),
        chunk(json!({"content": ""}), None),
        chunk(json!({"content": null}), None),
        chunk(json!({"content": "a"}), None),
        chunk(json!({}), Some("stop")),
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4}}\n\n".to_owned(),
        done(),
    ]
    .concat();
    assert_eq!(
        parse(&body),
        vec![text("a"), usage(3, 1, None), finished(FinishReason::Stop)]
    );
}

#[test]
fn end_without_done_after_finish_is_accepted() {
    let body = TEXT.replace("data: [DONE]\n\n", "");
    assert_eq!(parse(&body), text_events());
}

#[test]
fn clean_end_without_done_or_finish_is_a_transport_error() {
    let body = [chunk(json!({"content": "a"}), None)].concat();
    let items = parse(&body);
    assert_eq!(items.len(), 2, "{items:?}");
    assert_eq!(items[0], text("a"));
    let error = error_of(&items).unwrap();
    assert_eq!(error.class, ErrorClass::Transport, "{error:?}");
    assert!(error.message.contains("[DONE]"), "{}", error.message);
}

#[test]
fn body_without_events_is_a_server_error_quoting_it() {
    for (body, says) in [
        ("", "empty event stream"),
        ("\n\n", "empty event stream"),
        (
            "<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>",
            "an HTML page titled \"502 Bad Gateway\"",
        ),
        (
            "{\"id\":\"chatcmpl-1\",\"choices\":[]}",
            "{\"id\":\"chatcmpl-1\"",
        ),
    ] {
        let events = parse(body);
        assert_eq!(events.len(), 1, "{body}");
        let error = error_of(&events);
        assert_eq!(error.map(|e| e.class), Some(ErrorClass::Server), "{body}");
        let message = error.map(|e| e.message.clone()).unwrap_or_default();
        assert!(message.contains(says), "{body}: {message}");
    }
}

#[test]
fn error_in_stream_ends_it() {
    let events = parse(ERROR_IN_STREAM);
    assert_eq!(events.len(), 2);
    assert_eq!(events.first(), Some(&text("The answer")));
    let error = error_of(&events);
    assert_eq!(error.map(|e| e.class), Some(ErrorClass::Server));
    assert_eq!(
        error.map(|e| e.message.as_str()),
        Some("The server had an error while processing your request. Sorry about that!")
    );
}

#[test]
fn in_stream_errors_are_classified() {
    for (error, class) in [
        (
            json!({"message": "This model's maximum context length is 128000 tokens.", "type": "invalid_request_error", "code": "context_length_exceeded"}),
            ErrorClass::ContextLengthExceeded,
        ),
        (
            json!({"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}),
            ErrorClass::RateLimited,
        ),
        (
            json!({"message": "Overloaded", "type": "overloaded_error"}),
            ErrorClass::Overloaded,
        ),
        (
            json!({"message": "bad", "type": "BadRequestError", "code": 400}),
            ErrorClass::InvalidRequest,
        ),
        (json!("boom"), ErrorClass::Server),
    ] {
        let body = format!("data: {}\n\n", json!({ "error": error }));
        let events = parse(&body);
        assert_eq!(error_of(&events).map(|e| e.class), Some(class), "{error}");
    }
}

#[test]
fn malformed_chunk_is_a_server_error() {
    let events = parse(MALFORMED);
    assert_eq!(events.len(), 2);
    assert_eq!(events.first(), Some(&text("Hello")));
    let error = error_of(&events);
    assert_eq!(error.map(|e| e.class), Some(ErrorClass::Server));
    assert!(
        error.is_some_and(|e| e.message.starts_with("malformed chunk: ")),
        "{error:?}"
    );
}

#[test]
fn read_error_mid_stream_keeps_its_class() {
    let reads: Vec<Result<Vec<u8>, std::io::Error>> = vec![
        Ok(chunk(json!({"content": "a"}), None).into_bytes()),
        Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        )),
        Ok(done().into_bytes()),
    ];
    let events: Vec<Item> =
        futures::executor::block_on(parse_stream("test", futures::stream::iter(reads)).collect());
    assert_eq!(events.len(), 2);
    assert_eq!(
        error_of(&events).map(|e| e.class),
        Some(ErrorClass::Transport)
    );
}

#[tokio::test]
async fn idle_and_first_byte_timeouts_fire_and_are_named() {
    let timeouts = TimeoutConfig {
        connect_ms: 1000,
        first_byte_ms: 200,
        idle_ms: 50,
        total_ms: 10_000,
    };
    let reads = futures::stream::iter(vec![Ok::<_, Infallible>(
        chunk(json!({"content": "a"}), None).into_bytes(),
    )])
    .chain(futures::stream::pending());
    let events: Vec<Item> = parse_stream("test", with_timeouts(reads, Deadlines::start(&timeouts)))
        .collect()
        .await;
    assert_eq!(events.first(), Some(&text("a")));
    let error = error_of(&events);
    assert_eq!(error.map(|e| e.class), Some(ErrorClass::Timeout));
    assert!(
        error.is_some_and(|e| e.message.contains("idle timeout")),
        "{error:?}"
    );

    let silent = futures::stream::pending::<Result<Vec<u8>, Infallible>>();
    let events: Vec<Item> =
        parse_stream("test", with_timeouts(silent, Deadlines::start(&timeouts)))
            .collect()
            .await;
    assert!(
        error_of(&events).is_some_and(|e| e.message.contains("first-byte timeout")),
        "{events:?}"
    );

    let total = TimeoutConfig {
        total_ms: 30,
        ..timeouts
    };
    let silent = futures::stream::pending::<Result<Vec<u8>, Infallible>>();
    let events: Vec<Item> = parse_stream("test", with_timeouts(silent, Deadlines::start(&total)))
        .collect()
        .await;
    assert!(
        error_of(&events).is_some_and(|e| e.message.contains("total timeout")),
        "{events:?}"
    );
}

// --- errors of HTTP answers ------------------------------------------------------------------

fn class_of(status: u16, body: &str) -> ErrorClass {
    classify(Some(status), &ErrorDetail::from_body(body.as_bytes()))
}

#[test]
fn statuses_are_classified() {
    let plain = r#"{"error":{"message":"nope","type":"invalid_request_error","code":null}}"#;
    assert_eq!(class_of(401, plain), ErrorClass::Auth);
    assert_eq!(class_of(403, plain), ErrorClass::Auth);
    assert_eq!(class_of(429, plain), ErrorClass::RateLimited);
    assert_eq!(class_of(503, plain), ErrorClass::Overloaded);
    assert_eq!(class_of(529, plain), ErrorClass::Overloaded);
    assert_eq!(class_of(400, plain), ErrorClass::InvalidRequest);
    assert_eq!(class_of(404, plain), ErrorClass::InvalidRequest);
    assert_eq!(class_of(422, plain), ErrorClass::InvalidRequest);
    assert_eq!(class_of(500, plain), ErrorClass::Server);
    assert_eq!(
        class_of(502, "<html>bad gateway</html>"),
        ErrorClass::Server
    );
    let by_code = r#"{"error":{"message":"too long","type":"invalid_request_error","code":"context_length_exceeded"}}"#;
    assert_eq!(class_of(400, by_code), ErrorClass::ContextLengthExceeded);
    let by_message = r#"{"error":{"message":"This model's maximum context length is 8192 tokens. However, you requested 9000 tokens.","type":"invalid_request_error","code":null}}"#;
    assert_eq!(class_of(400, by_message), ErrorClass::ContextLengthExceeded);
    let vllm = r#"{"object":"error","message":"too many tokens in the prompt","type":"BadRequestError","code":400}"#;
    assert_eq!(class_of(400, vllm), ErrorClass::ContextLengthExceeded);
    assert_eq!(
        class_of(413, "request too large"),
        ErrorClass::ContextLengthExceeded
    );
}

#[test]
fn error_messages_prefer_the_provider_message() {
    let message_or = |detail: ErrorDetail, body: &[u8], status| {
        error_message(detail.message.as_deref(), body, status)
    };
    let detail = ErrorDetail::from_body(br#"{"error":{"message":"Incorrect API key provided"}}"#);
    assert_eq!(message_or(detail, b"", 401), "Incorrect API key provided");
    let body =
        b"<html><head><title>502 Bad\n Gateway</title></head><body>upstream error</body></html>";
    assert_eq!(
        message_or(ErrorDetail::from_body(body), body, 502),
        "HTTP 502: an HTML page titled \"502 Bad Gateway\""
    );
    let body = format!("<html><body>{}</body></html>", "x".repeat(100_000));
    assert_eq!(
        message_or(ErrorDetail::default(), body.as_bytes(), 500),
        "HTTP 500: an HTML page without a title"
    );
    assert_eq!(message_or(ErrorDetail::default(), b"", 500), "HTTP 500");
    let long = "x".repeat(1000);
    assert_eq!(
        message_or(ErrorDetail::default(), long.as_bytes(), 500)
            .chars()
            .count(),
        EXCERPT_CHARS + 1
    );
}

#[test]
fn retry_after_headers_are_read() -> TestResult {
    let mut headers = HeaderMap::new();
    assert_eq!(retry_after(&headers), None);
    headers.insert("retry-after", "7".parse()?);
    assert_eq!(retry_after(&headers), Some(Duration::from_secs(7)));
    headers.insert("retry-after-ms", "1500".parse()?);
    assert_eq!(retry_after(&headers), Some(Duration::from_millis(1500)));
    let mut date = HeaderMap::new();
    date.insert("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT".parse()?);
    assert_eq!(retry_after(&date), None);
    Ok(())
}

// --- request mapping -------------------------------------------------------------------------

fn body_of(request: &ModelRequest) -> Value {
    request_body(request, &Options::default())
}

fn request(messages: Vec<Message>, tools: Vec<ToolSpec>, tool_choice: ToolChoice) -> ModelRequest {
    ModelRequest {
        model: "gpt-4o-mini".to_owned(),
        messages: messages.into(),
        tools,
        tool_choice,
        max_output_tokens: None,
        ..ModelRequest::default()
    }
}

#[test]
fn request_without_tools_has_no_tool_keys() {
    let body = body_of(&request(
        vec![
            message(Role::System, vec![text_part("Be brief.")]),
            message(Role::User, vec![text_part("Hi "), text_part("there")]),
        ],
        Vec::new(),
        ToolChoice::Mode(ToolChoiceMode::Required),
    ));
    assert_eq!(
        body,
        json!({
            "model": "gpt-4o-mini",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there"},
            ],
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    );
}

#[test]
fn request_with_tool_calls_and_results_maps_the_history() {
    let mut assistant = message(Role::Assistant, Vec::new());
    assistant.tool_calls = vec![
        ToolCall {
            invalid_arguments: None,
            id: "call_1".to_owned(),
            name: "get_weather".to_owned(),
            arguments: json!({"location": "Paris"}),
        },
        ToolCall {
            invalid_arguments: None,
            id: "call_2".to_owned(),
            name: "now".to_owned(),
            arguments: json!({}),
        },
    ];
    let mut result_1 = message(
        Role::Tool,
        vec![ContentPart::Json {
            value: json!({"temp_c": 21}),
        }],
    );
    result_1.tool_call_id = Some("call_1".to_owned());
    result_1.tool_name = Some("get_weather".to_owned());
    let mut result_2 = message(Role::Tool, vec![text_part("12:00")]);
    result_2.tool_call_id = Some("call_2".to_owned());
    let mut req = request(
        vec![
            message(Role::User, vec![text_part("Weather?")]),
            assistant,
            result_1,
            result_2,
            message(Role::Assistant, vec![text_part("21 °C.")]),
        ],
        vec![ToolSpec {
            name: "get_weather".to_owned(),
            description: "Current weather".to_owned(),
            parameters: json!({"type": "object", "properties": {"location": {"type": "string"}}}),
        }],
        ToolChoice::Tool {
            name: "get_weather".to_owned(),
        },
    );
    req.max_output_tokens = Some(512);
    let body = request_body(&req, &Options::default());
    assert_eq!(
        body,
        json!({
            "model": "gpt-4o-mini",
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"location\":\"Paris\"}"}},
                    {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
                ]},
                {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\":21}"},
                {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
                {"role": "assistant", "content": "21 °C."},
            ],
            "stream": true,
            "stream_options": {"include_usage": true},
            "max_completion_tokens": 512,
            "tools": [{"type": "function", "function": {
                "name": "get_weather",
                "description": "Current weather",
                "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
            }}],
            "tool_choice": "required",
        })
    );
}

/// A `tool_choice` naming the only tool offered goes as `"required"` (llama-server reads no
/// other forcing form); with more tools offered, or `forced_tool_choice = "named"`, as the
/// named object.
#[test]
fn a_forced_tool_is_required_when_it_is_the_only_one_offered() {
    let tool = |name: &str| ToolSpec {
        name: name.to_owned(),
        description: String::new(),
        parameters: json!({"type": "object"}),
    };
    let forced = ToolChoice::Tool {
        name: "f".to_owned(),
    };
    let named = json!({"type": "function", "function": {"name": "f"}});
    let alone = request(Vec::new(), vec![tool("f")], forced.clone());
    assert_eq!(body_of(&alone)["tool_choice"], "required");
    let among = request(Vec::new(), vec![tool("f"), tool("g")], forced);
    assert_eq!(body_of(&among)["tool_choice"], named);
    let options = Options {
        forced_tool_choice: crate::config::ForcedToolChoice::Named,
        ..Options::default()
    };
    assert_eq!(request_body(&alone, &options)["tool_choice"], named);
}

#[test]
fn tool_choice_modes_and_images_map() {
    let tool = ToolSpec {
        name: "f".to_owned(),
        description: String::new(),
        parameters: json!({"type": "object"}),
    };
    for (mode, wire) in [
        (ToolChoiceMode::Auto, "auto"),
        (ToolChoiceMode::None, "none"),
        (ToolChoiceMode::Required, "required"),
    ] {
        let body = body_of(&request(
            Vec::new(),
            vec![tool.clone()],
            ToolChoice::Mode(mode),
        ));
        assert_eq!(body.get("tool_choice"), Some(&json!(wire)));
    }
    let user = message(
        Role::User,
        vec![
            text_part("What is this?"),
            ContentPart::Image {
                url: "https://example.com/cat.png".to_owned(),
                media_type: "image/png".to_owned(),
            },
        ],
    );
    let body = body_of(&request(vec![user], Vec::new(), ToolChoice::default()));
    assert_eq!(
        body.pointer("/messages/0/content"),
        Some(&json!([
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        ]))
    );
}

#[test]
fn adapter_keeps_the_base_url_without_trailing_slash() -> TestResult {
    let config = crate::config::Config::from_toml(
        "[providers.p]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:9/v1/\"\n[providers.p.models.m]\ncontext_window = 2\nmax_output_tokens = 1\n",
    )?;
    let provider = config.providers.get("p").ok_or("no provider")?;
    let adapter = OpenAi::new("p", provider)?;
    assert_eq!(adapter.endpoint.base_url, "http://127.0.0.1:9/v1");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Streams of real servers (tests/fixtures/README.md)

const LLAMACPP: &str =
    include_str!("../../../tests/fixtures/openai/llamacpp_reasoning_tool_call.sse");
const VLLM: &str = include_str!("../../../tests/fixtures/openai/vllm_reasoning_text.sse");
const OLLAMA: &str = include_str!("../../../tests/fixtures/openai/ollama_reasoning_tool_call.sse");
const DEEPSEEK: &str =
    include_str!("../../../tests/fixtures/openai/deepseek_reasoning_tool_call.sse");
const REFUSAL: &str = include_str!("../../../tests/fixtures/openai/openai_refusal.sse");
const REASONING_TOKENS: &str =
    include_str!("../../../tests/fixtures/openai/openai_reasoning_tokens.sse");
const NO_FINISH: &str = include_str!("../../../tests/fixtures/openai/no_finish_reason.sse");
const GARBLED: &str = include_str!("../../../tests/fixtures/openai/garbled_tool_calls.sse");

fn reasoning_completed(text: &str) -> Item {
    Ok(ModelEvent::ReasoningCompleted(Reasoning {
        text: text.to_owned(),
        signature: None,
        redacted_data: None,
    }))
}

fn usage_with_reasoning(input: u64, output: u64, reasoning: u64, cached: Option<u64>) -> Item {
    Ok(ModelEvent::Usage {
        usage: TokenUsage {
            reasoning_tokens: reasoning,
            estimated: false,
            input_tokens: input,
            output_tokens: output,
            total_tokens: input + output,
        },
        cache: cached.map(|cached| CacheMetrics {
            cached_input_tokens: cached,
            ..CacheMetrics::default()
        }),
    })
}

/// The same events whatever the reads: whole, one byte each, split at every 7th byte.
fn parse_every_way(body: &str) -> Vec<Item> {
    let events = parse(body);
    assert_eq!(parse_reads(bytewise(body.as_bytes())), events);
    for at in (0..body.len()).step_by(7) {
        assert_eq!(
            parse_reads(split(body.as_bytes(), at)),
            events,
            "split at {at}"
        );
    }
    events
}

#[test]
fn llamacpp_tool_call_with_function_call_duplicate_is_not_doubled() {
    assert_eq!(
        parse_every_way(LLAMACPP),
        vec![
            reasoning("The user wants "),
            reasoning("the weather in Paris. "),
            reasoning("I will call get_weather."),
            started("Z9fKq2cVbN1m", "get_weather"),
            delta("Z9fKq2cVbN1m", "{\"location\":"),
            delta("Z9fKq2cVbN1m", "\"Paris, France\""),
            delta("Z9fKq2cVbN1m", "}"),
            completed(
                "Z9fKq2cVbN1m",
                "get_weather",
                json!({"location": "Paris, France"})
            ),
            reasoning_completed("The user wants the weather in Paris. I will call get_weather."),
            usage_with_reasoning(212, 41, 0, None),
            finished(FinishReason::ToolCalls),
        ]
    );
}

#[test]
fn vllm_reasoning_content_is_never_text() {
    assert_eq!(
        parse_every_way(VLLM),
        vec![
            reasoning("2 + 2: "),
            reasoning("add the units."),
            text("The answer "),
            text("is 4."),
            reasoning_completed("2 + 2: add the units."),
            usage_with_reasoning(18, 43, 0, None),
            finished(FinishReason::Stop),
        ]
    );
}

#[test]
fn ollama_reasoning_and_whole_call_without_usage() {
    assert_eq!(
        parse_every_way(OLLAMA),
        vec![
            reasoning("Need the time "),
            reasoning("in Tokyo."),
            started("call_k3b9x2lq", "get_time"),
            delta("call_k3b9x2lq", "{\"timezone\":\"Asia/Tokyo\"}"),
            completed(
                "call_k3b9x2lq",
                "get_time",
                json!({"timezone": "Asia/Tokyo"})
            ),
            reasoning_completed("Need the time in Tokyo."),
            // No usage reported: no Usage event (never zeros).
            finished(FinishReason::ToolCalls),
        ]
    );
}

#[test]
fn deepseek_reasoning_tool_call_and_reasoning_tokens() {
    let id = "call_00_Vw9dEfHk2mXoP4rT";
    assert_eq!(
        parse_every_way(DEEPSEEK),
        vec![
            reasoning("I should look "),
            reasoning("up the file first."),
            started(id, "read_file"),
            delta(id, "{\"path\""),
            delta(id, ": \"notes.md\"}"),
            completed(id, "read_file", json!({"path": "notes.md"})),
            reasoning_completed("I should look up the file first."),
            usage_with_reasoning(320, 58, 37, Some(256)),
            finished(FinishReason::ToolCalls),
        ]
    );
}

#[test]
fn refusal_is_visible_text_and_content_filter() {
    assert_eq!(
        parse_every_way(REFUSAL),
        vec![
            text("I'm sorry, "),
            text("I can't help with that."),
            usage_with_reasoning(25, 9, 0, Some(0)),
            finished(FinishReason::ContentFilter),
        ]
    );
}

#[test]
fn reasoning_tokens_of_openai_usage_are_counted() {
    assert_eq!(
        parse_every_way(REASONING_TOKENS),
        vec![
            text("Paris "),
            text("is the capital."),
            usage_with_reasoning(14, 210, 192, Some(0)),
            finished(FinishReason::Stop),
        ]
    );
}

#[test]
fn done_without_finish_reason_is_unknown() {
    assert_eq!(
        parse_every_way(NO_FINISH),
        vec![
            text("The report "),
            text("covers three"),
            finished(FinishReason::Unknown),
        ]
    );
}

#[test]
fn garbled_arguments_complete_every_call() {
    let events = parse_every_way(GARBLED);
    let completed: Vec<_> = events
        .iter()
        .filter(|e| matches!(e, Ok(ModelEvent::ToolCallCompleted(_))))
        .cloned()
        .collect();
    assert_eq!(
        completed,
        vec![
            // A raw newline inside a string: escaped, the call is valid.
            super::super::testing::completed(
                "c0",
                "write_file",
                json!({"path": "a.py", "content": "print(1)\nprint(2)"})
            ),
            invalid(
                "c1",
                "get_weather",
                "{\"location\":\"Paris\"}{\"location\":\"Paris\"}"
            ),
            invalid(
                "c2",
                "write_file",
                "{\"path\":\"b.md\",\"content\":\"# Long"
            ),
        ]
    );
    let started = events
        .iter()
        .filter(|e| matches!(e, Ok(ModelEvent::ToolCallStarted { .. })))
        .count();
    assert_eq!(started, 3);
    assert_eq!(events.last(), Some(&finished(FinishReason::Length)));
}

#[test]
fn split_names_join_and_repeated_names_do_not() {
    let body = [
        chunk(json!({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "get_"}}]}), None),
        chunk(json!({"tool_calls": [{"index": 0, "function": {"name": "weather"}}]}), None),
        chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}), None),
        chunk(json!({"tool_calls": [{"index": 1, "id": "b", "function": {"name": "get_time", "arguments": ""}}]}), None),
        chunk(json!({"tool_calls": [{"index": 1, "id": "b", "function": {"name": "get_time", "arguments": "{\"tz\":"}}]}), None),
        chunk(json!({"tool_calls": [{"index": 1, "id": "b", "function": {"name": "get_time", "arguments": "1}"}}]}), None),
        chunk(json!({}), Some("tool_calls")),
        done(),
    ]
    .concat();
    assert_eq!(
        parse(&body),
        vec![
            started("a", "get_weather"),
            delta("a", "{}"),
            started("b", "get_time"),
            delta("b", "{\"tz\":"),
            delta("b", "1}"),
            completed("a", "get_weather", json!({})),
            completed("b", "get_time", json!({"tz": 1})),
            finished(FinishReason::ToolCalls),
        ]
    );
}

#[test]
fn duplicate_and_missing_ids_are_made_unique() {
    let body = [
        chunk(json!({"tool_calls": [{"index": 0, "id": "call_0", "function": {"name": "f", "arguments": "{}"}}]}), None),
        chunk(json!({"tool_calls": [{"index": 1, "id": "call_0", "function": {"name": "g", "arguments": "{}"}}]}), None),
        chunk(json!({"tool_calls": [{"index": 2, "function": {"name": "h", "arguments": "{}"}}]}), None),
        chunk(json!({}), Some("tool_calls")),
        done(),
    ]
    .concat();
    let events = parse(&body);
    let ids: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            Ok(ModelEvent::ToolCallCompleted(call)) => Some(call.id.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(ids, ["call_0", "call_0_2", "call_1"]);
    // Ids of the history are taken too: a server reusing `call_0` in every turn.
    let mut history = message(Role::Assistant, Vec::new());
    history.tool_calls = vec![ToolCall {
        id: "call_0".to_owned(),
        name: "f".to_owned(),
        arguments: json!({}),
        invalid_arguments: None,
    }];
    let reads: Vec<Result<Vec<u8>, Infallible>> = vec![Ok(body.into_bytes())];
    let stream = sse::parse(
        futures::stream::iter(reads),
        Parser::new("test", CallIds::of_history(&[history])),
    );
    let events: Vec<Item> = futures::executor::block_on(stream.collect());
    assert!(
        events.contains(&completed("call_0_2", "f", json!({}))),
        "{events:?}"
    );
}

#[test]
fn zero_usage_is_not_reported() {
    let body = [
        chunk(json!({"content": "a"}), Some("stop")),
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":0,\"completion_tokens\":0,\"total_tokens\":0}}\n\n".to_owned(),
        done(),
    ]
    .concat();
    assert_eq!(parse(&body), vec![text("a"), finished(FinishReason::Stop)]);
}

#[test]
fn context_length_wordings_of_compatible_servers_are_classified() {
    for body in [
        r#"{"error":{"message":"This model's maximum context length is 4096 tokens. However, you requested 5000 tokens.","type":"BadRequestError","code":400}}"#,
        r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9000,"n_ctx":8192}}"#,
        r#"{"error":{"message":"prompt too long; exceeded max context length by 120 tokens","type":"api_error"}}"#,
        r#"{"error":{"message":"Context length exceeded","type":"invalid_request_error","code":"context_length_exceeded"}}"#,
    ] {
        assert_eq!(
            class_of(400, body),
            ErrorClass::ContextLengthExceeded,
            "{body}"
        );
    }
    // The recorded bodies of each server (tests/fixtures/context_length/), with their status.
    for (file, status) in [
        ("openai.json", 400),
        ("vllm_legacy.json", 400),
        ("vllm.json", 400),
        ("llamacpp.json", 400),
        ("ollama.json", 500),
        ("lmstudio.json", 400),
    ] {
        let path = format!(
            "{}/tests/fixtures/context_length/{file}",
            env!("CARGO_MANIFEST_DIR")
        );
        let body = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(!body.is_empty(), "{path}");
        assert_eq!(
            class_of(status, &body),
            ErrorClass::ContextLengthExceeded,
            "{file}"
        );
    }
    let llamacpp = r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error"}}"#;
    assert_eq!(
        classify(None, &ErrorDetail::from_body(llamacpp.as_bytes())),
        ErrorClass::ContextLengthExceeded
    );
}

// ---------------------------------------------------------------------------------------------
// Request options

fn with_tool_call(text: &str, reasoning: &str) -> Message {
    let mut m = message(Role::Assistant, vec![text_part(text)]);
    if text.is_empty() {
        m.content.clear();
    }
    if !reasoning.is_empty() {
        m.reasoning = vec![Reasoning {
            text: reasoning.to_owned(),
            signature: None,
            redacted_data: None,
        }];
    }
    m.tool_calls = vec![ToolCall {
        id: "c1".to_owned(),
        name: "f".to_owned(),
        arguments: json!({}),
        invalid_arguments: None,
    }];
    m
}

fn tool_result_message() -> Message {
    let mut m = message(Role::Tool, vec![text_part("ok")]);
    m.tool_call_id = Some("c1".to_owned());
    m
}

#[test]
fn empty_assistant_messages_are_left_out() {
    let empty = message(Role::Assistant, Vec::new());
    let blank = message(Role::Assistant, vec![text_part("")]);
    let body = body_of(&request(
        vec![
            message(Role::User, vec![text_part("a")]),
            empty,
            blank,
            message(Role::User, vec![text_part("b")]),
        ],
        Vec::new(),
        ToolChoice::default(),
    ));
    assert_eq!(
        body.get("messages"),
        Some(&json!([
            {"role": "user", "content": "a"},
            {"role": "user", "content": "b"},
        ]))
    );
}

#[test]
fn assistant_tool_call_content_option_and_max_tokens_field() {
    let messages = vec![
        message(Role::User, vec![text_part("go")]),
        with_tool_call("", ""),
        tool_result_message(),
    ];
    let mut req = request(messages, Vec::new(), ToolChoice::default());
    req.max_output_tokens = Some(100);
    for (content, expected) in [
        (AssistantToolCallContent::Null, Some(Value::Null)),
        (AssistantToolCallContent::Empty, Some(json!(""))),
        (AssistantToolCallContent::Omit, None),
    ] {
        let options = Options {
            assistant_tool_call_content: content,
            max_tokens_field: MaxTokensField::MaxTokens,
            ..Options::default()
        };
        let body = request_body(&req, &options);
        assert_eq!(
            body.pointer("/messages/1/content"),
            expected.as_ref(),
            "{content:?}"
        );
        assert!(body.pointer("/messages/1/tool_calls/0").is_some());
        assert_eq!(body.get("max_tokens"), Some(&json!(100)));
        assert_eq!(body.get("max_completion_tokens"), None);
    }
    assert_eq!(
        default_max_tokens_field("https://api.openai.com/v1"),
        MaxTokensField::MaxCompletionTokens
    );
    assert_eq!(
        default_assistant_tool_call_content("https://api.openai.com/v1"),
        AssistantToolCallContent::Null
    );
    for url in [
        "http://127.0.0.1:8080/v1",
        "https://api.deepseek.com",
        "https://openrouter.ai/api/v1",
    ] {
        assert_eq!(
            default_max_tokens_field(url),
            MaxTokensField::MaxTokens,
            "{url}"
        );
        assert_eq!(
            default_assistant_tool_call_content(url),
            AssistantToolCallContent::Empty,
            "{url}"
        );
    }
}

#[test]
fn reasoning_replay_follows_the_option() {
    let messages = vec![
        message(Role::User, vec![text_part("q1")]),
        {
            let mut m = message(Role::Assistant, vec![text_part("plain answer")]);
            m.reasoning = vec![Reasoning {
                text: "no tools here".to_owned(),
                signature: None,
                redacted_data: None,
            }];
            m
        },
        message(Role::User, vec![text_part("q2")]),
        with_tool_call("", "need a tool"),
        tool_result_message(),
        {
            let mut m = message(Role::Assistant, vec![text_part("done")]);
            m.reasoning = vec![Reasoning {
                text: "got it".to_owned(),
                signature: None,
                redacted_data: None,
            }];
            m
        },
    ];
    let req = request(messages, Vec::new(), ToolChoice::default());
    let replayed = |replay| {
        let body = request_body(
            &req,
            &Options {
                reasoning_replay: replay,
                reasoning_effort: Some(ReasoningEffort::Low),
                ..Options::default()
            },
        );
        assert_eq!(body.get("reasoning_effort"), Some(&json!("low")));
        body.get("messages")
            .and_then(Value::as_array)
            .map(|messages| {
                messages
                    .iter()
                    .map(|m| m.get("reasoning_content").cloned())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    let some = |s: &str| Some(json!(s));
    assert_eq!(replayed(ReasoningReplay::None), vec![None; 6]);
    assert_eq!(
        replayed(ReasoningReplay::ToolTurns),
        vec![None, None, None, some("need a tool"), None, some("got it")]
    );
    assert_eq!(
        replayed(ReasoningReplay::All),
        vec![
            None,
            some("no tools here"),
            None,
            some("need a tool"),
            None,
            some("got it")
        ]
    );
}

#[test]
fn reasoning_sent_in_both_fields_is_taken_once() {
    // vLLM versions that send the same text as `reasoning_content` and `reasoning`.
    let body = [
        chunk(
            json!({"reasoning_content": "think", "reasoning": "think"}),
            None,
        ),
        chunk(json!({"reasoning": "ing"}), None),
        chunk(json!({"content": "ok"}), Some("stop")),
        done(),
    ]
    .concat();
    assert_eq!(
        parse(&body),
        vec![
            reasoning("think"),
            reasoning("ing"),
            text("ok"),
            reasoning_completed("thinking"),
            finished(FinishReason::Stop),
        ]
    );
}

#[test]
fn instructions_parameters_and_options_take_their_places() {
    let mut request = request(
        vec![message(Role::User, vec![text_part("Hi")])],
        vec![ToolSpec {
            name: "t".to_owned(),
            description: String::new(),
            parameters: json!({"type": "object"}),
        }],
        ToolChoice::default(),
    );
    request.instructions = Some("Be brief.".to_owned());
    request.temperature = Some(0.5);
    request.top_p = Some(0.8);
    request.stop = vec!["END".to_owned()];
    request.seed = Some(3);
    request.parallel_tool_calls = Some(false);
    request.max_output_tokens = Some(99);
    // Owned keys in the options are ignored even if validation let them through.
    for (key, value) in [
        ("messages", json!([])),
        ("stream", json!(false)),
        ("tools", json!([])),
        ("temperature", json!(2)),
        ("user", json!("u")),
    ] {
        request.provider_options.insert(key.to_owned(), value);
    }
    let body = request_body(
        &request,
        &Options {
            instructions_role: crate::config::InstructionsRole::Developer,
            ..Options::default()
        },
    );
    assert_eq!(
        body["messages"],
        json!([
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
        ])
    );
    assert_eq!(
        (
            &body["temperature"],
            &body["top_p"],
            &body["stop"],
            &body["seed"],
            &body["parallel_tool_calls"],
            &body["max_completion_tokens"],
            &body["stream"],
            &body["user"],
        ),
        (
            &json!(0.5),
            &json!(0.8),
            &json!(["END"]),
            &json!(3),
            &json!(false),
            &json!(99),
            &json!(true),
            &json!("u"),
        )
    );
    assert_eq!(body["tools"][0]["function"]["name"], "t");
    // Without tools, `parallel_tool_calls` is not sent (the API refuses it).
    request.tools.clear();
    assert!(body_of(&request).get("parallel_tool_calls").is_none());
    // Empty instructions are none.
    request.instructions = Some(String::new());
    assert_eq!(body_of(&request)["messages"][0]["role"], "user");
}

#[test]
fn system_instructions_and_leading_system_messages_are_one_message() {
    let mut request = request(
        vec![
            message(
                Role::System,
                vec![text_part("Summary of the earlier conversation.")],
            ),
            message(Role::User, vec![text_part("Hi")]),
            message(Role::System, vec![text_part("Later note.")]),
        ],
        Vec::new(),
        ToolChoice::default(),
    );
    request.instructions = Some("Be brief.".to_owned());
    assert_eq!(
        body_of(&request)["messages"],
        json!([
            {"role": "system", "content": "Be brief.\n\nSummary of the earlier conversation."},
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": "Later note."},
        ])
    );
    // Without instructions the leading system messages are still one.
    request.instructions = None;
    let mut messages = request.messages.to_vec();
    messages.insert(
        0,
        message(Role::System, vec![text_part("Stored system prompt.")]),
    );
    request.messages = messages.into();
    assert_eq!(
        body_of(&request)["messages"][0],
        json!({"role": "system", "content": "Stored system prompt.\n\nSummary of the earlier conversation."})
    );
    // `developer` instructions stay their own message.
    let body = request_body(
        &request,
        &Options {
            instructions_role: crate::config::InstructionsRole::Developer,
            ..Options::default()
        },
    );
    assert_eq!(body["messages"][0]["role"], "system");
    assert_eq!(body["messages"].as_array().map(Vec::len), Some(4));
}

#[test]
fn a_5xx_stating_a_validation_failure_is_invalid_request_naming_its_cause() {
    let message = "3 validation errors for Request\n\
        messages.1.system.role\n  Input should be 'system' [type=literal_error, input_value='assistant', input_type=str]\n    \
        For further information visit https://errors.pydantic.dev/2.11/v/literal_error\n\
        messages.1.assistant.content\n  Input should be a valid string [type=string_type, input_value=None, input_type=NoneType]\n    \
        For further information visit https://errors.pydantic.dev/2.11/v/string_type\n\
        messages.1.user.role\n  Input should be 'user' [type=literal_error, input_value='assistant', input_type=str]\n";
    let body = json!({"error": {"message": message, "type": "internal_server_error",
                                "param": null, "code": null}})
    .to_string();
    assert_eq!(class_of(500, &body), ErrorClass::InvalidRequest);
    assert_eq!(class_of(502, &body), ErrorClass::InvalidRequest);
    let detail = ErrorDetail::from_body(body.as_bytes());
    assert_eq!(
        detail.message.as_deref(),
        Some(
            "3 validation errors for Request: messages.1.assistant.content: Input should be a \
             valid string [type=string_type, input_value=None, input_type=NoneType]"
        )
    );
    // llama-cpp-python's server: a 500 listing seven errors as Python dicts, the third the
    // cause (an assistant message's content must be a string), then a traceback.
    let recorded = include_str!("../../../tests/fixtures/llama_cpp_python/content_null.500.json");
    assert_eq!(class_of(500, recorded), ErrorClass::InvalidRequest);
    assert_eq!(
        ErrorDetail::from_body(recorded.as_bytes())
            .message
            .as_deref(),
        Some(
            "7 validation errors: body.messages.1.ChatCompletionRequestAssistantMessage.content: \
             Input should be a valid string"
        )
    );
    // FastAPI's 422 list.
    let fastapi = r#"{"detail":[{"type":"string_type","loc":["body","messages",1,"content"],"msg":"Input should be a valid string","input":null}]}"#;
    assert_eq!(class_of(422, fastapi), ErrorClass::InvalidRequest);
    assert_eq!(
        ErrorDetail::from_body(fastapi.as_bytes())
            .message
            .as_deref(),
        Some("validation error: body.messages.1.content: Input should be a valid string")
    );
    // A plain 500 stays a (retried) server error; a one-line message is kept as it is.
    let plain =
        r#"{"error":{"message":"The server had an error.\nTry again.","type":"server_error"}}"#;
    assert_eq!(class_of(500, plain), ErrorClass::Server);
    assert_eq!(
        ErrorDetail::from_body(plain.as_bytes()).message.as_deref(),
        Some("The server had an error.\nTry again.")
    );
}
