//! HTTP tools: the arguments are POSTed as a JSON body to the configured URL with the
//! configured headers; a 2xx response body is the result (JSON, or the text as a JSON string).
//! A tool that reports progress streams its answer instead: `text/event-stream` (`progress`
//! events, then one `result` or `error` event) or `application/x-ndjson` (`{"progress": …}`
//! lines, then one `{"result": …}` or `{"error": "…"}` line).

use eventsource_stream::Eventsource as _;
use futures::{StreamExt as _, TryStreamExt as _};
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;
use tokio_util::codec::{FramedRead, LinesCodec};
use tokio_util::io::StreamReader;

use super::{ProgressSink, ToolError, ToolSetupError};
use crate::config::HttpToolConfig;

/// Bytes of an error response body quoted in [`ToolError::Failed`].
const BODY_EXCERPT_BYTES: usize = 200;
/// Bytes of one NDJSON line of a streamed answer at most.
const MAX_LINE_BYTES: usize = 16 << 20;

/// A progress report in a streamed answer (an SSE `progress` event's data, an NDJSON line).
#[derive(Debug, Deserialize)]
struct ProgressReport {
    progress: f64,
    #[serde(default)]
    total: Option<f64>,
    #[serde(default)]
    message: Option<String>,
}

/// One NDJSON line of a streamed answer: progress, the result, or the error.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Line {
    Result { result: serde_json::Value },
    Error { error: String },
    Progress(ProgressReport),
}

/// How the response body is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body {
    /// `application/json`, `+json` or no content type: JSON, else text.
    Json,
    /// `text/event-stream`: progress events, then the result.
    EventStream,
    /// `application/x-ndjson` (or `application/jsonl`): progress lines, then the result.
    Ndjson,
    /// Anything else: the text.
    Text,
}
/// One configured HTTP tool, ready to call.
#[derive(Debug, Clone)]
pub(super) struct HttpTool {
    name: String,
    url: String,
    headers: HeaderMap,
    client: reqwest::Client,
}

impl HttpTool {
    /// Checks the URL and headers of `[http_tools.<name>]`.
    pub(super) fn new(
        name: &str,
        config: &HttpToolConfig,
        client: reqwest::Client,
    ) -> Result<Self, ToolSetupError> {
        let url = reqwest::Url::parse(&config.url).map_err(|e| {
            ToolSetupError::Invalid(format!("http_tools.{name}.url `{}`: {e}", config.url))
        })?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ToolSetupError::Invalid(format!(
                "http_tools.{name}.url must start with http:// or https://"
            )));
        }
        let mut headers = HeaderMap::new();
        for (key, value) in &config.headers {
            let header = HeaderName::from_bytes(key.as_bytes()).map_err(|_| {
                ToolSetupError::Invalid(format!("http_tools.{name}.headers: bad name `{key}`"))
            })?;
            // The value may be a secret: never quote it.
            let mut value = HeaderValue::from_str(value).map_err(|_| {
                ToolSetupError::Invalid(format!("http_tools.{name}.headers.{key}: bad value"))
            })?;
            value.set_sensitive(true);
            headers.insert(header, value);
        }
        Ok(Self {
            name: name.to_owned(),
            url: config.url.clone(),
            headers,
            client,
        })
    }

    /// POSTs `arguments`, with `Idempotency-Key` when given; dropping the future aborts the
    /// request. A streamed answer's progress goes to `progress` (when given).
    pub(super) async fn call(
        &self,
        arguments: &serde_json::Value,
        idempotency_key: Option<&str>,
        progress: Option<&ProgressSink>,
    ) -> Result<serde_json::Value, ToolError> {
        let mut request = self
            .client
            .post(&self.url)
            .headers(self.headers.clone())
            .json(arguments);
        if let Some(key) = idempotency_key {
            request = request.header("idempotency-key", key);
        }
        let response = request
            .send()
            .await
            .map_err(|e| self.failed(&format!("request failed: {e}")))?;
        let status = response.status();
        let body = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map_or(Body::Json, body_kind);
        if status.is_success() {
            match body {
                Body::EventStream => return self.read_event_stream(response, progress).await,
                Body::Ndjson => return self.read_ndjson(response, progress).await,
                Body::Json | Body::Text => {}
            }
        }
        let json_body = body == Body::Json;
        let body = response
            .bytes()
            .await
            .map_err(|e| self.failed(&format!("reading the response failed: {e}")))?;
        if !status.is_success() {
            let text = String::from_utf8_lossy(&body);
            return Err(self.failed(&format!("HTTP {status}: {}", excerpt(text.trim()))));
        }
        if json_body && let Ok(value) = serde_json::from_slice(&body) {
            return Ok(value);
        }
        Ok(serde_json::Value::String(
            String::from_utf8_lossy(&body).into_owned(),
        ))
    }

    /// A `text/event-stream` answer: `progress` events (data `{"progress": number, "total"?:
    /// number, "message"?: string}`) reported, until a `result` event (its data: JSON, else the
    /// text as a JSON string) or an `error` event (its data is the failure's text). Other
    /// events are ignored; a stream that ends without either is a failure.
    async fn read_event_stream(
        &self,
        response: reqwest::Response,
        progress: Option<&ProgressSink>,
    ) -> Result<serde_json::Value, ToolError> {
        let mut events = response.bytes_stream().eventsource();
        while let Some(event) = events.next().await {
            let event =
                event.map_err(|e| self.failed(&format!("reading the stream failed: {e}")))?;
            match event.event.as_str() {
                "progress" => self.progress(&event.data, progress)?,
                "result" => {
                    return Ok(serde_json::from_str(&event.data)
                        .unwrap_or(serde_json::Value::String(event.data)));
                }
                "error" => return Err(self.failed(&excerpt(event.data.trim()))),
                _ => {}
            }
        }
        Err(self.failed("the event stream ended without a `result` event"))
    }

    /// An `application/x-ndjson` answer: `{"progress": …}` lines reported until a
    /// `{"result": …}` or `{"error": "…"}` line; blank lines and progress lines that do not
    /// read are skipped, any other line is a failure, and so is a stream that ends without a
    /// result.
    async fn read_ndjson(
        &self,
        response: reqwest::Response,
        progress: Option<&ProgressSink>,
    ) -> Result<serde_json::Value, ToolError> {
        let reader = StreamReader::new(response.bytes_stream().map_err(std::io::Error::other));
        let mut lines = FramedRead::new(reader, LinesCodec::new_with_max_length(MAX_LINE_BYTES));
        while let Some(line) = lines.next().await {
            let line = line.map_err(|e| self.failed(&format!("reading the stream failed: {e}")))?;
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str::<Line>(&line) {
                Ok(Line::Result { result }) => return Ok(result),
                Ok(Line::Error { error }) => return Err(self.failed(&excerpt(error.trim()))),
                Ok(Line::Progress(report)) => {
                    if let Some(sink) = progress {
                        sink.report(report.progress, report.total, report.message);
                    }
                }
                // A report that does not read (a string, a number out of range) is progress
                // lost, not the result: it is skipped.
                Err(e) if is_progress_line(&line) => {
                    tracing::warn!(tool = %self.name, error = %e, line = %excerpt(&line), "skipped a progress line that does not read");
                }
                Err(e) => {
                    return Err(self.failed(&format!(
                        "a line of the stream is not progress, a result or an error ({e}): {}",
                        excerpt(&line)
                    )));
                }
            }
        }
        Err(self.failed("the stream ended without a `result` line"))
    }

    /// Reports one `progress` event's data; one that does not read (not JSON, a number out of
    /// range) is skipped with a warning: a lost report never costs the tool's result.
    fn progress(&self, data: &str, progress: Option<&ProgressSink>) -> Result<(), ToolError> {
        match serde_json::from_str::<ProgressReport>(data) {
            Ok(report) => {
                if let Some(sink) = progress {
                    sink.report(report.progress, report.total, report.message);
                }
            }
            Err(e) => {
                tracing::warn!(tool = %self.name, error = %e, data = %excerpt(data), "skipped a progress event that does not read");
            }
        }
        Ok(())
    }

    fn failed(&self, reason: &str) -> ToolError {
        ToolError::Failed(format!("HTTP tool `{}`: {reason}", self.name))
    }
}

/// An NDJSON line that is an object with a `progress` member (and no `result` or `error`).
fn is_progress_line(line: &str) -> bool {
    // The values are skipped unread: `1e999` is out of range as a number, not as JSON.
    serde_json::from_str::<std::collections::HashMap<String, serde::de::IgnoredAny>>(line)
        .is_ok_and(|object| {
            object.contains_key("progress")
                && !object.contains_key("result")
                && !object.contains_key("error")
        })
}

/// How a body of this content type is read (parameters ignored).
fn body_kind(content_type: &str) -> Body {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    match essence.as_str() {
        "text/event-stream" => Body::EventStream,
        "application/x-ndjson" | "application/jsonl" => Body::Ndjson,
        _ if is_json_media_type(&essence) => Body::Json,
        _ => Body::Text,
    }
}

/// `application/json`, `application/problem+json`, … (parameters ignored).
fn is_json_media_type(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json" || essence.ends_with("+json")
}

/// The first [`BODY_EXCERPT_BYTES`] of `text`, cut on a character boundary, with `…` when cut.
fn excerpt(text: &str) -> String {
    if text.len() <= BODY_EXCERPT_BYTES {
        return text.to_owned();
    }
    let mut end = BODY_EXCERPT_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn excerpt_cuts_on_a_char_boundary() {
        let text = "é".repeat(150);
        let cut = excerpt(&text);
        assert!(cut.ends_with('…'));
        assert_eq!(cut.chars().count(), 101);
        assert_eq!(excerpt("short"), "short");
    }

    #[test]
    fn json_media_types() {
        assert!(is_json_media_type("application/json; charset=utf-8"));
        assert!(is_json_media_type("application/problem+json"));
        assert!(!is_json_media_type("text/plain"));
    }

    #[test]
    fn bad_header_is_named_without_value() {
        let config = HttpToolConfig {
            idempotent: false,
            requires_approval: false,
            description: String::new(),
            url: "http://127.0.0.1:1/".to_owned(),
            parameters: serde_json::json!({"type": "object"}),
            headers: [("X-Key".to_owned(), "secret\nvalue".to_owned())].into(),
        };
        let error = HttpTool::new("t", &config, crate::net::client().unwrap())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(error.contains("X-Key"), "{error}");
        assert!(!error.contains("secret"), "{error}");
    }
}
