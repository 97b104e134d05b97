//! A fake model provider for integration tests: a real HTTP server on `127.0.0.1:0` that
//! answers `POST /v1/chat/completions` (OpenAI) and `POST /v1/messages` (Anthropic, see
//! `fake_anthropic`) with scripted replies in the real wire formats (recorded SSE streams,
//! error bodies, stalls, cut connections) from one queue, and records every request it gets;
//! and the calls the adapter tests make through a provider against it.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::Response;
use axum::routing::post;
use behest::config::TimeoutConfig;
use behest::domain::{ContentPart, Message, MessageId, Role, RunId, SessionId};
use behest::provider::{ModelEvent, ModelRequest, Provider, ProviderError};
use chrono::Utc;
use futures::stream::BoxStream;
use futures::{StreamExt, stream};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

/// Pause between two pieces of a split body, so they arrive in separate reads (20 ms).
pub const PIECE_DELAY: Duration = Duration::from_millis(20);

/// Model name the fake's streams report.
pub const MODEL: &str = "gpt-4o-mini-2024-07-18";

/// A request the fake received.
#[derive(Debug, Clone)]
pub struct RecordedRequest {
    /// Its path, e.g. `/v1/chat/completions` or `/v1/messages`.
    pub path: String,
    /// Its HTTP headers (including `authorization`).
    pub headers: HeaderMap,
    /// Its JSON body (`Value::Null` when the body was not JSON).
    pub body: Value,
}

/// How a reply's body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// The body ends normally.
    Complete,
    /// The connection stays open and nothing more is sent.
    Stall,
    /// The connection is cut (the body errors out, so the chunked body is never terminated).
    Cut,
}

/// One scripted answer to a `POST /v1/chat/completions`.
#[derive(Debug, Clone)]
pub struct Reply {
    status: u16,
    content_type: &'static str,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Byte offsets where the body is cut into separate writes.
    cuts: Vec<usize>,
    /// Cut every `n` bytes instead (0: not used).
    every: usize,
    delay: Duration,
    ending: Ending,
}

impl Reply {
    fn new(status: u16, content_type: &'static str, body: Vec<u8>, ending: Ending) -> Self {
        Self {
            status,
            content_type,
            headers: Vec::new(),
            body,
            cuts: Vec::new(),
            every: 0,
            delay: PIECE_DELAY,
            ending,
        }
    }

    /// A `200 text/event-stream` answer with this exact body.
    pub fn sse(bytes: &[u8]) -> Self {
        Self::new(200, "text/event-stream", bytes.to_vec(), Ending::Complete)
    }

    /// An error answer: `code` with this JSON body (`application/json`).
    pub fn status(code: u16, body: Value) -> Self {
        Self::new(
            code,
            "application/json",
            body.to_string().into_bytes(),
            Ending::Complete,
        )
    }

    /// An answer with this status, content type and exact body (e.g. an HTML page, or a JSON
    /// completion where a stream was asked for).
    pub fn raw(status: u16, content_type: &'static str, bytes: &[u8]) -> Self {
        Self::new(status, content_type, bytes.to_vec(), Ending::Complete)
    }

    /// A `200 text/event-stream` answer that sends `bytes`, then keeps the connection open and
    /// sends nothing more.
    pub fn stall_after(bytes: &[u8]) -> Self {
        Self::new(200, "text/event-stream", bytes.to_vec(), Ending::Stall)
    }

    /// A `200 text/event-stream` answer that sends `bytes`, then cuts the connection (no
    /// `[DONE]`, no end of the chunked body).
    pub fn close_after(bytes: &[u8]) -> Self {
        Self::new(200, "text/event-stream", bytes.to_vec(), Ending::Cut)
    }

    /// Writes the body in separate pieces cut at these byte offsets, [`PIECE_DELAY`] apart.
    #[must_use]
    pub fn split_at(mut self, offsets: Vec<usize>) -> Self {
        self.cuts = offsets;
        self
    }

    /// Writes the body in pieces of `n` bytes, [`PIECE_DELAY`] apart.
    #[must_use]
    pub fn chunks_every(mut self, n: usize) -> Self {
        self.every = n;
        self
    }

    /// Sets the pause between pieces (default [`PIECE_DELAY`]).
    #[must_use]
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Adds a response header, e.g. `retry-after: 3`.
    #[must_use]
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// The body cut into the pieces written one by one.
    fn pieces(&self) -> Vec<Vec<u8>> {
        let len = self.body.len();
        let mut cuts: Vec<usize> = if self.every > 0 {
            (self.every..len).step_by(self.every).collect()
        } else {
            self.cuts
                .iter()
                .copied()
                .filter(|&c| c > 0 && c < len)
                .collect()
        };
        cuts.sort_unstable();
        cuts.dedup();
        let mut pieces = Vec::new();
        let mut start = 0;
        for cut in cuts.into_iter().chain([len]) {
            if let Some(piece) = self.body.get(start..cut) {
                pieces.push(piece.to_vec());
            }
            start = cut;
        }
        pieces
    }

    fn into_response(self, shared: Arc<Shared>) -> Response {
        let pieces = self.pieces();
        let delay = self.delay;
        let written =
            stream::iter(pieces.into_iter().enumerate()).then(move |(i, piece)| async move {
                if i > 0 {
                    tokio::time::sleep(delay).await;
                }
                Ok::<_, std::io::Error>(piece)
            });
        let body: BoxStream<'static, Result<Vec<u8>, std::io::Error>> = match self.ending {
            Ending::Complete => written.boxed(),
            Ending::Stall => written.chain(stream::pending()).boxed(),
            Ending::Cut => written
                .chain(stream::once(async move {
                    tokio::time::sleep(delay).await;
                    Err(std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        "fake provider cut the connection",
                    ))
                }))
                .boxed(),
        };
        let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let guard = Abandon(shared, ended.clone());
        let body = body.chain(stream::poll_fn(move |_| {
            let _owned = &guard;
            ended.store(true, std::sync::atomic::Ordering::SeqCst);
            std::task::Poll::Ready(None)
        }));
        let mut response = Response::new(Body::from_stream(body));
        *response.status_mut() =
            StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(self.content_type),
        );
        if self.content_type == "text/event-stream" {
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        }
        for (name, value) in &self.headers {
            if let (Ok(name), Ok(value)) = (
                HeaderName::try_from(name.as_str()),
                HeaderValue::try_from(value.as_str()),
            ) {
                headers.insert(name, value);
            }
        }
        response
    }
}

/// Chooses the reply to a request (`None`: the queue's next reply, else the default).
type ResponderFn = dyn Fn(&RecordedRequest) -> Option<Reply> + Send + Sync;

#[derive(Clone)]
struct Responder(Arc<ResponderFn>);

impl std::fmt::Debug for Responder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Responder")
    }
}

#[derive(Debug, Default)]
struct Shared {
    replies: Mutex<VecDeque<Reply>>,
    responder: Mutex<Option<Responder>>,
    requests: Mutex<Vec<RecordedRequest>>,
    /// Response bodies dropped before they ended: the client closed the connection.
    abandoned: std::sync::atomic::AtomicUsize,
    /// The context window enforced, in tokens (see [`FakeOpenAi::with_context_window`]).
    window: Mutex<Option<u64>>,
    /// Requests refused for not fitting the window.
    rejected: std::sync::atomic::AtomicUsize,
}

/// Counts a body as abandoned when it is dropped before its end.
struct Abandon(Arc<Shared>, Arc<std::sync::atomic::AtomicBool>);

impl Drop for Abandon {
    fn drop(&mut self) {
        if !self.1.load(std::sync::atomic::Ordering::SeqCst) {
            self.0
                .abandoned
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The running fake server; stops when dropped.
#[derive(Debug)]
pub struct FakeOpenAi {
    addr: SocketAddr,
    shared: Arc<Shared>,
    server: JoinHandle<()>,
}

impl FakeOpenAi {
    /// Starts the server on `127.0.0.1:0`.
    ///
    /// # Panics
    /// When no local port can be bound (tests only).
    pub async fn start() -> Self {
        let shared = Arc::new(Shared::default());
        let app = Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/messages", post(messages))
            .with_state(Arc::clone(&shared));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local address");
        let server = tokio::spawn(async move {
            // The server runs until the helper is dropped; a serve error ends the test's
            // requests with transport errors, which the test then reports.
            let _ = axum::serve(listener, app).await;
        });
        Self {
            addr,
            shared,
            server,
        }
    }

    /// The API base URL, e.g. `http://127.0.0.1:PORT/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Queues a reply; replies are consumed one per request, in order.
    pub fn push(&self, reply: Reply) -> &Self {
        lock(&self.shared.replies).push_back(reply);
        self
    }

    /// Answers each request with what `responder` returns for it (e.g. by the conversation's
    /// first user message, for concurrent runs); when it returns `None`, the queue answers.
    pub fn respond_with(
        &self,
        responder: impl Fn(&RecordedRequest) -> Option<Reply> + Send + Sync + 'static,
    ) -> &Self {
        *lock(&self.shared.responder) = Some(Responder(Arc::new(responder)));
        self
    }

    /// Refuses, from now on, every request whose prompt ([`prompt_tokens`]) plus its output
    /// limit (`max_tokens` / `max_completion_tokens`) passes `window` tokens, with the error a
    /// real provider answers: OpenAI's 400 `context_length_exceeded`, Anthropic's 400 "prompt is
    /// too long" (or its "input length and `max_tokens` exceed context limit"). Refused requests
    /// are recorded too, and counted by [`FakeOpenAi::rejected`].
    pub fn with_context_window(&self, window: u64) -> &Self {
        *lock(&self.shared.window) = Some(window);
        self
    }

    /// How many requests were refused for not fitting the context window.
    pub fn rejected(&self) -> usize {
        self.shared
            .rejected
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many response bodies the client abandoned (closed the connection before their end).
    pub fn abandoned(&self) -> usize {
        self.shared
            .abandoned
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Every request received so far, in order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        lock(&self.shared.requests).clone()
    }
}

impl Drop for FakeOpenAi {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn chat_completions(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(&shared, "/v1/chat/completions", headers, &body, || {
        Reply::sse(&text_stream(&["Hel", "lo"]))
    })
}

async fn messages(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    answer(&shared, "/v1/messages", headers, &body, || {
        Reply::sse(&super::fake_anthropic::text_stream(&["Hel", "lo"]))
    })
}

/// Records the request and answers with the next queued reply, else `default()`.
fn answer(
    shared: &Arc<Shared>,
    path: &str,
    headers: HeaderMap,
    body: &[u8],
    default: impl FnOnce() -> Reply,
) -> Response {
    let body = serde_json::from_slice(body).unwrap_or(Value::Null);
    let request = RecordedRequest {
        path: path.to_owned(),
        headers,
        body,
    };
    lock(&shared.requests).push(request.clone());
    if let Some(refusal) = window_refusal(shared, &request) {
        return refusal.into_response(Arc::clone(shared));
    }
    let responder = lock(&shared.responder).clone();
    let reply = responder
        .and_then(|responder| (responder.0)(&request))
        .or_else(|| lock(&shared.replies).pop_front())
        .unwrap_or_else(default);
    reply.into_response(Arc::clone(shared))
}

/// A base URL where nothing listens (a port bound and released), for connection failures.
pub async fn refused_base_url() -> String {
    let port = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
        Ok(listener) => listener.local_addr().map(|a| a.port()).unwrap_or(9),
        Err(_) => 9,
    };
    format!("http://127.0.0.1:{port}/v1")
}

/// A recorded fixture of `tests/fixtures/openai/`, e.g. `fixture("text.sse")`.
///
/// # Panics
/// When the file is missing (tests only).
pub fn fixture(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/openai")
        .join(name);
    std::fs::read(&path).expect("fixture exists")
}

/// One `data:` line of a `chat.completion.chunk` with one choice.
pub fn chunk(delta: Value, finish_reason: Option<&str>) -> String {
    sse_data(&json!({
        "id": "chatcmpl-fake0001",
        "object": "chat.completion.chunk",
        "created": 1_741_569_952,
        "model": MODEL,
        "system_fingerprint": "fp_fake",
        "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
        "usage": null,
    }))
}

/// The usage-only chunk OpenAI sends last with `stream_options.include_usage`.
pub fn usage_chunk(prompt_tokens: u64, completion_tokens: u64, cached_tokens: u64) -> String {
    sse_data(&json!({
        "id": "chatcmpl-fake0001",
        "object": "chat.completion.chunk",
        "created": 1_741_569_952,
        "model": MODEL,
        "system_fingerprint": "fp_fake",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
        },
    }))
}

/// `data: <json>` and the blank line ending the event.
pub fn sse_data(value: &Value) -> String {
    format!("data: {value}\n\n")
}

/// The terminating `data: [DONE]` event.
pub const DONE: &str = "data: [DONE]\n\n";

/// A complete text answer: a role chunk, one chunk per delta, a `stop` chunk, a usage chunk
/// (10 prompt tokens, one completion token per delta) and `[DONE]`.
pub fn text_stream(deltas: &[&str]) -> Vec<u8> {
    let mut body = chunk(
        json!({"role": "assistant", "content": "", "refusal": null}),
        None,
    );
    for delta in deltas {
        body.push_str(&chunk(json!({"content": delta}), None));
    }
    body.push_str(&chunk(json!({}), Some("stop")));
    body.push_str(&usage_chunk(10, deltas.len() as u64, 0));
    body.push_str(DONE);
    body.into_bytes()
}

/// A complete answer in which the model calls tools: `(call id, tool name, arguments)`, each
/// call's arguments streamed in two fragments, then `finish_reason: tool_calls`, usage and
/// `[DONE]`.
pub fn tool_calls_stream(calls: &[(&str, &str, Value)]) -> Vec<u8> {
    let mut body = chunk(json!({"role": "assistant", "content": null}), None);
    for (index, (id, name, arguments)) in calls.iter().enumerate() {
        let text = arguments.to_string();
        let (head, tail) = text.split_at(text.len() / 2);
        body.push_str(&chunk(
            json!({"tool_calls": [{"index": index, "id": id, "type": "function",
                                   "function": {"name": name, "arguments": head}}]}),
            None,
        ));
        body.push_str(&chunk(
            json!({"tool_calls": [{"index": index, "function": {"arguments": tail}}]}),
            None,
        ));
    }
    body.push_str(&chunk(json!({}), Some("tool_calls")));
    body.push_str(&usage_chunk(20, 8, 0));
    body.push_str(DONE);
    body.into_bytes()
}

// ---------------------------------------------------------------------------------------------
// Calls through an adapter

/// Deadlines long enough never to fire in a passing test: connect 2 s, first byte and idle
/// 5 s, total 30 s.
pub fn timeouts() -> TimeoutConfig {
    TimeoutConfig {
        connect_ms: 2_000,
        first_byte_ms: 5_000,
        idle_ms: 5_000,
        total_ms: 30_000,
    }
}

/// A message of a fresh run with one text part.
pub fn message(role: Role, text: &str) -> Message {
    Message {
        reasoning: Vec::new(),
        id: MessageId::new(),
        session_id: SessionId::new(),
        run_id: RunId::new(),
        role,
        content: vec![ContentPart::Text {
            text: text.to_owned(),
        }],
        tool_calls: Vec::new(),
        tool_call_id: None,
        tool_name: None,
        created_at: Utc::now(),
        status: Default::default(),
    }
}

/// The events of one call up to its first error, and that error.
pub async fn run(
    provider: &dyn Provider,
    request: ModelRequest,
) -> Result<(Vec<ModelEvent>, Option<ProviderError>), ProviderError> {
    let mut stream = provider.stream(request).await?;
    let mut events = Vec::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => events.push(event),
            Err(error) => return Ok((events, Some(error))),
        }
    }
    Ok((events, None))
}

/// The error of a call that fails before or during its stream.
pub async fn failure(provider: &dyn Provider, request: ModelRequest) -> Option<ProviderError> {
    match run(provider, request).await {
        Err(error) => Some(error),
        Ok((_, error)) => error,
    }
}

/// Concatenated text deltas.
pub fn text_of(events: &[ModelEvent]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            ModelEvent::TextDelta(t) => Some(t.as_str()),
            _ => None,
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The context window

/// The prompt tokens the fake counts for a request (`o200k_base`, over the wire JSON, roughly as
/// a server renders a chat template): per message 4 tokens, the role, the text (strings and
/// text parts or blocks), tool calls and tool uses as their JSON, tool results; the system
/// prompt; the tools' JSON; 3 tokens priming the reply.
pub fn prompt_tokens(body: &Value) -> u64 {
    let count = |text: &str| behest::runtime::tokens::count_text(text);
    let content = |content: &Value| -> u64 {
        match content {
            Value::String(text) => count(text),
            Value::Array(blocks) => blocks
                .iter()
                .map(|block| match block["type"].as_str() {
                    Some("text") => count(block["text"].as_str().unwrap_or_default()),
                    Some("thinking") => count(block["thinking"].as_str().unwrap_or_default()),
                    Some("tool_use") => {
                        count(block["name"].as_str().unwrap_or_default())
                            + count(&block["input"].to_string())
                    }
                    Some("tool_result") => match &block["content"] {
                        Value::String(text) => count(text),
                        other => count(&other.to_string()),
                    },
                    _ => count(&block.to_string()),
                })
                .sum(),
            Value::Null => 0,
            other => count(&other.to_string()),
        }
    };
    let mut tokens = 3;
    if let Some(system) = body.get("system") {
        tokens += 4 + content(system);
    }
    for message in body["messages"].as_array().into_iter().flatten() {
        tokens += 4 + count(message["role"].as_str().unwrap_or_default());
        tokens += content(&message["content"]);
        if let Some(calls) = message.get("tool_calls") {
            tokens += count(&calls.to_string());
        }
        if let Some(id) = message["tool_call_id"].as_str() {
            tokens += count(id);
        }
    }
    if let Some(tools) = body.get("tools") {
        tokens += count(&tools.to_string());
    }
    tokens
}

/// The output limit a request asks for.
fn max_output(body: &Value) -> u64 {
    ["max_tokens", "max_completion_tokens"]
        .iter()
        .find_map(|key| body[*key].as_u64())
        .unwrap_or(0)
}

/// The provider's refusal of a request that does not fit the enforced window, if one is set.
fn window_refusal(shared: &Shared, request: &RecordedRequest) -> Option<Reply> {
    let window = (*lock(&shared.window))?;
    let prompt = prompt_tokens(&request.body);
    let output = max_output(&request.body);
    if prompt + output <= window {
        return None;
    }
    shared
        .rejected
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    Some(if request.path == "/v1/messages" {
        let message = if prompt > window {
            format!("prompt is too long: {prompt} tokens > {window} maximum")
        } else {
            format!(
                "input length and `max_tokens` exceed context limit: {prompt} + {output} > \
                 {window}, decrease input length or `max_tokens` and try again"
            )
        };
        Reply::status(
            400,
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": message},
                   "request_id": "req_011CRfake0000000000000001"}),
        )
    } else {
        let message = format!(
            "This model's maximum context length is {window} tokens. However, you requested {} \
             tokens ({prompt} in the messages, {output} in the completion). Please reduce the \
             length of the messages or completion.",
            prompt + output
        );
        Reply::status(
            400,
            json!({"error": {"message": message, "type": "invalid_request_error",
                             "param": "messages", "code": "context_length_exceeded"}}),
        )
    })
}

/// Like [`text_stream`], reporting `prompt_tokens` (e.g. [`prompt_tokens`] of the request) as
/// the usage's prompt tokens.
pub fn text_stream_with_usage(deltas: &[&str], prompt_tokens: u64) -> Vec<u8> {
    let mut body = chunk(
        json!({"role": "assistant", "content": "", "refusal": null}),
        None,
    );
    for delta in deltas {
        body.push_str(&chunk(json!({"content": delta}), None));
    }
    body.push_str(&chunk(json!({}), Some("stop")));
    body.push_str(&usage_chunk(prompt_tokens, deltas.len() as u64, 0));
    body.push_str(DONE);
    body.into_bytes()
}

/// Like [`tool_calls_stream`], reporting `prompt_tokens` as the usage's prompt tokens.
pub fn tool_calls_stream_with_usage(calls: &[(&str, &str, Value)], prompt_tokens: u64) -> Vec<u8> {
    let plain = String::from_utf8(tool_calls_stream(calls)).unwrap_or_default();
    plain
        .replace(&usage_chunk(20, 8, 0), &usage_chunk(prompt_tokens, 8, 0))
        .into_bytes()
}
