//! PostgreSQL backend, for deployments that outgrow one machine.

use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool, Postgres, Transaction};

use super::{ConnectOptions, Signal, StoreError, StoreResult};

/// How long the listener's probe waits for its own notification.
const PROBE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

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
    /// Rows a scan claims are locked for the update, skipping rows another transaction holds
    /// (a claim never waits on another replica's locks).
    pub(super) const SKIP_LOCKED: &str = " FOR UPDATE SKIP LOCKED";

    /// Connects to a `postgres://` URL and migrates the database, with the default
    /// [`ConnectOptions`].
    ///
    /// # Errors
    /// When the server is unreachable or a migration fails.
    pub async fn connect(url: &str) -> StoreResult<Self> {
        Self::connect_with(url, &ConnectOptions::default()).await
    }

    /// Connects to a `postgres://` URL and migrates the database. Every pooled connection gets
    /// the options' `statement_timeout`, `lock_timeout`, `idle_in_transaction_session_timeout`
    /// and server-side TCP keepalives (one `SET` round trip when it opens), so a replica frozen
    /// or cut off inside a transaction holds its locks for a bounded time. Migrations run on a
    /// connection of their own without these limits (a migration may rewrite a large table).
    ///
    /// # Errors
    /// When the server is unreachable or a migration fails.
    pub async fn connect_with(url: &str, options: &ConnectOptions) -> StoreResult<Self> {
        let mut connect = PgConnectOptions::from_str(url)?;
        if let Some(name) = &options.application_name
            && connect.get_application_name().is_none()
        {
            connect = connect.application_name(name);
        }
        {
            let mut migrating = PgConnection::connect_with(&connect).await?;
            super::migrate(&sqlx::migrate!("./migrations/postgres"), &mut migrating).await?;
            migrating.close().await?;
        }
        // One string per pool, for the pool's life (the hook's future must not borrow it).
        let limits: &'static str = Box::leak(session_limits(options).into_boxed_str());
        // A connection is checked (a round trip) only after it sat idle: checking before
        // every query, sqlx's default, doubles the round trips of a busy pool.
        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections.unwrap_or(16))
            .idle_timeout(options.idle_timeout)
            .test_before_acquire(false)
            .after_connect(move |connection, _| {
                Box::pin(async move {
                    sqlx::Executor::execute(connection, limits).await?;
                    Ok(())
                })
            })
            .before_acquire(|connection, meta| {
                Box::pin(async move {
                    if meta.idle_for > IDLE_CHECK_AFTER {
                        sqlx::Connection::ping(connection).await?;
                    }
                    Ok(true)
                })
            })
            .connect_with(connect)
            .await?;
        Ok(Self { pool })
    }

    /// The connection pool (for tools and tests that inspect its connections).
    #[must_use]
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Notifies every listening replica of `signals` when `tx` commits (nothing when it rolls
    /// back).
    pub(super) async fn signal_in(
        tx: &mut Transaction<'static, Postgres>,
        signals: impl IntoIterator<Item = Signal> + Send,
    ) -> StoreResult<()> {
        let payloads: Vec<String> = signals.into_iter().map(Signal::payload).collect();
        if payloads.is_empty() {
            return Ok(());
        }
        let mut notify = sqlx::QueryBuilder::<Postgres>::new("SELECT pg_notify(");
        notify.push_bind(Signal::CHANNEL).push(", payload) FROM (");
        notify.push_values(&payloads, |mut row, payload| {
            row.push_bind(payload.as_str());
        });
        notify.push(") AS signals (payload)");
        notify.build().execute(&mut **tx).await?;
        Ok(())
    }

    /// A listener on its own connection, checked by a probe (see
    /// [`LeaseStore::listen`](super::LeaseStore::listen)).
    pub(super) async fn signal_listener(&self) -> StoreResult<Option<SignalListener>> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.ignore_pool_close_event(true);
        listener.listen(Signal::CHANNEL).await?;
        let probe = format!("probe {}", uuid::Uuid::now_v7());
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(Signal::CHANNEL)
            .bind(&probe)
            .execute(&self.pool)
            .await?;
        let arrived = tokio::time::timeout(PROBE_WAIT, async {
            loop {
                match listener.recv().await {
                    Ok(notification) if notification.payload() == probe => return Ok(()),
                    Ok(_) => {}
                    Err(error) => return Err(error),
                }
            }
        })
        .await;
        match arrived {
            Ok(Ok(())) => Ok(Some(SignalListener { listener })),
            Ok(Err(error)) => Err(error.into()),
            Err(_) => Err(StoreError::SignalsUnavailable(format!(
                "a notification sent through the database did not arrive on a listening \
                 connection within {} s: replicas need PostgreSQL LISTEN/NOTIFY (connect to \
                 the server directly or through a session-mode pooler, not a \
                 transaction-mode one)",
                PROBE_WAIT.as_secs()
            ))),
        }
    }

    pub(super) async fn begin_write(&self) -> StoreResult<Transaction<'static, Postgres>> {
        Ok(self.pool.begin().await?)
    }
}

/// The `SET` statements giving a pooled connection the options' limits (ms; `0` turns one off,
/// as in PostgreSQL).
fn session_limits(options: &ConnectOptions) -> String {
    let ms = |duration: std::time::Duration| duration.as_millis();
    format!(
        "SET statement_timeout = {}; SET lock_timeout = {}; \
         SET idle_in_transaction_session_timeout = {}; SET tcp_keepalives_idle = {}; \
         SET tcp_keepalives_interval = 10; SET tcp_keepalives_count = 3",
        ms(options.statement_timeout),
        ms(options.lock_timeout),
        ms(options.idle_in_transaction_timeout),
        options.tcp_keepalive_idle.as_secs().max(1),
    )
}

/// This process's listener for other replicas' [`Signal`]s: one connection, `LISTEN behest`.
#[derive(Debug)]
pub struct SignalListener {
    listener: PgListener,
}

impl SignalListener {
    /// The next signal; `Ok(None)` when the connection was lost and opened again, so signals
    /// may have been missed meanwhile (a watcher then reads the store).
    ///
    /// # Errors
    /// When the connection cannot be opened again (the caller waits and retries).
    pub async fn recv(&mut self) -> StoreResult<Option<Signal>> {
        loop {
            match self.listener.try_recv().await? {
                None => return Ok(None),
                Some(notification) => {
                    if let Some(signal) = Signal::parse(notification.payload()) {
                        return Ok(Some(signal));
                    }
                }
            }
        }
    }
}
