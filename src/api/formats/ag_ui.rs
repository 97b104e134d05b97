//! behest's log as AG-UI 1.0 events (`HttpAgent`, CopilotKit): the fold of the mapping in
//! `notes/frontend-protocols.md` §3.2, and the prelude a resumed stream begins with (§4).
//!
//! Ids: `threadId` and `runId` come from [`RunContext`]; the assistant message of a model call
//! is the id it is stored with (`model_started.message_id`; `<run_id>:<sequence of its
//! model_started>` in logs of older versions), a reasoning message `<run_id>:r<sequence>`,
//! a tool result message the id it is stored with (`tool_message_committed.message_id`, the
//! result being sent at that event; `<tool call id>:result` in logs of older versions, whose
//! `tool_message_committed` does not name its call); tool call ids are namespaced
//! ([`super::tool_call_id`]). The open step, reasoning span and message, text message and tool
//! calls are tracked per frame ([`AgUi::observe`]), so a cut between two frames of one event
//! re-opens exactly what the client has open.

use serde::Serialize;
use serde_json::{Value, json};

use super::{CallKind, Calls, Projection, RunContext};
use crate::domain::PendingKind;
use crate::events::{AgentEvent, EventPayload, ToolExecutionResult};

/// One AG-UI event (`@ag-ui/core` 1.0 `BaseEvent` subtypes); `type` in SCREAMING_SNAKE_CASE,
/// fields in camelCase.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AgUiEvent {
    /// A run (or a segment after a pause) begins.
    #[serde(rename_all = "camelCase")]
    RunStarted {
        /// The thread (behest session).
        thread_id: String,
        /// The run.
        run_id: String,
    },
    /// The run (or segment) ended; `outcome` says how.
    #[serde(rename_all = "camelCase")]
    RunFinished {
        /// The thread.
        thread_id: String,
        /// The run.
        run_id: String,
        /// `{type: success | interrupt | cancelled, …}`.
        outcome: Value,
        /// `{finishReason, iterations}` for a completed run.
        #[serde(skip_serializing_if = "Option::is_none")]
        result: Option<Value>,
    },
    /// The run failed.
    RunError {
        /// What went wrong.
        message: String,
        /// behest's error class.
        #[serde(skip_serializing_if = "Option::is_none")]
        code: Option<String>,
    },
    /// A model call begins.
    #[serde(rename_all = "camelCase")]
    StepStarted {
        /// `iteration-<n>`.
        step_name: String,
    },
    /// A model call (with its tool executions) ended.
    #[serde(rename_all = "camelCase")]
    StepFinished {
        /// `iteration-<n>`.
        step_name: String,
    },
    /// Reasoning span opens.
    #[serde(rename_all = "camelCase")]
    ReasoningStart {
        /// The reasoning message id.
        message_id: String,
    },
    /// Reasoning message opens.
    #[serde(rename_all = "camelCase")]
    ReasoningMessageStart {
        /// The reasoning message id.
        message_id: String,
        /// Always `reasoning`.
        role: &'static str,
    },
    /// Reasoning text.
    #[serde(rename_all = "camelCase")]
    ReasoningMessageContent {
        /// The reasoning message id.
        message_id: String,
        /// The next piece (never empty).
        delta: String,
    },
    /// Reasoning message closes.
    #[serde(rename_all = "camelCase")]
    ReasoningMessageEnd {
        /// The reasoning message id.
        message_id: String,
    },
    /// Reasoning span closes.
    #[serde(rename_all = "camelCase")]
    ReasoningEnd {
        /// The reasoning message id.
        message_id: String,
    },
    /// The assistant message of a model call opens.
    #[serde(rename_all = "camelCase")]
    TextMessageStart {
        /// The assistant message id.
        message_id: String,
        /// Always `assistant`.
        role: &'static str,
    },
    /// Assistant text.
    #[serde(rename_all = "camelCase")]
    TextMessageContent {
        /// The assistant message id.
        message_id: String,
        /// The next piece (never empty).
        delta: String,
    },
    /// The assistant message's text ends.
    #[serde(rename_all = "camelCase")]
    TextMessageEnd {
        /// The assistant message id.
        message_id: String,
    },
    /// A tool call opens.
    #[serde(rename_all = "camelCase")]
    ToolCallStart {
        /// Namespaced call id.
        tool_call_id: String,
        /// The tool's name.
        tool_call_name: String,
        /// The assistant message the call belongs to.
        parent_message_id: String,
    },
    /// Argument text.
    #[serde(rename_all = "camelCase")]
    ToolCallArgs {
        /// Namespaced call id.
        tool_call_id: String,
        /// The next piece (never empty).
        delta: String,
    },
    /// The call's arguments are complete.
    #[serde(rename_all = "camelCase")]
    ToolCallEnd {
        /// Namespaced call id.
        tool_call_id: String,
    },
    /// A server tool's result.
    #[serde(rename_all = "camelCase")]
    ToolCallResult {
        /// The tool message id.
        message_id: String,
        /// Namespaced call id.
        tool_call_id: String,
        /// The output as text (a string as-is, other JSON serialized), or `error: …`.
        content: String,
        /// Always `tool`.
        role: &'static str,
    },
    /// A behest event with no AG-UI counterpart: `behest.<type>`, the payload as value.
    Custom {
        /// `behest.<event type>`.
        name: String,
        /// The event's payload.
        value: Value,
    },
}

/// What the client has open, as of the frames it received.
#[derive(Debug, Clone, Default)]
struct Open {
    run: bool,
    step: Option<String>,
    reasoning_span: Option<String>,
    reasoning_message: Option<String>,
    text: Option<String>,
    /// `(call id, tool name, parent message id)`, in start order.
    calls: Vec<(String, String, String)>,
}

/// The fold state of one run's AG-UI stream.
#[derive(Debug, Clone)]
pub struct AgUi {
    run: RunContext,
    calls: Calls,
    /// The current model call's assistant message id.
    message_id: String,
    /// Calls whose arguments went out as `TOOL_CALL_ARGS`.
    args_sent: Vec<String>,
    /// Server tools' results not sent yet: `(call id, namespaced id, content)`, each sent as
    /// `TOOL_CALL_RESULT` at its tool message's `tool_message_committed`.
    results: Vec<(String, String, String)>,
    open: Open,
}

impl AgUi {
    /// The projection of `run`, before its first event.
    #[must_use]
    pub fn new(run: RunContext) -> Self {
        let run_id = run.run_id;
        let message_id = run_id.to_string();
        Self {
            run,
            calls: Calls::new(run_id),
            message_id,
            args_sent: Vec::new(),
            results: Vec::new(),
            open: Open::default(),
        }
    }

    /// Updates what the client has open after receiving `frame`.
    fn observe(open: &mut Open, frame: &AgUiEvent) {
        match frame {
            AgUiEvent::RunStarted { .. } => open.run = true,
            AgUiEvent::RunFinished { .. } | AgUiEvent::RunError { .. } => *open = Open::default(),
            AgUiEvent::StepStarted { step_name } => open.step = Some(step_name.clone()),
            AgUiEvent::StepFinished { .. } => open.step = None,
            AgUiEvent::ReasoningStart { message_id } => {
                open.reasoning_span = Some(message_id.clone());
            }
            AgUiEvent::ReasoningEnd { .. } => open.reasoning_span = None,
            AgUiEvent::ReasoningMessageStart { message_id, .. } => {
                open.reasoning_message = Some(message_id.clone());
            }
            AgUiEvent::ReasoningMessageEnd { .. } => open.reasoning_message = None,
            AgUiEvent::TextMessageStart { message_id, .. } => open.text = Some(message_id.clone()),
            AgUiEvent::TextMessageEnd { .. } => open.text = None,
            AgUiEvent::ToolCallStart {
                tool_call_id,
                tool_call_name,
                parent_message_id,
            } => open.calls.push((
                tool_call_id.clone(),
                tool_call_name.clone(),
                parent_message_id.clone(),
            )),
            AgUiEvent::ToolCallEnd { tool_call_id } => {
                open.calls.retain(|(id, _, _)| id != tool_call_id);
            }
            AgUiEvent::ReasoningMessageContent { .. }
            | AgUiEvent::TextMessageContent { .. }
            | AgUiEvent::ToolCallArgs { .. }
            | AgUiEvent::ToolCallResult { .. }
            | AgUiEvent::Custom { .. } => {}
        }
    }

    fn push(&mut self, out: &mut Vec<AgUiEvent>, frame: AgUiEvent) {
        Self::observe(&mut self.open, &frame);
        out.push(frame);
    }

    fn run_started(&self) -> AgUiEvent {
        AgUiEvent::RunStarted {
            thread_id: self.run.thread_id.clone(),
            run_id: self.run.ag_ui_run_id.clone(),
        }
    }

    fn run_finished(&self, outcome: Value, result: Option<Value>) -> AgUiEvent {
        AgUiEvent::RunFinished {
            thread_id: self.run.thread_id.clone(),
            run_id: self.run.ag_ui_run_id.clone(),
            outcome,
            result,
        }
    }

    fn close_reasoning(&mut self, out: &mut Vec<AgUiEvent>) {
        if let Some(message_id) = self.open.reasoning_message.clone() {
            self.push(out, AgUiEvent::ReasoningMessageEnd { message_id });
        }
        if let Some(message_id) = self.open.reasoning_span.clone() {
            self.push(out, AgUiEvent::ReasoningEnd { message_id });
        }
    }

    fn close_text(&mut self, out: &mut Vec<AgUiEvent>) {
        if let Some(message_id) = self.open.text.clone() {
            self.push(out, AgUiEvent::TextMessageEnd { message_id });
        }
    }

    /// Closes everything open but the run: calls, text, reasoning, the step.
    fn close_all(&mut self, out: &mut Vec<AgUiEvent>) {
        self.close_reasoning(out);
        self.close_text(out);
        for (tool_call_id, _, _) in self.open.calls.clone() {
            self.push(out, AgUiEvent::ToolCallEnd { tool_call_id });
        }
        if let Some(step_name) = self.open.step.clone() {
            self.push(out, AgUiEvent::StepFinished { step_name });
        }
    }

    /// Sends the results still waiting for their tool message, with derived message ids
    /// (`<tool call id>:result`): a log of an older version, whose `tool_message_committed`
    /// does not name its call. Every server tool call gets its result before the next model
    /// call and the run's end (the client counts a call without one as pending).
    fn flush_results(&mut self, out: &mut Vec<AgUiEvent>) {
        for (_, tool_call_id, content) in std::mem::take(&mut self.results) {
            self.push(
                out,
                AgUiEvent::ToolCallResult {
                    message_id: format!("{tool_call_id}:result"),
                    tool_call_id,
                    content,
                    role: "tool",
                },
            );
        }
    }

    fn start_call(&mut self, out: &mut Vec<AgUiEvent>, call_id: &str, tool_name: &str) -> String {
        self.close_reasoning(out);
        let id = self.calls.start(&self.run, call_id, tool_name).id.clone();
        self.push(
            out,
            AgUiEvent::ToolCallStart {
                tool_call_id: id.clone(),
                tool_call_name: tool_name.to_owned(),
                parent_message_id: self.message_id.clone(),
            },
        );
        id
    }
}

impl Projection for AgUi {
    type Frame = AgUiEvent;
    const DONE: Option<&'static str> = None;

    fn frames(&mut self, event: &AgentEvent) -> Vec<AgUiEvent> {
        self.calls.record(event);
        let mut out = Vec::new();
        if !self.open.run && !event.payload.is_terminal() {
            // The first event of the run, or the first after a pause: a new segment.
            if !matches!(event.payload, EventPayload::RunStarted(_)) {
                let started = self.run_started();
                self.push(&mut out, started);
            }
        }
        let seq = event.sequence;
        match &event.payload {
            EventPayload::RunStarted(_) => {
                let started = self.run_started();
                self.push(&mut out, started);
            }
            EventPayload::ModelStarted(started) => {
                self.flush_results(&mut out);
                self.close_all(&mut out);
                // The id the call's assistant message is stored with (older logs: derived).
                self.message_id = started
                    .message_id
                    .map_or_else(|| format!("{}:{seq}", self.run.run_id), |id| id.to_string());
                self.push(
                    &mut out,
                    AgUiEvent::StepStarted {
                        step_name: format!("iteration-{}", started.iteration),
                    },
                );
            }
            EventPayload::ReasoningDelta(delta) if !delta.delta.is_empty() => {
                let message_id = match self.open.reasoning_message.clone() {
                    Some(id) => id,
                    None => {
                        let id = format!("{}:r{seq}", self.run.run_id);
                        self.push(
                            &mut out,
                            AgUiEvent::ReasoningStart {
                                message_id: id.clone(),
                            },
                        );
                        self.push(
                            &mut out,
                            AgUiEvent::ReasoningMessageStart {
                                message_id: id.clone(),
                                role: "reasoning",
                            },
                        );
                        id
                    }
                };
                self.push(
                    &mut out,
                    AgUiEvent::ReasoningMessageContent {
                        message_id,
                        delta: delta.delta.clone(),
                    },
                );
            }
            EventPayload::TextDelta(delta) if !delta.delta.is_empty() => {
                self.close_reasoning(&mut out);
                if self.open.text.is_none() {
                    self.push(
                        &mut out,
                        AgUiEvent::TextMessageStart {
                            message_id: self.message_id.clone(),
                            role: "assistant",
                        },
                    );
                }
                self.push(
                    &mut out,
                    AgUiEvent::TextMessageContent {
                        message_id: self.message_id.clone(),
                        delta: delta.delta.clone(),
                    },
                );
            }
            EventPayload::ToolCallStarted(started) => {
                self.start_call(&mut out, &started.call_id, &started.tool_name);
            }
            EventPayload::ToolCallDelta(delta) if !delta.delta.is_empty() => {
                let id = self.calls.id(&delta.call_id);
                if self.open.calls.iter().any(|(open, _, _)| *open == id) {
                    self.args_sent.push(id.clone());
                    self.push(
                        &mut out,
                        AgUiEvent::ToolCallArgs {
                            tool_call_id: id,
                            delta: delta.delta.clone(),
                        },
                    );
                }
            }
            EventPayload::ToolCallCompleted(completed) => {
                let call = &completed.call;
                let known = self
                    .calls
                    .get(&call.id)
                    .map(|info| info.id.clone())
                    .filter(|id| self.open.calls.iter().any(|(open, _, _)| open == id));
                let id = match known {
                    Some(id) => id,
                    None => self.start_call(&mut out, &call.id, &call.name),
                };
                if !self.args_sent.contains(&id) {
                    let delta = call
                        .invalid_arguments
                        .clone()
                        .unwrap_or_else(|| call.arguments.to_string());
                    if !delta.is_empty() {
                        self.push(
                            &mut out,
                            AgUiEvent::ToolCallArgs {
                                tool_call_id: id.clone(),
                                delta,
                            },
                        );
                    }
                }
                self.args_sent.retain(|sent| *sent != id);
                self.push(&mut out, AgUiEvent::ToolCallEnd { tool_call_id: id });
            }
            EventPayload::UsageRecorded(_) => {
                self.close_reasoning(&mut out);
                self.close_text(&mut out);
            }
            EventPayload::ToolExecutionFinished(finished) => {
                let call = self.calls.get(&finished.call_id).cloned();
                // A client tool's result is the client's own tool message already.
                let client = call.as_ref().is_some_and(|call| {
                    call.kind == CallKind::Client || call.waits == Some(PendingKind::ClientTool)
                });
                if !client {
                    let content = match &finished.result {
                        ToolExecutionResult::Success(success) => match &success.output {
                            Value::String(text) => text.clone(),
                            other => other.to_string(),
                        },
                        ToolExecutionResult::Failure(failure) => {
                            format!("error: {}", failure.error)
                        }
                    };
                    // Sent with the id of the tool message that stores it, at its commit.
                    self.results.retain(|(id, _, _)| *id != finished.call_id);
                    self.results.push((
                        finished.call_id.clone(),
                        self.calls.id(&finished.call_id),
                        content,
                    ));
                }
            }
            EventPayload::ToolMessageCommitted(committed) => match &committed.call_id {
                Some(call_id) => {
                    if let Some(at) = self.results.iter().position(|(id, _, _)| id == call_id) {
                        let (_, tool_call_id, content) = self.results.remove(at);
                        self.push(
                            &mut out,
                            AgUiEvent::ToolCallResult {
                                message_id: committed.message_id.to_string(),
                                tool_call_id,
                                content,
                                role: "tool",
                            },
                        );
                    }
                }
                // Older logs do not say which call a tool message answers.
                None => self.flush_results(&mut out),
            },
            EventPayload::ToolCallsRequired(action) => {
                self.flush_results(&mut out);
                self.close_all(&mut out);
                let mut ids = Vec::new();
                for pending in &action.tool_calls {
                    ids.push((self.calls.id(&pending.call_id), pending.kind));
                    if let Some(call) = self.calls.get_mut(&pending.call_id) {
                        call.waits = Some(pending.kind);
                    }
                }
                let outcome = if ids.iter().all(|(_, kind)| *kind == PendingKind::ClientTool) {
                    json!({
                        "type": "success",
                        "pendingToolCallIds": ids.iter().map(|(id, _)| id).collect::<Vec<_>>(),
                    })
                } else {
                    let interrupts: Vec<Value> = ids
                        .iter()
                        .map(|(id, kind)| {
                            json!({
                                "id": id,
                                "reason": match kind {
                                    PendingKind::Approval => "tool_approval",
                                    PendingKind::ClientTool => "client_tool",
                                },
                                "toolCallId": id,
                                "expiresAt": action.expires_at,
                                "responseSchema": match kind {
                                    PendingKind::Approval => json!({
                                        "type": "object",
                                        "properties": {
                                            "approved": {"type": "boolean"},
                                            "reason": {"type": "string"},
                                        },
                                        "required": ["approved"],
                                    }),
                                    PendingKind::ClientTool => json!({}),
                                },
                            })
                        })
                        .collect();
                    json!({"type": "interrupt", "interrupts": interrupts})
                };
                let finished = self.run_finished(outcome, None);
                self.push(&mut out, finished);
            }
            EventPayload::RunResumed(resumed) => {
                if let Some(after) = resumed.abandoned_after {
                    let message_id = self.message_id.clone();
                    self.close_all(&mut out);
                    self.push(
                        &mut out,
                        AgUiEvent::Custom {
                            name: "behest.call_abandoned".to_owned(),
                            value: json!({"messageId": message_id, "abandonedAfter": after}),
                        },
                    );
                }
            }
            EventPayload::RunCompleted(completed) => {
                self.flush_results(&mut out);
                self.close_all(&mut out);
                let mut result = json!({
                    "finishReason": completed.finish_reason,
                    "iterations": completed.iterations,
                });
                // A run with an `output_schema`: its answer, parsed (`result` is any JSON).
                if let Some(parsed) = &completed.parsed {
                    result["parsed"] = parsed.clone();
                }
                let finished = self.run_finished(json!({"type": "success"}), Some(result));
                self.push(&mut out, finished);
            }
            EventPayload::RunFailed(failed) => {
                let code = failed
                    .error_class
                    .and_then(|class| serde_json::to_value(class).ok())
                    .and_then(|value| value.as_str().map(str::to_owned));
                self.push(
                    &mut out,
                    AgUiEvent::RunError {
                        message: failed.error.clone(),
                        code,
                    },
                );
            }
            EventPayload::RunCancelled(_) => {
                if self.open.run {
                    self.flush_results(&mut out);
                    self.close_all(&mut out);
                    let finished = self.run_finished(json!({"type": "cancelled"}), None);
                    self.push(&mut out, finished);
                } else {
                    // Cancelled while paused: the segment opens only to say so.
                    let started = self.run_started();
                    self.push(&mut out, started);
                    let finished = self.run_finished(json!({"type": "cancelled"}), None);
                    self.push(&mut out, finished);
                }
            }
            EventPayload::ToolProgress(progress) => {
                let id = self.calls.id(&progress.call_id);
                self.push(
                    &mut out,
                    AgUiEvent::Custom {
                        name: format!("behest.{}", event.payload.event_type()),
                        value: json!({
                            "toolCallId": id,
                            "progress": progress.progress,
                            "total": progress.total,
                            "message": progress.message,
                        }),
                    },
                );
            }
            EventPayload::ToolApprovalDecided(decided) => {
                let id = self.calls.id(&decided.call_id);
                if let Some(call) = self.calls.get_mut(&decided.call_id) {
                    call.decided = Some(decided.approved);
                }
                self.push(
                    &mut out,
                    AgUiEvent::Custom {
                        name: format!("behest.{}", event.payload.event_type()),
                        value: super::decision_notice(&event.payload, &id),
                    },
                );
            }
            EventPayload::CacheMetrics(_)
            | EventPayload::ModelRetrying(_)
            | EventPayload::ContextCompactionStarted(_)
            | EventPayload::OutputRejected(_)
            | EventPayload::ContextCompacted(_)
            | EventPayload::DoomLoopDetected(_)
            | EventPayload::CompactionCircuitOpened(_) => {
                let value = serde_json::to_value(&event.payload).unwrap_or(Value::Null);
                self.push(
                    &mut out,
                    AgUiEvent::Custom {
                        name: format!("behest.{}", event.payload.event_type()),
                        value,
                    },
                );
            }
            EventPayload::ReasoningDelta(_)
            | EventPayload::TextDelta(_)
            | EventPayload::ToolCallDelta(_)
            | EventPayload::ContextBuilt(_)
            | EventPayload::ToolExecutionStarted(_)
            | EventPayload::AssistantMessageCommitted(_) => {}
        }
        out
    }

    /// `RUN_STARTED`, then a start for the open step, reasoning span and message, text message
    /// and tool calls, as of `seen` frames of the next event after this state.
    fn prelude(&self, seen: &[AgUiEvent]) -> Vec<AgUiEvent> {
        let mut open = self.open.clone();
        for frame in seen {
            Self::observe(&mut open, frame);
        }
        if !open.run {
            return Vec::new();
        }
        let mut out = vec![self.run_started()];
        if let Some(step_name) = open.step {
            out.push(AgUiEvent::StepStarted { step_name });
        }
        if let Some(message_id) = open.reasoning_span {
            out.push(AgUiEvent::ReasoningStart { message_id });
        }
        if let Some(message_id) = open.reasoning_message {
            out.push(AgUiEvent::ReasoningMessageStart {
                message_id,
                role: "reasoning",
            });
        }
        if let Some(message_id) = open.text {
            out.push(AgUiEvent::TextMessageStart {
                message_id,
                role: "assistant",
            });
        }
        for (tool_call_id, tool_call_name, parent_message_id) in open.calls {
            out.push(AgUiEvent::ToolCallStart {
                tool_call_id,
                tool_call_name,
                parent_message_id,
            });
        }
        out
    }
}
