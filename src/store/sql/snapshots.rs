//! Snapshots: a run's state at its last iteration boundary (written with the event log), read,
//! listed and deleted.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{corrupt, count, error_class, to_i64};
use crate::domain::{RunId, RunStatus, SessionId, Snapshot, TokenUsage};
use crate::store::{
    EventWrite, PostgresStore, SnapshotFilter, SnapshotStore, SnapshotWrite, SqliteStore,
    StoreError, StoreResult,
};

pub(super) const SNAPSHOT_COLUMNS: &str = "run_id, session_id, status, iteration, input_tokens, \
     output_tokens, total_tokens, reasoning_tokens, usage_estimated, tool_calls, last_sequence, \
     created_at";

/// What a snapshot read selects: the columns written at each boundary, and the run's error
/// class written with its terminal event.
pub(super) const SNAPSHOT_READ_COLUMNS: &str = "run_id, session_id, status, iteration, \
     input_tokens, output_tokens, total_tokens, reasoning_tokens, usage_estimated, tool_calls, \
     last_sequence, created_at, error_class";

#[derive(sqlx::FromRow)]
pub(super) struct SnapshotRow {
    run_id: Uuid,
    session_id: Uuid,
    status: String,
    iteration: i64,
    input_tokens: i64,
    output_tokens: i64,
    total_tokens: i64,
    reasoning_tokens: i64,
    usage_estimated: bool,
    tool_calls: i64,
    last_sequence: i64,
    created_at: DateTime<Utc>,
    error_class: Option<String>,
}

impl TryFrom<SnapshotRow> for Snapshot {
    type Error = StoreError;

    fn try_from(row: SnapshotRow) -> StoreResult<Self> {
        Ok(Self {
            run_id: RunId(row.run_id),
            session_id: SessionId(row.session_id),
            status: RunStatus::parse(&row.status).ok_or_else(|| corrupt("status", &row.status))?,
            iteration: u32::try_from(row.iteration).unwrap_or(u32::MAX),
            total_usage: TokenUsage {
                input_tokens: count(row.input_tokens),
                output_tokens: count(row.output_tokens),
                total_tokens: count(row.total_tokens),
                reasoning_tokens: count(row.reasoning_tokens),
                estimated: row.usage_estimated,
            },
            tool_calls: u32::try_from(row.tool_calls).unwrap_or(u32::MAX),
            last_sequence: count(row.last_sequence),
            timestamp: row.created_at,
            error_class: row.error_class.map(|c| error_class(&c)).transpose()?,
        })
    }
}

pub(super) fn snapshots(rows: Vec<SnapshotRow>) -> StoreResult<Vec<Snapshot>> {
    rows.into_iter().map(TryInto::try_into).collect()
}

/// Implements [`SnapshotStore`] for a backend struct (see `sql/mod.rs`).
macro_rules! impl_snapshot_store {
    ($store:ty, $db:ty) => {
        #[async_trait::async_trait]
        impl SnapshotStore for $store {
            async fn get_snapshot(&self, run_id: RunId) -> StoreResult<Option<Snapshot>> {
                let row: Option<SnapshotRow> = sqlx::query_as(&format!(
                    "SELECT {SNAPSHOT_READ_COLUMNS} FROM snapshots WHERE run_id = $1"
                ))
                .bind(run_id.0)
                .fetch_optional(&self.pool)
                .await?;
                row.map(TryInto::try_into).transpose()
            }

            async fn list_snapshots(&self, filter: &SnapshotFilter) -> StoreResult<Vec<Snapshot>> {
                let mut query = sqlx::QueryBuilder::<$db>::new(format!(
                    "SELECT {SNAPSHOT_READ_COLUMNS} FROM snapshots WHERE 1 = 1"
                ));
                if let Some(session_id) = filter.session_id {
                    query.push(" AND session_id = ").push_bind(session_id.0);
                }
                if let Some(status) = filter.status {
                    query.push(" AND status = ").push_bind(status.as_str());
                }
                if let Some(before) = filter.before {
                    query.push(" AND run_id < ").push_bind(before.0);
                }
                query
                    .push(" ORDER BY run_id DESC LIMIT ")
                    .push_bind(i64::from(filter.limit));
                let rows: Vec<SnapshotRow> = query.build_query_as().fetch_all(&self.pool).await?;
                snapshots(rows)
            }

            async fn delete_snapshot(&self, run_id: RunId) -> StoreResult<bool> {
                let mut tx = self.begin_write().await?;
                let status: Option<String> =
                    sqlx::query_scalar("SELECT status FROM runs WHERE id = $1")
                        .bind(run_id.0)
                        .fetch_optional(&mut *tx)
                        .await?;
                let terminal = status
                    .as_deref()
                    .and_then(RunStatus::parse)
                    .is_none_or(|status| status.is_terminal());
                if !terminal {
                    return Err(StoreError::RunActive(run_id));
                }
                let deleted = sqlx::query("DELETE FROM snapshots WHERE run_id = $1")
                    .bind(run_id.0)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(deleted.rows_affected() > 0)
            }
        }

        impl $store {
            /// Writes the run's snapshot at an iteration boundary (one row per run).
            pub(super) async fn upsert_snapshot(
                connection: &mut <$db as sqlx::Database>::Connection,
                write: &EventWrite,
                snapshot: &SnapshotWrite,
            ) -> StoreResult<()> {
                let usage = snapshot.total_usage;
                sqlx::query(&format!(
                    "INSERT INTO snapshots ({SNAPSHOT_COLUMNS}) \
                     VALUES ($1, $2, 'calling_model', $3, $4, $5, $6, $7, $8, $9, $10, $11) \
                     ON CONFLICT (run_id) DO UPDATE SET status = excluded.status, \
                     iteration = excluded.iteration, input_tokens = excluded.input_tokens, \
                     output_tokens = excluded.output_tokens, total_tokens = excluded.total_tokens, \
                     reasoning_tokens = excluded.reasoning_tokens, \
                     usage_estimated = excluded.usage_estimated, tool_calls = excluded.tool_calls, \
                     last_sequence = excluded.last_sequence, created_at = excluded.created_at"
                ))
                .bind(write.run_id.0)
                .bind(snapshot.session_id.0)
                .bind(i64::from(snapshot.iteration))
                .bind(to_i64(usage.input_tokens))
                .bind(to_i64(usage.output_tokens))
                .bind(to_i64(usage.total_tokens))
                .bind(to_i64(usage.reasoning_tokens))
                .bind(usage.estimated)
                .bind(i64::from(snapshot.tool_calls))
                .bind(to_i64(write.event.sequence))
                .bind(chrono::Utc::now())
                .execute(connection)
                .await?;
                Ok(())
            }
        }
    };
}

impl_snapshot_store!(SqliteStore, sqlx::Sqlite);
impl_snapshot_store!(PostgresStore, sqlx::Postgres);
