//! The run loop: model → tool calls → results → model, until the model stops. A supervisor
//! owns the loop's task and writes exactly one terminal event whatever happens to it (error,
//! panic, cancellation, shutdown).

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::{LogError, RunEmitter, Runtime};
use crate::config::ModelConfig;
use crate::domain::{
    ContentPart, ErrorClass, FinishReason, Message, MessageId, Role, RunRecord, RunStatus,
    TokenUsage, ToolCall,
};
use crate::events::{
    CacheMetrics, ContextBuilt, EventPayload, MessageCommitted, ModelStarted, RunCancelled,
    RunCompleted, RunFailed, RunStarted, TextDelta, ToolCallCompleted, ToolCallDelta,
    ToolCallStarted, ToolExecutionFinished, ToolExecutionResult, ToolExecutionStarted, ToolFailure,
    UsageRecorded,
};
use crate::provider::{ModelEvent, ModelRequest, ProviderError};
use crate::store::{RunOutcome, Store, StoreError};

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

    emitter
        .emit(EventPayload::RunStarted(RunStarted {
            session_id: record.session_id,
            provider: record.provider.clone(),
            model: record.model.clone(),
        }))
        .await?;
    let mut history = store.session_messages(record.session_id).await?;
    store
        .set_run_status(record.id, RunStatus::SessionLoaded)
        .await?;
    store
        .set_run_status(record.id, RunStatus::BuildingContext)
        .await?;
    emitter
        .emit(EventPayload::ContextBuilt(ContextBuilt {
            message_count: u32::try_from(history.len()).unwrap_or(u32::MAX),
        }))
        .await?;

    let mut total_usage = TokenUsage::default();
    let max_iterations = runtime.config().max_iterations;
    for iteration in 1..=max_iterations {
        if cancel.is_cancelled() {
            return Err(RunFailure::Cancelled);
        }
        store
            .set_run_status(record.id, RunStatus::CallingModel)
            .await?;
        emitter
            .emit(EventPayload::ModelStarted(ModelStarted {
                provider: record.provider.clone(),
                model: record.model.clone(),
                iteration,
            }))
            .await?;
        let request = ModelRequest {
            model: record.model.clone(),
            messages: history.clone(),
            tools: Vec::new(),
            tool_choice: record.tool_choice.clone(),
            max_output_tokens: Some(model.max_output_tokens),
        };
        let turn = call_model(&emitter, entry.provider.as_ref(), request).await?;

        total_usage += turn.usage;
        store
            .record_progress(record.id, iteration, total_usage)
            .await?;
        emitter
            .emit(EventPayload::UsageRecorded(UsageRecorded {
                usage: turn.usage,
            }))
            .await?;
        if let Some(cache) = turn.cache {
            emitter.emit(EventPayload::CacheMetrics(cache)).await?;
        }

        store
            .set_run_status(record.id, RunStatus::Persisting)
            .await?;
        let content = if turn.text.is_empty() {
            Vec::new()
        } else {
            vec![ContentPart::Text { text: turn.text }]
        };
        let assistant = new_message(&record, Role::Assistant, content, turn.tool_calls.clone());
        store.add_message(&assistant).await?;
        emitter
            .emit(EventPayload::AssistantMessageCommitted(MessageCommitted {
                message_id: assistant.id,
            }))
            .await?;
        history.push(assistant);

        if turn.tool_calls.is_empty() {
            return Ok(Completion {
                finish_reason: turn.finish_reason,
                iterations: iteration,
            });
        }
        store
            .set_run_status(record.id, RunStatus::WaitingForTools)
            .await?;
        for call in turn.tool_calls {
            let result = ToolExecutionResult::Failure(ToolFailure {
                error: format!("no tool named `{}` is available", call.name),
            });
            let message =
                commit_tool_result(store.as_ref(), &emitter, &record, &call, result, 0).await?;
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

async fn call_model(
    emitter: &RunEmitter,
    provider: &dyn crate::provider::Provider,
    request: ModelRequest,
) -> Result<ModelTurn, RunFailure> {
    let mut stream = provider.stream(request).await?;
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
        }
    }
    if !finished {
        return Err(RunFailure::Limit(
            "the model stream ended without a finish reason".to_owned(),
        ));
    }
    Ok(turn)
}

async fn commit_tool_result(
    store: &dyn Store,
    emitter: &RunEmitter,
    record: &RunRecord,
    call: &ToolCall,
    result: ToolExecutionResult,
    duration_ms: u64,
) -> Result<Message, RunFailure> {
    emitter
        .emit(EventPayload::ToolExecutionStarted(ToolExecutionStarted {
            call_id: call.id.clone(),
            tool_name: call.name.clone(),
        }))
        .await?;
    let content = match &result {
        ToolExecutionResult::Success(success) => vec![ContentPart::Json {
            value: success.output.clone(),
        }],
        ToolExecutionResult::Failure(failure) => vec![ContentPart::Text {
            text: format!("error: {}", failure.error),
        }],
    };
    emitter
        .emit(EventPayload::ToolExecutionFinished(ToolExecutionFinished {
            call_id: call.id.clone(),
            tool_name: call.name.clone(),
            result,
            duration_ms,
        }))
        .await?;
    let mut message = new_message(record, Role::Tool, content, Vec::new());
    message.tool_call_id = Some(call.id.clone());
    message.tool_name = Some(call.name.clone());
    store.add_message(&message).await?;
    emitter
        .emit(EventPayload::ToolMessageCommitted(MessageCommitted {
            message_id: message.id,
        }))
        .await?;
    Ok(message)
}

fn new_message(
    record: &RunRecord,
    role: Role,
    content: Vec<ContentPart>,
    tool_calls: Vec<ToolCall>,
) -> Message {
    Message {
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
