//! How a run ends: one type, [`RunEnd`] (completed, failed with a class, cancelled), and one
//! close-out path whoever ends the run — its own task when the loop returns (completed,
//! failed, cancelled, its `requires_action` wait expired), a cancel of a run no process
//! executes, the recovery of a run whose process died (`recovery = "fail"`, its model no longer
//! configured, or a log that does not fold). A run stopped by a shutdown or taken over by
//! another process is not ended: it stays resumable.
//!
//! The order, read from the run's trail once every event before is durable: (0) a log still
//! empty (the run ended before its first model call) gets its `run_started`; (1) each tool call
//! the cut-off model call started and did not complete is completed, its argument text so far
//! as `invalid_arguments`; (2) when this process made that call and it was still streaming,
//! its estimated usage is recorded (`usage_recorded`, `estimated: true`), and likewise a
//! compaction's summariser call cut off (after `context_compaction_started`); (3) the text that
//! call streamed is kept as an incomplete assistant message; (4) each execution still open gets its `tool_execution_finished` (a `Failure`);
//! (5) each tool call of the run without a tool message gets one; (6) the terminal event, with
//! the run's status, finish reason, error and error class in its transaction. A completed run
//! has nothing open: only (6).

use std::sync::Arc;
use std::time::Duration;

use super::event_log::LogError;
use super::model_turn::CallInFlight;
use super::{RunEmitter, compaction, model_turn, tool_exec};
use crate::domain::{ErrorClass, RunEnd, RunRecord, RunStatus};
use crate::events::{EventPayload, RunStarted};
use crate::store::{RunChange, Store, StoreError};

/// Why a close-out stopped before its terminal event was written.
#[derive(Debug, thiserror::Error)]
pub(super) enum EndError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The result text of the calls a run that ends as `end` leaves open.
pub(super) fn open_call_reason(end: &RunEnd) -> &'static str {
    match end {
        RunEnd::Cancelled => tool_exec::CANCELLED,
        RunEnd::Failed {
            class: ErrorClass::Interrupted,
            ..
        } => tool_exec::INTERRUPTED,
        RunEnd::Failed {
            class: ErrorClass::ActionExpired,
            ..
        } => tool_exec::EXPIRED,
        RunEnd::Completed { .. } | RunEnd::Failed { .. } => tool_exec::NOT_EXECUTED,
    }
}

/// Ends the run as `end` (see the module's documentation for the order); `reason` is the
/// result text of the calls it leaves open. A completion or failure the store refuses because
/// a cancel was recorded first ends the run cancelled instead (cancel and completion race
/// through the run's row: an accepted cancel is never lost). Returns the terminal event's
/// sequence.
///
/// # Errors
/// The event log's or the store's; nothing terminal was written then, and calling again goes
/// on where this call stopped (the trail knows what was written).
pub(super) async fn close_out(
    store: &Arc<dyn Store>,
    emitter: &RunEmitter,
    record: &RunRecord,
    end: RunEnd,
    reason: &str,
    in_flight: Option<&CallInFlight>,
) -> Result<u64, EndError> {
    match close_out_as(store, emitter, record, end.clone(), reason, in_flight).await {
        Err(EndError::Log(LogError::CancelRequested)) if end != RunEnd::Cancelled => {
            tracing::info!(run_id = %record.id, "a cancel recorded before the run's end: it ends cancelled");
            close_out_as(
                store,
                emitter,
                record,
                RunEnd::Cancelled,
                tool_exec::CANCELLED,
                in_flight,
            )
            .await
        }
        other => other,
    }
}

/// [`close_out`] as `end`, without the switch to a cancel.
async fn close_out_as(
    store: &Arc<dyn Store>,
    emitter: &RunEmitter,
    record: &RunRecord,
    end: RunEnd,
    reason: &str,
    in_flight: Option<&CallInFlight>,
) -> Result<u64, EndError> {
    if !matches!(end, RunEnd::Completed { .. }) {
        // What the stopped body emitted in its last moment (e.g. the tool message of an answer
        // that raced a cancel) is durable, and in the trail, before what is open is read.
        emitter.flush().await?;
        let trail = emitter.trail();
        if trail.last_sequence() == 0 {
            // A run that ends before its first model call (a request that cannot fit, a
            // provider no longer configured, a cancel) still opens its log with `run_started`.
            emitter
                .emit_with(
                    EventPayload::RunStarted(RunStarted {
                        session_id: record.session_id,
                        provider: record.provider.clone(),
                        model: record.model.clone(),
                    }),
                    RunChange {
                        status: Some(RunStatus::SessionLoaded),
                        ..RunChange::default()
                    },
                )
                .await?;
        }
        let trail = emitter.trail();
        model_turn::complete_open_calls(emitter, &trail).await?;
        let cancelled = matches!(end, RunEnd::Cancelled);
        let trail = emitter.trail();
        compaction::record_cut_off_summariser(
            emitter,
            store.as_ref(),
            record,
            &trail,
            in_flight,
            cancelled,
        )
        .await?;
        let trail = emitter.trail();
        model_turn::record_cut_off_usage(
            emitter,
            store.as_ref(),
            record,
            &trail,
            in_flight,
            cancelled,
        )
        .await?;
        model_turn::keep_cut_off_text(emitter, record, &trail).await?;
        // Each open execution's `tool_execution_finished` precedes its tool message.
        tool_exec::finish_open_executions(emitter, &trail, reason).await?;
        let messages = store.session_messages(record.session_id).await?;
        let trail = emitter.trail();
        tool_exec::answer_open_calls(emitter, record, &trail, &messages, reason).await?;
    }
    let status = end.status().as_str();
    let sequence = emitter.finish(end).await?;
    let lived = (chrono::Utc::now() - record.created_at)
        .to_std()
        .unwrap_or(Duration::ZERO);
    crate::telemetry::metrics::run_duration(status, lived);
    Ok(sequence)
}

/// [`close_out`] for a run this process executes, retried while the store is unavailable (if
/// it never succeeds, the next owner's recovery ends the run). A log closed already or taken
/// over by another process ends the attempts.
pub(super) async fn close_out_retrying(
    store: &Arc<dyn Store>,
    emitter: &RunEmitter,
    record: &RunRecord,
    end: RunEnd,
    reason: &str,
    in_flight: Option<&CallInFlight>,
) {
    let mut delay = Duration::from_millis(100);
    for attempt in 1..=6 {
        match close_out(store, emitter, record, end.clone(), reason, in_flight).await {
            Ok(_) | Err(EndError::Log(LogError::Closed | LogError::Fenced)) => return,
            Err(error) => {
                tracing::error!(run_id = %record.id, %error, attempt, "the run's end could not be written");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
        }
    }
}
