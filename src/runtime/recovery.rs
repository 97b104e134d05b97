//! Ownership and recovery: each active run is owned by one process through a lease in the
//! store, renewed while the run lives; a run whose lease expired (its process died) is taken
//! over — at startup, and by a periodic scan that later lets any replica on a shared PostgreSQL
//! take over a dead replica's runs — and resumed from its snapshot and committed messages, or
//! failed (`[runtime] recovery`). This module also reads a run's log to plan its resumption.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use chrono::Utc;

use super::{Runtime, TraceContext, tool_exec};
use crate::config::Recovery;
use crate::domain::{
    ErrorClass, FinishReason, Message, Role, RunId, RunRecord, RunStatus, ToolCall,
};
use crate::events::{EventPayload, RunFailed, ToolExecutionResult};
use crate::store::{ClaimedRun, Lease, RunOutcome, StoreError, unix_ms};

/// Runs one recovery scan takes over at most.
const CLAIM_BATCH: u32 = 1000;

impl Runtime {
    /// This process's lease on a run, from now.
    pub(super) fn lease(&self) -> Lease {
        let ttl = i64::try_from(self.config.lease_ttl_ms).unwrap_or(i64::MAX);
        Lease {
            owner: self.owner.to_string(),
            expires_ms: unix_ms(Utc::now()).saturating_add(ttl),
        }
    }

    /// Takes over the runs left non-terminal by processes that are gone, and resumes or fails
    /// each (`[runtime] recovery`). At startup on SQLite (one process by design) every such
    /// run is taken at once; otherwise only runs whose lease has expired. A run whose cancel
    /// was requested meanwhile is cancelled. Returns how many runs were taken over.
    ///
    /// # Errors
    /// The store's.
    pub async fn recover(self: &Arc<Self>) -> Result<usize, StoreError> {
        self.take_over(self.store.single_process()).await
    }

    async fn take_over(self: &Arc<Self>, all: bool) -> Result<usize, StoreError> {
        if self.is_stopping() {
            return Ok(0);
        }
        let claimed = self
            .store
            .claim_runs(&self.lease(), unix_ms(Utc::now()), all, CLAIM_BATCH)
            .await?;
        let count = claimed.len();
        for run in claimed {
            let run_id = run.record.id;
            if let Err(error) = self.adopt(run).await {
                tracing::error!(%run_id, %error, "could not take over the run");
            }
        }
        if count > 0 {
            tracing::info!(
                runs = count,
                recovery = ?self.config.recovery,
                "took over runs left active by a stopped process"
            );
        }
        Ok(count)
    }

    /// Resumes, fails or cancels a run just claimed.
    async fn adopt(self: &Arc<Self>, run: ClaimedRun) -> Result<(), StoreError> {
        let record = run.record;
        if self.active().contains_key(&record.id) {
            return Ok(());
        }
        if run.cancel_requested {
            return self
                .end_orphan(
                    &record,
                    EventPayload::RunCancelled(Default::default()),
                    RunStatus::Cancelled,
                    None,
                )
                .await;
        }
        let model = self
            .providers
            .get(&record.provider)
            .and_then(|entry| entry.config.models.get(&record.model).copied());
        // A run waiting for its client was not interrupted: its wait resumes whatever
        // `recovery` says.
        let waiting = record.status == RunStatus::RequiresAction;
        let error = match (self.config.recovery, model) {
            (_, Some(model)) if waiting => {
                let last = self.store.last_sequence(record.id).await?;
                let trace = self.trace_of(record.id).await?;
                self.start(record, model, trace, last);
                return Ok(());
            }
            (Recovery::Resume, Some(model)) => {
                let last = self.store.last_sequence(record.id).await?;
                let trace = self.trace_of(record.id).await?;
                self.start(record, model, trace, last);
                return Ok(());
            }
            (Recovery::Resume, None) => format!(
                "the server stopped while the run was active, and its model `{}` of provider `{}` \
                 is no longer configured",
                record.model, record.provider
            ),
            (Recovery::Fail, _) => "the server stopped while the run was active".to_owned(),
        };
        let payload = EventPayload::RunFailed(RunFailed {
            error: error.clone(),
            error_class: Some(ErrorClass::Interrupted),
        });
        self.end_orphan(&record, payload, RunStatus::Failed, Some(error))
            .await
    }

    /// The trace context of a run continued by this process: its first event's trace (a
    /// resumed run stays in its trace), a new span whose parent is the run span of the first
    /// event (that of the process that started the run).
    async fn trace_of(&self, run_id: RunId) -> Result<TraceContext, StoreError> {
        let first = self.store.read_events(run_id, 0, 1).await?;
        let envelope = first
            .first()
            .and_then(|event| serde_json::from_str::<serde_json::Value>(&event.data).ok());
        Ok(match envelope {
            Some(envelope) => TraceContext {
                trace_id: envelope["trace_id"].as_str().unwrap_or_default().to_owned(),
                span_id: crate::telemetry::trace::new_span_id(),
                parent_span_id: envelope["span_id"].as_str().unwrap_or_default().to_owned(),
                sampled: true,
            },
            None => TraceContext::for_run(run_id),
        })
    }

    /// Ends a run no task of this process executes (a claimed or orphaned one): finishes its
    /// open tool executions and calls, answers its open tool calls, and writes the terminal
    /// event.
    pub(super) async fn end_orphan(
        &self,
        run: &RunRecord,
        payload: EventPayload,
        status: RunStatus,
        error: Option<String>,
    ) -> Result<(), StoreError> {
        let last = self.store.last_sequence(run.id).await?;
        let trace = self.trace_of(run.id).await?;
        let span = self.run_span(run, trace.clone(), true);
        let emitter = self.log.emitter(run.id, last, trace).with_span(span);
        let reason = if status == RunStatus::Cancelled {
            tool_exec::CANCELLED
        } else {
            tool_exec::INTERRUPTED
        };
        tool_exec::complete_logged_calls(self.store.as_ref(), &emitter, run.id).await?;
        super::model_turn::keep_cut_off_text(self.store.as_ref(), &emitter, run).await?;
        tool_exec::finish_logged_executions(self.store.as_ref(), &emitter, run.id, reason).await?;
        tool_exec::answer_open_calls(&self.store, &emitter, run, reason).await?;
        let outcome = RunOutcome {
            status,
            finish_reason: Some(if status == RunStatus::Failed {
                FinishReason::Error
            } else {
                FinishReason::Unknown
            }),
            error,
        };
        emitter
            .finish(payload, outcome)
            .await
            .map(|_| ())
            .map_err(|e| StoreError::Corrupt(e.to_string()))
    }
}

/// Renews this process's leases every third of the lease time, aborts local runs whose lease
/// another process took, passes on cancels requested through the store, and takes over runs
/// whose lease expired. Ends when the runtime is dropped or stops.
pub(super) async fn lease_loop(runtime: Weak<Runtime>, ttl: Duration) {
    let mut tick = tokio::time::interval((ttl / 3).max(Duration::from_millis(100)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(runtime) = runtime.upgrade() else {
            return;
        };
        if runtime.stop.is_cancelled() {
            return;
        }
        let lease = runtime.lease();
        // Only runs whose lease was committed before the renewal can be missing from it
        // because another process took them; a run created meanwhile is not lost.
        let leased: Vec<RunId> = runtime
            .active()
            .iter()
            .filter(|(_, run)| run.leased)
            .map(|(id, _)| *id)
            .collect();
        match runtime
            .store
            .renew_leases(&lease.owner, lease.expires_ms)
            .await
        {
            Ok(renewal) => {
                let lost: Vec<RunId> = leased
                    .into_iter()
                    .filter(|id| !renewal.owned.contains(id))
                    .collect();
                for run_id in lost {
                    // A run that just ended is not renewed either; only a live one was lost.
                    let ended = runtime
                        .store
                        .get_run(run_id)
                        .await
                        .map(|run| run.is_none_or(|run| run.status.is_terminal()));
                    if matches!(ended, Ok(false)) {
                        tracing::warn!(%run_id, "lost the run's lease to another process; stopping it here");
                        runtime.abandon(run_id);
                    }
                }
                for run_id in renewal.cancel_requested {
                    if let Some(run) = runtime.active().get(&run_id) {
                        run.cancel.cancel();
                    }
                }
            }
            Err(error) => tracing::warn!(%error, "lease renewal failed"),
        }
        if let Err(error) = runtime.take_over(false).await {
            tracing::warn!(%error, "recovery scan failed");
        }
    }
}

/// What a resumed run does first, read from its log and committed messages.
#[derive(Debug)]
pub(super) struct ResumePlan {
    /// The sequence of the `model_started` whose call was cut off.
    pub abandoned_after: Option<u64>,
    /// The iteration of the last `model_started` (0 when none).
    pub iteration: u32,
    pub next: Next,
    /// Every assistant message of the run, in order (for the doom-loop detector and the tool
    /// call count).
    pub assistant_messages: Vec<Message>,
}

/// Where a resumed run picks up.
#[derive(Debug)]
pub(super) enum Next {
    /// Make model call `iteration` (again).
    ModelCall(u32),
    /// Finish the tool calls of the last assistant message, then model call `iteration + 1`.
    Tools(PendingCalls),
    /// The last turn was the answer: the run completes.
    Complete(FinishReason),
}

/// The unanswered calls of the last assistant message and what the log says about each.
#[derive(Debug)]
pub(super) struct PendingCalls {
    /// Unanswered calls, in the model's order.
    pub calls: Vec<ToolCall>,
    /// Calls whose execution was logged as started.
    pub started: Vec<String>,
    /// Logged results of calls whose tool message is missing.
    pub finished: HashMap<String, ToolExecutionResult>,
    /// The description of a doom loop detected for this turn, when one was logged.
    pub doom_loop: Option<String>,
}

/// Reads the run's log and messages and decides where it resumes.
pub(super) async fn plan(
    store: &dyn crate::store::Store,
    record: &RunRecord,
    history: &[Message],
) -> Result<ResumePlan, StoreError> {
    let mut last_model_started: Option<(u64, u32)> = None;
    let mut committed_after = false;
    let mut doom_loop = None;
    let mut started = Vec::new();
    let mut finished = HashMap::new();
    let mut after = 0;
    loop {
        let page = store.read_events(record.id, after, 500).await?;
        let Some(last) = page.last() else { break };
        after = last.sequence;
        for event in &page {
            let interesting = matches!(
                event.event_type.as_str(),
                "model_started"
                    | "assistant_message_committed"
                    | "doom_loop_detected"
                    | "tool_execution_started"
                    | "tool_execution_finished"
            );
            if !interesting {
                continue;
            }
            let data: serde_json::Value = serde_json::from_str(&event.data)
                .map_err(|e| StoreError::Corrupt(e.to_string()))?;
            match event.event_type.as_str() {
                "model_started" => {
                    let iteration = data["iteration"].as_u64().unwrap_or(1);
                    last_model_started =
                        Some((event.sequence, u32::try_from(iteration).unwrap_or(u32::MAX)));
                    committed_after = false;
                    doom_loop = None;
                    started.clear();
                    finished.clear();
                }
                "assistant_message_committed" => committed_after = true,
                "doom_loop_detected" => {
                    doom_loop = Some(data["description"].as_str().unwrap_or_default().to_owned());
                }
                "tool_execution_started" => {
                    started.push(data["call_id"].as_str().unwrap_or_default().to_owned());
                }
                _ => {
                    let call_id = data["call_id"].as_str().unwrap_or_default().to_owned();
                    if let Ok(result) = serde_json::from_value(data["result"].clone()) {
                        finished.insert(call_id, result);
                    }
                }
            }
        }
    }
    // From the store: a compaction may have taken the run's earlier turns out of `history`.
    let assistant_messages = store.run_messages(record.id, Role::Assistant).await?;
    let Some((sequence, iteration)) = last_model_started else {
        return Ok(ResumePlan {
            abandoned_after: None,
            iteration: 0,
            next: Next::ModelCall(record.iterations.max(1)),
            assistant_messages,
        });
    };
    let last_turn = assistant_messages.last();
    let next = match last_turn {
        // The call was cut off before its message was committed: it is made again.
        _ if !committed_after => {
            return Ok(ResumePlan {
                abandoned_after: Some(sequence),
                iteration,
                next: Next::ModelCall(iteration),
                assistant_messages,
            });
        }
        None => Next::ModelCall(iteration),
        Some(turn) if turn.tool_calls.is_empty() => {
            Next::Complete(record.finish_reason.unwrap_or(FinishReason::Stop))
        }
        Some(turn) => {
            // The results after the turn answer its calls (an older call may have had the same
            // id before a compaction took it out of the requests).
            let after_turn = history
                .iter()
                .rposition(|m| m.id == turn.id)
                .map_or(history.len(), |i| i + 1);
            let answered: std::collections::HashSet<&str> = history[after_turn..]
                .iter()
                .filter_map(|m| m.tool_call_id.as_deref())
                .collect();
            let calls: Vec<ToolCall> = turn
                .tool_calls
                .iter()
                .filter(|call| !answered.contains(call.id.as_str()))
                .cloned()
                .collect();
            if calls.is_empty() {
                Next::ModelCall(iteration.saturating_add(1))
            } else {
                Next::Tools(PendingCalls {
                    calls,
                    started,
                    finished,
                    doom_loop,
                })
            }
        }
    };
    Ok(ResumePlan {
        abandoned_after: None,
        iteration,
        next,
        assistant_messages,
    })
}
