//! Helpers shared by the adapters' unit tests: feeding a body to a `parse_stream` in reads of
//! any size, and the expected [`ModelEvent`]s and request messages written briefly.

use std::convert::Infallible;

use chrono::Utc;
use futures::StreamExt;
use serde_json::Value;

use super::{ModelEvent, ModelStream, ProviderError};
use crate::domain::{
    ContentPart, FinishReason, Message, MessageId, Role, RunId, SessionId, ToolCall,
};

/// One item of a model stream.
pub(super) type Item = Result<ModelEvent, ProviderError>;

/// A body as a stream of reads that never fail.
pub(super) type Reads = futures::stream::Iter<std::vec::IntoIter<Result<Vec<u8>, Infallible>>>;

/// Runs an adapter's `parse_stream` (provider id `test`) over the given reads.
pub(super) fn parse_reads_with(
    parse_stream: fn(&str, Reads) -> ModelStream,
    reads: Vec<Vec<u8>>,
) -> Vec<Item> {
    let reads: Vec<Result<Vec<u8>, Infallible>> = reads.into_iter().map(Ok).collect();
    let bytes = futures::stream::iter(reads);
    futures::executor::block_on(parse_stream("test", bytes).collect())
}

/// The body in two reads, split at `at` bytes (possibly inside a UTF-8 character).
pub(super) fn split(body: &[u8], at: usize) -> Vec<Vec<u8>> {
    let (a, b) = body.split_at(at);
    vec![a.to_vec(), b.to_vec()]
}

/// The body one byte per read.
pub(super) fn bytewise(body: &[u8]) -> Vec<Vec<u8>> {
    body.iter().map(|b| vec![*b]).collect()
}

pub(super) fn text(s: &str) -> Item {
    Ok(ModelEvent::TextDelta(s.to_owned()))
}

pub(super) fn started(id: &str, name: &str) -> Item {
    Ok(ModelEvent::ToolCallStarted {
        call_id: id.to_owned(),
        tool_name: name.to_owned(),
    })
}

pub(super) fn delta(id: &str, piece: &str) -> Item {
    Ok(ModelEvent::ToolCallDelta {
        call_id: id.to_owned(),
        delta: piece.to_owned(),
    })
}

pub(super) fn completed(id: &str, name: &str, arguments: Value) -> Item {
    Ok(ModelEvent::ToolCallCompleted(ToolCall {
        invalid_arguments: None,
        id: id.to_owned(),
        name: name.to_owned(),
        arguments,
    }))
}

/// A completed call whose arguments were not valid JSON: `{}` and the raw text.
pub(super) fn invalid(id: &str, name: &str, raw: &str) -> Item {
    Ok(ModelEvent::ToolCallCompleted(ToolCall {
        invalid_arguments: Some(raw.to_owned()),
        id: id.to_owned(),
        name: name.to_owned(),
        arguments: serde_json::json!({}),
    }))
}

pub(super) fn reasoning(s: &str) -> Item {
    Ok(ModelEvent::ReasoningDelta(s.to_owned()))
}

pub(super) fn finished(reason: FinishReason) -> Item {
    Ok(ModelEvent::Finished(reason))
}

/// Concatenated text deltas.
pub(super) fn joined_text(events: &[Item]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            Ok(ModelEvent::TextDelta(t)) => Some(t.as_str()),
            _ => None,
        })
        .collect()
}

/// A message of a fresh run, without tool calls.
pub(super) fn message(role: Role, content: Vec<ContentPart>) -> Message {
    Message {
        reasoning: Vec::new(),
        id: MessageId::new(),
        session_id: SessionId::new(),
        run_id: RunId::new(),
        role,
        content,
        tool_calls: Vec::new(),
        tool_call_id: None,
        tool_name: None,
        created_at: Utc::now(),
        status: Default::default(),
    }
}

pub(super) fn text_part(text: &str) -> ContentPart {
    ContentPart::Text {
        text: text.to_owned(),
    }
}
