//! Unit tests of the Anthropic adapter: recorded streams split at awkward boundaries, SSE
//! framing, tool_use blocks, stop reasons, usage, errors, and the request mapping.

use serde_json::{Value, json};

use super::*;
use crate::provider::ToolSpec;
use crate::provider::testing::*;

const TEXT: &str = include_str!("../../../tests/fixtures/anthropic/text.sse");
const TOOL_USE: &str = include_str!("../../../tests/fixtures/anthropic/tool_use.sse");
const PARALLEL: &str = include_str!("../../../tests/fixtures/anthropic/parallel_tool_use.sse");
const ERROR_IN_STREAM: &str = include_str!("../../../tests/fixtures/anthropic/error_in_stream.sse");
const MAX_TOKENS: &str =
    include_str!("../../../tests/fixtures/anthropic/max_tokens_in_tool_use.sse");

fn parse_reads(reads: Vec<Vec<u8>>) -> Vec<Item> {
    parse_reads_with(parse_stream, reads)
}

fn parse(body: &str) -> Vec<Item> {
    parse_reads(vec![body.as_bytes().to_vec()])
}

fn usage(input: u64, output: u64, creation: u64, read: u64) -> Item {
    Ok(ModelEvent::Usage {
        usage: TokenUsage {
            reasoning_tokens: 0,
            estimated: false,
            input_tokens: input,
            output_tokens: output,
            total_tokens: input + output,
        },
        cache: Some(CacheMetrics {
            cache_creation_input_tokens: creation,
            cache_read_input_tokens: read,
            cached_input_tokens: 0,
        }),
    })
}

fn error_of(events: &[Item]) -> Option<&ProviderError> {
    events.iter().find_map(|e| e.as_ref().err())
}

fn text_events() -> Vec<Item> {
    vec![
        text("Héllo "),
        text("wörld"),
        text(" — 你"),
        text("好 🌍"),
        text("!"),
        usage(12, 15, 0, 0),
        finished(FinishReason::Stop),
    ]
}

#[test]
fn text_stream_gives_exact_events() {
    assert_eq!(parse(TEXT), text_events());
}

#[test]
fn text_stream_split_at_every_offset_gives_the_same_events() {
    let body = TEXT.as_bytes();
    for at in 1..body.len() {
        let events = parse_reads(split(body, at));
        assert_eq!(
            joined_text(&events),
            "Héllo wörld — 你好 🌍!",
            "split at {at}"
        );
        assert_eq!(events.last(), text_events().last(), "split at {at}");
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
        .replacen("event:", ": keep-alive comment\r\nevent:", 3);
    assert_eq!(parse(&body), text_events());
}

#[test]
fn events_without_event_names_are_read_by_their_type() {
    let body: String = TEXT
        .lines()
        .filter(|line| !line.starts_with("event:"))
        .map(|line| format!("{line}\n"))
        .collect();
    assert_eq!(parse(&body), text_events());
}

fn tool_use_events() -> Vec<Item> {
    let id = "toolu_01T1x1fJ34qAmk2tNTrN7Up6";
    vec![
        text("I'll check the weather"),
        text(" in Paris for you."),
        started(id, "get_weather"),
        delta(id, "{\"location\":"),
        delta(id, " \"Paris, Fr"),
        delta(id, "ance\""),
        delta(id, ", \"unit\": \"c"),
        delta(id, "elsius\"}"),
        completed(
            id,
            "get_weather",
            json!({"location": "Paris, France", "unit": "celsius"}),
        ),
        usage(472 + 2048, 89, 0, 2048),
        finished(FinishReason::ToolCalls),
    ]
}

#[test]
fn input_json_delta_pieces_are_assembled() {
    assert_eq!(parse(TOOL_USE), tool_use_events());
}

#[test]
fn tool_use_stream_split_anywhere_gives_the_same_calls() {
    let body = TOOL_USE.as_bytes();
    for at in (1..body.len()).step_by(7) {
        let events = parse_reads(split(body, at));
        assert_eq!(events, tool_use_events(), "split at {at}");
    }
}

#[test]
fn parallel_tool_use_blocks_and_empty_input() {
    let weather = "toolu_01A09q90qw90lq917835lq9";
    let time = "toolu_01B19r91rx91mr028946mr0";
    assert_eq!(
        parse(PARALLEL),
        vec![
            started(weather, "get_weather"),
            delta(weather, "{\"locati"),
            delta(weather, "on\": \"Paris\"}"),
            completed(weather, "get_weather", json!({"location": "Paris"})),
            started(time, "get_time"),
            completed(time, "get_time", json!({})),
            usage(520 + 1800, 74, 1800, 0),
            finished(FinishReason::ToolCalls),
        ]
    );
}

#[test]
fn tool_use_cut_by_max_tokens_completes_with_its_invalid_arguments() {
    let events = parse(MAX_TOKENS);
    let raw = "{\"path\": \"notes.md\", \"content\": \"# Notes\\n\\nThe first line of a long";
    assert!(
        events.contains(&invalid("toolu_01C29s92sy92ns139057ns1", "write_file", raw)),
        "{events:?}"
    );
    assert_eq!(events.last(), Some(&finished(FinishReason::Length)));
    assert_eq!(error_of(&events), None);
}

#[test]
fn complete_call_before_a_max_tokens_cut_is_kept() {
    // A whole call, then a text block cut by max_tokens: the call is complete.
    let body = PARALLEL
        .replace("\"stop_reason\":\"tool_use\"", "\"stop_reason\":\"max_tokens\"")
        .replace(
            "event: message_delta",
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":2,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\nevent: message_delta",
        );
    let events = parse(&body);
    let completed: Vec<_> = events
        .iter()
        .filter(|e| matches!(e, Ok(ModelEvent::ToolCallCompleted(_))))
        .collect();
    assert_eq!(completed.len(), 2, "{events:?}");
    assert_eq!(events.last(), Some(&finished(FinishReason::Length)));
}

#[test]
fn stop_reasons_map() {
    for (reason, expected) in [
        ("end_turn", FinishReason::Stop),
        ("stop_sequence", FinishReason::Stop),
        ("tool_use", FinishReason::ToolCalls),
        ("max_tokens", FinishReason::Length),
        ("refusal", FinishReason::ContentFilter),
        ("pause_turn", FinishReason::Unknown),
        ("something_new", FinishReason::Unknown),
    ] {
        let body = TEXT.replace("end_turn", reason);
        assert_eq!(parse(&body).last(), Some(&finished(expected)), "{reason}");
    }
}

#[test]
fn unknown_events_and_blocks_are_skipped() {
    let extra = "event: future_event\ndata: {\"type\":\"future_event\",\"x\":1}\n\n\
                 event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":9,\"content_block\":{\"type\":\"server_tool_use\",\"id\":\"srvtoolu_1\"}}\n\n\
                 event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":9,\"delta\":{\"type\":\"future_delta\",\"x\":\"hmm\"}}\n\n\
                 event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":9}\n\n";
    let body = TEXT.replacen(
        "event: content_block_start",
        &format!("{extra}event: content_block_start"),
        1,
    );
    assert_eq!(parse(&body), text_events());
}

#[test]
fn usage_in_message_delta_is_cumulative_and_replaces() {
    let body = TEXT.replace(
        "\"usage\":{\"output_tokens\":15}",
        "\"usage\":{\"input_tokens\":12,\"cache_read_input_tokens\":100,\"output_tokens\":15}",
    );
    let events = parse(&body);
    assert!(events.contains(&usage(112, 15, 0, 100)), "{events:?}");
}

#[test]
fn error_event_ends_the_stream_classified() {
    let events = parse(ERROR_IN_STREAM);
    assert_eq!(joined_text(&events), "The answer");
    let error = error_of(&events).cloned();
    assert_eq!(
        error.as_ref().map(|e| e.class),
        Some(ErrorClass::Overloaded)
    );
    assert_eq!(error.map(|e| e.message), Some("Overloaded".to_owned()));
    assert!(events.last().is_some_and(Result::is_err));
}

#[test]
fn in_stream_error_types_are_classified() {
    for (kind, message, class) in [
        ("overloaded_error", "Overloaded", ErrorClass::Overloaded),
        ("rate_limit_error", "slow down", ErrorClass::RateLimited),
        ("api_error", "Internal server error", ErrorClass::Server),
        (
            "authentication_error",
            "invalid x-api-key",
            ErrorClass::Auth,
        ),
        ("invalid_request_error", "bad", ErrorClass::InvalidRequest),
        (
            "invalid_request_error",
            "prompt is too long: 208000 tokens > 200000 maximum",
            ErrorClass::ContextLengthExceeded,
        ),
        ("something_new", "?", ErrorClass::Server),
    ] {
        let body = format!(
            "event: error\ndata: {}\n\n",
            json!({"type": "error", "error": {"type": kind, "message": message}})
        );
        let events = parse(&body);
        assert_eq!(error_of(&events).map(|e| e.class), Some(class), "{kind}");
    }
}

#[test]
fn end_without_message_stop_after_stop_reason_is_a_transport_error() {
    let body = TEXT.replace(
        "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        "",
    );
    let events = parse(&body);
    assert_eq!(joined_text(&events), "Héllo wörld — 你好 🌍!");
    assert_eq!(
        error_of(&events).map(|e| (e.class, e.message.as_str())),
        Some((
            ErrorClass::Transport,
            "connection closed before message_stop"
        ))
    );
}

#[test]
fn end_before_any_stop_reason_is_a_transport_error() {
    let cut = TEXT.find("event: message_delta").unwrap_or(0);
    let events = parse(TEXT.get(..cut).unwrap_or_default());
    assert_eq!(joined_text(&events), "Héllo wörld — 你好 🌍!");
    assert_eq!(
        error_of(&events).map(|e| e.class),
        Some(ErrorClass::Transport)
    );
}

#[test]
fn malformed_event_is_a_server_error() {
    let body = TEXT.replacen(
        "{\"type\":\"content_block_delta\"",
        "{\"type\":\"content_block_delta\",",
        1,
    );
    let events = parse(&body);
    let error = error_of(&events);
    assert_eq!(error.map(|e| e.class), Some(ErrorClass::Server));
    assert!(error.is_some_and(|e| e.message.starts_with("malformed event")));
}

fn class_of(status: u16, body: &Value) -> ErrorClass {
    classify(
        Some(status),
        &ErrorDetail::from_body(body.to_string().as_bytes()),
    )
}

fn anthropic_error(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

#[test]
fn http_errors_are_classified() {
    for (status, kind, message, class) in [
        (
            400,
            "invalid_request_error",
            "messages: at least one message is required",
            ErrorClass::InvalidRequest,
        ),
        (
            400,
            "invalid_request_error",
            "prompt is too long: 208000 tokens > 200000 maximum",
            ErrorClass::ContextLengthExceeded,
        ),
        (
            400,
            "invalid_request_error",
            "input length and `max_tokens` exceed context limit: 188240 + 21333 > 200000, decrease input length or `max_tokens` and try again",
            ErrorClass::ContextLengthExceeded,
        ),
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
            413,
            "request_too_large",
            "Request exceeds the maximum allowed number of bytes.",
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
        assert_eq!(
            class_of(status, &anthropic_error(kind, message)),
            class,
            "{status} {kind} {message}"
        );
    }
    assert_eq!(class_of(502, &json!("bad gateway")), ErrorClass::Server);
    assert_eq!(class_of(503, &json!({})), ErrorClass::Overloaded);
    assert_eq!(class_of(401, &json!({})), ErrorClass::Auth);
}

// ---------------------------------------------------------------------------------------------
// Request mapping

fn tool_message(call_id: &str, content: ContentPart) -> Message {
    let mut m = message(Role::Tool, vec![content]);
    m.tool_call_id = Some(call_id.to_owned());
    m.tool_name = Some("t".to_owned());
    m
}

fn request(messages: Vec<Message>, tools: Vec<ToolSpec>, tool_choice: ToolChoice) -> ModelRequest {
    ModelRequest {
        model: "claude-sonnet-4-20250514".to_owned(),
        messages: messages.into(),
        tools,
        tool_choice,
        max_output_tokens: Some(1024),
        ..ModelRequest::default()
    }
}

fn weather_tool() -> ToolSpec {
    ToolSpec {
        name: "get_weather".to_owned(),
        description: "Current weather".to_owned(),
        parameters: json!({"type": "object", "properties": {"location": {"type": "string"}}}),
    }
}

#[test]
fn request_without_tools_has_no_tool_keys_and_system_on_top() {
    let body = request_body(
        &request(
            vec![
                message(Role::System, vec![text_part("Be brief.")]),
                message(Role::User, vec![text_part("Hi")]),
            ],
            Vec::new(),
            ToolChoice::Mode(ToolChoiceMode::Required),
        ),
        1024,
        None,
    );
    assert_eq!(
        body,
        json!({
            "model": "claude-sonnet-4-20250514",
            "max_tokens": 1024,
            "stream": true,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        })
    );
}

#[test]
fn tool_choices_map() {
    for (choice, expected) in [
        (
            ToolChoice::Mode(ToolChoiceMode::Auto),
            json!({"type": "auto"}),
        ),
        (
            ToolChoice::Mode(ToolChoiceMode::None),
            json!({"type": "none"}),
        ),
        (
            ToolChoice::Mode(ToolChoiceMode::Required),
            json!({"type": "any"}),
        ),
        (
            ToolChoice::Tool {
                name: "get_weather".to_owned(),
            },
            json!({"type": "tool", "name": "get_weather"}),
        ),
    ] {
        let body = request_body(
            &request(
                vec![message(Role::User, vec![text_part("Hi")])],
                vec![weather_tool()],
                choice,
            ),
            1024,
            None,
        );
        assert_eq!(body.get("tool_choice"), Some(&expected));
        assert_eq!(
            body.pointer("/tools/0"),
            Some(&json!({
                "name": "get_weather",
                "description": "Current weather",
                "input_schema": {"type": "object", "properties": {"location": {"type": "string"}}},
            }))
        );
    }
}

#[test]
fn parallel_tool_results_go_back_in_one_user_message_in_call_order() {
    let mut assistant = message(Role::Assistant, vec![text_part("Let me look.")]);
    assistant.tool_calls = vec![
        ToolCall {
            invalid_arguments: None,
            id: "toolu_a".to_owned(),
            name: "get_weather".to_owned(),
            arguments: json!({"location": "Paris"}),
        },
        ToolCall {
            invalid_arguments: None,
            id: "toolu_b".to_owned(),
            name: "get_time".to_owned(),
            arguments: json!({}),
        },
    ];
    let body = request_body(
        &request(
            vec![
                message(Role::User, vec![text_part("Weather and time?")]),
                assistant,
                tool_message(
                    "toolu_a",
                    ContentPart::Json {
                        value: json!({"temp_c": 21}),
                    },
                ),
                tool_message(
                    "toolu_b",
                    text_part("error: no tool named `get_time` is available"),
                ),
                message(Role::User, vec![text_part("Thanks")]),
            ],
            vec![weather_tool()],
            ToolChoice::default(),
        ),
        1024,
        None,
    );
    assert_eq!(
        body.get("messages"),
        Some(&json!([
            {"role": "user", "content": [{"type": "text", "text": "Weather and time?"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"location": "Paris"}},
                {"type": "tool_use", "id": "toolu_b", "name": "get_time", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_a", "content": "{\"temp_c\":21}"},
                {"type": "tool_result", "tool_use_id": "toolu_b", "content": "error: no tool named `get_time` is available", "is_error": true},
                {"type": "text", "text": "Thanks"},
            ]},
        ]))
    );
}

#[test]
fn empty_assistant_text_and_images_map() {
    let mut assistant = message(Role::Assistant, vec![text_part("")]);
    assistant.tool_calls = vec![ToolCall {
        invalid_arguments: None,
        id: "toolu_a".to_owned(),
        name: "get_time".to_owned(),
        arguments: json!({}),
    }];
    let user = message(
        Role::User,
        vec![
            ContentPart::Image {
                url: "data:image/png;base64,iVBORw0KGgo=".to_owned(),
                media_type: "image/png".to_owned(),
            },
            ContentPart::Image {
                url: "https://example.com/cat.jpg".to_owned(),
                media_type: "image/jpeg".to_owned(),
            },
        ],
    );
    let body = request_body(
        &request(vec![user, assistant], Vec::new(), ToolChoice::default()),
        1024,
        None,
    );
    assert_eq!(
        body.get("messages"),
        Some(&json!([
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
            ]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_a", "name": "get_time", "input": {}},
            ]},
        ]))
    );
}

// ---------------------------------------------------------------------------------------------
// Extended thinking, interleaved blocks, ids, request shape

const THINKING: &str =
    include_str!("../../../tests/fixtures/anthropic/thinking_interleaved_tool_use.sse");

const SIGNATURE: &str = "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds";
const REDACTED: &str = "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIwxtE3rAFBa8cr3qpP";

#[test]
fn thinking_redacted_thinking_and_interleaved_tool_use_blocks() {
    let weather = "toolu_01A09q90qw90lq917835lq9";
    let time = "toolu_01B18r81rx81mr826924mr8";
    let expected = vec![
        reasoning("The user wants weather and time. "),
        reasoning("Two independent calls."),
        Ok(ModelEvent::ReasoningCompleted(Reasoning {
            text: "The user wants weather and time. Two independent calls.".to_owned(),
            signature: Some(SIGNATURE.to_owned()),
            redacted_data: None,
        })),
        Ok(ModelEvent::ReasoningCompleted(Reasoning {
            text: String::new(),
            signature: None,
            redacted_data: Some(REDACTED.to_owned()),
        })),
        text("Checking both."),
        started(weather, "get_weather"),
        started(time, "get_time"),
        delta(weather, "{\"location\": "),
        delta(time, "{\"timezone\": "),
        delta(weather, "\"Paris\"}"),
        completed(weather, "get_weather", json!({"location": "Paris"})),
        delta(time, "\"Europe/Paris\"}"),
        completed(time, "get_time", json!({"timezone": "Europe/Paris"})),
        usage(480, 164, 0, 0),
        finished(FinishReason::ToolCalls),
    ];
    assert_eq!(parse(THINKING), expected);
    assert_eq!(parse_reads(bytewise(THINKING.as_bytes())), expected);
    for at in (0..THINKING.len()).step_by(11) {
        assert_eq!(
            parse_reads(split(THINKING.as_bytes(), at)),
            expected,
            "{at}"
        );
    }
}

#[test]
fn duplicate_and_missing_tool_use_ids_are_made_unique() {
    let block = |index: u64, id: &str| {
        format!(
            "event: content_block_start\ndata: {{\"type\":\"content_block_start\",\"index\":{index},\"content_block\":{{\"type\":\"tool_use\",\"id\":\"{id}\",\"name\":\"f\",\"input\":{{}}}}}}\n\n\
             event: content_block_stop\ndata: {{\"type\":\"content_block_stop\",\"index\":{index}}}\n\n"
        )
    };
    let start = TEXT.find("event: content_block_start").unwrap_or(0);
    let end = TEXT.find("event: message_delta").unwrap_or(0);
    let body = format!(
        "{}{}{}{}{}",
        TEXT.get(..start).unwrap_or_default(),
        block(0, "toolu_same"),
        block(1, "toolu_same"),
        block(2, ""),
        TEXT.get(end..)
            .unwrap_or_default()
            .replace("end_turn", "tool_use"),
    );
    let ids: Vec<String> = parse(&body)
        .iter()
        .filter_map(|e| match e {
            Ok(ModelEvent::ToolCallCompleted(call)) => Some(call.id.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(ids, ["toolu_same", "toolu_same_2", "call_0"]);
}

fn assistant_with(text: &str, reasoning: Vec<Reasoning>, calls: bool) -> Message {
    let mut m = message(Role::Assistant, vec![text_part(text)]);
    m.reasoning = reasoning;
    if calls {
        m.tool_calls = vec![ToolCall {
            id: "toolu_1".to_owned(),
            name: "get_weather".to_owned(),
            arguments: json!({}),
            invalid_arguments: Some("{\"location\": ".to_owned()),
        }];
    }
    m
}

#[test]
fn reasoning_is_replayed_first_and_empty_turns_are_left_out() {
    let thinking = Reasoning {
        text: "think".to_owned(),
        signature: Some(SIGNATURE.to_owned()),
        redacted_data: None,
    };
    let redacted = Reasoning {
        text: String::new(),
        signature: None,
        redacted_data: Some(REDACTED.to_owned()),
    };
    let unsigned = Reasoning {
        text: "no signature".to_owned(),
        signature: None,
        redacted_data: None,
    };
    let messages = vec![
        message(Role::User, vec![text_part("Weather?")]),
        // Empty and blank assistant turns, and one of thinking alone: left out.
        assistant_with("", Vec::new(), false),
        assistant_with("  \n", vec![thinking.clone()], false),
        assistant_with("", vec![thinking, redacted, unsigned], true),
        tool_message("toolu_1", text_part("error: invalid arguments")),
    ];
    let body = request_body(
        &request(messages, vec![weather_tool()], ToolChoice::default()),
        2048,
        Some(1500),
    );
    assert_eq!(
        body.get("thinking"),
        Some(&json!({"type": "enabled", "budget_tokens": 1500}))
    );
    assert_eq!(
        body.get("messages"),
        Some(&json!([
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "think", "signature": SIGNATURE},
                {"type": "redacted_thinking", "data": REDACTED},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "error: invalid arguments", "is_error": true},
            ]},
        ]))
    );
}

#[test]
fn thinking_budget_is_bounded_by_max_tokens_and_off_for_forced_tools() {
    let hi = vec![message(Role::User, vec![text_part("Hi")])];
    let budget = |max_tokens, choice| {
        request_body(
            &request(hi.clone(), vec![weather_tool()], choice),
            max_tokens,
            Some(4000),
        )
        .get("thinking")
        .cloned()
    };
    assert_eq!(
        budget(8000, ToolChoice::default()),
        Some(json!({"type": "enabled", "budget_tokens": 4000}))
    );
    assert_eq!(
        budget(3000, ToolChoice::default()),
        Some(json!({"type": "enabled", "budget_tokens": 2999}))
    );
    assert_eq!(budget(1000, ToolChoice::default()), None);
    assert_eq!(
        budget(8000, ToolChoice::Mode(ToolChoiceMode::Required)),
        None
    );
    assert_eq!(
        request_body(&request(hi, Vec::new(), ToolChoice::default()), 8000, None).get("thinking"),
        None
    );
}

/// A tool-use loop begun without thinking (a forced first call) goes on without it: one
/// thinking configuration per assistant turn. The next user message starts a new turn.
#[test]
fn thinking_stays_off_for_a_tool_loop_begun_without_it() {
    let mut messages = vec![
        message(Role::User, vec![text_part("Weather?")]),
        assistant_with("", Vec::new(), true),
        tool_message("toolu_1", text_part("sunny")),
    ];
    let thinking = |messages: &Vec<Message>| {
        request_body(
            &request(
                messages.clone(),
                vec![weather_tool()],
                ToolChoice::default(),
            ),
            8000,
            Some(2048),
        )
        .get("thinking")
        .cloned()
    };
    assert_eq!(thinking(&messages), None);
    messages.push(assistant_with("Sunny.", Vec::new(), false));
    messages.push(message(Role::User, vec![text_part("And tomorrow?")]));
    assert_eq!(
        thinking(&messages),
        Some(json!({"type": "enabled", "budget_tokens": 2048}))
    );
    let signed = Reasoning {
        text: "think".to_owned(),
        signature: Some(SIGNATURE.to_owned()),
        redacted_data: None,
    };
    messages.push(assistant_with("", vec![signed], true));
    messages.push(tool_message("toolu_1", text_part("rain")));
    assert_eq!(
        thinking(&messages),
        Some(json!({"type": "enabled", "budget_tokens": 2048}))
    );
}

#[test]
fn prompt_too_long_is_context_length_exceeded() {
    let body = anthropic_error(
        "invalid_request_error",
        "prompt is too long: 208310 tokens > 200000 maximum",
    );
    assert_eq!(class_of(400, &body), ErrorClass::ContextLengthExceeded);
    // The recorded bodies (tests/fixtures/context_length/).
    for file in ["anthropic.json", "anthropic_max_tokens.json"] {
        let path = format!(
            "{}/tests/fixtures/context_length/{file}",
            env!("CARGO_MANIFEST_DIR")
        );
        let body: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_default())
            .unwrap_or(Value::Null);
        assert_eq!(
            class_of(400, &body),
            ErrorClass::ContextLengthExceeded,
            "{file}"
        );
    }
}

#[test]
fn instructions_come_first_in_system_and_options_never_replace_owned_keys() {
    let mut request = request(
        vec![
            message(Role::System, vec![text_part("Context summary.")]),
            message(Role::User, vec![text_part("Hi")]),
        ],
        vec![weather_tool()],
        ToolChoice::Mode(ToolChoiceMode::Required),
    );
    request.instructions = Some("Be brief.".to_owned());
    request.temperature = Some(0.5);
    request.top_p = Some(0.8);
    request.stop = vec!["END".to_owned()];
    request.parallel_tool_calls = Some(false);
    for (key, value) in [
        ("system", json!("other")),
        ("messages", json!([])),
        ("max_tokens", json!(1)),
        ("top_k", json!(3)),
    ] {
        request.provider_options.insert(key.to_owned(), value);
    }
    let body = request_body(&request, 1024, None);
    assert_eq!(body["system"], "Be brief.\n\nContext summary.");
    assert_eq!(body["messages"][0]["content"][0]["text"], "Hi");
    assert_eq!(
        body["tool_choice"],
        json!({"type": "any", "disable_parallel_tool_use": true})
    );
    assert_eq!(
        (
            &body["temperature"],
            &body["top_p"],
            &body["stop_sequences"],
            &body["max_tokens"],
            &body["top_k"],
        ),
        (
            &json!(0.5),
            &json!(0.8),
            &json!(["END"]),
            &json!(1024),
            &json!(3)
        )
    );
    assert!(body.get("seed").is_none());
    // `none` takes no parallel option.
    request.tool_choice = ToolChoice::Mode(ToolChoiceMode::None);
    assert_eq!(
        request_body(&request, 1024, None)["tool_choice"],
        json!({"type": "none"})
    );
}
