//! The webhook outbox: a delivery written in the transaction of the event that causes it
//! (`insert_webhook_delivery`, called by `events.rs`), claimed by a worker with a short claim
//! that a dead process's expires, its attempts recorded, and a run's deliveries read back.
//! Each claim writes its attempt's row at once, `interrupted` until the attempt's end replaces
//! it: an attempt whose process died in the middle is still listed (shown `in_progress` while
//! its claim is live).

use chrono::{DateTime, TimeZone, Utc};
use uuid::Uuid;

use super::runs::{RUN_COLUMNS, RunRow};
use super::{corrupt, count, text, to_i64, to_json};
use crate::domain::{
    ClaimedDelivery, RunId, RunRecord, WebhookAttempt, WebhookAttemptOutcome, WebhookClaim,
    WebhookDelivery, WebhookDeliveryStatus, WebhookEventType,
};
use crate::store::{
    AttemptRecord, OutboxState, PostgresStore, SqliteStore, StoreResult, WebhookDue, WebhookStore,
};

#[derive(sqlx::FromRow)]
struct ClaimRow {
    id: Uuid,
    run_id: Uuid,
    url: String,
    payload: String,
    attempts: i64,
}

/// The text of an attempt that never ended.
const INTERRUPTED: &str = "the attempt did not end: the process making it stopped (killed, \
                           crashed or shut down); the receiver may have got it";

#[derive(sqlx::FromRow)]
struct DeliveryRow {
    id: Uuid,
    run_id: Uuid,
    event_type: String,
    url: String,
    status: String,
    created_ms: i64,
    next_attempt_ms: i64,
    finished_ms: Option<i64>,
    attempts: i64,
    locked_until_ms: Option<i64>,
}

#[derive(sqlx::FromRow)]
struct AttemptRow {
    delivery_id: Uuid,
    attempt: i64,
    started_ms: i64,
    duration_ms: Option<i64>,
    status_code: Option<i64>,
    error: Option<String>,
    outcome: String,
}

#[derive(sqlx::FromRow)]
struct OutboxRow {
    pending: i64,
    next_due_ms: Option<i64>,
}

fn time(ms: i64) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(ms)
        .single()
        .unwrap_or(DateTime::<Utc>::UNIX_EPOCH)
}

/// The body of a delivery: the Standard Webhooks envelope around the run record.
fn payload(due: &WebhookDue, run: &RunRecord) -> StoreResult<String> {
    to_json(&serde_json::json!({
        "type": due.event_type.as_str(),
        "timestamp": time(due.due_ms),
        "data": run,
    }))
}

/// The deliveries with their attempts; the latest attempt of a delivery whose claim is live at
/// `now_ms` and that has not ended is `in_progress` (stored `interrupted` at the claim).
fn deliveries(
    rows: Vec<DeliveryRow>,
    attempts: Vec<AttemptRow>,
    now_ms: i64,
) -> StoreResult<Vec<WebhookDelivery>> {
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let status = WebhookDeliveryStatus::parse(&row.status)
            .ok_or_else(|| corrupt("webhook delivery status", &row.status))?;
        let mut delivery = WebhookDelivery {
            id: row.id,
            run_id: RunId(row.run_id),
            event_type: WebhookEventType::parse(&row.event_type)
                .ok_or_else(|| corrupt("webhook event type", &row.event_type))?,
            url: row.url,
            status,
            created_at: time(row.created_ms),
            next_attempt_at: (status == WebhookDeliveryStatus::Pending)
                .then(|| time(row.next_attempt_ms)),
            finished_at: row.finished_ms.map(time),
            attempts: Vec::new(),
        };
        let claimed = status == WebhookDeliveryStatus::Pending
            && row.locked_until_ms.is_some_and(|until| until >= now_ms);
        for attempt in attempts.iter().filter(|a| a.delivery_id == row.id) {
            let mut outcome = WebhookAttemptOutcome::parse(&attempt.outcome)
                .ok_or_else(|| corrupt("webhook attempt outcome", &attempt.outcome))?;
            let mut error = attempt.error.clone();
            if outcome == WebhookAttemptOutcome::Interrupted
                && claimed
                && attempt.attempt == row.attempts
            {
                outcome = WebhookAttemptOutcome::InProgress;
                error = None;
            }
            delivery.attempts.push(WebhookAttempt {
                attempt: u32::try_from(attempt.attempt).unwrap_or(u32::MAX),
                started_at: time(attempt.started_ms),
                duration_ms: attempt.duration_ms.map(count),
                status_code: attempt.status_code.and_then(|c| u16::try_from(c).ok()),
                error,
                outcome,
            });
        }
        out.push(delivery);
    }
    Ok(out)
}

/// Implements [`WebhookStore`] for a backend struct (see `sql/mod.rs`).
macro_rules! impl_webhook_store {
    ($store:ty, $db:ty) => {
        #[async_trait::async_trait]
        impl WebhookStore for $store {
            async fn claim_webhook_deliveries(
                &self,
                owner: &str,
                now_ms: i64,
                claim_until_ms: i64,
                limit: u32,
                max_attempts: u32,
            ) -> StoreResult<WebhookClaim> {
                let mut tx = self.begin_write().await?;
                // The schedule's attempts were all made, the last one cut short (a recorded
                // failure of the last one fails it at once): failed, not attempted again. A
                // claim still set had expired: that attempt is found interrupted here (a
                // released one was counted by the process that released it).
                let exhausted: Vec<(Uuid, bool)> = sqlx::query_as(&format!(
                    "SELECT id, locked_until_ms IS NOT NULL FROM webhook_deliveries \
                     WHERE status = 'pending' AND attempts >= $2 AND next_attempt_ms <= $1 \
                     AND (locked_until_ms IS NULL OR locked_until_ms < $1){}",
                    Self::SKIP_LOCKED
                ))
                .bind(now_ms)
                .bind(i64::from(max_attempts))
                .fetch_all(&mut *tx)
                .await?;
                let mut interrupted = 0;
                for (id, expired) in exhausted {
                    let failed = sqlx::query(
                        "UPDATE webhook_deliveries SET status = 'failed', finished_ms = $2, \
                         locked_by = NULL, locked_until_ms = NULL \
                         WHERE id = $1 AND status = 'pending'",
                    )
                    .bind(id)
                    .bind(now_ms)
                    .execute(&mut *tx)
                    .await?;
                    if expired && failed.rows_affected() == 1 {
                        interrupted += 1;
                    }
                }
                // Rows another replica's transaction holds are skipped, not waited for.
                let candidates: Vec<(Uuid, bool)> = sqlx::query_as(&format!(
                    "SELECT id, locked_until_ms IS NOT NULL FROM webhook_deliveries \
                     WHERE status = 'pending' \
                     AND next_attempt_ms <= $1 AND attempts < $3 \
                     AND (locked_until_ms IS NULL OR locked_until_ms < $1) \
                     ORDER BY next_attempt_ms LIMIT $2{}",
                    Self::SKIP_LOCKED
                ))
                .bind(now_ms)
                .bind(i64::from(limit))
                .bind(i64::from(max_attempts))
                .fetch_all(&mut *tx)
                .await?;
                let mut claimed = Vec::with_capacity(candidates.len());
                for (id, expired) in candidates {
                    // Re-checked under the row lock: a claim another replica won is skipped.
                    // The claim is an attempt: numbered now, so one cut short keeps its number.
                    let row: Option<ClaimRow> = sqlx::query_as(
                        "UPDATE webhook_deliveries SET locked_by = $2, locked_until_ms = $3, \
                         attempts = attempts + 1 \
                         WHERE id = $1 AND status = 'pending' \
                         AND (locked_until_ms IS NULL OR locked_until_ms < $4) \
                         RETURNING id, run_id, url, payload, attempts",
                    )
                    .bind(id)
                    .bind(owner)
                    .bind(claim_until_ms)
                    .bind(now_ms)
                    .fetch_optional(&mut *tx)
                    .await?;
                    if let Some(row) = row {
                        interrupted += u64::from(expired);
                        // Listed as `interrupted` until its end replaces it: a process that
                        // dies in the middle leaves it so.
                        sqlx::query(
                            "INSERT INTO webhook_attempts (delivery_id, attempt, started_ms, \
                             duration_ms, status_code, error, outcome) \
                             VALUES ($1, $2, $3, NULL, NULL, $4, 'interrupted') \
                             ON CONFLICT DO NOTHING",
                        )
                        .bind(row.id)
                        .bind(row.attempts)
                        .bind(now_ms)
                        .bind(INTERRUPTED)
                        .execute(&mut *tx)
                        .await?;
                        claimed.push(ClaimedDelivery {
                            id: row.id,
                            run_id: RunId(row.run_id),
                            url: row.url,
                            payload: row.payload,
                            attempt: u32::try_from(row.attempts).unwrap_or(u32::MAX),
                        });
                    }
                }
                tx.commit().await?;
                Ok(WebhookClaim {
                    deliveries: claimed,
                    interrupted,
                })
            }

            async fn record_webhook_attempt(
                &self,
                delivery_id: Uuid,
                record: &AttemptRecord,
            ) -> StoreResult<()> {
                let attempt = &record.attempt;
                let started_ms = attempt.started_at.timestamp_millis();
                let ended_ms = started_ms.saturating_add(attempt.duration_ms.map_or(0, to_i64));
                let error = attempt.error.as_deref().map(text);
                let status = match attempt.outcome {
                    WebhookAttemptOutcome::Delivered => WebhookDeliveryStatus::Delivered,
                    // The last two are never an attempt's end: the delivery stays pending.
                    WebhookAttemptOutcome::Retry
                    | WebhookAttemptOutcome::InProgress
                    | WebhookAttemptOutcome::Interrupted => WebhookDeliveryStatus::Pending,
                    WebhookAttemptOutcome::Failed => WebhookDeliveryStatus::Failed,
                };
                let finished_ms = (status != WebhookDeliveryStatus::Pending).then_some(ended_ms);
                let duration_ms = attempt.duration_ms.map(to_i64);
                let mut tx = self.begin_write().await?;
                // The attempt's end replaces the `interrupted` row its claim wrote.
                sqlx::query(
                    "INSERT INTO webhook_attempts (delivery_id, attempt, started_ms, duration_ms, \
                     status_code, error, outcome) VALUES ($1, $2, $3, $4, $5, $6, $7) \
                     ON CONFLICT (delivery_id, attempt) DO UPDATE SET \
                     started_ms = excluded.started_ms, duration_ms = excluded.duration_ms, \
                     status_code = excluded.status_code, error = excluded.error, \
                     outcome = excluded.outcome",
                )
                .bind(delivery_id)
                .bind(i64::from(attempt.attempt))
                .bind(started_ms)
                .bind(duration_ms)
                .bind(attempt.status_code.map(i64::from))
                .bind(error.as_deref())
                .bind(attempt.outcome.as_str())
                .execute(&mut *tx)
                .await?;
                // A delivery already delivered (by another process's attempt) stays delivered;
                // an attempt that outlived its claim (another process claimed the next one)
                // changes the delivery only when it delivered it.
                sqlx::query(
                    "UPDATE webhook_deliveries SET status = $3, \
                     next_attempt_ms = COALESCE($4, next_attempt_ms), locked_by = NULL, \
                     locked_until_ms = NULL, last_status_code = $5, last_error = $6, \
                     finished_ms = $7 WHERE id = $1 AND status = 'pending' \
                     AND (attempts = $2 OR $3 = 'delivered')",
                )
                .bind(delivery_id)
                .bind(i64::from(attempt.attempt))
                .bind(status.as_str())
                .bind(record.next_attempt_ms)
                .bind(attempt.status_code.map(i64::from))
                .bind(error.as_deref())
                .bind(finished_ms)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok(())
            }

            async fn release_webhook_claims(&self, owner: &str) -> StoreResult<u64> {
                let released = sqlx::query(
                    "UPDATE webhook_deliveries SET locked_by = NULL, locked_until_ms = NULL \
                     WHERE locked_by = $1 AND status = 'pending'",
                )
                .bind(owner)
                .execute(&self.pool)
                .await?;
                Ok(released.rows_affected())
            }

            async fn webhook_outbox(&self) -> StoreResult<OutboxState> {
                let row: OutboxRow = sqlx::query_as(
                    "SELECT COUNT(*) AS pending, MIN(next_attempt_ms) AS next_due_ms \
                     FROM webhook_deliveries WHERE status = 'pending'",
                )
                .fetch_one(&self.pool)
                .await?;
                Ok(OutboxState {
                    pending: count(row.pending),
                    next_due_ms: row.next_due_ms,
                })
            }

            async fn webhook_deliveries(&self, run_id: RunId) -> StoreResult<Vec<WebhookDelivery>> {
                let rows: Vec<DeliveryRow> = sqlx::query_as(
                    "SELECT id, run_id, event_type, url, status, created_ms, next_attempt_ms, \
                     finished_ms, attempts, locked_until_ms FROM webhook_deliveries \
                     WHERE run_id = $1 ORDER BY id",
                )
                .bind(run_id.0)
                .fetch_all(&self.pool)
                .await?;
                if rows.is_empty() {
                    return Ok(Vec::new());
                }
                let attempts: Vec<AttemptRow> = sqlx::query_as(
                    "SELECT a.delivery_id, a.attempt, a.started_ms, a.duration_ms, a.status_code, \
                     a.error, a.outcome FROM webhook_attempts a JOIN webhook_deliveries d \
                     ON d.id = a.delivery_id WHERE d.run_id = $1 ORDER BY a.delivery_id, a.attempt",
                )
                .bind(run_id.0)
                .fetch_all(&self.pool)
                .await?;
                deliveries(rows, attempts, Utc::now().timestamp_millis())
            }
        }

        impl $store {
            /// Writes the delivery `due` of `run_id` in the transaction of the event that
            /// causes it; its payload holds the run record as the transaction leaves it.
            pub(super) async fn insert_webhook_delivery(
                connection: &mut <$db as sqlx::Database>::Connection,
                run_id: RunId,
                due: &WebhookDue,
            ) -> StoreResult<()> {
                let row: RunRow =
                    sqlx::query_as(&format!("SELECT {RUN_COLUMNS} FROM runs WHERE id = $1"))
                        .bind(run_id.0)
                        .fetch_one(&mut *connection)
                        .await?;
                let run: RunRecord = row.try_into()?;
                let body = payload(due, &run)?;
                sqlx::query(
                    "INSERT INTO webhook_deliveries (id, run_id, event_type, url, payload, \
                     status, attempts, created_ms, next_attempt_ms) \
                     VALUES ($1, $2, $3, $4, $5, 'pending', 0, $6, $6)",
                )
                .bind(due.id)
                .bind(run_id.0)
                .bind(due.event_type.as_str())
                .bind(&*due.url)
                .bind(body)
                .bind(due.due_ms)
                .execute(&mut *connection)
                .await?;
                Ok(())
            }
        }
    };
}

impl_webhook_store!(SqliteStore, sqlx::Sqlite);
impl_webhook_store!(PostgresStore, sqlx::Postgres);
