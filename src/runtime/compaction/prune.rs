//! Pruning (`prune` on): before a summary is considered, the outputs of old tool calls — those
//! outside the newest turns a compaction would keep — are replaced in the request by a short
//! marker. The stored messages are untouched; the call and its (pruned) result stay paired.

use std::collections::HashMap;

use super::select::Split;
use crate::domain::{Message, MessageId, Role};
use crate::runtime::tokens::{PER_MESSAGE_OVERHEAD, TokenCounter};

/// Tool outputs of at most this many tokens are left alone: a marker would save little.
const MIN_PRUNED_TOKENS: u64 = 64;

/// What replaces a pruned tool output in requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Pruned {
    /// The marker text.
    pub marker: String,
    /// The tokens of the marker message.
    pub tokens: u64,
}

/// The marker of an output of `tool` that counted `tokens`.
pub(super) fn marker(tool: &str, tokens: u64) -> String {
    format!(
        "[output of `{tool}` pruned by behest to keep the context within the model's window \
         ({tokens} tokens); it is no longer shown]"
    )
}

/// Marks the tool outputs of the head (the messages before `split.tail_start`) larger than
/// `MIN_PRUNED_TOKENS` as pruned; `sizes[i]` is message `i`'s tokens. Returns how many were
/// newly pruned.
pub(super) fn prune(
    messages: &[Message],
    sizes: &[u64],
    split: &Split,
    pruned: &mut HashMap<MessageId, Pruned>,
    counter: &TokenCounter,
) -> usize {
    let mut count = 0;
    for (message, &size) in messages[..split.tail_start].iter().zip(sizes) {
        if message.role != Role::Tool
            || size <= MIN_PRUNED_TOKENS
            || pruned.contains_key(&message.id)
        {
            continue;
        }
        let marker = marker(message.tool_name.as_deref().unwrap_or("a tool"), size);
        let tokens = counter.text(&marker) + PER_MESSAGE_OVERHEAD;
        pruned.insert(message.id, Pruned { marker, tokens });
        count += 1;
    }
    count
}
