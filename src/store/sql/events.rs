//! A run's event log: appending batches in one transaction with the writes each event proves
//! (fenced by the runs' leases), and reading the log back. The writes that belong to another
//! concern are its helpers: `insert_message` (`sessions.rs`), `upsert_snapshot`
//! (`snapshots.rs`), `insert_compaction_row` (`compaction.rs`), `update_run_progress`
//! (`runs.rs`), `insert_webhook_delivery` (`webhooks.rs`).

use super::{corrupt, count, text, to_i64, to_json};
use crate::domain::{RunId, RunStatus, TokenUsage};
use crate::events::{LoggedEvent, StoredEnvelope, StoredEvent};
use crate::store::{
    EventStore, EventWrite, PostgresStore, Refused, Signal, SqliteStore, StoreResult,
};

/// A row of `events` (migration 0006): see [`StoredEvent`].
#[derive(sqlx::FromRow)]
pub(super) struct EventRow {
    sequence: i64,
    kind: i16,
    emitted_at: Option<i64>,
    span_id: Option<Vec<u8>>,
    trace_id: Option<Vec<u8>>,
    body: String,
}

/// The logged events of `run_id`'s rows, `data` derived again from the stored values.
pub(super) fn events(run_id: RunId, rows: Vec<EventRow>) -> StoreResult<Vec<LoggedEvent>> {
    rows.into_iter()
        .map(|row| {
            let envelope = row.emitted_at.map(|emitted_at| StoredEnvelope {
                emitted_at,
                span_id: row.span_id.unwrap_or_default(),
                trace_id: row.trace_id,
            });
            let stored = StoredEvent {
                kind: row.kind,
                envelope,
                body: row.body,
            };
            stored
                .decode(run_id, count(row.sequence))
                .map_err(|error| corrupt("event", error))
        })
        .collect()
}

/// The distinct runs of `writes`, sorted (row locks are taken in this order).
fn run_ids<'a>(writes: impl Iterator<Item = &'a EventWrite>) -> Vec<uuid::Uuid> {
    let mut runs: Vec<uuid::Uuid> = writes.map(|w| w.run_id.0).collect();
    runs.sort_unstable();
    runs.dedup();
    runs
}

/// Whether the events of `run` in `writes` are the next sequences after `last`, in order.
fn continues_log(run: uuid::Uuid, last: u64, writes: &[EventWrite]) -> bool {
    let sequences = writes
        .iter()
        .filter(|write| write.run_id.0 == run)
        .map(|write| write.event.sequence);
    let continues = sequences
        .zip(last + 1..)
        .all(|(sequence, next)| sequence == next);
    if !continues {
        tracing::warn!(
            run_id = %run,
            last_stored = last,
            "events that do not continue the run's stored log were refused (a stopped writer's)"
        );
    }
    continues
}

/// Implements [`EventStore`] for a backend struct (see `sql/mod.rs`).
macro_rules! impl_event_store {
    ($store:ty, $db:ty) => {
        #[async_trait::async_trait]
        impl EventStore for $store {
            async fn append_events_as(
                &self,
                owner: Option<&str>,
                events: &[EventWrite],
            ) -> StoreResult<Refused> {
                if events.is_empty() {
                    return Ok(Refused::default());
                }
                // Encoded before the transaction opens: it stays as short as before.
                let encoded: Vec<StoredEvent> = events
                    .iter()
                    .map(|write| StoredEvent::encode(write.run_id, &write.event))
                    .collect();
                let mut tx = self.begin_write().await?;
                let mut refused = Refused::default();
                // Fencing: only runs this process (still) holds the lease of are written, and
                // only events that continue the stored log (the next sequences, in order). The
                // second check refuses a stopped emitter's late events — its run was taken over
                // and given back meanwhile, or resumed here from the log — run by run, where a
                // duplicate sequence would fail the whole batch. The checks hold until the
                // commit: SQLite's write transaction excludes every other writer; PostgreSQL's
                // `FOR SHARE` row locks make a takeover wait for it.
                if let Some(owner) = owner {
                    let runs = run_ids(events.iter());
                    let mut check = sqlx::QueryBuilder::<$db>::new(
                        "SELECT id, (SELECT MAX(sequence) FROM events WHERE events.run_id = runs.id) \
                         FROM runs WHERE (lease_owner IS NULL OR lease_owner = ",
                    );
                    check.push_bind(owner).push(") AND id IN (");
                    let mut list = check.separated(", ");
                    for run in &runs {
                        list.push_bind(*run);
                    }
                    check.push(")").push(Self::ROW_LOCK);
                    let owned: Vec<(uuid::Uuid, Option<i64>)> =
                        check.build_query_as().fetch_all(&mut *tx).await?;
                    refused.fenced = runs
                        .into_iter()
                        .filter(|run| {
                            owned.iter().find(|(id, _)| id == run).is_none_or(|(_, last)| {
                                !continues_log(*run, last.map_or(0, count), events)
                            })
                        })
                        .map(RunId)
                        .collect();
                }
                // Cancel and completion race through the run's row: a run whose cancel was
                // recorded before this transaction does not complete or fail here (its end is
                // refused; the runtime ends it cancelled), and a cancel recorded after it finds
                // the run ended (`request_cancel` is conditional on the status; on PostgreSQL
                // the `FOR SHARE` lock makes its UPDATE wait for this commit).
                let ending = run_ids(events.iter().filter(|write| {
                    !refused.fenced.contains(&write.run_id)
                        && write
                            .outcome
                            .as_ref()
                            .is_some_and(|end| end.status() != RunStatus::Cancelled)
                }));
                if !ending.is_empty() {
                    let mut check = sqlx::QueryBuilder::<$db>::new(
                        "SELECT id FROM runs WHERE cancel_requested AND id IN (",
                    );
                    let mut list = check.separated(", ");
                    for run in &ending {
                        list.push_bind(*run);
                    }
                    check.push(")").push(Self::ROW_LOCK);
                    let cancelled: Vec<uuid::Uuid> =
                        check.build_query_scalar().fetch_all(&mut *tx).await?;
                    refused.cancelled = cancelled.into_iter().map(RunId).collect();
                }
                let written = |write: &EventWrite| {
                    !refused.fenced.contains(&write.run_id)
                        && !(write.outcome.is_some() && refused.cancelled.contains(&write.run_id))
                };
                let all = events;
                let kept: Vec<EventWrite>;
                let events = if refused.is_empty() {
                    events
                } else {
                    kept = events.iter().filter(|w| written(w)).cloned().collect();
                    if kept.is_empty() {
                        return Ok(refused);
                    }
                    &kept[..]
                };
                let stored: Vec<_> = all
                    .iter()
                    .zip(&encoded)
                    .filter(|(write, _)| written(write))
                    .collect();
                // One multi-row INSERT per chunk keeps group commit to a few statements.
                for chunk in stored.chunks(200) {
                    let mut insert = sqlx::QueryBuilder::<$db>::new(
                        "INSERT INTO events (run_id, sequence, kind, emitted_at, span_id, \
                         trace_id, body) ",
                    );
                    insert.push_values(chunk, |mut row, (write, stored)| {
                        let envelope = stored.envelope.as_ref();
                        row.push_bind(write.run_id.0)
                            .push_bind(to_i64(write.event.sequence))
                            .push_bind(stored.kind)
                            .push_bind(envelope.map(|e| e.emitted_at))
                            .push_bind(envelope.map(|e| e.span_id.as_slice()))
                            .push_bind(envelope.and_then(|e| e.trace_id.as_deref()))
                            .push_bind(stored.body.as_str());
                    });
                    insert.build().execute(&mut *tx).await?;
                }
                // A run's status and progress changes that follow one another in the batch are
                // written as one UPDATE (e.g. a start's `run_started`, `context_built` and
                // `model_started`): the later values win, as they would one after another.
                let mut carried: Option<(RunId, Option<RunStatus>, Option<(u32, TokenUsage)>)> =
                    None;
                for (index, write) in events.iter().enumerate() {
                    let change = &write.change;
                    if let Some(message) = &change.message {
                        Self::insert_message(&mut tx, message).await?;
                        // A committed message is a boundary: the run's takeovers count again
                        // from 0 (`sql/leases.rs`).
                        sqlx::query("UPDATE runs SET takeovers = 0 WHERE id = $1 AND takeovers > 0")
                            .bind(write.run_id.0)
                            .execute(&mut *tx)
                            .await?;
                    }
                    if let Some(snapshot) = &change.snapshot {
                        Self::upsert_snapshot(&mut tx, write, snapshot).await?;
                    }
                    if let Some(compaction) = &change.compaction {
                        Self::insert_compaction_row(&mut tx, compaction).await?;
                    }
                    if let Some((session_id, calibration)) = &change.calibration {
                        sqlx::query(
                            "UPDATE sessions SET context_reported_tokens = $2, \
                             context_counted_tokens = $3 WHERE id = $1",
                        )
                        .bind(session_id.0)
                        .bind(to_i64(calibration.reported_tokens))
                        .bind(to_i64(calibration.counted_tokens))
                        .execute(&mut *tx)
                        .await?;
                    }
                    if let Some(reason) = change.finish_reason {
                        sqlx::query("UPDATE runs SET finish_reason = $2 WHERE id = $1")
                            .bind(write.run_id.0)
                            .bind(reason.as_str())
                            .execute(&mut *tx)
                            .await?;
                    }
                    let (mut status, mut progress) = (change.status, change.progress);
                    if let Some((run_id, earlier_status, earlier_progress)) = carried.take() {
                        if run_id == write.run_id {
                            status = status.or(earlier_status);
                            progress = progress.or(earlier_progress);
                        } else {
                            Self::update_run_progress(
                                &mut tx,
                                run_id,
                                earlier_status,
                                earlier_progress,
                            )
                            .await?;
                        }
                    }
                    if status.is_some() || progress.is_some() {
                        // Carried into the next write of the same run, unless this one ends or
                        // pauses the run, or the next pauses it (which keeps `required_action`).
                        let carry = write.outcome.is_none()
                            && change.required_action.is_none()
                            && events.get(index + 1).is_some_and(|next| {
                                next.run_id == write.run_id
                                    && next.change.status != Some(RunStatus::RequiresAction)
                            });
                        if carry {
                            carried = Some((write.run_id, status, progress));
                        } else {
                            Self::update_run_progress(&mut tx, write.run_id, status, progress)
                                .await?;
                        }
                    }
                    if let Some(action) = &change.required_action {
                        sqlx::query(
                            "UPDATE runs SET required_action = $2 WHERE id = $1 \
                             AND status NOT IN ('completed', 'failed', 'cancelled')",
                        )
                        .bind(write.run_id.0)
                        .bind(to_json(action)?)
                        .execute(&mut *tx)
                        .await?;
                    }
                    let Some(outcome) = &write.outcome else {
                        // `tool_calls_required`'s delivery: the run as it waits.
                        if let Some(due) = &change.webhook {
                            Self::insert_webhook_delivery(&mut tx, write.run_id, due).await?;
                        }
                        continue;
                    };
                    let error_class = outcome.error_class().map(|c| c.as_str());
                    sqlx::query(
                        "UPDATE runs SET status = $2, finish_reason = $3, error = $4, updated_at = $5, \
                         required_action = NULL, error_class = $6 WHERE id = $1",
                    )
                    .bind(write.run_id.0)
                    .bind(outcome.status().as_str())
                    .bind(outcome.finish_reason().as_str())
                    .bind(outcome.error().map(text))
                    .bind(chrono::Utc::now())
                    .bind(error_class)
                    .execute(&mut *tx)
                    .await?;
                    // The snapshot of a finished run shows how it ended.
                    sqlx::query(
                        "UPDATE snapshots SET status = $2, last_sequence = $3, created_at = $4, \
                         error_class = $5, (iteration, input_tokens, output_tokens, total_tokens, \
                         reasoning_tokens, usage_estimated) = (SELECT iterations, input_tokens, \
                         output_tokens, total_tokens, reasoning_tokens, usage_estimated FROM runs \
                         WHERE id = $1) WHERE run_id = $1",
                    )
                    .bind(write.run_id.0)
                    .bind(outcome.status().as_str())
                    .bind(to_i64(write.event.sequence))
                    .bind(chrono::Utc::now())
                    .bind(error_class)
                    .execute(&mut *tx)
                    .await?;
                    // The end's delivery: the run as it ended.
                    if let Some(due) = &change.webhook {
                        Self::insert_webhook_delivery(&mut tx, write.run_id, due).await?;
                    }
                }
                // Watchers on other replicas are woken when the transaction commits.
                let mut written: Vec<RunId> = stored.iter().map(|(write, _)| write.run_id).collect();
                written.sort_unstable_by_key(|run| run.0);
                written.dedup();
                Self::signal_in(&mut tx, written.into_iter().map(Signal::Events)).await?;
                tx.commit().await?;
                Ok(refused)
            }

            async fn read_events(
                &self,
                run_id: RunId,
                after: u64,
                limit: u32,
            ) -> StoreResult<Vec<LoggedEvent>> {
                #[cfg(test)]
                crate::store::log_reads::count(run_id);
                let rows: Vec<EventRow> = sqlx::query_as(
                    "SELECT sequence, kind, emitted_at, span_id, trace_id, body FROM events \
                     WHERE run_id = $1 AND sequence > $2 ORDER BY sequence LIMIT $3",
                )
                .bind(run_id.0)
                .bind(to_i64(after))
                .bind(i64::from(limit))
                .fetch_all(&self.pool)
                .await?;
                events(run_id, rows)
            }

            async fn last_sequence(&self, run_id: RunId) -> StoreResult<u64> {
                let last: Option<i64> =
                    sqlx::query_scalar("SELECT MAX(sequence) FROM events WHERE run_id = $1")
                        .bind(run_id.0)
                        .fetch_one(&self.pool)
                        .await?;
                Ok(last.and_then(|s| u64::try_from(s).ok()).unwrap_or(0))
            }
        }
    };
}

impl_event_store!(SqliteStore, sqlx::Sqlite);
impl_event_store!(PostgresStore, sqlx::Postgres);
