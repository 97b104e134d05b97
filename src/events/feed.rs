//! The in-memory live feed: one bounded broadcast channel per active run.
//!
//! Only durable events are published here (the event log persists first). The feed is lossy for
//! slow receivers by design: a receiver that lags sees a gap in `sequence` and fills it from the
//! store, so nothing is lost.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::broadcast;

use crate::domain::RunId;

/// An event as logged: serialized once, shared by every watcher and the replay path.
#[derive(Debug, Clone, PartialEq)]
pub struct LoggedEvent {
    /// Per-run sequence, from 1.
    pub sequence: u64,
    /// The `type` tag (SSE `event:`).
    pub event_type: String,
    /// The event's full JSON (SSE `data:`).
    pub data: Arc<str>,
    /// True for the run's terminal event.
    pub terminal: bool,
}

/// A receiver of one run's live events.
pub type FeedSubscription = broadcast::Receiver<Arc<LoggedEvent>>;

/// Per-run broadcast channels for runs executing in this process.
#[derive(Debug)]
pub struct EventFeed {
    capacity: usize,
    runs: Mutex<HashMap<RunId, broadcast::Sender<Arc<LoggedEvent>>>>,
}

impl EventFeed {
    /// A feed whose per-run channels buffer `capacity` events (at least 1) for slow receivers.
    #[must_use]
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            runs: Mutex::new(HashMap::new()),
        }
    }

    fn runs(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<RunId, broadcast::Sender<Arc<LoggedEvent>>>> {
        self.runs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Opens the run's channel; called before the run emits its first event.
    pub fn open(&self, run_id: RunId) {
        self.runs()
            .entry(run_id)
            .or_insert_with(|| broadcast::channel(self.capacity).0);
    }

    /// Subscribes to the run's live events; `None` when the run is not live in this process.
    #[must_use]
    pub fn subscribe(&self, run_id: RunId) -> Option<FeedSubscription> {
        self.runs().get(&run_id).map(broadcast::Sender::subscribe)
    }

    /// Publishes a durable event to the run's current receivers.
    pub fn publish(&self, run_id: RunId, event: Arc<LoggedEvent>) {
        if let Some(sender) = self.runs().get(&run_id) {
            // No receiver is not an error: the event is in the store for later watchers.
            let _ = sender.send(event);
        }
    }

    /// Closes the run's channel; receivers drain what they buffered, then see `Closed`.
    pub fn close(&self, run_id: RunId) {
        self.runs().remove(&run_id);
    }
}
