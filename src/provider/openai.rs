//! OpenAI Chat Completions, streaming (and compatible servers: vLLM, Ollama, llama.cpp, …).
//!
//! Wire format: `POST {base_url}/chat/completions` with `stream: true`, answered by Server-Sent
//! Events whose `data:` lines are `chat.completion.chunk` objects and end with `data: [DONE]`
//! (<https://platform.openai.com/docs/api-reference/chat/create>,
//! <https://platform.openai.com/docs/api-reference/chat-streaming>).

use async_trait::async_trait;
use futures::Stream;
use serde::Deserialize;
use serde_json::{Map, Value, json};

pub use super::http::ReadError;
use super::http::{Endpoint, excerpt};
use super::sse::{self, Out, Step, StreamParser};
use super::text_of;
use super::{ErrorClass, ModelEvent, ModelRequest, ModelStream, Provider, ProviderError};
use crate::config::ProviderConfig;
use crate::domain::{
    ContentPart, FinishReason, Message, Role, TokenUsage, ToolCall, ToolChoice, ToolChoiceMode,
};
use crate::events::CacheMetrics;

/// Adapter for `kind = "openai"`: one streaming Chat Completions call per
/// [`Provider::stream`], without retries.
#[derive(Debug)]
pub struct OpenAi {
    endpoint: Endpoint,
}

impl OpenAi {
    /// Builds the adapter: an HTTP client with the configured connect timeout (ms), the base
    /// URL (trailing `/` trimmed) and the API key, sent as `Authorization: Bearer` when set.
    ///
    /// # Errors
    /// A [`ProviderError`] of class `invalid_request` when the HTTP client cannot be built.
    pub fn new(id: &str, config: &ProviderConfig) -> Result<Self, ProviderError> {
        Ok(Self {
            endpoint: Endpoint::new(id, config)?,
        })
    }
}

#[async_trait]
impl Provider for OpenAi {
    #[tracing::instrument(skip_all, fields(provider = %self.endpoint.id, model = %request.model))]
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ProviderError> {
        let mut builder = self
            .endpoint
            .post("/chat/completions", &request_body(&request));
        if let Some(key) = self.endpoint.api_key() {
            builder = builder.bearer_auth(key);
        }
        // A non-2xx answer is classified by its status, then its error code.
        let bytes = self
            .endpoint
            .open(builder, |status, body| {
                let detail = ErrorDetail::from_body(body);
                (classify(Some(status), &detail), detail.message)
            })
            .await?;
        Ok(parse_stream(&self.endpoint.id, bytes))
    }
}

/// What an error body or an in-stream error object says.
#[derive(Debug, Default)]
struct ErrorDetail {
    message: Option<String>,
    /// `error.code` or `error.type` strings, e.g. `context_length_exceeded`.
    codes: Vec<String>,
    /// A numeric `code`/`status` some compatible servers put in the error object.
    status: Option<u16>,
}

impl ErrorDetail {
    /// Reads `{"error": {"message", "type", "code"}}`, `{"error": "…"}`, `{"message": "…"}`
    /// or `{"detail": "…"}`; anything else gives an empty detail.
    fn from_body(body: &[u8]) -> Self {
        match serde_json::from_slice::<Value>(body) {
            Ok(Value::Object(object)) => match object.get("error") {
                Some(error) => Self::from_error(error),
                None => Self::from_error(&Value::Object(object)),
            },
            _ => Self::default(),
        }
    }

    fn from_error(error: &Value) -> Self {
        let mut detail = Self::default();
        match error {
            Value::String(message) => detail.message = Some(message.clone()),
            Value::Object(object) => {
                detail.message = ["message", "detail", "error"]
                    .iter()
                    .find_map(|key| object.get(*key).and_then(Value::as_str))
                    .map(str::to_owned);
                for key in ["code", "type", "status"] {
                    match object.get(key) {
                        Some(Value::String(code)) => detail.codes.push(code.clone()),
                        Some(Value::Number(n)) => {
                            detail.status = n.as_u64().and_then(|n| u16::try_from(n).ok());
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
        detail
    }

    fn has_code(&self, needle: &str) -> bool {
        self.codes
            .iter()
            .any(|code| code.to_ascii_lowercase().contains(needle))
    }

    fn is_context_length(&self) -> bool {
        if self.has_code("context_length_exceeded") {
            return true;
        }
        let message = self.message.as_deref().unwrap_or("").to_lowercase();
        [
            "maximum context length",
            "context length",
            "too many tokens",
            "context window",
        ]
        .iter()
        .any(|phrase| message.contains(phrase))
    }
}

/// The class of an error answer: by HTTP status when there is one, else by the error's
/// `code`/`type` (in-stream errors).
fn classify(status: Option<u16>, detail: &ErrorDetail) -> ErrorClass {
    match status.or(detail.status) {
        Some(401 | 403) => ErrorClass::Auth,
        Some(429) => ErrorClass::RateLimited,
        Some(503 | 529) => ErrorClass::Overloaded,
        Some(408) => ErrorClass::Timeout,
        Some(400 | 404 | 413 | 422) if detail.is_context_length() => {
            ErrorClass::ContextLengthExceeded
        }
        Some(400..=499) => ErrorClass::InvalidRequest,
        Some(_) => ErrorClass::Server,
        None if detail.is_context_length() => ErrorClass::ContextLengthExceeded,
        None if detail.has_code("rate_limit") => ErrorClass::RateLimited,
        None if detail.has_code("overloaded") => ErrorClass::Overloaded,
        None if detail.has_code("auth") || detail.has_code("api_key") => ErrorClass::Auth,
        None if detail.has_code("invalid_request") => ErrorClass::InvalidRequest,
        None => ErrorClass::Server,
    }
}

// ---------------------------------------------------------------------------------------------
// Request

/// The JSON body of a streaming Chat Completions request.
fn request_body(request: &ModelRequest) -> Value {
    let mut body = Map::new();
    body.insert("model".to_owned(), json!(request.model));
    body.insert(
        "messages".to_owned(),
        Value::Array(request.messages.iter().map(message_json).collect()),
    );
    body.insert("stream".to_owned(), json!(true));
    body.insert("stream_options".to_owned(), json!({"include_usage": true}));
    if let Some(max) = request.max_output_tokens {
        body.insert("max_completion_tokens".to_owned(), json!(max));
    }
    if !request.tools.is_empty() {
        let tools = request
            .tools
            .iter()
            .map(|tool| {
                json!({
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": tool.parameters,
                    }
                })
            })
            .collect();
        body.insert("tools".to_owned(), Value::Array(tools));
        let choice = match &request.tool_choice {
            ToolChoice::Mode(ToolChoiceMode::Auto) => json!("auto"),
            ToolChoice::Mode(ToolChoiceMode::None) => json!("none"),
            ToolChoice::Mode(ToolChoiceMode::Required) => json!("required"),
            ToolChoice::Tool { name } => json!({"type": "function", "function": {"name": name}}),
        };
        body.insert("tool_choice".to_owned(), choice);
    }
    Value::Object(body)
}

/// A system or user message's `content`: a string, or an array of `text`/`image_url` parts
/// when an image is present.
fn rich_content(parts: &[ContentPart]) -> Value {
    if !parts
        .iter()
        .any(|part| matches!(part, ContentPart::Image { .. }))
    {
        return Value::String(text_of(parts));
    }
    let parts = parts
        .iter()
        .map(|part| match part {
            ContentPart::Text { text } => json!({"type": "text", "text": text}),
            ContentPart::Json { value } => json!({"type": "text", "text": value.to_string()}),
            ContentPart::Image { url, .. } => {
                json!({"type": "image_url", "image_url": {"url": url}})
            }
        })
        .collect();
    Value::Array(parts)
}

fn message_json(message: &Message) -> Value {
    match message.role {
        Role::System | Role::User => json!({
            "role": message.role.as_str(),
            "content": rich_content(&message.content),
        }),
        Role::Assistant => {
            let text = text_of(&message.content);
            let mut object = Map::new();
            object.insert("role".to_owned(), json!("assistant"));
            let content = if text.is_empty() && !message.tool_calls.is_empty() {
                Value::Null
            } else {
                Value::String(text)
            };
            object.insert("content".to_owned(), content);
            if !message.tool_calls.is_empty() {
                let calls = message
                    .tool_calls
                    .iter()
                    .map(|call| {
                        json!({
                            "id": call.id,
                            "type": "function",
                            "function": {
                                "name": call.name,
                                "arguments": call.arguments.to_string(),
                            }
                        })
                    })
                    .collect();
                object.insert("tool_calls".to_owned(), Value::Array(calls));
            }
            Value::Object(object)
        }
        Role::Tool => json!({
            "role": "tool",
            "tool_call_id": message.tool_call_id.as_deref().unwrap_or_default(),
            "content": text_of(&message.content),
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// Response stream

/// Parses a Chat Completions event stream (the raw response body, in reads of any size) into
/// [`ModelEvent`]s: text and tool-call events as they arrive, then at most one `Usage` and
/// exactly one `Finished`. The stream ends after the first error: an `{"error": …}` chunk
/// (classified like an HTTP error), a malformed chunk (`server`), a read error (its class) or
/// an end of the body before any finish reason (`transport`).
pub fn parse_stream<S, B, E>(provider: &str, bytes: S) -> ModelStream
where
    S: Stream<Item = Result<B, E>> + Send + 'static,
    B: AsRef<[u8]> + Send + 'static,
    E: Into<ReadError> + Send + 'static,
{
    sse::parse(bytes, Parser::new(provider))
}

/// One `chat.completion.chunk`, leniently: every field may be absent or null.
#[derive(Debug, Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Option<Vec<Choice>>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct Choice {
    #[serde(default)]
    index: Option<u64>,
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<Fragment>>,
    /// The deprecated single `function_call`, treated as a call without id.
    #[serde(default)]
    function_call: Option<FunctionFragment>,
}

#[derive(Debug, Default, Deserialize)]
struct Fragment {
    #[serde(default)]
    index: Option<u64>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<FunctionFragment>,
}

#[derive(Debug, Default, Deserialize)]
struct FunctionFragment {
    #[serde(default)]
    name: Option<String>,
    /// A JSON text piece; some servers send a whole JSON object instead.
    #[serde(default)]
    arguments: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    total_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Debug, Deserialize)]
struct PromptTokensDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// A tool call being assembled from fragments.
#[derive(Debug, Default)]
struct PendingCall {
    index: Option<u64>,
    id: String,
    name: String,
    arguments: String,
    /// Bytes of `arguments` already sent as `ToolCallDelta`s.
    emitted: usize,
    started: bool,
    /// Completed or dropped.
    closed: bool,
}

/// The state of one call's stream (choice 0 only; behest never asks for `n > 1`).
struct Parser {
    provider: String,
    calls: Vec<PendingCall>,
    last_call: Option<usize>,
    finish: Option<FinishReason>,
    usage: Option<(TokenUsage, Option<CacheMetrics>)>,
    completed: usize,
}

impl Parser {
    fn new(provider: &str) -> Self {
        Self {
            provider: provider.to_owned(),
            calls: Vec::new(),
            last_call: None,
            finish: None,
            usage: None,
            completed: 0,
        }
    }

    fn error(&self, class: ErrorClass, message: impl Into<String>) -> ProviderError {
        ProviderError::new(&self.provider, class, message)
    }

    /// Finds (or opens) the call a fragment continues: by `index`; without one by a non-empty
    /// `id`, else the last open call.
    fn slot(&mut self, fragment: &Fragment, id: Option<&str>) -> usize {
        let open = |call: &PendingCall| !call.closed;
        let found = match fragment.index {
            Some(index) => self.calls.iter().position(|call| {
                open(call)
                    && call.index == Some(index)
                    // Some servers reuse index 0 for every call; a new id means a new call.
                    && id.is_none_or(|id| call.id.is_empty() || call.id == id)
            }),
            None => match id {
                Some(id) => self
                    .calls
                    .iter()
                    .position(|call| open(call) && call.id == id),
                None => self
                    .last_call
                    .filter(|&i| self.calls.get(i).is_some_and(open)),
            },
        };
        found.unwrap_or_else(|| {
            self.calls.push(PendingCall {
                index: fragment.index,
                ..PendingCall::default()
            });
            self.calls.len() - 1
        })
    }

    fn on_fragment(&mut self, fragment: Fragment, out: &mut Out) {
        let id = fragment.id.as_deref().filter(|id| !id.is_empty());
        let slot = self.slot(&fragment, id);
        self.last_call = Some(slot);
        let Some(call) = self.calls.get_mut(slot) else {
            return;
        };
        if let Some(id) = id
            && call.id.is_empty()
        {
            id.clone_into(&mut call.id);
        }
        let function = fragment.function.unwrap_or_default();
        if let Some(name) = function.name.filter(|n| !n.is_empty())
            && call.name.is_empty()
        {
            call.name = name;
        }
        let piece = match function.arguments {
            Some(Value::String(piece)) => piece,
            Some(Value::Null) | None => String::new(),
            Some(value) => value.to_string(),
        };
        if !piece.is_empty() {
            if !call.arguments.is_empty() && piece.starts_with(&call.arguments) {
                // A server resending the arguments so far plus the new piece.
                call.arguments = piece;
            } else {
                call.arguments.push_str(&piece);
            }
        }
        if !call.started && !call.id.is_empty() && !call.name.is_empty() {
            call.started = true;
            out.push_back(Ok(ModelEvent::ToolCallStarted {
                call_id: call.id.clone(),
                tool_name: call.name.clone(),
            }));
        }
        emit_arguments(call, out);
    }

    /// Completes every open call whose arguments parse (empty arguments are `{}`) and drops
    /// the others.
    fn close_calls(&mut self, out: &mut Out) {
        for (n, call) in self.calls.iter_mut().enumerate() {
            if call.closed {
                continue;
            }
            call.closed = true;
            let arguments = if call.arguments.trim().is_empty() {
                Ok(json!({}))
            } else {
                serde_json::from_str::<Value>(&call.arguments)
            };
            let arguments = match (call.name.is_empty(), arguments) {
                (false, Ok(arguments)) => arguments,
                (_, result) => {
                    tracing::warn!(
                        provider = %self.provider,
                        call_id = %call.id,
                        tool = %call.name,
                        argument_bytes = call.arguments.len(),
                        valid_json = result.is_ok(),
                        "incomplete tool call dropped"
                    );
                    continue;
                }
            };
            if call.id.is_empty() {
                // Servers that send no ids (legacy `function_call`, some local servers).
                call.id = format!("call_{n}");
            }
            if !call.started {
                call.started = true;
                out.push_back(Ok(ModelEvent::ToolCallStarted {
                    call_id: call.id.clone(),
                    tool_name: call.name.clone(),
                }));
                emit_arguments(call, out);
            }
            self.completed += 1;
            out.push_back(Ok(ModelEvent::ToolCallCompleted(ToolCall {
                invalid_arguments: None,
                id: call.id.clone(),
                name: call.name.clone(),
                arguments,
            })));
        }
    }
}

impl StreamParser for Parser {
    fn provider(&self) -> &str {
        &self.provider
    }

    /// Handles one SSE event (`event` is its type, `message` by default).
    fn on_event(&mut self, event: &str, data: &str, out: &mut Out) -> Step {
        if data.trim() == "[DONE]" {
            self.finish_events(out);
            return Step::End;
        }
        if event != "message" && event != "error" {
            return Step::Continue;
        }
        let chunk: Chunk = match serde_json::from_str(data) {
            Ok(chunk) => chunk,
            Err(error) if event == "error" => {
                tracing::debug!(%error, "error event without a JSON body");
                let detail = ErrorDetail {
                    message: Some(excerpt(data)),
                    ..ErrorDetail::default()
                };
                out.push_back(Err(self.error(classify(None, &detail), excerpt(data))));
                return Step::End;
            }
            Err(error) => {
                out.push_back(Err(self.error(
                    ErrorClass::Server,
                    format!("malformed chunk: {error}: {}", excerpt(data)),
                )));
                return Step::End;
            }
        };
        if let Some(error) = chunk.error.filter(|e| !e.is_null()) {
            let detail = ErrorDetail::from_error(&error);
            let message = detail
                .message
                .as_deref()
                .map_or_else(|| excerpt(&error.to_string()), excerpt);
            out.push_back(Err(ProviderError {
                status: detail.status,
                ..self.error(classify(None, &detail), message)
            }));
            return Step::End;
        }
        if let Some(usage) = chunk.usage {
            let input = usage.prompt_tokens.unwrap_or(0);
            let output = usage.completion_tokens.unwrap_or(0);
            let tokens = TokenUsage {
                reasoning_tokens: 0,
                estimated: false,
                input_tokens: input,
                output_tokens: output,
                total_tokens: usage.total_tokens.unwrap_or(input + output),
            };
            let cache = usage
                .prompt_tokens_details
                .and_then(|details| details.cached_tokens)
                .map(|cached| CacheMetrics {
                    cached_input_tokens: cached,
                    ..CacheMetrics::default()
                });
            self.usage = Some((tokens, cache));
        }
        for choice in chunk.choices.unwrap_or_default() {
            if choice.index.unwrap_or(0) != 0 {
                continue;
            }
            if let Some(delta) = choice.delta {
                if let Some(text) = delta.content.filter(|t| !t.is_empty()) {
                    out.push_back(Ok(ModelEvent::TextDelta(text)));
                }
                for fragment in delta.tool_calls.unwrap_or_default() {
                    self.on_fragment(fragment, out);
                }
                if let Some(function) = delta.function_call {
                    self.on_fragment(
                        Fragment {
                            function: Some(function),
                            ..Fragment::default()
                        },
                        out,
                    );
                }
            }
            if let Some(reason) = choice.finish_reason.filter(|r| !r.is_empty()) {
                self.finish = Some(finish_reason(&reason));
                self.close_calls(out);
            }
        }
        Step::Continue
    }

    fn stop_known(&self) -> bool {
        self.finish.is_some()
    }

    fn finish_events(&mut self, out: &mut Out) {
        self.close_calls(out);
        if let Some((usage, cache)) = self.usage.take() {
            out.push_back(Ok(ModelEvent::Usage { usage, cache }));
        }
        let reason = sse::final_reason(self.finish, self.completed);
        out.push_back(Ok(ModelEvent::Finished(reason)));
    }
}

/// Sends the arguments received since the last delta of a started call.
fn emit_arguments(call: &mut PendingCall, out: &mut Out) {
    if !call.started {
        return;
    }
    if let Some(delta) = call.arguments.get(call.emitted..).filter(|d| !d.is_empty()) {
        out.push_back(Ok(ModelEvent::ToolCallDelta {
            call_id: call.id.clone(),
            delta: delta.to_owned(),
        }));
        call.emitted = call.arguments.len();
    }
}

/// Maps OpenAI's `finish_reason` (and a few spellings of compatible servers).
fn finish_reason(reason: &str) -> FinishReason {
    match reason {
        "stop" | "eos" | "eos_token" | "end_turn" | "stop_sequence" => FinishReason::Stop,
        "tool_calls" | "function_call" => FinishReason::ToolCalls,
        "length" | "max_tokens" => FinishReason::Length,
        "content_filter" => FinishReason::ContentFilter,
        _ => FinishReason::Unknown,
    }
}

#[cfg(test)]
mod tests;
