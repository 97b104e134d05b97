//! The run loop: model → tool calls → results → model, until the model stops. A supervisor
//! owns the loop's task and writes exactly one terminal event whatever happens to it (error,
//! panic, cancellation, shutdown).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::model_turn::{TurnError, read_model_stream};
use super::tokens::{Reply, TokenCounter};
use super::tool_exec::{self, InFlight, answer_open_calls, commit_tool_message, skip_calls};
use super::{DoomLoopDetector, LogError, RunEmitter, Runtime};
use crate::config::ModelConfig;
use crate::domain::{
    ContentPart, ErrorClass, FinishReason, Role, RunRecord, RunStatus, TokenUsage, ToolChoice,
    ToolChoiceMode,
};
use crate::events::{
    ContextBuilt, DoomLoopDetected, EventPayload, MessageCommitted, ModelStarted, RunCancelled,
    RunCompleted, RunFailed, RunStarted, UsageRecorded,
};
use crate::provider::{ModelRequest, ProviderError};
use crate::store::{RunChange, RunOutcome, StoreError};

/// Why the loop stopped early; each maps to the `error_class` of `run_failed`.
#[derive(Debug, thiserror::Error)]
enum RunFailure {
    #[error("{0}")]
    Provider(#[from] ProviderError),
    #[error(transparent)]
    Log(#[from] LogError),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// `max_iterations` or `max_tool_calls`.
    #[error("{0}")]
    Limit(String),
    #[error("doom loop detected: {0}")]
    DoomLoop(String),
    /// Shutdown.
    #[error("{0}")]
    Interrupted(String),
    /// A bug or a configuration change under a running run.
    #[error("{0}")]
    Internal(String),
    #[error("cancelled")]
    Cancelled,
}

impl RunFailure {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Provider(error) => error.class,
            Self::Limit(_) => ErrorClass::LimitExceeded,
            Self::DoomLoop(_) => ErrorClass::DoomLoop,
            Self::Interrupted(_) | Self::Cancelled => ErrorClass::Interrupted,
            Self::Log(_) | Self::Store(_) | Self::Internal(_) => ErrorClass::Internal,
        }
    }
}

impl RunFailure {
    fn from_turn(error: TurnError, provider: &str) -> Self {
        match error {
            TurnError::Provider(error) => Self::Provider(error),
            TurnError::Log(error) => Self::Log(error),
            TurnError::NoFinish => Self::Provider(ProviderError::new(
                provider,
                ErrorClass::Transport,
                error.to_string(),
            )),
        }
    }
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
    in_flight: InFlight,
}

/// Runs the loop in its own task and writes the one terminal event. A run that ends early
/// first finishes its open tool executions and answers its open tool calls.
pub(super) async fn supervise(
    runtime: &Arc<Runtime>,
    record: RunRecord,
    model: ModelConfig,
    emitter: Arc<RunEmitter>,
    cancel: CancellationToken,
) {
    let run_id = record.id;
    let record_for_cleanup = record.clone();
    let in_flight = InFlight::default();
    let context = RunContext {
        runtime: runtime.clone(),
        record,
        model,
        emitter: emitter.clone(),
        cancel: cancel.clone(),
        in_flight: in_flight.clone(),
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
            Err(RunFailure::Interrupted("the server shut down while the run was active".to_owned()))
        }
        joined = &mut body => match joined {
            Ok(result) => result,
            Err(join_error) => {
                tracing::error!(%run_id, %join_error, "run task panicked");
                Err(RunFailure::Internal(format!("internal error: the run task failed ({join_error})")))
            }
        },
    };
    if ended.is_err() {
        let reason = match &ended {
            Err(RunFailure::Cancelled) => tool_exec::CANCELLED,
            Err(RunFailure::Interrupted(_)) => tool_exec::INTERRUPTED,
            _ => "not executed: the run ended before this tool call finished",
        };
        // Every started call is completed, even one cut off mid-stream.
        if let Err(error) =
            tool_exec::complete_logged_calls(runtime.store().as_ref(), &emitter, run_id).await
        {
            tracing::error!(%run_id, %error, "could not complete open tool calls");
        }
        // Each open execution's `tool_execution_finished` precedes its tool message.
        if let Err(error) = in_flight.finish_all(&emitter, reason).await {
            tracing::error!(%run_id, %error, "could not finish open tool executions");
        }
        if let Err(error) =
            answer_open_calls(runtime.store(), &emitter, &record_for_cleanup, reason).await
        {
            tracing::error!(%run_id, %error, "could not answer open tool calls");
        }
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
                finish_reason: Some(FinishReason::Unknown),
                error: None,
            },
        ),
        Err(failure) => {
            let error = failure.to_string();
            let error_class = failure.class();
            tracing::warn!(%run_id, %error, error_class = error_class.as_str(), "run failed");
            (
                EventPayload::RunFailed(RunFailed {
                    error: error.clone(),
                    error_class: Some(error_class),
                }),
                RunOutcome {
                    status: RunStatus::Failed,
                    finish_reason: Some(FinishReason::Error),
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

/// The tool choice of the run's `iteration`th model call: a forcing choice (`required`, a named
/// tool) applies to the first call only, later calls use `auto`, so a forced run can end with
/// an answer.
fn tool_choice_for(choice: &ToolChoice, iteration: u32) -> ToolChoice {
    match choice {
        ToolChoice::Mode(ToolChoiceMode::Required) | ToolChoice::Tool { .. } if iteration > 1 => {
            ToolChoice::Mode(ToolChoiceMode::Auto)
        }
        other => other.clone(),
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
        in_flight,
    } = context;
    let store = runtime.store().clone();
    let entry = runtime
        .providers()
        .get(&record.provider)
        .cloned()
        .ok_or_else(|| {
            RunFailure::Internal(format!(
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
    let mut counter = TokenCounter::new();
    let config = runtime.config().clone();
    let max_iterations = record.max_iterations;
    let tools = runtime.tools().specs(record.tools.as_deref());
    let mut doom_loop = config.doom_loop.enabled.then(|| {
        DoomLoopDetector::new(config.doom_loop.threshold).allowing(&config.doom_loop.allow)
    });
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
            tool_choice: tool_choice_for(&record.tool_choice, iteration),
            max_output_tokens: Some(model.max_output_tokens),
        };
        // The request goes out while `model_started` is being committed: the provider's answer
        // is only read once the event is durable, so nothing of the call precedes it in the log.
        let (logged, stream) =
            tokio::join!(emitter.emit_all(events), entry.provider.stream(request));
        logged?;
        let turn = read_model_stream(&emitter, stream?)
            .await
            .map_err(|e| RunFailure::from_turn(e, &record.provider))?;

        // A call without reported usage is estimated with the tokenizer, and marked so.
        let usage = turn.usage.unwrap_or_else(|| {
            let reply = Reply {
                text: &turn.text,
                reasoning: &turn.reasoning_text,
                tool_calls: &turn.tool_calls,
            };
            counter.estimate(&history, &tools, &reply)
        });
        total_usage += usage;
        let progress = RunChange {
            progress: Some((iteration, total_usage)),
            ..RunChange::default()
        };
        emitter
            .emit_with(
                EventPayload::UsageRecorded(UsageRecorded { usage }),
                progress,
            )
            .await?;
        if let Some(cache) = turn.cache.clone() {
            emitter.emit(EventPayload::CacheMetrics(cache)).await?;
        }

        // No text and no tool call: nothing is stored (an empty assistant message would make
        // the session's next request invalid); the run completes with the model's reason.
        if turn.is_empty() {
            return Ok(Completion {
                finish_reason: turn.finish_reason,
                iterations: iteration,
            });
        }
        let content = if turn.text.is_empty() {
            Vec::new()
        } else {
            vec![ContentPart::Text { text: turn.text }]
        };
        let mut assistant =
            tool_exec::new_message(&record, Role::Assistant, content, turn.tool_calls.clone());
        assistant.reasoning = turn.reasoning;
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
            return Err(RunFailure::DoomLoop(description));
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
            .map(|call| {
                tool_exec::execute_tool(&runtime, &emitter, &in_flight, &record, call, &config)
            })
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

/// A change that only moves the run to `status`.
fn status(status: RunStatus) -> RunChange {
    RunChange {
        status: Some(status),
        ..RunChange::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forced_tool_choice_applies_to_the_first_call_only() {
        let named = ToolChoice::Tool {
            name: "add".to_owned(),
        };
        let required = ToolChoice::Mode(ToolChoiceMode::Required);
        let none = ToolChoice::Mode(ToolChoiceMode::None);
        assert_eq!(tool_choice_for(&named, 1), named);
        assert_eq!(tool_choice_for(&required, 1), required);
        for later in [2, 3, 25] {
            assert_eq!(tool_choice_for(&named, later), ToolChoice::default());
            assert_eq!(tool_choice_for(&required, later), ToolChoice::default());
            assert_eq!(tool_choice_for(&none, later), none);
        }
    }
}
