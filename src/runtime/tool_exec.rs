//! Executing the model's tool calls and committing their results: every
//! `tool_execution_started` gets exactly one `tool_execution_finished` (also when the run is
//! cancelled, shut down or interrupted mid-call), and every tool call of the session gets
//! exactly one tool message, so the session's next request is one providers accept.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use chrono::Utc;

use super::{RunEmitter, Runtime};
use crate::config::RuntimeConfig;
use crate::domain::{ContentPart, Message, MessageId, Role, RunRecord, RunStatus, ToolCall};
use crate::events::{
    EventPayload, MessageCommitted, ToolExecutionFinished, ToolExecutionResult,
    ToolExecutionStarted, ToolFailure, ToolSuccess,
};
use crate::store::{RunChange, Store, StoreError};
use crate::telemetry;
use crate::tools::ToolError;

use super::event_log::LogError;

/// The result text of a call that was left open when the server stopped (crash or shutdown).
pub(super) const INTERRUPTED: &str =
    "interrupted: the server stopped before this tool call finished; its outcome is unknown";
/// The result text of a call that was open when the run was cancelled.
pub(super) const CANCELLED: &str =
    "cancelled: the run was cancelled before this tool call finished";

/// Bytes of invalid argument text quoted back to the model.
const ARGUMENT_EXCERPT_BYTES: usize = 200;

/// Executions that emitted `tool_execution_started` and not yet `tool_execution_finished`,
/// shared with the supervisor, which finishes them when it aborts the run.
#[derive(Debug, Clone, Default)]
pub(super) struct InFlight(Arc<Mutex<Vec<(String, String, Instant)>>>);

impl InFlight {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(String, String, Instant)>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn add(&self, call: &ToolCall) {
        self.lock()
            .push((call.id.clone(), call.name.clone(), Instant::now()));
    }

    fn remove(&self, call_id: &str) {
        let mut open = self.lock();
        if let Some(position) = open.iter().position(|(id, _, _)| id == call_id) {
            open.remove(position);
        }
    }

    /// Emits `tool_execution_finished` with a `Failure` (`reason`) for every execution still
    /// open, and forgets them.
    pub(super) async fn finish_all(
        &self,
        emitter: &RunEmitter,
        reason: &str,
    ) -> Result<(), LogError> {
        let open = std::mem::take(&mut *self.lock());
        for (call_id, tool_name, started) in open {
            emitter
                .emit(EventPayload::ToolExecutionFinished(ToolExecutionFinished {
                    call_id,
                    tool_name,
                    result: ToolExecutionResult::Failure(ToolFailure {
                        error: reason.to_owned(),
                    }),
                    duration_ms: millis(started),
                }))
                .await?;
        }
        Ok(())
    }
}

fn millis(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// How a tool call is answered.
#[derive(Debug, Clone)]
pub(super) enum Execution {
    /// Executed: `tool_execution_started`, the call, `tool_execution_finished`.
    Run,
    /// Its execution was cut off by a crash and its tool is idempotent: executed again, with
    /// only a `tool_execution_finished` (its `tool_execution_started` is in the log).
    Rerun,
    /// Its execution was cut off by a crash: not executed again; `tool_execution_finished`
    /// with a `Failure` saying the outcome is unknown.
    Interrupted,
    /// Its `tool_execution_finished` is in the log already: its result is answered as logged.
    Logged(ToolExecutionResult),
    /// Not executed here: its result came from outside (a client tool's output, a rejected
    /// approval) or from a check, after the run waited this many ms; only a
    /// `tool_execution_finished` (which moves the run out of `requires_action`).
    Answered(ToolExecutionResult, u64),
}

/// Executes one tool call (see [`Execution`]): `tool_execution_started`, the call (validated,
/// with the timeout), `tool_execution_finished`. A call with invalid arguments is not
/// executed: its result is a `Failure` quoting the start of its argument text. Returns the
/// content of its tool message.
pub(super) async fn execute_tool(
    runtime: &Runtime,
    emitter: &RunEmitter,
    in_flight: &InFlight,
    record: &RunRecord,
    call: ToolCall,
    config: &RuntimeConfig,
    execution: Execution,
) -> Result<(ToolCall, Vec<ContentPart>), LogError> {
    if let Execution::Logged(result) = &execution {
        return Ok((call, tool_content(result)));
    }
    // Its span is the one its events are emitted in; metrics name only tools the registry
    // knows (a model may call any name).
    let mut span = telemetry::spans::tool_execution(emitter.trace(), &call.name, &call.id);
    let tool = if runtime.tools().contains(&call.name) {
        call.name.clone()
    } else {
        "unknown".to_owned()
    };
    let started = Instant::now();
    let executed = span
        .scope(run_tool(
            runtime, emitter, in_flight, record, call, config, execution,
        ))
        .await;
    if let Ok((_, _, failure)) = &executed {
        telemetry::metrics::tool_execution(&tool, failure.is_none(), started.elapsed());
        if let Some((error_type, message)) = failure {
            span.fail(error_type, message);
        }
    }
    span.end();
    executed.map(|(call, content, _)| (call, content))
}

/// The result of a tool execution that failed: `error.type` and the error text.
type ToolFailureInfo = Option<(&'static str, String)>;

/// [`execute_tool`] within the execution's span.
async fn run_tool(
    runtime: &Runtime,
    emitter: &RunEmitter,
    in_flight: &InFlight,
    record: &RunRecord,
    call: ToolCall,
    config: &RuntimeConfig,
    execution: Execution,
) -> Result<(ToolCall, Vec<ContentPart>, ToolFailureInfo), LogError> {
    match execution {
        Execution::Logged(result) => return Ok((call, tool_content(&result), None)),
        Execution::Answered(result, waited_ms) => {
            let content = tool_content(&result);
            // The client's answer: a failure it reported is the execution's error.
            let failure = match &result {
                ToolExecutionResult::Failure(failure) => {
                    Some(("tool_error", failure.error.clone()))
                }
                ToolExecutionResult::Success(_) => None,
            };
            emitter
                .emit_with(
                    EventPayload::ToolExecutionFinished(ToolExecutionFinished {
                        call_id: call.id.clone(),
                        tool_name: call.name.clone(),
                        result,
                        duration_ms: waited_ms,
                    }),
                    RunChange {
                        status: Some(RunStatus::WaitingForTools),
                        ..RunChange::default()
                    },
                )
                .await?;
            return Ok((call, content, failure));
        }
        Execution::Interrupted => {
            let result = ToolExecutionResult::Failure(ToolFailure {
                error: INTERRUPTED.to_owned(),
            });
            let content = tool_content(&result);
            emitter
                .emit(EventPayload::ToolExecutionFinished(ToolExecutionFinished {
                    call_id: call.id.clone(),
                    tool_name: call.name.clone(),
                    result,
                    duration_ms: 0,
                }))
                .await?;
            return Ok((call, content, Some(("interrupted", INTERRUPTED.to_owned()))));
        }
        Execution::Run | Execution::Rerun => {}
    }
    // Registered in the same poll that queues the event: an abort cannot fall in between.
    in_flight.add(&call);
    if matches!(execution, Execution::Run) {
        emitter
            .emit_with(
                EventPayload::ToolExecutionStarted(ToolExecutionStarted {
                    call_id: call.id.clone(),
                    tool_name: call.name.clone(),
                }),
                RunChange {
                    status: Some(RunStatus::WaitingForTools),
                    ..RunChange::default()
                },
            )
            .await?;
    }
    let started = Instant::now();
    let allowed = record
        .server_tools()
        .is_none_or(|tools| tools.contains(&call.name));
    let outcome = if let Some(raw) = &call.invalid_arguments {
        Err((
            "invalid_arguments",
            format!(
                "the arguments were not valid JSON: {}",
                excerpt(raw, ARGUMENT_EXCERPT_BYTES)
            ),
        ))
    } else if allowed {
        let timeout_ms = record.tool_timeout_ms.unwrap_or(config.tool_timeout_ms);
        let timeout = Duration::from_millis(timeout_ms);
        match tokio::time::timeout(timeout, runtime.tools().call(&call.name, &call.arguments)).await
        {
            Ok(result) => result.map_err(|error| {
                let error_type = match &error {
                    ToolError::UnknownTool(_) => "tool_not_found",
                    ToolError::InvalidArguments { .. } => "invalid_arguments",
                    ToolError::Failed(_) => "tool_error",
                };
                (error_type, error.to_string())
            }),
            Err(_) => Err((
                "timeout",
                format!("`{}` timed out after {timeout_ms} ms", call.name),
            )),
        }
    } else {
        Err((
            "tool_not_available",
            format!("the tool `{}` is not available to this run", call.name),
        ))
    };
    let budget = config.max_tool_output_bytes;
    let mut failure = None;
    let result = match outcome {
        Ok(output) => ToolExecutionResult::Success(ToolSuccess {
            output: truncate_output(output, budget),
        }),
        Err((error_type, error)) => {
            let error = truncate_text(&error, budget);
            failure = Some((error_type, error.clone()));
            ToolExecutionResult::Failure(ToolFailure { error })
        }
    };
    let content = tool_content(&result);
    in_flight.remove(&call.id);
    emitter
        .emit(EventPayload::ToolExecutionFinished(ToolExecutionFinished {
            call_id: call.id.clone(),
            tool_name: call.name.clone(),
            result,
            duration_ms: millis(started),
        }))
        .await?;
    Ok((call, content, failure))
}

/// The first `max` bytes of `text` (cut on a UTF-8 boundary), with `…` when cut.
fn excerpt(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut cut = max;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &text[..cut])
}

/// What the model sees of a result: a string output as text, other JSON as a JSON part, a
/// failure as text starting with `error: `.
fn tool_content(result: &ToolExecutionResult) -> Vec<ContentPart> {
    match result {
        ToolExecutionResult::Success(ToolSuccess {
            output: serde_json::Value::String(text),
        }) => vec![ContentPart::Text { text: text.clone() }],
        ToolExecutionResult::Success(success) => vec![ContentPart::Json {
            value: success.output.clone(),
        }],
        ToolExecutionResult::Failure(failure) => vec![ContentPart::Text {
            text: format!("error: {}", failure.error),
        }],
    }
}

/// Keeps a tool output within `budget` bytes of serialized JSON: a larger one becomes its text
/// cut on a UTF-8 boundary plus a marker saying how much was cut.
pub(super) fn truncate_output(output: serde_json::Value, budget: usize) -> serde_json::Value {
    let text = match &output {
        serde_json::Value::String(text) => text.clone(),
        other => other.to_string(),
    };
    if text.len() <= budget {
        return output;
    }
    serde_json::Value::String(truncate_text(&text, budget))
}

/// `text` within `budget` bytes plus a marker saying how much was cut (unchanged when it fits).
fn truncate_text(text: &str, budget: usize) -> String {
    if text.len() <= budget {
        return text.to_owned();
    }
    let mut cut = budget;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!(
        "{}\n[truncated: {} of {} bytes cut]",
        &text[..cut],
        text.len() - cut,
        text.len()
    )
}

/// Stores one tool message answering `call` and emits `tool_message_committed`.
pub(super) async fn commit_tool_message(
    emitter: &RunEmitter,
    record: &RunRecord,
    call: &ToolCall,
    content: Vec<ContentPart>,
) -> Result<Message, LogError> {
    let mut message = new_message(record, Role::Tool, content, Vec::new());
    message.tool_call_id = Some(call.id.clone());
    message.tool_name = Some(call.name.clone());
    let committed = RunChange {
        message: Some(message.clone()),
        ..RunChange::default()
    };
    emitter
        .emit_with(
            EventPayload::ToolMessageCommitted(MessageCommitted {
                message_id: message.id,
            }),
            committed,
        )
        .await?;
    Ok(message)
}

/// Answers calls that will not run, so the session's history stays valid.
pub(super) async fn skip_calls(
    emitter: &RunEmitter,
    record: &RunRecord,
    calls: &[ToolCall],
    reason: &str,
) -> Result<(), LogError> {
    for call in calls {
        let content = vec![ContentPart::Text {
            text: format!("error: {reason}"),
        }];
        commit_tool_message(emitter, record, call, content).await?;
    }
    Ok(())
}

/// The run's logged events of the given `types`, in order, with their data parsed.
pub(super) async fn logged_events(
    store: &dyn Store,
    run_id: crate::domain::RunId,
    types: &[&str],
) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
    let mut found = Vec::new();
    let mut after = 0;
    loop {
        let page = store.read_events(run_id, after, 500).await?;
        let Some(last) = page.last() else { break };
        after = last.sequence;
        for event in page
            .iter()
            .filter(|e| types.contains(&e.event_type.as_str()))
        {
            let data: serde_json::Value = serde_json::from_str(&event.data)
                .map_err(|e| StoreError::Corrupt(e.to_string()))?;
            found.push((event.event_type.clone(), data));
        }
    }
    Ok(found)
}

pub(super) fn text_field(data: &serde_json::Value, key: &str) -> String {
    data[key].as_str().unwrap_or_default().to_owned()
}

/// For a run whose task is gone (crash, orphan): reads its log and emits a
/// `tool_execution_finished` with a `Failure` (`reason`) for every `tool_execution_started`
/// that has none.
///
/// # Errors
/// The store's or the event log's.
pub(super) async fn finish_logged_executions(
    store: &dyn Store,
    emitter: &RunEmitter,
    run_id: crate::domain::RunId,
    reason: &str,
) -> Result<(), StoreError> {
    let mut open: Vec<(String, String)> = Vec::new();
    let types = ["tool_execution_started", "tool_execution_finished"];
    for (event_type, data) in logged_events(store, run_id, &types).await? {
        let call_id = text_field(&data, "call_id");
        if event_type == "tool_execution_started" {
            open.push((call_id, text_field(&data, "tool_name")));
        } else if let Some(position) = open.iter().position(|(id, _)| *id == call_id) {
            open.remove(position);
        }
    }
    for (call_id, tool_name) in open {
        emitter
            .emit(EventPayload::ToolExecutionFinished(ToolExecutionFinished {
                call_id,
                tool_name,
                result: ToolExecutionResult::Failure(ToolFailure {
                    error: reason.to_owned(),
                }),
                duration_ms: 0,
            }))
            .await
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
    }
    Ok(())
}

/// For a run whose model call was cut off (cancel, crash, shutdown): reads its log and emits a
/// `tool_call_completed` for every `tool_call_started` that has none, with the argument text
/// streamed so far as `invalid_arguments` (`arguments` `{}`), so that every started call is
/// completed. Such a call belongs to no committed message: it is never executed or replayed.
///
/// # Errors
/// The store's or the event log's.
pub(super) async fn complete_logged_calls(
    store: &dyn Store,
    emitter: &RunEmitter,
    run_id: crate::domain::RunId,
) -> Result<(), StoreError> {
    // (call id, tool name, argument text so far)
    let mut open: Vec<(String, String, String)> = Vec::new();
    let types = [
        "tool_call_started",
        "tool_call_delta",
        "tool_call_completed",
    ];
    for (event_type, data) in logged_events(store, run_id, &types).await? {
        let (call_id, call) = match event_type.as_str() {
            "tool_call_completed" => (text_field(&data["call"], "id"), None),
            _ => (text_field(&data, "call_id"), Some(&data)),
        };
        let position = open.iter().position(|(id, _, _)| *id == call_id);
        match (event_type.as_str(), position, call) {
            ("tool_call_started", _, Some(data)) => {
                open.push((call_id, text_field(data, "tool_name"), String::new()));
            }
            ("tool_call_delta", Some(at), Some(data)) => {
                open[at]
                    .2
                    .push_str(data["delta"].as_str().unwrap_or_default());
            }
            ("tool_call_completed", Some(at), _) => {
                open.remove(at);
            }
            _ => {}
        }
    }
    for (id, name, text) in open {
        let call = ToolCall {
            id,
            name,
            arguments: serde_json::json!({}),
            invalid_arguments: Some(text),
        };
        emitter
            .emit(EventPayload::ToolCallCompleted(
                crate::events::ToolCallCompleted { call },
            ))
            .await
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
    }
    Ok(())
}

/// After a run ended early (cancelled, failed, interrupted by a crash): answers every tool call
/// of the run that has no tool message yet, so the session's next run sends a valid history.
///
/// # Errors
/// The store's or the event log's.
pub(super) async fn answer_open_calls(
    store: &Arc<dyn Store>,
    emitter: &RunEmitter,
    record: &RunRecord,
    reason: &str,
) -> Result<(), StoreError> {
    let messages = store.session_messages(record.session_id).await?;
    // In order: a result answers the open call with its id (ids may repeat once a compaction
    // took the older call out of the requests).
    let mut open: Vec<ToolCall> = Vec::new();
    for message in messages.iter().filter(|m| m.run_id == record.id) {
        open.extend(message.tool_calls.iter().cloned());
        if let Some(id) = message.tool_call_id.as_deref()
            && let Some(position) = open.iter().position(|call| call.id == id)
        {
            open.remove(position);
        }
    }
    skip_calls(emitter, record, &open, reason)
        .await
        .map_err(|e| StoreError::Corrupt(e.to_string()))
}

/// A new message of the run.
pub(super) fn new_message(
    record: &RunRecord,
    role: Role,
    content: Vec<ContentPart>,
    tool_calls: Vec<ToolCall>,
) -> Message {
    Message {
        reasoning: Vec::new(),
        id: MessageId::new(),
        session_id: record.session_id,
        run_id: record.id,
        role,
        content,
        tool_calls,
        tool_call_id: None,
        tool_name: None,
        created_at: Utc::now(),
        status: crate::domain::MessageStatus::Completed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_failure_is_cut_like_an_output() {
        let error = "é".repeat(400_000);
        let cut = truncate_text(&error, 1000);
        assert!(cut.len() < 1100, "{}", cut.len());
        assert!(
            cut.ends_with("[truncated: 799000 of 800000 bytes cut]"),
            "{cut}"
        );
        assert_eq!(truncate_text("short", 1000), "short");
    }

    #[test]
    fn excerpts_cut_on_a_char_boundary() {
        assert_eq!(excerpt("abc", 10), "abc");
        assert_eq!(excerpt("ééé", 3), "é…");
    }
}
