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
    /// This process's name among the replicas on one database: the first part of its lease
    /// owner id (`{replica_id}/{UUID v7}`, new at each start, so a restarted process never
    /// counts as its previous self), in its startup log line, and its PostgreSQL connections'
    /// `application_name` (unless the database URL sets one). 1 to 63 characters of
    /// `A-Z a-z 0-9 . _ -`; default `{hostname}-{pid}`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica_id: Option<String>,
    /// PostgreSQL `tcp_keepalives_idle` (the server's probes of a silent connection), in ms,
    /// rounded down to seconds; default 30000.
    pub tcp_keepalive_idle_ms: u64,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        let defaults = ConnectOptions::default();
        let ms = |duration: Duration| u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
        Self {
            replica_id: None,
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
            application_name: Some(self.replica_id()),
            max_connections: self.max_connections,
            idle_timeout: (self.idle_timeout_ms > 0)
                .then(|| Duration::from_millis(self.idle_timeout_ms)),
            statement_timeout: Duration::from_millis(self.statement_timeout_ms),
            lock_timeout: Duration::from_millis(self.lock_timeout_ms),
            idle_in_transaction_timeout: Duration::from_millis(self.idle_in_transaction_timeout_ms),
            tcp_keepalive_idle: Duration::from_millis(self.tcp_keepalive_idle_ms),
        }
    }

    /// The configured replica id, else `{hostname}-{pid}` (the host name cut to what fits,
    /// characters outside `A-Z a-z 0-9 . _ -` replaced by `-`; `behest` when unknown).
    #[must_use]
    pub fn replica_id(&self) -> String {
        if let Some(id) = &self.replica_id {
            return id.clone();
        }
        let host: String = whoami::fallible::hostname()
            .unwrap_or_else(|_| "behest".to_owned())
            .chars()
            .map(|c| if is_id_char(c) { c } else { '-' })
            .take(48)
            .collect();
        format!("{host}-{}", std::process::id())
    }

    /// The range checks, as `(holds, message)`.
    pub(super) fn checks(&self) -> [(bool, &'static str); 3] {
        [
            (
                self.replica_id
                    .as_deref()
                    .is_none_or(|id| (1..=63).contains(&id.len()) && id.chars().all(is_id_char)),
                "database.replica_id must be 1 to 63 characters of A-Z a-z 0-9 . _ -",
            ),
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

/// A character a replica id may hold.
fn is_id_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}
