//! behest's log as the AI SDK UI message stream (`useChat`, `readUIMessageStream`): the fold
//! of the mapping in `notes/frontend-protocols.md` §3.1.
//!
//! One run is one UI message (`messageId` = run id: `/chat` routes answers by it, and the
//! session's stored messages carry their `run_id`); a step is one model call with its tool
//! executions, opened by a transient `data-behest-model-started` part naming the assistant
//! message the step is stored as (`model_started.message_id`). Part ids are derived from the
//! log: `t<seq>` / `r<seq>` for the text and reasoning part opened by the event of that
//! sequence, and tool call ids are namespaced ([`super::tool_call_id`]). Dialect `v6` sends only
//! chunks both `ai` 6 and `ai` 7 accept; `v7` adds `reset-step`, `tool-approval-response` (from
//! `tool_approval_decided`; from the execution or the denial in older logs) and
//! `finishReason: "interrupted"`.

use serde_json::{Value, json};

use super::{AiSdkDialect, CallKind, Calls, Projection, RunContext};
use crate::domain::{FinishReason, PendingKind};
use crate::events::{AgentEvent, EventPayload, ToolExecutionResult};

/// The fold state of one run's UI message stream.
#[derive(Debug, Clone)]
pub struct AiSdk {
    dialect: AiSdkDialect,
    run: RunContext,
    calls: Calls,
    step_open: bool,
    text_open: Option<String>,
    reasoning_open: Option<String>,
    /// After a `tool_calls_required`: the next event opens a new segment (`start`).
    paused: bool,
}

impl AiSdk {
    /// The projection of `run` in `dialect`, before its first event.
    #[must_use]
    pub fn new(run: RunContext, dialect: AiSdkDialect) -> Self {
        let run_id = run.run_id;
        Self {
            dialect,
            run,
            calls: Calls::new(run_id),
            step_open: false,
            text_open: None,
            reasoning_open: None,
            paused: false,
        }
    }

    fn v7(&self) -> bool {
        self.dialect == AiSdkDialect::V7
    }

    fn close_parts(&mut self, out: &mut Vec<Value>) {
        if let Some(id) = self.text_open.take() {
            out.push(json!({"type": "text-end", "id": id}));
        }
        if let Some(id) = self.reasoning_open.take() {
            out.push(json!({"type": "reasoning-end", "id": id}));
        }
    }

    fn close_step(&mut self, out: &mut Vec<Value>) {
        self.close_parts(out);
        if std::mem::take(&mut self.step_open) {
            out.push(json!({"type": "finish-step"}));
        }
    }

    /// `dynamic` + `providerExecuted` for a server tool (no `onToolCall`), nothing for a
    /// client tool or a call that waits for approval (a static `tool-<name>` part).
    fn flags(kind: CallKind, chunk: &mut Value) {
        if kind == CallKind::Server {
            chunk["dynamic"] = json!(true);
            chunk["providerExecuted"] = json!(true);
        }
    }
}

fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::ToolCalls => "tool-calls",
        FinishReason::Length => "length",
        FinishReason::ContentFilter => "content-filter",
        FinishReason::Error => "error",
        FinishReason::Unknown => "other",
    }
}

impl Projection for AiSdk {
    type Frame = Value;
    const DONE: Option<&'static str> = Some("[DONE]");

    fn frames(&mut self, event: &AgentEvent) -> Vec<Value> {
        self.calls.record(event);
        let mut out = Vec::new();
        let run_id = self.run.run_id.to_string();
        if std::mem::take(&mut self.paused) {
            out.push(json!({"type": "start", "messageId": run_id}));
        }
        let seq = event.sequence;
        match &event.payload {
            EventPayload::RunStarted(started) => out.push(json!({
                "type": "start",
                "messageId": run_id,
                "messageMetadata": {"behest": {
                    "runId": run_id,
                    "sessionId": started.session_id,
                    "provider": started.provider,
                    "model": started.model,
                }},
            })),
            EventPayload::ModelStarted(started) => {
                self.close_step(&mut out);
                self.step_open = true;
                out.push(json!({"type": "start-step"}));
                // The stored assistant message of this step, known before its first token
                // (`GET /sessions/{id}/messages`; the UI message is the run's).
                if let Some(message_id) = started.message_id {
                    out.push(json!({
                        "type": "data-behest-model-started",
                        "data": {"messageId": message_id, "iteration": started.iteration},
                        "transient": true,
                    }));
                }
            }
            EventPayload::ToolApprovalDecided(decided) => {
                let id = self.calls.id(&decided.call_id);
                if let Some(call) = self.calls.get_mut(&decided.call_id) {
                    call.decided = Some(decided.approved);
                }
                out.push(json!({
                    "type": "data-behest-tool-approval-decided",
                    "data": super::decision_notice(&event.payload, &id),
                    "transient": true,
                }));
                if self.v7() {
                    let mut chunk = json!({
                        "type": "tool-approval-response",
                        "approvalId": id,
                        "approved": decided.approved,
                    });
                    if let Some(reason) = &decided.reason {
                        chunk["reason"] = json!(reason);
                    }
                    out.push(chunk);
                }
            }
            EventPayload::ReasoningDelta(delta) => {
                if let Some(id) = self.text_open.take() {
                    out.push(json!({"type": "text-end", "id": id}));
                }
                let id = match &self.reasoning_open {
                    Some(id) => id.clone(),
                    None => {
                        let id = format!("r{seq}");
                        out.push(json!({"type": "reasoning-start", "id": id}));
                        self.reasoning_open = Some(id.clone());
                        id
                    }
                };
                out.push(json!({"type": "reasoning-delta", "id": id, "delta": delta.delta}));
            }
            EventPayload::TextDelta(delta) => {
                if let Some(id) = self.reasoning_open.take() {
                    out.push(json!({"type": "reasoning-end", "id": id}));
                }
                let id = match &self.text_open {
                    Some(id) => id.clone(),
                    None => {
                        let id = format!("t{seq}");
                        out.push(json!({"type": "text-start", "id": id}));
                        self.text_open = Some(id.clone());
                        id
                    }
                };
                out.push(json!({"type": "text-delta", "id": id, "delta": delta.delta}));
            }
            EventPayload::ToolCallStarted(started) => {
                self.close_parts(&mut out);
                let call = self
                    .calls
                    .start(&self.run, &started.call_id, &started.tool_name);
                let mut chunk = json!({
                    "type": "tool-input-start",
                    "toolCallId": call.id,
                    "toolName": call.tool_name,
                });
                Self::flags(call.kind, &mut chunk);
                out.push(chunk);
            }
            EventPayload::ToolCallDelta(delta) => {
                let id = self.calls.id(&delta.call_id);
                out.push(json!({
                    "type": "tool-input-delta",
                    "toolCallId": id,
                    "inputTextDelta": delta.delta,
                }));
            }
            EventPayload::ToolCallCompleted(completed) => {
                self.close_parts(&mut out);
                let call = &completed.call;
                let info = match self.calls.get(&call.id) {
                    Some(info) => info.clone(),
                    None => self.calls.start(&self.run, &call.id, &call.name).clone(),
                };
                let mut chunk = match &call.invalid_arguments {
                    Some(raw) => json!({
                        "type": "tool-input-error",
                        "toolCallId": info.id,
                        "toolName": call.name,
                        "input": raw,
                        "errorText": "the arguments are not valid JSON",
                    }),
                    None => json!({
                        "type": "tool-input-available",
                        "toolCallId": info.id,
                        "toolName": call.name,
                        "input": call.arguments,
                    }),
                };
                Self::flags(info.kind, &mut chunk);
                out.push(chunk);
            }
            EventPayload::UsageRecorded(_) => self.close_parts(&mut out),
            EventPayload::ToolExecutionStarted(started) => {
                let v7 = self.v7();
                if let Some(call) = self.calls.get_mut(&started.call_id) {
                    call.executing = true;
                    // A log without `tool_approval_decided` (older versions): the start says it.
                    if v7 && call.waits == Some(PendingKind::Approval) && call.decided.is_none() {
                        out.push(json!({
                            "type": "tool-approval-response",
                            "approvalId": call.id,
                            "approved": true,
                        }));
                    }
                }
            }
            EventPayload::ToolExecutionFinished(finished) => {
                let call = self
                    .calls
                    .get(&finished.call_id)
                    .cloned()
                    .unwrap_or_else(|| {
                        self.calls
                            .start(&self.run, &finished.call_id, &finished.tool_name)
                            .clone()
                    });
                let denied = call.decided == Some(false)
                    || (call.decided.is_none()
                        && call.waits == Some(PendingKind::Approval)
                        && !call.executing);
                let mut chunk = match &finished.result {
                    _ if denied => {
                        if self.v7() && call.decided.is_none() {
                            out.push(json!({
                                "type": "tool-approval-response",
                                "approvalId": call.id,
                                "approved": false,
                            }));
                        }
                        json!({"type": "tool-output-denied", "toolCallId": call.id})
                    }
                    ToolExecutionResult::Success(success) => json!({
                        "type": "tool-output-available",
                        "toolCallId": call.id,
                        "output": success.output,
                    }),
                    ToolExecutionResult::Failure(failure) => json!({
                        "type": "tool-output-error",
                        "toolCallId": call.id,
                        "errorText": failure.error,
                    }),
                };
                if !denied {
                    Self::flags(call.kind, &mut chunk);
                }
                out.push(chunk);
            }
            EventPayload::ToolCallsRequired(action) => {
                self.close_parts(&mut out);
                for pending in &action.tool_calls {
                    let id = self.calls.id(&pending.call_id);
                    if let Some(call) = self.calls.get_mut(&pending.call_id) {
                        call.waits = Some(pending.kind);
                    }
                    if pending.kind == PendingKind::Approval {
                        out.push(json!({
                            "type": "tool-approval-request",
                            "approvalId": id,
                            "toolCallId": id,
                        }));
                    }
                }
                self.close_step(&mut out);
                out.push(json!({
                    "type": "finish",
                    "finishReason": "tool-calls",
                    "messageMetadata": {"behest": {
                        "status": "requires_action",
                        "expiresAt": action.expires_at,
                    }},
                }));
                self.paused = true;
            }
            EventPayload::RunResumed(resumed) => {
                if let Some(after) = resumed.abandoned_after {
                    self.close_parts(&mut out);
                    if self.v7() {
                        // The abandoned call's parts go; its step is not re-opened.
                        out.push(json!({"type": "reset-step"}));
                        self.step_open = false;
                    } else {
                        out.push(json!({
                            "type": "data-behest-call-abandoned",
                            "data": {"abandonedAfter": after, "iteration": resumed.iteration},
                            "transient": true,
                        }));
                    }
                }
            }
            EventPayload::RunCompleted(completed) => {
                self.close_step(&mut out);
                let mut metadata = json!({"behest": {"iterations": completed.iterations}});
                // A run with an `output_schema`: its answer, parsed (as `run_completed.parsed`).
                if let Some(parsed) = &completed.parsed {
                    metadata["parsed"] = parsed.clone();
                }
                out.push(json!({
                    "type": "finish",
                    "finishReason": finish_reason(completed.finish_reason),
                    "messageMetadata": metadata,
                }));
            }
            EventPayload::RunFailed(failed) => {
                self.close_step(&mut out);
                out.push(json!({"type": "error", "errorText": failed.error}));
                out.push(json!({
                    "type": "finish",
                    "finishReason": "error",
                    "messageMetadata": {"behest": {"errorClass": failed.error_class}},
                }));
            }
            EventPayload::RunCancelled(_) => {
                self.close_step(&mut out);
                out.push(json!({"type": "abort", "reason": "cancelled"}));
                out.push(if self.v7() {
                    json!({"type": "finish", "finishReason": "interrupted"})
                } else {
                    json!({"type": "finish"})
                });
            }
            // Not transient, with the call's id: each report replaces the last one in the
            // message, so a client shows the latest progress beside its tool part.
            EventPayload::ToolProgress(progress) => {
                let id = self.calls.id(&progress.call_id);
                out.push(json!({
                    "type": format!("data-behest-{}", event.payload.event_type().replace('_', "-")),
                    "id": id,
                    "data": {
                        "toolCallId": id,
                        "progress": progress.progress,
                        "total": progress.total,
                        "message": progress.message,
                    },
                }));
            }
            EventPayload::CacheMetrics(_)
            | EventPayload::ModelRetrying(_)
            | EventPayload::ContextCompactionStarted(_)
            | EventPayload::OutputRejected(_)
            | EventPayload::ContextCompacted(_)
            | EventPayload::DoomLoopDetected(_)
            | EventPayload::CompactionCircuitOpened(_) => out.push(json!({
                "type": format!("data-behest-{}", event.payload.event_type().replace('_', "-")),
                "data": event.payload,
                "transient": true,
            })),
            EventPayload::ContextBuilt(_)
            | EventPayload::AssistantMessageCommitted(_)
            | EventPayload::ToolMessageCommitted(_) => {}
        }
        out
    }

    fn prelude(&self, _seen: &[Value]) -> Vec<Value> {
        // A prelude breaks the AI SDK reader (a re-sent `text-start` splits the text part):
        // a continuation is for a reader that kept its state.
        Vec::new()
    }
}
