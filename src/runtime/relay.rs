//! One store reader per run and replica for the runs executing on another replica: woken by
//! the run's signals (`signals.rs`), a relay reads the events committed since its last read once
//! and hands their frames to every watcher of the run in this process, as the live feed does
//! for a run executing here. A thousand watchers of a remote run cost one read per committed
//! batch, not a thousand.
//!
//! The relay is a hint like the signals that drive it: a watcher that sees a gap in its
//! frames (it attached after the relay read, or lagged) fills it from the store itself
//! (`watch.rs`), so a relay that missed a wake-up loses nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use tokio::sync::{broadcast, watch};

use crate::domain::RunId;
use crate::events::{EventFrame, FeedSubscription};
use crate::store::Store;

/// Events read from the store per query.
const PAGE: u32 = 512;
/// Frames a relay buffers for its slowest watcher (a watcher further behind reads the store).
const CAPACITY: usize = 1024;

/// A run's wake-ups in this process, and its relay of frames read from the store.
#[derive(Debug)]
pub(super) struct Relay {
    /// Changed whenever a signal for the run arrives (or may have been missed).
    pub(super) wake: watch::Sender<()>,
    /// Dropped when the reader ends (the run's end, or the store failed as it started): its
    /// watchers then see `Closed` and read the store at each wake-up instead.
    frames: Mutex<Option<broadcast::Sender<Arc<EventFrame>>>>,
    reading: AtomicBool,
    /// True once the reader knows where it starts (the log's last sequence when it started),
    /// or has ended: a watcher replays the store only after that, so every event is either
    /// in its replay or among the frames the reader sends. (A watcher that replayed first
    /// would miss the events committed between its replay and the reader's start: nothing
    /// after them would show it the gap.)
    started: watch::Sender<bool>,
}

impl Relay {
    pub(super) fn new() -> Self {
        Self {
            wake: watch::Sender::new(()),
            frames: Mutex::new(Some(broadcast::channel(CAPACITY).0)),
            reading: AtomicBool::new(false),
            started: watch::Sender::new(false),
        }
    }

    /// Becomes true once the reader has started (see `started`).
    pub(super) fn started(&self) -> watch::Receiver<bool> {
        self.started.subscribe()
    }

    fn frames(&self) -> std::sync::MutexGuard<'_, Option<broadcast::Sender<Arc<EventFrame>>>> {
        self.frames.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The frames the relay reads from now on; starts its reader on the first call (a run
    /// executing in this process never needs one: its watchers use the live feed). `None`
    /// once the reader has ended.
    pub(super) fn subscribe(
        self: &Arc<Self>,
        store: &Arc<dyn Store>,
        run_id: RunId,
    ) -> Option<FeedSubscription> {
        let frames = self.frames().as_ref()?.subscribe();
        if !self.reading.swap(true, Ordering::AcqRel) {
            // Subscribed to wake-ups before the store's last sequence is read: an event
            // committed after that read wakes the reader.
            let wake = self.wake.subscribe();
            tokio::spawn(read_loop(Arc::downgrade(self), wake, store.clone(), run_id));
        }
        Some(frames)
    }
}

/// Reads the run's new events at each wake-up and sends their frames; ends after the terminal
/// event, or once no watcher holds the relay.
async fn read_loop(
    relay: Weak<Relay>,
    wake: watch::Receiver<()>,
    store: Arc<dyn Store>,
    run_id: RunId,
) {
    read(&relay, wake, store.as_ref(), run_id).await;
    if let Some(relay) = relay.upgrade() {
        relay.frames().take();
        relay.started.send_replace(true);
    }
}

async fn read(
    relay: &Weak<Relay>,
    mut wake: watch::Receiver<()>,
    store: &dyn Store,
    run_id: RunId,
) {
    let mut last = match store.last_sequence(run_id).await {
        Ok(last) => last,
        Err(error) => {
            tracing::warn!(%run_id, %error, "the run's relay could not start; its watchers read the store");
            return;
        }
    };
    match relay.upgrade() {
        Some(relay) => relay.started.send_replace(true),
        None => return,
    };
    loop {
        wake.mark_unchanged();
        loop {
            let page = match store.read_events(run_id, last, PAGE).await {
                Ok(page) => page,
                Err(error) => {
                    // The watchers see no frame and read the store at their next gap.
                    tracing::warn!(%run_id, %error, "the run's relay could not read the store");
                    break;
                }
            };
            let full = page.len() == PAGE as usize;
            for event in page {
                let Some(relay) = relay.upgrade() else {
                    return;
                };
                last = event.sequence;
                let terminal = event.terminal;
                // No receiver is not an error: later watchers replay from the store.
                if let Some(frames) = relay.frames().as_ref() {
                    let _ = frames.send(Arc::new(event.frame()));
                }
                if terminal {
                    return;
                }
            }
            if !full {
                break;
            }
        }
        if wake.changed().await.is_err() {
            return;
        }
    }
}
