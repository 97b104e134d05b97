//! Snapshots: a run's resumable state at an iteration boundary (the seed's `SnapshotInfo`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{ErrorClass, RunId, RunStatus, SessionId, TokenUsage};

/// A run's state at its last iteration boundary (proto `SnapshotInfo`, plus where it stands in
/// the event log and how many tool calls it has made).
///
/// Written in the transaction of each `model_started` event (the run's messages committed so far
/// are the rest of what resuming needs), and updated to the terminal status in the transaction
/// of the run's terminal event. It exists from the run's first model call on and is kept after
/// the run ends until retention (`[runtime] event_retention_secs`) removes it with the run's
/// events, or `DELETE /snapshots/{run_id}` does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Snapshot {
    /// The run.
    pub run_id: RunId,
    /// Its session.
    pub session_id: SessionId,
    /// The run's status when the snapshot was written: `calling_model` at an iteration
    /// boundary, then the terminal status once the run ended.
    pub status: RunStatus,
    /// The iteration (model call, from 1) that begins at this boundary.
    pub iteration: u32,
    /// The run's token usage up to this boundary, in tokens.
    pub total_usage: TokenUsage,
    /// Tool calls the run had made up to this boundary.
    pub tool_calls: u32,
    /// Why the run failed, once it ended failed (its `error_class`); null otherwise.
    pub error_class: Option<ErrorClass>,
    /// The `sequence` of the event whose transaction wrote the snapshot (`model_started`, or the
    /// terminal event).
    pub last_sequence: u64,
    /// When it was written (RFC 3339).
    pub timestamp: DateTime<Utc>,
}
