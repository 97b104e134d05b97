//! Sessions and their message history.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::extract::Query;
use super::page::Page;
use super::{ApiError, AppState, Problem};
use crate::domain::{Message, MessageId, Session, SessionId};
use crate::store::StoreError;

fn parse_session_id(raw: &str) -> Result<SessionId, ApiError> {
    raw.parse().map_err(|_| session_not_found(raw))
}

fn session_not_found(raw: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "session_not_found",
        format!("no session with id `{raw}`"),
    )
}

async fn load_session(state: &AppState, raw: &str) -> Result<Session, ApiError> {
    let id = parse_session_id(raw)?;
    state
        .runtime
        .store()
        .get_session(id)
        .await?
        .ok_or_else(|| session_not_found(raw))
}

/// Query of `GET /sessions`; an unknown parameter is 400 `invalid_query`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListSessionsQuery {
    /// Page size, 1 to 200; default 50. A page may hold fewer when its records pass the
    /// server's byte budget (`runtime.max_page_bytes`, default 1 MiB); `next_cursor` continues.
    #[param(minimum = 1, maximum = 200)]
    limit: Option<u32>,
    /// `next_cursor` of the previous page, unchanged (today the last session id of that page).
    #[param(value_type = Option<String>, format = Uuid)]
    cursor: Option<String>,
}

/// A page of sessions, newest first.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ListSessionsResponse {
    /// The sessions.
    pub sessions: Vec<Session>,
    /// Pass as `cursor` for the next page; absent on the last page.
    pub next_cursor: Option<String>,
}

/// List sessions, newest first.
///
/// A page of sessions by last activity, newest first; pass `next_cursor` back as `cursor` for
/// the next page. The page ends at `limit` sessions or once its JSON passes the server's byte
/// budget (`runtime.max_page_bytes`).
#[utoipa::path(get, path = "/sessions", tag = "sessions",
    params(ListSessionsQuery),
    responses(
        (status = 200, description = "A page of sessions", body = ListSessionsResponse),
        (status = 400, description = "`invalid_cursor` (not a cursor this server returned); `invalid_query` (`limit` out of 1–200, an unknown parameter)", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn list_sessions(
    State(state): State<AppState>,
    Query(query): Query<ListSessionsQuery>,
) -> Result<axum::Json<ListSessionsResponse>, ApiError> {
    let page = Page::<SessionId>::parse(query.limit, query.cursor.as_deref())?;
    let mut sessions = state
        .runtime
        .store()
        .list_sessions(page.before, page.fetch())
        .await?;
    let max_bytes = state.runtime.config().max_page_bytes;
    let next_cursor = page.finish(&mut sessions, max_bytes, |session| session.id.to_string());
    Ok(axum::Json(ListSessionsResponse {
        sessions,
        next_cursor,
    }))
}

/// Read a session.
///
/// The session's record: its id, when it was created and when it was last active (its
/// messages are at `/sessions/{session_id}/messages`, its runs at `/runs?session_id=`).
#[utoipa::path(get, path = "/sessions/{session_id}", tag = "sessions",
    params(("session_id" = String, Path, format = Uuid, description = "Session id")),
    responses(
        (status = 200, description = "The session", body = Session),
        (status = 404, description = "`session_not_found`", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_session(
    State(state): State<AppState>,
    Path(session_id): Path<String>,
) -> Result<axum::Json<Session>, ApiError> {
    Ok(axum::Json(load_session(&state, &session_id).await?))
}

/// The session's messages, oldest first.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct SessionMessages {
    /// Every message: user inputs, assistant replies (with tool calls), tool results; fewer
    /// when they pass the server's byte budget (`runtime.max_page_bytes`).
    pub messages: Vec<Message>,
    /// Pass as `cursor` for the rest; absent when `messages` ends the history.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// Query of `GET /sessions/{session_id}/messages`; an unknown parameter is 400 `invalid_query`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct MessagesQuery {
    /// `next_cursor` of the previous answer, unchanged (today the id of its last message).
    #[param(value_type = Option<String>, format = Uuid)]
    cursor: Option<String>,
}

/// A session's message history.
///
/// Its messages oldest first: roles, content parts, tool calls and tool results. The answer
/// stops once its messages pass the server's byte budget (`runtime.max_page_bytes`, default
/// 1 MiB; the message that passes it is included); `next_cursor` continues.
#[utoipa::path(get, path = "/sessions/{session_id}/messages", tag = "sessions",
    params(("session_id" = String, Path, format = Uuid, description = "Session id"), MessagesQuery),
    responses(
        (status = 200, description = "The messages, oldest first", body = SessionMessages),
        (status = 400, description = "`invalid_cursor` (not a cursor this server returned); `invalid_query` (an unknown parameter)", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "`session_not_found`", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn list_session_messages(
    State(state): State<AppState>,
    Path(session_id): Path<String>,
    Query(query): Query<MessagesQuery>,
) -> Result<axum::Json<SessionMessages>, ApiError> {
    let session = load_session(&state, &session_id).await?;
    let mut messages = state.runtime.store().session_messages(session.id).await?;
    if let Some(cursor) = query.cursor.as_deref() {
        let position = cursor
            .parse::<MessageId>()
            .ok()
            .and_then(|id| messages.iter().position(|m| m.id == id))
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_cursor",
                    "the cursor is not one this server returned for this session",
                )
                .field("cursor")
            })?;
        messages.drain(..=position);
    }
    let page = Page::<MessageId> {
        limit: u32::try_from(messages.len()).unwrap_or(u32::MAX),
        before: None,
    };
    let max_bytes = state.runtime.config().max_page_bytes;
    let next_cursor = page.finish(&mut messages, max_bytes, |m| m.id.to_string());
    Ok(axum::Json(SessionMessages {
        messages,
        next_cursor,
    }))
}

/// Delete a session with its runs, messages and events.
///
/// Everything stored of the session goes, in one transaction. A session with an active run is
/// not deleted (409 `session_busy`): cancel the run first.
#[utoipa::path(delete, path = "/sessions/{session_id}", tag = "sessions",
    params(("session_id" = String, Path, format = Uuid, description = "Session id")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "`session_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`session_busy`: a run is active (its id is `run_id`)", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn delete_session(
    State(state): State<AppState>,
    Path(raw): Path<String>,
) -> Result<Response, ApiError> {
    let id = parse_session_id(&raw)?;
    match state.runtime.store().delete_session(id).await {
        Ok(true) => Ok(StatusCode::NO_CONTENT.into_response()),
        Ok(false) => Err(session_not_found(&raw)),
        Err(StoreError::SessionBusy { active_run, .. }) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "session_busy",
            format!("the session has an active run ({active_run}); cancel it first"),
        )
        .run(active_run, None)),
        Err(other) => Err(other.into()),
    }
}
