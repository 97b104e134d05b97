//! Anthropic Messages streams for the fake provider of `fake_openai` (which also serves
//! `POST /v1/messages` from the same reply queue): recorded fixtures of
//! `tests/fixtures/anthropic/` and builders of events in the documented wire format.

use std::path::Path;

use serde_json::{Value, json};

pub use super::fake_openai::{FakeOpenAi as FakeProvider, RecordedRequest, Reply};

/// Model name the fake's streams report.
pub const MODEL: &str = "claude-sonnet-4-20250514";

/// A recorded fixture of `tests/fixtures/anthropic/`, e.g. `fixture("text.sse")`.
///
/// # Panics
/// When the file is missing (tests only).
pub fn fixture(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/anthropic")
        .join(name);
    std::fs::read(&path).expect("fixture exists")
}

/// `event: <type>` and `data: <json>`, ending the event with a blank line.
pub fn event(data: &Value) -> String {
    let kind = data
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("message");
    format!("event: {kind}\ndata: {data}\n\n")
}

/// `message_start` with these input tokens (cache creation/read 0).
pub fn message_start(input_tokens: u64) -> String {
    event(&json!({"type": "message_start", "message": {
        "id": "msg_fake0001", "type": "message", "role": "assistant", "model": MODEL,
        "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": input_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 1},
    }}))
}

/// A `text_delta` of block `index`.
pub fn text_delta(index: u64, text: &str) -> String {
    event(
        &json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}}),
    )
}

/// `message_delta` with this stop reason and cumulative output tokens, then `message_stop`.
pub fn message_end(stop_reason: &str, output_tokens: u64) -> String {
    let mut end = event(
        &json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": null}, "usage": {"output_tokens": output_tokens}}),
    );
    end.push_str(&event(&json!({"type": "message_stop"})));
    end
}

/// A complete text answer: `message_start` (10 input tokens), one text block with one delta
/// per piece, a `ping`, `end_turn` with one output token per delta.
pub fn text_stream(deltas: &[&str]) -> Vec<u8> {
    let mut body = message_start(10);
    body.push_str(&event(&json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})));
    body.push_str(&event(&json!({"type": "ping"})));
    for delta in deltas {
        body.push_str(&text_delta(0, delta));
    }
    body.push_str(&event(&json!({"type": "content_block_stop", "index": 0})));
    body.push_str(&message_end("end_turn", deltas.len() as u64));
    body.into_bytes()
}

/// An Anthropic error body: `{"type": "error", "error": {"type": kind, "message": message}}`.
pub fn error_body(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// A complete answer in which the model calls tools, in parallel: one `tool_use` block per
/// `(call id, tool name, arguments)` (its arguments in two `input_json_delta` pieces), then
/// `tool_use` as the stop reason.
pub fn tool_use_stream(calls: &[(&str, &str, Value)]) -> Vec<u8> {
    tool_use_stream_with_usage(calls, 30)
}

/// Like [`tool_use_stream`], with `input_tokens` in `message_start` (e.g. the fake's count of
/// the request, `fake_openai::prompt_tokens`).
pub fn tool_use_stream_with_usage(calls: &[(&str, &str, Value)], input_tokens: u64) -> Vec<u8> {
    let mut body = message_start(input_tokens);
    for (index, (id, name, arguments)) in calls.iter().enumerate() {
        let text = arguments.to_string();
        let (head, tail) = text.split_at(text.len() / 2);
        body.push_str(&event(
            &json!({"type": "content_block_start", "index": index,
            "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}}),
        ));
        for piece in [head, tail] {
            body.push_str(&event(
                &json!({"type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": piece}}),
            ));
        }
        body.push_str(&event(
            &json!({"type": "content_block_stop", "index": index}),
        ));
    }
    body.push_str(&message_end("tool_use", 12));
    body.into_bytes()
}

/// The start of a text answer (`message_start`, a text block, one delta), then nothing: for a
/// stream held open (`Reply::stall_after`) or cut (`Reply::close_after`) mid-answer.
pub fn text_start(text: &str) -> Vec<u8> {
    let mut body = message_start(10);
    body.push_str(&event(&json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})));
    body.push_str(&text_delta(0, text));
    body.into_bytes()
}

/// Like [`text_stream`], with `input_tokens` in `message_start` (e.g. the fake's count of the
/// request, `fake_openai::prompt_tokens`).
pub fn text_stream_with_usage(deltas: &[&str], input_tokens: u64) -> Vec<u8> {
    let plain = String::from_utf8(text_stream(deltas)).unwrap_or_default();
    plain
        .replacen(&message_start(10), &message_start(input_tokens), 1)
        .into_bytes()
}
