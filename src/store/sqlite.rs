//! SQLite backend: one file, WAL, `busy_timeout`, `synchronous=NORMAL`, foreign keys on;
//! write transactions start with `BEGIN IMMEDIATE` so concurrent writers queue instead of
//! failing on lock upgrade, and this process queues its own writers in order before they ask
//! SQLite (whose busy handler polls with sleeps of 1, 2, 5, … 100 ms).

use std::ops::{Deref, DerefMut};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Sqlite, SqliteConnection, SqlitePool, Transaction};
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::StoreResult;

/// The SQLite store.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pub(super) pool: SqlitePool,
    /// Held by this process's write transaction: SQLite has one writer at a time.
    writer: Arc<Mutex<()>>,
}

/// A write transaction, the only one of this process while it lives: its connection, for
/// queries (`&mut *tx`), and [`WriteTx::commit`].
pub(super) struct WriteTx {
    tx: Transaction<'static, Sqlite>,
    _turn: OwnedMutexGuard<()>,
}

impl WriteTx {
    /// Commits (the next writer starts after).
    pub(super) async fn commit(self) -> Result<(), sqlx::Error> {
        self.tx.commit().await
    }
}

impl Deref for WriteTx {
    type Target = SqliteConnection;
    fn deref(&self) -> &SqliteConnection {
        &self.tx
    }
}

impl DerefMut for WriteTx {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        &mut self.tx
    }
}

impl SqliteStore {
    /// One process per database file (DESIGN.md: "SQLite is one process").
    pub(super) const SINGLE_PROCESS: bool = true;
    /// No row locks: a write transaction (`BEGIN IMMEDIATE`) excludes every other writer.
    pub(super) const ROW_LOCK: &str = "";
    /// No row locks: the write transaction holds every row it reads.
    pub(super) const ROW_LOCK_UPDATE: &str = "";
    /// No row locks (see `ROW_LOCK_UPDATE`).
    pub(super) const ROW_LOCK_NO_KEY_UPDATE: &str = "";
    /// No row locks (see `ROW_LOCK_UPDATE`).
    pub(super) const SKIP_LOCKED: &str = "";

    /// Opens (creating when missing) the database at a `sqlite://PATH` URL and migrates it.
    ///
    /// # Errors
    /// When the file cannot be opened or a migration fails.
    pub async fn connect(url: &str) -> StoreResult<Self> {
        Self::connect_with(url, &super::ConnectOptions::default()).await
    }

    /// [`Self::connect`] with the pool's size and idle timeout from `pool` (PostgreSQL's time
    /// limits do not apply: one process, and `busy_timeout` bounds a wait for the writer).
    ///
    /// # Errors
    /// When the file cannot be opened or a migration fails.
    pub async fn connect_with(url: &str, pool: &super::ConnectOptions) -> StoreResult<Self> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true);
        // A connection to a file in this process does not break while idle: no ping before
        // each use (sqlx's default, a round trip to the connection's thread).
        let pool = SqlitePoolOptions::new()
            .max_connections(pool.max_connections.unwrap_or(8))
            .idle_timeout(pool.idle_timeout)
            .test_before_acquire(false)
            .connect_with(options)
            .await?;
        super::migrate(
            &sqlx::migrate!("./migrations/sqlite"),
            &mut *pool.acquire().await?,
        )
        .await?;
        Ok(Self {
            pool,
            writer: Arc::new(Mutex::new(())),
        })
    }

    /// No other process to wake.
    #[expect(clippy::unused_async, reason = "the same call as PostgreSQL's")]
    pub(super) async fn signal_in(
        _tx: &mut WriteTx,
        _signals: impl IntoIterator<Item = super::Signal> + Send,
    ) -> StoreResult<()> {
        Ok(())
    }

    /// No other process to listen to.
    #[expect(clippy::unused_async, reason = "the same call as PostgreSQL's")]
    pub(super) async fn signal_listener(&self) -> StoreResult<Option<super::SignalListener>> {
        Ok(None)
    }

    /// Waits for this process's previous writer (in order), then begins.
    pub(super) async fn begin_write(&self) -> StoreResult<WriteTx> {
        let turn = self.writer.clone().lock_owned().await;
        Ok(WriteTx {
            tx: self.pool.begin_with("BEGIN IMMEDIATE").await?,
            _turn: turn,
        })
    }
}
