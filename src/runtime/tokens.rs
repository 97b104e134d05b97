//! Token counting with a real tokenizer (`tiktoken-rs`, `o200k_base`, BPE data embedded in the
//! crate: works offline), for usage estimates when a provider reports none. Counts are per
//! message and cached by message id, so that a caller counting the same history again (the
//! next model call, compaction) pays only for new messages.

use std::collections::HashMap;

use crate::domain::{Message, MessageId, TokenUsage, ToolCall};
use crate::provider::ToolSpec;

/// Tokens a chat format spends around each message (role, separators), as in OpenAI's
/// cookbook count for its chat models.
const PER_MESSAGE_OVERHEAD: u64 = 4;
/// Tokens that prime the reply (`<|start|>assistant<|message|>`).
const REPLY_PRIMING: u64 = 3;

/// The tokens of a text (`o200k_base`, special tokens counted as ordinary text).
#[must_use]
pub fn count_text(text: &str) -> u64 {
    if text.is_empty() {
        return 0;
    }
    let tokens = tiktoken_rs::o200k_base_singleton().count_ordinary(text);
    u64::try_from(tokens).unwrap_or(u64::MAX)
}

/// Counts messages and requests, caching each message's count by id.
#[derive(Debug, Default)]
pub struct TokenCounter {
    cache: HashMap<MessageId, u64>,
}

impl TokenCounter {
    /// An empty cache.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The tokens of one message: its content (JSON parts serialized), reasoning, tool calls
    /// (name and arguments JSON) and the per-message overhead. Cached by message id.
    pub fn message(&mut self, message: &Message) -> u64 {
        *self
            .cache
            .entry(message.id)
            .or_insert_with(|| count_message(message))
    }

    /// The prompt tokens of a request: every message, the tools' JSON (name, description,
    /// parameters schema) and the reply priming.
    pub fn request(&mut self, messages: &[Message], tools: &[ToolSpec]) -> u64 {
        let messages: u64 = messages.iter().map(|m| self.message(m)).sum();
        let tools: u64 = tools
            .iter()
            .map(|tool| {
                let json = serde_json::json!({
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.parameters,
                });
                count_text(&json.to_string())
            })
            .sum();
        messages + tools + REPLY_PRIMING
    }

    /// An estimated usage (`estimated: true`) for a call with this prompt and this reply.
    pub fn estimate(
        &mut self,
        messages: &[Message],
        tools: &[ToolSpec],
        reply: &Reply<'_>,
    ) -> TokenUsage {
        let input_tokens = self.request(messages, tools);
        let reasoning_tokens = count_text(reply.reasoning);
        let output_tokens = count_text(reply.text)
            + reasoning_tokens
            + reply.tool_calls.iter().map(count_call).sum::<u64>();
        TokenUsage {
            input_tokens,
            output_tokens,
            total_tokens: input_tokens + output_tokens,
            reasoning_tokens,
            estimated: true,
        }
    }
}

/// What a model call produced, for an estimate.
#[derive(Debug, Clone, Copy)]
pub struct Reply<'a> {
    /// The answer text.
    pub text: &'a str,
    /// The reasoning text.
    pub reasoning: &'a str,
    /// The tool calls.
    pub tool_calls: &'a [ToolCall],
}

fn count_call(call: &ToolCall) -> u64 {
    let arguments = match &call.invalid_arguments {
        Some(raw) => raw.clone(),
        None => call.arguments.to_string(),
    };
    count_text(&call.name) + count_text(&arguments)
}

fn count_message(message: &Message) -> u64 {
    let content: u64 = message
        .content
        .iter()
        .map(|part| match part {
            crate::domain::ContentPart::Text { text } => count_text(text),
            crate::domain::ContentPart::Json { value } => count_text(&value.to_string()),
            crate::domain::ContentPart::Image { url, .. } => count_text(url),
        })
        .sum();
    let reasoning: u64 = message.reasoning.iter().map(|r| count_text(&r.text)).sum();
    let calls: u64 = message.tool_calls.iter().map(count_call).sum();
    PER_MESSAGE_OVERHEAD + content + reasoning + calls
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_real_tokens_not_bytes() {
        assert_eq!(count_text(""), 0);
        // "hello world" is two o200k tokens; a long repeated word is far fewer tokens than bytes.
        assert_eq!(count_text("hello world"), 2);
        let long = "tokenizer ".repeat(100);
        let tokens = count_text(&long);
        assert!((100..300).contains(&tokens), "{tokens}");
    }

    #[test]
    fn estimates_are_marked_and_cached() {
        let mut counter = TokenCounter::new();
        let message = Message {
            id: MessageId::new(),
            session_id: crate::domain::SessionId::new(),
            run_id: crate::domain::RunId::new(),
            role: crate::domain::Role::User,
            content: vec![crate::domain::ContentPart::Text {
                text: "What is the weather in Paris?".to_owned(),
            }],
            reasoning: Vec::new(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            tool_name: None,
            created_at: chrono::Utc::now(),
            status: Default::default(),
        };
        let reply = Reply {
            text: "Sunny.",
            reasoning: "",
            tool_calls: &[],
        };
        let usage = counter.estimate(std::slice::from_ref(&message), &[], &reply);
        assert!(usage.estimated);
        assert!(usage.input_tokens > PER_MESSAGE_OVERHEAD + REPLY_PRIMING);
        assert_eq!(usage.output_tokens, count_text("Sunny."));
        assert_eq!(usage.total_tokens, usage.input_tokens + usage.output_tokens);
        let cached = counter.cache.get(&message.id).copied();
        assert_eq!(cached, Some(count_message(&message)));
        assert_eq!(counter.message(&message), count_message(&message));
    }
}
