//! Retention: the events, snapshots, answers and finished webhook deliveries of runs that ended
//! long ago, removed in batches.

use crate::store::{PostgresStore, RetentionStore, SqliteStore, StoreResult};

/// Implements [`RetentionStore`] for a backend struct (see `sql/mod.rs`).
macro_rules! impl_retention_store {
    ($store:ty, $db:ty) => {
        #[async_trait::async_trait]
        impl RetentionStore for $store {
            async fn remove_expired_events(
                &self,
                ended_before: chrono::DateTime<chrono::Utc>,
                limit: u32,
            ) -> StoreResult<u32> {
                let mut tx = self.begin_write().await?;
                let runs: Vec<uuid::Uuid> = sqlx::query_scalar(
                    "SELECT id FROM runs WHERE status IN ('completed', 'failed', 'cancelled') \
                     AND events_removed_at IS NULL AND updated_at < $1 ORDER BY updated_at LIMIT $2",
                )
                .bind(ended_before)
                .bind(i64::from(limit))
                .fetch_all(&mut *tx)
                .await?;
                if runs.is_empty() {
                    return Ok(0);
                }
                let now = chrono::Utc::now();
                for statement in [
                    "DELETE FROM events WHERE run_id IN (",
                    "DELETE FROM snapshots WHERE run_id IN (",
                    "DELETE FROM action_answers WHERE run_id IN (",
                    // Finished webhook deliveries (their attempts go with them); a pending one
                    // stays until it is delivered or fails.
                    "DELETE FROM webhook_deliveries WHERE status <> 'pending' AND run_id IN (",
                    "UPDATE runs SET events_removed_at = ",
                ] {
                    let mut query = sqlx::QueryBuilder::<$db>::new(statement);
                    if statement.starts_with("UPDATE") {
                        query.push_bind(now).push(" WHERE id IN (");
                    }
                    let mut list = query.separated(", ");
                    for run in &runs {
                        list.push_bind(*run);
                    }
                    query.push(")");
                    query.build().execute(&mut *tx).await?;
                }
                tx.commit().await?;
                Ok(u32::try_from(runs.len()).unwrap_or(u32::MAX))
            }
        }
    };
}

impl_retention_store!(SqliteStore, sqlx::Sqlite);
impl_retention_store!(PostgresStore, sqlx::Postgres);
