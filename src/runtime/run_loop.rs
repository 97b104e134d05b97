//! The run loop: model → tool calls → results → model, until the model stops. A supervisor
//! owns the loop's task and ends the run exactly once whatever happens to it (error, panic,
//! cancellation), through the close-out of `end.rs`; a shutdown or a takeover by another
//! process stops it without an end (it stays resumable).

use std::sync::Arc;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::agents::{self, Decision, RunAgent, WaitError};
use super::compaction::{self, Conversation, Window};
use super::model_turn::{self, ModelCall, ModelTurn, TurnError};
use super::resume::{self, Next, PendingCalls};
use super::structured::{OutputCheck, Verdict};
use super::tokens::Reply;
use super::tool_exec::{self, Execution, commit_tool_message, skip_calls};
use super::{DoomLoopDetector, LogError, ProviderEntry, RunEmitter, Runtime, end};
use crate::config::{ActionExpiry, ModelConfig};
use crate::domain::{
    ContentPart, ErrorClass, FinishReason, MessageId, Role, RunEnd, RunRecord, RunStatus,
    TokenUsage, ToolCall, ToolChoice, ToolChoiceMode,
};
use crate::events::{
    ContextBuilt, DoomLoopDetected, EventPayload, MessageCommitted, ModelRetrying, ModelStarted,
    OutputRejected, RunResumed, RunStarted, UsageRecorded,
};
use crate::provider::{ProviderError, ToolSpec};
use crate::store::{RunChange, SnapshotWrite, StoreError};

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
    /// Shutdown: the run stopped at a boundary (or where it was, after the grace) and stays
    /// resumable; nothing terminal is written.
    #[error("suspended for a shutdown")]
    Suspended,
    /// A bug or a configuration change under a running run.
    #[error("{0}")]
    Internal(String),
    #[error("cancelled")]
    Cancelled,
    /// The `requires_action` wait passed its deadline.
    #[error("{0}")]
    Expired(String),
    /// The final answer did not match the run's `output_schema`, corrective turns included.
    #[error("{0}")]
    OutputInvalid(String),
}

impl From<WaitError> for RunFailure {
    fn from(error: WaitError) -> Self {
        match error {
            WaitError::Log(error) => Self::Log(error),
            WaitError::Store(error) => Self::Store(error),
            WaitError::Suspended => Self::Suspended,
            WaitError::Expired(message) => Self::Expired(message),
        }
    }
}

impl RunFailure {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Provider(error) => error.class,
            Self::Limit(_) => ErrorClass::LimitExceeded,
            Self::DoomLoop(_) => ErrorClass::DoomLoop,
            Self::Suspended | Self::Cancelled => ErrorClass::Interrupted,
            Self::Log(_) | Self::Store(_) | Self::Internal(_) => ErrorClass::Internal,
            Self::Expired(_) => ErrorClass::ActionExpired,
            Self::OutputInvalid(_) => ErrorClass::OutputInvalid,
        }
    }
}

impl From<compaction::Stop> for RunFailure {
    fn from(stop: compaction::Stop) -> Self {
        match stop {
            compaction::Stop::TooLong(message) => Self::Provider(ProviderError::new(
                "compaction",
                ErrorClass::ContextLengthExceeded,
                message,
            )),
            compaction::Stop::Log(error) => Self::Log(error),
            compaction::Stop::Store(error) => Self::Store(error),
        }
    }
}

impl RunFailure {
    fn from_turn(error: TurnError, provider: &str) -> Self {
        match error {
            TurnError::Rejected(error) | TurnError::Provider(error) => Self::Provider(error),
            TurnError::Log(error) => Self::Log(error),
            TurnError::NoFinish => Self::Provider(ProviderError::new(
                provider,
                ErrorClass::Transport,
                error.to_string(),
            )),
        }
    }
}

/// How the loop ended well (the iterations are the trail's).
struct Completion {
    finish_reason: FinishReason,
    /// The final answer parsed, for a run with an `output_schema`.
    parsed: Option<serde_json::Value>,
}

struct RunContext {
    runtime: Arc<Runtime>,
    record: RunRecord,
    model: ModelConfig,
    emitter: Arc<RunEmitter>,
    cancel: CancellationToken,
    agent: RunAgent,
    answered: Arc<tokio::sync::Notify>,
    /// The model call being made, for the run's end if it cuts the call off.
    in_flight: model_turn::InFlight,
}

/// What stops a run's task from outside, and what wakes it.
#[derive(Debug, Clone)]
pub(super) struct Tokens {
    /// A client's cancel: the run ends with `run_cancelled`.
    pub cancel: CancellationToken,
    /// Another process took the run over: the task stops, writing nothing.
    pub abandon: CancellationToken,
    /// Answers to the calls the run waits for were stored (`requires_action`).
    pub answered: Arc<tokio::sync::Notify>,
}

/// Runs the loop in its own task (from the start, or `resumed` after the last logged event)
/// and ends the run once through the close-out (`end.rs`), which finishes what the loop left
/// open. A run suspended by a shutdown, or taken over by another process, writes nothing more
/// here: it is resumed by the next owner.
pub(super) async fn supervise(
    runtime: &Arc<Runtime>,
    record: RunRecord,
    model: ModelConfig,
    emitter: Arc<RunEmitter>,
    tokens: Tokens,
    resumed: bool,
) {
    let run_id = record.id;
    let cancel = tokens.cancel;
    let in_flight = model_turn::InFlight::default();
    let context = RunContext {
        runtime: runtime.clone(),
        agent: RunAgent::of(runtime, &record),
        record: record.clone(),
        model,
        emitter: emitter.clone(),
        cancel: cancel.clone(),
        answered: tokens.answered,
        in_flight: in_flight.clone(),
    };
    let mut body = tokio::spawn(execute(context, resumed));
    let ended = tokio::select! {
        biased;
        () = cancel.cancelled() => {
            body.abort();
            let _ = body.await;
            Err(RunFailure::Cancelled)
        }
        () = tokens.abandon.cancelled() => {
            body.abort();
            let _ = body.await;
            Err(RunFailure::Log(LogError::Fenced))
        }
        () = runtime.stop.cancelled() => {
            body.abort();
            let _ = body.await;
            Err(RunFailure::Suspended)
        }
        joined = &mut body => match joined {
            Ok(result) => result,
            Err(join_error) => {
                tracing::error!(%run_id, %join_error, "run task panicked");
                Err(RunFailure::Internal(format!("internal error: the run task failed ({join_error})")))
            }
        },
    };
    let expiry = runtime.config().action_expiry;
    let (end, reason) = match ended {
        Err(RunFailure::Suspended) => {
            tracing::info!(%run_id, "run suspended for the shutdown; the next start resumes it");
            model_turn::count_interrupted(&in_flight);
            runtime.log.feed().close(run_id);
            return;
        }
        Err(RunFailure::Log(LogError::Fenced)) => {
            tracing::warn!(%run_id, "another process owns the run now; stopped here");
            model_turn::count_interrupted(&in_flight);
            runtime.log.feed().close(run_id);
            return;
        }
        Ok(completion) => (
            RunEnd::Completed {
                finish_reason: completion.finish_reason,
                parsed: completion.parsed,
            },
            tool_exec::NOT_EXECUTED,
        ),
        Err(RunFailure::Cancelled) => (RunEnd::Cancelled, tool_exec::CANCELLED),
        Err(RunFailure::Expired(_)) if expiry == ActionExpiry::Cancel => {
            (RunEnd::Cancelled, tool_exec::EXPIRED)
        }
        Err(failure) => {
            let end = RunEnd::failed(failure.class(), failure.to_string());
            let error_class = failure.class().as_str();
            tracing::warn!(%run_id, error = %failure, error_class, "run failed");
            let reason = end::open_call_reason(&end);
            (end, reason)
        }
    };
    let in_flight = in_flight
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    end::close_out_retrying(
        runtime.store(),
        &emitter,
        &record,
        end,
        reason,
        in_flight.as_ref(),
    )
    .await;
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

/// The loop's state that outlives one iteration.
struct Progress {
    /// What the model calls are made with (from the session's latest compaction on).
    context: Conversation,
    total_usage: TokenUsage,
    tool_calls_made: u32,
    doom_loop: Option<DoomLoopDetector>,
    tools: Vec<ToolSpec>,
    /// The run's `output_schema` and its corrective turns.
    output: Option<OutputCheck>,
}

#[tracing::instrument(skip_all, fields(run_id = %context.record.id))]
async fn execute(context: RunContext, resumed: bool) -> Result<Completion, RunFailure> {
    let runtime = context.runtime.clone();
    let record = &context.record;
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
    let config = runtime.config().clone();
    let loaded = runtime
        .contexts
        .load(store.as_ref(), record.session_id)
        .await?;
    let loaded_len = loaded.context.messages.len();
    let doom_loop = record.doom_loop.as_ref().unwrap_or(&config.doom_loop);
    let mut progress = Progress {
        context: Conversation::new(loaded.context, &record.model)
            .with_counter(loaded.counter)
            .with_instructions(record.instructions.as_deref()),
        total_usage: TokenUsage::default(),
        tool_calls_made: 0,
        doom_loop: doom_loop
            .enabled
            .then(|| DoomLoopDetector::new(doom_loop.threshold).allowing(&doom_loop.allow)),
        tools: agents::tool_specs(&runtime, record),
        output: OutputCheck::of(
            record,
            config.output_corrections,
            context.emitter.trail().output_rejections(),
        ),
    };
    let result = iterate(&context, &entry, &mut progress, resumed).await;
    if let Some((messages, counter)) = progress.context.into_loaded(loaded_len) {
        runtime
            .contexts
            .give_back(record.session_id, messages, counter);
    }
    result
}

/// The run's model calls and tool calls, from its first iteration (or where a resumed run goes
/// on) to its end.
async fn iterate(
    context: &RunContext,
    entry: &ProviderEntry,
    progress: &mut Progress,
    resumed: bool,
) -> Result<Completion, RunFailure> {
    let runtime = &context.runtime;
    let record = &context.record;
    let mut preamble = Vec::new();
    let first_iteration = if resumed {
        match resume(context, progress).await? {
            Resumed::At(iteration) => iteration,
            Resumed::Done(completion) => return Ok(completion),
        }
    } else {
        // Logged with the first `model_started`, in one transaction.
        preamble = vec![
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
                    message_count: u32::try_from(progress.context.request_len())
                        .unwrap_or(u32::MAX),
                }),
                status(RunStatus::BuildingContext),
            ),
        ];
        1
    };
    let RunContext {
        model,
        emitter,
        cancel,
        ..
    } = &context;
    let max_iterations = record.max_iterations;
    for iteration in first_iteration..=max_iterations {
        if cancel.is_cancelled() {
            return Err(RunFailure::Cancelled);
        }
        // A shutdown stops the run here, at the boundary, resumable.
        if runtime.draining.is_cancelled() {
            return Err(RunFailure::Suspended);
        }
        // The request is compacted (pruned, summarised) first when it would not fit; any event
        // that writes comes after the run's opening events.
        let call = compaction::Call {
            runtime,
            session_id: record.session_id,
            run_id: record.id,
            provider: &record.provider,
            model: &record.model,
            window: Window::of(*model, agents::max_output_tokens(record, model)),
            emitter,
            tools: &progress.tools,
            iterations: iteration - 1,
            in_flight: &context.in_flight,
        };
        call.before(
            &mut progress.context,
            &mut progress.total_usage,
            &mut preamble,
        )
        .await?;
        let mut events = std::mem::take(&mut preamble);
        // The id the call's assistant message is stored with, announced up front so a
        // frontend knows it from the call's first event.
        let message_id = MessageId::new();
        events.push((
            EventPayload::ModelStarted(ModelStarted {
                provider: record.provider.clone(),
                model: record.model.clone(),
                iteration,
                message_id: Some(message_id),
            }),
            // The call counts as an iteration from its start, whether or not it completes; the
            // boundary's snapshot is written with it.
            RunChange {
                status: Some(RunStatus::CallingModel),
                progress: Some((iteration, progress.total_usage)),
                snapshot: Some(SnapshotWrite {
                    session_id: record.session_id,
                    iteration,
                    total_usage: progress.total_usage,
                    tool_calls: progress.tool_calls_made,
                }),
                ..RunChange::default()
            },
        ));
        let (turn, call) = call_model(context, progress, entry, iteration, events).await?;

        // A call without reported usage is estimated with the tokenizer, and marked so; a
        // reported one calibrates the session's estimates.
        let calibration = turn
            .usage
            .and_then(|usage| progress.context.calibrate(usage.input_tokens));
        let usage = turn.usage.unwrap_or_else(|| {
            progress.context.usage(&Reply {
                text: &turn.text,
                reasoning: &turn.reasoning_text,
                tool_calls: &turn.tool_calls,
            })
        });
        call.finish(&turn, &usage);
        progress.total_usage += usage;
        let recorded = RunChange {
            progress: Some((iteration, progress.total_usage)),
            calibration: calibration.map(|c| (record.session_id, c)),
            ..RunChange::default()
        };
        emitter
            .emit_with(
                EventPayload::UsageRecorded(UsageRecorded { usage }),
                recorded,
            )
            .await?;
        if let Some(cache) = turn.cache.clone() {
            emitter.emit(EventPayload::CacheMetrics(cache)).await?;
        }

        // No text and no tool call: nothing is stored (an empty assistant message would make
        // the session's next request invalid); the run completes with the model's reason.
        if turn.is_empty() {
            match settle_answer(context, progress, "", turn.finish_reason).await? {
                Some(completion) => return Ok(completion),
                None => continue,
            }
        }
        // The answer a run with an `output_schema` is checked by.
        let answer = if progress.output.is_some() {
            turn.text.clone()
        } else {
            String::new()
        };
        let content = if turn.text.is_empty() {
            Vec::new()
        } else {
            vec![ContentPart::Text { text: turn.text }]
        };
        let mut assistant =
            tool_exec::new_message(record, Role::Assistant, content, turn.tool_calls.clone());
        assistant.id = message_id;
        assistant.reasoning = turn.reasoning;
        let committed = RunChange {
            status: Some(RunStatus::Persisting),
            message: Some(assistant.clone()),
            // Kept with the last turn, so a run resumed before its terminal event knows it.
            finish_reason: turn.tool_calls.is_empty().then_some(turn.finish_reason),
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
        progress.context.push(assistant);

        if turn.tool_calls.is_empty() {
            match settle_answer(context, progress, &answer, turn.finish_reason).await? {
                Some(completion) => return Ok(completion),
                None => continue,
            }
        }
        run_tools(context, progress, message_id, &turn.tool_calls, None).await?;
    }
    Err(RunFailure::Limit(format!(
        "the run reached max_iterations ({max_iterations}) without the model stopping"
    )))
}

/// The iteration's model call: the request goes out while `events` (its `model_started`) are
/// being committed — the provider's answer is only read once they are durable, so nothing of
/// the call precedes them in the log. A call the provider rejects as too long before any output
/// (`context_length_exceeded`) is made once more after a compaction (`model_retrying`, then
/// `context_compacted`); rejected again, the run fails.
async fn call_model(
    context: &RunContext,
    progress: &mut Progress,
    entry: &ProviderEntry,
    iteration: u32,
    events: Vec<(EventPayload, RunChange)>,
) -> Result<(ModelTurn, ModelCall), RunFailure> {
    let RunContext {
        runtime,
        record,
        model,
        emitter,
        ..
    } = context;
    let mut events = Some(events);
    let mut compacted = false;
    loop {
        let request = agents::model_request(
            record,
            model,
            progress.context.request_messages(),
            progress.tools.clone(),
            tool_choice_for(&record.tool_choice, iteration),
            entry.config.structured_output,
        );
        let announce = events.take().unwrap_or_default();
        let estimate = progress.context.usage(&Reply {
            text: "",
            reasoning: "",
            tool_calls: &[],
        });
        model_turn::set_in_flight(
            &context.in_flight,
            Some(model_turn::CallInFlight {
                provider: record.provider.clone(),
                model: record.model.clone(),
                input_tokens: estimate.input_tokens,
                started: std::time::Instant::now(),
                summariser: false,
            }),
        );
        let turn = model_turn::call_model(
            emitter,
            entry,
            &record.provider,
            request,
            announce,
            iteration,
        )
        .await;
        // A call that streamed to its end records its own usage; one the provider rejected
        // before any output costs nothing. Any other failure leaves it for the run's end.
        if matches!(turn, Ok(_) | Err(TurnError::Rejected(_))) {
            model_turn::set_in_flight(&context.in_flight, None);
        }
        let error = match turn {
            Err(TurnError::Rejected(error)) if error.class == ErrorClass::ContextLengthExceeded => {
                error
            }
            other => return other.map_err(|e| RunFailure::from_turn(e, &record.provider)),
        };
        if compacted {
            return Err(RunFailure::Provider(ProviderError {
                message: format!("still too long after a compaction: {}", error.message),
                ..error
            }));
        }
        compacted = true;
        emitter
            .emit(EventPayload::ModelRetrying(ModelRetrying {
                attempt: 1,
                error_class: error.class,
                delay_ms: 0,
                error: error.message.clone(),
            }))
            .await?;
        let call = compaction::Call {
            runtime,
            session_id: record.session_id,
            run_id: record.id,
            provider: &record.provider,
            model: &record.model,
            window: Window::of(*model, agents::max_output_tokens(record, model)),
            emitter,
            tools: &progress.tools,
            iterations: iteration,
            in_flight: &context.in_flight,
        };
        call.after_overflow(&mut progress.context, &mut progress.total_usage, &error)
            .await?;
        progress.context.measure(&progress.tools);
    }
}

/// Where a resumed run goes on.
enum Resumed {
    /// With this iteration's model call.
    At(u32),
    /// Its last turn was the answer: it completes.
    Done(Completion),
}

/// Resumes a run taken over from a stopped process: announces `run_resumed`, restores the
/// usage, tool-call count and doom-loop detector from its committed turns, finishes the tool
/// calls of its last turn, and says which iteration comes next.
async fn resume(context: &RunContext, progress: &mut Progress) -> Result<Resumed, RunFailure> {
    let record = &context.record;
    let store = context.runtime.store().clone();
    // The trail the run was taken over with: its log, read once.
    let trail = context.emitter.trail();
    let assistant_messages = store.run_messages(record.id, Role::Assistant).await?;
    let plan = resume::plan(
        &trail,
        record,
        assistant_messages,
        progress.context.messages(),
    );
    let next_iteration = match &plan.next {
        Next::ModelCall(iteration) => *iteration,
        Next::Tools(_) => plan.iteration.saturating_add(1),
        Next::Complete(_) => plan.iteration,
    };
    if plan.abandoned_after.is_some() {
        // Calls the cut-off stream had begun are completed (as invalid: their argument text so
        // far), so every `tool_call_started` has its `tool_call_completed`; they belong to the
        // abandoned call, before `run_resumed`, and are never executed.
        model_turn::complete_open_calls(&context.emitter, &trail).await?;
    }
    context
        .emitter
        .emit(EventPayload::RunResumed(RunResumed {
            iteration: next_iteration,
            abandoned_after: plan.abandoned_after,
        }))
        .await?;
    progress.total_usage = record.total_usage;
    // The turns before the one still open replay through the detector and the count.
    let replayed = match plan.next {
        Next::Tools(_) => plan.assistant_messages.len().saturating_sub(1),
        _ => plan.assistant_messages.len(),
    };
    for turn in &plan.assistant_messages[..replayed] {
        if let Some(detector) = progress.doom_loop.as_mut() {
            let _ = detector.observe(&turn.tool_calls);
        }
        progress.tool_calls_made = progress
            .tool_calls_made
            .saturating_add(u32::try_from(turn.tool_calls.len()).unwrap_or(u32::MAX));
    }
    match plan.next {
        Next::ModelCall(iteration) => Ok(Resumed::At(iteration)),
        Next::Complete(finish_reason) => {
            let text = plan
                .assistant_messages
                .last()
                .map(super::structured::answer_text)
                .unwrap_or_default();
            match settle_answer(context, progress, &text, finish_reason).await? {
                Some(completion) => Ok(Resumed::Done(completion)),
                None => Ok(Resumed::At(next_iteration.saturating_add(1))),
            }
        }
        Next::Tools(pending) => {
            let (message_id, turn_calls) = plan
                .assistant_messages
                .last()
                .map(|turn| (turn.id, turn.tool_calls.clone()))
                .unwrap_or_default();
            run_tools(context, progress, message_id, &turn_calls, Some(pending)).await?;
            Ok(Resumed::At(next_iteration))
        }
    }
}

/// Checks one turn's tool calls (doom loop, `max_tool_calls`), waits for the client's answers
/// to those it executes or approves (`requires_action`, see `agents::settle`), executes the
/// rest and commits their results in the model's call order. For a resumed turn, `pending`
/// says which calls are still unanswered and what the log holds of each: a logged result is
/// committed as it is, an execution cut off is answered as interrupted (or executed again when
/// its tool is idempotent), the others execute.
async fn run_tools(
    context: &RunContext,
    progress: &mut Progress,
    message_id: MessageId,
    turn_calls: &[ToolCall],
    pending: Option<PendingCalls>,
) -> Result<(), RunFailure> {
    let RunContext {
        runtime,
        record,
        emitter,
        ..
    } = context;
    let config = runtime.config();
    let to_answer = pending
        .as_ref()
        .map_or_else(|| turn_calls.to_vec(), |p| p.calls.clone());
    // A doom loop already logged for this turn (before a crash) is honoured, not logged again.
    let doom_loop = match pending.as_ref().and_then(|p| p.doom_loop.clone()) {
        Some(logged) => Some(logged),
        None => match progress
            .doom_loop
            .as_mut()
            .and_then(|d| d.observe(turn_calls))
        {
            Some(description) => {
                crate::telemetry::metrics::doom_loop();
                emitter
                    .emit(EventPayload::DoomLoopDetected(DoomLoopDetected {
                        description: description.clone(),
                    }))
                    .await?;
                Some(description)
            }
            None => None,
        },
    };
    if let Some(description) = doom_loop {
        skip_calls(
            emitter,
            record,
            &to_answer,
            "not executed: doom loop detected",
        )
        .await?;
        return Err(RunFailure::DoomLoop(description));
    }
    progress.tool_calls_made = progress
        .tool_calls_made
        .saturating_add(u32::try_from(turn_calls.len()).unwrap_or(u32::MAX));
    if progress.tool_calls_made > config.max_tool_calls {
        let reason = format!("the run reached max_tool_calls ({})", config.max_tool_calls);
        skip_calls(
            emitter,
            record,
            &to_answer,
            &format!("not executed: {reason}"),
        )
        .await?;
        return Err(RunFailure::Limit(reason));
    }
    let wait = agents::Wait {
        runtime,
        record,
        emitter,
        agent: &context.agent,
        answered: &context.answered,
        cancel: &context.cancel,
    };
    let decisions = agents::settle(&wait, message_id, &to_answer).await?;
    let executions = futures::stream::iter(to_answer)
        .map(|call| {
            let logged = pending.as_ref().and_then(|p| p.finished.get(&call.id));
            let execution = match (&pending, decisions.get(&call.id)) {
                (_, Some(Decision::Answered { result, waited_ms })) if logged.is_none() => {
                    Execution::Answered(result.clone(), *waited_ms)
                }
                (None, _) => Execution::Run,
                (Some(pending), _) => {
                    if let Some(result) = pending.finished.get(&call.id) {
                        Execution::Logged(result.clone())
                    } else if pending.started.contains(&call.id) {
                        if runtime.tools().is_idempotent(&call.name) {
                            Execution::Rerun
                        } else {
                            Execution::Interrupted
                        }
                    } else {
                        Execution::Run
                    }
                }
            };
            tool_exec::execute_tool(runtime, emitter, record, call, config, execution)
        })
        .buffered(config.tool_concurrency.max(1));
    futures::pin_mut!(executions);
    // Results are committed in the model's call order, whatever order the tools end in.
    while let Some(execution) = executions.next().await {
        let (call, content) = execution?;
        let message = commit_tool_message(emitter, record, &call, content).await?;
        progress.context.push(message);
    }
    Ok(())
}

/// The end of a turn without tool calls: the run completes — for a run with an
/// `output_schema`, once `text` (the answer) is valid. An invalid answer gets a corrective turn
/// while one is left (`output_rejected` with the stored user message; `None`: the loop calls
/// the model again), else the run fails with `output_invalid`.
async fn settle_answer(
    context: &RunContext,
    progress: &mut Progress,
    text: &str,
    finish_reason: FinishReason,
) -> Result<Option<Completion>, RunFailure> {
    let Some(output) = progress.output.as_mut() else {
        return Ok(Some(Completion {
            finish_reason,
            parsed: None,
        }));
    };
    match output.check(text) {
        Verdict::Valid(parsed) => Ok(Some(Completion {
            finish_reason,
            parsed: Some(parsed),
        })),
        Verdict::Fail(error) => Err(RunFailure::OutputInvalid(error)),
        Verdict::Correct {
            attempt,
            errors,
            message,
        } => {
            let correction = tool_exec::new_message(
                &context.record,
                Role::User,
                vec![ContentPart::Text { text: message }],
                Vec::new(),
            );
            context
                .emitter
                .emit_with(
                    EventPayload::OutputRejected(OutputRejected {
                        message_id: correction.id,
                        errors,
                        attempt,
                    }),
                    RunChange {
                        message: Some(correction.clone()),
                        ..RunChange::default()
                    },
                )
                .await?;
            progress.context.push(correction);
            Ok(None)
        }
    }
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
