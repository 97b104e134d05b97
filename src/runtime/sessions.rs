//! The contexts sessions' runs start from, cached in this process so that starting a run does
//! not grow with its session's length: a run of a session seen before reads only the messages
//! stored since (its own user input, the previous run's answer), whichever process wrote them.
//! A compacted session is read from its latest compaction instead, which the store bounds.
//!
//! The cache is never trusted over the store: every load asks the store what changed after the
//! last message it holds. Messages are append-only and a session's are written by one run at a
//! time (a session has at most one active run), so "after the last message read" misses
//! nothing. The one exception is a session this process has just created with its first run:
//! nothing else can have written to it, so that run starts from its input without a read.

use std::sync::{Mutex, PoisonError};

use hashlink::LruCache;

use crate::domain::{Message, SessionId};
use crate::store::{ContextUpdate, SessionContext, Store, StoreResult};

/// Messages held across all cached sessions at most; the least recently started sessions are
/// dropped first (a dropped session's next run reads its context whole, once).
pub const CACHED_MESSAGES: usize = 200_000;

/// A session's messages, oldest first, as the store held them.
#[derive(Debug)]
struct Entry {
    messages: Vec<Message>,
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

    /// The session's context as [`Store::session_context`] reads it, reading only what was
    /// stored since this process last loaded the session.
    ///
    /// # Errors
    /// The store's.
    pub(super) async fn load(
        &self,
        store: &dyn Store,
        session_id: SessionId,
    ) -> StoreResult<SessionContext> {
        // Taken out while the store is asked (a concurrent load of the same session reads it
        // whole), put back with what was added.
        let mut cached = {
            let mut inner = self.inner();
            let entry = inner.entries.remove(&session_id);
            if let Some(entry) = &entry {
                inner.held -= entry.messages.len();
            }
            entry
        };
        if let Some(mut entry) = cached.take_if(|entry| entry.new) {
            entry.new = false;
            let context = SessionContext {
                compaction: None,
                messages: entry.messages.clone(),
                calibration: None,
            };
            self.put(session_id, entry);
            return Ok(context);
        }
        let after = cached
            .as_ref()
            .and_then(|entry| entry.messages.last())
            .map(|message| message.id);
        match store.session_context_after(session_id, after).await? {
            ContextUpdate::Compacted(context) => Ok(*context),
            ContextUpdate::Appended {
                messages,
                calibration,
            } => {
                let mut entry = cached.unwrap_or(Entry {
                    messages: Vec::new(),
                    new: false,
                });
                entry.messages.extend(messages);
                let context = SessionContext {
                    compaction: None,
                    messages: entry.messages.clone(),
                    calibration,
                };
                self.put(session_id, entry);
                Ok(context)
            }
        }
    }

    /// A session this process has just stored with its first run's `input`: that run loads
    /// it without a read.
    pub(super) fn created(&self, session_id: SessionId, input: Message) {
        self.put(
            session_id,
            Entry {
                messages: vec![input],
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
