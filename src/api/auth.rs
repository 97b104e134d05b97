//! Bearer API keys: with keys configured, every route of the API but `/healthz` and
//! `/readyz` needs `Authorization: Bearer <key>` (RFC 6750); `GET /runs/{run_id}/events` also
//! takes it as `?access_token=`, because a browser `EventSource` cannot set headers. A
//! presented key is hashed and compared with every configured hash in constant time; it is
//! never logged, echoed in an error, or put in a metric or a span (request URIs are logged
//! with the value of every parameter whose name may carry a secret redacted, whatever its
//! case or percent-encoding).

use std::sync::Arc;

use axum::extract::{FromRequestParts, MatchedPath, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, Method, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use super::{ApiError, AppState};
use crate::config::{AuthConfig, KeyHash};

/// The route whose key may come as `?access_token=` (an `EventSource` cannot send headers).
pub const EVENTS_ROUTE: &str = "/runs/{run_id}/events";
/// The query parameter carrying a key on [`EVENTS_ROUTE`].
pub const ACCESS_TOKEN: &str = "access_token";
/// Routes that never need a key: load balancers' probes.
pub const PUBLIC_ROUTES: [&str; 2] = ["/healthz", "/readyz"];

/// The configured keys (their SHA-256 digests).
#[derive(Debug, Clone, Default)]
pub struct Auth {
    keys: Arc<[KeyHash]>,
    metrics_public: bool,
}

impl Auth {
    /// The keys of `[auth]`.
    #[must_use]
    pub fn new(config: &AuthConfig) -> Self {
        Self {
            keys: config.keys.0.iter().copied().collect(),
            metrics_public: config.metrics_public,
        }
    }

    /// Whether keys are required.
    #[must_use]
    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// How many keys are configured.
    #[must_use]
    pub fn key_count(&self) -> usize {
        self.keys.len()
    }

    /// The index of the configured key `token` is, comparing its digest with every key's in
    /// constant time (no early exit: the time says nothing about which key, or how much of
    /// one, matched).
    fn identify(&self, token: &str) -> Option<usize> {
        let presented = KeyHash::of(token);
        let mut found = None;
        for (index, key) in self.keys.iter().enumerate() {
            if bool::from(key.0.ct_eq(&presented.0)) {
                found = Some(index);
            }
        }
        found
    }
}

/// Who is calling: the index of their API key among the configured ones, `None` when the
/// server has no keys. Per-key limits are counted by it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Caller(pub Option<usize>);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(parts
            .extensions
            .get::<Caller>()
            .copied()
            .unwrap_or_default())
    }
}

/// Middleware of every protected route: lets a request with a configured key through (with
/// its [`Caller`]), answers any other `401 unauthorized` with `WWW-Authenticate: Bearer`.
pub async fn require_key(
    State(state): State<AppState>,
    matched: Option<MatchedPath>,
    mut request: Request,
    next: Next,
) -> Response {
    let auth = &state.auth;
    let route = matched.as_ref().map(MatchedPath::as_str);
    if !auth.enabled() || (auth.metrics_public && route == Some("/metrics")) {
        return next.run(request).await;
    }
    let header = request.headers().get(header::AUTHORIZATION);
    let token = match header {
        Some(value) => bearer(value),
        None if route == Some(EVENTS_ROUTE) && request.method() == Method::GET => {
            query_token(request.uri())
        }
        None => None,
    };
    let Some(token) = token else {
        let detail = if header.is_some() {
            "send the API key as `Authorization: Bearer <key>`"
        } else {
            "this server requires an API key: `Authorization: Bearer <key>`"
        };
        return unauthorized(detail, header.is_some());
    };
    match auth.identify(&token) {
        Some(index) => {
            request.extensions_mut().insert(Caller(Some(index)));
            next.run(request).await
        }
        None => unauthorized("the API key is not valid", true),
    }
}

/// The token of an `Authorization: Bearer <token>` header (scheme case-insensitive).
fn bearer(value: &HeaderValue) -> Option<String> {
    let text = value.to_str().ok()?.trim();
    let (scheme, token) = text.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then(|| token.to_owned())
}

/// The `access_token` query parameter.
fn query_token(uri: &Uri) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Token {
        access_token: Option<String>,
    }
    axum::extract::Query::<Token>::try_from_uri(uri)
        .ok()
        .and_then(|query| query.0.access_token)
        .filter(|token| !token.is_empty())
}

/// 401 `unauthorized` with `WWW-Authenticate` (RFC 6750 §3: `error="invalid_token"` when a
/// key was presented).
fn unauthorized(detail: &str, presented: bool) -> Response {
    let challenge = if presented {
        "Bearer realm=\"behest\", error=\"invalid_token\""
    } else {
        "Bearer realm=\"behest\""
    };
    let mut response = ApiError::unauthorized(detail).into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static(challenge),
    );
    response
}

/// Words that make a query parameter secret when its name (percent-decoded, any case)
/// contains one: `access_token`, `api_key`, `Api-Key`, `client_secret`, `password`,
/// `auth`, …
const SECRET_NAME_PARTS: [&str; 7] = [
    "token",
    "key",
    "secret",
    "password",
    "passwd",
    "auth",
    "credential",
];

/// Whether a query parameter named `raw_name` (as sent: percent-encoded, `+` for a space)
/// may carry a secret: its decoded name, in any case, contains one of [`SECRET_NAME_PARTS`].
/// `access%5Ftoken` is `access_token`, which the key check reads too.
fn is_secret_name(raw_name: &str) -> bool {
    // The raw name holds no `&` or `=` (the pair was split at them): one name comes out.
    let decoded: String = form_urlencoded::parse(raw_name.as_bytes())
        .map(|(name, _)| name)
        .collect();
    let decoded = decoded.to_lowercase();
    SECRET_NAME_PARTS.iter().any(|part| decoded.contains(part))
}

/// The request URI as logged: the value of every query parameter whose name may carry a
/// secret ([`is_secret_name`]) replaced by `[redacted]`; the path and other parameters as
/// sent.
#[must_use]
pub fn redacted_uri(uri: &Uri) -> String {
    let Some(query) = uri.query() else {
        return uri.to_string();
    };
    let mut redacted = false;
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if is_secret_name(name) => {
                redacted = true;
                format!("{name}=[redacted]")
            }
            _ => pair.to_owned(),
        })
        .collect();
    if !redacted {
        return uri.to_string();
    }
    format!("{}?{}", uri.path(), pairs.join("&"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_redacted_from_logged_uris() {
        let uri: Uri = "/runs/x/events?last_event_id=3&access_token=sk-secret&b=1"
            .parse()
            .unwrap_or_default();
        let logged = redacted_uri(&uri);
        assert_eq!(
            logged,
            "/runs/x/events?last_event_id=3&access_token=[redacted]&b=1"
        );
        assert!(!logged.contains("sk-secret"));
        let plain: Uri = "/runs?limit=5".parse().unwrap_or_default();
        assert_eq!(redacted_uri(&plain), "/runs?limit=5");
    }

    #[test]
    fn secret_names_are_redacted_in_any_encoding_and_case() {
        for query in [
            "access%5Ftoken=SECRET",
            "ACCESS_TOKEN=SECRET",
            "Access%5FToken=SECRET",
            "%61ccess_token=SECRET",
            "Api%2DKey=SECRET",
            "x-api-key=SECRET",
            "client_secret=SECRET",
            "PassWord=SECRET",
            "Authorization=SECRET",
            "api+key=SECRET",
            "limit=5&access_token=SECRET&access_token=SECRET",
        ] {
            let uri: Uri = format!("/runs/x/events?{query}").parse().unwrap();
            let logged = redacted_uri(&uri);
            assert!(!logged.contains("SECRET"), "{query}: {logged}");
            assert!(logged.contains("[redacted]"), "{query}: {logged}");
        }
        let kept: Uri = "/runs?session_id=s&cursor=c&status=completed"
            .parse()
            .unwrap();
        assert_eq!(redacted_uri(&kept), kept.to_string());
    }

    #[test]
    fn keys_are_identified_by_digest() -> Result<(), &'static str> {
        let mut config = AuthConfig::default();
        config.keys.extend_from("one,two")?;
        let auth = Auth::new(&config);
        assert_eq!(auth.identify("two"), Some(1));
        assert_eq!(auth.identify("three"), None);
        assert_eq!(auth.identify("tw"), None);
        Ok(())
    }

    #[test]
    fn bearer_headers_parse() {
        let token = |text: &'static str| bearer(&HeaderValue::from_static(text));
        assert_eq!(token("Bearer abc"), Some("abc".to_owned()));
        assert_eq!(token("bearer  abc "), Some("abc".to_owned()));
        assert_eq!(token("Basic abc"), None);
        assert_eq!(token("Bearer"), None);
    }
}
