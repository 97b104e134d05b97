//! The event contract (seed `AgentEvent` enum, proto `agent.v1.AgentEvent`) and the live feed.
//!
//! An event on the wire is the envelope `{sequence, run_id, timestamp, trace_id, span_id}` plus
//! the payload, internally tagged with `"type"` in snake_case (the proto's oneof names).

mod call_names;
mod feed;
mod schema;
mod stored;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::domain::{
    CompactionId, CompactionTrigger, ErrorClass, FinishReason, MessageId, RequiredAction, RunEnd,
    RunId, SessionId, TokenUsage, ToolCall,
};

pub use call_names::{CallNames, split_tool_call_id, tool_call_id};
pub use feed::{EventFeed, EventFrame, FeedSubscription, LoggedEvent};
pub use stored::{StoredEnvelope, StoredEvent, UNKNOWN_KIND};

/// One event of a run's log: envelope plus payload (proto `AgentEvent`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentEvent {
    /// Per-run position, contiguous from 1; the SSE `id:`.
    pub sequence: u64,
    /// The run the event belongs to.
    pub run_id: RunId,
    /// When the event was emitted (RFC 3339, UTC).
    pub timestamp: DateTime<Utc>,
    /// W3C trace context trace id (32 hex chars), empty when unavailable.
    pub trace_id: String,
    /// W3C trace context span id (16 hex chars), empty when unavailable.
    pub span_id: String,
    /// What happened, tagged by `type`.
    #[serde(flatten)]
    pub payload: EventPayload,
}

impl AgentEvent {
    /// True for `run_completed`, `run_failed` and `run_cancelled`: the last event of a run.
    #[must_use]
    pub fn is_terminal(&self) -> bool {
        self.payload.is_terminal()
    }
}

macro_rules! event_payloads {
    ($($(#[$doc:meta])* $variant:ident($payload:ty) = $name:literal),+ $(,)?) => {
        /// The payload of an event, one variant per proto oneof field (seed `AgentEvent`).
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "type", rename_all = "snake_case")]
        pub enum EventPayload {
            $($(#[$doc])* $variant($payload),)+
        }

        impl EventPayload {
            /// The variant's `type` tag, also the SSE `event:` name.
            #[must_use]
            pub fn event_type(&self) -> &'static str {
                match self {
                    $(Self::$variant(_) => $name,)+
                }
            }
        }

        /// Every variant: `(type tag, schema component name, payload schema, payload's nested schemas)`.
        pub(crate) fn variant_schemas() -> Vec<schema::VariantSchema> {
            vec![$(schema::VariantSchema::of::<$payload>($name, concat!(stringify!($variant), "Event")),)+]
        }
    };
}

event_payloads! {
    /// The run began, after session load and input admission.
    RunStarted(RunStarted) = "run_started",
    /// The model's context was assembled.
    ContextBuilt(ContextBuilt) = "context_built",
    /// A model call began.
    ModelStarted(ModelStarted) = "model_started",
    /// Streamed text from the model.
    TextDelta(TextDelta) = "text_delta",
    /// The model began a tool call.
    ToolCallStarted(ToolCallStarted) = "tool_call_started",
    /// Streamed tool-call arguments.
    ToolCallDelta(ToolCallDelta) = "tool_call_delta",
    /// The model finished a tool call.
    ToolCallCompleted(ToolCallCompleted) = "tool_call_completed",
    /// A tool began executing.
    ToolExecutionStarted(ToolExecutionStarted) = "tool_execution_started",
    /// A tool finished executing.
    ToolExecutionFinished(ToolExecutionFinished) = "tool_execution_finished",
    /// The assistant message was stored.
    AssistantMessageCommitted(MessageCommitted) = "assistant_message_committed",
    /// A tool message was stored.
    ToolMessageCommitted(ToolMessageCommitted) = "tool_message_committed",
    /// Token usage of one model call (estimated, `estimated: true`, for a call cut off by a
    /// cancel or a failure before the provider reported any).
    UsageRecorded(UsageRecorded) = "usage_recorded",
    /// Prompt-cache statistics of one model call.
    CacheMetrics(CacheMetrics) = "cache_metrics",
    /// Terminal: the run completed.
    RunCompleted(RunCompleted) = "run_completed",
    /// Terminal: the run failed.
    RunFailed(RunFailed) = "run_failed",
    /// Terminal: the run was cancelled.
    RunCancelled(RunCancelled) = "run_cancelled",
    /// A repetitive tool-call pattern was detected; the run fails next.
    DoomLoopDetected(DoomLoopDetected) = "doom_loop_detected",
    /// The compaction circuit breaker opened.
    CompactionCircuitOpened(CompactionCircuitOpened) = "compaction_circuit_opened",
    /// Streamed reasoning ("thinking") of the model; never answer text.
    ReasoningDelta(ReasoningDelta) = "reasoning_delta",
    /// A model call attempt failed before any output and is retried after a pause.
    ModelRetrying(ModelRetrying) = "model_retrying",
    /// The run continues in a new server process after the one executing it stopped (crash,
    /// `kill -9`, shutdown); its log goes on with the next sequence.
    RunResumed(RunResumed) = "run_resumed",
    /// The run paused in `requires_action`: these tool calls wait for the client's outputs
    /// (`POST /runs/{run_id}/tool_outputs`) or a person's approval
    /// (`POST /runs/{run_id}/approvals`). For a client tool this stands where
    /// `tool_execution_started` would be; its answer comes as `tool_execution_finished`.
    ToolCallsRequired(RequiredAction) = "tool_calls_required",
    /// The run's context was compacted: older turns replaced by a summary in the requests that
    /// follow (the stored messages stay).
    ContextCompacted(ContextCompacted) = "context_compacted",
    /// The summariser was called to compact the run's context (status `compacting` until
    /// `context_compacted`, or the next event, says how it went).
    ContextCompactionStarted(ContextCompactionStarted) = "context_compaction_started",
    /// The run's final answer did not match its `output_schema`: a user message with the
    /// validation errors was stored, and the model is called again (a corrective turn).
    OutputRejected(OutputRejected) = "output_rejected",
    /// A tool reported progress while it executes (between its call's
    /// `tool_execution_started` and `tool_execution_finished`), at most one per
    /// `runtime.tool_progress_interval_ms` per call.
    ToolProgress(ToolProgress) = "tool_progress",
    /// A person approved or rejected a tool call the run waited for (`tool_calls_required`,
    /// kind `approval`): who decided what, before the call executes or is answered rejected.
    ToolApprovalDecided(ToolApprovalDecided) = "tool_approval_decided",
}

impl EventPayload {
    /// True for the three terminal variants.
    #[must_use]
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            Self::RunCompleted(_) | Self::RunFailed(_) | Self::RunCancelled(_)
        )
    }

    /// What a run's webhook is told of this event: its end (`run.completed`, `run.failed`,
    /// `run.cancelled`) or its pause (`run.requires_action`, `tool_calls_required`); `None`
    /// for any other event.
    #[must_use]
    pub fn webhook_event(&self) -> Option<crate::domain::WebhookEventType> {
        use crate::domain::WebhookEventType;
        Some(match self {
            Self::RunCompleted(_) => WebhookEventType::RunCompleted,
            Self::RunFailed(_) => WebhookEventType::RunFailed,
            Self::RunCancelled(_) => WebhookEventType::RunCancelled,
            Self::ToolCallsRequired(_) => WebhookEventType::RunRequiresAction,
            _ => return None,
        })
    }

    /// The terminal event of a run that ends `end` after `iterations` model calls.
    #[must_use]
    pub fn terminal(end: &RunEnd, iterations: u32) -> Self {
        match end {
            RunEnd::Completed {
                finish_reason,
                parsed,
            } => Self::RunCompleted(RunCompleted {
                finish_reason: *finish_reason,
                iterations,
                parsed: parsed.clone(),
            }),
            RunEnd::Failed { class, error } => Self::RunFailed(RunFailed {
                error: error.clone(),
                error_class: Some(*class),
            }),
            RunEnd::Cancelled => Self::RunCancelled(RunCancelled {}),
        }
    }

    /// How the run ended, for a terminal event (a `run_failed` an older version wrote without
    /// a class is `internal`); `None` for the others.
    #[must_use]
    pub fn run_end(&self) -> Option<RunEnd> {
        match self {
            Self::RunCompleted(completed) => Some(RunEnd::Completed {
                finish_reason: completed.finish_reason,
                parsed: completed.parsed.clone(),
            }),
            Self::RunFailed(failed) => Some(RunEnd::Failed {
                class: failed.error_class.unwrap_or(ErrorClass::Internal),
                error: failed.error.clone(),
            }),
            Self::RunCancelled(_) => Some(RunEnd::Cancelled),
            _ => None,
        }
    }
}

/// `run_started` (proto `RunStartedEvent`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RunStarted {
    /// The run's session.
    pub session_id: SessionId,
    /// Provider id used for model calls.
    pub provider: String,
    /// Model used for generation.
    pub model: String,
}

/// `context_built` (proto `ContextBuiltEvent`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ContextBuilt {
    /// Messages in the context sent to the model.
    pub message_count: u32,
}

/// `model_started` (proto `ModelStartedEvent`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ModelStarted {
    /// Provider being called.
    pub provider: String,
    /// Model being used.
    pub model: String,
    /// Iteration number, from 1.
    pub iteration: u32,
    /// The id the call's assistant message gets when it is stored: the `message_id` of its
    /// `assistant_message_committed` (also of the incomplete message a cancel or failure keeps
    /// of its text), known from the call's first event. A call cut off by a crash and made
    /// again after `run_resumed` gets a new id (nothing of the abandoned call is stored).
    /// Absent in logs written by older versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<MessageId>,
}

/// `text_delta` (proto `TextDeltaEvent`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TextDelta {
    /// The next piece of the assistant's text (UTF-8, never a split character).
    pub delta: String,
}

/// `tool_call_started` (proto `ToolCallStartedEvent`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolCallStarted {
    /// The provider's call id.
    pub call_id: String,
    /// The tool's name.
    pub tool_name: String,
}

/// `tool_call_delta` (proto `ToolCallDeltaEvent`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolCallDelta {
    /// The provider's call id.
    pub call_id: String,
    /// The next piece of the arguments' JSON text.
    pub delta: String,
}

/// `tool_call_completed` (proto `ToolCallCompletedEvent`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolCallCompleted {
    /// The complete call.
    pub call: ToolCall,
}

/// `tool_execution_started` (proto `ToolExecutionStartedEvent`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolExecutionStarted {
    /// The call being executed.
    pub call_id: String,
    /// The tool's name.
    pub tool_name: String,
}

/// `tool_execution_finished` (proto `ToolExecutionFinishedEvent`, seed `ToolExecutionFinished`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolExecutionFinished {
    /// The call that was executed.
    pub call_id: String,
    /// The tool's name.
    pub tool_name: String,
    /// What the tool returned, or why it failed.
    pub result: ToolExecutionResult,
    /// Execution time in ms.
    pub duration_ms: u64,
}

/// Result of one tool execution (seed `ToolExecutionResult`): `{"Success": {"output": …}}` or
/// `{"Failure": {"error": "…"}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub enum ToolExecutionResult {
    /// The tool executed successfully.
    Success(ToolSuccess),
    /// The tool failed; the model sees the error.
    Failure(ToolFailure),
}

/// A successful tool execution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolSuccess {
    /// The value the tool returned.
    pub output: serde_json::Value,
}

/// A failed tool execution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolFailure {
    /// Why the tool failed.
    pub error: String,
}

/// `assistant_message_committed` / `tool_message_committed` (seed `MessageCommitted`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MessageCommitted {
    /// The stored message's id.
    pub message_id: MessageId,
}

/// `tool_message_committed` (seed `MessageCommitted`, with the call it answers).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolMessageCommitted {
    /// The stored message's id.
    pub message_id: MessageId,
    /// The provider's id of the call the message answers (its `tool_call_id`). Absent in logs
    /// written by older versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
}

/// `usage_recorded` (proto `UsageRecordedEvent`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct UsageRecorded {
    /// Tokens of this model call.
    pub usage: TokenUsage,
}

/// `cache_metrics` (seed `CacheMetrics`): prompt-cache statistics of one model call, in tokens.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CacheMetrics {
    /// Input tokens written to the cache (Anthropic `cache_creation_input_tokens`).
    pub cache_creation_input_tokens: u64,
    /// Input tokens read from the cache (Anthropic `cache_read_input_tokens`).
    pub cache_read_input_tokens: u64,
    /// Input tokens served from the cache (OpenAI `prompt_tokens_details.cached_tokens`).
    pub cached_input_tokens: u64,
}

/// `run_completed` (proto `RunCompletedEvent`), terminal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RunCompleted {
    /// Why the model stopped.
    pub finish_reason: FinishReason,
    /// Model calls made.
    pub iterations: u32,
    /// For a run with an `output_schema`: its final answer, parsed and validated against the
    /// schema (also the run output's `parsed`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub parsed: Option<serde_json::Value>,
}

/// `output_rejected`: the final answer (the last assistant message's text) did not match the
/// run's `output_schema`; the user message it announces tells the model what was wrong.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OutputRejected {
    /// The stored user message with the validation errors (role `user`).
    pub message_id: MessageId,
    /// What did not match: one entry for an answer that is not JSON (`instance_path` `""`), or
    /// up to 20 schema violations (a last `"and N more"` entry when there were more). Logs
    /// written before this was a list hold one string: it is read as one entry with
    /// `instance_path` `""`.
    #[serde(deserialize_with = "violations")]
    pub errors: Vec<OutputViolation>,
    /// Which corrective turn this is, from 1 (at most the server's
    /// `runtime.output_corrections`).
    pub attempt: u32,
}

/// One way a final answer did not match the run's `output_schema`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct OutputViolation {
    /// Where in the answer, as a JSON Pointer (RFC 6901; `""` is the whole answer), as the
    /// `jsonschema` crate reports it.
    pub instance_path: String,
    /// What is wrong there, in words.
    pub message: String,
}

/// `output_rejected.errors` as a list, or as the one string older logs hold.
fn violations<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Vec<OutputViolation>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Errors {
        List(Vec<OutputViolation>),
        Text(String),
    }
    Ok(match Errors::deserialize(deserializer)? {
        Errors::List(list) => list,
        Errors::Text(message) => vec![OutputViolation {
            instance_path: String::new(),
            message,
        }],
    })
}

/// `tool_approval_decided`: the decision on one call that waited for approval, logged once the
/// run has every answer it waited for, in the model's call order, before the calls execute
/// (approved: `tool_execution_started` follows) or are answered (rejected: a
/// `tool_execution_finished` with the `Failure` "rejected by the user…", never executed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolApprovalDecided {
    /// The call decided on (`tool_calls_required.tool_calls[].call_id`).
    pub call_id: String,
    /// The tool's name.
    pub tool_name: String,
    /// `true`: the tool runs; `false`: it does not.
    pub approved: bool,
    /// Why, as the decision gave it (`POST /runs/{run_id}/approvals` `reason`, the AI SDK's
    /// `approval.reason`, AG-UI's `payload.reason`); absent when none was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Who decided, as the request named them (`decided_by` of `POST /runs/{run_id}/approvals`,
    /// `payload.decidedBy` of an AG-UI `resume` entry): the client's word, not checked by
    /// behest; absent when not given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    /// The API key that authenticated the request carrying the decision: its position, from
    /// 0, among the server's configured keys (`[auth] keys`, then `keys_env`'s); absent when
    /// the server has no keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<u32>,
}

/// `run_failed` (proto `RunFailedEvent`), terminal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RunFailed {
    /// What went wrong, readable by a person.
    pub error: String,
    /// Why the run failed: the class of the model provider failure, or `doom_loop`,
    /// `limit_exceeded`, `interrupted` (shutdown or crash) or `internal`. behest always sets
    /// it; optional only for logs written by older versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_class: Option<ErrorClass>,
}

/// `run_cancelled` (proto `RunCancelledEvent`), terminal.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RunCancelled {}

/// `doom_loop_detected` (proto `DoomLoopDetectedEvent`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DoomLoopDetected {
    /// The repeated pattern.
    pub description: String,
}

/// `compaction_circuit_opened` (proto `CompactionCircuitOpenedEvent`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CompactionCircuitOpened {
    /// Consecutive compaction failures that opened the breaker.
    pub consecutive_failures: u32,
}

/// `reasoning_delta`: a piece of the model's reasoning (OpenAI-compatible `reasoning_content`,
/// Anthropic `thinking_delta`). Not part of the answer; the complete blocks are stored with the
/// assistant message (`Message.reasoning`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ReasoningDelta {
    /// The next piece of reasoning text (UTF-8).
    pub delta: String,
}

/// `run_resumed`: the run was taken over by a new server process (after a crash, `kill -9` or a
/// shutdown) and continues from its last snapshot and committed messages. The first event a
/// resumed run writes. Nothing before it is rewritten or sent again; committed messages stay;
/// a tool call whose execution was cut off gets a result marked interrupted (or runs again when
/// its tool is idempotent).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RunResumed {
    /// The iteration the run continues with: the next `model_started` has this `iteration`
    /// (the same one as the abandoned call's, when `abandoned_after` is set).
    pub iteration: u32,
    /// The `sequence` of the `model_started` whose call was cut off, or null. Every
    /// `text_delta`, `reasoning_delta`, `tool_call_started`, `tool_call_delta`,
    /// `tool_call_completed`, `usage_recorded` and `cache_metrics` event after it and before
    /// this one belongs to that abandoned call (a tool call it had begun is completed there with
    /// its argument text so far as `invalid_arguments`): a client drops its text and tool
    /// calls, none of which is executed. The call
    /// is made again (a new `model_started` with the same `iteration`); nothing of the abandoned
    /// one was stored as a message, so `GET /runs/{id}/output` never contains it.
    pub abandoned_after: Option<u64>,
}

/// `model_retrying`: a model call attempt failed before any output; the call is made again
/// after `delay_ms`. Follows the call's `model_started`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ModelRetrying {
    /// The attempt that failed, from 1.
    pub attempt: u32,
    /// Its failure class.
    pub error_class: ErrorClass,
    /// The pause before the next attempt, in ms.
    pub delay_ms: u64,
    /// Why the attempt failed (no secrets).
    pub error: String,
}

/// `context_compacted`: the older turns of the session were summarised, and the requests that
/// follow hold the system content, this summary, then the messages after `through_message_id`
/// (and the latest user input, always kept verbatim). Every original message stays stored;
/// `GET /sessions/{session_id}/messages` lists the compaction with them. Comes before the
/// `model_started` of the call it makes room for (`trigger` `auto`), or after the
/// `model_retrying` of a call the provider rejected as too long (`reactive`), which is then
/// made again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ContextCompacted {
    /// The stored compaction.
    pub compaction_id: CompactionId,
    /// What made it happen: `auto` or `reactive`.
    pub trigger: CompactionTrigger,
    /// Original messages summarised by this compaction.
    pub messages_summarised: u32,
    /// The last message the summary covers.
    pub through_message_id: MessageId,
    /// The request's estimated size before, in tokens.
    pub tokens_before: u64,
    /// The request's estimated size after, in tokens.
    pub tokens_after: u64,
    /// The summary, as the next requests carry it.
    pub summary: String,
    /// The summariser's token usage (counted in the run's `total_usage`).
    pub usage: TokenUsage,
    /// How long the summariser took, in ms.
    pub duration_ms: u64,
}

/// `context_compaction_started`: the summariser was called to compact the run's context; the run
/// is in status `compacting` until the call returns (seconds to minutes with a large local
/// model). What follows says how it went: `context_compacted` on success; on a failure nothing
/// (or `compaction_circuit_opened`, when this failure opened the breaker) and the run goes on
/// with its request as it is, or fails with `context_length_exceeded` when that does not fit.
/// A cancel meanwhile is an ordinary cancel (`run_cancelled`). Comes where `context_compacted`
/// may come: before a call's `model_started` (`trigger` `auto`), or after the `model_retrying`
/// of a call the provider rejected as too long (`reactive`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ContextCompactionStarted {
    /// What made it happen: `auto` or `reactive`.
    pub trigger: CompactionTrigger,
    /// Original messages being summarised (older than the turns kept verbatim).
    pub messages_to_summarise: u32,
    /// The request's estimated size before the compaction, in tokens.
    pub tokens_before: u64,
    /// The summariser's provider id (the compaction provider, else the run's).
    pub provider: String,
    /// The summariser's model (the compaction model, else the run's).
    pub model: String,
}

/// `tool_progress`: what an executing tool said of its progress (MCP `notifications/progress`,
/// an HTTP tool's streamed `progress` events or lines), passed through as the tool said it: not
/// necessarily increasing, `total` may change. Comes between the call's
/// `tool_execution_started` and `tool_execution_finished`, at most one per call per
/// `runtime.tool_progress_interval_ms` (default 250 ms): a tool that reports faster has its
/// updates coalesced, the latest one wins, and the update pending when the execution finishes
/// is dropped (the result says the rest). Changes nothing of the call's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolProgress {
    /// The call being executed.
    pub call_id: String,
    /// Progress so far, in the tool's own unit (items, bytes, percent…); a finite number.
    pub progress: f64,
    /// The total in the same unit, when the tool knows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total: Option<f64>,
    /// What the tool is doing, readable by a person.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::{EventPayload, OutputViolation};

    /// `output_rejected.errors` is a list of `{instance_path, message}`; a log written when it
    /// was one string still reads (as one entry for the whole answer).
    #[test]
    fn output_rejected_errors_read_as_a_list_or_the_old_string() {
        let message_id = "0190a5c2-7e6b-7cc4-9a55-1d1b7c2f0e01";
        let old: Result<EventPayload, _> = serde_json::from_value(serde_json::json!({
            "type": "output_rejected", "message_id": message_id,
            "errors": "the answer is not JSON (expected value at line 1 column 1)", "attempt": 1
        }));
        let Ok(EventPayload::OutputRejected(old)) = old else {
            panic!("{old:?}");
        };
        assert_eq!(
            old.errors,
            vec![OutputViolation {
                instance_path: String::new(),
                message: "the answer is not JSON (expected value at line 1 column 1)".to_owned(),
            }]
        );
        let list = serde_json::json!({
            "type": "output_rejected", "message_id": message_id,
            "errors": [{"instance_path": "/days", "message": "\"x\" is not of type \"integer\""}],
            "attempt": 1
        });
        let new: Result<EventPayload, _> = serde_json::from_value(list.clone());
        let Ok(new) = new else { panic!("{new:?}") };
        assert_eq!(serde_json::to_value(&new).ok(), Some(list));
    }

    /// Event types are told apart by [`EventPayload`]'s variants: no source outside `events/`
    /// names one by its `type` tag in quotes. Left out: `provider/`, whose wire formats have
    /// tags of their own that coincide (Anthropic's `text_delta`), and `bin/`, whose
    /// `behest-bench` is a client of the wire format (it reads SSE frames by their `event:`
    /// names, as any client does).
    #[test]
    fn event_types_are_named_by_their_tags_only_in_events() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let skipped = ["events", "provider", "bin"].map(|dir| src.join(dir));
        let tags: Vec<String> = super::variant_schemas()
            .iter()
            .map(|variant| format!("\"{}\"", variant.tag))
            .collect();
        let mut pending = vec![src];
        let mut files: Vec<PathBuf> = Vec::new();
        while let Some(dir) = pending.pop() {
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let path = entry.path();
                if path.is_dir() && !skipped.contains(&path) {
                    pending.push(path);
                } else if path.extension().is_some_and(|ext| ext == "rs") {
                    files.push(path);
                }
            }
        }
        assert!(files.len() > 50, "the sources were found: {files:?}");
        let mut found = Vec::new();
        for file in &files {
            let text = std::fs::read_to_string(file).unwrap_or_default();
            for (number, line) in text.lines().enumerate() {
                if let Some(tag) = tags.iter().find(|tag| line.contains(tag.as_str())) {
                    found.push(format!("{}:{}: {tag}", file.display(), number + 1));
                }
            }
        }
        assert!(
            found.is_empty(),
            "event types matched by their tags outside src/events/ (match on EventPayload, or \
             read the run's RunTrail):\n{}",
            found.join("\n")
        );
    }
}
