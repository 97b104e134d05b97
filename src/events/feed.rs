//! The in-memory live feed: one bounded broadcast channel per active run.
//!
//! Only durable events are published here (the event log persists first). The feed is lossy for
//! slow receivers by design: a receiver that lags sees a gap in `sequence` and fills it from the
//! store, so nothing is lost. Each event is rendered as an SSE frame once, when it is published,
//! and every watcher writes those same bytes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::{BufMut, Bytes, BytesMut};
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

impl LoggedEvent {
    /// The event's SSE frame (`id: <sequence>`, `event: <type>`, one `data:` line per line of
    /// the JSON, a blank line; WHATWG HTML §9.2.6), rendered once for all its watchers.
    #[must_use]
    pub fn frame(&self) -> EventFrame {
        let mut frame = BytesMut::with_capacity(self.event_type.len() + self.data.len() + 40);
        frame.put_slice(b"id: ");
        frame.put_slice(self.sequence.to_string().as_bytes());
        frame.put_slice(b"\nevent: ");
        frame.put_slice(self.event_type.as_bytes());
        // serde_json writes no raw line breaks; any other source still makes a valid frame.
        for line in self.data.split('\n') {
            frame.put_slice(b"\ndata: ");
            frame.put_slice(line.strip_suffix('\r').unwrap_or(line).as_bytes());
        }
        frame.put_slice(b"\n\n");
        EventFrame {
            sequence: self.sequence,
            terminal: self.terminal,
            bytes: frame.freeze(),
            data: self.data.clone(),
        }
    }
}

/// An event rendered for the wire: what a watcher needs to order it, and its SSE frame. The
/// feed shares one per event (`Arc`) with every watcher; the bytes are never copied per watcher,
/// and a slot of the run's channel holds a pointer, not the frame.
#[derive(Debug, Clone, PartialEq)]
pub struct EventFrame {
    /// Per-run sequence, from 1 (the frame's `id:`).
    pub sequence: u64,
    /// True for the run's terminal event.
    pub terminal: bool,
    /// The whole SSE frame, from `id:` to the blank line that ends it.
    pub bytes: Bytes,
    /// The event's JSON (shared with the [`LoggedEvent`], not copied): what the other
    /// renderings of the log (`api/formats`) deserialize into the typed [`crate::events::AgentEvent`].
    pub data: Arc<str>,
}

/// A receiver of one run's live events.
pub type FeedSubscription = broadcast::Receiver<Arc<EventFrame>>;

/// Per-run broadcast channels for runs executing in this process.
#[derive(Debug)]
pub struct EventFeed {
    capacity: usize,
    runs: Mutex<HashMap<RunId, broadcast::Sender<Arc<EventFrame>>>>,
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
    ) -> std::sync::MutexGuard<'_, HashMap<RunId, broadcast::Sender<Arc<EventFrame>>>> {
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

    /// Publishes a durable event to the run's current receivers, rendered once for all of them.
    pub fn publish(&self, run_id: RunId, event: &LoggedEvent) {
        let Some(sender) = self.runs().get(&run_id).cloned() else {
            return;
        };
        // No receiver is not an error: the event is in the store for later watchers.
        if sender.receiver_count() > 0 {
            let _ = sender.send(Arc::new(event.frame()));
        }
    }

    /// Closes the run's channel; receivers drain what they buffered, then see `Closed`.
    pub fn close(&self, run_id: RunId) {
        self.runs().remove(&run_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(data: &str) -> LoggedEvent {
        LoggedEvent {
            sequence: 7,
            event_type: "text_delta".to_owned(),
            data: Arc::from(data),
            terminal: false,
        }
    }

    #[test]
    fn a_frame_carries_id_event_and_data() {
        let frame = event(r#"{"type":"text_delta","text":"a\nb"}"#).frame();
        assert_eq!(
            frame.bytes,
            "id: 7\nevent: text_delta\ndata: {\"type\":\"text_delta\",\"text\":\"a\\nb\"}\n\n"
        );
        assert_eq!((frame.sequence, frame.terminal), (7, false));
    }

    #[test]
    fn each_line_of_the_data_is_its_own_data_field() {
        assert_eq!(
            event("{\n\"a\": 1\r\n}").frame().bytes,
            "id: 7\nevent: text_delta\ndata: {\ndata: \"a\": 1\ndata: }\n\n"
        );
    }
}
