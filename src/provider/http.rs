//! HTTP plumbing shared by the provider adapters: the client, deadlines of one call
//! (first byte, idle between chunks, total), bounded error bodies, `retry-after` and error
//! messages without secrets.

use std::convert::Infallible;
use std::time::Duration;

use futures::{Stream, StreamExt};
use reqwest::header::{ACCEPT, CONTENT_TYPE, HeaderMap};
use secrecy::ExposeSecret;
use tokio::time::Instant;

use super::{ErrorClass, ProviderError};
use crate::config::{ProviderConfig, Secret, TimeoutConfig};

/// Most bytes of an error response body read for its message (64 KiB).
pub(super) const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;

/// Most characters of a body or chunk quoted in an error message.
pub(super) const EXCERPT_CHARS: usize = 200;

/// The deadlines of one call, from the moment it starts.
#[derive(Debug, Clone, Copy)]
pub(super) struct Deadlines {
    first_byte: Instant,
    /// When the whole call must be over.
    pub(super) total: Instant,
    idle: Duration,
    timeouts: TimeoutConfig,
}

impl Deadlines {
    pub(super) fn start(timeouts: &TimeoutConfig) -> Self {
        let now = Instant::now();
        Self {
            first_byte: now + Duration::from_millis(timeouts.first_byte_ms),
            total: now + Duration::from_millis(timeouts.total_ms),
            idle: Duration::from_millis(timeouts.idle_ms),
            timeouts: *timeouts,
        }
    }

    /// The deadline for the response head and first chunk, and the message when it fires.
    pub(super) fn first_byte(&self) -> (Instant, String) {
        self.earlier(
            self.first_byte,
            format!("first-byte timeout ({} ms)", self.timeouts.first_byte_ms),
        )
    }

    /// The deadline for the next chunk, and the message when it fires.
    pub(super) fn next_chunk(&self) -> (Instant, String) {
        self.earlier(
            Instant::now() + self.idle,
            format!("idle timeout ({} ms between chunks)", self.timeouts.idle_ms),
        )
    }

    fn earlier(&self, deadline: Instant, name: String) -> (Instant, String) {
        if self.total <= deadline {
            (
                self.total,
                format!("total timeout ({} ms)", self.timeouts.total_ms),
            )
        } else {
            (deadline, name)
        }
    }
}

/// Applies the first-byte, idle and total deadlines to a response body; after a timeout the
/// stream ends.
pub(super) fn with_timeouts<S, B, E>(
    bytes: S,
    deadlines: Deadlines,
) -> impl Stream<Item = Result<B, ReadError>> + Send + 'static
where
    S: Stream<Item = Result<B, E>> + Send + 'static,
    B: Send + 'static,
    E: Into<ReadError> + Send + 'static,
{
    futures::stream::unfold(
        (Box::pin(bytes), true, false),
        move |(mut bytes, first, done)| async move {
            if done {
                return None;
            }
            let (deadline, which) = if first {
                deadlines.first_byte()
            } else {
                deadlines.next_chunk()
            };
            match tokio::time::timeout_at(deadline, bytes.next()).await {
                Err(_) => Some((
                    Err(ReadError {
                        class: ErrorClass::Timeout,
                        message: which,
                    }),
                    (bytes, first, true),
                )),
                Ok(None) => None,
                Ok(Some(Ok(chunk))) => Some((Ok(chunk), (bytes, false, false))),
                Ok(Some(Err(e))) => Some((Err(e.into()), (bytes, first, true))),
            }
        },
    )
}

/// Reads at most [`MAX_ERROR_BODY_BYTES`] of an error response, until `deadline`; what could
/// not be read is left out.
pub(super) async fn read_bounded(mut response: reqwest::Response, deadline: Instant) -> Vec<u8> {
    let mut body = Vec::new();
    while body.len() < MAX_ERROR_BODY_BYTES {
        match tokio::time::timeout_at(deadline, response.chunk()).await {
            Ok(Ok(Some(chunk))) => body.extend_from_slice(&chunk),
            _ => break,
        }
    }
    body.truncate(MAX_ERROR_BODY_BYTES);
    body
}

/// `retry-after-ms` (OpenAI, ms) or `retry-after` (RFC 9110, delay in seconds; HTTP dates are
/// ignored).
pub(super) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(ms) = header("retry-after-ms").and_then(|v| v.trim().parse::<f64>().ok())
        && ms.is_finite()
        && ms >= 0.0
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    header("retry-after")
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(Duration::from_secs_f64)
}

/// An error's message with its sources, e.g. `error sending request: tcp connect error: …`.
/// The URL is left out (it may carry credentials of some deployments).
pub(super) fn error_chain(error: &reqwest::Error) -> String {
    let mut message = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

/// The first [`EXCERPT_CHARS`] characters of `text`, on one line.
pub(super) fn excerpt(text: &str) -> String {
    let mut out: String = text
        .trim()
        .chars()
        .take(EXCERPT_CHARS)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if text.trim().chars().count() > EXCERPT_CHARS {
        out.push('…');
    }
    out
}

/// A failure reading the response body: its class (`transport` or `timeout`) and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadError {
    /// The class the call fails with.
    pub class: ErrorClass,
    /// What happened.
    pub message: String,
}

impl From<reqwest::Error> for ReadError {
    fn from(error: reqwest::Error) -> Self {
        Self {
            class: if error.is_timeout() {
                ErrorClass::Timeout
            } else {
                ErrorClass::Transport
            },
            message: error_chain(&error),
        }
    }
}

impl From<std::io::Error> for ReadError {
    fn from(error: std::io::Error) -> Self {
        Self {
            class: ErrorClass::Transport,
            message: error.to_string(),
        }
    }
}

impl From<Infallible> for ReadError {
    fn from(error: Infallible) -> Self {
        match error {}
    }
}

/// Where and how an adapter calls its provider: the provider id, the HTTP client, the base
/// URL, the API key and the deadlines of each call.
#[derive(Debug)]
pub(super) struct Endpoint {
    /// The provider id, for errors and logs.
    pub(super) id: String,
    client: reqwest::Client,
    /// Base URL without a trailing `/`, e.g. `https://api.openai.com/v1`.
    pub(super) base_url: String,
    api_key: Option<Secret>,
    timeouts: TimeoutConfig,
}

impl Endpoint {
    /// An HTTP client with the configured connect timeout (ms), the base URL (trailing `/`
    /// trimmed) and the API key.
    ///
    /// # Errors
    /// A [`ProviderError`] of class `invalid_request` when the HTTP client cannot be built.
    pub(super) fn new(id: &str, config: &ProviderConfig) -> Result<Self, ProviderError> {
        Ok(Self {
            id: id.to_owned(),
            client: client(id, config)?,
            base_url: config.base_url.trim_end_matches('/').to_owned(),
            api_key: config.api_key.clone(),
            timeouts: config.timeouts,
        })
    }

    /// The API key, when configured, for the wire format's credential header.
    pub(super) fn api_key(&self) -> Option<&str> {
        self.api_key.as_ref().map(|key| key.0.expose_secret())
    }

    /// `POST {base_url}{path}` (path with its leading `/`) of a JSON body, asking for an event
    /// stream.
    pub(super) fn post(&self, path: &str, body: &serde_json::Value) -> reqwest::RequestBuilder {
        self.client
            .post(format!("{}{path}", self.base_url))
            .header(ACCEPT, "text/event-stream")
            .json(body)
    }

    /// Sends a request (see [`send`]; `read_error` classifies an error answer) and returns
    /// its event-stream body under the first-byte, idle and total deadlines, which start now.
    ///
    /// # Errors
    /// As [`send`].
    pub(super) async fn open(
        &self,
        builder: reqwest::RequestBuilder,
        read_error: impl FnOnce(Option<u16>, &[u8]) -> (ErrorClass, Option<String>),
    ) -> Result<
        impl Stream<Item = Result<impl AsRef<[u8]> + Send + 'static, ReadError>> + Send + 'static,
        ProviderError,
    > {
        let deadlines = Deadlines::start(&self.timeouts);
        let response = send(&self.id, builder, &deadlines, read_error, Expect::Stream).await?;
        Ok(with_timeouts(response.bytes_stream(), deadlines))
    }
}

impl Endpoint {
    /// `POST {base_url}{path}` of a JSON body, asking for a JSON answer (a call without
    /// streaming).
    pub(super) fn post_json(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> reqwest::RequestBuilder {
        self.client
            .post(format!("{}{path}", self.base_url))
            .header(ACCEPT, "application/json")
            .json(body)
    }

    /// Sends a request that is answered without streaming and returns the 2xx answer's body
    /// (at most [`MAX_COMPLETION_BYTES`]), under the first-byte and total deadlines.
    ///
    /// # Errors
    /// As [`send`] for an error answer or a failed connection; `transport` when the body
    /// cannot be read.
    pub(super) async fn complete(
        &self,
        builder: reqwest::RequestBuilder,
        read_error: impl FnOnce(Option<u16>, &[u8]) -> (ErrorClass, Option<String>),
    ) -> Result<Vec<u8>, ProviderError> {
        let deadlines = Deadlines::start(&self.timeouts);
        let response = send(&self.id, builder, &deadlines, read_error, Expect::Json).await?;
        let mut body = Vec::new();
        let mut response = response;
        while body.len() < MAX_COMPLETION_BYTES {
            match tokio::time::timeout_at(deadlines.total, response.chunk()).await {
                Ok(Ok(Some(chunk))) => body.extend_from_slice(&chunk),
                Ok(Ok(None)) => return Ok(body),
                Ok(Err(e)) => {
                    let error = ReadError::from(e);
                    return Err(ProviderError::new(&self.id, error.class, error.message));
                }
                Err(_) => {
                    let message = format!("total timeout ({} ms)", self.timeouts.total_ms);
                    return Err(ProviderError::new(&self.id, ErrorClass::Timeout, message));
                }
            }
        }
        Ok(body)
    }
}

/// Most bytes of a completion answered without streaming (16 MiB).
pub(super) const MAX_COMPLETION_BYTES: usize = 16 * 1024 * 1024;

/// What a 2xx answer must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// An event stream (`text/event-stream`, or no content type).
    Stream,
    /// Anything (read as JSON by the caller).
    Json,
}

/// An HTTP client with the provider's connect timeout (ms) and behest's user agent.
///
/// # Errors
/// A [`ProviderError`] of class `invalid_request` when the client cannot be built.
fn client(id: &str, config: &ProviderConfig) -> Result<reqwest::Client, ProviderError> {
    crate::net::client_builder()
        .connect_timeout(Duration::from_millis(config.timeouts.connect_ms))
        .build()
        .map_err(|e| {
            ProviderError::new(
                id,
                ErrorClass::InvalidRequest,
                format!("cannot build the HTTP client: {}", error_chain(&e)),
            )
        })
}

/// Sends a request and waits for its answer until the first-byte (or total) deadline. A 2xx
/// `text/event-stream` answer (or one without a content type; any 2xx with
/// [`Expect::Json`]) is the answer; of any
/// other answer at most [`MAX_ERROR_BODY_BYTES`] of the body are read and handed, with the
/// status (`None` for a 2xx), to `read_error`, which classifies them by the wire format's
/// error body and returns the provider's own message when it gave one.
///
/// # Errors
/// `timeout` when a deadline fires, `transport` when the connection fails, and for a 2xx that
/// is not an event stream (see [`not_a_stream`]) `invalid_request` or `server` with status
/// 2xx (never retried: the server would answer the same again); for a non-2xx answer
/// `read_error`'s class, with its status, `retry-after-ms` / `retry-after` and message (see
/// [`error_message`]).
async fn send(
    id: &str,
    builder: reqwest::RequestBuilder,
    deadlines: &Deadlines,
    read_error: impl FnOnce(Option<u16>, &[u8]) -> (ErrorClass, Option<String>),
    expect: Expect,
) -> Result<reqwest::Response, ProviderError> {
    let (deadline, which) = deadlines.first_byte();
    let response = match tokio::time::timeout_at(deadline, builder.send()).await {
        Err(_) => return Err(ProviderError::new(id, ErrorClass::Timeout, which)),
        Ok(Err(e)) => return Err(request_error(id, &e, deadlines)),
        Ok(Ok(response)) => response,
    };
    let status = response.status();
    let content_type = response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_ascii_lowercase());
    if status.is_success() {
        if expect == Expect::Json
            || content_type
                .as_deref()
                .is_none_or(|v| v.starts_with("text/event-stream"))
        {
            return Ok(response);
        }
        let status = status.as_u16();
        let content_type = content_type.unwrap_or_default();
        let body = read_bounded(response, deadlines.total).await;
        let (class, message) = not_a_stream(status, &content_type, &body, read_error);
        return Err(ProviderError {
            status: Some(status),
            ..ProviderError::new(id, class, message)
        });
    }
    let status = status.as_u16();
    let retry_after = retry_after(response.headers());
    let body = read_bounded(response, deadlines.total).await;
    let (class, message) = read_error(Some(status), &body);
    Err(ProviderError {
        provider: id.to_owned(),
        class,
        status: Some(status),
        message: error_message(message.as_deref(), &body, status),
        retry_after,
    })
}

/// A 2xx answer of another content type than `text/event-stream`: a JSON error object is
/// classified by `read_error` (some gateways answer errors with 200); any other JSON is a
/// whole completion (`invalid_request`: the server ignored `stream: true`); HTML, an empty
/// body or anything else is `server`. The message names the status, the content type and
/// what arrived (see [`body_summary`]).
fn not_a_stream(
    status: u16,
    content_type: &str,
    body: &[u8],
    read_error: impl FnOnce(Option<u16>, &[u8]) -> (ErrorClass, Option<String>),
) -> (ErrorClass, String) {
    let what = format!("HTTP {status} {content_type} instead of an event stream");
    if let Ok(serde_json::Value::Object(object)) = serde_json::from_slice(body) {
        if object.contains_key("error") {
            let (class, message) = read_error(None, body);
            let detail = message.map_or_else(|| body_summary(body), |m| excerpt(&m));
            return (class, format!("{what}: {detail}"));
        }
        return (
            ErrorClass::InvalidRequest,
            format!(
                "{what}: a JSON answer (the server ignored `stream: true`): {}",
                body_summary(body)
            ),
        );
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return (ErrorClass::Server, format!("{what}: an empty body"));
    }
    (
        ErrorClass::Server,
        format!("{what}: {}", body_summary(body)),
    )
}

/// What a body that was not expected says, briefly: an HTML page by its `<title>` (never the
/// whole page), anything else by its first [`EXCERPT_CHARS`] characters.
pub(super) fn body_summary(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    if is_html(&text) {
        return match html_title(&text) {
            Some(title) => format!("an HTML page titled \"{title}\""),
            None => "an HTML page without a title".to_owned(),
        };
    }
    excerpt(&text)
}

/// Whether a body is an HTML page (`<!doctype html`, `<html` or `<head` near its start).
fn is_html(text: &str) -> bool {
    let start: String = text.trim_start().chars().take(512).collect();
    let start = start.to_ascii_lowercase();
    start.starts_with('<')
        && ["<!doctype html", "<html", "<head", "<body"]
            .iter()
            .any(|tag| start.contains(tag))
}

/// The text of an HTML page's `<title>`, whitespace collapsed, at most [`EXCERPT_CHARS`]
/// characters.
fn html_title(text: &str) -> Option<String> {
    let lower = text.to_ascii_lowercase();
    let open = lower.find("<title")?;
    let start = open + lower.get(open..)?.find('>')? + 1;
    let end = start + lower.get(start..)?.find("</title")?;
    let title = text
        .get(start..end)?
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    (!title.is_empty()).then(|| excerpt(&title))
}

/// The message of an error answer: the provider's `message`, else a summary of the body (an
/// HTML page by its title, see [`body_summary`]), else `HTTP {status}`; at most
/// [`EXCERPT_CHARS`] characters of the provider's text either way.
pub(super) fn error_message(message: Option<&str>, body: &[u8], status: u16) -> String {
    if let Some(message) = message {
        return excerpt(message);
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return format!("HTTP {status}");
    }
    let summary = body_summary(body);
    if is_html(&String::from_utf8_lossy(body)) {
        format!("HTTP {status}: {summary}")
    } else {
        summary
    }
}

fn request_error(id: &str, error: &reqwest::Error, deadlines: &Deadlines) -> ProviderError {
    let class = if error.is_timeout() {
        ErrorClass::Timeout
    } else {
        ErrorClass::Transport
    };
    let mut message = error_chain(error);
    if error.is_connect() && error.is_timeout() {
        message = format!(
            "connect timeout ({} ms): {message}",
            deadlines.timeouts.connect_ms
        );
    }
    ProviderError::new(id, class, message)
}
