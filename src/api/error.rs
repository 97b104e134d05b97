//! The one error type at the HTTP edge, rendered as RFC 9457 `application/problem+json` with a
//! stable machine `code`. Body, path and query rejections go through it too.

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use super::extract::Body;
use crate::domain::{RunId, RunStatus};
use crate::runtime::{AnswerError, CancelError, CreateRunError};
use crate::store::StoreError;

/// An RFC 9457 problem document.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Problem {
    /// Problem type URI; `about:blank` (the `code` identifies the problem).
    #[serde(rename = "type")]
    pub problem_type: String,
    /// Short summary of the problem kind.
    pub title: String,
    /// HTTP status code.
    pub status: u16,
    /// What happened in this occurrence, readable by a person.
    pub detail: String,
    /// Stable machine code, e.g. `run_not_found`, `invalid_cursor`, `run_not_finished`.
    pub code: String,
    /// The offending request field, when one is to blame.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The run concerned, when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// The run's status, when it explains the problem (e.g. `run_not_finished`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_status: Option<RunStatus>,
}

/// An error answered to a client: its problem document, and for a temporary refusal how many
/// seconds to wait before retrying (the `Retry-After` header).
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError(Box<Problem>, Option<u32>);

impl ApiError {
    /// A problem with status, code and detail.
    /// A detail longer than [`MAX_DETAIL_BYTES`] is cut there with a `… (truncated)` marker, so
    /// no client value is echoed at length.
    #[must_use]
    pub fn new(status: StatusCode, code: &str, detail: impl Into<String>) -> Self {
        Self(
            Box::new(Problem {
                problem_type: "about:blank".to_owned(),
                title: status.canonical_reason().unwrap_or("Error").to_owned(),
                status: status.as_u16(),
                detail: clip(detail.into(), MAX_DETAIL_BYTES),
                code: code.to_owned(),
                field: None,
                run_id: None,
                run_status: None,
            }),
            None,
        )
    }

    /// The problem document.
    #[must_use]
    pub fn problem(&self) -> &Problem {
        &self.0
    }

    /// Adds a `Retry-After` header of `seconds`.
    #[must_use]
    pub fn retry_after(mut self, seconds: u32) -> Self {
        self.1 = Some(seconds);
        self
    }

    /// 503 `shutting_down` with `Retry-After`: this process drains its runs and admits none;
    /// the next process (or another replica) will.
    #[must_use]
    pub fn shutting_down() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting_down",
            "the server is shutting down; retry shortly (the next process takes requests)",
        )
        .retry_after(SHUTDOWN_RETRY_AFTER_SECS)
    }

    /// 401 `unauthorized`: no API key, or not one of the configured keys (the key is never
    /// echoed). The auth layer adds `WWW-Authenticate: Bearer`.
    #[must_use]
    pub fn unauthorized(detail: &str) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", detail)
    }

    /// 429 `rate_limited` with `Retry-After`: the API key created runs faster than
    /// `[limits] runs_per_minute`.
    #[must_use]
    pub fn rate_limited(retry_after_secs: u32) -> Self {
        Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limited",
            "this API key creates runs faster than the server allows; retry after the \
             `Retry-After` seconds",
        )
        .retry_after(retry_after_secs.max(1))
    }

    /// 503 `too_many_watchers` with `Retry-After`: the server's or the API key's cap on open
    /// event streams is reached.
    #[must_use]
    pub fn too_many_watchers(per_key: bool) -> Self {
        let whose = if per_key {
            "this API key holds the most event streams it may open at once"
        } else {
            "the server holds the most event streams it serves at once"
        };
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too_many_watchers",
            format!("{whose}; close one, or retry later"),
        )
        .retry_after(WATCHERS_RETRY_AFTER_SECS)
    }

    /// 404 `snapshot_not_found`.
    #[must_use]
    pub fn snapshot_not_found(run_id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "snapshot_not_found",
            format!("no snapshot of a run with id `{run_id}`"),
        )
    }

    /// This error with another `detail` (cut as [`ApiError::new`] cuts it).
    #[must_use]
    pub fn with_detail(mut self, detail: String) -> Self {
        self.0.detail = clip(detail, MAX_DETAIL_BYTES);
        self
    }

    /// The field this error names, if any.
    pub fn field_name(&self) -> Option<&str> {
        self.0.field.as_deref()
    }

    /// Names the offending field (its path in the request body, e.g. `defaults.model`).
    #[must_use]
    pub fn field(mut self, field: &str) -> Self {
        self.0.field = Some(clip(field.to_owned(), MAX_FIELD_BYTES));
        self
    }

    /// Names `to` as the offending field where this error names `from` or a field inside it
    /// (`from.…`, `from[…]`), in `field` and where the detail quotes it (`` `from` ``): for a
    /// route whose body says in `to` what the run's create request says in `from` (`/chat`'s
    /// and `/ag-ui`'s `messages` are a run's `input`).
    #[must_use]
    pub fn field_renamed(mut self, from: &str, to: &str) -> Self {
        let inside = |field: &str| {
            field == from
                || field
                    .strip_prefix(from)
                    .is_some_and(|rest| rest.starts_with(['.', '[']))
        };
        if self.0.field.as_deref().is_some_and(inside) {
            self.0.field = Some(to.to_owned());
            self.0.detail = self
                .0
                .detail
                .replace(&format!("`{from}`"), &format!("`{to}`"));
        }
        self
    }

    /// Names the run's status.
    #[must_use]
    pub fn with_status(mut self, status: RunStatus) -> Self {
        self.0.run_status = Some(status);
        self
    }

    /// Names the run and its status.
    #[must_use]
    pub fn run(mut self, run_id: RunId, status: Option<RunStatus>) -> Self {
        self.0.run_id = Some(run_id);
        self.0.run_status = status;
        self
    }

    /// 400 `invalid_cursor` for a cursor beyond the last event the run has logged: events are
    /// published only once stored, so no client received that sequence (a stream from there
    /// would wait in silence and miss the terminal event). `cursor` as the client sent it
    /// (`N`, or `N.j` in the projected formats).
    #[must_use]
    pub fn cursor_ahead(cursor: impl std::fmt::Display, last: u64) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_cursor",
            format!("the cursor {cursor} is beyond the run's last event ({last})"),
        )
        .field("last_event_id")
    }

    /// 404 `run_not_found`.
    #[must_use]
    pub fn run_not_found(run_id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "run_not_found",
            format!("no run with id `{run_id}`"),
        )
    }

    /// 500 `internal_error` for a store failure; the detail is logged, not sent.
    #[must_use]
    pub fn internal(error: &dyn std::fmt::Display) -> Self {
        tracing::error!(%error, "request failed");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "the server failed to handle the request; it was logged",
        )
    }
}

impl ApiError {
    /// 422 `invalid_body` in words for serde's message `located` (prefixed with the path of
    /// the offending value when there is one).
    #[must_use]
    pub(super) fn body_mismatch<T: Body>(located: &str) -> Self {
        body_mismatch::<T>(located)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, Json(self.0)).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(seconds) = self.1 {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

impl From<StoreError> for ApiError {
    /// 409 `external_id_taken` (field `external_id`) for a session id another session has;
    /// anything else is the server's fault (500).
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::ExternalIdTaken(_) => Self::new(
                StatusCode::CONFLICT,
                "external_id_taken",
                format!("{error}; give another id, or use that session"),
            )
            .field("external_id"),
            other => Self::internal(&other),
        }
    }
}

impl From<CancelError> for ApiError {
    /// The store's error as [`From<StoreError>`] maps it; the event log's is the server's
    /// fault (500, logged with its kind).
    fn from(error: CancelError) -> Self {
        match error {
            CancelError::Store(error) => error.into(),
            CancelError::Log(error) => Self::internal(&error),
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        match rejection {
            JsonRejection::JsonSyntaxError(e) => Self::new(
                StatusCode::BAD_REQUEST,
                "malformed_json",
                format!("the body is not valid JSON: {}", source_text(&e)),
            ),
            JsonRejection::JsonDataError(e) => {
                // axum reports the path to the offending value first: "input: invalid type …".
                let located = std::error::Error::source(&e)
                    .map(ToString::to_string)
                    .unwrap_or_else(|| source_text(&e));
                body_mismatch::<serde_json::Value>(&located)
            }
            JsonRejection::MissingJsonContentType(_) => Self::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "send the body as `Content-Type: application/json`",
            ),
            other if other.status() == StatusCode::PAYLOAD_TOO_LARGE => Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                "the body is larger than the server accepts",
            ),
            other => Self::new(other.status(), "invalid_body", other.body_text()),
        }
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        let QueryRejection::FailedToDeserializeQueryString(e) = &rejection else {
            return Self::new(
                StatusCode::BAD_REQUEST,
                "invalid_query",
                rejection.body_text(),
            );
        };
        // axum reports the offending parameter first: "limit: invalid digit found in string".
        let located = std::error::Error::source(e)
            .map(ToString::to_string)
            .unwrap_or_else(|| source_text(e));
        query_mismatch(&located)
    }
}

/// 400 `invalid_query` in words for serde's message about a query string, naming the parameter.
fn query_mismatch(located: &str) -> ApiError {
    let invalid = |detail: String| ApiError::new(StatusCode::BAD_REQUEST, "invalid_query", detail);
    if let Some(at) = located.find("unknown field `") {
        let name = located[at..].split('`').nth(1).unwrap_or_default();
        return invalid(format!(
            "unknown query parameter `{name}`; this route refuses parameters it does not know"
        ))
        .field(name);
    }
    let Some((name, _)) = located
        .split_once(": ")
        .filter(|(name, _)| !name.is_empty() && !name.contains(' '))
    else {
        return invalid("the query string is not valid for this route".to_owned());
    };
    let detail = match name {
        "limit" => "`limit` must be an integer from 1 to 200".to_owned(),
        "status" => format!(
            "`status` must be one of {}",
            RunStatus::ALL.map(RunStatus::as_str).join(", ")
        ),
        "wait" => "`wait` must be `true` or `false`".to_owned(),
        "session_id" => "`session_id` must be a UUID".to_owned(),
        other => format!("`{other}` has an invalid value"),
    };
    invalid(detail).field(name)
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_path",
            rejection.body_text(),
        )
    }
}

impl From<CreateRunError> for ApiError {
    fn from(error: CreateRunError) -> Self {
        let detail = error.to_string();
        match error {
            CreateRunError::MissingField(field) => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "missing_field", detail).field(field)
            }
            CreateRunError::InvalidField { field, .. } => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", detail).field(field)
            }
            CreateRunError::UnknownProvider(_) => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "unknown_provider", detail)
                    .field("provider")
            }
            CreateRunError::UnknownModel { .. } => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "unknown_model", detail).field("model")
            }
            CreateRunError::UnknownAgent(_) => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "unknown_agent", detail).field("agent")
            }
            CreateRunError::SessionNotFound(_) => {
                Self::new(StatusCode::NOT_FOUND, "session_not_found", detail).field("session_id")
            }
            CreateRunError::SessionBusy { active_run, .. } => {
                Self::new(StatusCode::CONFLICT, "session_busy", detail).run(active_run, None)
            }
            CreateRunError::IdempotencyKeyReused { existing, .. } => {
                Self::new(StatusCode::CONFLICT, "idempotency_key_reused", detail)
                    .field("client_request_id")
                    .run(existing, None)
            }
            CreateRunError::UnknownTool(_) => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "unknown_tool", detail).field("tools")
            }
            CreateRunError::ShuttingDown => Self::shutting_down(),
            CreateRunError::TooManyActiveRuns(_) => Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_active_runs",
                detail,
            )
            .retry_after(1),
            CreateRunError::InputTooLarge { field, .. } => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "input_too_large", detail).field(field)
            }
            CreateRunError::InstructionsTooLarge { .. } => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "input_too_large", detail)
                    .field("defaults.instructions")
            }
            CreateRunError::Webhook(crate::runtime::WebhookProblem::Disabled) => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "webhooks_disabled",
                detail,
            )
            .field("webhook"),
            CreateRunError::Webhook(crate::runtime::WebhookProblem::Invalid(_)) => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_webhook", detail)
                    .field("webhook.url")
            }
            CreateRunError::Store(error) => error.into(),
        }
    }
}

impl From<AnswerError> for ApiError {
    /// 404 `run_not_found`; 409 `run_not_waiting` (with the run's status: not, or no longer,
    /// waiting for answers of this kind; the deadline passed), 409 `action_conflict` (a call an
    /// earlier request answered otherwise, at the pause the run waits at or at one it has moved
    /// on from); 422 `unknown_tool_call`, `duplicate_tool_call`, `missing_tool_calls`
    /// naming the body's list field.
    fn from(error: AnswerError) -> Self {
        let detail = error.to_string();
        match error {
            AnswerError::RunNotFound(id) => Self::run_not_found(&id.to_string()),
            AnswerError::NotWaiting { status, .. } => {
                Self::new(StatusCode::CONFLICT, "run_not_waiting", detail).with_status(status)
            }
            AnswerError::Conflict(_) | AnswerError::AnsweredBefore { .. } => {
                Self::new(StatusCode::CONFLICT, "action_conflict", detail)
            }
            AnswerError::UnknownCall(_) => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "unknown_tool_call",
                detail,
            ),
            AnswerError::DuplicateCall(_) => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "duplicate_tool_call",
                detail,
            ),
            AnswerError::Missing(_) => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "missing_tool_calls",
                detail,
            ),
            AnswerError::Store(error) => Self::internal(&error),
        }
    }
}

/// `Retry-After` of a `shutting_down` refusal, in seconds: about what a restart or a load
/// balancer's switch to another replica takes.
const SHUTDOWN_RETRY_AFTER_SECS: u32 = 5;

/// `Retry-After` of a `too_many_watchers` refusal, in seconds.
const WATCHERS_RETRY_AFTER_SECS: u32 = 5;

/// Most bytes of a problem's `detail`; a longer one (one that would echo a long client value)
/// is cut with a `… (truncated)` marker.
pub const MAX_DETAIL_BYTES: usize = 400;

/// Most bytes of a problem's `field`.
const MAX_FIELD_BYTES: usize = 100;

/// `text` cut to at most `max` bytes (at a character boundary) plus `… (truncated)`.
fn clip(mut text: String, max: usize) -> String {
    const MARKER: &str = "… (truncated)";
    if text.len() <= max {
        return text;
    }
    let mut cut = max.saturating_sub(MARKER.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text.truncate(cut);
    text.push_str(MARKER);
    text
}

/// 422 `invalid_body` for a JSON body of the wrong shape, in words rather than serde's (which
/// name Rust types, "untagged enum", "expected u32"): `located` is serde's message, prefixed
/// with the path of the offending value when there is one.
fn body_mismatch<T: Body>(located: &str) -> ApiError {
    let invalid =
        |detail: String| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_body", detail);
    let quoted = |message: &str| message.split('`').nth(1).map(str::to_owned);
    if let Some(at) = located.find("unknown field `") {
        let name = quoted(&located[at..]).unwrap_or_default();
        // Inside a field's value (`defaults.colour: unknown field …`): that field is at fault.
        let top = located[..at]
            .split_once(": ")
            .map(|(path, _)| path.split(['.', '[']).next().unwrap_or(path))
            .filter(|top| !top.is_empty() && *top != "." && *top != name && !top.contains(' '));
        if let Some(top) = top {
            let expectation = T::expectation(top).unwrap_or("has the wrong shape");
            return invalid(format!("`{top}` {expectation}: unknown field `{name}`")).field(top);
        }
        return invalid(format!(
            "unknown field `{name}`; the body accepts {}",
            T::FIELDS.join(", ")
        ))
        .field(&name);
    }
    if let Some(at) = located.find("missing field `") {
        // A required field absent: its path (`resume[0].interruptId`), the top-level field as
        // `field`.
        let name = quoted(&located[at..]).unwrap_or_default();
        let path = match located[..at].strip_suffix(": ") {
            Some(parent) if !parent.is_empty() && parent != "." && !parent.contains(' ') => {
                format!("{parent}.{name}")
            }
            _ => name,
        };
        let top = path.split(['.', '[']).next().unwrap_or(&path).to_owned();
        return invalid(format!("`{path}` is required")).field(&top);
    }
    match located.split_once(": ") {
        Some((path, _)) if !path.is_empty() && path != "." && !path.contains(' ') => {
            let top = path.split(['.', '[']).next().unwrap_or(path);
            let mut detail = match T::expectation(top) {
                Some(expectation) => format!("`{top}` {expectation}"),
                None => format!("`{top}` has the wrong type"),
            };
            if path != top {
                detail.push_str(&format!(" (at `{path}`)"));
            }
            invalid(detail).field(top)
        }
        _ => {
            let message = located.strip_prefix(". ").unwrap_or(located);
            if message.starts_with("duplicate field") {
                let name = quoted(message).unwrap_or_default();
                invalid(format!("the field `{name}` is given twice")).field(&name)
            } else if message.starts_with("invalid type") {
                invalid("the body must be a JSON object".to_owned())
            } else {
                invalid("the body does not match the schema".to_owned())
            }
        }
    }
}

/// The innermost error text (serde's message names the field and position).
fn source_text(error: &dyn std::error::Error) -> String {
    let mut current = error;
    while let Some(source) = current.source() {
        current = source;
    }
    current.to_string()
}
