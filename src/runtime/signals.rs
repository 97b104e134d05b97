//! Signals between replicas on a shared PostgreSQL: each process listens on one connection
//! (`LISTEN behest`) and is woken when another commits a run's events, records a cancel or
//! records answers to a waiting run. A signal is a hint — the store stays the source of truth —
//! so a watcher woken reads the store after its cursor, a listener that reconnected wakes every
//! watcher (signals may have been missed), and a slow check bounds a silent listener: every
//! [`PROBE_EVERY`] the replica sends itself a probe, and when the previous one has not come
//! back it wakes every watcher (they read the store) and reports the listener failed. One
//! probe per replica, whatever the number of watchers: idle watchers cost the database nothing,
//! and a run's live watchers here share one read of the store per signal (`relay.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::Runtime;
use super::relay::Relay;
use crate::domain::RunId;
use crate::events::FeedSubscription;
use crate::store::{Signal, SignalListener, Store, StoreError};

/// How long the loop waits before listening again after the connection failed.
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// How often the replica probes its own listener (a probe not back by the next one: silent).
const PROBE_EVERY: Duration = Duration::from_secs(5);

/// The wake-ups of this process's watchers of runs executing elsewhere, by run.
#[derive(Debug, Default)]
pub(super) struct Signals {
    /// Whether a listener runs (else watchers poll the store).
    listening: AtomicBool,
    /// Whether the listener's connection works (false from a failure to its next signal).
    failed: AtomicBool,
    runs: Mutex<HashMap<RunId, Weak<Relay>>>,
}

/// A watcher's wake-up: changed whenever a signal for its run arrives (or may have been
/// missed); it holds the run's [`Relay`] in this process.
#[derive(Debug)]
pub struct Wakeup {
    relay: Arc<Relay>,
    receiver: watch::Receiver<()>,
    /// Once this watcher takes the relay's frames: whether the relay's reader has started.
    relay_started: Option<watch::Receiver<bool>>,
}

impl Wakeup {
    /// Marks every wake-up so far as seen (call before reading the store).
    pub fn seen(&mut self) {
        self.receiver.mark_unchanged();
    }

    /// Waits for a wake-up after the last [`Self::seen`].
    pub async fn changed(&mut self) {
        if self.receiver.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// The frames of the run read from the store once for every watcher here, from now on
    /// (`relay.rs`); `None` once that reader has ended. The watcher replays the store only
    /// once [`Self::relay_started`] returns.
    pub(super) fn relay(
        &mut self,
        store: &Arc<dyn Store>,
        run_id: RunId,
    ) -> Option<FeedSubscription> {
        let frames = self.relay.subscribe(store, run_id)?;
        self.relay_started = Some(self.relay.started());
        Some(frames)
    }

    /// Waits until the relay's reader whose frames this watcher takes knows where it starts
    /// (at once when it takes none): the watcher's replay then reaches at least that far, so
    /// no event falls between the two.
    pub async fn relay_started(&mut self) {
        if let Some(started) = self.relay_started.as_mut() {
            // The sender lives in the relay this wake-up holds: it cannot be dropped.
            let _ = started.wait_for(|started| *started).await;
        }
    }
}

impl Signals {
    fn runs(&self) -> MutexGuard<'_, HashMap<RunId, Weak<Relay>>> {
        self.runs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A wake-up for a watcher of `run_id`; `None` when this process does not listen.
    pub(super) fn wakeup(&self, run_id: RunId) -> Option<Wakeup> {
        if !self.listening.load(Ordering::Acquire) {
            return None;
        }
        let mut runs = self.runs();
        let relay = runs
            .get(&run_id)
            .and_then(Weak::upgrade)
            .unwrap_or_else(|| {
                let relay = Arc::new(Relay::new());
                runs.insert(run_id, Arc::downgrade(&relay));
                relay
            });
        // Forget runs nobody watches any more (amortised: only when the map grew large).
        if runs.len() > 64 && runs.len().is_power_of_two() {
            runs.retain(|_, relay| relay.strong_count() > 0);
        }
        let receiver = relay.wake.subscribe();
        Some(Wakeup {
            relay,
            receiver,
            relay_started: None,
        })
    }

    fn wake(&self, run_id: RunId) {
        if let Some(relay) = self.runs().get(&run_id).and_then(Weak::upgrade) {
            relay.wake.send_replace(());
        }
    }

    fn wake_all(&self) {
        let relays: Vec<_> = self.runs().values().filter_map(Weak::upgrade).collect();
        for relay in relays {
            relay.wake.send_replace(());
        }
    }
}

impl Runtime {
    /// Why this replica is not ready, as `(code, detail)` for `/readyz`: its listener's
    /// connection failed (`signals_unavailable`), or it cannot confirm its leases
    /// (`leases_unconfirmed`, fail-stop).
    #[must_use]
    pub fn replica_trouble(&self) -> Option<(&'static str, &'static str)> {
        if self.signals.failed.load(Ordering::Acquire) {
            return Some((
                "signals_unavailable",
                "the connection listening for other replicas' signals failed",
            ));
        }
        if !self.leases_confirmed.load(Ordering::Acquire) {
            return Some((
                "leases_unconfirmed",
                "this replica cannot renew its runs' leases in the database",
            ));
        }
        None
    }

    /// Listens for other replicas' signals (PostgreSQL; nothing on SQLite): connects the
    /// listener, checks that a notification arrives (the probe), then dispatches signals until
    /// the runtime stops. Call once at startup.
    ///
    /// # Errors
    /// [`StoreError::SignalsUnavailable`] when notifications do not arrive (e.g. a
    /// transaction-mode pooler), or the connection's error.
    pub async fn listen(self: &Arc<Self>) -> Result<(), StoreError> {
        let Some(listener) = self.store.listen().await? else {
            return Ok(());
        };
        self.signals.listening.store(true, Ordering::Release);
        tokio::spawn(signal_loop(
            Arc::downgrade(self),
            listener,
            self.stop.clone(),
        ));
        Ok(())
    }

    /// Tells the run's owner, wherever it is, at once (best effort: the store already holds
    /// what changed, and the owner's lease tick finds it too).
    pub(super) async fn send_signal(&self, signal: Signal) {
        if let Err(error) = self.store.send_signal(signal).await {
            tracing::warn!(%error, ?signal, "could not signal the other replicas");
        }
    }
}

async fn signal_loop(
    runtime: Weak<Runtime>,
    mut listener: SignalListener,
    stop: CancellationToken,
) {
    let mut probe_tick = tokio::time::interval(PROBE_EVERY);
    probe_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut outstanding: Option<uuid::Uuid> = None;
    loop {
        let received = tokio::select! {
            received = listener.recv() => received,
            _ = probe_tick.tick() => {
                let Some(runtime) = runtime.upgrade() else {
                    return;
                };
                if outstanding.is_some() {
                    tracing::warn!("the signal listener is silent (its probe did not come back); watchers read the store");
                    runtime.signals.failed.store(true, Ordering::Release);
                    runtime.signals.wake_all();
                }
                let probe = uuid::Uuid::now_v7();
                outstanding = Some(probe);
                runtime.send_signal(Signal::Probe(probe)).await;
                continue;
            }
            () = stop.cancelled() => return,
        };
        let Some(runtime) = runtime.upgrade() else {
            return;
        };
        runtime
            .signals
            .failed
            .store(received.is_err(), Ordering::Release);
        match received {
            Ok(Some(Signal::Probe(probe))) => {
                if outstanding == Some(probe) {
                    outstanding = None;
                }
            }
            Ok(Some(Signal::Events(run_id))) => runtime.signals.wake(run_id),
            Ok(Some(Signal::Released)) => runtime.spawn_scan(),
            Ok(Some(Signal::Cancel(run_id))) => {
                if let Some(run) = runtime.active().get(&run_id) {
                    run.cancel.cancel();
                }
            }
            Ok(Some(Signal::Answers(run_id))) => {
                if let Some(run) = runtime.active().get(&run_id) {
                    run.answered.notify_waiters();
                }
            }
            Ok(None) => {
                tracing::warn!("the signal listener reconnected; watchers read the store");
                runtime.signals.wake_all();
            }
            Err(error) => {
                tracing::warn!(%error, "the signal listener failed; listening again");
                runtime.signals.wake_all();
                drop(runtime);
                tokio::time::sleep(RETRY_AFTER).await;
            }
        }
    }
}
