//! SQL shared by both backends, one file per concern: each holds its row types, its queries and
//! a macro that implements its trait ([`RunStore`](super::RunStore), …) for a backend, invoked at
//! the file's end for [`SqliteStore`](super::SqliteStore) and
//! [`PostgresStore`](super::PostgresStore) (the queries are the same text; sqlx's types differ).
//! What differs between the backends is small and named in `sqlite.rs` and `postgres.rs`:
//! `begin_write`, `ROW_LOCK`, `ROW_LOCK_UPDATE`, `ROW_LOCK_NO_KEY_UPDATE`, `SKIP_LOCKED` and
//! `SINGLE_PROCESS`. JSON is stored as text on both backends so it reads back byte for byte.
//!
//! - `runs.rs`: creating runs (admission), reading them, their status and progress.
//! - `events.rs`: appending to a run's event log (fenced by leases) and reading it.
//! - `sessions.rs`: sessions, messages, a run's context and the token calibration.
//! - `leases.rs`: which process owns a run, takeovers, renewal, release, cancel requests.
//! - `actions.rs`: answers to a paused run's required action.
//! - `snapshots.rs`: a run's state at its last iteration boundary.
//! - `compaction.rs`: compactions, compaction settings and the circuit breaker.
//! - `retention.rs`: removing the logs of runs that ended long ago.
//! - `webhooks.rs`: the webhook outbox (deliveries, claims, attempts).

mod actions;
mod compaction;
mod events;
mod leases;
mod retention;
mod runs;
mod sessions;
mod snapshots;
mod webhooks;

use super::{StoreError, StoreResult};

fn corrupt(what: &str, value: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!("{what}: {value}"))
}

fn json<T: serde::de::DeserializeOwned>(what: &str, text: &str) -> StoreResult<T> {
    serde_json::from_str(text).map_err(|e| corrupt(what, e))
}

pub(super) fn to_json<T: serde::Serialize>(value: &T) -> StoreResult<String> {
    serde_json::to_string(value).map_err(|e| corrupt("serialize", e))
}

/// A stored `error_class`.
fn error_class(text: &str) -> StoreResult<crate::domain::ErrorClass> {
    serde_json::from_value(serde_json::Value::String(text.to_owned()))
        .map_err(|_| corrupt("error_class", text))
}

fn count(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

/// A string for a TEXT column: U+0000, which PostgreSQL cannot store in TEXT, becomes U+FFFD
/// (on both backends, so they agree). Client values with NUL are rejected before this (422);
/// this catches what comes from outside: provider error text, model-chosen tool call ids and
/// names. JSON columns need nothing: serde_json writes U+0000 as the escape `\u0000`.
pub(super) fn text(value: &str) -> std::borrow::Cow<'_, str> {
    if value.contains('\0') {
        std::borrow::Cow::Owned(value.replace('\0', "\u{fffd}"))
    } else {
        std::borrow::Cow::Borrowed(value)
    }
}

pub(super) fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}
