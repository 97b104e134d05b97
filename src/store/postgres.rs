//! PostgreSQL backend, for deployments that outgrow one machine.

use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres, Transaction};

use super::StoreResult;

/// A pooled connection idle for longer than this is pinged before it is used again (the
/// server may have closed it meanwhile).
const IDLE_CHECK_AFTER: std::time::Duration = std::time::Duration::from_secs(5);

/// The PostgreSQL store.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pub(super) pool: PgPool,
}

impl PostgresStore {
    /// Several replicas may share the database.
    pub(super) const SINGLE_PROCESS: bool = false;
    /// Rows read for a check that must hold until the commit (fencing) are share-locked.
    pub(super) const ROW_LOCK: &str = " FOR SHARE";
    /// A row read to be updated in the same transaction is locked for it.
    pub(super) const ROW_LOCK_UPDATE: &str = " FOR UPDATE";
    /// A row whose non-key columns the transaction updates later: locked for that update at
    /// once (two transactions that share-locked it first would deadlock upgrading), without
    /// blocking inserts elsewhere that reference it by foreign key.
    pub(super) const ROW_LOCK_NO_KEY_UPDATE: &str = " FOR NO KEY UPDATE";

    /// Connects to a `postgres://` URL and migrates the database.
    ///
    /// # Errors
    /// When the server is unreachable or a migration fails.
    pub async fn connect(url: &str) -> StoreResult<Self> {
        let options = PgConnectOptions::from_str(url)?;
        // A connection is checked (a round trip) only after it sat idle: checking before
        // every query, sqlx's default, doubles the round trips of a busy pool.
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .test_before_acquire(false)
            .before_acquire(|connection, meta| {
                Box::pin(async move {
                    if meta.idle_for > IDLE_CHECK_AFTER {
                        sqlx::Connection::ping(connection).await?;
                    }
                    Ok(true)
                })
            })
            .connect_with(options)
            .await?;
        super::migrate(
            &sqlx::migrate!("./migrations/postgres"),
            &mut *pool.acquire().await?,
        )
        .await?;
        Ok(Self { pool })
    }

    pub(super) async fn begin_write(&self) -> StoreResult<Transaction<'static, Postgres>> {
        Ok(self.pool.begin().await?)
    }
}
