//! What a run paused in `requires_action` waits for: the outputs of the tools the client
//! executes (`POST /runs/{run_id}/tool_outputs`) and approvals of server tools
//! (`POST /runs/{run_id}/approvals`).

use axum::extract::State;

use super::extract::Path;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::auth::Caller;
use super::extract::{Body, Json};
use super::{ApiError, AppState, Problem};
use crate::domain::{ActionAnswer, PendingKind, RunId, RunRecord};
use crate::runtime::{Answer, AnswerError};

/// Body of `POST /runs/{run_id}/tool_outputs`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"tool_outputs": [
    {"call_id": "call_1", "output": {"city": "Paris"}},
    {"call_id": "call_2", "error": "the clock is not available"}
]}))]
pub struct ToolOutputsRequest {
    /// One entry per `client_tool` call of the run's `required_action`, all of them at once.
    pub tool_outputs: Vec<ToolOutput>,
}

/// A client tool's result: exactly one of `output` (success) and `error` (a failure the model
/// sees as one).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolOutput {
    /// The call answered (`required_action.tool_calls[].call_id`); no U+0000.
    #[schema(pattern = r"^[^\u0000]*$")]
    pub call_id: String,
    /// What the tool returned: any JSON value (a string reaches the model as text, anything
    /// else as JSON); cut to the server's `runtime.max_tool_output_bytes` like a server tool's.
    #[serde(default, deserialize_with = "present_value")]
    pub output: Option<serde_json::Value>,
    /// Why the tool failed; no U+0000.
    #[serde(default)]
    #[schema(pattern = r"^[^\u0000]*$")]
    pub error: Option<String>,
}

/// Distinguishes `"output": null` (a null output) from an absent `output`.
fn present_value<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(d).map(Some)
}

/// Body of `POST /runs/{run_id}/approvals`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"approvals": [
    {"call_id": "call_3", "approve": false, "reason": "not during business hours"}
]}))]
pub struct ApprovalsRequest {
    /// One entry per `approval` call of the run's `required_action`, all of them at once.
    pub approvals: Vec<Approval>,
}

/// A decision on one server tool call that needs approval.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Approval {
    /// The call decided on; no U+0000.
    #[schema(pattern = r"^[^\u0000]*$")]
    pub call_id: String,
    /// `true`: the tool runs; `false`: it does not, and the model sees a `Failure`
    /// "rejected by the user: <reason>".
    pub approve: bool,
    /// Why, shown to the model with a rejection: at most 4096 characters, no U+0000.
    #[serde(default)]
    #[schema(max_length = 4096, pattern = r"^[^\u0000]*$")]
    pub reason: Option<String>,
    /// Who decided (a person's name or an id of your app's, 1 to 255 characters, no control
    /// character):
    /// kept as `decided_by` of the `tool_approval_decided` event, as given (behest does not
    /// check it; the event's `api_key` names the key that sent it).
    #[serde(default)]
    #[schema(
        min_length = 1,
        max_length = 255,
        pattern = r"^[^\u0000-\u001f\u007f]*$"
    )]
    pub decided_by: Option<String>,
}

impl Body for ToolOutputsRequest {
    const FIELDS: &'static [&'static str] = &["tool_outputs"];
    fn expectation(field: &str) -> Option<&'static str> {
        (field == "tool_outputs").then_some(
            "must be an array of {\"call_id\", \"output\"} or {\"call_id\", \"error\"} objects",
        )
    }
}

impl Body for ApprovalsRequest {
    const FIELDS: &'static [&'static str] = &["approvals"];
    fn expectation(field: &str) -> Option<&'static str> {
        (field == "approvals").then_some(
            "must be an array of {\"call_id\", \"approve\", \"reason\"?, \"decided_by\"?} objects",
        )
    }
}

/// 422 `invalid_field` naming `field`.
fn invalid(field: &str, detail: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", detail).field(field)
}

/// Checks the strings a client sent: no U+0000 (the store cannot keep it in text columns).
fn no_nul(field: &str, values: &[&str]) -> Result<(), ApiError> {
    if values.iter().any(|value| value.contains('\0')) {
        return Err(invalid(
            field,
            "must not contain the NUL character (U+0000)",
        ));
    }
    Ok(())
}

/// `answer` as sent by `caller`: an approval records the position of the API key that
/// authenticated it (`tool_approval_decided.api_key`).
pub(super) fn sent_by(caller: Caller, answer: ActionAnswer) -> ActionAnswer {
    match answer {
        ActionAnswer::Approval {
            approve,
            reason,
            decided_by,
            ..
        } => ActionAnswer::Approval {
            approve,
            reason,
            decided_by,
            api_key: caller.0.and_then(|index| u32::try_from(index).ok()),
        },
        other => other,
    }
}

/// Checks a `decided_by` a client sent: 1 to 255 characters, no control character (422
/// `invalid_field` naming `field`).
pub(super) fn check_decided_by(field: &str, decided_by: Option<&str>) -> Result<(), ApiError> {
    match decided_by {
        Some(name)
            if name.is_empty()
                || name.chars().count() > 255
                || name.chars().any(|c| c.is_ascii_control()) =>
        {
            Err(invalid(
                field,
                "`decided_by` must be 1 to 255 characters, none of them a control character",
            ))
        }
        _ => Ok(()),
    }
}

/// Most characters of an approval's `reason`.
pub(super) const REASON_MAX_CHARS: usize = 4096;

/// The problem for an [`AnswerError`]; the errors about one call name `field`, the body's
/// list.
pub(super) fn answer_error(error: AnswerError, field: &str) -> ApiError {
    let named = matches!(
        error,
        AnswerError::UnknownCall(_)
            | AnswerError::DuplicateCall(_)
            | AnswerError::Missing(_)
            | AnswerError::Conflict(_)
            | AnswerError::AnsweredBefore { .. }
    );
    let api = ApiError::from(error);
    if named { api.field(field) } else { api }
}

async fn answer(
    state: &AppState,
    raw_id: &str,
    field: &str,
    kind: PendingKind,
    answers: Vec<Answer>,
) -> Result<Response, ApiError> {
    let run_id: RunId = raw_id
        .parse()
        .map_err(|_| ApiError::run_not_found(raw_id))?;
    let record: RunRecord = state
        .runtime
        .answer(run_id, kind, answers)
        .await
        .map_err(|error| answer_error(error, field))?;
    Ok((StatusCode::ACCEPTED, axum::Json(record)).into_response())
}

/// Answer a paused run's client tool calls. When the model calls a tool the run defined (see
/// `tools` of `POST /runs`), the run pauses in `requires_action` with a `tool_calls_required`
/// event; `GET /runs/{run_id}` shows the calls as `required_action`. Execute them, then post
/// every `client_tool` call's output here in one request; the run resumes (`202`, the run as it
/// is now), commits the outputs as tool results (each a `tool_execution_finished` and a
/// `tool_message_committed`) and calls the model again.
///
/// A round trip with curl, against `behest serve` with no configuration (the built-in `demo`
/// model calls the tools the input names):
///
/// ```sh
/// RUN=$(curl -s localhost:8080/runs -H 'content-type: application/json' -d '{
///   "provider": "demo", "model": "demo", "input": "call get_location and call get_weather",
///   "tools": [{"name": "get_location", "description": "Where the user is"},
///             {"name": "get_weather", "description": "The weather where the user is"}]}' \
///   | sed -E 's/.*"run_id":"([^"]+)".*/\1/')
/// curl -s localhost:8080/runs/$RUN        # "status":"requires_action","required_action":{…}
/// curl -s localhost:8080/runs/$RUN/tool_outputs -H 'content-type: application/json' -d '{
///   "tool_outputs": [{"call_id": "call_1", "output": {"city": "Paris"}},
///                    {"call_id": "call_2", "output": "sunny, 21 °C"}]}'
/// curl -s localhost:8080/runs/$RUN/output # the model's answer from both outputs
/// ```
#[utoipa::path(post, path = "/runs/{run_id}/tool_outputs", tag = "runs",
    params(("run_id" = String, Path, format = Uuid, description = "Run id")),
    request_body(content = ToolOutputsRequest, description = "One answer (`output` or `error`) for every call the run waits for"),
    responses(
        (status = 202, description = "Stored; the run resumes. The run as it is now (its status may still show `requires_action` for a moment, or for its `approval` calls). The same outputs posted again (a retry) answer the same, the run as it is now, also once it has moved on from that pause", body = RunRecord),
        (status = 400, description = "`malformed_json`", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "`run_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`run_not_waiting` (`run_status` says why: the run is not, or no longer, in `requires_action` — it was answered, cancelled, ended, or its wait expired — or it waits only for approvals); `action_conflict` (an earlier request answered a call otherwise: `detail` names it, and once the run has moved on, the pause already answered and its answer; the same answers again are accepted again)", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "`payload_too_large`", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "`unsupported_media_type`", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`unknown_tool_call` (a `call_id` the run does not wait an output for), `duplicate_tool_call` (one `call_id` twice), `missing_tool_calls` (every `client_tool` call must be answered at once; the detail lists the missing), `invalid_field` (both or neither of `output` and `error`; a NUL character), `invalid_body`; `field` is `tool_outputs`", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn submit_tool_outputs(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    Json(body): Json<ToolOutputsRequest>,
) -> Result<Response, ApiError> {
    let mut answers = Vec::with_capacity(body.tool_outputs.len());
    for output in body.tool_outputs {
        no_nul("tool_outputs", &[&output.call_id])?;
        let answer = match (output.output, output.error) {
            (Some(value), None) => ActionAnswer::Output(value),
            (None, Some(error)) => {
                no_nul("tool_outputs", &[&error])?;
                ActionAnswer::Error(error)
            }
            _ => {
                return Err(invalid(
                    "tool_outputs",
                    format!(
                        "call `{}`: give exactly one of `output` and `error`",
                        output.call_id
                    ),
                ));
            }
        };
        answers.push(Answer {
            call_id: output.call_id,
            answer,
        });
    }
    answer(
        &state,
        &run_id,
        "tool_outputs",
        PendingKind::ClientTool,
        answers,
    )
    .await
}

/// Approve or reject a paused run's server tool calls. Tools configured with
/// `requires_approval` (or listed in a run's `approval`) pause the run in `requires_action`
/// before they execute; post every `approval` call's decision here in one request. An approved
/// call executes as usual; a rejected one is not executed and the model sees a `Failure`
/// "rejected by the user: <reason>". Once the run has every answer it waited for, it logs each
/// decision as a `tool_approval_decided` event (`approved`, `reason`, the optional
/// `decided_by` given here, and `api_key`, the position of the key that sent it), so a replay
/// shows who decided what.
///
/// ```sh
/// RUN=$(curl -s localhost:8080/runs -H 'content-type: application/json' \
///   -d '{"provider": "demo", "model": "demo", "input": "What time is it?", "approval": ["current_time"]}' \
///   | sed -E 's/.*"run_id":"([^"]+)".*/\1/')
/// curl -s localhost:8080/runs/$RUN/approvals -H 'content-type: application/json' \
///   -d '{"approvals": [{"call_id": "call_1", "approve": true, "decided_by": "alice"}]}'
/// ```
#[utoipa::path(post, path = "/runs/{run_id}/approvals", tag = "runs",
    params(("run_id" = String, Path, format = Uuid, description = "Run id")),
    request_body(content = ApprovalsRequest, description = "One decision (`approve`, optional `reason`) for every call the run waits for"),
    responses(
        (status = 202, description = "Stored; the run resumes. The run as it is now", body = RunRecord),
        (status = 400, description = "`malformed_json`", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "`run_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`run_not_waiting` (not, or no longer, in `requires_action`, or waiting only for tool outputs; see `run_status`); `action_conflict` (an earlier request decided a call otherwise: `detail` names it, and once the run has moved on, the pause already answered and its decision; the same decisions again are accepted again, also once the run has moved on)", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "`payload_too_large`", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "`unsupported_media_type`", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`unknown_tool_call`, `duplicate_tool_call`, `missing_tool_calls` (every `approval` call must be decided at once), `invalid_field` (a NUL character), `invalid_body`; `field` is `approvals`", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn submit_approvals(
    State(state): State<AppState>,
    caller: Caller,
    Path(run_id): Path<String>,
    Json(body): Json<ApprovalsRequest>,
) -> Result<Response, ApiError> {
    let mut answers = Vec::with_capacity(body.approvals.len());
    for approval in body.approvals {
        no_nul(
            "approvals",
            &[
                &approval.call_id,
                approval.reason.as_deref().unwrap_or_default(),
            ],
        )?;
        check_decided_by("approvals", approval.decided_by.as_deref())?;
        if approval
            .reason
            .as_deref()
            .is_some_and(|reason| reason.chars().count() > REASON_MAX_CHARS)
        {
            return Err(invalid(
                "approvals",
                format!("a `reason` must be at most {REASON_MAX_CHARS} characters"),
            ));
        }
        answers.push(Answer {
            call_id: approval.call_id,
            answer: sent_by(
                caller,
                ActionAnswer::Approval {
                    approve: approval.approve,
                    reason: approval.reason,
                    decided_by: approval.decided_by,
                    api_key: None,
                },
            ),
        });
    }
    answer(&state, &run_id, "approvals", PendingKind::Approval, answers).await
}
