//! Sessions and their message history.

use axum::extract::State;

use super::extract::Path;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::extract::{Body, Json, NoBody, Query};
use super::page::Page;
use super::{ApiError, AppState, Problem};
use crate::domain::{
    Compaction, CreateSessionRequest, Message, MessageId, RequestProblem, Session, SessionId,
    UpdateSessionRequest,
};
use crate::runtime::CompactError;
use crate::store::{SessionPatch, StoreError};

impl Body for CreateSessionRequest {
    const FIELDS: &'static [&'static str] = &["title", "metadata", "defaults", "external_id"];
    fn expectation(field: &str) -> Option<&'static str> {
        Some(match field {
            "title" => "must be a string",
            "external_id" => "must be a string",
            "metadata" => "must be a JSON object",
            "defaults" => {
                "must be an object of agent, provider, model, instructions (strings) and \
                 parameters ({temperature, top_p, max_output_tokens, stop, seed, \
                 parallel_tool_calls}), no other keys"
            }
            _ => return None,
        })
    }
}

impl Body for UpdateSessionRequest {
    const FIELDS: &'static [&'static str] = &["title", "metadata"];
    fn expectation(field: &str) -> Option<&'static str> {
        Some(match field {
            "title" => "must be a string or null",
            "metadata" => "must be a JSON object",
            _ => return None,
        })
    }
}

/// Create a session.
///
/// Its title, metadata, and the defaults its runs take when they do not say (agent,
/// provider, model, instructions, parameters). `POST /runs` without a
/// `session_id` creates one too; a session made here starts empty, and its first run fills in
/// the defaults it lacks with that run's agent, provider, model and instructions. An
/// `external_id` is the id a web client keeps for the conversation (a `useChat` chat id, an
/// AG-UI `threadId`): `POST /chat` and `POST /ag-ui` find the session by it.
#[utoipa::path(post, path = "/sessions", tag = "sessions",
    request_body(content = CreateSessionRequest, description = "The session's title, metadata and run defaults (every field optional)", example = json!({
        "title": "Support chat",
        "metadata": {"customer": "c-42"},
        "defaults": {"provider": "demo", "model": "demo", "instructions": "Answer in French.",
                     "parameters": {"temperature": 0.2}}
    })),
    responses(
        (status = 201, description = "Created; `Location` is the session", body = Session,
            headers(("Location" = String, description = "`/sessions/{session_id}`"))),
        (status = 400, description = "`malformed_json`", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "`payload_too_large`", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "`unsupported_media_type`", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`external_id_taken`: another session has this `external_id`", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`invalid_field` (`title` over 1000 bytes, `metadata` not an object or over 16384 bytes, a parameter out of range or above the model's own (`max_output_tokens`, `field: defaults`), a NUL character, blank `instructions`, a `model` without its `provider`, `external_id` not 1 to 255 characters of `A-Z a-z 0-9 - _ . : ~` or `.`/`..`), `input_too_large` (`defaults.instructions` that no run could send: with a one-word input and the tools such a run offers, over the context window less the answer's `max_output_tokens` of the model the defaults or their agent name; nothing is stored), `unknown_agent`, `unknown_provider`, `unknown_model` (`field`: `defaults.agent`, `defaults.provider`, `defaults.model`), `invalid_body`; `field` names the field", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn create_session(
    State(state): State<AppState>,
    Json(request): Json<CreateSessionRequest>,
) -> Result<Response, ApiError> {
    let session = state
        .runtime
        .create_session(request)
        .await
        .map_err(|error| {
            // A name the server does not know is a field of the defaults, as the body says it.
            let error = ApiError::from(error);
            match error.field_name() {
                Some(field @ ("agent" | "provider" | "model")) => {
                    let field = format!("defaults.{field}");
                    error.field(&field)
                }
                _ => error,
            }
        })?;
    let location = format!("/sessions/{}", session.id);
    Ok((
        StatusCode::CREATED,
        [(axum::http::header::LOCATION, location)],
        axum::Json(session),
    )
        .into_response())
}

/// Change a session's title or metadata.
///
/// The fields given replace the session's (`"title": null` removes the title); the others
/// stay.
#[utoipa::path(patch, path = "/sessions/{session_id}", tag = "sessions",
    params(("session_id" = String, Path, format = Uuid, description = "Session id")),
    request_body(content = UpdateSessionRequest, description = "The title and/or metadata to set", example = json!({"title": "Billing question"})),
    responses(
        (status = 200, description = "The session as changed", body = Session),
        (status = 400, description = "`malformed_json`", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "`session_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "`payload_too_large`", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "`unsupported_media_type`", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`invalid_field` (`title` over 1000 bytes, `metadata` not an object or over 16384 bytes, a NUL character), `invalid_body`; `field` names the field", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn update_session(
    State(state): State<AppState>,
    Path(raw): Path<String>,
    Json(request): Json<UpdateSessionRequest>,
) -> Result<axum::Json<Session>, ApiError> {
    let id = parse_session_id(&raw)?;
    request.check().map_err(|problem| match problem {
        RequestProblem::Invalid { field, reason } => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_field",
            format!("`{field}`: {reason}"),
        )
        .field(field),
        RequestProblem::Missing(field) => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "missing_field",
            format!("`{field}` is required"),
        )
        .field(field),
    })?;
    let patch = SessionPatch {
        title: request.title,
        metadata: request.metadata,
    };
    state
        .runtime
        .store()
        .update_session(id, &patch, chrono::Utc::now())
        .await?
        .map(axum::Json)
        .ok_or_else(|| session_not_found(&raw))
}

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
    /// Pass as `cursor` for the next page; `null` on the last page (always present).
    #[schema(required = true)]
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

/// A page of the session's messages, oldest first.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct SessionMessages {
    /// Up to `limit` messages: user inputs, assistant replies (with tool calls), tool results;
    /// fewer when they pass the server's byte budget (`runtime.max_page_bytes`).
    pub messages: Vec<Message>,
    /// Pass as `cursor` for the rest; `null` when `messages` ends the history (always
    /// present).
    #[serde(default)]
    #[schema(required = true)]
    pub next_cursor: Option<String>,
    /// The compactions made at a message of this page, in order: each one's summary replaces,
    /// in the requests after it, every message up to its `through_message_id` (the latest user
    /// input stays verbatim). Every original message stays in `messages`.
    pub compactions: Vec<Compaction>,
}

/// Query of `GET /sessions/{session_id}/messages`; an unknown parameter is 400 `invalid_query`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct MessagesQuery {
    /// Page size, 1 to 200; default 50. A page may hold fewer when its messages pass the
    /// server's byte budget (`runtime.max_page_bytes`, default 1 MiB); `next_cursor` continues.
    #[param(minimum = 1, maximum = 200)]
    limit: Option<u32>,
    /// `next_cursor` of the previous answer, unchanged (today the id of its last message).
    #[param(value_type = Option<String>, format = Uuid)]
    cursor: Option<String>,
}

/// A session's message history.
///
/// Its messages oldest first: roles, content parts, tool calls and tool results, the text of a
/// model call cut off by its run's end (`status: incomplete`), and where each compaction
/// happened with its summary (`compactions`). A page holds up to `limit` messages and stops
/// once they pass the server's byte budget (`runtime.max_page_bytes`, default 1 MiB; the
/// message that passes it is included); `next_cursor` continues. Each page reads only its own
/// messages from the store.
#[utoipa::path(get, path = "/sessions/{session_id}/messages", tag = "sessions",
    params(("session_id" = String, Path, format = Uuid, description = "Session id"), MessagesQuery),
    responses(
        (status = 200, description = "A page of messages, oldest first", body = SessionMessages),
        (status = 400, description = "`invalid_cursor` (not a cursor this server returned for this session); `invalid_query` (`limit` out of 1–200, an unknown parameter)", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "`session_not_found`", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn list_session_messages(
    State(state): State<AppState>,
    Path(session_id): Path<String>,
    Query(query): Query<MessagesQuery>,
) -> Result<axum::Json<SessionMessages>, ApiError> {
    let session = load_session(&state, &session_id).await?;
    let invalid_cursor = || {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_cursor",
            "the cursor is not one this server returned for this session",
        )
        .field("cursor")
    };
    let page = Page::<MessageId>::parse(query.limit, None)?;
    let after = query
        .cursor
        .as_deref()
        .map(|cursor| cursor.parse::<MessageId>().map_err(|_| invalid_cursor()))
        .transpose()?;
    let mut messages = state
        .runtime
        .store()
        .session_messages_page(session.id, after, page.fetch())
        .await?
        .ok_or_else(invalid_cursor)?;
    let max_bytes = state.runtime.config().max_page_bytes;
    let next_cursor = page.finish(&mut messages, max_bytes, |m| m.id.to_string());
    let on_page: std::collections::HashSet<MessageId> = messages.iter().map(|m| m.id).collect();
    let compactions = state
        .runtime
        .store()
        .session_compactions(session.id)
        .await?
        .into_iter()
        .filter(|c| on_page.contains(&c.through_message_id))
        .collect();
    Ok(axum::Json(SessionMessages {
        messages,
        next_cursor,
        compactions,
    }))
}

/// Compact a session now.
///
/// The context its next run would start from is summarised — older
/// turns replaced by a summary, the newest kept verbatim, as an automatic compaction does — by
/// the compaction model (`/compaction`'s `provider`/`model`, else the model of the session's
/// latest run). The original messages stay; the compaction is listed with them at
/// `GET /sessions/{session_id}/messages`. A failure counts for the circuit breaker.
#[utoipa::path(post, path = "/sessions/{session_id}/compact", tag = "sessions",
    params(("session_id" = String, Path, format = Uuid, description = "Session id")),
    responses(
        (status = 200, description = "The compaction made", body = Compaction),
        (status = 400, description = "`unexpected_body`: the request has a body; this route takes none", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "`session_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`session_busy`: a run is active (its id is `run_id`); `nothing_to_compact`: everything fits in what compaction keeps verbatim (`tail_turns`, `keep_tokens`), or the older turns hold too few tokens for a summary to shrink them (64 besides the summary's heading); `compaction_circuit_open`: the circuit breaker is open (reset it first); `model_not_configured`: the session's model is no longer configured", body = Problem, content_type = "application/problem+json"),
        (status = 502, description = "`compaction_failed`: the summariser failed, returned an empty summary, or its summary did not shrink the context (counted by the circuit breaker)", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn compact_session(
    State(state): State<AppState>,
    Path(raw): Path<String>,
    _: NoBody,
) -> Result<axum::Json<Compaction>, ApiError> {
    let id = parse_session_id(&raw)?;
    match state.runtime.compact_session(id).await {
        Ok(compaction) => Ok(axum::Json(compaction)),
        Err(error) => {
            let detail = error.to_string();
            Err(match error {
                CompactError::SessionNotFound(_) => session_not_found(&raw),
                CompactError::SessionBusy(run_id) => {
                    ApiError::new(StatusCode::CONFLICT, "session_busy", detail).run(run_id, None)
                }
                CompactError::NothingToCompact(_) => {
                    ApiError::new(StatusCode::CONFLICT, "nothing_to_compact", detail)
                }
                CompactError::CircuitOpen(_) => {
                    ApiError::new(StatusCode::CONFLICT, "compaction_circuit_open", detail)
                }
                CompactError::ModelGone(_) => {
                    ApiError::new(StatusCode::CONFLICT, "model_not_configured", detail)
                }
                CompactError::Failed(_) => {
                    ApiError::new(StatusCode::BAD_GATEWAY, "compaction_failed", detail)
                }
                CompactError::Store(error) => error.into(),
            })
        }
    }
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
