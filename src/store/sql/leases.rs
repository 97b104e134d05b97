//! Leases: which process owns an active run, takeovers of expired leases, renewal and release,
//! and cancels requested for the owner.

use super::runs::{RUN_COLUMNS, RunRow};
use crate::domain::RunId;
use crate::store::{
    ClaimedRun, Lease, LeaseRenewal, LeaseStore, PostgresStore, Signal, SignalListener,
    SqliteStore, StoreResult,
};

/// A claimed run with the cancel requested while nobody owned it.
#[derive(sqlx::FromRow)]
pub(super) struct ClaimRow {
    #[sqlx(flatten)]
    pub(super) run: RunRow,
    pub(super) cancel_requested: bool,
    pub(super) takeovers: i64,
}

/// The SET clause of a claim that counts a takeover: a run whose previous owner did not release
/// it (it died) counts one more; a released run (a shutdown: `release_leases` sets its expiry to
/// 0) or one waiting for its client is not counted. A message committed by the run (its next
/// boundary) sets the count back to 0 (`sql/events.rs`).
const COUNT_TAKEOVER: &str = "takeovers = CASE \
     WHEN lease_owner IS NULL OR lease_expires_ms = 0 OR status = 'requires_action' \
     THEN takeovers ELSE takeovers + 1 END";

/// Implements [`LeaseStore`] for a backend struct (see `sql/mod.rs`).
macro_rules! impl_lease_store {
    ($store:ty, $db:ty) => {
        #[async_trait::async_trait]
        impl LeaseStore for $store {
            fn single_process(&self) -> bool {
                Self::SINGLE_PROCESS
            }

            async fn claim_runs(
                &self,
                lease: &Lease,
                now_ms: i64,
                all: bool,
                limit: u32,
            ) -> StoreResult<Vec<ClaimedRun>> {
                let mut tx = self.begin_write().await?;
                // Rows another transaction holds (a replica frozen mid-write) are skipped, not
                // waited for: the next scan sees them once that transaction ended.
                let candidates: Vec<uuid::Uuid> = sqlx::query_scalar(&format!(
                    "SELECT id FROM runs WHERE status NOT IN ('completed', 'failed', 'cancelled') \
                     AND (lease_owner IS NULL OR lease_owner <> $1) \
                     AND ($2 OR lease_owner IS NULL OR lease_expires_ms IS NULL OR lease_expires_ms < $3) \
                     ORDER BY id LIMIT $4{}",
                    Self::SKIP_LOCKED
                ))
                .bind(&lease.owner)
                .bind(all)
                .bind(now_ms)
                .bind(i64::from(limit))
                .fetch_all(&mut *tx)
                .await?;
                let mut claimed = Vec::with_capacity(candidates.len());
                for id in candidates {
                    // Re-checked under the row lock: a concurrent claimer that won is skipped.
                    let row: Option<ClaimRow> = sqlx::query_as(&format!(
                        "UPDATE runs SET lease_owner = $2, lease_expires_ms = $3, {COUNT_TAKEOVER} \
                         WHERE id = $1 AND status NOT IN ('completed', 'failed', 'cancelled') \
                         AND (lease_owner IS NULL OR lease_owner <> $2) \
                         AND ($4 OR lease_owner IS NULL OR lease_expires_ms IS NULL OR lease_expires_ms < $5) \
                         RETURNING {RUN_COLUMNS}, cancel_requested, takeovers"
                    ))
                    .bind(id)
                    .bind(&lease.owner)
                    .bind(lease.expires_ms)
                    .bind(all)
                    .bind(now_ms)
                    .fetch_optional(&mut *tx)
                    .await?;
                    if let Some(row) = row {
                        claimed.push(ClaimedRun {
                            record: row.run.try_into()?,
                            cancel_requested: row.cancel_requested,
                            takeovers: u32::try_from(row.takeovers).unwrap_or(u32::MAX),
                        });
                    }
                }
                tx.commit().await?;
                Ok(claimed)
            }

            async fn claim_run(
                &self,
                run_id: RunId,
                lease: &Lease,
                now_ms: i64,
            ) -> StoreResult<Option<ClaimedRun>> {
                let row: Option<ClaimRow> = sqlx::query_as(&format!(
                    "UPDATE runs SET lease_owner = $2, lease_expires_ms = $3, {COUNT_TAKEOVER} \
                     WHERE id = $1 AND status NOT IN ('completed', 'failed', 'cancelled') \
                     AND (lease_owner IS NULL OR lease_owner = $2 OR lease_expires_ms IS NULL \
                     OR lease_expires_ms < $4) \
                     RETURNING {RUN_COLUMNS}, cancel_requested, takeovers"
                ))
                .bind(run_id.0)
                .bind(&lease.owner)
                .bind(lease.expires_ms)
                .bind(now_ms)
                .fetch_optional(&self.pool)
                .await?;
                row.map(|row| {
                    Ok(ClaimedRun {
                        record: row.run.try_into()?,
                        cancel_requested: row.cancel_requested,
                        takeovers: u32::try_from(row.takeovers).unwrap_or(u32::MAX),
                    })
                })
                .transpose()
            }

            async fn renew_leases(
                &self,
                owner: &str,
                expires_ms: i64,
            ) -> StoreResult<LeaseRenewal> {
                let rows: Vec<(uuid::Uuid, bool)> = sqlx::query_as(
                    "UPDATE runs SET lease_expires_ms = $2 WHERE lease_owner = $1 \
                     AND status NOT IN ('completed', 'failed', 'cancelled') \
                     RETURNING id, cancel_requested",
                )
                .bind(owner)
                .bind(expires_ms)
                .fetch_all(&self.pool)
                .await?;
                let mut renewal = LeaseRenewal::default();
                for (id, cancel_requested) in rows {
                    let id = RunId(id);
                    renewal.owned.push(id);
                    if cancel_requested {
                        renewal.cancel_requested.push(id);
                    }
                }
                Ok(renewal)
            }

            async fn database_now_ms(&self) -> StoreResult<Option<i64>> {
                if Self::SINGLE_PROCESS {
                    return Ok(None);
                }
                let now: i64 = sqlx::query_scalar(
                    "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
                )
                .fetch_one(&self.pool)
                .await?;
                Ok(Some(now))
            }

            async fn send_signal(&self, signal: Signal) -> StoreResult<()> {
                if Self::SINGLE_PROCESS {
                    return Ok(());
                }
                sqlx::query("SELECT pg_notify($1, $2)")
                    .bind(Signal::CHANNEL)
                    .bind(signal.payload())
                    .execute(&self.pool)
                    .await?;
                Ok(())
            }

            async fn listen(&self) -> StoreResult<Option<SignalListener>> {
                self.signal_listener().await
            }

            async fn release_leases(&self, owner: &str) -> StoreResult<()> {
                sqlx::query(
                    "UPDATE runs SET lease_expires_ms = 0 WHERE lease_owner = $1 \
                     AND status NOT IN ('completed', 'failed', 'cancelled')",
                )
                .bind(owner)
                .execute(&self.pool)
                .await?;
                Ok(())
            }

            async fn request_cancel(&self, run_id: RunId) -> StoreResult<bool> {
                let updated = sqlx::query(
                    "UPDATE runs SET cancel_requested = TRUE WHERE id = $1 \
                     AND status NOT IN ('completed', 'failed', 'cancelled')",
                )
                .bind(run_id.0)
                .execute(&self.pool)
                .await?;
                Ok(updated.rows_affected() > 0)
            }
        }
    };
}

impl_lease_store!(SqliteStore, sqlx::Sqlite);
impl_lease_store!(PostgresStore, sqlx::Postgres);
