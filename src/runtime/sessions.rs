//! The contexts sessions' runs start from, cached in this process so that starting a run does
//! not grow with its session's length: a run of a session seen before reads only the messages
//! stored since (its own user input, the previous run's answer), whichever process wrote them.
//! A compacted session is read from its latest compaction instead, which the store bounds.
//!
//! A run borrows its session's entry: [`ContextCache::load`] hands the messages over (no copy of
//! a long history per run) and [`ContextCache::give_back`] takes what was loaded back when the
//! run ends; a run that never gives back (a crash) only costs its session's next run one whole
//! read.
//!
//! The cache is never trusted over the store: every load asks the store what changed after the
//! last message it holds. Messages are append-only and a session's are written by one run at a
//! time (a session has at most one active run), so "after the last message read" misses
//! nothing. The one exception is a session this process has just created with its first run:
//! nothing else can have written to it, so that run starts from its input without a read.

use std::sync::{Mutex, PoisonError};

use hashlink::LruCache;

use crate::domain::{Message, SessionId};
use crate::runtime::tokens::TokenCounter;
use crate::store::{ContextUpdate, SessionContext, Store, StoreResult};

/// Messages held across all cached sessions at most; the least recently started sessions are
/// dropped first (a dropped session's next run reads its context whole, once).
pub const CACHED_MESSAGES: usize = 200_000;

/// A session's messages, oldest first, as the store held them.
#[derive(Debug)]
struct Entry {
    messages: Vec<Message>,
    /// The last run's counter, which knows these messages' token counts.
    counter: Option<TokenCounter>,
    /// The session was created by this process with these messages, and nothing can have
    /// been added since: its next load needs no read.
    new: bool,
}

#[derive(Debug)]
struct Inner {
    entries: LruCache<SessionId, Entry>,
    /// Messages held by `entries`.
    held: usize,
}

/// What a run starts from.
#[derive(Debug)]
pub(super) struct Loaded {
    pub(super) context: SessionContext,
    /// The counter of the session's last run in this process, which knows its messages'
    /// token counts (`None`: a new one counts them, from the process-wide cache).
    pub(super) counter: Option<TokenCounter>,
}

/// Sessions' uncompacted contexts, least recently used dropped first.
#[derive(Debug)]
pub(super) struct ContextCache {
    inner: Mutex<Inner>,
    budget: usize,
}

impl ContextCache {
    /// A cache holding at most `budget` messages.
    pub(super) fn new(budget: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                entries: LruCache::new_unbounded(),
                held: 0,
            }),
            budget,
        }
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The session's context as
    /// [`SessionStore::session_context`](crate::store::SessionStore::session_context) reads it,
    /// reading only what was stored since this process last loaded the session; the session's
    /// entry goes with it until [`ContextCache::give_back`].
    ///
    /// # Errors
    /// The store's.
    pub(super) async fn load(
        &self,
        store: &dyn Store,
        session_id: SessionId,
    ) -> StoreResult<Loaded> {
        // Taken out for the run (a concurrent load of the same session reads it whole).
        let mut cached = {
            let mut inner = self.inner();
            let entry = inner.entries.remove(&session_id);
            if let Some(entry) = &entry {
                inner.held -= entry.messages.len();
            }
            entry
        };
        if let Some(entry) = cached.take_if(|entry| entry.new) {
            return Ok(Loaded {
                context: SessionContext {
                    compaction: None,
                    messages: entry.messages,
                    calibration: None,
                },
                counter: entry.counter,
            });
        }
        let after = cached
            .as_ref()
            .and_then(|entry| entry.messages.last())
            .map(|message| message.id);
        match store.session_context_after(session_id, after).await? {
            ContextUpdate::Compacted(context) => Ok(Loaded {
                context: *context,
                counter: None,
            }),
            ContextUpdate::Appended {
                messages,
                calibration,
            } => {
                let (mut held, counter) = cached
                    .map(|entry| (entry.messages, entry.counter))
                    .unwrap_or_default();
                held.extend(messages);
                Ok(Loaded {
                    context: SessionContext {
                        compaction: None,
                        messages: held,
                        calibration,
                    },
                    counter,
                })
            }
        }
    }

    /// Takes back, when a run of the session ends, the uncompacted `messages` its
    /// [`ContextCache::load`] handed over, oldest first — only those: what the run stored
    /// itself is read by the next load, in the store's order — and the run's `counter`.
    pub(super) fn give_back(
        &self,
        session_id: SessionId,
        messages: Vec<Message>,
        counter: TokenCounter,
    ) {
        self.put(
            session_id,
            Entry {
                messages,
                counter: Some(counter),
                new: false,
            },
        );
    }

    /// A session this process has just stored with its first run's `input`: that run loads
    /// it without a read.
    pub(super) fn created(&self, session_id: SessionId, input: Message) {
        self.put(
            session_id,
            Entry {
                messages: vec![input],
                counter: None,
                new: true,
            },
        );
    }

    fn put(&self, session_id: SessionId, entry: Entry) {
        if entry.messages.len() > self.budget {
            return;
        }
        let mut inner = self.inner();
        inner.held += entry.messages.len();
        if let Some(replaced) = inner.entries.insert(session_id, entry) {
            inner.held -= replaced.messages.len();
        }
        while inner.held > self.budget {
            match inner.entries.remove_lru() {
                Some((_, dropped)) => inner.held -= dropped.messages.len(),
                None => break,
            }
        }
    }
}

impl Default for ContextCache {
    fn default() -> Self {
        Self::new(CACHED_MESSAGES)
    }
}
