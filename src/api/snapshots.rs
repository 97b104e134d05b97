//! SnapshotService over REST: list, read and delete the snapshots runs write at their iteration
//! boundaries.

use axum::extract::State;

use super::extract::Path;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::extract::Query;
use super::page::RunListQuery;
use super::{ApiError, AppState, Problem};
use crate::domain::{RunId, Snapshot};
use crate::store::{SnapshotFilter, StoreError};

/// Like the other routes of one run, an id that is not a UUID names no snapshot: 404.
fn parse_run_id(raw: &str) -> Result<RunId, ApiError> {
    raw.parse().map_err(|_| ApiError::snapshot_not_found(raw))
}

/// A page of snapshots, newest run first (proto `ListSnapshotsResponse`).
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ListSnapshotsResponse {
    /// The snapshots.
    pub snapshots: Vec<Snapshot>,
    /// Pass as `cursor` for the next page; `null` on the last page (always present).
    #[schema(required = true)]
    pub next_cursor: Option<String>,
}

/// List snapshots, newest run first, optionally by session and status (proto
/// `SnapshotService.ListSnapshots`).
///
/// A run has a snapshot from its first model call on: it is
/// rewritten at each iteration boundary (`model_started`) and, once the run ends, shows the
/// terminal status; it is kept until retention (`[runtime] event_retention_secs`) removes it
/// with the run's events, or `DELETE /snapshots/{run_id}` does. `status` filters on the
/// snapshot's status: `calling_model` for a run between boundaries, else the terminal status.
#[utoipa::path(get, path = "/snapshots", tag = "snapshots",
    params(RunListQuery),
    responses(
        (status = 200, description = "A page of snapshots", body = ListSnapshotsResponse),
        (status = 400, description = "`invalid_cursor` (not a cursor this server returned); `invalid_query` (`limit` out of 1–200, unknown `status`, `session_id` not a UUID, an unknown parameter)", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn list_snapshots(
    State(state): State<AppState>,
    Query(query): Query<RunListQuery>,
) -> Result<axum::Json<ListSnapshotsResponse>, ApiError> {
    let (page, session_id) = query.parse()?;
    let filter = SnapshotFilter {
        session_id,
        status: query.status,
        before: page.before,
        limit: page.fetch(),
    };
    let mut snapshots = state.runtime.store().list_snapshots(&filter).await?;
    let max_bytes = state.runtime.config().max_page_bytes;
    let next_cursor = page.finish(&mut snapshots, max_bytes, |snapshot| {
        snapshot.run_id.to_string()
    });
    Ok(axum::Json(ListSnapshotsResponse {
        snapshots,
        next_cursor,
    }))
}

/// Read a run's snapshot (proto `SnapshotService.GetSnapshot`).
///
/// The run's state at its last iteration boundary, or how it ended. There is none before the run's first model call, after
/// retention removed it, or after it was deleted.
#[utoipa::path(get, path = "/snapshots/{run_id}", tag = "snapshots",
    params(("run_id" = String, Path, format = Uuid, description = "Run id")),
    responses(
        (status = 200, description = "The run's snapshot", body = Snapshot),
        (status = 404, description = "`snapshot_not_found`: no such run (or the id is not a UUID), or the run has no snapshot (before its first model call, removed by retention, or deleted)", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_snapshot(
    State(state): State<AppState>,
    Path(raw_id): Path<String>,
) -> Result<axum::Json<Snapshot>, ApiError> {
    let run_id = parse_run_id(&raw_id)?;
    state
        .runtime
        .store()
        .get_snapshot(run_id)
        .await?
        .map(axum::Json)
        .ok_or_else(|| ApiError::snapshot_not_found(&raw_id))
}

/// Delete a finished run's snapshot (proto `SnapshotService.DeleteSnapshot`).
///
/// The run, its events and messages stay. An active run's snapshot is what resuming it after a restart
/// needs, so it cannot be deleted (409 `run_active`).
#[utoipa::path(delete, path = "/snapshots/{run_id}", tag = "snapshots",
    params(("run_id" = String, Path, format = Uuid, description = "Run id")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "`snapshot_not_found`: no such run (or the id is not a UUID), or the run has no snapshot", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`run_active`: the run has not ended; `run_id` names it", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn delete_snapshot(
    State(state): State<AppState>,
    Path(raw_id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let run_id = parse_run_id(&raw_id)?;
    match state.runtime.store().delete_snapshot(run_id).await {
        Ok(true) => Ok(StatusCode::NO_CONTENT),
        Ok(false) => Err(ApiError::snapshot_not_found(&raw_id)),
        Err(StoreError::RunActive(run_id)) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "run_active",
            "the run has not ended: its snapshot is what resuming it needs",
        )
        .run(run_id, None)),
        Err(error) => Err(error.into()),
    }
}
