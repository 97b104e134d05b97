//! Retention: a background sweep removes the events and snapshots of runs that ended more than
//! `[runtime] event_retention_secs` ago, a small batch of runs per transaction, so it never
//! holds the store long enough to slow the live path. The runs, sessions and messages stay.

use std::sync::{Arc, Weak};
use std::time::Duration;

use chrono::Utc;

use super::Runtime;
use crate::store::{Store, StoreError};

/// Longest pause between two sweeps.
const MAX_PERIOD: Duration = Duration::from_secs(60);
/// Shortest pause between two sweeps.
const MIN_PERIOD: Duration = Duration::from_secs(1);
/// Pause between two batches of one sweep: the live path's writes go first.
const BATCH_PAUSE: Duration = Duration::from_millis(20);

/// Sweeps every tenth of the retention period (at least 1 s, at most 60 s) while the runtime
/// lives; returns at once when retention is off (`event_retention_secs` unset).
pub(super) async fn sweep_loop(runtime: Weak<Runtime>) {
    let Some(settings) = runtime.upgrade().and_then(|runtime| {
        let secs = runtime.config.event_retention_secs?;
        Some((secs, runtime.config.retention_batch_runs.max(1)))
    }) else {
        return;
    };
    let (secs, batch) = settings;
    let retention = Duration::from_secs(secs);
    let period = (retention / 10).clamp(MIN_PERIOD, MAX_PERIOD);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let store = match runtime.upgrade() {
            Some(runtime) if !runtime.stop.is_cancelled() => runtime.store.clone(),
            _ => return,
        };
        match sweep(&store, &runtime, retention, batch).await {
            Ok(0) => {}
            Ok(runs) => tracing::info!(
                runs,
                retention_secs = secs,
                "retention removed the events and snapshots of finished runs"
            ),
            Err(error) => tracing::warn!(%error, "retention sweep failed"),
        }
    }
}

/// Removes, batch after batch, the events of runs that ended before now − `retention`, until a
/// batch comes back short (or the runtime stops); returns how many runs were cleared.
async fn sweep(
    store: &Arc<dyn Store>,
    runtime: &Weak<Runtime>,
    retention: Duration,
    batch: u32,
) -> Result<u64, StoreError> {
    let retention = chrono::Duration::from_std(retention).unwrap_or(chrono::Duration::MAX);
    let Some(ended_before) = Utc::now().checked_sub_signed(retention) else {
        return Ok(0);
    };
    let mut cleared = 0u64;
    loop {
        let removed = store.remove_expired_events(ended_before, batch).await?;
        cleared += u64::from(removed);
        let stopping = runtime
            .upgrade()
            .is_none_or(|runtime| runtime.stop.is_cancelled());
        if removed < batch || stopping {
            return Ok(cleared);
        }
        tokio::time::sleep(BATCH_PAUSE).await;
    }
}
