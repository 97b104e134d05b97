//! SQLite backend: one file, WAL, `busy_timeout`, `synchronous=NORMAL`, foreign keys on;
//! write transactions start with `BEGIN IMMEDIATE` so concurrent writers queue instead of
//! failing on lock upgrade.

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Sqlite, SqlitePool, Transaction};

use super::StoreResult;
use super::sql::{impl_explain_conflict, impl_store};

/// The SQLite store.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
}

impl SqliteStore {
    /// One process per database file (DESIGN.md: "SQLite is one process").
    const SINGLE_PROCESS: bool = true;
    /// No row locks: a write transaction (`BEGIN IMMEDIATE`) excludes every other writer.
    const ROW_LOCK: &str = "";
    /// No row locks: the write transaction holds every row it reads.
    const ROW_LOCK_UPDATE: &str = "";

    /// Opens (creating when missing) the database at a `sqlite://PATH` URL and migrates it.
    ///
    /// # Errors
    /// When the file cannot be opened or a migration fails.
    pub async fn connect(url: &str) -> StoreResult<Self> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await?;
        super::migrate(
            &sqlx::migrate!("./migrations/sqlite"),
            &mut *pool.acquire().await?,
        )
        .await?;
        Ok(Self { pool })
    }

    async fn begin_write(&self) -> StoreResult<Transaction<'static, Sqlite>> {
        Ok(self.pool.begin_with("BEGIN IMMEDIATE").await?)
    }
}

impl_explain_conflict!(SqliteStore, Sqlite);
impl_store!(SqliteStore, Sqlite);
