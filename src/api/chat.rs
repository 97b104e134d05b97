//! The AI SDK's `useChat` against behest, unchanged: `POST /chat` takes the body
//! `DefaultChatTransport` sends and answers the UI message stream of a run,
//! `GET /chat/{chat_id}/stream` is what `useChat({ resume: true })` calls, and
//! `POST /chat/{chat_id}/stop` cancels the chat's run (the client's `stop()` only disconnects).
//!
//! A chat is a session, named by the chat id the client generated (the session's
//! `external_id`, or one of behest's session ids). The UI message id of a run's answer is the
//! run id, and tool call ids are namespaced (`<run_id>:<model call>:<call_id>`, see
//! [`formats::split_tool_call_id`]); the answers a client posts come back under those ids.

use axum::extract::{FromRequest, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::{IntoParams, ToSchema};

use super::auth::Caller;
use super::extract::{Json, NoBody, Path, Query};
use super::formats::{self, Cursor, Format};
use super::{ApiError, AppState, Problem, actions, runs};
use crate::domain::{
    ActionAnswer, CreateRunRequest, InputPart, PendingKind, RunId, RunInput, RunRecord, Session,
};
use crate::runtime::Answer;
use crate::runtime::client_sessions::{PausedCall, in_progress};

/// Query of the `/chat` routes: the UI message stream's dialect. Unknown parameters are
/// ignored (a `useChat` `api` URL may carry the app's own).
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ChatQuery {
    /// `ai-sdk` (the default: the chunks both `ai` 6 and `ai` 7 accept) or `ai-sdk-v7` (adds
    /// `reset-step`, `tool-approval-response` and `finishReason: "interrupted"`, which `ai` 6
    /// rejects); anything else is 400 `unknown_format`. Put it on the transport's `api` URL:
    /// `new DefaultChatTransport({ api: "/chat?format=ai-sdk-v7" })`.
    #[param(pattern = "^(ai-sdk|ai-sdk-v7)?$")]
    format: Option<String>,
}

impl ChatQuery {
    fn format(&self) -> Result<Format, ApiError> {
        match self.format.as_deref() {
            None | Some("") => Format::parse(Some("ai-sdk")),
            Some(raw @ ("ai-sdk" | "ai-sdk-v7")) => Format::parse(Some(raw)),
            Some(other) => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "unknown_format",
                format!("`{other}` is not a format of /chat: ai-sdk or ai-sdk-v7"),
            )
            .field("format")),
        }
    }
}

/// Body of `POST /chat`: what the AI SDK's `DefaultChatTransport` sends, plus the transport's
/// `body` keys, which are `POST /runs` fields (`agent`, `provider`, `model`, `instructions`,
/// `tools`, `approval`, `temperature`, `metadata`, …; not `session_id` or `input`, which the
/// chat gives).
// Read through a map (`try_from`) rather than with `flatten`, which would hide the path of a
// field's error: each of the chat's own fields is read by itself and its error names it.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(try_from = "Map<String, Value>")]
#[schema(example = json!({
    "id": "Xk3q9ZpLmN0aBcDe",
    "messages": [{"id": "m1", "role": "user", "parts": [{"type": "text", "text": "What time is it?"}]}],
    "trigger": "submit-message",
    "provider": "demo", "model": "demo"
}))]
pub struct ChatRequest {
    /// The chat: one of behest's session ids, or an id the client generated (a `useChat` id,
    /// 1 to 255 characters of `A-Z a-z 0-9 - _ . : ~`), kept as the session's `external_id`;
    /// the session is created on first use.
    #[schema(
        min_length = 1,
        max_length = 255,
        pattern = r"^[A-Za-z0-9_.:~-]{1,255}$"
    )]
    pub id: String,
    /// The chat's UI messages as the client holds them. Only the last one is read: a `user`
    /// message (its `text` parts, joined by newlines, are the new run's input, with its `file`
    /// parts of an `image/*` `mediaType` — a `data:…;base64,` or `https:` `url` — as image
    /// parts in order; another file is 422 `invalid_field`), or the
    /// assistant message of a run waiting in `requires_action` (its id is the run id) whose
    /// tool parts carry the client's answers — `output-available` (`output`) and
    /// `output-error` (`errorText`) for the run's client tools, `approval-responded`
    /// (`approval.approved`, `approval.reason`) for its approvals. The history before it is
    /// behest's already.
    #[schema(value_type = Vec<Object>, min_items = 1)]
    pub messages: Vec<Value>,
    /// `submit-message` (default) or `regenerate-message` (refused: 409
    /// `regenerate_unsupported`).
    #[serde(default)]
    #[schema(pattern = "^(submit-message|regenerate-message)$")]
    pub trigger: Option<String>,
    /// The assistant message continued after tool outputs (the run id), or the one to
    /// regenerate.
    #[serde(default, rename = "messageId")]
    pub message_id: Option<String>,
    /// Any other key is a `POST /runs` field (see `CreateRunRequest`).
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub run: Map<String, Value>,
}

impl TryFrom<Map<String, Value>> for ChatRequest {
    /// serde's message, prefixed with the field's path (`messages: invalid type: …`).
    type Error = String;

    fn try_from(mut body: Map<String, Value>) -> Result<Self, String> {
        fn take<T: serde::de::DeserializeOwned>(
            body: &mut Map<String, Value>,
            key: &str,
        ) -> Result<Option<T>, String> {
            body.remove(key)
                .map(|value| {
                    serde_path_to_error::deserialize(value).map_err(|error| {
                        let path = error.path().to_string();
                        match path.as_str() {
                            "." => format!("{key}: {}", error.inner()),
                            inner if inner.starts_with('[') => {
                                format!("{key}{inner}: {}", error.inner())
                            }
                            inner => format!("{key}.{inner}: {}", error.inner()),
                        }
                    })
                })
                .transpose()
        }
        let id = take(&mut body, "id")?.ok_or("missing field `id`")?;
        let messages = take(&mut body, "messages")?.ok_or("missing field `messages`")?;
        let trigger = take::<Option<String>>(&mut body, "trigger")?.flatten();
        let message_id = take::<Option<String>>(&mut body, "messageId")?.flatten();
        Ok(Self {
            id,
            messages,
            trigger,
            message_id,
            run: body,
        })
    }
}

/// One UI message, as much of it as behest reads.
#[derive(Debug, Deserialize)]
struct UiMessage {
    #[serde(default)]
    id: String,
    role: String,
    #[serde(default)]
    parts: Vec<UiPart>,
}

/// One part of a UI message, as much of it as behest reads; other parts and keys are ignored.
#[derive(Debug, Deserialize)]
struct UiPart {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
    /// A `file` part's `data:` or `https:` URL.
    #[serde(default)]
    url: Option<String>,
    /// A `file` part's media type.
    #[serde(default, rename = "mediaType")]
    media_type: Option<String>,
    #[serde(default, rename = "toolCallId")]
    tool_call_id: Option<String>,
    #[serde(default)]
    state: Option<String>,
    #[serde(default, deserialize_with = "present")]
    output: Option<Value>,
    #[serde(default, rename = "errorText")]
    error_text: Option<String>,
    #[serde(default)]
    approval: Option<UiApproval>,
}

#[derive(Debug, Deserialize)]
struct UiApproval {
    #[serde(default)]
    approved: Option<bool>,
    #[serde(default)]
    reason: Option<String>,
}

/// Distinguishes `"output": null` from an absent `output`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

impl super::extract::Body for ChatRequest {
    const FIELDS: &'static [&'static str] = &["id", "messages", "trigger", "messageId"];
    fn expectation(field: &str) -> Option<&'static str> {
        Some(match field {
            "id" => "must be a string",
            "messages" => "must be an array of UI messages",
            "trigger" => "must be `submit-message` or `regenerate-message`",
            "messageId" => "must be a string",
            _ => return None,
        })
    }
}

/// 422 `invalid_field` naming `field`.
fn invalid(field: &str, detail: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", detail).field(field)
}

/// A client's answers to tool calls, by the namespaced or plain call id it names.
pub(super) struct ClientAnswers {
    /// `(call id as sent, answer)`, in the order sent.
    pub answers: Vec<(String, ActionAnswer)>,
}

impl ClientAnswers {
    /// The answer given for `call` of a pause: the latest one sent under its namespaced id
    /// (the id the client received, which names one call of one model call) or, from a client
    /// that kept the provider's plain id, under that (which may name a call of every pause
    /// that reused it: the pause matched is then the latest).
    pub fn find(&self, call: &PausedCall) -> Option<&ActionAnswer> {
        self.answers
            .iter()
            .rev()
            .find(|(sent, _)| *sent == call.name || *sent == call.call_id)
            .map(|(_, answer)| answer)
    }

    /// Whether an answer names `call` by its namespaced id.
    fn names(&self, call: &PausedCall) -> bool {
        self.answers.iter().any(|(sent, _)| *sent == call.name)
    }
}

/// Answers `run`'s calls from `given` and returns the cursor of the pause they answer, after
/// which the continuation streams. The pause is found by the calls' namespaced ids (the ids
/// the client received; [`Runtime::pauses`] names them with the renderings' own fold), so a
/// provider that said `call_1` in two pauses of the run never has one pause's answers taken
/// for the other's. When the run waits for calls the client answered, those answers are
/// recorded (tool outputs, then approvals, each kind all at once as
/// `POST /runs/{run_id}/tool_outputs` and `/approvals` require; the same errors). When the
/// client answered an earlier pause (a repeated post, the run has moved on), nothing is
/// recorded and the continuation of that pause streams again — when the answers are those
/// recorded; a call answered otherwise is 409 `action_conflict`.
///
/// # Errors
/// 409 `run_not_waiting` when the run neither waits for these answers nor paused for them
/// before; the runtime's answer errors (`missing_tool_calls`, …) with `field`.
///
/// [`Runtime::pauses`]: crate::runtime::Runtime::pauses
pub(super) async fn answer_pause(
    state: &AppState,
    caller: Caller,
    run: &RunRecord,
    given: &ClientAnswers,
    field: &str,
) -> Result<Cursor, ApiError> {
    let pauses = state.runtime.pauses(run.id).await?;
    let pending = run
        .required_action
        .as_ref()
        .filter(|_| run.status == crate::domain::RunStatus::RequiresAction)
        .map(|action| action.tool_calls.clone())
        .unwrap_or_default();
    // The pause the run waits at is its latest (its calls are `required_action`'s).
    let waiting = pauses.last().filter(|pause| {
        !pending.is_empty()
            && pause
                .calls
                .iter()
                .map(|call| call.call_id.as_str())
                .eq(pending.iter().map(|call| call.call_id.as_str()))
    });
    if let Some(pause) = waiting.filter(|pause| pause.calls.iter().any(|c| given.find(c).is_some()))
    {
        // Every call is answered, or nothing is recorded.
        let missing: Vec<String> = pause
            .calls
            .iter()
            .filter(|call| given.find(call).is_none())
            .map(|call| call.call_id.clone())
            .collect();
        if !missing.is_empty() {
            return Err(actions::answer_error(
                crate::runtime::AnswerError::Missing(missing),
                field,
            ));
        }
        for kind in [PendingKind::ClientTool, PendingKind::Approval] {
            let of_kind: Vec<Answer> = pending
                .iter()
                .zip(&pause.calls)
                .filter(|(call, _)| call.kind == kind)
                .filter_map(|(call, named)| {
                    given.find(named).map(|answer| Answer {
                        call_id: call.call_id.clone(),
                        answer: actions::sent_by(caller, answer.clone()),
                    })
                })
                .collect();
            if of_kind.is_empty() {
                continue;
            }
            // A concurrent identical post that answered first is accepted again: the same
            // continuation streams.
            state
                .runtime
                .answer(run.id, kind, of_kind)
                .await
                .map_err(|error| actions::answer_error(error, field))?;
        }
        return Ok(Cursor::after(pause.sequence));
    }
    // An earlier pause: the latest one a namespaced id names, else (a client that kept plain
    // ids) the latest one a plain id names.
    let answered = pauses
        .iter()
        .rev()
        .find(|pause| pause.calls.iter().any(|call| given.names(call)))
        .or_else(|| {
            pauses
                .iter()
                .rev()
                .find(|pause| pause.calls.iter().any(|call| given.find(call).is_some()))
        });
    let Some(pause) = answered else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "run_not_waiting",
            format!(
                "the run is {} and waits for none of the answers sent",
                run.status.as_str()
            ),
        )
        .run(run.id, Some(run.status)));
    };
    // A repeated post streams the continuation again — only when it repeats the answers: one
    // that answers a call otherwise is refused, the first answer stands.
    let recorded = state
        .runtime
        .store()
        .action_answers(run.id, pause.message_id)
        .await?;
    let decision = |answer: &ActionAnswer| matches!(answer, ActionAnswer::Approval { .. });
    let conflict = pause.calls.iter().find_map(|call| {
        let answer = given.find(call)?;
        recorded.iter().find(|(id, before)| {
            *id == call.call_id && decision(before) == decision(answer) && !before.same_as(answer)
        })
    });
    if let Some((call_id, before)) = conflict {
        return Err(actions::answer_error(
            crate::runtime::AnswerError::AnsweredBefore {
                call_id: call_id.clone(),
                left_out: false,
                sequence: pause.sequence,
                answer: before.in_short(),
            },
            field,
        ));
    }
    Ok(Cursor::after(pause.sequence))
}

/// The answers in the tool parts of a UI message: `output-available` → the output,
/// `output-error` → the error, `approval-responded` → the decision.
fn part_answers(parts: &[UiPart]) -> ClientAnswers {
    let answers = parts
        .iter()
        .filter(|part| part.kind.starts_with("tool-") || part.kind == "dynamic-tool")
        .filter_map(|part| {
            let id = part.tool_call_id.clone()?;
            let answer = match part.state.as_deref()? {
                "output-available" => ActionAnswer::Output(part.output.clone()?),
                "output-error" => ActionAnswer::Error(
                    part.error_text
                        .clone()
                        .unwrap_or_else(|| "the tool failed".to_owned()),
                ),
                "approval-responded" | "output-denied" => {
                    let approval = part.approval.as_ref()?;
                    ActionAnswer::Approval {
                        approve: approval.approved?,
                        reason: approval.reason.clone(),
                        decided_by: None,
                        api_key: None,
                    }
                }
                _ => return None,
            };
            Some((id, answer))
        })
        .collect();
    ClientAnswers { answers }
}

/// The run fields of a `/chat` or `/ag-ui` body (`field` names where they came from):
/// checked as `POST /runs` checks its body, with `session_id` and `input` refused because the
/// chat gives them.
pub(super) fn run_fields(
    fields: Map<String, Value>,
    field: &str,
) -> Result<CreateRunRequest, ApiError> {
    for owned in ["session_id", "input"] {
        if fields.contains_key(owned) {
            return Err(invalid(
                owned,
                format!("`{owned}` is given by the chat, not by {field}"),
            ));
        }
    }
    serde_path_to_error::deserialize(Value::Object(fields))
        .map_err(|error| ApiError::body_mismatch::<CreateRunRequest>(&error.to_string()))
}

/// The headers naming the run of a `/chat` answer: `X-Run-Id`, and `x-workflow-run-id` for
/// `@workflow/ai`'s `WorkflowChatTransport`.
fn run_id_headers(response: &mut Response, run_id: RunId) {
    if let Ok(value) = HeaderValue::from_str(&run_id.to_string()) {
        let headers = response.headers_mut();
        headers.insert(HeaderName::from_static("x-run-id"), value.clone());
        headers.insert(HeaderName::from_static("x-workflow-run-id"), value);
    }
}

/// Send a `useChat` message (the AI SDK's `DefaultChatTransport`).
///
/// The body is what the transport sends: the chat `id` (the session, created with that id on
/// first use), its `messages`, `trigger` and `messageId`, plus the transport's `body` keys as
/// `POST /runs` fields. When the last message is the user's, its text starts a run in the
/// chat's session; the answer is that run's UI message stream (`start` with `messageId` = the
/// run id … `finish`, `[DONE]`). A run that calls a client tool or waits for an approval ends
/// its stream with `finish` (`finishReason: "tool-calls"`); when the client posts again with
/// the answers in the assistant message's tool parts (`addToolOutput`,
/// `addToolApprovalResponse`, then `sendAutomaticallyWhen`), they are recorded and the answer
/// is the stream of the run's continuation. Posting the same answers again streams that
/// continuation again, and posting the same user message again (same id and text) streams its
/// run again from the start. `regenerate-message` has no behest equivalent (409).
#[utoipa::path(post, path = "/chat", tag = "frontends",
    params(ChatQuery),
    request_body(content = ChatRequest, description = "`DefaultChatTransport`'s body and the transport's `body` keys (POST /runs fields)"),
    responses(
        (status = 200, description = "The AI SDK UI message stream (`x-vercel-ai-ui-message-stream: v1`): `id:` = the frame's cursor (`N` or `N.j`), `data:` = a UI message chunk, `data: [DONE]` at the end; `X-Run-Id` and `x-workflow-run-id` name the run",
            content_type = "text/event-stream", body = String,
            headers(("X-Run-Id" = String, description = "The run streamed"),
                    ("x-workflow-run-id" = String, description = "The same, for `WorkflowChatTransport`"),
                    ("x-vercel-ai-ui-message-stream" = String, description = "`v1`"))),
        (status = 400, description = "`malformed_json`; `unknown_format` (`format` is not `ai-sdk` or `ai-sdk-v7`)", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "`run_not_found`: the last message is an assistant message whose id is no run of this chat", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`regenerate_unsupported` (`trigger: regenerate-message`); `session_busy` (the chat has a run in progress, `run_id`); `run_not_waiting` (the assistant message answers a run that waits for none of its answers); `action_conflict` (answers that differ from those an earlier post recorded for the same call: `detail` names it); `idempotency_key_reused`", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "`payload_too_large`", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "`unsupported_media_type`", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`missing_field` (`messages` empty); `invalid_field` (`id` not 1 to 255 characters of `A-Z a-z 0-9 - _ . : ~` or `.`/`..`; the last message neither a user message with text or an image nor an assistant message; a `file` part that is no image; `session_id` or `input` among the run fields; a run field as `POST /runs` refuses it); `input_too_large` (the last user message with the run's instructions and tool definitions does not fit the model's window less the answer: `field` is `messages`, `instructions` or `tools`; nothing is stored); `unknown_tool_call`, `missing_tool_calls` (every call of a kind the run waits for is answered at once); `unknown_agent`, `unknown_provider`, `unknown_model`, `unknown_tool`, `invalid_body`", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "`rate_limited`, `too_many_active_runs`: as `POST /runs`", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = String, description = "Seconds to wait before retrying"))),
        (status = 503, description = "`shutting_down`; `too_many_watchers`", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = String, description = "Seconds to wait before retrying"))),
    ))]
pub async fn send_chat_message(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Query(query): Query<ChatQuery>,
    request: Request,
) -> Result<Response, ApiError> {
    // The format is checked before the body is read: a bad `?format=` is 400 whatever the body.
    let format = query.format()?;
    let Json(body) = Json::<ChatRequest>::from_request(request, &state).await?;
    if body.trigger.as_deref() == Some("regenerate-message") {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "regenerate_unsupported",
            "behest keeps a chat's history as it happened and cannot regenerate a message: \
             send a new message instead",
        )
        .field("trigger"));
    }
    if let Some(trigger) = body.trigger.as_deref()
        && trigger != "submit-message"
    {
        return Err(invalid(
            "trigger",
            "must be `submit-message` or `regenerate-message`",
        ));
    }
    let mut fields = run_fields(body.run, "the chat body")?;
    let Some(last) = body.messages.last() else {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "missing_field",
            "`messages` must hold at least the message to send",
        )
        .field("messages"));
    };
    let last: UiMessage = serde_json::from_value(last.clone()).map_err(|error| {
        invalid(
            "messages",
            format!("the last message is not a UI message: {error}"),
        )
    })?;
    let (session, new) = state
        .runtime
        .client_session("id", &body.id)
        .await
        .map_err(ApiError::from)?;
    let answered = async {
        match last.role.as_str() {
            "user" => {
                let mut parts = Vec::new();
                for part in &last.parts {
                    match part.kind.as_str() {
                        "text" => {
                            parts.extend(part.text.clone().map(|text| InputPart::Text { text }))
                        }
                        "file" => parts.push(image_part(
                            "messages",
                            part.media_type.as_deref().unwrap_or_default(),
                            part.url.as_deref().unwrap_or_default(),
                            None,
                        )?),
                        _ => {}
                    }
                }
                let input = user_input(parts);
                let text = input.text();
                if text.trim().is_empty() && !input.has_image() {
                    return Err(invalid(
                        "messages",
                        "the last user message has no text part with a non-whitespace character \
                         and no image",
                    ));
                }
                fields.session_id = Some(session.id.to_string());
                if fields.client_request_id.is_none()
                    && !headers.contains_key("idempotency-key")
                    && !last.id.is_empty()
                {
                    // A retry of this message (a post whose answer was lost) is this run
                    // again, streamed from its start, not a second turn.
                    fields.client_request_id = Some(message_key(&session, &last.id, &input));
                }
                fields.input = Some(input);
                let permit = state.limits.open_watcher(caller)?;
                let created = runs::start_run(&state, caller, &headers, fields)
                    .await
                    .map_err(|error| error.field_renamed("input", "messages"))?;
                let mut response =
                    formats::stream(&state, &created.record, format, None, permit).await?;
                run_id_headers(&mut response, created.record.id);
                Ok(response)
            }
            "assistant" => {
                let raw = if last.id.is_empty() {
                    body.message_id.clone().unwrap_or_default()
                } else {
                    last.id.clone()
                };
                let run = chat_run(&state, &session, &raw).await?;
                let given = part_answers(&last.parts);
                let after = answer_pause(&state, caller, &run, &given, "messages").await?;
                let permit = state.limits.open_watcher(caller)?;
                let run = runs::load_run(&state, &run.id.to_string()).await?;
                let mut response =
                    formats::stream(&state, &run, format, Some(after), permit).await?;
                run_id_headers(&mut response, run.id);
                Ok(response)
            }
            other => Err(invalid(
                "messages",
                format!(
                    "the last message is a `{other}` message: send a user message, or the \
                     assistant message of a run waiting for tool outputs or approvals"
                ),
            )),
        }
    }
    .await;
    if answered.is_err() && new {
        forget_new_session(&state, &session).await;
    }
    answered
}

/// The idempotency key of the run a chat's user message starts: `chat:<session id>:` and 32 hex
/// digits of the SHA-256 of the message's id and text, so the same message posted again
/// (`DefaultChatTransport` gives each message its own id) finds its run, and a client that
/// reuses an id for another text starts a new one.
fn message_key(session: &Session, message_id: &str, input: &RunInput) -> String {
    use sha2::Digest as _;
    // A text input hashes its text alone (as before images were read), one with images its
    // parts' JSON.
    let content = match input {
        RunInput::Text(text) => text.clone(),
        RunInput::Parts(_) => serde_json::to_string(input).unwrap_or_default(),
    };
    let digest = sha2::Sha256::digest(format!("{message_id}\n{content}"));
    let mut key = format!("chat:{}:", session.id);
    for byte in &digest[..16] {
        let _ = std::fmt::Write::write_fmt(&mut key, format_args!("{byte:02x}"));
    }
    key
}

/// A run's input from a user message's parts in order: its text alone (text parts joined by
/// newlines) when it has no image, else the parts.
pub(super) fn user_input(parts: Vec<InputPart>) -> RunInput {
    if parts
        .iter()
        .all(|part| matches!(part, InputPart::Text { .. }))
    {
        let texts: Vec<String> = parts
            .into_iter()
            .filter_map(|part| match part {
                InputPart::Text { text } => Some(text),
                InputPart::Image { .. } => None,
            })
            .collect();
        RunInput::Text(texts.join("\n"))
    } else {
        RunInput::Parts(parts)
    }
}

/// An image part of a user message (the AI SDK's `file` part, AG-UI's `binary` part): a
/// `data:<media type>;base64,<data>` or `https:` `url`, or base64 `data`, of an `image/*`
/// `media_type`; the run's input checks it further as `POST /runs` does. Any other file is
/// 422 `invalid_field` naming `field`.
pub(super) fn image_part(
    field: &str,
    media_type: &str,
    url: &str,
    data: Option<&str>,
) -> Result<InputPart, ApiError> {
    if !media_type.starts_with("image/") {
        return Err(invalid(
            field,
            format!(
                "a file of type `{media_type}` in the last user message: behest reads text and \
                 images (image/png, image/jpeg, image/gif, image/webp)"
            ),
        ));
    }
    let media_type = Some(media_type.to_owned());
    if let Some(data) = data.filter(|data| !data.is_empty()) {
        return Ok(InputPart::Image {
            media_type,
            data: Some(data.to_owned()),
            url: None,
        });
    }
    if let Some(rest) = url.strip_prefix("data:") {
        let Some((_, data)) = rest.split_once(";base64,") else {
            return Err(invalid(
                field,
                "an image's `data:` URL must be base64 (`data:<media type>;base64,…`)",
            ));
        };
        return Ok(InputPart::Image {
            media_type,
            data: Some(data.to_owned()),
            url: None,
        });
    }
    Ok(InputPart::Image {
        media_type,
        data: None,
        url: Some(url.to_owned()),
    })
}

/// Deletes a session this request created for a client's id when the request then failed
/// before a run was stored in it: a refused first message leaves no record behind.
pub(super) async fn forget_new_session(state: &AppState, session: &Session) {
    if let Ok(None) = state.runtime.latest_run(session.id).await
        && let Err(error) = state.runtime.store().delete_session(session.id).await
    {
        tracing::warn!(session_id = %session.id, %error, "a session made for a refused request was not deleted");
    }
}

/// The run of `session` whose id is `raw` (a UI assistant message id).
async fn chat_run(state: &AppState, session: &Session, raw: &str) -> Result<RunRecord, ApiError> {
    let run = runs::load_run(state, raw).await?;
    if run.session_id != session.id {
        return Err(ApiError::run_not_found(raw));
    }
    Ok(run)
}

/// The session a client's id names, without creating one.
async fn find_session(state: &AppState, id: &str) -> Result<Option<Session>, ApiError> {
    if let Ok(own) = id.parse()
        && let Some(session) = state.runtime.store().get_session(own).await?
    {
        return Ok(Some(session));
    }
    Ok(state.runtime.store().session_by_external_id(id).await?)
}

/// Resume a chat's stream (`useChat({ resume: true })`, `chat.resumeStream()`).
///
/// `204` when the chat has no run in progress (none, finished, or paused for the client's
/// answers: its stream ended at the pause) or is unknown; else the run's whole UI message
/// stream from its start, then live. The AI SDK's transport keeps no cursor and treats a resumed
/// stream as a full replay (`resumeStreamIsReplay`, the default): its `start` chunk (the same
/// message id) rebuilds the interrupted message. A client that kept its state can continue
/// exactly instead with `GET /runs/{run_id}/events?format=ai-sdk` and `Last-Event-ID`.
#[utoipa::path(get, path = "/chat/{chat_id}/stream", tag = "frontends",
    params(("chat_id" = String, Path, description = "The chat id (`POST /chat`'s `id`)"), ChatQuery),
    responses(
        (status = 200, description = "The run's UI message stream from its start, then live", content_type = "text/event-stream", body = String,
            headers(("X-Run-Id" = String, description = "The run streamed"))),
        (status = 204, description = "Nothing to resume: no run in progress"),
        (status = 400, description = "`unknown_format`", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "`run_events_expired`", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "`shutting_down`; `too_many_watchers`", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = String, description = "Seconds to wait before retrying"))),
    ))]
pub async fn resume_chat_stream(
    State(state): State<AppState>,
    caller: Caller,
    Path(chat_id): Path<String>,
    Query(query): Query<ChatQuery>,
) -> Result<Response, ApiError> {
    let format = query.format()?;
    let Some(session) = find_session(&state, &chat_id).await? else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    let Some(run) = state.runtime.latest_run(session.id).await? else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    if !in_progress(&run) {
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    let mut response = formats::respond(&state, caller, &run, format, None).await?;
    run_id_headers(&mut response, run.id);
    Ok(response)
}

/// Stop a chat's run (what `useChat`'s `stop()` cannot do: it only drops the connection).
///
/// Cancels the chat's run in progress or paused for the client, as
/// `POST /runs/{run_id}/cancel` does (`202` and the run; its stream ends with `abort`,
/// `finish`). `204` when the chat has no such run (it ended already: stopping is idempotent).
///
/// ```js
/// const { stop } = useChat({ id });
/// const stopRun = () => { stop(); fetch(`/chat/${id}/stop`, { method: "POST" }); };
/// ```
#[utoipa::path(post, path = "/chat/{chat_id}/stop", tag = "frontends",
    params(("chat_id" = String, Path, description = "The chat id (`POST /chat`'s `id`)")),
    responses(
        (status = 202, description = "Cancellation requested; the run as it is now", body = RunRecord),
        (status = 204, description = "The chat has no run to stop"),
        (status = 400, description = "`unexpected_body`: the request has a body (this route takes none)", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "`session_not_found`: no chat has this id", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn stop_chat(
    State(state): State<AppState>,
    Path(chat_id): Path<String>,
    _: NoBody,
) -> Result<Response, ApiError> {
    let Some(session) = find_session(&state, &chat_id).await? else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "session_not_found",
            format!("no chat has the id `{chat_id}`"),
        ));
    };
    let run = state.runtime.latest_run(session.id).await?;
    let Some(run) = run.filter(|run| !run.status.is_terminal()) else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    match state.runtime.cancel_run(run.id).await? {
        Some(crate::runtime::CancelOutcome::Cancelling(record)) => {
            Ok((StatusCode::ACCEPTED, axum::Json(record)).into_response())
        }
        _ => Ok(StatusCode::NO_CONTENT.into_response()),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{ActionAnswer, PausedCall, UiPart, part_answers};
    use crate::domain::RunId;

    fn parts(value: serde_json::Value) -> Vec<UiPart> {
        serde_json::from_value(value).unwrap()
    }

    fn call(run: RunId, model_call: u64, call_id: &str) -> PausedCall {
        PausedCall {
            call_id: call_id.to_owned(),
            name: crate::events::tool_call_id(run, model_call, call_id),
        }
    }

    /// Only answered tool parts count; a namespaced id answers its own model call's call only
    /// (a provider's `call_1` of another model call or run is another call), the latest part
    /// for a call wins, and a plain id (a client that kept behest's) is accepted.
    #[test]
    fn tool_parts_become_answers_by_namespaced_call_id() {
        let run = RunId::new();
        let other = RunId::new();
        let answers = part_answers(&parts(json!([
            {"type": "step-start"},
            {"type": "text", "text": "hi"},
            {"type": "tool-get_location", "toolCallId": format!("{run}:1:call_1"),
             "state": "output-available", "input": {}, "output": {"city": "Lyon"}},
            {"type": "tool-get_location", "toolCallId": format!("{run}:2:call_1"),
             "state": "output-available", "input": {}, "output": null},
            {"type": "tool-get_location", "toolCallId": format!("{run}:2:call_1"),
             "state": "output-available", "input": {}, "output": "latest"},
            {"type": "tool-get_weather", "toolCallId": format!("{other}:1:call_2"),
             "state": "output-error", "input": {}, "errorText": "down"},
            {"type": "tool-current_time", "toolCallId": "call_3", "state": "approval-responded",
             "input": {}, "approval": {"id": "call_3", "approved": false, "reason": "no"}},
            {"type": "tool-current_time", "toolCallId": format!("{run}:2:call_4"),
             "state": "input-available", "input": {}},
            {"type": "dynamic-tool", "toolName": "search", "toolCallId": format!("{run}:2:call_5"),
             "state": "output-available", "input": {}, "output": "found"}
        ])));
        assert_eq!(
            answers.find(&call(run, 1, "call_1")),
            Some(&ActionAnswer::Output(json!({"city": "Lyon"}))),
            "the first model call's call_1"
        );
        assert_eq!(
            answers.find(&call(run, 2, "call_1")),
            Some(&ActionAnswer::Output(json!("latest")))
        );
        assert_eq!(
            answers.find(&call(run, 3, "call_1")),
            None,
            "a third call_1"
        );
        assert!(answers.names(&call(run, 1, "call_1")));
        assert_eq!(
            answers.find(&call(run, 1, "call_2")),
            None,
            "another run's call"
        );
        assert_eq!(
            answers.find(&call(other, 1, "call_2")),
            Some(&ActionAnswer::Error("down".to_owned()))
        );
        assert_eq!(
            answers.find(&call(run, 7, "call_3")),
            Some(&ActionAnswer::Approval {
                approve: false,
                reason: Some("no".to_owned()),
                decided_by: None,
                api_key: None,
            }),
            "a plain id"
        );
        assert!(!answers.names(&call(run, 7, "call_3")));
        assert_eq!(
            answers.find(&call(run, 2, "call_4")),
            None,
            "not answered yet"
        );
        assert_eq!(
            answers.find(&call(run, 2, "call_5")),
            Some(&ActionAnswer::Output(json!("found")))
        );
    }

    #[test]
    fn client_ids_are_bounded_and_plain() {
        use crate::domain::is_external_id;
        for good in [
            "Xk3q9ZpLmN0aBcDe",
            "0b7e2a0c-5d0f-4b7e-9a43-1f7f3c1a2b3c",
            "a.b:c~d_e",
            "...",
        ] {
            assert!(is_external_id(good), "{good}");
        }
        let long = "x".repeat(256);
        for bad in ["", ".", "..", "a/b", "a b", "é", "a\u{0}", long.as_str()] {
            assert!(!is_external_id(bad), "{bad:?}");
        }
        assert!(is_external_id(&"x".repeat(255)));
    }
}
