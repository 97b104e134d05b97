//! OpenAI Chat Completions, streaming (and compatible servers: vLLM, Ollama, llama.cpp, …).
//!
//! Wire format: `POST {base_url}/chat/completions` with `stream: true`, answered by Server-Sent
//! Events whose `data:` lines are `chat.completion.chunk` objects and end with `data: [DONE]`
//! (<https://platform.openai.com/docs/api-reference/chat/create>,
//! <https://platform.openai.com/docs/api-reference/chat-streaming>).

use async_trait::async_trait;
use futures::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::calls::{CallIds, parse_arguments};
pub use super::http::ReadError;
use super::http::{Endpoint, excerpt};
use super::sse::{self, Out, Step, StreamParser};
use super::text_of;
use super::{ErrorClass, ModelEvent, ModelRequest, ModelStream, Provider, ProviderError};
use crate::config::{
    AssistantToolCallContent, ForcedToolChoice, InstructionsRole, MaxTokensField, ProviderConfig,
    ReasoningEffort, ReasoningReplay,
};
use crate::domain::{
    ContentPart, FinishReason, Message, Reasoning, Role, TokenUsage, ToolCall, ToolChoice,
    ToolChoiceMode,
};
use crate::events::CacheMetrics;

/// Adapter for `kind = "openai"`: one streaming Chat Completions call per
/// [`Provider::stream`], without retries.
#[derive(Debug)]
pub struct OpenAi {
    endpoint: Endpoint,
    options: Options,
}

/// The provider options that shape a request (see [`ProviderConfig`]).
#[derive(Debug, Clone, Copy)]
struct Options {
    max_tokens_field: MaxTokensField,
    assistant_tool_call_content: AssistantToolCallContent,
    reasoning_replay: ReasoningReplay,
    reasoning_effort: Option<ReasoningEffort>,
    instructions_role: InstructionsRole,
    forced_tool_choice: ForcedToolChoice,
}

/// OpenAI's own defaults (as for `https://api.openai.com/v1`).
impl Default for Options {
    fn default() -> Self {
        Self {
            max_tokens_field: MaxTokensField::MaxCompletionTokens,
            assistant_tool_call_content: AssistantToolCallContent::Null,
            reasoning_replay: ReasoningReplay::None,
            reasoning_effort: None,
            instructions_role: InstructionsRole::System,
            forced_tool_choice: ForcedToolChoice::Required,
        }
    }
}

impl Options {
    fn of(config: &ProviderConfig) -> Self {
        Self {
            max_tokens_field: config
                .max_tokens_field
                .unwrap_or_else(|| default_max_tokens_field(&config.base_url)),
            assistant_tool_call_content: config
                .assistant_tool_call_content
                .unwrap_or_else(|| default_assistant_tool_call_content(&config.base_url)),
            reasoning_replay: config.reasoning_replay,
            reasoning_effort: config.reasoning_effort,
            instructions_role: config.instructions_role,
            forced_tool_choice: config.forced_tool_choice,
        }
    }
}

/// Whether the base URL's host is `api.openai.com`.
fn is_openai(base_url: &str) -> bool {
    let host = reqwest::Url::parse(base_url)
        .ok()
        .and_then(|url| url.host_str().map(str::to_ascii_lowercase));
    host.as_deref() == Some("api.openai.com")
}

/// `max_completion_tokens` when the base URL's host is `api.openai.com`, else `max_tokens`.
fn default_max_tokens_field(base_url: &str) -> MaxTokensField {
    if is_openai(base_url) {
        MaxTokensField::MaxCompletionTokens
    } else {
        MaxTokensField::MaxTokens
    }
}

/// `null` (OpenAI's documented format) when the base URL's host is `api.openai.com`, else
/// `""`: what every compatible server accepts (`llama-cpp-python`'s server answers `500` to a
/// `null` content, see `tests/fixtures/llama_cpp_python/`).
fn default_assistant_tool_call_content(base_url: &str) -> AssistantToolCallContent {
    if is_openai(base_url) {
        AssistantToolCallContent::Null
    } else {
        AssistantToolCallContent::Empty
    }
}

impl OpenAi {
    /// Builds the adapter: an HTTP client with the configured connect timeout (ms), the base
    /// URL (trailing `/` trimmed), the API key, sent as `Authorization: Bearer` when set, and
    /// the request options (`max_tokens_field`, `assistant_tool_call_content`,
    /// `reasoning_replay`, `reasoning_effort`, `instructions_role`, `forced_tool_choice`).
    ///
    /// # Errors
    /// A [`ProviderError`] of class `invalid_request` when the HTTP client cannot be built.
    pub fn new(id: &str, config: &ProviderConfig) -> Result<Self, ProviderError> {
        Ok(Self {
            endpoint: Endpoint::new(id, config)?,
            options: Options::of(config),
        })
    }
}

#[async_trait]
impl Provider for OpenAi {
    #[tracing::instrument(skip_all, fields(provider = %self.endpoint.id, model = %request.model))]
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ProviderError> {
        let mut builder = self
            .endpoint
            .post("/chat/completions", &request_body(&request, &self.options));
        if let Some(key) = self.endpoint.api_key() {
            builder = builder.bearer_auth(key);
        }
        // A non-2xx answer is classified by its status, then its error code.
        let bytes = self
            .endpoint
            .open(builder, |status, body| {
                let detail = ErrorDetail::from_body(body);
                (classify(status, &detail), detail.message)
            })
            .await?;
        let ids = CallIds::of_history(&request.messages);
        let mut stream = sse::parse(bytes, Parser::new(&self.endpoint.id, ids));
        match stream.next().await {
            Some(Err(error)) if sse::is_empty_stream(&error) => self.unstreamed(&request).await,
            Some(first) => Ok(futures::stream::once(async move { first })
                .chain(stream)
                .boxed()),
            None => Ok(futures::stream::empty().boxed()),
        }
    }
}

impl OpenAi {
    /// The request made again without streaming, after a `200` event stream that held no
    /// event: `llama-cpp-python`'s server answers an over-long streaming request so, and the
    /// same request without `stream` gets its real error (`400 context_length_exceeded`), or a
    /// completion, replayed as the events of a stream. A connection that fails is tried once
    /// more.
    ///
    /// # Errors
    /// The answer's error, classified as any other; the connection's when it fails twice.
    async fn unstreamed(&self, request: &ModelRequest) -> Result<ModelStream, ProviderError> {
        tracing::info!(
            provider = %self.endpoint.id,
            "empty event stream; asking again without streaming to read the error"
        );
        let mut body = request_body(request, &self.options);
        if let Some(object) = body.as_object_mut() {
            object.insert("stream".to_owned(), Value::Bool(false));
            object.remove("stream_options");
        }
        let mut tries = 0;
        let answer = loop {
            tries += 1;
            let mut builder = self.endpoint.post_json("/chat/completions", &body);
            if let Some(key) = self.endpoint.api_key() {
                builder = builder.bearer_auth(key);
            }
            let answer = self
                .endpoint
                .complete(builder, |status, body| {
                    let detail = ErrorDetail::from_body(body);
                    (classify(status, &detail), detail.message)
                })
                .await;
            match answer {
                Err(error) if error.class == ErrorClass::Transport && tries < 2 => {}
                answer => break answer?,
            }
        };
        let ids = CallIds::of_history(&request.messages);
        Ok(completion_events(
            Parser::new(&self.endpoint.id, ids),
            &answer,
        ))
    }
}

/// The events of a whole `chat.completion` (an answer without streaming): its choices'
/// `message` read as one chunk's `delta`, then the normal end.
fn completion_events(mut parser: Parser, body: &[u8]) -> ModelStream {
    let mut out = Out::new();
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(mut completion)) => {
            if let Some(Value::Array(choices)) = completion.get_mut("choices") {
                for choice in choices.iter_mut().filter_map(Value::as_object_mut) {
                    if let Some(message) = choice.remove("message") {
                        choice.insert("delta".to_owned(), message);
                    }
                }
            }
            let chunk = Value::Object(completion).to_string();
            if parser.on_event("message", &chunk, &mut out) == Step::Continue {
                parser.finish_events(&mut out);
            }
        }
        _ => out.push_back(Err(parser.error(
            ErrorClass::Server,
            format!(
                "the answer without streaming is not a completion: {}",
                excerpt(&String::from_utf8_lossy(body))
            ),
        ))),
    }
    futures::stream::iter(out).boxed()
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
            Value::String(message) => detail.message = Some(most_specific(message)),
            Value::Object(object) => {
                detail.message = ["message", "detail", "error"]
                    .iter()
                    .find_map(|key| object.get(*key).and_then(Value::as_str))
                    .map(most_specific)
                    .or_else(|| object.get("detail").and_then(fastapi_detail));
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

    /// Whether the message states that the request failed validation: pydantic's "N
    /// validation error(s) for …" (`llama-cpp-python`'s server answers `500` with it), FastAPI's
    /// list of errors, or "validation error" in any wording. Such an answer is the same on
    /// every try.
    fn states_validation_failure(&self) -> bool {
        let message = self.message.as_deref().unwrap_or("").to_lowercase();
        message.contains("validation error")
            || message.contains("validationerror")
            || self.has_code("validation")
    }

    fn has_code(&self, needle: &str) -> bool {
        self.codes
            .iter()
            .any(|code| code.to_ascii_lowercase().contains(needle))
    }

    /// OpenAI's `context_length_exceeded` code, llama.cpp's `exceed_context_size_error` type,
    /// or the wordings of OpenAI, vLLM ("This model's maximum context length is …", and its v1
    /// engine's "The decoder prompt (length …) is longer than the maximum model length of …"),
    /// llama.cpp ("request (… tokens) exceeds the available context size"), Ollama ("prompt
    /// too long; exceeded max context length by … tokens", "the input length exceeds the
    /// context length"), LM Studio ("… loaded with context length of only … tokens") and
    /// similar. The bodies are in `tests/fixtures/context_length/`.
    fn is_context_length(&self) -> bool {
        if self.has_code("context_length_exceeded") || self.has_code("exceed_context_size") {
            return true;
        }
        let message = self.message.as_deref().unwrap_or("").to_lowercase();
        [
            "maximum context length",
            "max context length",
            "context length",
            "context size",
            "too many tokens",
            "context window",
            "prompt is too long",
            "prompt too long",
            "maximum model length",
        ]
        .iter()
        .any(|phrase| message.contains(phrase))
    }
}

/// The message of a validation failure as one line: its heading and the error that names the
/// cause — the first that is neither a union member's literal mismatch (`literal_error`, e.g.
/// "Input should be 'system'" for an assistant message) nor a missing field, else the first.
/// Two layouts are read: pydantic's own ("N validation errors for Model", then per error a
/// location line and a message line with `[type=…]`) and the list `llama-cpp-python`'s server
/// sends ("N validation errors:", then one Python dict per line with `type`, `loc`, `msg`; a
/// traceback after them). Any other message is returned as it is.
fn most_specific(message: &str) -> String {
    let lines: Vec<&str> = message
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with("For further information"))
        .take_while(|line| !line.starts_with("File \"") && !line.starts_with("Traceback"))
        .collect();
    let Some((heading, rest)) = lines.split_first() else {
        return message.to_owned();
    };
    let is_heading = heading
        .split_once(' ')
        .is_some_and(|(n, tail)| n.parse::<u32>().is_ok() && tail.starts_with("validation error"));
    if !is_heading || rest.is_empty() {
        return message.to_owned();
    }
    // (type, location, message) of each error.
    let errors: Vec<(String, String, String)> = if rest.iter().all(|line| line.starts_with('{')) {
        rest.iter().filter_map(|line| python_error(line)).collect()
    } else {
        rest.chunks(2)
            .filter_map(|pair| match pair {
                [location, error] => {
                    let kind = error
                        .split_once("[type=")
                        .and_then(|(_, tail)| tail.split([',', ']']).next())
                        .unwrap_or_default();
                    Some((kind.to_owned(), (*location).to_owned(), (*error).to_owned()))
                }
                _ => None,
            })
            .collect()
    };
    let telling =
        |(kind, _, _): &&(String, String, String)| kind != "literal_error" && kind != "missing";
    let Some((_, location, error)) = errors.iter().find(telling).or_else(|| errors.first()) else {
        return message.to_owned();
    };
    format!("{}: {location}: {error}", heading.trim_end_matches(':'))
}

/// `type`, `loc` (dot-joined) and `msg` of one error printed as a Python dict, e.g.
/// `{'type': 'string_type', 'loc': ('body', 'messages', 1, 'content'), 'msg': 'Input should be
/// a valid string', 'input': None}`.
fn python_error(line: &str) -> Option<(String, String, String)> {
    /// The Python string literal at the start of `text` (quoted with `'` or `"`).
    fn literal(text: &str) -> Option<&str> {
        let quote = text.chars().next().filter(|c| *c == '\'' || *c == '"')?;
        let body = text.get(1..)?;
        body.find(quote).and_then(|end| body.get(..end))
    }
    let after = |key: &str| line.split_once(&format!("'{key}': ")).map(|(_, tail)| tail);
    let kind = literal(after("type")?)?;
    let msg = literal(after("msg")?)?;
    let loc = after("loc")
        .and_then(|tail| tail.strip_prefix('('))
        .and_then(|tail| tail.split_once(')'))
        .map(|(inside, _)| {
            inside
                .split(", ")
                .map(|part| part.trim_matches(['\'', '"']))
                .filter(|part| !part.is_empty())
                .collect::<Vec<_>>()
                .join(".")
        })
        .unwrap_or_default();
    Some((kind.to_owned(), loc, msg.to_owned()))
}

/// FastAPI's `{"detail": [{"loc": […], "msg": "…"}, …]}` (a `422`): the first error as
/// `loc: msg`.
fn fastapi_detail(detail: &Value) -> Option<String> {
    let first = detail.as_array()?.first()?;
    let message = first.get("msg")?.as_str()?;
    let location = first
        .get("loc")
        .and_then(Value::as_array)
        .map(|parts| {
            parts
                .iter()
                .map(|part| match part {
                    Value::String(text) => text.clone(),
                    other => other.to_string(),
                })
                .collect::<Vec<_>>()
                .join(".")
        })
        .unwrap_or_default();
    Some(format!("validation error: {location}: {message}"))
}

/// The class of an error answer: by HTTP status when there is one, else by the error's
/// `code`/`type` (in-stream errors). A `5xx` whose body states a validation failure is
/// `invalid_request` (deterministic: never retried).
fn classify(status: Option<u16>, detail: &ErrorDetail) -> ErrorClass {
    match status.or(detail.status) {
        Some(500..=599) if detail.states_validation_failure() => ErrorClass::InvalidRequest,
        Some(401 | 403) => ErrorClass::Auth,
        Some(429) => ErrorClass::RateLimited,
        Some(503 | 529) => ErrorClass::Overloaded,
        Some(408) => ErrorClass::Timeout,
        // 413: the server, or a proxy in front of it, refuses the request's size.
        Some(413) => ErrorClass::ContextLengthExceeded,
        Some(400 | 404 | 422 | 500) if detail.is_context_length() => {
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

/// The keys [`request_body`] writes itself or models, which `provider_options` may not set
/// (see [`super::owned_keys`]).
pub const OWNED_KEYS: &[&str] = &[
    "model",
    "messages",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "n",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "parallel_tool_calls",
];

/// The JSON body of a streaming Chat Completions request. The instructions are a first
/// message of the configured `instructions_role` (`system` or `developer`; with `system`, the
/// context's leading system messages are joined into it, blank-line separated); the output limit
/// goes in the configured `max_tokens_field`; `temperature`, `top_p`, `stop`, `seed` when set,
/// `parallel_tool_calls` when set and tools are offered (the API refuses it without tools);
/// a `tool_choice` naming the only tool offered as `"required"` unless `forced_tool_choice`
/// is `named`; `reasoning_effort` when configured; then `provider_options`, except [`OWNED_KEYS`]; then
/// the run's output schema as `response_format` (`json_schema`, see `provider::structured`).
/// Assistant messages with neither text nor tool calls (nor reasoning to replay) are left
/// out: the API rejects them.
fn request_body(request: &ModelRequest, options: &Options) -> Value {
    let mut body = Map::new();
    body.insert("model".to_owned(), json!(request.model));
    let replay = replayed_reasoning(&request.messages, options.reasoning_replay);
    let instructions = request
        .instructions
        .as_deref()
        .filter(|text| !text.is_empty());
    // With `system` instructions, they and the system messages that open the context (a
    // compaction's summary among them) go as one first `system` message: many
    // OpenAI-compatible servers' chat templates take only one, at the start (a second one
    // fails the request, e.g. "roles must alternate").
    let leading = match options.instructions_role {
        InstructionsRole::System => request
            .messages
            .iter()
            .take_while(|message| message.role == Role::System)
            .count(),
        InstructionsRole::Developer => 0,
    };
    let system_text: Vec<String> = instructions
        .map(str::to_owned)
        .into_iter()
        .chain(
            request.messages[..leading]
                .iter()
                .map(|message| text_of(&message.content)),
        )
        .filter(|text| !text.is_empty())
        .collect();
    let first = (!system_text.is_empty()).then(
        || json!({"role": options.instructions_role.as_str(), "content": system_text.join("\n\n")}),
    );
    let messages = first
        .into_iter()
        .chain(
            request
                .messages
                .iter()
                .zip(replay)
                .skip(leading)
                .filter_map(|(message, replay)| message_json(message, replay, options)),
        )
        .collect();
    body.insert("messages".to_owned(), Value::Array(messages));
    if let Some(temperature) = request.temperature {
        body.insert("temperature".to_owned(), json!(temperature));
    }
    if let Some(top_p) = request.top_p {
        body.insert("top_p".to_owned(), json!(top_p));
    }
    if !request.stop.is_empty() {
        body.insert("stop".to_owned(), json!(request.stop));
    }
    if let Some(seed) = request.seed {
        body.insert("seed".to_owned(), json!(seed));
    }
    body.insert("stream".to_owned(), json!(true));
    body.insert("stream_options".to_owned(), json!({"include_usage": true}));
    if let Some(max) = request.max_output_tokens {
        let field = match options.max_tokens_field {
            MaxTokensField::MaxTokens => "max_tokens",
            MaxTokensField::MaxCompletionTokens => "max_completion_tokens",
        };
        body.insert(field.to_owned(), json!(max));
    }
    if let Some(effort) = options.reasoning_effort {
        body.insert("reasoning_effort".to_owned(), json!(effort.as_str()));
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
            // The only tool offered: "required" says the same, and is the one forcing form
            // llama-server reads (it takes `tool_choice` as a string only, b11434).
            ToolChoice::Tool { name }
                if options.forced_tool_choice == ForcedToolChoice::Required
                    && matches!(request.tools.as_slice(), [only] if only.name == *name) =>
            {
                json!("required")
            }
            ToolChoice::Tool { name } => json!({"type": "function", "function": {"name": name}}),
        };
        body.insert("tool_choice".to_owned(), choice);
        if let Some(parallel) = request.parallel_tool_calls {
            body.insert("parallel_tool_calls".to_owned(), json!(parallel));
        }
    }
    super::merge_options(&mut body, &request.provider_options, OWNED_KEYS);
    if let Some(output) = &request.output {
        body.insert(super::structured::OPENAI_KEY.to_owned(), output.openai());
    }
    Value::Object(body)
}

/// For each message, whether its reasoning goes back as `reasoning_content`: never (`none`);
/// for the assistant messages between two user messages when one of them has tool calls
/// (`tool_turns`, what DeepSeek's thinking mode requires); for every assistant message
/// (`all`).
fn replayed_reasoning(messages: &[Message], replay: ReasoningReplay) -> Vec<bool> {
    let assistant = |m: &Message| m.role == Role::Assistant && !m.reasoning.is_empty();
    match replay {
        ReasoningReplay::None => vec![false; messages.len()],
        ReasoningReplay::All => messages.iter().map(assistant).collect(),
        ReasoningReplay::ToolTurns => {
            let mut out = vec![false; messages.len()];
            for turn in messages
                .iter()
                .enumerate()
                .collect::<Vec<_>>()
                .split(|(_, m)| m.role == Role::User)
            {
                if turn
                    .iter()
                    .any(|(_, m)| m.role == Role::Assistant && !m.tool_calls.is_empty())
                {
                    for (i, m) in turn {
                        if let Some(slot) = out.get_mut(*i) {
                            *slot = assistant(m);
                        }
                    }
                }
            }
            out
        }
    }
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

/// A message as the API takes it; `None` for an assistant message with nothing to send.
fn message_json(message: &Message, replay_reasoning: bool, options: &Options) -> Option<Value> {
    Some(match message.role {
        Role::System | Role::User => json!({
            "role": message.role.as_str(),
            "content": rich_content(&message.content),
        }),
        Role::Assistant => {
            let text = text_of(&message.content);
            let reasoning: String = message
                .reasoning
                .iter()
                .map(|block| block.text.as_str())
                .collect();
            let replay = replay_reasoning && !reasoning.is_empty();
            if text.is_empty() && message.tool_calls.is_empty() && !replay {
                return None;
            }
            let mut object = Map::new();
            object.insert("role".to_owned(), json!("assistant"));
            if !text.is_empty() || message.tool_calls.is_empty() {
                object.insert("content".to_owned(), Value::String(text));
            } else {
                match options.assistant_tool_call_content {
                    AssistantToolCallContent::Null => {
                        object.insert("content".to_owned(), Value::Null);
                    }
                    AssistantToolCallContent::Empty => {
                        object.insert("content".to_owned(), json!(""));
                    }
                    AssistantToolCallContent::Omit => {}
                }
            }
            if replay {
                object.insert("reasoning_content".to_owned(), Value::String(reasoning));
            }
            if !message.tool_calls.is_empty() {
                // Arguments that were not valid JSON went back as `{}` (see
                // `ToolCall::invalid_arguments`): servers that parse them accept the request.
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
    })
}

// ---------------------------------------------------------------------------------------------
// Response stream

/// Parses a Chat Completions event stream (the raw response body, in reads of any size) into
/// [`ModelEvent`]s: text, reasoning and tool-call events as they arrive, then one
/// `ReasoningCompleted` when the model reasoned, at most one `Usage` and exactly one
/// `Finished`.
///
/// What servers really send, and what comes of it:
/// - `reasoning_content` (DeepSeek, vLLM, llama.cpp) or `reasoning` (OpenRouter, Ollama,
///   newer vLLM) deltas are `ReasoningDelta`s, never text (when a delta has both, they are
///   the same text and `reasoning_content` is taken).
/// - A `refusal` delta is visible text, and the call finishes `content_filter`.
/// - Tool-call fragments are keyed by their `index` (by id, else the last call, when a server
///   sends none); a delta with both `tool_calls` and the legacy `function_call` (llama.cpp)
///   is read from `tool_calls` only; a name split over fragments is joined, a name repeated
///   whole in every fragment is kept once; a call starts when its name is known and its
///   arguments begin (or at the end). Ids are unique in the session (see [`CallIds`]).
/// - Every started call completes, also when cut by `length`: with arguments that are not
///   valid JSON it carries them in `invalid_arguments` (see [`parse_arguments`]).
/// - Usage: `prompt_tokens`, `completion_tokens`, `completion_tokens_details.reasoning_tokens`,
///   `prompt_tokens_details.cached_tokens`; no `Usage` event when the server reported none
///   (or only zeros).
/// - `[DONE]` or a clean end of the body without a finish reason: `Finished(Unknown)` (a
///   server that interrupted the generation), `ToolCalls` when calls completed.
///
/// The stream ends after the first error: an `{"error": …}` chunk (classified like an HTTP
/// error), a malformed chunk (`server`), a read error (its class; a cut connection is
/// `transport`) or a body without any event (`server`).
pub fn parse_stream<S, B, E>(provider: &str, bytes: S) -> ModelStream
where
    S: Stream<Item = Result<B, E>> + Send + 'static,
    B: AsRef<[u8]> + Send + 'static,
    E: Into<ReadError> + Send + 'static,
{
    sse::parse(bytes, Parser::new(provider, CallIds::default()))
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
    /// DeepSeek, vLLM, llama.cpp.
    #[serde(default)]
    reasoning_content: Option<String>,
    /// OpenRouter, Ollama, newer vLLM.
    #[serde(default)]
    reasoning: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
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
    #[serde(default)]
    completion_tokens_details: Option<CompletionTokensDetails>,
}

#[derive(Debug, Deserialize)]
struct PromptTokensDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct CompletionTokensDetails {
    #[serde(default)]
    reasoning_tokens: Option<u64>,
}

/// A tool call being assembled from fragments.
#[derive(Debug, Default)]
struct PendingCall {
    index: Option<u64>,
    /// The id the provider sent (possibly empty); `id` is the one the call gets.
    provider_id: String,
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
    ids: CallIds,
    calls: Vec<PendingCall>,
    last_call: Option<usize>,
    reasoning: String,
    refused: bool,
    finish: Option<FinishReason>,
    usage: Option<(TokenUsage, Option<CacheMetrics>)>,
    completed: usize,
}

impl Parser {
    fn new(provider: &str, ids: CallIds) -> Self {
        Self {
            provider: provider.to_owned(),
            ids,
            calls: Vec::new(),
            last_call: None,
            reasoning: String::new(),
            refused: false,
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
                    && id.is_none_or(|id| call.provider_id.is_empty() || call.provider_id == id)
            }),
            None => match id {
                Some(id) => self
                    .calls
                    .iter()
                    .position(|call| open(call) && call.provider_id == id),
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
            && call.provider_id.is_empty()
        {
            id.clone_into(&mut call.provider_id);
        }
        let function = fragment.function.unwrap_or_default();
        if let Some(name) = function.name.filter(|n| !n.is_empty()) {
            if call.name.is_empty() {
                call.name = name;
            } else if !call.started && name != call.name {
                // A name split over fragments; a name repeated whole is kept once.
                call.name.push_str(&name);
            }
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
        if !call.started && !call.name.is_empty() && !call.arguments.is_empty() {
            start(call, &mut self.ids, out);
        }
        emit_arguments(call, out);
    }

    /// Completes every open call (its arguments parsed, or kept raw in `invalid_arguments`);
    /// a call whose name never came cannot be answered and is dropped (it never started).
    fn close_calls(&mut self, out: &mut Out) {
        for call in &mut self.calls {
            if call.closed {
                continue;
            }
            call.closed = true;
            if call.name.is_empty() {
                tracing::warn!(
                    provider = %self.provider,
                    call_id = %call.provider_id,
                    argument_bytes = call.arguments.len(),
                    "tool call without a name dropped"
                );
                continue;
            }
            if !call.started {
                start(call, &mut self.ids, out);
                emit_arguments(call, out);
            }
            let (arguments, invalid_arguments) = parse_arguments(&call.arguments);
            if invalid_arguments.is_some() {
                tracing::warn!(
                    provider = %self.provider,
                    call_id = %call.id,
                    tool = %call.name,
                    argument_bytes = call.arguments.len(),
                    "tool call arguments are not a JSON object"
                );
            }
            self.completed += 1;
            out.push_back(Ok(ModelEvent::ToolCallCompleted(ToolCall {
                invalid_arguments,
                id: call.id.clone(),
                name: call.name.clone(),
                arguments,
            })));
        }
    }

    fn on_usage(&mut self, usage: Usage) {
        let input = usage.prompt_tokens.unwrap_or(0);
        let output = usage.completion_tokens.unwrap_or(0);
        if input == 0 && output == 0 {
            // Servers that ignore `include_usage` but send a zeroed object: not a report.
            return;
        }
        let tokens = TokenUsage {
            reasoning_tokens: usage
                .completion_tokens_details
                .and_then(|details| details.reasoning_tokens)
                .unwrap_or(0),
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

    fn on_delta(&mut self, delta: Delta, out: &mut Out) {
        let reasoning = delta
            .reasoning_content
            .filter(|t| !t.is_empty())
            .or(delta.reasoning.filter(|t| !t.is_empty()));
        if let Some(reasoning) = reasoning {
            self.reasoning.push_str(&reasoning);
            out.push_back(Ok(ModelEvent::ReasoningDelta(reasoning)));
        }
        if let Some(text) = delta.content.filter(|t| !t.is_empty()) {
            out.push_back(Ok(ModelEvent::TextDelta(text)));
        }
        if let Some(refusal) = delta.refusal.filter(|t| !t.is_empty()) {
            self.refused = true;
            out.push_back(Ok(ModelEvent::TextDelta(refusal)));
        }
        let fragments = delta.tool_calls.unwrap_or_default();
        if fragments.is_empty() {
            if let Some(function) = delta.function_call {
                self.on_fragment(
                    Fragment {
                        function: Some(function),
                        ..Fragment::default()
                    },
                    out,
                );
            }
        } else {
            // llama.cpp's server repeats the call as `function_call` in the same delta.
            for fragment in fragments {
                self.on_fragment(fragment, out);
            }
        }
    }
}

/// Starts a call: its unique id, then `ToolCallStarted`.
fn start(call: &mut PendingCall, ids: &mut CallIds, out: &mut Out) {
    call.started = true;
    call.id = ids.assign(&call.provider_id);
    out.push_back(Ok(ModelEvent::ToolCallStarted {
        call_id: call.id.clone(),
        tool_name: call.name.clone(),
    }));
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
            self.on_usage(usage);
        }
        for choice in chunk.choices.unwrap_or_default() {
            if choice.index.unwrap_or(0) != 0 {
                continue;
            }
            if let Some(delta) = choice.delta {
                self.on_delta(delta, out);
            }
            if let Some(reason) = choice.finish_reason.filter(|r| !r.is_empty()) {
                self.finish = Some(finish_reason(&reason));
                self.close_calls(out);
            }
        }
        Step::Continue
    }

    /// A clean end without `[DONE]` after a finish reason is the normal end (some servers
    /// leave `[DONE]` out); without either, the server (or a proxy) closed the stream midway:
    /// a `transport` error, retried when nothing was shown yet, never a completed answer.
    fn end_of_body(&mut self, out: &mut Out) {
        if self.finish.is_some() {
            self.finish_events(out);
        } else {
            out.push_back(Err(self.error(
                ErrorClass::Transport,
                "the stream ended without `[DONE]` or a finish reason (closed midway)",
            )));
        }
    }

    fn finish_events(&mut self, out: &mut Out) {
        self.close_calls(out);
        if !self.reasoning.is_empty() {
            out.push_back(Ok(ModelEvent::ReasoningCompleted(Reasoning {
                text: std::mem::take(&mut self.reasoning),
                signature: None,
                redacted_data: None,
            })));
        }
        if let Some((usage, cache)) = self.usage.take() {
            out.push_back(Ok(ModelEvent::Usage { usage, cache }));
        }
        let reason = if self.refused {
            FinishReason::ContentFilter
        } else {
            sse::final_reason(self.finish, self.completed)
        };
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
