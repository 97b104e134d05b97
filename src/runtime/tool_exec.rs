//! Executing the model's tool calls and committing their results: every
//! `tool_execution_started` gets exactly one `tool_execution_finished` (also when the run is
//! cancelled, shut down or interrupted mid-call), and every tool call of the session gets
//! exactly one tool message, so the session's next request is one providers accept.

use std::time::{Duration, Instant};

use chrono::Utc;

use super::trail::RunTrail;
use super::{RunEmitter, Runtime};
use crate::config::RuntimeConfig;
use crate::domain::{ContentPart, Message, MessageId, Role, RunRecord, RunStatus, ToolCall};
use crate::events::{
    EventPayload, ToolExecutionFinished, ToolExecutionResult, ToolExecutionStarted, ToolFailure,
    ToolMessageCommitted, ToolSuccess,
};
use crate::store::RunChange;
use crate::telemetry;
use crate::tools::{ProgressSink, ToolError};

use super::event_log::LogError;
use super::tool_progress::with_progress;

/// The result text of a call that was left open when the server stopped (crash or shutdown).
pub(super) const INTERRUPTED: &str =
    "interrupted: the server stopped before this tool call finished; its outcome is unknown";
/// The result text of a call that was open when the run was cancelled.
pub(super) const CANCELLED: &str =
    "cancelled: the run was cancelled before this tool call finished";
/// The result text of a call whose `requires_action` wait expired.
pub(super) const EXPIRED: &str =
    "expired: the run's wait for this call's answer passed its deadline";
/// The result text of a call left open by a run that failed.
pub(super) const NOT_EXECUTED: &str = "not executed: the run ended before this tool call finished";

/// Bytes of invalid argument text quoted back to the model.
const ARGUMENT_EXCERPT_BYTES: usize = 200;

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
        .scope(run_tool(runtime, emitter, record, call, config, execution))
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
    // Once durable, the start is in the run's trail: a run that ends before the execution
    // finishes finishes it there.
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
        let key = crate::tools::idempotency_key(record.id, &call.id);
        let (sink, updates) = ProgressSink::channel();
        let execution =
            runtime
                .tools()
                .call_reporting(&call.name, &call.arguments, Some(&key), Some(&sink));
        let interval = Duration::from_millis(config.tool_progress_interval_ms);
        let execution = tokio::time::timeout(timeout, execution);
        match with_progress(emitter, &call.id, interval, updates, execution).await? {
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
            EventPayload::ToolMessageCommitted(ToolMessageCommitted {
                message_id: message.id,
                call_id: Some(call.id.clone()),
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
    let content = tool_content(&ToolExecutionResult::Failure(ToolFailure {
        error: reason.to_owned(),
    }));
    for call in calls {
        commit_tool_message(emitter, record, call, content.clone()).await?;
    }
    Ok(())
}

/// For a run that ends: emits a `tool_execution_finished` with a `Failure` (`reason`) for
/// every execution its trail shows started and not finished. Its duration is the time since
/// its start when this emitter started it, 0 when an earlier process did (unknown).
///
/// # Errors
/// The event log's.
pub(super) async fn finish_open_executions(
    emitter: &RunEmitter,
    trail: &RunTrail,
    reason: &str,
) -> Result<(), LogError> {
    for execution in trail.open_executions() {
        let duration_ms = match execution.started {
            Some((sequence, at)) if sequence >= emitter.first_sequence() => {
                u64::try_from((Utc::now() - at).num_milliseconds()).unwrap_or(0)
            }
            _ => 0,
        };
        emitter
            .emit(EventPayload::ToolExecutionFinished(ToolExecutionFinished {
                call_id: execution.call_id.clone(),
                tool_name: execution.tool_name.clone(),
                result: ToolExecutionResult::Failure(ToolFailure {
                    error: reason.to_owned(),
                }),
                duration_ms,
            }))
            .await?;
    }
    Ok(())
}

/// After a run ended early (cancelled, failed, interrupted by a crash): answers every tool call
/// of the run that has no tool message in `messages` (its session's), so the session's next
/// run sends a valid history. A call whose result the log holds (`tool_execution_finished` in
/// `trail`'s last turn: the run was stopped between logging a result and committing it) is
/// answered with that result, so the session says what the log says; the others with
/// `reason`, logged first as the call's `tool_execution_finished` (a `Failure`) when the call is
/// one of the last turn's (a call that waited for the client: a reader of the log sees how it
/// ended).
///
/// # Errors
/// The event log's.
pub(super) async fn answer_open_calls(
    emitter: &RunEmitter,
    record: &RunRecord,
    trail: &RunTrail,
    messages: &[Message],
    reason: &str,
) -> Result<(), LogError> {
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
    let logged = |call: &ToolCall| {
        trail.turn().and_then(|turn| {
            turn.executions
                .iter()
                .find(|execution| execution.call_id == call.id)
                .and_then(|execution| execution.result.as_ref())
        })
    };
    let mut finished: Vec<&str> = Vec::new();
    for call in &open {
        let content = match logged(call) {
            Some(result) => tool_content(result),
            None => {
                let result = ToolExecutionResult::Failure(ToolFailure {
                    error: reason.to_owned(),
                });
                if trail.awaits_result(&call.id) && !finished.contains(&call.id.as_str()) {
                    finished.push(&call.id);
                    emitter
                        .emit(EventPayload::ToolExecutionFinished(ToolExecutionFinished {
                            call_id: call.id.clone(),
                            tool_name: call.name.clone(),
                            result: result.clone(),
                            duration_ms: 0,
                        }))
                        .await?;
                }
                tool_content(&result)
            }
        };
        commit_tool_message(emitter, record, call, content).await?;
    }
    Ok(())
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
