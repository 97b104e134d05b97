//! HTTP tools: the arguments are POSTed as a JSON body to the configured URL with the
//! configured headers; a 2xx response body is the result (JSON, or the text as a JSON string).

use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};

use super::{ToolError, ToolSetupError};
use crate::config::HttpToolConfig;

/// Bytes of an error response body quoted in [`ToolError::Failed`].
const BODY_EXCERPT_BYTES: usize = 200;

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
    /// request.
    pub(super) async fn call(
        &self,
        arguments: &serde_json::Value,
        idempotency_key: Option<&str>,
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
        let json_body = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_none_or(is_json_media_type);
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

    fn failed(&self, reason: &str) -> ToolError {
        ToolError::Failed(format!("HTTP tool `{}`: {reason}", self.name))
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
