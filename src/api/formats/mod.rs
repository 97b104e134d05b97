//! Other renderings of a run's log for web frontends: the AI SDK UI message stream
//! (`useChat`) and AG-UI (`HttpAgent`, CopilotKit), each a pure fold of the run's typed
//! events, so a replay is byte-identical to what was sent live and nothing is stored twice.
//!
//! Interface (used by `runs.rs` and the `/chat` and `/ag-ui` routes):
//! - [`Format`] (`?format=behest|ai-sdk|ai-sdk-v7|ag-ui`, [`Format::parse`]) and
//!   [`AiSdkDialect`];
//! - [`Cursor`]: the resume cursor `N` or `N.j` (`cursor.rs` has the grammar);
//! - [`Projection`]: `frames(&AgentEvent) -> Vec<Frame>`, implemented by [`AiSdk`] and
//!   [`AgUi`]; [`Renderer`] turns its frames into SSE bytes with ids and resumes at a cursor;
//! - [`Renderings`] (`shared.rs`, held by the app state): one rendering per run and format
//!   shared by its watchers in this process, so each event is folded and serialized once, not
//!   once per watcher;
//! - [`respond`] (a whole `GET`: 204, 410, 503 and the stream) and [`stream`] (the stream of a
//!   run already admitted, for `POST /runs/stream`);
//! - [`tool_call_id`] / [`split_tool_call_id`]: the namespaced tool call ids both formats use
//!   (from `events`, whose [`CallNames`] fold names a run's calls for both formats and for the
//!   matching of a client's answers to a pause);
//! - [`RunContext`]: what a projection knows besides the events, all from the run record.
//!
//! Frames are `id: <cursor>` + `data: <json>`, LF line endings, no `event:` line. An event of
//! sequence `N` that gives `k` frames sends the ids `N.1 … N.(k-1)`, `N`. A response ends
//! after a pause (`tool_calls_required`) or a terminal event whose frames lie beyond the
//! cursor (the AI SDK's with `data: [DONE]`, no id); at server shutdown, and on a store error,
//! it is aborted instead (no chunked terminator): both readers take a clean end for a finished
//! message.

mod ag_ui;
mod ai_sdk;
mod cursor;
mod shared;

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt::Write as _;

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use serde::Serialize;

pub use ag_ui::{AgUi, AgUiEvent};
pub use ai_sdk::AiSdk;
pub use cursor::Cursor;
pub use shared::Renderings;
use shared::Watcher;

use super::auth::Caller;
use super::limits::WatcherPermit;
use super::{ApiError, AppState, sse};
use crate::domain::{PendingKind, RunId, RunRecord, RunTool, SessionId};
use crate::events::{AgentEvent, CallNames, EventPayload};
use crate::tools::ToolRegistry;

/// The dialect of the AI SDK UI message stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AiSdkDialect {
    /// The chunks both `ai` 6 and `ai` 7 accept (`?format=ai-sdk`, the safe default).
    V6,
    /// `ai` 7 only (`?format=ai-sdk-v7`): adds `reset-step`, `tool-approval-response` and
    /// `finishReason: "interrupted"`, which `ai` 6 rejects.
    V7,
}

/// How a run's events are rendered on an event stream, chosen by `?format=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// behest's own events (`behest`, the default): `id:` = sequence, `event:`, `data:`.
    Behest,
    /// The AI SDK UI message stream (`ai-sdk`, `ai-sdk-v7`).
    AiSdk(AiSdkDialect),
    /// AG-UI 1.0 events (`ag-ui`).
    AgUi,
}

impl Format {
    /// Parses `?format=`: absent or empty is `behest`; `behest`, `ai-sdk`, `ai-sdk-v7`,
    /// `ag-ui`; anything else is 400 `unknown_format` (`field: format`).
    pub fn parse(raw: Option<&str>) -> Result<Self, ApiError> {
        match raw.unwrap_or_default() {
            "" | "behest" => Ok(Self::Behest),
            "ai-sdk" => Ok(Self::AiSdk(AiSdkDialect::V6)),
            "ai-sdk-v7" => Ok(Self::AiSdk(AiSdkDialect::V7)),
            "ag-ui" => Ok(Self::AgUi),
            other => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "unknown_format",
                format!("`{other}` is not a format: behest, ai-sdk, ai-sdk-v7 or ag-ui"),
            )
            .field("format")),
        }
    }

    /// Parses a resume cursor for this format: `N` for behest's, `N` or `N.j` for the others
    /// (400 `invalid_cursor`).
    pub fn cursor(self, raw: &str) -> Result<Cursor, ApiError> {
        Cursor::parse(raw, self != Self::Behest)
    }
}

pub use crate::events::{split_tool_call_id, tool_call_id};

/// The `client_request_id` prefix of a run started through `POST /ag-ui`: the rest is
/// `<session id>:<RunAgentInput.runId>` (a runId is an idempotency key within its thread, not
/// across the server), and AG-UI frames carry the runId as `runId`.
pub const AG_UI_RUN_PREFIX: &str = "ag-ui:";

/// The client's AG-UI runId in the `client_request_id` of a run of session `session_id` (see
/// [`AG_UI_RUN_PREFIX`]); `None` when the key names another session (a key a client wrote
/// through `POST /runs` does not rename its run).
#[must_use]
pub fn ag_ui_run_id(client_request_id: &str, session_id: SessionId) -> Option<&str> {
    let rest = client_request_id.strip_prefix(AG_UI_RUN_PREFIX)?;
    let id = match rest.split_once(':') {
        Some((thread, id)) => match thread.parse::<SessionId>() {
            Ok(thread) if thread == session_id => id,
            Ok(_) => return None,
            Err(_) => rest,
        },
        None => rest,
    };
    (!id.is_empty()).then_some(id)
}

/// What a projection knows of a run besides its events, all from its record (and the tool
/// configuration for which server tools wait for approval).
#[derive(Debug, Clone)]
pub struct RunContext {
    /// The run.
    pub run_id: RunId,
    /// AG-UI `threadId`: the client's own id of the session (its `external_id`, a thread
    /// `POST /ag-ui` created from the client's `threadId`), else the session id.
    pub thread_id: String,
    /// AG-UI `runId`: the client's runId for a run started through `/ag-ui`
    /// (`client_request_id` = [`AG_UI_RUN_PREFIX`] + session id + `:` + runId), else the run id.
    pub ag_ui_run_id: String,
    /// Tools the run defined for the client to execute.
    pub client_tools: HashSet<String>,
    /// Server tools whose calls wait for approval in this run.
    pub approval_tools: HashSet<String>,
}

impl RunContext {
    /// The context of `record`; `tools` says which server tools need approval by
    /// configuration.
    #[must_use]
    pub fn new(record: &RunRecord, tools: &ToolRegistry) -> Self {
        let client_tools = record
            .tools
            .iter()
            .flatten()
            .filter_map(|tool| match tool {
                RunTool::Client(definition) => Some(definition.name.clone()),
                RunTool::Server(_) => None,
            })
            .collect();
        let approval_tools = record
            .approval
            .iter()
            .cloned()
            .chain(
                tools
                    .list()
                    .into_iter()
                    .filter(|tool| tools.requires_approval(&tool.name))
                    .map(|tool| tool.name),
            )
            .collect();
        let ag_ui_run_id = record
            .client_request_id
            .as_deref()
            .and_then(|key| ag_ui_run_id(key, record.session_id))
            .map_or_else(|| record.id.to_string(), str::to_owned);
        Self {
            run_id: record.id,
            thread_id: record.session_id.to_string(),
            ag_ui_run_id,
            client_tools,
            approval_tools,
        }
    }
}

/// Who executes a tool call, as known when the model starts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CallKind {
    /// A server tool that runs without approval.
    Server,
    /// A tool the client executes.
    Client,
    /// A server tool that waits for approval.
    Approval,
}

/// One tool call as the projections name it.
#[derive(Debug, Clone)]
pub(crate) struct CallInfo {
    /// The namespaced id.
    pub id: String,
    pub tool_name: String,
    pub kind: CallKind,
    /// What `tool_calls_required` said it waits for.
    pub waits: Option<PendingKind>,
    /// A `tool_execution_started` came (an approved call runs).
    pub executing: bool,
    /// What its `tool_approval_decided` said (`None` before one, and in logs of older
    /// versions, which have none).
    pub decided: Option<bool>,
}

/// The run's tool calls by provider call id (the latest model call's, for a reused id), named
/// by the one fold that names them ([`CallNames`], which the answers' matching uses too).
#[derive(Debug, Clone)]
pub(crate) struct Calls {
    names: CallNames,
    calls: HashMap<String, CallInfo>,
}

/// A `tool_approval_decided` as both formats carry it to their own subscribers: the event's
/// payload (behest's names, `type` included) and the call's namespaced `toolCallId`.
fn decision_notice(payload: &EventPayload, tool_call_id: &str) -> serde_json::Value {
    let mut value = serde_json::to_value(payload).unwrap_or_default();
    if let Some(object) = value.as_object_mut() {
        object.insert("toolCallId".to_owned(), tool_call_id.into());
    }
    value
}

impl Calls {
    fn new(run_id: RunId) -> Self {
        Self {
            names: CallNames::new(run_id),
            calls: HashMap::new(),
        }
    }

    /// Folds the next event into the calls' names: each projection calls it first.
    fn record(&mut self, event: &AgentEvent) {
        self.names.record(event);
    }

    fn start(&mut self, run: &RunContext, call_id: &str, tool_name: &str) -> &CallInfo {
        let kind = if run.client_tools.contains(tool_name) {
            CallKind::Client
        } else if run.approval_tools.contains(tool_name) {
            CallKind::Approval
        } else {
            CallKind::Server
        };
        let info = CallInfo {
            id: self.names.name(call_id),
            tool_name: tool_name.to_owned(),
            kind,
            waits: None,
            executing: false,
            decided: None,
        };
        self.calls.insert(call_id.to_owned(), info);
        &self.calls[call_id]
    }

    fn get(&self, call_id: &str) -> Option<&CallInfo> {
        self.calls.get(call_id)
    }

    fn get_mut(&mut self, call_id: &str) -> Option<&mut CallInfo> {
        self.calls.get_mut(call_id)
    }

    /// The namespaced id of the provider's call `call_id`.
    fn id(&self, call_id: &str) -> String {
        self.names.name(call_id)
    }
}

/// A rendering of a run's log: a fold from typed events to frames.
pub trait Projection: Clone + Send + 'static {
    /// One frame's JSON (`data:`).
    type Frame: Serialize;
    /// The `data:` a clean end sends after the last frame (no id), if the format has one.
    const DONE: Option<&'static str>;

    /// The frames of the next event of the log (in sequence order), updating the state.
    fn frames(&mut self, event: &AgentEvent) -> Vec<Self::Frame>;

    /// The frames a stream resumed here begins with, each sent with the cursor as id: the
    /// state is this one followed by the `seen` frames of the next event.
    fn prelude(&self, seen: &[Self::Frame]) -> Vec<Self::Frame>;
}

/// One event's output on the wire.
#[derive(Debug, Default, PartialEq)]
pub struct Rendered {
    /// Whole SSE frames, in order.
    pub frames: Vec<Bytes>,
    /// The response ends after these frames (a pause or terminal event beyond the cursor).
    pub end: bool,
}

/// A projection with its cursor: folds silently up to the cursor, then renders SSE frames.
#[derive(Debug, Clone)]
pub struct Renderer<P: Projection> {
    projection: P,
    after: Option<Cursor>,
    /// The prelude to send before the next frame, once the cursor is reached.
    prelude: Option<Vec<P::Frame>>,
}

impl<P: Projection> Renderer<P> {
    /// Renders the log of `projection`'s run after `after` (`None` or `0`: from the start).
    pub fn new(projection: P, after: Option<Cursor>) -> Self {
        Self {
            projection,
            after: after.filter(|cursor| *cursor != Cursor::after(0)),
            prelude: None,
        }
    }

    /// Renders the log of `projection`'s run after event `through`, whose frames were sent
    /// (no prelude): a watcher that folds the log again from its start.
    fn continuing(projection: P, through: u64) -> Self {
        Self {
            projection,
            after: Some(Cursor::after(through)),
            prelude: Some(Vec::new()),
        }
    }

    /// True once the cursor is behind and the prelude sent: from here on this renders what a
    /// renderer from the start renders.
    fn live(&self) -> bool {
        self.after.is_none() || self.prelude.as_ref().is_some_and(Vec::is_empty)
    }

    /// This renderer, [`Self::live`], as a renderer from the start.
    fn into_live(self) -> Self {
        Self {
            after: None,
            prelude: None,
            ..self
        }
    }

    /// The frames of the next event of the log: none up to the cursor, then the prelude (once)
    /// and the event's frames with their ids.
    pub fn render(&mut self, event: &AgentEvent) -> Rendered {
        let at_cursor = self
            .after
            .is_some_and(|cursor| cursor.sequence == event.sequence && cursor.frame.is_some());
        let before = at_cursor.then(|| self.projection.clone());
        let frames = self.projection.frames(event);
        let count = frames.len();
        let seen = self
            .after
            .map_or(0, |cursor| cursor.seen(event.sequence, count));
        if let Some(cursor) = self.after
            && event.sequence >= cursor.sequence
            && self.prelude.is_none()
        {
            self.prelude = Some(match &before {
                Some(before) if seen < count => before.prelude(&frames[..seen]),
                _ if seen < count => Vec::new(),
                _ => self.projection.prelude(&[]),
            });
        }
        let mut rendered = Rendered::default();
        if seen == count {
            return rendered;
        }
        if let (Some(cursor), Some(prelude)) = (self.after, self.prelude.as_mut()) {
            let id = cursor.to_string();
            for frame in prelude.drain(..) {
                rendered.frames.push(sse_frame(Some(&id), &frame));
            }
        }
        for (index, frame) in frames.iter().enumerate().skip(seen) {
            let id = Cursor::frame_id(event.sequence, index, count).to_string();
            rendered.frames.push(sse_frame(Some(&id), frame));
        }
        rendered.end =
            event.is_terminal() || matches!(event.payload, EventPayload::ToolCallsRequired(_));
        rendered
    }

    /// The bytes a clean end sends last (the AI SDK's `data: [DONE]`), if any.
    #[must_use]
    pub fn done(&self) -> Option<Bytes> {
        done_frame::<P>()
    }
}

/// The bytes a clean end of a `P` stream sends last, if any.
fn done_frame<P: Projection>() -> Option<Bytes> {
    P::DONE.map(|data| Bytes::from(format!("data: {data}\n\n")))
}

/// `id: <id>` (if any) and one `data:` line of the frame's JSON, LF endings, a blank line.
fn sse_frame<F: Serialize>(id: Option<&str>, frame: &F) -> Bytes {
    // serde_json writes no raw line breaks, so one `data:` line holds the whole JSON.
    let json = serde_json::to_string(frame).unwrap_or_else(|_| "{}".to_owned());
    let mut out = String::with_capacity(json.len() + 32);
    if let Some(id) = id {
        let _ = writeln!(out, "id: {id}");
    }
    let _ = write!(out, "data: {json}\n\n");
    Bytes::from(out)
}

/// A whole watch of run `record` in `format` (not `Behest`): 410 when retention removed its
/// events, 503 while the server drains, 204 when the cursor is at or past the end of a
/// finished run, else the stream (at the pause of a run in `requires_action` it waits for the
/// next segment).
pub async fn respond(
    state: &AppState,
    caller: Caller,
    record: &RunRecord,
    format: Format,
    after: Option<Cursor>,
) -> Result<Response, ApiError> {
    if record.events_removed_at.is_some() {
        return Err(ApiError::new(
            StatusCode::GONE,
            "run_events_expired",
            "the run's events were removed by retention after it ended; the run record, its \
             session and messages are kept",
        )
        .run(record.id, Some(record.status)));
    }
    if state.runtime.is_stopping() {
        return Err(ApiError::shutting_down());
    }
    // A cursor at a pause is not an end: the stream waits for the next segment (an answer
    // posted just before may not have resumed the run yet).
    if let Some(cursor) = after {
        let last = state.runtime.store().last_sequence(record.id).await?;
        if record.status.is_terminal() {
            let past =
                cursor.sequence > last || (cursor.sequence == last && cursor.frame.is_none());
            if past {
                return Ok(StatusCode::NO_CONTENT.into_response());
            }
        } else if cursor.sequence > last {
            return Err(ApiError::cursor_ahead(cursor, last));
        }
    }
    let permit = state.limits.open_watcher(caller)?;
    stream(state, record, format, after, permit).await
}

/// The event stream of run `record` in `format` after `after`, for a caller already admitted
/// (`permit`). `Format::Behest` is rendered as AI SDK v6 here: callers serve behest's own
/// format themselves (`runs.rs`).
///
/// # Errors
/// The store's, reading the run's session (AG-UI's `threadId`).
pub async fn stream(
    state: &AppState,
    record: &RunRecord,
    format: Format,
    after: Option<Cursor>,
    permit: WatcherPermit,
) -> Result<Response, ApiError> {
    stream_as(state, record, format, after, permit, None).await
}

/// [`stream`] of an AG-UI continuation: its `RUN_STARTED` and `RUN_FINISHED` name `run_id`,
/// the `runId` of the `RunAgentInput` that resumed the run (in AG-UI each `runAgent` is a run
/// of its own, whose two boundary events agree on its runId), not the runId that started it.
///
/// # Errors
/// As [`stream`].
pub async fn stream_ag_ui_continuation(
    state: &AppState,
    record: &RunRecord,
    after: Cursor,
    permit: WatcherPermit,
    run_id: String,
) -> Result<Response, ApiError> {
    stream_as(
        state,
        record,
        Format::AgUi,
        Some(after),
        permit,
        Some(run_id),
    )
    .await
}

async fn stream_as(
    state: &AppState,
    record: &RunRecord,
    format: Format,
    after: Option<Cursor>,
    permit: WatcherPermit,
    ag_ui_run_id: Option<String>,
) -> Result<Response, ApiError> {
    let renderings = &state.renderings;
    let run = || RunContext::new(record, state.runtime.tools());
    Ok(match format {
        Format::AgUi => {
            // The shared rendering already knows the thread's id: the session is read once.
            let shared = match (renderings.held(record.id, format), ag_ui_run_id) {
                (Some(shared), None) => shared,
                (_, ag_ui_run_id) => {
                    let mut run = run();
                    if let Some(session) =
                        state.runtime.store().get_session(record.session_id).await?
                        && let Some(external_id) = session.external_id
                    {
                        // A thread the client named by its own id is echoed by that id.
                        run.thread_id = external_id;
                    }
                    match ag_ui_run_id {
                        // A continuation's frames name its own runId: a rendering of its own.
                        Some(ag_ui_run_id) => {
                            run.ag_ui_run_id = ag_ui_run_id;
                            Renderings::unshared(AgUi::new(run))
                        }
                        None => renderings.share(record.id, format, || AgUi::new(run)),
                    }
                }
            };
            pump(state, record.id, shared, after, permit)
        }
        Format::AiSdk(dialect) => {
            let shared = renderings.share(record.id, format, || AiSdk::new(run(), dialect));
            let mut response = pump(state, record.id, shared, after, permit);
            response.headers_mut().insert(
                "x-vercel-ai-ui-message-stream",
                HeaderValue::from_static("v1"),
            );
            response
        }
        Format::Behest => {
            let shared =
                renderings.share(record.id, format, || AiSdk::new(run(), AiSdkDialect::V6));
            pump(state, record.id, shared, after, permit)
        }
    })
}

/// Why a projected stream was aborted rather than ended.
#[derive(Debug, thiserror::Error)]
enum Abort {
    #[error("the server is shutting down")]
    Shutdown,
    #[error("the event log could not be read: {0}")]
    Store(String),
    #[error("the event log ended before the run did")]
    Cut,
}

struct Pump<P: Projection> {
    events: futures::stream::BoxStream<
        'static,
        Result<std::sync::Arc<crate::events::EventFrame>, crate::store::StoreError>,
    >,
    watcher: Watcher<P>,
    runtime: std::sync::Arc<crate::runtime::Runtime>,
    /// The run's terminal event was read.
    terminal: bool,
    out: VecDeque<Bytes>,
    done: bool,
    /// The server's shutdown, waited on once for the whole stream (a fresh wait per event
    /// would register with the token every time, under a lock all watchers share).
    shutdown: std::pin::Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
    run_id: RunId,
    _permit: WatcherPermit,
}

impl<P: Projection> Pump<P> {
    async fn next(&mut self) -> Option<Result<Bytes, Abort>> {
        loop {
            if let Some(bytes) = self.out.pop_front() {
                return Some(Ok(bytes));
            }
            if self.done {
                return None;
            }
            let item = tokio::select! {
                biased;
                () = &mut self.shutdown => None::<Option<_>>,
                item = self.events.next() => Some(item),
            };
            let Some(item) = item else {
                self.done = true;
                return Some(Err(Abort::Shutdown));
            };
            let abort = match item {
                Some(Ok(frame)) => match self.watcher.render(&frame) {
                    Ok(Some(rendered)) => {
                        self.terminal |= frame.terminal;
                        self.out.extend(rendered.frames.iter().cloned());
                        if rendered.end {
                            self.out.extend(done_frame::<P>());
                            self.done = true;
                        }
                        continue;
                    }
                    Ok(None) => {
                        // Fell behind the shared rendering: fold the log again from the
                        // latest projection it keeps before this event.
                        let from = self.watcher.from();
                        tracing::debug!(run_id = %self.run_id, sequence = frame.sequence, from, "projected watcher folds its run again");
                        self.events = self.runtime.watch(self.run_id, from).boxed();
                        continue;
                    }
                    Err(error) => Abort::Store(error.to_string()),
                },
                Some(Err(error)) => Abort::Store(error.to_string()),
                None if self.terminal => {
                    self.out.extend(done_frame::<P>());
                    self.done = true;
                    continue;
                }
                None => Abort::Cut,
            };
            if !matches!(abort, Abort::Shutdown) {
                tracing::warn!(run_id = %self.run_id, error = %abort, "projected event stream aborted");
            }
            self.done = true;
            return Some(Err(abort));
        }
    }
}

fn pump<P: Projection>(
    state: &AppState,
    run_id: RunId,
    shared: std::sync::Arc<std::sync::Mutex<shared::Shared<P>>>,
    after: Option<Cursor>,
    permit: WatcherPermit,
) -> Response
where
    P::Frame: Send,
{
    let watcher = Watcher::new(shared, after);
    let pump = Pump {
        events: state.runtime.watch(run_id, watcher.from()).boxed(),
        watcher,
        runtime: state.runtime.clone(),
        terminal: false,
        out: VecDeque::new(),
        done: false,
        shutdown: Box::pin(state.shutdown.clone().cancelled_owned()),
        run_id,
        _permit: permit,
    };
    let body = futures::stream::unfold(pump, |mut pump| async move {
        let item = pump.next().await?;
        Some((item, pump))
    });
    sse::try_response(body, &state.keep_alive)
}

#[cfg(test)]
mod tests;
