//! `[database]`: the store's connection pool and, on PostgreSQL, each connection's time limits,
//! which bound how long a replica frozen or cut off inside a transaction holds its locks.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::store::ConnectOptions;

/// `[database]` (every field optional; `0` turns a PostgreSQL limit off).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// Connections in the pool at most (1 to 1000); default 16 on PostgreSQL, 8 on SQLite.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u32>,
    /// A pooled connection idle this long is closed, in ms; default 600000; 0: never.
    pub idle_timeout_ms: u64,
    /// PostgreSQL `statement_timeout` of every pooled connection, in ms; default 30000.
    pub statement_timeout_ms: u64,
    /// PostgreSQL `lock_timeout`, in ms; default 5000.
    pub lock_timeout_ms: u64,
    /// PostgreSQL `idle_in_transaction_session_timeout`, in ms; default 10000: a replica
    /// frozen inside a transaction loses it (and its locks) after this long.
    pub idle_in_transaction_timeout_ms: u64,
    /// PostgreSQL `tcp_keepalives_idle` (the server's probes of a silent connection), in ms,
    /// rounded down to seconds; default 30000.
    pub tcp_keepalive_idle_ms: u64,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        let defaults = ConnectOptions::default();
        let ms = |duration: Duration| u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
        Self {
            max_connections: defaults.max_connections,
            idle_timeout_ms: defaults.idle_timeout.map_or(0, ms),
            statement_timeout_ms: ms(defaults.statement_timeout),
            lock_timeout_ms: ms(defaults.lock_timeout),
            idle_in_transaction_timeout_ms: ms(defaults.idle_in_transaction_timeout),
            tcp_keepalive_idle_ms: ms(defaults.tcp_keepalive_idle),
        }
    }
}

impl DatabaseConfig {
    /// What the store connects with.
    #[must_use]
    pub fn connect_options(&self) -> ConnectOptions {
        ConnectOptions {
            max_connections: self.max_connections,
            idle_timeout: (self.idle_timeout_ms > 0)
                .then(|| Duration::from_millis(self.idle_timeout_ms)),
            statement_timeout: Duration::from_millis(self.statement_timeout_ms),
            lock_timeout: Duration::from_millis(self.lock_timeout_ms),
            idle_in_transaction_timeout: Duration::from_millis(self.idle_in_transaction_timeout_ms),
            tcp_keepalive_idle: Duration::from_millis(self.tcp_keepalive_idle_ms),
        }
    }

    /// The range checks, as `(holds, message)`.
    pub(super) fn checks(&self) -> [(bool, &'static str); 2] {
        [
            (
                self.max_connections.is_none_or(|n| (1..=1000).contains(&n)),
                "database.max_connections must be from 1 to 1000",
            ),
            (
                [
                    self.statement_timeout_ms,
                    self.lock_timeout_ms,
                    self.idle_in_transaction_timeout_ms,
                    self.tcp_keepalive_idle_ms,
                ]
                .iter()
                .all(|ms| *ms <= i32::MAX as u64),
                "database time limits must be at most 2147483647 ms",
            ),
        ]
    }
}
