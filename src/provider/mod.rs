//! Model providers: one adapter per wire format, mapping it to a common stream of
//! [`ModelEvent`]s. Providers never import the runtime or the API.

pub mod anthropic;
mod calls;
mod http;
pub mod openai;
pub mod retry;
pub mod scripted;
mod sse;
pub mod structured;
#[cfg(test)]
mod testing;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;

use crate::config::{ProviderConfig, ProviderKind};
pub use crate::domain::ErrorClass;
use crate::domain::{
    ContentPart, FinishReason, Message, Reasoning, TokenUsage, ToolCall, ToolChoice,
};
use crate::events::CacheMetrics;
pub use http::ReadError;

/// A tool the model may call: name, description and JSON Schema of its arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    /// The tool's name.
    pub name: String,
    /// What the tool does, for the model.
    pub description: String,
    /// JSON Schema (an object schema) of the arguments.
    pub parameters: serde_json::Value,
}

/// One model call: the context and what the model may do.
#[derive(Debug, Clone, Default)]
pub struct ModelRequest {
    /// Model name as the provider knows it.
    pub model: String,
    /// The context, oldest first (system, user, assistant with tool calls, tool results);
    /// shared, so that a request kept for its retries is not a copy of a long history.
    pub messages: std::sync::Arc<[Message]>,
    /// Tools offered; empty means no tools are sent (and no `tool_choice`).
    pub tools: Vec<ToolSpec>,
    /// How the model may use the tools.
    pub tool_choice: ToolChoice,
    /// Upper bound on generated tokens.
    pub max_output_tokens: Option<u32>,
    /// The system prompt, sent in the wire format's own place (OpenAI-compatible: a first
    /// `system`/`developer` message; Anthropic: `system`, before any system messages of the
    /// context). `None` or empty: none.
    pub instructions: Option<String>,
    /// Sampling temperature (`temperature`); `None`: not sent.
    pub temperature: Option<f64>,
    /// Nucleus sampling (`top_p`); `None`: not sent.
    pub top_p: Option<f64>,
    /// Stop sequences (OpenAI `stop`, Anthropic `stop_sequences`); empty: not sent.
    pub stop: Vec<String>,
    /// Sampling seed (OpenAI-compatible `seed`; Anthropic has none).
    pub seed: Option<i64>,
    /// Whether the model may call several tools in one turn; `None`: not sent. Only sent with
    /// tools (OpenAI `parallel_tool_calls`, Anthropic `tool_choice.disable_parallel_tool_use`).
    pub parallel_tool_calls: Option<bool>,
    /// Extra top-level fields of the request body, merged in last, except the keys the
    /// adapter owns ([`owned_keys`]), which it never lets them replace.
    pub provider_options: serde_json::Map<String, serde_json::Value>,
    /// The JSON Schema the answer must match, sent in the wire format's own form
    /// ([`structured`]); `None`: free text (also for a provider with
    /// `structured_output = "prompt"`, whose runs carry the schema in `instructions`).
    pub output: Option<structured::StructuredOutput>,
}

/// The request-body keys an adapter of `kind` writes itself (or models as a field of
/// [`ModelRequest`]), which `provider_options` may not set: OpenAI-compatible `model`,
/// `messages`, `stream`, `stream_options`, `tools`, `tool_choice`, `n` (behest reads one
/// choice), `temperature`, `top_p`, `max_tokens`, `max_completion_tokens`, `stop`, `seed`,
/// `parallel_tool_calls`; Anthropic `model`, `messages`, `system`, `stream`, `tools`,
/// `tool_choice`, `max_tokens`, `thinking` (per-turn, see the adapter), `temperature`,
/// `top_p`, `stop_sequences`; the built-in model `model`, `messages`, `tools`, `stream`.
#[must_use]
pub fn owned_keys(kind: ProviderKind) -> &'static [&'static str] {
    match kind {
        ProviderKind::Openai => openai::OWNED_KEYS,
        ProviderKind::Anthropic => anthropic::OWNED_KEYS,
        ProviderKind::Scripted => &["model", "messages", "tools", "stream"],
    }
}

/// Inserts each of `options` into `body` except the `owned` keys (which the adapter wrote).
fn merge_options(
    body: &mut serde_json::Map<String, serde_json::Value>,
    options: &serde_json::Map<String, serde_json::Value>,
    owned: &[&str],
) {
    for (key, value) in options {
        if !owned.contains(&key.as_str()) {
            body.insert(key.clone(), value.clone());
        }
    }
}

/// What a model call streams, in order. Adapters guarantee: `Retrying` only before any other
/// event; text, reasoning and tool-call events as they arrive; `ToolCallCompleted` for every
/// call the model started (with its arguments parsed, or [`ToolCall::invalid_arguments`] set
/// when they are not valid JSON); at most one `Usage`; and exactly one `Finished`, last.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelEvent {
    /// The attempt failed before any output and the call will be made again after `delay`
    /// (emitted by [`retry::Retrying`]).
    Retrying {
        /// The attempt that failed, from 1.
        attempt: u32,
        /// Its failure class.
        error_class: ErrorClass,
        /// The pause before the next attempt.
        delay: Duration,
        /// Why the attempt failed (no secrets).
        error: String,
    },
    /// A piece of assistant text (never a split UTF-8 character).
    TextDelta(String),
    /// A piece of the model's reasoning ("thinking": OpenAI-compatible `reasoning_content` /
    /// `reasoning`, Anthropic `thinking_delta`); never answer text.
    ReasoningDelta(String),
    /// A complete reasoning block, as the provider must receive it again in the next request
    /// (after its `ReasoningDelta`s; Anthropic: at the block's `content_block_stop`).
    ReasoningCompleted(Reasoning),
    /// The model began a tool call.
    ToolCallStarted {
        /// The provider's call id.
        call_id: String,
        /// The tool's name.
        tool_name: String,
    },
    /// A piece of a tool call's arguments (JSON text).
    ToolCallDelta {
        /// The provider's call id.
        call_id: String,
        /// The piece.
        delta: String,
    },
    /// A tool call is complete, its arguments parsed.
    ToolCallCompleted(ToolCall),
    /// Token usage of the call, with prompt-cache figures when the provider reports them.
    Usage {
        /// Input/output/total tokens.
        usage: TokenUsage,
        /// Cache tokens; `None` when the provider reported none.
        cache: Option<CacheMetrics>,
    },
    /// The call ended; the last event.
    Finished(FinishReason),
}

/// The stream of one model call.
pub type ModelStream = BoxStream<'static, Result<ModelEvent, ProviderError>>;

/// A model provider speaking one wire format.
#[async_trait]
pub trait Provider: Send + Sync + fmt::Debug {
    /// Starts a streaming model call. Errors before the first event come back here or as the
    /// stream's first item; later ones end the stream.
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ProviderError>;
}

/// Builds the adapter for a configured provider, wrapped in [`retry::Retrying`] when its
/// `retry.max_attempts` is above 1.
///
/// # Errors
/// A [`ProviderError`] of class `invalid_request` when the HTTP client cannot be built (or a
/// scripted provider's script cannot be read).
pub fn build(id: &str, config: &ProviderConfig) -> Result<Arc<dyn Provider>, ProviderError> {
    let adapter: Arc<dyn Provider> = match config.kind {
        ProviderKind::Openai => Arc::new(openai::OpenAi::new(id, config)?),
        ProviderKind::Anthropic => Arc::new(anthropic::Anthropic::new(id, config)?),
        ProviderKind::Scripted => Arc::new(scripted::Scripted::new(id, config)?),
    };
    if config.retry.max_attempts > 1 {
        Ok(Arc::new(retry::Retrying::new(id, adapter, config.retry)))
    } else {
        Ok(adapter)
    }
}

/// Text and JSON parts as one string (JSON serialized), in order; images left out.
fn text_of(parts: &[ContentPart]) -> String {
    let mut text = String::new();
    for part in parts {
        match part {
            ContentPart::Text { text: t } => text.push_str(t),
            ContentPart::Json { value } => text.push_str(&value.to_string()),
            ContentPart::Image { .. } => {}
        }
    }
    text
}

/// A failed provider call. The message never contains secrets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{provider}: {class}: {message}", class = class.as_str())]
pub struct ProviderError {
    /// The provider id.
    pub provider: String,
    /// The failure class.
    pub class: ErrorClass,
    /// HTTP status, when the provider answered with one.
    pub status: Option<u16>,
    /// Readable detail (the provider's own error message where it gave one).
    pub message: String,
    /// The provider's `retry-after`, when given.
    pub retry_after: Option<Duration>,
}

impl ProviderError {
    /// An error without status or retry hint.
    #[must_use]
    pub fn new(provider: &str, class: ErrorClass, message: impl Into<String>) -> Self {
        Self {
            provider: provider.to_owned(),
            class,
            status: None,
            message: message.into(),
            retry_after: None,
        }
    }
}
