//! One rendering of a run per format, shared by this process's watchers of it: the first
//! watcher to reach an event folds it and renders its SSE frames once; every other watcher past
//! its cursor sends the same bytes. A rendering is a pure function of the log, so the bytes are
//! those each watcher would have rendered on its own (a replay stays byte-identical).
//!
//! A watcher renders on its own (a [`Renderer`] of its own) while it is before its cursor or
//! its prelude is unsent (a resume), and while the shared rendering is elsewhere in the log; it
//! joins the shared one at the first event the shared rendering can give it, and hands its
//! fold over when the shared rendering is behind it. A joined watcher that falls further
//! behind than the shared rendering keeps frames ([`RECENT`] events, [`RECENT_BYTES`] bytes)
//! folds the log again on its own ([`Watcher::render`] answers `None`: the caller re-reads the
//! log after [`Watcher::from`]).
//!
//! Folding again need not start at the log's first event: the shared rendering keeps its
//! projection as it was after every [`CHECKPOINT_EVERY`]th event (the latest
//! [`CHECKPOINTS`] of them), and a watcher that falls behind, or resumes, starts from the latest
//! one before the events it must render. On a long run a stalled client then re-reads at most
//! about `CHECKPOINT_EVERY` events more than its gap, not the whole log.
//!
//! A shared rendering lives as long as one of its watchers does ([`Renderings`] holds it
//! weakly).

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use bytes::Bytes;

use super::{Cursor, Format, Projection, Rendered, Renderer};
use crate::domain::RunId;
use crate::events::{AgentEvent, EventFrame};

/// Events whose frames a shared rendering keeps for its watchers a little behind (as many as
/// the live feed's channel keeps by default)...
pub(super) const RECENT: usize = 1024;

/// ...and at most this many bytes of them (large tool results would otherwise keep up to
/// [`RECENT`] times their size), though always the latest event's.
pub(super) const RECENT_BYTES: usize = 4 << 20;

/// A shared rendering keeps its projection after each event whose sequence is a multiple of
/// this...
pub(super) const CHECKPOINT_EVERY: u64 = 1024;

/// ...the latest this many of them (a watcher further behind folds from the log's start).
pub(super) const CHECKPOINTS: usize = 4;

/// This process's shared renderings, by run and format, each kept while it has a watcher.
#[derive(Debug, Default)]
pub struct Renderings(Mutex<HashMap<(RunId, Format), Weak<dyn Any + Send + Sync>>>);

impl Renderings {
    /// The shared rendering of run `run_id` in `format`, if a watcher holds one.
    pub(super) fn held<P: Projection>(
        &self,
        run_id: RunId,
        format: Format,
    ) -> Option<Arc<Mutex<Shared<P>>>>
    where
        P::Frame: Send,
    {
        let map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        upgrade(map.get(&(run_id, format)))
    }

    /// The shared rendering of run `run_id` in `format`, made from `fresh()` (the projection
    /// of no event yet) when no watcher holds one.
    pub(super) fn share<P: Projection>(
        &self,
        run_id: RunId,
        format: Format,
        fresh: impl FnOnce() -> P,
    ) -> Arc<Mutex<Shared<P>>>
    where
        P::Frame: Send,
    {
        let mut map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(held) = upgrade(map.get(&(run_id, format))) {
            return held;
        }
        map.retain(|_, held| held.strong_count() > 0);
        let shared = Self::unshared(fresh());
        let erased: Arc<dyn Any + Send + Sync> = shared.clone();
        map.insert((run_id, format), Arc::downgrade(&erased));
        shared
    }

    /// A rendering from `fresh` that no other watcher shares (its frames differ from the
    /// run's shared rendering, e.g. an AG-UI continuation's runId).
    pub(super) fn unshared<P: Projection>(fresh: P) -> Arc<Mutex<Shared<P>>> {
        Arc::new(Mutex::new(Shared::new(fresh)))
    }

    /// How many shared renderings are held (for tests).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        let map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        map.values().filter(|held| held.strong_count() > 0).count()
    }
}

/// The shared rendering `held` points to, if a watcher still holds it.
fn upgrade<P: Projection>(
    held: Option<&Weak<dyn Any + Send + Sync>>,
) -> Option<Arc<Mutex<Shared<P>>>>
where
    P::Frame: Send,
{
    held?.upgrade()?.downcast::<Mutex<Shared<P>>>().ok()
}

/// A fold of a run's log through event `last`, with the frames of its latest events.
pub(super) struct Shared<P: Projection> {
    /// The projection of no event yet (a watcher that fell behind starts again from it).
    fresh: P,
    /// The fold through `last`, rendering every frame (no cursor).
    renderer: Renderer<P>,
    /// The sequence of the last event folded (0: none).
    last: u64,
    /// The frames of events `last − len + 1 ..= last`, at most [`RECENT`] events and
    /// [`RECENT_BYTES`] bytes (or the latest event alone).
    recent: VecDeque<Arc<Rendered>>,
    /// The bytes of the frames in `recent`.
    recent_bytes: usize,
    /// The projection after event `k`, for the latest [`CHECKPOINTS`] multiples `k` of
    /// [`CHECKPOINT_EVERY`] this fold passed, oldest first.
    checkpoints: VecDeque<(u64, P)>,
}

impl<P: Projection> Shared<P> {
    fn new(fresh: P) -> Self {
        Self {
            renderer: Renderer::new(fresh.clone(), None),
            fresh,
            last: 0,
            recent: VecDeque::new(),
            recent_bytes: 0,
            checkpoints: VecDeque::new(),
        }
    }

    /// The latest projection kept after an event at or before `through`, and that event's
    /// sequence: a fold from it given the log after that event is the fold from the start.
    fn checkpoint(&self, through: u64) -> (u64, P) {
        self.checkpoints
            .iter()
            .rev()
            .find(|(sequence, _)| *sequence <= through)
            .map_or_else(|| (0, self.fresh.clone()), |(s, p)| (*s, p.clone()))
    }

    /// The frames of event `sequence`, if kept.
    fn get(&self, sequence: u64) -> Option<Arc<Rendered>> {
        let first = self.last + 1 - self.recent.len() as u64;
        let index = usize::try_from(sequence.checked_sub(first)?).ok()?;
        self.recent.get(index).cloned()
    }

    /// Folds `event`, the one after `last`, and keeps its frames.
    fn push(&mut self, event: &AgentEvent) -> Arc<Rendered> {
        let rendered = Arc::new(self.renderer.render(event));
        self.last = event.sequence;
        if event.sequence.is_multiple_of(CHECKPOINT_EVERY) {
            self.checkpoints
                .push_back((event.sequence, self.renderer.projection.clone()));
            if self.checkpoints.len() > CHECKPOINTS {
                self.checkpoints.pop_front();
            }
        }
        self.recent_bytes += size(&rendered);
        self.recent.push_back(rendered.clone());
        while self.recent.len() > RECENT
            || (self.recent_bytes > RECENT_BYTES && self.recent.len() > 1)
        {
            if let Some(oldest) = self.recent.pop_front() {
                self.recent_bytes -= size(&oldest);
            }
        }
        rendered
    }

    /// Takes over `renderer`, a watcher's fold through `last` (ahead of this one). The kept
    /// projections stay: every fold of the log passes through the same ones.
    fn adopt(&mut self, renderer: Renderer<P>, last: u64) {
        self.renderer = renderer.into_live();
        self.last = last;
        self.recent.clear();
        self.recent_bytes = 0;
    }
}

/// The bytes of an event's frames.
fn size(rendered: &Rendered) -> usize {
    rendered.frames.iter().map(Bytes::len).sum()
}

fn lock<P: Projection>(shared: &Mutex<Shared<P>>) -> MutexGuard<'_, Shared<P>> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One watcher's rendering: its own fold until it can join the shared one.
pub(super) struct Watcher<P: Projection> {
    shared: Arc<Mutex<Shared<P>>>,
    /// The watcher's own fold; `None` once it takes its frames from `shared`.
    own: Option<Renderer<P>>,
    /// The sequence after which the caller gives this watcher the log.
    from: u64,
}

impl<P: Projection> Watcher<P> {
    /// A watcher of the log after `after` (see [`Renderer::new`]) that joins `shared`, to be
    /// given the log after [`Watcher::from`]. It folds from the latest projection kept before
    /// the cursor's event (the prelude of a resume is made from the state before that event).
    pub(super) fn new(shared: Arc<Mutex<Shared<P>>>, after: Option<Cursor>) -> Self {
        let through = after.map_or(0, |cursor| cursor.sequence.saturating_sub(1));
        let (from, projection) = lock(&shared).checkpoint(through);
        Self {
            own: Some(Renderer::new(projection, after)),
            from,
            shared,
        }
    }

    /// The sequence after which the caller gives this watcher the log: at its start, and again
    /// after [`Watcher::render`] answers `None`.
    pub(super) fn from(&self) -> u64 {
        self.from
    }

    /// The frames of `frame`, the next event of the log in sequence order: what
    /// [`Renderer::render`] gives. `None`: this watcher fell behind the frames the shared
    /// rendering keeps; it was reset by [`Watcher::restart`] and must be given the log again
    /// after [`Watcher::from`].
    ///
    /// # Errors
    /// The event's JSON does not read as an [`AgentEvent`].
    pub(super) fn render(
        &mut self,
        frame: &EventFrame,
    ) -> Result<Option<Arc<Rendered>>, serde_json::Error> {
        let sequence = frame.sequence;
        if let Some(own) = self.own.take_if(|own| own.live()) {
            let mut shared = lock(&self.shared);
            if shared.last + 1 < sequence {
                shared.adopt(own, sequence.saturating_sub(1));
            } else if shared.last + 1 != sequence && shared.get(sequence).is_none() {
                self.own = Some(own);
            }
        }
        if let Some(own) = &mut self.own {
            let event = serde_json::from_str::<AgentEvent>(&frame.data)?;
            return Ok(Some(Arc::new(own.render(&event))));
        }
        let mut shared = lock(&self.shared);
        if let Some(rendered) = shared.get(sequence) {
            return Ok(Some(rendered));
        }
        if shared.last + 1 == sequence {
            let event = serde_json::from_str::<AgentEvent>(&frame.data)?;
            return Ok(Some(shared.push(&event)));
        }
        let through = sequence.saturating_sub(1);
        let (from, projection) = shared.checkpoint(through);
        drop(shared);
        self.restart(from, projection, through);
        Ok(None)
    }

    /// Folds on its own again from `projection`, the fold through event `from`: silently
    /// through `through`, then every frame after it (no prelude: those before were sent).
    fn restart(&mut self, from: u64, projection: P, through: u64) {
        self.own = Some(Renderer::continuing(projection, through));
        self.from = from;
    }
}
