//! A tool's progress while it executes: the reports its `tools::ProgressSink` receives become
//! `tool_progress` events, at most one per call per `runtime.tool_progress_interval_ms`.
//!
//! The sink is a `watch` channel, so a report replaces one not logged yet (latest wins) and the
//! tool never waits for the log. The first report is logged at once; one that comes within the
//! interval of the last logged is held until the interval has passed, and dropped if the
//! execution finishes first (its result says the rest).

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::RunEmitter;
use super::event_log::LogError;
use crate::events::{EventPayload, ToolProgress};
use crate::tools::ToolProgressUpdate;

/// Drives `execution` (a tool call given the sink whose receiver `updates` is) to its output,
/// logging the progress it reports for call `call_id` meanwhile; `interval` is the least time
/// between two events.
///
/// # Errors
/// The event log's (the execution is then dropped, which stops the call).
pub(super) async fn with_progress<Fut: Future>(
    emitter: &RunEmitter,
    call_id: &str,
    interval: Duration,
    mut updates: watch::Receiver<Option<ToolProgressUpdate>>,
    execution: Fut,
) -> Result<Fut::Output, LogError> {
    tokio::pin!(execution);
    let mut last_logged: Option<Instant> = None;
    let mut pending = false;
    let mut open = true;
    loop {
        let due = last_logged.map_or_else(Instant::now, |at| at + interval);
        tokio::select! {
            biased;
            output = &mut execution => return Ok(output),
            changed = updates.changed(), if open && !pending => match changed {
                Ok(()) => pending = true,
                Err(_) => open = false,
            },
            () = tokio::time::sleep_until(due), if pending => {
                pending = false;
                last_logged = Some(Instant::now());
                let update = updates.borrow_and_update().clone();
                if let Some(update) = update {
                    emitter
                        .emit(EventPayload::ToolProgress(ToolProgress {
                            call_id: call_id.to_owned(),
                            progress: update.progress,
                            total: update.total,
                            message: update.message,
                        }))
                        .await?;
                }
            }
        }
    }
}
