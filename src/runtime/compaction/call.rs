//! The checks around a run's model call: before it (the threshold, prune, compaction) and after
//! the provider rejected it as too long (one compaction, then the call is made again), with the
//! events and the circuit breaker's count of each attempt.

use super::conversation::Conversation;
use super::job::{Attempt, Job};
use crate::config::ModelConfig;
use crate::domain::{CompactionConfig, CompactionTrigger, RunId, RunStatus, SessionId, TokenUsage};
use crate::events::{
    CompactionCircuitOpened, ContextCompacted, ContextCompactionStarted, EventPayload,
};
use crate::provider::{ProviderError, ToolSpec};
use crate::runtime::Runtime;
use crate::runtime::event_log::{LogError, RunEmitter};
use crate::runtime::model_turn::{self, CallInFlight, InFlight};
use crate::store::{RunChange, StoreError};
use crate::telemetry;

/// A model's limits for one call, in tokens.
#[derive(Debug, Clone, Copy)]
pub(in crate::runtime) struct Window {
    pub(super) context: u64,
    pub(super) max_output: u64,
}

impl Window {
    /// The window of `model` for a call that may generate `max_output` tokens.
    pub fn of(model: ModelConfig, max_output: u32) -> Self {
        Self {
            context: u64::from(model.context_window),
            max_output: u64::from(max_output),
        }
    }

    /// The most a request may hold: the window less the output.
    pub(super) fn hard(self) -> u64 {
        self.context.saturating_sub(self.max_output)
    }

    /// Where compaction starts: the window less the output and `buffer_tokens` (set, or
    /// relative to the window).
    pub(super) fn threshold(self, settings: &CompactionConfig) -> u64 {
        self.hard().saturating_sub(settings.buffer_for(self.hard()))
    }

    /// The most tokens of the newest turns compaction keeps verbatim (`keep_tokens`, set or
    /// relative to the window).
    pub(super) fn keep(self, settings: &CompactionConfig) -> u64 {
        settings.keep_for(self.hard())
    }

    /// Whether the tail compaction keeps fits below the threshold.
    pub(super) fn fits(self, settings: &CompactionConfig) -> bool {
        self.keep(settings) < self.threshold(settings)
    }
}

/// Why a compacted request that still does not fit is not sent.
const COMPACTED_STILL_TOO_LONG: &str = "it was compacted, but what compaction keeps verbatim \
(the newest turns, the latest input among them, the instructions and the tools) is still too \
long; the run fails without sending it (the session stays valid: a shorter input can follow)";

/// Why a run cannot make its model call.
#[derive(Debug, thiserror::Error)]
pub(in crate::runtime) enum Stop {
    /// The request does not fit the model's window and compaction could not make it fit:
    /// the run fails with `context_length_exceeded`.
    #[error("{0}")]
    TooLong(String),
    #[error(transparent)]
    Log(#[from] LogError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A model call of a run, as the checks around it see it.
pub(in crate::runtime) struct Call<'a> {
    /// The runtime (store, providers, settings).
    pub runtime: &'a Runtime,
    /// The run's session.
    pub session_id: SessionId,
    /// The run.
    pub run_id: RunId,
    /// The run's provider id.
    pub provider: &'a str,
    /// The run's model.
    pub model: &'a str,
    /// The model's limits for this call.
    pub window: Window,
    /// Where the run's events go.
    pub emitter: &'a RunEmitter,
    /// The tools the request offers.
    pub tools: &'a [ToolSpec],
    /// Model calls the run has made so far (its `iterations`).
    pub iterations: u32,
    /// The run's call in flight: the summariser's while it is called, for the run's end if it
    /// cuts the call off.
    pub in_flight: &'a InFlight,
}

impl Call<'_> {
    fn job<'b>(&'b self, settings: &'b CompactionConfig, trigger: CompactionTrigger) -> Job<'b> {
        Job {
            runtime: self.runtime,
            session_id: self.session_id,
            run_id: Some(self.run_id),
            provider: self.provider,
            model: self.model,
            window: self.window,
            tools: self.tools,
            settings,
            trigger,
        }
    }

    /// The run's failure when the request does not fit and `reason` says why nothing helped.
    fn too_long(&self, estimated: u64, reason: &str) -> Stop {
        Stop::TooLong(format!(
            "the request (about {estimated} tokens) does not fit the context window of `{}` \
             ({} tokens, {} of them kept for the answer), and {reason}",
            self.model, self.window.context, self.window.max_output
        ))
    }

    /// Before the model call: when the request passes the threshold and `auto` is on, prunes
    /// (`prune` on) and compacts. Events it emits are written after `preamble` (the run's
    /// opening events not yet logged), which is then empty.
    ///
    /// # Errors
    /// [`Stop::TooLong`] when the request does not fit the window and could not be made to
    /// (also when it was compacted and is still over it: it is never sent); the event log's or
    /// the store's errors.
    pub async fn before(
        &self,
        conversation: &mut Conversation,
        total_usage: &mut TokenUsage,
        preamble: &mut Vec<(EventPayload, RunChange)>,
    ) -> Result<(), Stop> {
        let settings = self.runtime.compaction_config().await?;
        let mut size = conversation.measure(self.tools);
        let threshold = self.window.threshold(&settings);
        if size.estimated <= threshold || !settings.auto {
            return Ok(());
        }
        if settings.prune {
            let pruned = conversation.prune(self.window.keep(&settings), settings.tail_turns);
            if pruned > 0 {
                size = conversation.measure(self.tools);
                tracing::info!(run_id = %self.run_id, pruned, tokens = size.estimated, "pruned old tool outputs");
                if size.estimated <= threshold {
                    return Ok(());
                }
            }
        }
        let reason = if self.window.fits(&settings) {
            let job = self.job(&settings, CompactionTrigger::Auto);
            match self
                .attempt(job, conversation, total_usage, preamble)
                .await?
            {
                None => {
                    // The call's estimated usage and the calibration after it are of the
                    // request that is sent: the compacted one — unless it still does not fit
                    // (what compaction keeps verbatim, the latest input among it, is too
                    // long): a request over the window is never sent.
                    let size = conversation.measure(self.tools);
                    if size.estimated > self.window.hard() {
                        return Err(self.too_long(size.estimated, COMPACTED_STILL_TOO_LONG));
                    }
                    return Ok(());
                }
                Some(reason) => reason,
            }
        } else {
            "the compaction settings do not fit this model's window (see /compaction)".to_owned()
        };
        let size = conversation.measure(self.tools);
        if size.estimated > self.window.hard() {
            return Err(self.too_long(size.estimated, &reason));
        }
        tracing::info!(run_id = %self.run_id, tokens = size.estimated, %reason, "the request is past the compaction threshold and still fits: sent as it is");
        Ok(())
    }

    /// After the provider rejected the call as too long (`context_length_exceeded`): the
    /// estimate is corrected upwards and the context compacted once, so that the call can be
    /// made again.
    ///
    /// # Errors
    /// [`Stop::TooLong`] when nothing could be compacted, or the compacted request is still
    /// estimated over the window; the event log's or the store's.
    pub async fn after_overflow(
        &self,
        conversation: &mut Conversation,
        total_usage: &mut TokenUsage,
        error: &ProviderError,
    ) -> Result<(), Stop> {
        // The provider counted more than the window less the answer: behest undercounted.
        let raw = conversation.last_raw.max(1);
        let floor = self.window.hard() as f64 / raw as f64 * 1.05;
        conversation.ratio_floor = conversation.ratio_floor.max(floor);
        let settings = self.runtime.compaction_config().await?;
        let job = self.job(&settings, CompactionTrigger::Reactive);
        match self
            .attempt(job, conversation, total_usage, &mut Vec::new())
            .await?
        {
            None => {
                let size = conversation.measure(self.tools);
                if size.estimated > self.window.hard() {
                    return Err(self.too_long(size.estimated, COMPACTED_STILL_TOO_LONG));
                }
                Ok(())
            }
            Some(reason) => Err(Stop::TooLong(format!(
                "the provider rejected the request as too long for the context window of `{}` \
                 ({}), and {reason}",
                self.model, error.message
            ))),
        }
    }

    /// One compaction attempt with its events: before the summariser is called,
    /// `context_compaction_started` (status `compacting`), written after `preamble` (the run's
    /// opening events), so a watcher sees the run start and what it waits for; then
    /// `context_compacted` (its usage counted in the run's) on success; on failure the
    /// breaker's count, and `compaction_circuit_opened` when this failure opened it. `None`
    /// when compacted, else why not.
    async fn attempt(
        &self,
        job: Job<'_>,
        conversation: &mut Conversation,
        total_usage: &mut TokenUsage,
        preamble: &mut Vec<(EventPayload, RunChange)>,
    ) -> Result<Option<String>, Stop> {
        let trigger = job.trigger.as_str();
        let outcome = match job.plan(conversation).await? {
            Err(outcome) => outcome,
            Ok(planned) => {
                let mut events = std::mem::take(preamble);
                events.push((
                    EventPayload::ContextCompactionStarted(ContextCompactionStarted {
                        trigger: job.trigger,
                        messages_to_summarise: planned.messages_to_summarise,
                        tokens_before: planned.tokens_before,
                        provider: planned.provider_id.clone(),
                        model: planned.model.clone(),
                    }),
                    RunChange {
                        status: Some(RunStatus::Compacting),
                        ..RunChange::default()
                    },
                ));
                self.emitter.emit_all(events).await?;
                let counter = crate::runtime::tokens::TokenCounter::for_model(&planned.model);
                model_turn::set_in_flight(
                    self.in_flight,
                    Some(CallInFlight {
                        provider: planned.provider_id.clone(),
                        model: planned.model.clone(),
                        input_tokens: planned.head_tokens + counter.text(super::SUMMARISER_PROMPT),
                        started: std::time::Instant::now(),
                        summariser: true,
                    }),
                );
                let outcome = job.summarise(conversation, planned).await;
                model_turn::set_in_flight(self.in_flight, None);
                outcome
            }
        };
        match outcome {
            Attempt::Compacted(candidate) => {
                telemetry::metrics::compaction(trigger, true);
                let compaction = candidate.compaction.clone();
                *total_usage += compaction.usage;
                let mut events = std::mem::take(preamble);
                events.push((
                    EventPayload::ContextCompacted(ContextCompacted {
                        compaction_id: compaction.id,
                        trigger: compaction.trigger,
                        messages_summarised: compaction.messages_summarised,
                        through_message_id: compaction.through_message_id,
                        tokens_before: compaction.tokens_before,
                        tokens_after: compaction.tokens_after,
                        summary: compaction.summary.clone(),
                        usage: compaction.usage,
                        duration_ms: u64::try_from(candidate.duration.as_millis())
                            .unwrap_or(u64::MAX),
                    }),
                    RunChange {
                        status: Some(RunStatus::BuildingContext),
                        progress: Some((self.iterations, *total_usage)),
                        compaction: Some(compaction),
                        ..RunChange::default()
                    },
                ));
                self.emitter.emit_all(events).await?;
                conversation.apply(candidate);
                Ok(None)
            }
            Attempt::NotAttempted(reason) => Ok(Some(reason)),
            Attempt::Failed { message, usage } => {
                telemetry::metrics::compaction(trigger, false);
                *total_usage += usage;
                let failure = self
                    .runtime
                    .store
                    .record_compaction_failure(&message, job.settings.circuit_breaker_threshold)
                    .await?;
                tracing::warn!(
                    run_id = %self.run_id,
                    consecutive_failures = failure.breaker.consecutive_failures,
                    error = %message,
                    "compaction failed"
                );
                if failure.opened {
                    tracing::error!(
                        consecutive_failures = failure.breaker.consecutive_failures,
                        "compaction circuit breaker opened: no compaction is attempted until it \
                         is reset (POST /compaction/circuit-breaker/reset)"
                    );
                    let mut events = std::mem::take(preamble);
                    events.push((
                        EventPayload::CompactionCircuitOpened(CompactionCircuitOpened {
                            consecutive_failures: failure.breaker.consecutive_failures,
                        }),
                        RunChange::default(),
                    ));
                    self.emitter.emit_all(events).await?;
                }
                Ok(Some(format!("compaction failed: {message}")))
            }
        }
    }
}

/// Records the estimated usage of a compaction's summariser call the run ended in, when the
/// log has its `context_compaction_started` without an outcome and this process made the call
/// (`in_flight`): the tokens of the messages it was sent and of the summariser's prompt, no
/// output, `estimated: true`, as a `usage_recorded` counted in the run's `total_usage` and in
/// the token metrics; the call is counted as `cancelled` in the call metrics when a cancel cut
/// it. A run ended by another process after a crash has no call in flight: nothing is
/// estimated for it (the log stays as it is, the compaction without an outcome).
///
/// # Errors
/// The event log's or the store's.
pub(in crate::runtime) async fn record_cut_off_summariser(
    emitter: &RunEmitter,
    store: &dyn crate::store::Store,
    record: &crate::domain::RunRecord,
    trail: &crate::runtime::trail::RunTrail,
    in_flight: Option<&CallInFlight>,
    cancelled: bool,
) -> Result<(), crate::runtime::end::EndError> {
    let Some(in_flight) = in_flight.filter(|call| call.summariser) else {
        return Ok(());
    };
    if trail.open_compaction().is_none() {
        return Ok(());
    }
    let counter = crate::runtime::tokens::TokenCounter::for_model(&in_flight.model);
    let usage = counter.usage(
        in_flight.input_tokens,
        &crate::runtime::tokens::Reply {
            text: "",
            reasoning: "",
            tool_calls: &[],
        },
    );
    crate::runtime::model_turn::log_estimated_usage(
        emitter, store, record, trail, in_flight, usage, cancelled,
    )
    .await
}
