//! RunService over REST: create (JSON or event stream), list, get, output, cancel, watch.

use std::time::Duration;

use axum::extract::{FromRequest, State};

use super::extract::Path;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::auth::Caller;
use super::extract::{Json, NoBody, Query};
use super::formats::{self, Format};
use super::limits::WatcherPermit;
use super::page::RunListQuery;
use super::{ApiError, AppState, Problem, sse};
use crate::domain::{
    CreateRunRequest, CreateRunResponse, FinishReason, Role, RunId, RunOutput, RunRecord, RunStatus,
};
use crate::events::AgentEvent;
use crate::runtime::{CancelOutcome, CreatedRun, TraceContext};
use crate::store::RunFilter;

fn parse_run_id(raw: &str) -> Result<RunId, ApiError> {
    raw.parse().map_err(|_| ApiError::run_not_found(raw))
}

pub(super) async fn load_run(state: &AppState, raw: &str) -> Result<RunRecord, ApiError> {
    let run_id = parse_run_id(raw)?;
    state
        .runtime
        .store()
        .get_run(run_id)
        .await?
        .ok_or_else(|| ApiError::run_not_found(raw))
}

/// Starts the run a create request describes; the `Idempotency-Key` header stands in for a
/// missing `client_request_id`.
pub(super) async fn start_run(
    state: &AppState,
    caller: Caller,
    headers: &HeaderMap,
    mut request: CreateRunRequest,
) -> Result<CreatedRun, ApiError> {
    state.limits.admit_run(caller)?;
    if let Some(key) = headers.get("idempotency-key") {
        let key = key
            .to_str()
            .ok()
            .filter(|key| crate::domain::is_idempotency_key(key))
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_header",
                    format!("Idempotency-Key {}", crate::domain::IDEMPOTENCY_KEY_RULE),
                )
                .field("Idempotency-Key")
            })?;
        match &request.client_request_id {
            None => request.client_request_id = Some(key.to_owned()),
            Some(body_key) if body_key != key => {
                return Err(ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "invalid_field",
                    "the Idempotency-Key header and client_request_id differ",
                )
                .field("client_request_id"));
            }
            _ => {}
        }
    }
    Ok(state
        .runtime
        .create_run(request, trace_context(headers))
        .await?)
}

fn run_headers(created: &CreatedRun) -> Result<Vec<(header::HeaderName, HeaderValue)>, ApiError> {
    let id = created.record.id;
    let mut headers = vec![
        (
            header::LOCATION,
            HeaderValue::from_str(&format!("/runs/{id}")).map_err(|e| ApiError::internal(&e))?,
        ),
        (
            header::HeaderName::from_static("x-run-id"),
            HeaderValue::from_str(&id.to_string()).map_err(|e| ApiError::internal(&e))?,
        ),
    ];
    if created.replayed {
        headers.push((
            header::HeaderName::from_static("idempotent-replayed"),
            HeaderValue::from_static("true"),
        ));
    }
    Ok(headers)
}

fn trace_context(headers: &HeaderMap) -> Option<TraceContext> {
    headers
        .get("traceparent")
        .and_then(|value| value.to_str().ok())
        .and_then(TraceContext::from_traceparent)
}

/// Start a run (proto `RunService.CreateRun`).
///
/// Returns at once; watch its events at `/runs/{run_id}/events`. A W3C `traceparent` header
/// continues the caller's trace: it sets the events' `trace_id`, and the run's span is a child
/// of the caller's.
///
/// The run is defined by its fields, over its agent preset (`agent`, `GET /agents`) and its
/// session's defaults: `instructions` (the system prompt), model parameters (`temperature`,
/// `top_p`, `max_output_tokens`, `stop`, `seed`, `parallel_tool_calls`), `provider_options`,
/// `tools` (server tools by name, and tools the run defines for the client to execute) and
/// `approval`. A call to a tool the run defined pauses it in `requires_action` until the client
/// posts the output (`POST /runs/{run_id}/tool_outputs`, which shows the whole round trip); a
/// call to a server tool that needs approval waits for `POST /runs/{run_id}/approvals`.
#[utoipa::path(post, path = "/runs", tag = "runs",
    request_body(content = CreateRunRequest, description = "The run: its input, provider and model (or an agent preset or the session's defaults), optionally a session to continue, instructions, model parameters, tools, tool choice, limits and metadata", examples(
        ("demo" = (summary = "The built-in model, no configuration needed",
            value = json!({"provider": "demo", "model": "demo", "input": "What time is it?"}))),
        ("client_tools" = (summary = "Tools the client executes (see POST /runs/{run_id}/tool_outputs)",
            value = json!({"provider": "demo", "model": "demo",
                "input": "call get_location and call get_weather",
                "instructions": "Answer in one sentence.", "temperature": 0.2,
                "tools": [{"name": "get_location", "description": "Where the user is"},
                          {"name": "get_weather", "description": "The weather where the user is"}]}))),
        ("agent" = (summary = "An agent preset, one field overridden",
            value = json!({"agent": "support", "input": "Where is my order?", "temperature": 0.7})))
    )),
    params(
        ("traceparent" = Option<String>, Header, nullable = false, description = "W3C trace context of the caller"),
        ("Idempotency-Key" = Option<String>, Header, nullable = false, min_length = 1, max_length = 255, pattern = "^[!-~]+$", description = "Stands in for `client_request_id` (1 to 255 visible ASCII characters, `!` to `~`)"),
    ),
    responses(
        (status = 202, description = "Run created (or, with `Idempotent-Replayed: true`, the run an earlier identical request created); `Location` is the run", body = CreateRunResponse,
            headers(("Location" = String, description = "`/runs/{run_id}`"),
                    ("Idempotent-Replayed" = Option<String>, description = "`true` when an earlier identical request created the run"))),
        (status = 400, description = "`malformed_json`; `invalid_header` (`Idempotency-Key` not 1 to 255 visible ASCII characters `!`..`~`); `duplicate_header` (`Idempotency-Key` given twice)", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "`session_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`session_busy` (with the active `run_id`), `idempotency_key_reused`", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "`payload_too_large`", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "`unsupported_media_type`", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "`shutting_down`: the server is draining its runs before it stops and admits none; retry after `Retry-After` seconds (the next process, or another replica, takes the run)", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = String, description = "Seconds to wait before retrying"))),
        (status = 429, description = "`rate_limited`: this API key created runs faster than `[limits] runs_per_minute`; `too_many_active_runs`: `[runtime] max_active_runs` runs are active (a create is refused, not queued); retry after `Retry-After` seconds", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = String, description = "Seconds to wait before retrying"))),
        (status = 422, description = "`missing_field` (`input` absent, or `provider`/`model` absent and not given by the agent or the session), `invalid_field` (empty or blank, NUL character, `metadata` or `provider_options` not an object or over 16384 bytes, `provider_options` setting a key behest owns, `max_iterations` or `action_timeout_ms` out of range, a model parameter out of range — `max_output_tokens` above the model's, `temperature` above 1, a `seed` or a whitespace-only `stop` sequence for an Anthropic provider — `client_request_id` not 1 to 255 visible ASCII characters, more than 128 tool definitions, a tool definition with a bad name, a schema that is not an object schema, does not compile, has a `$ref` cycle that consumes no input, over 10000 subschemas or over 1000 applied to one value, a name used twice or a server tool's, `approval` naming no server tool of the run, `tool_choice` without tools or naming none of the run's), `input_too_large` (the input with the run's instructions and tool definitions, estimated as compaction estimates a request, does not fit the model's `context_window` less the answer's `max_output_tokens`: nothing is stored), `unknown_agent`, `unknown_provider`, `unknown_model`, `unknown_tool`, `invalid_body` (not a JSON object, a field of the wrong type, an unknown field); `field` names the field", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn create_run(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Json(request): Json<CreateRunRequest>,
) -> Result<Response, ApiError> {
    let created = start_run(&state, caller, &headers, request).await?;
    let body = CreateRunResponse {
        run_id: created.record.id,
        session_id: created.record.session_id,
    };
    let mut response = (StatusCode::ACCEPTED, axum::Json(body)).into_response();
    response.headers_mut().extend(run_headers(&created)?);
    Ok(response)
}

/// Start a run and stream its events from sequence 1 (proto `RunService.CreateRunStream`).
///
/// The response's `X-Run-Id` header names the run; a client that disconnects resumes at
/// `/runs/{run_id}/events` with `Last-Event-ID`. Disconnecting never cancels the run.
#[utoipa::path(post, path = "/runs/stream", tag = "runs",
    request_body(content = CreateRunRequest, description = "The run: provider, model and input, optionally a session to continue, tools, tool choice, limits and metadata"),
    params(
        ("traceparent" = Option<String>, Header, nullable = false, description = "W3C trace context of the caller"),
        ("Idempotency-Key" = Option<String>, Header, nullable = false, min_length = 1, max_length = 255, pattern = "^[!-~]+$", description = "Stands in for `client_request_id` (1 to 255 visible ASCII characters, `!` to `~`); a retry attaches to the existing run's stream from sequence 1"),
        StreamQuery
    ),
    responses(
        (status = 200, description = "Server-Sent Events: `id:` = sequence, `event:` = type, `data:` = the event JSON",
            content_type = "text/event-stream", body = AgentEvent,
            headers(("X-Run-Id" = String, description = "The new run's id"),
                    ("Location" = String, description = "`/runs/{run_id}`"))),
        (status = 400, description = "`malformed_json`; `invalid_header` (`Idempotency-Key` not 1 to 255 visible ASCII characters `!`..`~`); `duplicate_header` (`Idempotency-Key` given twice); `unknown_format` (`format` is none of `behest`, `ai-sdk`, `ai-sdk-v7`, `ag-ui`)", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "`session_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`session_busy`, `idempotency_key_reused`", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "`payload_too_large`", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "`unsupported_media_type`", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "`run_events_expired`: an identical earlier request created the run, which has ended and whose events retention removed (`GET /runs/{run_id}` still answers)", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "`shutting_down`: as `POST /runs`; `too_many_watchers`: `[limits] max_watchers` event streams are open, or `max_watchers_per_key` for this API key (no run is started)", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = String, description = "Seconds to wait before retrying"))),
        (status = 429, description = "`rate_limited`, `too_many_active_runs`: as `POST /runs`", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = String, description = "Seconds to wait before retrying"))),
        (status = 422, description = "As `POST /runs`: `missing_field`, `invalid_field`, `unknown_agent`, `unknown_provider`, `unknown_model`, `unknown_tool`, `invalid_body`", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn create_run_stream(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Query(query): Query<StreamQuery>,
    body: axum::extract::Request,
) -> Result<Response, ApiError> {
    // The query before the body: a bad `format` is a 400 whatever the body is.
    let format = Format::parse(query.format.as_deref())?;
    let Json(request) = Json::<CreateRunRequest>::from_request(body, &state).await?;
    // The stream's place is taken before the run starts: a refused stream starts no run.
    let permit = state.limits.open_watcher(caller)?;
    let created = start_run(&state, caller, &headers, request).await?;
    if created.record.events_removed_at.is_some() {
        return Err(events_expired(&created.record));
    }
    // A retry with the same key attaches to the existing run's stream, from sequence 1.
    let mut response = match format {
        Format::Behest => event_stream(&state, created.record.id, 0, permit),
        format => formats::stream(&state, &created.record, format, None, permit).await?,
    };
    response.headers_mut().extend(run_headers(&created)?);
    Ok(response)
}

/// A page of runs, newest first (proto `ListRunsResponse`).
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ListRunsResponse {
    /// The runs.
    pub runs: Vec<RunRecord>,
    /// Pass as `cursor` for the next page; `null` on the last page (always present).
    #[schema(required = true)]
    pub next_cursor: Option<String>,
}

/// List runs, newest first (proto `RunService.ListRuns`).
///
/// Optionally only one session's runs, or those with one status. Pass `next_cursor` back as
/// `cursor` for the next page; a page ends at `limit` runs or once its JSON passes the
/// server's byte budget (`runtime.max_page_bytes`).
#[utoipa::path(get, path = "/runs", tag = "runs",
    params(RunListQuery),
    responses(
        (status = 200, description = "A page of runs", body = ListRunsResponse),
        (status = 400, description = "`invalid_cursor` (not a cursor this server returned); `invalid_query` (`limit` out of 1–200, unknown `status`, `session_id` not a UUID, an unknown parameter)", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn list_runs(
    State(state): State<AppState>,
    Query(query): Query<RunListQuery>,
) -> Result<axum::Json<ListRunsResponse>, ApiError> {
    let (page, session_id) = query.parse()?;
    let filter = RunFilter {
        session_id,
        status: query.status,
        before: page.before,
        limit: page.fetch(),
    };
    let mut runs = state.runtime.store().list_runs(&filter).await?;
    let max_bytes = state.runtime.config().max_page_bytes;
    let next_cursor = page.finish(&mut runs, max_bytes, |run| run.id.to_string());
    Ok(axum::Json(ListRunsResponse { runs, next_cursor }))
}

/// Read a run (proto `RunService.GetRun`).
///
/// Its record as it is now: status, definition (agent, instructions, parameters, tools,
/// limits), iterations, usage so far, finish reason and error once it ended; while it is
/// `requires_action`, the tool calls it waits for (`required_action`).
#[utoipa::path(get, path = "/runs/{run_id}", tag = "runs",
    params(("run_id" = String, Path, format = Uuid, description = "Run id")),
    responses(
        (status = 200, description = "The run", body = RunRecord),
        (status = 404, description = "`run_not_found`", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_run(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
) -> Result<axum::Json<RunRecord>, ApiError> {
    Ok(axum::Json(load_run(&state, &run_id).await?))
}

/// What a finished run produced (proto `RunService.GetRunOutput`).
///
/// Its assistant messages, finish reason, iterations and total usage; `409 run_not_finished`
/// while it is still active. A run that ended in the middle of a model call (cancelled,
/// failed, interrupted) also shows the text it streamed, as an assistant message with
/// `status: incomplete`. A completed run with an `output_schema` has its answer parsed in
/// `parsed`.
#[utoipa::path(get, path = "/runs/{run_id}/output", tag = "runs",
    params(("run_id" = String, Path, format = Uuid, description = "Run id")),
    responses(
        (status = 200, description = "The run's output", body = RunOutput),
        (status = 404, description = "`run_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`run_not_finished`: the run is still active", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_run_output(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
) -> Result<axum::Json<RunOutput>, ApiError> {
    let record = load_run(&state, &run_id).await?;
    if !record.status.is_terminal() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "run_not_finished",
            format!(
                "the run is {}; its output exists once it ends",
                record.status.as_str()
            ),
        )
        .run(record.id, Some(record.status)));
    }
    let messages = state
        .runtime
        .store()
        .run_messages(record.id, Role::Assistant)
        .await?;
    let finish_reason = record.finish_reason.unwrap_or(match record.status {
        RunStatus::Failed => FinishReason::Error,
        _ => FinishReason::Unknown,
    });
    let parsed = crate::runtime::parsed_output(&record, &messages);
    Ok(axum::Json(RunOutput {
        parsed,
        run_id: record.id,
        session_id: record.session_id,
        status: record.status,
        iterations: record.iterations,
        finish_reason,
        total_usage: record.total_usage,
        messages,
        error: record.error,
        error_class: record.error_class,
    }))
}

/// Query of `POST /runs/{run_id}/cancel`; an unknown parameter is 400 `invalid_query`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct CancelQuery {
    /// Answer only after the run's terminal event (at most 30 s).
    #[serde(default)]
    wait: bool,
}

/// Cancel a run (proto `RunService.CancelRun`).
///
/// Stops the model call and the loop and ends the run with one `run_cancelled`. Every cancel of an active run gets `202` (`200` with
/// `wait=true` once the run is terminal), also when a concurrent cancel ended the run while
/// this request was being handled. A run waiting in `requires_action` is ended before the
/// answer (its record says `cancelled`, and the session accepts its next input at once); an
/// answer to its calls sent after the cancel gets `409 run_not_waiting`. A run that had
/// finished before the request arrived is left alone (409 with its status).
#[utoipa::path(post, path = "/runs/{run_id}/cancel", tag = "runs",
    params(("run_id" = String, Path, format = Uuid, description = "Run id"), CancelQuery),
    responses(
        (status = 200, description = "With `wait=true`: the run after its terminal event", body = RunRecord),
        (status = 202, description = "Cancellation requested, or the run was already cancelled (cancel is idempotent); the run as it is now", body = RunRecord),
        (status = 400, description = "`invalid_query`: `wait` is not `true`/`false`, or an unknown parameter; `unexpected_body`: the request has a body (this route takes none)", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "`run_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`run_finished`: the run had completed or failed; `run_status` says how", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn cancel_run(
    State(state): State<AppState>,
    Path(raw_id): Path<String>,
    Query(query): Query<CancelQuery>,
    _: NoBody,
) -> Result<Response, ApiError> {
    let run_id = parse_run_id(&raw_id)?;
    let outcome = state
        .runtime
        .cancel_run(run_id)
        .await?
        .ok_or_else(|| ApiError::run_not_found(&raw_id))?;
    let record = match outcome {
        CancelOutcome::AlreadyFinished(record) => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "run_finished",
                format!("the run already ended: {}", record.status.as_str()),
            )
            .run(record.id, Some(record.status)));
        }
        CancelOutcome::Cancelling(record) => record,
    };
    if !query.wait {
        return Ok((StatusCode::ACCEPTED, axum::Json(record)).into_response());
    }
    if record.status.is_terminal() {
        return Ok((StatusCode::OK, axum::Json(record)).into_response());
    }
    let after = state.runtime.store().last_sequence(run_id).await?;
    let drained = state
        .runtime
        .watch(run_id, after.saturating_sub(1))
        .for_each(|_| async {});
    let finished = tokio::time::timeout(Duration::from_secs(30), drained)
        .await
        .is_ok();
    let record = load_run(&state, &raw_id).await?;
    let status = if finished && record.status.is_terminal() {
        StatusCode::OK
    } else {
        StatusCode::ACCEPTED
    };
    Ok((status, axum::Json(record)).into_response())
}

/// Query of `GET /runs/{run_id}/events`. Unlike the other routes, unknown parameters are
/// ignored here: `EventSource` clients add cache-busters and tokens they cannot leave out.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct WatchQuery {
    /// Resume after this sequence (proto `WatchRunEventsRequest.last_event_id`): decimal digits
    /// only; empty means from the start. A non-empty `Last-Event-ID` header takes precedence;
    /// an empty one is ignored.
    /// (For the formats other than `behest`, also `sequence.frame`: see `format`.)
    #[param(pattern = "^0*[0-9]{0,19}(\\.0*[1-9][0-9]{0,9})?$")]
    last_event_id: Option<String>,
    /// How events are rendered: `behest` (the default: `id:` = sequence, `event:` = type,
    /// `data:` = the event), `ai-sdk` (the AI SDK UI message stream in the chunks both `ai` 6
    /// and `ai` 7 accept), `ai-sdk-v7` (adds the chunks only `ai` 7 accepts) or `ag-ui` (AG-UI
    /// 1.0 events). In those three, one event may give several frames: their ids are
    /// `N.1 … N.(k-1)`, `N`, and a cursor `N.j` resumes after frame `j` of event `N`; an
    /// AG-UI resume begins with a prelude (`RUN_STARTED` and the open step, reasoning, text
    /// and tool calls) whose frames carry the cursor as id. Anything else: 400
    /// `unknown_format`.
    #[param(pattern = "^(behest|ai-sdk|ai-sdk-v7|ag-ui)?$")]
    format: Option<String>,
}

/// Query of `POST /runs/stream`; unknown parameters are ignored.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct StreamQuery {
    /// How events are rendered: `behest` (the default), `ai-sdk`, `ai-sdk-v7` or `ag-ui`, as
    /// for `GET /runs/{run_id}/events`; anything else: 400 `unknown_format` (no run is
    /// started).
    #[param(pattern = "^(behest|ai-sdk|ai-sdk-v7|ag-ui)?$")]
    format: Option<String>,
}

/// Parses a resume cursor: exactly decimal digits (`0`, `42`; not `+5`, ` 5`, `5.0`, `-1`),
/// at most 19 of them after leading zeros (what the spec's pattern says; always 64 bits).
fn parse_cursor(raw: &str) -> Result<u64, ApiError> {
    let digits = !raw.is_empty()
        && raw.bytes().all(|b| b.is_ascii_digit())
        && raw.trim_start_matches('0').len() <= 19;
    digits
        .then(|| raw.parse::<u64>().ok())
        .flatten()
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_cursor",
                format!("`{raw}` is not an event sequence number (decimal digits)"),
            )
            .field("last_event_id")
        })
}

/// Watch a run's events (proto `RunService.WatchRunEvents`).
///
/// Replay after the cursor, then live, each sequence exactly once, ending after the terminal
/// event. Keep-alive comments every ~15 s. A browser `EventSource` cannot set headers: it may
/// pass the API key as `?access_token=` (this route only; never logged).
/// When the server shuts down the stream ends early, with no terminal event: reconnect with
/// `Last-Event-ID` (as `EventSource` does by itself) to continue at the next process, gaplessly.
#[utoipa::path(get, path = "/runs/{run_id}/events", tag = "runs",
    params(
        ("run_id" = String, Path, format = Uuid, description = "Run id"),
        ("Last-Event-ID" = Option<String>, Header, nullable = false, description = "Resume after this sequence (what EventSource sends): decimal digits only; an empty header is ignored. With `format` other than `behest`, also `sequence.frame` (after that frame of the event)", pattern = "^0*[0-9]{0,19}(\\.0*[1-9][0-9]{0,9})?$"),
        WatchQuery
    ),
    responses(
        (status = 200, description = "Server-Sent Events: `id:` = sequence, `event:` = type, `data:` = the event JSON",
            content_type = "text/event-stream", body = AgentEvent),
        (status = 204, description = "The cursor is at or past the terminal event of a finished run: nothing more will come"),
        (status = 400, description = "`duplicate_header`: `Last-Event-ID` given twice. `invalid_cursor`: the cursor is not decimal digits (`+5`, ` 5`, `5.0`, `-1` are refused) or exceeds 64 bits (in a format other than `behest`: not `N` or `N.j` with `j` ≥ 1), or is beyond the last event of a run that has not ended; `unknown_format`: `format` is none of `behest`, `ai-sdk`, `ai-sdk-v7`, `ag-ui`", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "`run_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "`run_events_expired`: the run ended more than `[runtime] event_retention_secs` ago and its events were removed (its record, session and messages are kept)", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "`shutting_down`: the server is draining before it stops; reconnect after `Retry-After` seconds (to the next process, which continues the stream from `Last-Event-ID`). `too_many_watchers`: `[limits] max_watchers` event streams are open, or `max_watchers_per_key` for this API key; retry after `Retry-After` seconds", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = String, description = "Seconds to wait before retrying"))),
    ))]
pub async fn watch_run_events(
    State(state): State<AppState>,
    caller: Caller,
    Path(raw_id): Path<String>,
    headers: HeaderMap,
    Query(query): Query<WatchQuery>,
) -> Result<Response, ApiError> {
    let format = Format::parse(query.format.as_deref())?;
    if format != Format::Behest {
        let header = headers
            .get("last-event-id")
            .map(|value| value.to_str().unwrap_or("\u{fffd}"))
            .filter(|value| !value.is_empty());
        let from_query = match query.last_event_id.as_deref() {
            None | Some("") => None,
            Some(raw) => Some(format.cursor(raw)?),
        };
        let after = match header {
            Some(raw) => Some(format.cursor(raw)?),
            None => from_query,
        };
        let record = load_run(&state, &raw_id).await?;
        return formats::respond(&state, caller, &record, format, after).await;
    }
    let header = headers
        .get("last-event-id")
        .map(|value| value.to_str().unwrap_or("\u{fffd}"))
        .filter(|value| !value.is_empty());
    // A malformed query cursor is refused even when a header wins over it.
    let from_query = match query.last_event_id.as_deref() {
        None | Some("") => None,
        Some(raw) => Some(parse_cursor(raw)?),
    };
    let after = match header {
        Some(raw) => parse_cursor(raw)?,
        None => from_query.unwrap_or(0),
    };
    let record = load_run(&state, &raw_id).await?;
    if record.events_removed_at.is_some() {
        return Err(events_expired(&record));
    }
    // Streams end at the start of a drain; a new one would end at once, empty.
    if state.runtime.is_stopping() {
        return Err(ApiError::shutting_down());
    }
    if after > 0 {
        let last = state.runtime.store().last_sequence(record.id).await?;
        if record.status.is_terminal() && after >= last {
            return Ok(StatusCode::NO_CONTENT.into_response());
        }
        if after > last {
            return Err(ApiError::cursor_ahead(after, last));
        }
    }
    let permit = state.limits.open_watcher(caller)?;
    Ok(event_stream(&state, record.id, after, permit))
}

/// 410 `run_events_expired` for a run whose events retention removed.
fn events_expired(record: &RunRecord) -> ApiError {
    ApiError::new(
        StatusCode::GONE,
        "run_events_expired",
        "the run's events were removed by retention after it ended; the run record, its \
         session and messages are kept",
    )
    .run(record.id, Some(record.status))
}

/// The SSE response of a watch: frames `id:`/`event:`/`data:`, keep-alives, no caching or
/// proxy buffering; it ends after the terminal event or at shutdown. `permit` counts it
/// against the watcher caps while it is open.
fn event_stream(state: &AppState, run_id: RunId, after: u64, permit: WatcherPermit) -> Response {
    let frames = state
        .runtime
        .watch(run_id, after)
        .take_while(move |item| {
            if let Err(error) = item {
                tracing::warn!(%run_id, %error, "event stream ended by a store error");
            }
            std::future::ready(item.is_ok())
        })
        .filter_map(|item| std::future::ready(item.ok()))
        .map(move |frame| {
            let _open = &permit;
            frame.bytes.clone()
        })
        .take_until(state.shutdown.clone().cancelled_owned());
    sse::response(frames, &state.keep_alive)
}
