//! Group commit of starts: the runs created while the previous batch was being written are
//! stored together, in one transaction
//! ([`RunStore::create_runs`](crate::store::RunStore::create_runs)), by one task. Under a burst
//! of creates every request waits for one commit, not for the commits of all the requests ahead
//! of it; alone, a create is written at once.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use crate::domain::RunRecord;
use crate::store::{NewRun, Store, StoreError, StoreResult};

/// Runs stored in one transaction at most.
const MAX_BATCH: usize = 128;

/// A create waiting for its batch.
type Pending = (NewRun, oneshot::Sender<StoreResult<RunRecord>>);

/// Handle to the task that stores new runs.
#[derive(Debug, Clone)]
pub(super) struct Admission {
    queue: mpsc::UnboundedSender<Pending>,
}

impl Admission {
    /// Starts the writer task; it ends when every handle is dropped.
    pub(super) fn start(store: Arc<dyn Store>) -> Self {
        let (queue, receiver) = mpsc::unbounded_channel();
        tokio::spawn(write_loop(store, receiver));
        Self { queue }
    }

    /// Stores the run with its user message (and its new session), as
    /// [`RunStore::create_run`](crate::store::RunStore::create_run).
    ///
    /// # Errors
    /// [`RunStore::create_run`](crate::store::RunStore::create_run)'s.
    pub(super) async fn create(&self, run: NewRun) -> StoreResult<RunRecord> {
        let (done, result) = oneshot::channel();
        self.queue
            .send((run, done))
            .map_err(|_| StoreError::Database(sqlx::Error::WorkerCrashed))?;
        result
            .await
            .map_err(|_| StoreError::Database(sqlx::Error::WorkerCrashed))?
    }
}

async fn write_loop(store: Arc<dyn Store>, mut receiver: mpsc::UnboundedReceiver<Pending>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while receiver.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let (runs, waiting): (Vec<NewRun>, Vec<_>) = batch.drain(..).unzip();
        let results = store.create_runs(&runs).await;
        for (done, result) in waiting.into_iter().zip(results) {
            // A request that went away (client disconnected) does not need the answer; its run
            // is stored and starts all the same.
            let _ = done.send(result);
        }
    }
}
