//! Watching a run: subscribe to the live feed, replay from the store after the cursor, then
//! forward live events. Any gap in `sequence` (the replay/live race, a lagging watcher, a
//! closed feed) is filled from the store, which holds every published event; any sequence
//! already sent is dropped. The stream ends after the terminal event.
//!
//! A watcher holds no copy of the log: live events are the feed's shared frames, and a replay
//! page is rendered one event at a time and released once sent.
//!
//! A run not live in this process (executing on another replica) is read from the store when
//! a signal says its events were committed (`signals.rs`, whose probe of its own listener
//! wakes every watcher when signals may have been lost: no watcher polls), once for all its
//! watchers here (`relay.rs`: its frames take the live feed's place, gaps are filled the same
//! way); without a listener (a store one process uses), every [`POLL_INTERVAL`].

use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tokio::sync::broadcast::error::RecvError;

use super::signals::Wakeup;
use crate::domain::RunId;
use crate::events::{EventFrame, FeedSubscription, LoggedEvent};
use crate::store::{Store, StoreError};

/// Events read from the store per query.
const PAGE: u32 = 512;
/// How often a run that is not live in this process is polled in the store, without signals.
const POLL_INTERVAL: Duration = Duration::from_millis(250);

struct Watch {
    store: Arc<dyn Store>,
    run_id: RunId,
    live: Option<FeedSubscription>,
    wakeup: Option<Wakeup>,
    last_sent: u64,
    /// The rest of the store page being replayed.
    replay: std::vec::IntoIter<LoggedEvent>,
    read_store: bool,
    done: bool,
}

/// The run's events with `sequence > after`, in order, each exactly once, ending with the
/// terminal event. `live` must be subscribed before this is called (subscribe, then replay).
pub fn watch(
    store: Arc<dyn Store>,
    run_id: RunId,
    live: Option<FeedSubscription>,
    wakeup: Option<Wakeup>,
    after: u64,
) -> impl Stream<Item = Result<Arc<EventFrame>, StoreError>> + Send + 'static {
    let watch = Watch {
        store,
        run_id,
        live,
        wakeup,
        last_sent: after,
        replay: Vec::new().into_iter(),
        read_store: true,
        done: false,
    };
    futures::stream::unfold(watch, |mut watch| async move {
        let item = watch.next().await?;
        if item.is_err() {
            watch.done = true;
        }
        Some((item, watch))
    })
}

impl Watch {
    /// Sends `frame` if it is the next one; true when it was sent.
    fn send(&mut self, frame: &EventFrame) -> bool {
        if frame.sequence != self.last_sent + 1 {
            return false;
        }
        self.last_sent = frame.sequence;
        self.done = frame.terminal;
        true
    }

    async fn next(&mut self) -> Option<Result<Arc<EventFrame>, StoreError>> {
        loop {
            if self.done {
                return None;
            }
            if let Some(event) = self.replay.next() {
                if event.sequence <= self.last_sent {
                    continue;
                }
                let frame = event.frame();
                self.last_sent = frame.sequence;
                self.done = frame.terminal;
                if self.replay.len() == 0 {
                    // Release the page's buffer: an idle watcher keeps none.
                    self.replay = Vec::new().into_iter();
                }
                return Some(Ok(Arc::new(frame)));
            }
            if self.read_store {
                if let Some(wakeup) = self.wakeup.as_mut() {
                    // Before the first replay: the relay's reader starts no later than it.
                    wakeup.relay_started().await;
                    wakeup.seen();
                }
                let page = match self
                    .store
                    .read_events(self.run_id, self.last_sent, PAGE)
                    .await
                {
                    Ok(page) => page,
                    Err(error) => return Some(Err(error)),
                };
                self.read_store = page.len() == PAGE as usize;
                if page.is_empty() && self.live.is_none() {
                    // Nothing after the cursor and no live feed: if the run has ended, so has
                    // the stream — once the log is read again after the status: the terminal
                    // event may have been committed between the two reads.
                    match self.store.get_run(self.run_id).await {
                        Ok(Some(run)) if !run.status.is_terminal() => {}
                        Ok(_) => {
                            match self
                                .store
                                .read_events(self.run_id, self.last_sent, PAGE)
                                .await
                            {
                                Ok(rest) if rest.is_empty() => return None,
                                Ok(rest) => {
                                    self.read_store = rest.len() == PAGE as usize;
                                    self.replay = rest.into_iter();
                                    continue;
                                }
                                Err(error) => return Some(Err(error)),
                            }
                        }
                        Err(error) => return Some(Err(error)),
                    }
                }
                self.replay = page.into_iter();
                continue;
            }
            let Some(live) = self.live.as_mut() else {
                // Not live here (finished, or executing elsewhere): read the store when
                // signalled, else poll it.
                match self.wakeup.as_mut() {
                    Some(wakeup) => wakeup.changed().await,
                    None => tokio::time::sleep(POLL_INTERVAL).await,
                }
                self.read_store = true;
                continue;
            };
            match live.recv().await {
                Ok(frame) if self.send(&frame) => return Some(Ok(frame)),
                // Already sent, or before the cursor; a terminal one there ends the stream.
                Ok(frame) if frame.sequence <= self.last_sent => self.done = frame.terminal,
                // A gap: the store has everything up to this durable event.
                Ok(_) | Err(RecvError::Lagged(_)) => self.read_store = true,
                Err(RecvError::Closed) => {
                    self.live = None;
                    self.read_store = true;
                }
            }
        }
    }
}
