//! The run loop: model → tool calls → results → model, until the model stops. A supervisor
//! owns the loop's task and writes exactly one terminal event whatever happens to it (error,
//! panic, cancellation, shutdown).

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::{DoomLoopDetector, LogError, RunEmitter, Runtime};
use crate::config::{ModelConfig, RuntimeConfig};
use crate::domain::{
    ContentPart, ErrorClass, FinishReason, Message, MessageId, Role, RunRecord, RunStatus,
    TokenUsage, ToolCall,
};
use crate::events::{
    CacheMetrics, ContextBuilt, DoomLoopDetected, EventPayload, MessageCommitted, ModelStarted,
    RunCancelled, RunCompleted, RunFailed, RunStarted, TextDelta, ToolCallCompleted, ToolCallDelta,
    ToolCallStarted, ToolExecutionFinished, ToolExecutionResult, ToolExecutionStarted, ToolFailure,
    ToolSuccess, UsageRecorded,
};
use crate::provider::{ModelEvent, ModelRequest, ProviderError};
use crate::store::{RunChange, RunOutcome, Store, StoreError};

/// Why the loop stopped early.
#[derive(Debug, thiserror::Error)]
enum RunFailure {
    #[error("{0}")]
    Provider(#[from] ProviderError),
    #[error(transparent)]
    Log(#[from] LogError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Limit(String),
    #[error("cancelled")]
    Cancelled,
}

/// How the loop ended well.
struct Completion {
    finish_reason: FinishReason,
    iterations: u32,
}

struct RunContext {
    runtime: Arc<Runtime>,
    record: RunRecord,
    model: ModelConfig,
    emitter: Arc<RunEmitter>,
    cancel: CancellationToken,
}

/// Runs the loop in its own task and writes the one terminal event.
pub(super) async fn supervise(
    runtime: &Arc<Runtime>,
    record: RunRecord,
    model: ModelConfig,
    emitter: Arc<RunEmitter>,
    cancel: CancellationToken,
) {
    let run_id = record.id;
    let record_for_cleanup = record.clone();
    let context = RunContext {
        runtime: runtime.clone(),
        record,
        model,
        emitter: emitter.clone(),
        cancel: cancel.clone(),
    };
    let mut body = tokio::spawn(execute(context));
    let ended = tokio::select! {
        biased;
        () = cancel.cancelled() => {
            body.abort();
            let _ = body.await;
            Err(RunFailure::Cancelled)
        }
        () = runtime.stop.cancelled() => {
            body.abort();
            let _ = body.await;
            Err(RunFailure::Limit("the server shut down while the run was active".to_owned()))
        }
        joined = &mut body => match joined {
            Ok(result) => result,
            Err(join_error) => {
                tracing::error!(%run_id, %join_error, "run task panicked");
                Err(RunFailure::Limit(format!("internal error: the run task failed ({join_error})")))
            }
        },
    };
    if ended.is_err() {
        let reason = match &ended {
            Err(RunFailure::Cancelled) => {
                "cancelled: the run was cancelled before this tool call finished"
            }
            _ => "not executed: the run ended before this tool call finished",
        };
        answer_open_calls(runtime.store(), &emitter, &record_for_cleanup, reason).await;
    }
    let (payload, outcome) = match ended {
        Ok(completion) => (
            EventPayload::RunCompleted(RunCompleted {
                finish_reason: completion.finish_reason,
                iterations: completion.iterations,
            }),
            RunOutcome {
                status: RunStatus::Completed,
                finish_reason: Some(completion.finish_reason),
                error: None,
            },
        ),
        Err(RunFailure::Cancelled) => (
            EventPayload::RunCancelled(RunCancelled {}),
            RunOutcome {
                status: RunStatus::Cancelled,
                finish_reason: None,
                error: None,
            },
        ),
        Err(failure) => {
            let error = failure.to_string();
            let error_class = match &failure {
                RunFailure::Provider(provider_error) => Some(provider_error.class),
                _ => None,
            };
            tracing::warn!(
                %run_id,
                %error,
                error_class = error_class.map(ErrorClass::as_str),
                "run failed"
            );
            (
                EventPayload::RunFailed(RunFailed {
                    error: error.clone(),
                    error_class,
                }),
                RunOutcome {
                    status: RunStatus::Failed,
                    finish_reason: None,
                    error: Some(error),
                },
            )
        }
    };
    finish(&emitter, payload, outcome).await;
}

/// Writes the terminal event, retrying while the store is unavailable; if it never succeeds,
/// startup recovery ends the run.
async fn finish(emitter: &RunEmitter, payload: EventPayload, outcome: RunOutcome) {
    let mut delay = Duration::from_millis(100);
    for attempt in 1..=6 {
        match emitter.finish(payload.clone(), outcome.clone()).await {
            Ok(_) | Err(LogError::Closed) => return,
            Err(error) => {
                tracing::error!(run_id = %emitter.run_id(), %error, attempt, "terminal event write failed");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
        }
    }
}

#[tracing::instrument(skip_all, fields(run_id = %context.record.id))]
async fn execute(context: RunContext) -> Result<Completion, RunFailure> {
    let RunContext {
        runtime,
        record,
        model,
        emitter,
        cancel,
    } = context;
    let store = runtime.store().clone();
    let entry = runtime
        .providers()
        .get(&record.provider)
        .cloned()
        .ok_or_else(|| {
            RunFailure::Limit(format!(
                "provider `{}` is no longer configured",
                record.provider
            ))
        })?;

    let mut history = store.session_messages(record.session_id).await?;
    // Logged with the first `model_started`, in one transaction.
    let mut preamble = vec![
        (
            EventPayload::RunStarted(RunStarted {
                session_id: record.session_id,
                provider: record.provider.clone(),
                model: record.model.clone(),
            }),
            status(RunStatus::SessionLoaded),
        ),
        (
            EventPayload::ContextBuilt(ContextBuilt {
                message_count: u32::try_from(history.len()).unwrap_or(u32::MAX),
            }),
            status(RunStatus::BuildingContext),
        ),
    ];

    let mut total_usage = TokenUsage::default();
    let config = runtime.config().clone();
    let max_iterations = record.max_iterations;
    let tools = runtime.tools().specs(record.tools.as_deref());
    let mut doom_loop = config
        .doom_loop
        .enabled
        .then(|| DoomLoopDetector::new(config.doom_loop.threshold));
    let mut tool_calls_made: u32 = 0;
    for iteration in 1..=max_iterations {
        if cancel.is_cancelled() {
            return Err(RunFailure::Cancelled);
        }
        let mut events = std::mem::take(&mut preamble);
        events.push((
            EventPayload::ModelStarted(ModelStarted {
                provider: record.provider.clone(),
                model: record.model.clone(),
                iteration,
            }),
            // The call counts as an iteration from its start, whether or not it completes.
            RunChange {
                status: Some(RunStatus::CallingModel),
                progress: Some((iteration, total_usage)),
                ..RunChange::default()
            },
        ));
        let request = ModelRequest {
            model: record.model.clone(),
            messages: history.clone(),
            tools: tools.clone(),
            tool_choice: record.tool_choice.clone(),
            max_output_tokens: Some(model.max_output_tokens),
        };
        // The request goes out while `model_started` is being committed: the provider's answer
        // is only read once the event is durable, so nothing of the call precedes it in the log.
        let (logged, stream) =
            tokio::join!(emitter.emit_all(events), entry.provider.stream(request));
        logged?;
        let turn = read_model_stream(&emitter, stream?).await?;

        total_usage += turn.usage;
        let progress = RunChange {
            progress: Some((iteration, total_usage)),
            ..RunChange::default()
        };
        emitter
            .emit_with(
                EventPayload::UsageRecorded(UsageRecorded { usage: turn.usage }),
                progress,
            )
            .await?;
        if let Some(cache) = turn.cache {
            emitter.emit(EventPayload::CacheMetrics(cache)).await?;
        }

        let content = if turn.text.is_empty() {
            Vec::new()
        } else {
            vec![ContentPart::Text { text: turn.text }]
        };
        let assistant = new_message(&record, Role::Assistant, content, turn.tool_calls.clone());
        let committed = RunChange {
            status: Some(RunStatus::Persisting),
            message: Some(assistant.clone()),
            ..RunChange::default()
        };
        emitter
            .emit_with(
                EventPayload::AssistantMessageCommitted(MessageCommitted {
                    message_id: assistant.id,
                }),
                committed,
            )
            .await?;
        history.push(assistant);

        if turn.tool_calls.is_empty() {
            return Ok(Completion {
                finish_reason: turn.finish_reason,
                iterations: iteration,
            });
        }
        let calls = turn.tool_calls;
        if let Some(description) = doom_loop.as_mut().and_then(|d| d.observe(&calls)) {
            emitter
                .emit(EventPayload::DoomLoopDetected(DoomLoopDetected {
                    description: description.clone(),
                }))
                .await?;
            skip_calls(
                &emitter,
                &record,
                &calls,
                "not executed: doom loop detected",
            )
            .await?;
            return Err(RunFailure::Limit(format!(
                "doom loop detected: {description}"
            )));
        }
        tool_calls_made =
            tool_calls_made.saturating_add(u32::try_from(calls.len()).unwrap_or(u32::MAX));
        if tool_calls_made > config.max_tool_calls {
            let reason = format!("the run reached max_tool_calls ({})", config.max_tool_calls);
            skip_calls(
                &emitter,
                &record,
                &calls,
                &format!("not executed: {reason}"),
            )
            .await?;
            return Err(RunFailure::Limit(reason));
        }
        let executions = futures::stream::iter(calls)
            .map(|call| execute_tool(&runtime, &emitter, &record, call, &config))
            .buffered(config.tool_concurrency.max(1));
        futures::pin_mut!(executions);
        // Results are committed in the model's call order, whatever order the tools end in.
        while let Some(execution) = executions.next().await {
            let (call, content) = execution?;
            let message = commit_tool_message(&emitter, &record, &call, content).await?;
            history.push(message);
        }
    }
    Err(RunFailure::Limit(format!(
        "the run reached max_iterations ({max_iterations}) without the model stopping"
    )))
}

/// One model call's result.
struct ModelTurn {
    text: String,
    tool_calls: Vec<ToolCall>,
    usage: TokenUsage,
    cache: Option<CacheMetrics>,
    finish_reason: FinishReason,
}

/// Emits what one model call streams and collects its result.
async fn read_model_stream(
    emitter: &RunEmitter,
    mut stream: crate::provider::ModelStream,
) -> Result<ModelTurn, RunFailure> {
    let mut turn = ModelTurn {
        text: String::new(),
        tool_calls: Vec::new(),
        usage: TokenUsage::default(),
        cache: None,
        finish_reason: FinishReason::Unknown,
    };
    let mut finished = false;
    while let Some(event) = stream.next().await {
        match event? {
            ModelEvent::TextDelta(delta) => {
                turn.text.push_str(&delta);
                emitter
                    .emit(EventPayload::TextDelta(TextDelta { delta }))
                    .await?;
            }
            ModelEvent::ToolCallStarted { call_id, tool_name } => {
                emitter
                    .emit(EventPayload::ToolCallStarted(ToolCallStarted {
                        call_id,
                        tool_name,
                    }))
                    .await?;
            }
            ModelEvent::ToolCallDelta { call_id, delta } => {
                emitter
                    .emit(EventPayload::ToolCallDelta(ToolCallDelta {
                        call_id,
                        delta,
                    }))
                    .await?;
            }
            ModelEvent::ToolCallCompleted(call) => {
                turn.tool_calls.push(call.clone());
                emitter
                    .emit(EventPayload::ToolCallCompleted(ToolCallCompleted { call }))
                    .await?;
            }
            ModelEvent::Usage { usage, cache } => {
                turn.usage = usage;
                turn.cache = cache;
            }
            ModelEvent::Finished(reason) => {
                turn.finish_reason = reason;
                finished = true;
            }
            // Not yet surfaced as events (issue #8 adds `reasoning_delta` and `model_retrying`).
            ModelEvent::Retrying { .. }
            | ModelEvent::ReasoningDelta(_)
            | ModelEvent::ReasoningCompleted(_) => {}
        }
    }
    if !finished {
        return Err(RunFailure::Limit(
            "the model stream ended without a finish reason".to_owned(),
        ));
    }
    Ok(turn)
}

/// Executes one tool call: `tool_execution_started`, the call (validated, with the timeout),
/// `tool_execution_finished`. Returns the content of its tool message.
async fn execute_tool(
    runtime: &Runtime,
    emitter: &RunEmitter,
    record: &RunRecord,
    call: ToolCall,
    config: &RuntimeConfig,
) -> Result<(ToolCall, Vec<ContentPart>), RunFailure> {
    emitter
        .emit_with(
            EventPayload::ToolExecutionStarted(ToolExecutionStarted {
                call_id: call.id.clone(),
                tool_name: call.name.clone(),
            }),
            status(RunStatus::WaitingForTools),
        )
        .await?;
    let started = Instant::now();
    let allowed = record
        .tools
        .as_ref()
        .is_none_or(|tools| tools.contains(&call.name));
    let outcome = if allowed {
        let timeout = Duration::from_millis(config.tool_timeout_ms);
        match tokio::time::timeout(timeout, runtime.tools().call(&call.name, &call.arguments)).await
        {
            Ok(result) => result.map_err(|e| e.to_string()),
            Err(_) => Err(format!(
                "`{}` timed out after {} ms",
                call.name, config.tool_timeout_ms
            )),
        }
    } else {
        Err(format!(
            "the tool `{}` is not available to this run",
            call.name
        ))
    };
    let duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    let result = match outcome {
        Ok(output) => ToolExecutionResult::Success(ToolSuccess {
            output: truncate_output(output, config.max_tool_output_bytes),
        }),
        Err(error) => ToolExecutionResult::Failure(ToolFailure { error }),
    };
    let content = tool_content(&result);
    emitter
        .emit(EventPayload::ToolExecutionFinished(ToolExecutionFinished {
            call_id: call.id.clone(),
            tool_name: call.name.clone(),
            result,
            duration_ms,
        }))
        .await?;
    Ok((call, content))
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
fn truncate_output(output: serde_json::Value, budget: usize) -> serde_json::Value {
    let text = match &output {
        serde_json::Value::String(text) => text.clone(),
        other => other.to_string(),
    };
    if text.len() <= budget {
        return output;
    }
    let mut cut = budget;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    serde_json::Value::String(format!(
        "{}\n[truncated: {} of {} bytes cut]",
        &text[..cut],
        text.len() - cut,
        text.len()
    ))
}

/// Stores one tool message answering `call` and emits `tool_message_committed`.
async fn commit_tool_message(
    emitter: &RunEmitter,
    record: &RunRecord,
    call: &ToolCall,
    content: Vec<ContentPart>,
) -> Result<Message, RunFailure> {
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
async fn skip_calls(
    emitter: &RunEmitter,
    record: &RunRecord,
    calls: &[ToolCall],
    reason: &str,
) -> Result<(), RunFailure> {
    for call in calls {
        let content = vec![ContentPart::Text {
            text: format!("error: {reason}"),
        }];
        commit_tool_message(emitter, record, call, content).await?;
    }
    Ok(())
}

/// After a run ended early (cancelled, failed): answers every tool call of the run that has no
/// tool message yet, so the session's next run sends a valid history.
async fn answer_open_calls(
    store: &Arc<dyn Store>,
    emitter: &RunEmitter,
    record: &RunRecord,
    reason: &str,
) {
    let answered = async {
        let messages = store.session_messages(record.session_id).await?;
        let answered: std::collections::HashSet<&str> = messages
            .iter()
            .filter_map(|m| m.tool_call_id.as_deref())
            .collect();
        let open: Vec<ToolCall> = messages
            .iter()
            .filter(|m| m.run_id == record.id)
            .flat_map(|m| m.tool_calls.iter())
            .filter(|call| !answered.contains(call.id.as_str()))
            .cloned()
            .collect();
        skip_calls(emitter, record, &open, reason).await
    };
    if let Err(error) = answered.await {
        tracing::error!(run_id = %record.id, %error, "could not answer open tool calls");
    }
}

/// A change that only moves the run to `status`.
fn status(status: RunStatus) -> RunChange {
    RunChange {
        status: Some(status),
        ..RunChange::default()
    }
}

fn new_message(
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
    }
}
