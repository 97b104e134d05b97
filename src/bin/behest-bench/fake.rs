//! The paced fake OpenAI Chat Completions provider: `POST /v1/chat/completions` answers every
//! streaming request with real `chat.completion.chunk` SSE — a role chunk with the first token
//! after the time to first token, one content chunk per token `interval` apart, a `stop` chunk,
//! a usage chunk when `stream_options.include_usage` is set, and `data: [DONE]`.
//!
//! Token `k` (from 1) is the text `" t{k}"`, so a reader can tell a lost, duplicated or
//! reordered token from the text alone. The usage's `prompt_tokens` is the request's
//! `o200k_base` count (4 per message, its text, 3 priming the reply), as a server would report
//! it: behest calibrates its context estimates by it. Every request is recorded in memory under its tag (the
//! text of its last user message): when it arrived, when each token was written, when the
//! body ended and whether it ended normally or because the client went away.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::serve::ListenerExt;
use serde_json::Value;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use crate::Result;

/// How a model streams: time to first token, interval between tokens, token count; a gated
/// profile waits until the bench opens its gate before the time to first token starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Profile {
    /// From the request's arrival (or the gate's opening) to the first token.
    pub ttft: Duration,
    /// Between two tokens.
    pub interval: Duration,
    /// Tokens per answer.
    pub tokens: u32,
    /// Whether requests wait for [`FakeProvider::open_gate`] first.
    pub gated: bool,
}

impl Profile {
    /// An ungated profile in ms.
    pub const fn ms(ttft: u64, interval: u64, tokens: u32) -> Self {
        Self {
            ttft: Duration::from_millis(ttft),
            interval: Duration::from_millis(interval),
            tokens,
            gated: false,
        }
    }

    /// The same profile, waiting for its gate.
    pub const fn gated(mut self) -> Self {
        self.gated = true;
        self
    }
}

/// The text of token `k` (from 1).
pub fn token_text(k: u32) -> String {
    format!(" t{k}")
}

/// What happened to one request, as the provider saw it.
#[derive(Debug, Clone, Default)]
pub struct ExchangeState {
    /// When each token was handed to the connection, token 1 first.
    pub token_sent: Vec<Instant>,
    /// When the body ended (normally or because the client went away).
    pub ended: Option<Instant>,
    /// Whether the body was written to the end (`[DONE]`).
    pub completed: bool,
    /// Bytes of the SSE body written.
    pub bytes: usize,
}

/// One request and what happened to it.
#[derive(Debug)]
pub struct Exchange {
    /// When the request arrived.
    pub received: Instant,
    state: Mutex<ExchangeState>,
    ended: Notify,
}

impl Exchange {
    fn state(&self) -> MutexGuard<'_, ExchangeState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A copy of what happened so far.
    pub fn snapshot(&self) -> ExchangeState {
        self.state().clone()
    }

    /// When the body ended, waiting at most `timeout` for it.
    pub async fn wait_ended(&self, timeout: Duration) -> Option<Instant> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.ended.notified();
            if let Some(ended) = self.state().ended {
                return Some(ended);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.state().ended;
            }
        }
    }
}

struct Shared {
    default: Profile,
    profiles: HashMap<String, Profile>,
    gates: HashMap<String, watch::Sender<bool>>,
    exchanges: Mutex<HashMap<String, Arc<Exchange>>>,
}

/// Requests kept in memory at most (the standalone server forgets older ones).
const MAX_RECORDED: usize = 200_000;

/// The running fake provider; stops when dropped.
pub struct FakeProvider {
    addr: SocketAddr,
    shared: Arc<Shared>,
    server: JoinHandle<()>,
}

impl FakeProvider {
    /// Serves on `bind` (e.g. `127.0.0.1:0`): `profiles` by model name, `default` for any
    /// other model.
    pub async fn start(
        bind: &str,
        default: Profile,
        profiles: HashMap<String, Profile>,
    ) -> Result<Self> {
        let gates = profiles
            .iter()
            .filter(|(_, profile)| profile.gated)
            .map(|(model, _)| (model.clone(), watch::channel(false).0))
            .collect();
        let shared = Arc::new(Shared {
            default,
            profiles,
            gates,
            exchanges: Mutex::new(HashMap::new()),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .with_state(shared.clone());
        // The prompt counts use the tokenizer: its tables load before the first request.
        tokio::task::spawn_blocking(|| behest::runtime::tokens::Tokenizer::O200k.warm_up())
            .await
            .map_err(|e| crate::BenchError(e.to_string()))?;
        let listener = tokio::net::TcpListener::bind(bind).await?;
        let addr = listener.local_addr()?;
        // Small SSE writes must leave at once: a model's tokens are never held back by Nagle.
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        // A make-service, as behest serves: a bare `Router` would be rebuilt per connection.
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app.into_make_service()).await;
        });
        Ok(Self {
            addr,
            shared,
            server,
        })
    }

    /// The OpenAI base URL, `http://ADDR/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Lets the gated requests of `model` go (and any that arrive while open).
    pub fn open_gate(&self, model: &str) {
        if let Some(gate) = self.shared.gates.get(model) {
            gate.send_replace(true);
        }
    }

    /// Holds later requests of `model` at the gate again.
    pub fn close_gate(&self, model: &str) {
        if let Some(gate) = self.shared.gates.get(model) {
            gate.send_replace(false);
        }
    }

    /// The request tagged `tag`, if one arrived.
    pub fn exchange(&self, tag: &str) -> Option<Arc<Exchange>> {
        lock(&self.shared.exchanges).get(tag).cloned()
    }

    /// Waits up to `timeout` for a request tagged `tag` to arrive.
    pub async fn wait_exchange(&self, tag: &str, timeout: Duration) -> Option<Arc<Exchange>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(exchange) = self.exchange(tag) {
                return Some(exchange);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Forgets every recorded request.
    pub fn clear(&self) {
        lock(&self.shared.exchanges).clear();
    }
}

impl Drop for FakeProvider {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The request's prompt tokens: per message 4, plus its text (`o200k_base`), plus 3 priming the
/// reply.
fn prompt_tokens(request: &Value) -> u64 {
    let messages = request["messages"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    3 + messages
        .iter()
        .map(|message| {
            let text = match &message["content"] {
                Value::String(text) => text.clone(),
                Value::Array(parts) => parts
                    .iter()
                    .filter_map(|part| part["text"].as_str())
                    .collect(),
                _ => String::new(),
            };
            4 + behest::runtime::tokens::count_text(&text)
        })
        .sum::<u64>()
}

/// The text of the last user message (`content` as a string or as text parts).
fn last_user_text(request: &Value) -> String {
    let Some(messages) = request["messages"].as_array() else {
        return String::new();
    };
    let Some(user) = messages.iter().rev().find(|m| m["role"] == "user") else {
        return String::new();
    };
    match &user["content"] {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| part["text"].as_str())
            .collect(),
        _ => String::new(),
    }
}

/// Request bodies up to this size (bytes) are parsed on the async worker that received them.
const READ_IN_PLACE: usize = 16 * 1024;

/// What the handler needs of a request body.
struct Read {
    stream: bool,
    model: String,
    include_usage: bool,
    prompt_tokens: u64,
    /// The last user message's text, which names the exchange.
    tag: String,
}

impl Read {
    /// `None` when the body is not JSON.
    fn of(body: &[u8]) -> Option<Self> {
        let request = serde_json::from_slice::<Value>(body).ok()?;
        Some(Self {
            stream: request["stream"] == true,
            model: request["model"].as_str().unwrap_or("fake-model").to_owned(),
            include_usage: request["stream_options"]["include_usage"] == true,
            prompt_tokens: prompt_tokens(&request),
            tag: last_user_text(&request),
        })
    }
}

fn error_response(status: StatusCode, message: &str) -> Response {
    let body = serde_json::json!({
        "error": {"message": message, "type": "invalid_request_error", "param": null, "code": null}
    });
    (status, axum::Json(body)).into_response()
}

async fn chat_completions(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let received = Instant::now();
    // Parsing and counting a long request (a 2,000-message session: ≈ 25 ms of `o200k_base`)
    // runs off the async workers: a real provider does it on its own machine, and here the
    // bench's driver reads behest's streams on those workers meanwhile. A short one is read
    // in place (a thread hop would cost more than it).
    let read = if body.len() > READ_IN_PLACE {
        tokio::task::spawn_blocking(move || Read::of(&body))
            .await
            .ok()
            .flatten()
    } else {
        Read::of(&body)
    };
    let Some(read) = read else {
        return error_response(StatusCode::BAD_REQUEST, "the body is not JSON");
    };
    let Read {
        stream,
        model,
        include_usage,
        prompt_tokens,
        tag,
    } = read;
    if !stream {
        return error_response(
            StatusCode::BAD_REQUEST,
            "this fake provider only streams: set \"stream\": true",
        );
    }
    let profile = shared
        .profiles
        .get(&model)
        .copied()
        .unwrap_or(shared.default);
    let gate = if profile.gated {
        shared.gates.get(&model).map(watch::Sender::subscribe)
    } else {
        None
    };
    let exchange = Arc::new(Exchange {
        received,
        state: Mutex::new(ExchangeState::default()),
        ended: Notify::new(),
    });
    {
        let mut exchanges = lock(&shared.exchanges);
        if exchanges.len() >= MAX_RECORDED {
            exchanges.clear();
        }
        exchanges.insert(tag, exchange.clone());
    }
    let paced = Paced {
        exchange,
        profile,
        gate,
        include_usage,
        prompt_tokens,
        prefix: chunk_prefix(&model),
        next: 0,
        first_token: None,
        done: false,
    };
    let body = futures::stream::unfold(paced, Paced::next_piece);
    let mut response = Response::new(Body::from_stream(body));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// The fields every chunk starts with, up to `"choices":`.
fn chunk_prefix(model: &str) -> String {
    let model = serde_json::to_string(model).unwrap_or_else(|_| "\"fake-model\"".to_owned());
    let id = uuid::Uuid::new_v4().simple().to_string();
    let created = chrono::Utc::now().timestamp();
    format!(
        "data: {{\"id\":\"chatcmpl-{id}\",\"object\":\"chat.completion.chunk\",\"created\":{created},\
         \"model\":{model},\"system_fingerprint\":\"fp_behest_bench\","
    )
}

/// The body of one answer, piece by piece: piece 0 is the role chunk and token 1 (after the
/// gate and the time to first token), pieces 1..tokens are tokens 2..=tokens, then the end.
struct Paced {
    exchange: Arc<Exchange>,
    profile: Profile,
    gate: Option<watch::Receiver<bool>>,
    include_usage: bool,
    prompt_tokens: u64,
    prefix: String,
    next: u32,
    first_token: Option<tokio::time::Instant>,
    done: bool,
}

impl Paced {
    fn usage_field(&self) -> &'static str {
        if self.include_usage {
            ",\"usage\":null"
        } else {
            ""
        }
    }

    fn content(&self, text: &str) -> String {
        format!(
            "{}\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}},\"logprobs\":null,\"finish_reason\":null}}]{}}}\n\n",
            self.prefix,
            self.usage_field()
        )
    }

    fn role(&self) -> String {
        format!(
            "{}\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\",\"refusal\":null}},\"logprobs\":null,\"finish_reason\":null}}]{}}}\n\n",
            self.prefix,
            self.usage_field()
        )
    }

    fn end(&self) -> String {
        let mut end = format!(
            "{}\"choices\":[{{\"index\":0,\"delta\":{{}},\"logprobs\":null,\"finish_reason\":\"stop\"}}]{}}}\n\n",
            self.prefix,
            self.usage_field()
        );
        if self.include_usage {
            let completion = self.profile.tokens;
            let prompt = self.prompt_tokens;
            end.push_str(&format!(
                "{}\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":{completion},\
                 \"total_tokens\":{},\"prompt_tokens_details\":{{\"cached_tokens\":0,\"audio_tokens\":0}},\
                 \"completion_tokens_details\":{{\"reasoning_tokens\":0,\"audio_tokens\":0,\
                 \"accepted_prediction_tokens\":0,\"rejected_prediction_tokens\":0}}}}}}\n\n",
                self.prefix,
                prompt + u64::from(completion),
            ));
        }
        end.push_str("data: [DONE]\n\n");
        end
    }

    async fn next_piece(mut self) -> Option<(std::result::Result<Bytes, Infallible>, Self)> {
        let tokens = self.profile.tokens;
        if self.done {
            return None;
        }
        let piece = if self.next == 0 {
            let start = match self.gate.as_mut() {
                Some(gate) => {
                    let _ = gate.wait_for(|open| *open).await;
                    tokio::time::Instant::now()
                }
                None => self.exchange.received.into(),
            };
            tokio::time::sleep_until(start + self.profile.ttft).await;
            let mut piece = self.role();
            if tokens == 0 {
                piece.push_str(&self.end());
                self.done = true;
            } else {
                piece.push_str(&self.content(&token_text(1)));
                self.first_token = Some(tokio::time::Instant::now());
            }
            piece
        } else if self.next < tokens {
            if let Some(first) = self.first_token {
                tokio::time::sleep_until(first + self.profile.interval * self.next).await;
            }
            self.content(&token_text(self.next + 1))
        } else {
            self.done = true;
            self.end()
        };
        {
            let mut state = self.exchange.state();
            if self.next < tokens {
                state.token_sent.push(Instant::now());
            }
            state.bytes += piece.len();
            state.completed = self.done;
        }
        self.next += 1;
        Some((Ok(Bytes::from(piece)), self))
    }
}

impl Drop for Paced {
    fn drop(&mut self) {
        // Dropped when the body was written to the end, or when the client went away.
        self.exchange.state().ended = Some(Instant::now());
        self.exchange.ended.notify_one();
    }
}
