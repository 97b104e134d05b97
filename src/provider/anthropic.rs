//! Anthropic Messages API, streaming.
//!
//! Wire format: `POST {base_url}/messages` (base URL e.g. `https://api.anthropic.com/v1`) with
//! `stream: true` and the headers `x-api-key`, `anthropic-version: 2023-06-01` and
//! `content-type: application/json`, answered by Server-Sent Events: `message_start`, then per
//! content block `content_block_start` / `content_block_delta` (`text_delta`,
//! `input_json_delta`) / `content_block_stop`, then `message_delta` (stop reason, cumulative
//! usage) and `message_stop`; `ping` and `error` may come at any point
//! (<https://docs.anthropic.com/en/api/messages>, <https://docs.anthropic.com/en/api/messages-streaming>,
//! <https://docs.anthropic.com/en/api/errors>,
//! <https://docs.anthropic.com/en/docs/build-with-claude/tool-use>).
//!
//! Decisions where the API leaves a choice:
//! - `TokenUsage.input_tokens` is `input_tokens + cache_creation_input_tokens +
//!   cache_read_input_tokens`: the whole prompt, comparable to OpenAI's `prompt_tokens`; the
//!   cache figures themselves go to [`CacheMetrics`]. Thinking tokens are part of
//!   `output_tokens` (the API does not report them apart).
//! - Stop reasons: `end_turn`/`stop_sequence` → `stop`, `tool_use` → `tool_calls`,
//!   `max_tokens`/`model_context_window_exceeded` → `length`, `refusal` → `content_filter`;
//!   `pause_turn` (a server-tool turn the client should continue) and anything else →
//!   `unknown`, since behest uses no server tools and cannot continue such a turn.
//! - Content blocks are keyed by their `index`, so interleaved blocks stay apart. A tool call
//!   completes at its block's `content_block_stop` (or when the stop reason comes, for a block
//!   never stopped), also when cut by `max_tokens`: arguments that are not valid JSON go to
//!   `invalid_arguments`. Ids are unique in the session (a duplicate gets a suffix).
//! - Extended thinking: `thinking` blocks stream `ReasoningDelta`s (`thinking_delta`) and end
//!   with one `ReasoningCompleted` carrying the `signature` (`signature_delta`);
//!   `redacted_thinking` blocks end with one `ReasoningCompleted` carrying their `data`. An
//!   assistant message's reasoning is replayed first in its turn (thinking blocks without a
//!   signature cannot be verified by the API and are left out).
//! - A body that ends without `message_stop` is a `transport` error.

use async_trait::async_trait;
use futures::Stream;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::calls::{CallIds, parse_arguments};
use super::http::{Endpoint, ReadError, excerpt};
use super::sse::{self, Out, Step, StreamParser};
use super::text_of;
use super::{ErrorClass, ModelEvent, ModelRequest, ModelStream, Provider, ProviderError};
use crate::config::ProviderConfig;
use crate::domain::{
    ContentPart, FinishReason, Message, Reasoning, Role, TokenUsage, ToolCall, ToolChoice,
    ToolChoiceMode,
};
use crate::events::CacheMetrics;

/// The `anthropic-version` header sent with every request (API version 2023-06-01).
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// `max_tokens` when neither the request nor the model's configuration gives one (the API
/// requires the field), in tokens.
pub const DEFAULT_MAX_TOKENS: u32 = 4096;

/// Adapter for `kind = "anthropic"`: one streaming Messages call per [`Provider::stream`],
/// without retries.
#[derive(Debug)]
pub struct Anthropic {
    endpoint: Endpoint,
    /// Configured `max_output_tokens` per model, for requests without their own limit.
    max_tokens: Vec<(String, u32)>,
    /// `thinking_budget_tokens`: extended thinking on with this budget.
    thinking_budget: Option<u32>,
}

impl Anthropic {
    /// Builds the adapter: an HTTP client with the configured connect timeout (ms), the base
    /// URL (trailing `/` trimmed) and the API key, sent as `x-api-key` when set.
    ///
    /// # Errors
    /// A [`ProviderError`] of class `invalid_request` when the HTTP client cannot be built.
    pub fn new(id: &str, config: &ProviderConfig) -> Result<Self, ProviderError> {
        Ok(Self {
            endpoint: Endpoint::new(id, config)?,
            max_tokens: config
                .models
                .iter()
                .map(|(name, model)| (name.clone(), model.max_output_tokens))
                .collect(),
            thinking_budget: config.thinking_budget_tokens,
        })
    }

    /// The request's `max_tokens`: its own limit, else the model's configured one, else
    /// [`DEFAULT_MAX_TOKENS`].
    fn max_tokens(&self, request: &ModelRequest) -> u32 {
        request.max_output_tokens.unwrap_or_else(|| {
            self.max_tokens
                .iter()
                .find(|(name, _)| *name == request.model)
                .map_or(DEFAULT_MAX_TOKENS, |(_, max)| *max)
        })
    }
}

#[async_trait]
impl Provider for Anthropic {
    #[tracing::instrument(skip_all, fields(provider = %self.endpoint.id, model = %request.model))]
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ProviderError> {
        let body = request_body(&request, self.max_tokens(&request), self.thinking_budget);
        let mut builder = self
            .endpoint
            .post("/messages", &body)
            .header("anthropic-version", ANTHROPIC_VERSION);
        if let Some(key) = self.endpoint.api_key() {
            builder = builder.header("x-api-key", key);
        }
        // A non-2xx answer is classified by its error type, then its status.
        let bytes = self
            .endpoint
            .open(builder, |status, body| {
                let detail = ErrorDetail::from_body(body);
                (classify(status, &detail), detail.message)
            })
            .await?;
        let ids = CallIds::of_history(&request.messages);
        Ok(sse::parse(bytes, Parser::new(&self.endpoint.id, ids)))
    }
}

// ---------------------------------------------------------------------------------------------
// Errors

/// What an error body or an in-stream `error` event says:
/// `{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}`.
#[derive(Debug, Default)]
struct ErrorDetail {
    /// `error.type`, e.g. `invalid_request_error`.
    kind: Option<String>,
    message: Option<String>,
}

impl ErrorDetail {
    fn from_body(body: &[u8]) -> Self {
        serde_json::from_slice::<Value>(body)
            .map(|value| Self::from_value(&value))
            .unwrap_or_default()
    }

    /// Reads the Anthropic shape, also accepting the error object alone or `{"error": "…"}`
    /// (proxies).
    fn from_value(value: &Value) -> Self {
        let error = match value.get("error") {
            Some(Value::String(message)) => {
                return Self {
                    kind: None,
                    message: Some(message.clone()),
                };
            }
            Some(error) => error,
            None => value,
        };
        Self {
            kind: error.get("type").and_then(Value::as_str).map(str::to_owned),
            message: error
                .get("message")
                .and_then(Value::as_str)
                .map(str::to_owned),
        }
    }

    /// "prompt is too long: 208000 tokens > 200000 maximum", "input length and `max_tokens`
    /// exceed context limit: …" and similar.
    fn is_context_length(&self) -> bool {
        let message = self.message.as_deref().unwrap_or("").to_lowercase();
        [
            "prompt is too long",
            "exceed context limit",
            "context window",
            "context length",
        ]
        .iter()
        .any(|phrase| message.contains(phrase))
    }
}

/// The class of an error answer: by the error's `type` when it is one Anthropic documents,
/// else by HTTP status; `invalid_request_error` (400) about the prompt's length, and
/// `request_too_large` or any `413` (the API's or a proxy's size limit), are
/// `context_length_exceeded`.
fn classify(status: Option<u16>, detail: &ErrorDetail) -> ErrorClass {
    let by_kind = match detail.kind.as_deref() {
        Some("invalid_request_error" | "not_found_error") => Some(ErrorClass::InvalidRequest),
        // 413: the request's size; a compaction shrinks it.
        Some("request_too_large") => Some(ErrorClass::ContextLengthExceeded),
        Some("authentication_error" | "permission_error") => Some(ErrorClass::Auth),
        Some("rate_limit_error") => Some(ErrorClass::RateLimited),
        Some("overloaded_error") => Some(ErrorClass::Overloaded),
        Some("api_error") => Some(ErrorClass::Server),
        Some("timeout_error") => Some(ErrorClass::Timeout),
        _ => None,
    };
    let by_status = status.map(|status| match status {
        401 | 403 => ErrorClass::Auth,
        429 => ErrorClass::RateLimited,
        503 | 529 => ErrorClass::Overloaded,
        408 | 504 => ErrorClass::Timeout,
        413 => ErrorClass::ContextLengthExceeded,
        400..=499 => ErrorClass::InvalidRequest,
        _ => ErrorClass::Server,
    });
    match by_kind.or(by_status).unwrap_or(ErrorClass::Server) {
        ErrorClass::InvalidRequest if detail.is_context_length() => {
            ErrorClass::ContextLengthExceeded
        }
        class => class,
    }
}

// ---------------------------------------------------------------------------------------------
// Request

/// The JSON body of a streaming Messages request: the instructions and then the system
/// messages joined (blank line between) into the top-level `system`; `temperature`, `top_p`,
/// `stop_sequences` when set; `tool_choice.disable_parallel_tool_use` when
/// `parallel_tool_calls` is set and tools are offered; `provider_options` last, except
/// [`OWNED_KEYS`], then the run's output schema as `output_config.format` (`json_schema`, see
/// `provider::structured`); the other messages as `user`/`assistant` turns of content
/// blocks, consecutive messages of one side merged into one turn (so all `tool_result` blocks
/// answering one assistant turn travel in one user message, in call order).
///
/// With a thinking budget, `"thinking": {"type": "enabled", "budget_tokens": N}`, N at most
/// `max_tokens - 1`; left out when that is below the API's minimum of 1024 tokens, when the
/// tool choice forces a tool (the API does not allow thinking then), or when the current
/// assistant turn (the tool-use loop since the last user message) already has a tool-use
/// message without thinking, e.g. after a forced first call: the API wants one thinking
/// configuration per assistant turn, and with thinking on it rejects a final assistant turn
/// that does not start with a thinking block.
fn request_body(request: &ModelRequest, max_tokens: u32, thinking_budget: Option<u32>) -> Value {
    let mut body = Map::new();
    body.insert("model".to_owned(), json!(request.model));
    body.insert("max_tokens".to_owned(), json!(max_tokens));
    body.insert("stream".to_owned(), json!(true));
    if let Some(temperature) = request.temperature {
        body.insert("temperature".to_owned(), json!(temperature));
    }
    if let Some(top_p) = request.top_p {
        body.insert("top_p".to_owned(), json!(top_p));
    }
    if !request.stop.is_empty() {
        body.insert("stop_sequences".to_owned(), json!(request.stop));
    }
    let forced = !request.tools.is_empty()
        && matches!(
            request.tool_choice,
            ToolChoice::Mode(ToolChoiceMode::Required) | ToolChoice::Tool { .. }
        );
    if let Some(budget) = thinking_budget.map(|b| b.min(max_tokens.saturating_sub(1)))
        && budget >= MIN_THINKING_BUDGET
        && !forced
        && !turn_started_without_thinking(&request.messages)
    {
        body.insert(
            "thinking".to_owned(),
            json!({"type": "enabled", "budget_tokens": budget}),
        );
    }
    let system: Vec<String> = request
        .instructions
        .iter()
        .cloned()
        .chain(
            request
                .messages
                .iter()
                .filter(|message| message.role == Role::System)
                .map(|message| text_of(&message.content)),
        )
        .filter(|text| !text.is_empty())
        .collect();
    if !system.is_empty() {
        body.insert("system".to_owned(), json!(system.join("\n\n")));
    }
    body.insert(
        "messages".to_owned(),
        Value::Array(turns(&request.messages)),
    );
    if !request.tools.is_empty() {
        let tools = request
            .tools
            .iter()
            .map(|tool| {
                json!({
                    "name": tool.name,
                    "description": tool.description,
                    "input_schema": tool.parameters,
                })
            })
            .collect();
        body.insert("tools".to_owned(), Value::Array(tools));
        let mut choice = match &request.tool_choice {
            ToolChoice::Mode(ToolChoiceMode::Auto) => json!({"type": "auto"}),
            ToolChoice::Mode(ToolChoiceMode::None) => json!({"type": "none"}),
            ToolChoice::Mode(ToolChoiceMode::Required) => json!({"type": "any"}),
            ToolChoice::Tool { name } => json!({"type": "tool", "name": name}),
        };
        // `none` takes no options.
        if let (Some(parallel), Some(object)) =
            (request.parallel_tool_calls, choice.as_object_mut())
            && request.tool_choice != ToolChoice::Mode(ToolChoiceMode::None)
        {
            object.insert("disable_parallel_tool_use".to_owned(), json!(!parallel));
        }
        body.insert("tool_choice".to_owned(), choice);
    }
    super::merge_options(&mut body, &request.provider_options, OWNED_KEYS);
    if let Some(output) = &request.output {
        body.insert(
            super::structured::ANTHROPIC_KEY.to_owned(),
            output.anthropic(),
        );
    }
    Value::Object(body)
}

/// The keys [`request_body`] writes itself or models, which `provider_options` may not set
/// (see [`super::owned_keys`]).
pub const OWNED_KEYS: &[&str] = &[
    "model",
    "messages",
    "system",
    "stream",
    "tools",
    "tool_choice",
    "max_tokens",
    "thinking",
    "temperature",
    "top_p",
    "stop_sequences",
];

/// Whether the assistant turn in progress (the messages after the last user message) has a
/// message with tool calls and no reasoning: that tool-use loop began with thinking off.
fn turn_started_without_thinking(messages: &[Message]) -> bool {
    let start = messages
        .iter()
        .rposition(|message| message.role == Role::User)
        .map_or(0, |i| i + 1);
    messages
        .get(start..)
        .unwrap_or_default()
        .iter()
        .any(|message| {
            message.role == Role::Assistant
                && !message.tool_calls.is_empty()
                && message.reasoning.is_empty()
        })
}

/// The API's smallest thinking budget, in tokens.
const MIN_THINKING_BUDGET: u32 = 1024;

/// The `messages` array: alternating turns; messages without any block are left out (the
/// API rejects empty content), and so are assistant messages with neither text nor tool
/// calls (a turn of thinking alone is not a turn). An assistant message's reasoning blocks
/// come first in its content.
fn turns(messages: &[Message]) -> Vec<Value> {
    let mut turns: Vec<(&'static str, Vec<Value>)> = Vec::new();
    for message in messages {
        let (role, blocks) = match message.role {
            Role::System => continue,
            Role::User => ("user", content_blocks(&message.content)),
            Role::Tool => ("user", vec![tool_result(message)]),
            Role::Assistant => {
                let said = content_blocks(&message.content);
                if said.is_empty() && message.tool_calls.is_empty() {
                    continue;
                }
                let mut blocks = reasoning_blocks(message);
                blocks.extend(said);
                blocks.extend(message.tool_calls.iter().map(|call| {
                    json!({
                        "type": "tool_use",
                        "id": call.id,
                        "name": call.name,
                        "input": call.arguments,
                    })
                }));
                ("assistant", blocks)
            }
        };
        if blocks.is_empty() {
            continue;
        }
        match turns.last_mut() {
            Some((last, content)) if *last == role => content.extend(blocks),
            _ => turns.push((role, blocks)),
        }
    }
    turns
        .into_iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect()
}

/// The reasoning of an assistant message as `thinking` (with its signature) and
/// `redacted_thinking` blocks; blocks without a signature or data are left out.
fn reasoning_blocks(message: &Message) -> Vec<Value> {
    message
        .reasoning
        .iter()
        .filter_map(|block| match (&block.redacted_data, &block.signature) {
            (Some(data), _) => Some(json!({"type": "redacted_thinking", "data": data})),
            (None, Some(signature)) => Some(json!({
                "type": "thinking",
                "thinking": block.text,
                "signature": signature,
            })),
            (None, None) => None,
        })
        .collect()
}

/// Text (not blank: the API rejects empty and whitespace-only text blocks), JSON (as text)
/// and image parts as content blocks.
fn content_blocks(parts: &[ContentPart]) -> Vec<Value> {
    parts
        .iter()
        .filter_map(|part| match part {
            ContentPart::Text { text } if text.trim().is_empty() => None,
            ContentPart::Text { text } => Some(json!({"type": "text", "text": text})),
            ContentPart::Json { value } => Some(json!({"type": "text", "text": value.to_string()})),
            ContentPart::Image { url, media_type } => Some(image_block(url, media_type)),
        })
        .collect()
}

/// An image block: `base64` source for a `data:` URL, else `url` source.
fn image_block(url: &str, mime_type: &str) -> Value {
    if let Some(rest) = url.strip_prefix("data:")
        && let Some((meta, data)) = rest.split_once(',')
        && let Some(media_type) = meta.strip_suffix(";base64")
    {
        let media_type = if media_type.is_empty() {
            mime_type
        } else {
            media_type
        };
        return json!({"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}});
    }
    json!({"type": "image", "source": {"type": "url", "url": url}})
}

/// A tool message as a `tool_result` block; `is_error` when the run loop stored a failure
/// (text starting with `error: `).
fn tool_result(message: &Message) -> Value {
    let text = text_of(&message.content);
    let mut block = json!({
        "type": "tool_result",
        "tool_use_id": message.tool_call_id.as_deref().unwrap_or_default(),
        "content": text,
    });
    if text.starts_with("error: ") {
        block["is_error"] = json!(true);
    }
    block
}

// ---------------------------------------------------------------------------------------------
// Response stream

/// Parses a Messages event stream (the raw response body, in reads of any size) into
/// [`ModelEvent`]s: text, reasoning and tool-call events as they arrive (see the module
/// documentation), then at most one `Usage` and exactly one `Finished`. The stream ends after
/// the first error: an `error` event (classified like an HTTP error), a malformed event
/// (`server`), a read error (its class), a body without any event (`server`) or one that ends
/// before `message_stop` (`transport`).
pub fn parse_stream<S, B, E>(provider: &str, bytes: S) -> ModelStream
where
    S: Stream<Item = Result<B, E>> + Send + 'static,
    B: AsRef<[u8]> + Send + 'static,
    E: Into<ReadError> + Send + 'static,
{
    sse::parse(bytes, Parser::new(provider, CallIds::default()))
}

/// One event's data, leniently: every field may be absent.
#[derive(Debug, Default, Deserialize)]
struct Data {
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    message: Option<MessageStart>,
    #[serde(default)]
    index: Option<u64>,
    #[serde(default)]
    content_block: Option<Value>,
    #[serde(default)]
    delta: Option<Value>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Debug, Default, Deserialize)]
struct MessageStart {
    #[serde(default)]
    usage: Option<Usage>,
}

/// Token counts; each field replaces the one reported before (`message_delta` counts are
/// cumulative).
#[derive(Debug, Default, Clone, Copy, Deserialize)]
struct Usage {
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
}

impl Usage {
    fn merge(&mut self, newer: Usage) {
        self.input_tokens = newer.input_tokens.or(self.input_tokens);
        self.output_tokens = newer.output_tokens.or(self.output_tokens);
        self.cache_creation_input_tokens = newer
            .cache_creation_input_tokens
            .or(self.cache_creation_input_tokens);
        self.cache_read_input_tokens = newer
            .cache_read_input_tokens
            .or(self.cache_read_input_tokens);
    }

    fn event(self) -> ModelEvent {
        let creation = self.cache_creation_input_tokens.unwrap_or(0);
        let read = self.cache_read_input_tokens.unwrap_or(0);
        let input = self.input_tokens.unwrap_or(0) + creation + read;
        let output = self.output_tokens.unwrap_or(0);
        let cache = (self.cache_creation_input_tokens.is_some()
            || self.cache_read_input_tokens.is_some())
        .then(|| CacheMetrics {
            cache_creation_input_tokens: creation,
            cache_read_input_tokens: read,
            ..CacheMetrics::default()
        });
        ModelEvent::Usage {
            usage: TokenUsage {
                reasoning_tokens: 0,
                estimated: false,
                input_tokens: input,
                output_tokens: output,
                total_tokens: input + output,
            },
            cache,
        }
    }
}

/// A content block being streamed, by its `index`.
#[derive(Debug)]
enum Block {
    /// A tool_use block.
    Tool {
        id: String,
        name: String,
        /// `content_block_start`'s `input` (`{}` when streamed), used when no delta came.
        initial: Value,
        arguments: String,
    },
    /// A thinking block: its text and signature so far.
    Thinking { text: String, signature: String },
    /// A redacted_thinking block and its opaque data.
    Redacted { data: String },
    /// Text and anything else: its deltas are handled as they come.
    Other,
}

/// The state of one call's stream.
struct Parser {
    provider: String,
    ids: CallIds,
    /// Open content blocks with their index (interleaved blocks stay apart).
    blocks: Vec<(Option<u64>, Block)>,
    stop_reason: Option<String>,
    usage: Option<Usage>,
    completed: usize,
}

impl Parser {
    fn new(provider: &str, ids: CallIds) -> Self {
        Self {
            provider: provider.to_owned(),
            ids,
            blocks: Vec::new(),
            stop_reason: None,
            usage: None,
            completed: 0,
        }
    }

    fn error(&self, class: ErrorClass, message: impl Into<String>) -> ProviderError {
        ProviderError::new(&self.provider, class, message)
    }

    fn add_usage(&mut self, usage: Usage) {
        self.usage.get_or_insert_with(Usage::default).merge(usage);
    }

    /// The open block of `index` (the last one when the event has no index).
    fn block(&mut self, index: Option<u64>) -> Option<&mut Block> {
        match index {
            Some(_) => self
                .blocks
                .iter_mut()
                .find(|(i, _)| *i == index)
                .map(|(_, block)| block),
            None => self.blocks.last_mut().map(|(_, block)| block),
        }
    }

    fn on_block_start(&mut self, data: &Data, out: &mut Out) {
        let Some(block) = &data.content_block else {
            return;
        };
        let field = |key: &str| {
            block
                .get(key)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        let open = match block.get("type").and_then(Value::as_str) {
            Some("text") => {
                let text = field("text");
                if !text.is_empty() {
                    out.push_back(Ok(ModelEvent::TextDelta(text)));
                }
                Block::Other
            }
            Some("tool_use") => {
                let id = self.ids.assign(&field("id"));
                let name = field("name");
                out.push_back(Ok(ModelEvent::ToolCallStarted {
                    call_id: id.clone(),
                    tool_name: name.clone(),
                }));
                Block::Tool {
                    id,
                    name,
                    initial: block.get("input").cloned().unwrap_or_else(|| json!({})),
                    arguments: String::new(),
                }
            }
            Some("thinking") => {
                let text = field("thinking");
                if !text.is_empty() {
                    out.push_back(Ok(ModelEvent::ReasoningDelta(text.clone())));
                }
                Block::Thinking {
                    text,
                    signature: field("signature"),
                }
            }
            Some("redacted_thinking") => Block::Redacted {
                data: field("data"),
            },
            // Server tools and block types added later: not surfaced.
            _ => Block::Other,
        };
        // A block index reused before its stop replaces the old block, which is closed.
        if let Some(position) = self.blocks.iter().position(|(i, _)| *i == data.index)
            && data.index.is_some()
        {
            let (_, old) = self.blocks.remove(position);
            self.close(old, out);
        }
        self.blocks.push((data.index, open));
    }

    fn on_block_delta(&mut self, data: &Data, out: &mut Out) {
        let Some(delta) = &data.delta else {
            return;
        };
        let piece = |key: &str| delta.get(key).and_then(Value::as_str).unwrap_or_default();
        match delta.get("type").and_then(Value::as_str) {
            Some("text_delta") => {
                let text = piece("text");
                if !text.is_empty() {
                    out.push_back(Ok(ModelEvent::TextDelta(text.to_owned())));
                }
            }
            Some("input_json_delta") => {
                let json = piece("partial_json");
                if let Some(Block::Tool { id, arguments, .. }) = self.block(data.index)
                    && !json.is_empty()
                {
                    arguments.push_str(json);
                    out.push_back(Ok(ModelEvent::ToolCallDelta {
                        call_id: id.clone(),
                        delta: json.to_owned(),
                    }));
                }
            }
            Some("thinking_delta") => {
                let thinking = piece("thinking");
                if let Some(Block::Thinking { text, .. }) = self.block(data.index)
                    && !thinking.is_empty()
                {
                    text.push_str(thinking);
                    out.push_back(Ok(ModelEvent::ReasoningDelta(thinking.to_owned())));
                }
            }
            Some("signature_delta") => {
                if let Some(Block::Thinking { signature, .. }) = self.block(data.index) {
                    signature.push_str(piece("signature"));
                }
            }
            // citations_delta and delta types added later: not surfaced.
            _ => {}
        }
    }

    fn on_block_stop(&mut self, index: Option<u64>, out: &mut Out) {
        let position = match index {
            Some(_) => self.blocks.iter().position(|(i, _)| *i == index),
            None => self.blocks.len().checked_sub(1),
        };
        if let Some(position) = position {
            let (_, block) = self.blocks.remove(position);
            self.close(block, out);
        }
    }

    /// A block ended: a tool call completes (arguments parsed, or kept raw in
    /// `invalid_arguments`), a thinking block becomes one `ReasoningCompleted`.
    fn close(&mut self, block: Block, out: &mut Out) {
        match block {
            Block::Tool {
                id,
                name,
                initial,
                arguments,
            } => {
                let (arguments, invalid_arguments) = if arguments.trim().is_empty() {
                    (initial, None)
                } else {
                    parse_arguments(&arguments)
                };
                if invalid_arguments.is_some() {
                    tracing::warn!(
                        provider = %self.provider,
                        call_id = %id,
                        tool = %name,
                        "tool call arguments are not a JSON object"
                    );
                }
                self.completed += 1;
                out.push_back(Ok(ModelEvent::ToolCallCompleted(ToolCall {
                    id,
                    name,
                    arguments,
                    invalid_arguments,
                })));
            }
            Block::Thinking { text, signature } => {
                out.push_back(Ok(ModelEvent::ReasoningCompleted(Reasoning {
                    text,
                    signature: (!signature.is_empty()).then_some(signature),
                    redacted_data: None,
                })));
            }
            Block::Redacted { data } => {
                out.push_back(Ok(ModelEvent::ReasoningCompleted(Reasoning {
                    text: String::new(),
                    signature: None,
                    redacted_data: Some(data),
                })));
            }
            Block::Other => {}
        }
    }

    /// The stop reason is known: blocks never stopped are closed now.
    fn close_blocks(&mut self, out: &mut Out) {
        for (_, block) in std::mem::take(&mut self.blocks) {
            self.close(block, out);
        }
    }
}

impl StreamParser for Parser {
    fn provider(&self) -> &str {
        &self.provider
    }

    /// Handles one SSE event; its data's `type` decides, the SSE event name is the fallback.
    fn on_event(&mut self, event: &str, data: &str, out: &mut Out) -> Step {
        if data.trim().is_empty() {
            return Step::Continue;
        }
        let parsed: Data = match serde_json::from_str(data) {
            Ok(parsed) => parsed,
            Err(_) if event == "error" => {
                let detail = ErrorDetail {
                    kind: None,
                    message: Some(excerpt(data)),
                };
                out.push_back(Err(self.error(classify(None, &detail), excerpt(data))));
                return Step::End;
            }
            Err(error) => {
                out.push_back(Err(self.error(
                    ErrorClass::Server,
                    format!("malformed event: {error}: {}", excerpt(data)),
                )));
                return Step::End;
            }
        };
        let kind = parsed.kind.clone().unwrap_or_else(|| event.to_owned());
        match kind.as_str() {
            "message_start" => {
                if let Some(usage) = parsed.message.and_then(|m| m.usage) {
                    self.add_usage(usage);
                }
            }
            "content_block_start" => self.on_block_start(&parsed, out),
            "content_block_delta" => self.on_block_delta(&parsed, out),
            "content_block_stop" => self.on_block_stop(parsed.index, out),
            "message_delta" => {
                if let Some(usage) = parsed.usage {
                    self.add_usage(usage);
                }
                let reason = parsed
                    .delta
                    .as_ref()
                    .and_then(|d| d.get("stop_reason"))
                    .and_then(Value::as_str);
                if let Some(reason) = reason {
                    self.stop_reason = Some(reason.to_owned());
                    self.close_blocks(out);
                }
            }
            "message_stop" => {
                self.finish_events(out);
                return Step::End;
            }
            "error" => {
                let detail =
                    ErrorDetail::from_value(&serde_json::from_str(data).unwrap_or_default());
                let message = detail
                    .message
                    .as_deref()
                    .map_or_else(|| excerpt(data), excerpt);
                out.push_back(Err(self.error(classify(None, &detail), message)));
                return Step::End;
            }
            // `ping` and event types added to the API later are skipped, as the API asks.
            _ => {}
        }
        Step::Continue
    }

    /// Without `message_stop` the answer is incomplete: `transport`.
    fn end_of_body(&mut self, out: &mut Out) {
        out.push_back(Err(self.error(
            ErrorClass::Transport,
            "connection closed before message_stop",
        )));
    }

    fn finish_events(&mut self, out: &mut Out) {
        self.close_blocks(out);
        if let Some(usage) = self.usage.take() {
            out.push_back(Ok(usage.event()));
        }
        let reason =
            sse::final_reason(self.stop_reason.as_deref().map(stop_reason), self.completed);
        out.push_back(Ok(ModelEvent::Finished(reason)));
    }
}

/// Maps Anthropic's `stop_reason` (see the module documentation for the choices).
fn stop_reason(reason: &str) -> FinishReason {
    match reason {
        "end_turn" | "stop_sequence" => FinishReason::Stop,
        "tool_use" => FinishReason::ToolCalls,
        "max_tokens" | "model_context_window_exceeded" => FinishReason::Length,
        "refusal" => FinishReason::ContentFilter,
        _ => FinishReason::Unknown,
    }
}

#[cfg(test)]
mod tests;
