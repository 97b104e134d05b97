//! An AG-UI agent endpoint (`HttpAgent`, CopilotKit): `POST /ag-ui` takes a `RunAgentInput`
//! and answers AG-UI events. The thread is a session (named by the client's `threadId`, kept
//! as its `external_id`); the client's `runId` is kept as the run's `client_request_id`
//! (`ag-ui:<runId>`), so a retry of the same input attaches to the same run and the events
//! carry the client's `runId`; a continuation (an input answering the run's pause) is
//! answered with its own `runId`.
//!
//! AG-UI has no resume and no cancel: a client re-attaches with
//! `GET /runs/{run_id}/events?format=ag-ui` and `Last-Event-ID`, and cancels with
//! `POST /runs/{run_id}/cancel`; the behest run id is the response's `X-Run-Id` header.

use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::ToSchema;

use super::auth::Caller;
use super::chat::{self, ClientAnswers, answer_pause, forget_new_session, run_fields};
use super::extract::Json;
use super::formats::{self, AG_UI_RUN_PREFIX, Format};
use super::{ApiError, AppState, Problem, runs};
use crate::domain::{ActionAnswer, InputPart, RunTool, Session, ToolDefinition};

/// Body of `POST /ag-ui`: AG-UI's `RunAgentInput` (what `HttpAgent.runAgent()` sends).
/// Unknown keys are ignored.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(example = json!({
    "threadId": "0b7e2a0c-5d0f-4b7e-9a43-1f7f3c1a2b3c",
    "runId": "6c1f1b9e-3b8e-4c49-8d1e-0a8a1d3c5e7f",
    "messages": [{"id": "u1", "role": "user", "content": "What time is it?"}],
    "tools": [], "context": [], "state": {},
    "forwardedProps": {"provider": "demo", "model": "demo"}
}))]
pub struct RunAgentInput {
    /// The thread: one of behest's session ids, or an id the client generated (`HttpAgent`'s
    /// default is a uuid v4; 1 to 255 characters of `A-Z a-z 0-9 - _ . : ~`), kept as the
    /// session's `external_id`; the session is created on first use.
    #[schema(
        min_length = 1,
        max_length = 255,
        pattern = r"^[A-Za-z0-9_.:~-]{1,255}$"
    )]
    pub thread_id: String,
    /// The client's run id: stored as the run's `client_request_id` `ag-ui:<session id>:<runId>`, an idempotency key within the thread (so at
    /// most 212 visible ASCII characters) and sent back as `runId` in the events. The same
    /// input posted again attaches to the same run (a different one with this `runId`: 409
    /// `idempotency_key_reused`).
    #[schema(min_length = 1, max_length = 212, pattern = "^[!-~]{1,212}$")]
    pub run_id: String,
    /// The thread as the client holds it; behest reads only the end of it. A last `user`
    /// message (`content` a string, or parts whose `text` parts are joined by newlines, with
    /// its `binary` parts of an `image/*` `mimeType` — base64 `data` or a `url` — as image
    /// parts in order; another binary is 422 `invalid_field`) starts
    /// a run (unless `resume` is given). Otherwise the thread's run waiting in
    /// `requires_action` is answered: `tool` messages (`toolCallId`, `content` kept as a
    /// string, or `error`) answer its client tool calls.
    #[serde(default)]
    #[schema(value_type = Vec<Object>)]
    pub messages: Vec<Value>,
    /// The frontend tools `{name, description, parameters}`: the run's client tools, added to
    /// `forwardedProps.tools` (or to the agent's tools, or every server tool).
    #[serde(default)]
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<Value>,
    /// `{description, value}` entries, appended to the run's instructions as text (lossy: the
    /// model sees them as part of the system prompt).
    #[serde(default)]
    pub context: Vec<AgUiContext>,
    /// `POST /runs` fields (`agent`, `provider`, `model`, `instructions`, `tools`, …; not
    /// `session_id`, `input` or `client_request_id`).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub forwarded_props: Option<Value>,
    /// Answers to the interrupts of a run paused for approvals (`RUN_FINISHED.outcome` of
    /// type `interrupt`): `interruptId` = the interrupt's id; `status: "resolved"` with
    /// `payload.approved` (and optional `payload.reason`) decides, `"cancelled"` rejects.
    #[serde(default)]
    pub resume: Vec<AgUiResume>,
    /// Ignored, whatever JSON it is (AG-UI's `state` is any value): behest has no agent state.
    #[serde(default)]
    pub state: Option<Value>,
}

/// One `RunAgentInput.context` entry.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct AgUiContext {
    /// What the value is.
    #[serde(default)]
    pub description: String,
    /// The value.
    #[serde(default)]
    pub value: String,
}

/// One `RunAgentInput.resume` entry.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgUiResume {
    /// The interrupt answered.
    pub interrupt_id: String,
    /// `resolved` or `cancelled`.
    pub status: String,
    /// For an approval: `{approved: boolean, reason?: string, decidedBy?: string}`
    /// (`decidedBy`: who decided, 1 to 255 characters, kept unchecked as `decided_by` of the
    /// `tool_approval_decided` event).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub payload: Option<Value>,
}

impl super::extract::Body for RunAgentInput {
    const FIELDS: &'static [&'static str] = &[
        "threadId",
        "runId",
        "messages",
        "tools",
        "context",
        "forwardedProps",
        "resume",
        "state",
    ];
    fn expectation(field: &str) -> Option<&'static str> {
        Some(match field {
            "threadId" | "runId" => "must be a string",
            "messages" => "must be an array of AG-UI messages",
            "tools" => "must be an array of {name, description, parameters} objects",
            "context" => "must be an array of {description, value} objects",
            "resume" => "must be an array of {interruptId, status, payload} objects",
            _ => return None,
        })
    }
}

/// One AG-UI message, as much of it as behest reads.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct AgUiMessage {
    role: String,
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    error: Option<String>,
}

/// 422 `invalid_field` naming `field`.
fn invalid(field: &str, detail: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", detail).field(field)
}

/// `error` on the run's `tools` whose detail names `tools[k]`, renamed as the client sent the
/// tool: the input's `tools[k - from]` for one of its client tools (from `from` on, when it
/// sent some), else `forwardedProps.tools[k]` when forwardedProps gave the tools before them.
fn tools_renumbered(error: ApiError, from: Option<usize>, forwarded: bool) -> ApiError {
    if error.field_name() != Some("tools") {
        return error;
    }
    let from = from.unwrap_or(usize::MAX);
    let detail = error.problem().detail.clone();
    let Some(at) = detail.find("tools[") else {
        return error;
    };
    let digits = &detail[at + "tools[".len()..];
    let Some(end) = digits.find(']') else {
        return error;
    };
    let Ok(index) = digits[..end].parse::<usize>() else {
        return error;
    };
    let (name, field) = match index.checked_sub(from) {
        Some(client) => (format!("tools[{client}]"), "tools"),
        None if forwarded => (
            format!("forwardedProps.tools[{index}]"),
            "forwardedProps.tools",
        ),
        None => return error,
    };
    let renamed = format!("{}{name}{}", &detail[..at], &digits[end + 1..]);
    error.with_detail(renamed).field(field)
}

/// `error` naming a run field the client gave in `forwardedProps` (one of `keys`), or one
/// missing that it would give there, named by its path in the input: `forwardedProps.<field>`.
/// The input's own fields, and the run fields they became (`messages`, `runId`, `context`,
/// `tools`), keep their names.
fn in_forwarded_props(error: ApiError, keys: &[String]) -> ApiError {
    const OWN: [&str; 8] = [
        "threadId",
        "runId",
        "messages",
        "tools",
        "context",
        "state",
        "resume",
        "forwardedProps",
    ];
    let Some(field) = error.field_name().map(str::to_owned) else {
        return error;
    };
    let top = field.split(['.', '[']).next().unwrap_or_default();
    let given = keys.iter().any(|key| key == top);
    if OWN.contains(&top) || !(given || error.problem().code == "missing_field") {
        return error;
    }
    error.field_renamed(top, &format!("forwardedProps.{top}"))
}

/// The string `key` of `part`, or empty.
fn str_field<'a>(part: &'a Value, key: &str) -> &'a str {
    part.get(key).and_then(Value::as_str).unwrap_or_default()
}

/// The run input of a user message's `content`: a string, or its `text` parts joined by
/// newlines, with its `binary` image parts (`mimeType` `image/*`, base64 `data` or a `url`)
/// in order when it has some ([`chat::image_part`]; another binary is 422 on `messages`).
fn user_input(content: Option<&Value>) -> Result<crate::domain::RunInput, ApiError> {
    let text_of = |part: &Value| part.get("text").and_then(Value::as_str).map(str::to_owned);
    let mut parts = Vec::new();
    match content {
        Some(Value::String(text)) => parts.push(InputPart::Text { text: text.clone() }),
        Some(Value::Array(items)) => {
            for part in items {
                match part.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        parts.extend(text_of(part).map(|text| InputPart::Text { text }))
                    }
                    Some("binary") => parts.push(chat::image_part(
                        "messages",
                        str_field(part, "mimeType"),
                        str_field(part, "url"),
                        part.get("data").and_then(Value::as_str),
                    )?),
                    _ => {}
                }
            }
        }
        Some(Value::Null) | None => {}
        Some(_) => {
            return Err(invalid(
                "messages",
                "the last user message's `content` must be a string or an array of parts",
            ));
        }
    }
    Ok(chat::user_input(parts))
}

/// The answers in an input: `tool` messages and `resume` entries.
fn input_answers(messages: &[AgUiMessage], resume: &[AgUiResume]) -> ClientAnswers {
    let mut answers: Vec<(String, ActionAnswer)> = messages
        .iter()
        .filter(|message| message.role == "tool")
        .filter_map(|message| {
            let id = message.tool_call_id.clone()?;
            let answer = match &message.error {
                Some(error) => ActionAnswer::Error(error.clone()),
                None => ActionAnswer::Output(match &message.content {
                    Some(Value::String(text)) => Value::String(text.clone()),
                    Some(other) => Value::String(other.to_string()),
                    None => Value::String(String::new()),
                }),
            };
            Some((id, answer))
        })
        .collect();
    answers.extend(resume.iter().map(|entry| {
        let payload = entry.payload.as_ref();
        let approve = entry.status == "resolved"
            && payload
                .and_then(|p| p.get("approved"))
                .and_then(Value::as_bool)
                .unwrap_or(false);
        let reason = payload
            .and_then(|p| p.get("reason"))
            .and_then(Value::as_str)
            .map(str::to_owned)
            .or_else(|| (entry.status == "cancelled").then(|| "cancelled".to_owned()));
        let decided_by = payload
            .and_then(|p| p.get("decidedBy"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        (
            entry.interrupt_id.clone(),
            ActionAnswer::Approval {
                approve,
                reason,
                decided_by,
                api_key: None,
            },
        )
    }));
    ClientAnswers { answers }
}

/// Run an AG-UI agent (`HttpAgent`'s `runAgent`).
///
/// Takes a `RunAgentInput` and answers AG-UI 1.0 events (`data:` JSON, `id:` = the frame's
/// cursor `N` or `N.j`, LF line endings): `RUN_STARTED` (`threadId` = the client's thread id, `runId`
/// = the client's) … `RUN_FINISHED` or `RUN_ERROR`. A last `user` message starts a run in the
/// thread's session; `tools` become the run's client tools, `forwardedProps` its other
/// fields, `context` is appended to its instructions. A run that calls a client tool ends the
/// response with `RUN_FINISHED` (`outcome.pendingToolCallIds`); one waiting for approvals with
/// an `interrupt` outcome. The next input answers it (`tool` messages, `resume[]`) and
/// the response is the run's continuation, its `RUN_STARTED`/`RUN_FINISHED` naming that
/// input's `runId`; the same answers posted again stream that continuation again.
///
/// Re-attach after a lost connection with `GET /runs/{run_id}/events?format=ag-ui` and
/// `Last-Event-ID` (the `X-Run-Id` header names the run); cancel with
/// `POST /runs/{run_id}/cancel`.
#[utoipa::path(post, path = "/ag-ui", tag = "frontends",
    request_body(content = RunAgentInput, description = "AG-UI `RunAgentInput`"),
    responses(
        (status = 200, description = "AG-UI events: `id:` = the frame's cursor, `data:` = one event",
            content_type = "text/event-stream", body = String,
            headers(("X-Run-Id" = String, description = "The behest run streamed (for re-attach and cancel)"))),
        (status = 400, description = "`malformed_json`", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "`run_not_found`", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`session_busy` (the thread has a run in progress, `run_id`); `run_not_waiting` (the input answers calls its run does not wait for); `action_conflict` (answers that differ from those an earlier post recorded for the same call: `detail` names it); `idempotency_key_reused` (this `runId` started a different run)", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "`payload_too_large`", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "`unsupported_media_type`", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`invalid_field` (`threadId` not 1 to 255 characters of `A-Z a-z 0-9 - _ . : ~`; `runId` not 1 to 212 visible ASCII characters; no user message to start a run from and no waiting run; a `binary` part that is no image; a tool definition or a `forwardedProps` field as `POST /runs` refuses it: `field` is its path, `tools[i]` for the input's own tools, `forwardedProps.<field>` for a run field given or missing there); `input_too_large` (the last user message with the run's instructions, `context` appended to them, and tool definitions does not fit the model's window less the answer: `field` is `messages`, `context` when it was sent, else `instructions`, or `tools`; nothing is stored); `unknown_tool_call`, `missing_tool_calls`; `unknown_agent`, `unknown_provider`, `unknown_model`, `unknown_tool`, `invalid_body`", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "`rate_limited`, `too_many_active_runs`: as `POST /runs`", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = String, description = "Seconds to wait before retrying"))),
        (status = 503, description = "`shutting_down`; `too_many_watchers`", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = String, description = "Seconds to wait before retrying"))),
    ))]
pub async fn run_ag_ui_agent(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Json(input): Json<RunAgentInput>,
) -> Result<Response, ApiError> {
    // Keyed within its thread: `ag-ui:<session id>:<runId>`, at most 255 characters.
    let thread_key = format!("{AG_UI_RUN_PREFIX}{}:", crate::domain::SessionId::new());
    if input.run_id.is_empty()
        || !crate::domain::is_idempotency_key(&format!("{thread_key}{}", input.run_id))
    {
        return Err(invalid(
            "runId",
            format!(
                "must be 1 to {} visible ASCII characters (`!` to `~`)",
                255 - thread_key.len()
            ),
        ));
    }
    let messages: Vec<AgUiMessage> = input
        .messages
        .iter()
        .map(|message| serde_json::from_value(message.clone()))
        .collect::<Result<_, _>>()
        .map_err(|error| invalid("messages", format!("not an AG-UI message: {error}")))?;
    let (session, new) = state
        .runtime
        .client_session("threadId", &input.thread_id)
        .await?;
    let client_request_id = format!("{AG_UI_RUN_PREFIX}{}:{}", session.id, input.run_id);
    let answered = agent_answer(
        &state,
        caller,
        &headers,
        input,
        &messages,
        client_request_id,
        &session,
    )
    .await;
    if answered.is_err() && new {
        forget_new_session(&state, &session).await;
    }
    answered
}

/// What `POST /ag-ui` answers once the thread's session is known.
async fn agent_answer(
    state: &AppState,
    caller: Caller,
    headers: &HeaderMap,
    input: RunAgentInput,
    messages: &[AgUiMessage],
    client_request_id: String,
    session: &Session,
) -> Result<Response, ApiError> {
    // A last user message starts a run; anything else (a tool message, the assistant message
    // of the pause, `resume[]`) answers the thread's paused run.
    let starts_run = input.resume.is_empty()
        && messages
            .last()
            .is_some_and(|message| message.role == "user");
    if !starts_run {
        let given = input_answers(messages, &input.resume);
        let run = state.runtime.latest_run(session.id).await?;
        let Some(run) = run.filter(|_| !given.answers.is_empty()) else {
            return Err(invalid(
                "messages",
                "the thread's last message is no user message, and the input answers no run \
                 of the thread that waits for tool outputs or approvals",
            ));
        };
        for (_, answer) in &given.answers {
            if let ActionAnswer::Approval { decided_by, .. } = answer {
                super::actions::check_decided_by("resume", decided_by.as_deref())?;
            }
        }
        // Approvals come in `resume[]`, tool outputs in `tool` messages: an error names the one
        // the input answers with (`messages` when it has both).
        let answers_in = if messages.iter().any(|message| message.role == "tool") {
            "messages"
        } else {
            "resume"
        };
        let after = answer_pause(state, caller, &run, &given, answers_in).await?;
        let permit = state.limits.open_watcher(caller)?;
        let run = runs::load_run(state, &run.id.to_string()).await?;
        // The continuation answers this input: its runId, not the one that started the run.
        let mut response =
            formats::stream_ag_ui_continuation(state, &run, after, permit, input.run_id).await?;
        run_id_header(&mut response, &run.id.to_string());
        return Ok(response);
    }
    let forwarded = match input.forwarded_props {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(map)) => map,
        Some(_) => return Err(invalid("forwardedProps", "must be a JSON object")),
    };
    if forwarded.contains_key("client_request_id") {
        return Err(invalid(
            "forwardedProps.client_request_id",
            "a run started through /ag-ui is keyed by the input's `runId`",
        ));
    }
    let forwarded_keys: Vec<String> = forwarded.keys().cloned().collect();
    let mut fields = run_fields(forwarded, "forwardedProps")
        .map_err(|error| in_forwarded_props(error, &forwarded_keys))?;
    fields.session_id = Some(session.id.to_string());
    fields.input = Some(user_input(
        messages.last().and_then(|m| m.content.as_ref()),
    )?);
    fields.client_request_id = Some(client_request_id);
    let preset = fields
        .agent
        .as_ref()
        .or(session.defaults.agent.as_ref())
        .and_then(|name| state.runtime.agents().get(name));
    // Where the input's client tools start in the run's tools, and whether forwardedProps gave
    // the tools before them: a tool error names the tool as the client sent it.
    let mut client_tools_from = None;
    let forwarded_tools = fields.tools.is_some();
    if !input.tools.is_empty() {
        let mut tools = match (fields.tools.take(), preset.and_then(|p| p.tools.clone())) {
            (Some(tools), _) | (None, Some(tools)) => tools,
            (None, None) => state
                .runtime
                .tools()
                .list()
                .into_iter()
                .map(|tool| RunTool::Server(tool.name))
                .collect(),
        };
        client_tools_from = Some(tools.len());
        for tool in input.tools {
            let definition: ToolDefinition = serde_json::from_value(tool)
                .map_err(|error| invalid("tools", format!("not a tool definition: {error}")))?;
            tools.push(RunTool::Client(definition));
        }
        fields.tools = Some(tools);
    }
    let with_context = !input.context.is_empty();
    if with_context {
        let base = fields
            .instructions
            .clone()
            .or_else(|| preset.and_then(|p| p.instructions.clone()))
            .or_else(|| session.defaults.instructions.clone())
            .unwrap_or_default();
        let mut text = base;
        if !text.is_empty() {
            text.push_str("\n\n");
        }
        text.push_str("Context:");
        for entry in &input.context {
            text.push_str(&format!("\n- {}: {}", entry.description, entry.value));
        }
        fields.instructions = Some(text);
    }
    let permit = state.limits.open_watcher(caller)?;
    let created = runs::start_run(state, caller, headers, fields)
        .await
        .map_err(|error| {
            let error = error
                .field_renamed("input", "messages")
                .field_renamed("client_request_id", "runId");
            // The instructions a run refuses are the client's `context` appended to them.
            let error = if with_context {
                error.field_renamed("instructions", "context")
            } else {
                error
            };
            let error = tools_renumbered(error, client_tools_from, forwarded_tools);
            in_forwarded_props(error, &forwarded_keys)
        })?;
    let mut response = formats::stream(state, &created.record, Format::AgUi, None, permit).await?;
    run_id_header(&mut response, &created.record.id.to_string());
    Ok(response)
}

fn run_id_header(response: &mut Response, run_id: &str) {
    if let Ok(value) = HeaderValue::from_str(run_id) {
        response
            .headers_mut()
            .insert(HeaderName::from_static("x-run-id"), value);
    }
}
