//! The event log: persist, then publish. One writer task group-commits whatever events are
//! queued (up to `max_batch_events`) in one transaction, then folds them into their runs'
//! trails, publishes them to the live feed and acknowledges each emitter. Per-run emitters
//! assign contiguous sequences under a lock, so the queue order is the sequence order.

use std::sync::{Arc, Mutex, PoisonError};

use chrono::Utc;
use tokio::sync::{mpsc, oneshot};

use super::trail::RunTrail;
use crate::domain::{RunEnd, RunId};
use crate::events::{AgentEvent, EventFeed, EventPayload, LoggedEvent};
use crate::store::{EventWrite, Refused, RunChange, Store, StoreError};
use crate::telemetry;

/// Why an event could not be logged.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// The store rejected the batch holding the event: its error, of its own kind (a
    /// database error stays one), shared by every emitter of the batch.
    #[error("event log write failed: {0}")]
    Store(#[source] Arc<StoreError>),
    /// The run's log is closed: its terminal event was written.
    #[error("the run's event log is closed")]
    Closed,
    /// The writer task is gone (shutdown).
    #[error("the event log writer stopped")]
    WriterGone,
    /// The event could not be serialized (a bug).
    #[error("event serialization failed: {0}")]
    Serialize(String),
    /// Another process holds the run's lease now: this one may no longer write its log.
    #[error("the run is owned by another process")]
    Fenced,
    /// The run's completion or failure was not written: a cancel was recorded first, so the
    /// run ends cancelled.
    #[error("a cancel was recorded before the run's end")]
    CancelRequested,
}

/// Events of one emit: written in one transaction (never split across batches).
struct Pending {
    writes: Vec<EventWrite>,
    /// The same events typed, folded into the run's trail once durable (nothing is parsed).
    events: Vec<AgentEvent>,
    trail: Option<Arc<Mutex<RunTrail>>>,
    done: oneshot::Sender<Result<(), LogError>>,
}

/// Handle to the group-commit writer; cheap to clone.
#[derive(Clone, Debug)]
pub struct EventLog {
    queue: mpsc::UnboundedSender<Pending>,
    feed: Arc<EventFeed>,
    /// Notified once a batch holding a webhook delivery is committed (the delivery worker).
    webhook_wake: Arc<tokio::sync::Notify>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sequences: Vec<u64> = self.writes.iter().map(|w| w.event.sequence).collect();
        f.debug_struct("Pending")
            .field("sequences", &sequences)
            .finish()
    }
}

impl EventLog {
    /// Starts the writer task; it ends when every `EventLog` handle is dropped.
    /// Writes are fenced by `owner`'s leases
    /// ([`EventStore::append_events_as`](crate::store::EventStore::append_events_as)).
    #[must_use]
    pub fn start(
        store: Arc<dyn Store>,
        feed: Arc<EventFeed>,
        max_batch: usize,
        owner: Arc<str>,
    ) -> Self {
        let (queue, receiver) = mpsc::unbounded_channel();
        let webhook_wake = Arc::new(tokio::sync::Notify::new());
        tokio::spawn(write_loop(
            store,
            feed.clone(),
            receiver,
            max_batch.max(1),
            owner,
            webhook_wake.clone(),
        ));
        Self {
            queue,
            feed,
            webhook_wake,
        }
    }

    /// Notified each time a batch holding a webhook delivery was committed.
    #[must_use]
    pub fn webhook_wake(&self) -> Arc<tokio::sync::Notify> {
        self.webhook_wake.clone()
    }

    /// Waits until every event enqueued before this call is committed (or its batch failed).
    ///
    /// # Errors
    /// [`LogError::WriterGone`] when the writer stopped; the store's error of that batch.
    pub async fn flush(&self) -> Result<(), LogError> {
        let (done, ack) = oneshot::channel();
        self.queue
            .send(Pending {
                writes: Vec::new(),
                events: Vec::new(),
                trail: None,
                done,
            })
            .map_err(|_| LogError::WriterGone)?;
        ack.await.map_err(|_| LogError::WriterGone)?
    }

    /// The live feed events are published to.
    #[must_use]
    pub fn feed(&self) -> &Arc<EventFeed> {
        &self.feed
    }

    /// An emitter for a run whose log folds into `trail` so far (a new run's is empty); the
    /// emitter keeps it current with every event it writes.
    #[must_use]
    pub fn emitter(&self, run_id: RunId, trail: RunTrail, trace: TraceContext) -> RunEmitter {
        let last_sequence = trail.last_sequence();
        RunEmitter {
            run_id,
            trace,
            log: self.clone(),
            state: Mutex::new(EmitterState {
                next_sequence: last_sequence + 1,
                closed: trail.end().is_some(),
            }),
            first_sequence: last_sequence + 1,
            trail: Arc::new(Mutex::new(trail)),
            span: Mutex::new(None),
            webhook: None,
        }
    }
}

async fn write_loop(
    store: Arc<dyn Store>,
    feed: Arc<EventFeed>,
    mut receiver: mpsc::UnboundedReceiver<Pending>,
    max_batch: usize,
    owner: Arc<str>,
    webhook_wake: Arc<tokio::sync::Notify>,
) {
    let mut batch = Vec::with_capacity(max_batch);
    while receiver.recv_many(&mut batch, max_batch).await > 0 {
        let mut writes = Vec::with_capacity(batch.len());
        let mut acks = Vec::with_capacity(batch.len());
        for pending in batch.drain(..) {
            acks.push((
                pending.writes.len(),
                pending.events,
                pending.trail,
                pending.done,
            ));
            writes.extend(pending.writes);
        }
        let started = std::time::Instant::now();
        let result = append_with_retry(store.as_ref(), &owner, &writes)
            .await
            .map_err(Arc::new);
        if result.is_ok() {
            telemetry::metrics::event_batch(writes.len(), started.elapsed());
            if writes.iter().any(|write| write.change.webhook.is_some()) {
                webhook_wake.notify_one();
            }
        }
        let mut written = writes.into_iter();
        for (count, events, trail, done) in acks {
            let ack = match &result {
                Ok(refused) => {
                    let mut ack = Ok(());
                    for write in written.by_ref().take(count) {
                        if refused.fenced.contains(&write.run_id) {
                            ack = Err(LogError::Fenced);
                        } else if write.outcome.is_some()
                            && refused.cancelled.contains(&write.run_id)
                        {
                            ack = Err(LogError::CancelRequested);
                        } else {
                            feed.publish(write.run_id, &write.event);
                        }
                    }
                    if ack.is_ok()
                        && let Some(trail) = trail
                    {
                        record(&trail, &events);
                    }
                    ack
                }
                Err(error) => Err(LogError::Store(error.clone())),
            };
            // An emitter that stopped waiting (cancelled run) does not need the ack.
            let _ = done.send(ack);
        }
    }
}

/// Folds durable events into their run's trail. An event the trail rejects is a bug of the
/// runtime (it wrote a log no run can have); it is logged, and the run goes on.
fn record(trail: &Mutex<RunTrail>, events: &[AgentEvent]) {
    let mut trail = trail.lock().unwrap_or_else(PoisonError::into_inner);
    for event in events {
        if let Err(error) = trail.record(event) {
            tracing::error!(run_id = %event.run_id, %error, "the run's log does not fold (a bug)");
        }
    }
}

/// Transient store errors (busy database, dropped connection) get a few quick retries before
/// the batch is reported failed.
async fn append_with_retry(
    store: &dyn Store,
    owner: &str,
    writes: &[EventWrite],
) -> Result<Refused, StoreError> {
    let mut delay = std::time::Duration::from_millis(20);
    let mut attempt = 1;
    loop {
        match store.append_events_as(Some(owner), writes).await {
            Ok(refused) => {
                if !refused.fenced.is_empty() {
                    tracing::warn!(
                        fenced = ?refused.fenced,
                        "events of runs another process owns were not written"
                    );
                }
                return Ok(refused);
            }
            Err(error) if attempt < 4 => {
                tracing::warn!(%error, attempt, "event batch write failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 4;
                attempt += 1;
            }
            Err(error) => {
                tracing::error!(%error, events = writes.len(), "event batch write failed");
                return Err(error);
            }
        }
    }
}

pub use crate::telemetry::trace::TraceContext;

#[derive(Debug)]
struct EmitterState {
    next_sequence: u64,
    closed: bool,
}

/// Emits one run's events with contiguous sequences; after the terminal event it refuses more.
#[derive(Debug)]
pub struct RunEmitter {
    run_id: RunId,
    trace: TraceContext,
    log: EventLog,
    state: Mutex<EmitterState>,
    /// The sequence of the first event this emitter writes.
    first_sequence: u64,
    /// The run's trail, current with every event written (by the log's writer, before it
    /// acknowledges them).
    trail: Arc<Mutex<RunTrail>>,
    /// The run's span in this process, ended with the terminal event (or when dropped).
    span: Mutex<Option<telemetry::trace::Span>>,
    /// The run's webhook URL: its terminal event and each `tool_calls_required` write a
    /// delivery to the outbox in their transaction.
    webhook: Option<Arc<str>>,
}

impl RunEmitter {
    /// The run this emitter writes for.
    #[must_use]
    pub fn run_id(&self) -> RunId {
        self.run_id
    }

    /// The trace context of the run's span: events emitted outside a model call's or a tool
    /// execution's span carry its `span_id`.
    #[must_use]
    pub fn trace(&self) -> &TraceContext {
        &self.trace
    }

    /// The run's trail as of every event acknowledged so far (a copy).
    #[must_use]
    pub fn trail(&self) -> RunTrail {
        self.trail
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The sequence of the first event this emitter writes: events before it were written by
    /// an earlier process (or emitter) of the run.
    #[must_use]
    pub fn first_sequence(&self) -> u64 {
        self.first_sequence
    }

    /// Waits until every event enqueued so far (by any emitter) is durable and folded into
    /// its trail, or its batch failed.
    ///
    /// # Errors
    /// [`LogError::WriterGone`] when the writer stopped; the store's error of that batch.
    pub async fn flush(&self) -> Result<(), LogError> {
        self.log.flush().await
    }

    /// Gives the emitter the run's span, ended with the terminal event.
    #[must_use]
    pub fn with_span(self, span: telemetry::trace::Span) -> Self {
        *self.span.lock().unwrap_or_else(PoisonError::into_inner) = Some(span);
        self
    }

    /// Gives the emitter the run's webhook (none: nothing more is written).
    #[must_use]
    pub fn with_webhook(mut self, webhook: Option<&crate::domain::Webhook>) -> Self {
        self.webhook = webhook.map(|w| Arc::from(w.url.as_str()));
        self
    }

    /// Logs an event and waits until it is durable (and published). Returns its sequence.
    ///
    /// # Errors
    /// [`LogError`] when the log is closed or the write failed.
    pub async fn emit(&self, payload: EventPayload) -> Result<u64, LogError> {
        self.emit_with(payload, RunChange::default()).await
    }

    /// Logs an event together with the writes it announces (status, progress, a message), all
    /// in one transaction, and waits until they are durable. Returns its sequence.
    ///
    /// # Errors
    /// [`LogError`] when the log is closed or the write failed (then nothing was written).
    pub async fn emit_with(
        &self,
        payload: EventPayload,
        change: RunChange,
    ) -> Result<u64, LogError> {
        self.emit_all(vec![(payload, change)]).await
    }

    /// Logs several events in one transaction (all or none) and waits until they are durable.
    /// Returns the last one's sequence.
    ///
    /// # Errors
    /// [`LogError`] when the log is closed or the write failed (then none was written).
    pub async fn emit_all(&self, events: Vec<(EventPayload, RunChange)>) -> Result<u64, LogError> {
        let events = events.into_iter().map(|(p, c)| (p, None, c)).collect();
        let (first, last, ack) = self.enqueue(events)?;
        self.settle(first, last, ack).await
    }

    /// Logs the run's terminal event, built from `end` and the trail's iterations, with the
    /// run's final state (one transaction), and closes the log; a second call gets
    /// [`LogError::Closed`]. Called once every other event of the run is durable (the trail
    /// then holds its last model call).
    ///
    /// # Errors
    /// [`LogError`] when already closed or the write failed.
    pub async fn finish(&self, end: RunEnd) -> Result<u64, LogError> {
        let iterations = self
            .trail
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iterations();
        let payload = EventPayload::terminal(&end, iterations);
        let status = end.status().as_str();
        let error_class = end.error_class().map(|class| class.as_str());
        let finish_reason = end.finish_reason();
        let error = end.error().map(str::to_owned);
        let (first, last, ack) = self.enqueue(vec![(payload, Some(end), RunChange::default())])?;
        let result = self.settle(first, last, ack).await;
        if result.is_ok() {
            self.log.feed.close(self.run_id);
            telemetry::metrics::run_finished(status, error_class);
            let span = self
                .span
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            if let Some(span) = span {
                let error = error
                    .as_deref()
                    .map(|message| (error_class.unwrap_or("error"), message));
                telemetry::spans::end_run(span, status, Some(finish_reason), error);
            }
        }
        result
    }

    /// Waits for the write; when it failed, gives its sequence back (and reopens the log after a
    /// failed terminal event) so the stored log stays contiguous and a terminal event can still
    /// be written.
    async fn settle(
        &self,
        first: u64,
        last: u64,
        ack: oneshot::Receiver<Result<(), LogError>>,
    ) -> Result<u64, LogError> {
        let result = ack.await.unwrap_or(Err(LogError::WriterGone));
        if let Err(error) = result {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if state.next_sequence == last + 1 {
                state.next_sequence = first;
                state.closed = false;
            }
            return Err(error);
        }
        Ok(last)
    }

    /// Assigns contiguous sequences, serializes each event once, and queues them as one
    /// transaction. Returns the first and last sequence.
    #[expect(clippy::type_complexity, reason = "a private helper's tuple")]
    fn enqueue(
        &self,
        events: Vec<(EventPayload, Option<RunEnd>, RunChange)>,
    ) -> Result<(u64, u64, oneshot::Receiver<Result<(), LogError>>), LogError> {
        let (done, ack) = oneshot::channel();
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.closed {
            return Err(LogError::Closed);
        }
        let first = state.next_sequence;
        // The span the events are emitted in: a model call's or a tool execution's, else the
        // run's.
        let span_id = telemetry::trace::current_span_id()
            .map_or_else(|| self.trace.span_id.clone(), |id| id.to_string());
        let mut writes = Vec::with_capacity(events.len());
        let mut typed = Vec::with_capacity(events.len());
        let mut closed = false;
        for (offset, (payload, outcome, mut change)) in (0..).zip(events) {
            if closed {
                return Err(LogError::Closed);
            }
            let sequence = first + offset;
            let terminal = payload.is_terminal();
            closed = terminal;
            if self.webhook.is_some() {
                change.webhook = super::webhooks::due(self.webhook.as_ref(), &payload);
            }
            let event_type = payload.event_type().to_owned();
            let event = AgentEvent {
                sequence,
                run_id: self.run_id,
                timestamp: Utc::now(),
                trace_id: self.trace.trace_id.clone(),
                span_id: span_id.clone(),
                payload,
            };
            let data =
                serde_json::to_string(&event).map_err(|e| LogError::Serialize(e.to_string()))?;
            writes.push(EventWrite {
                run_id: self.run_id,
                event: Arc::new(LoggedEvent {
                    sequence,
                    event_type,
                    data: Arc::from(data),
                    terminal,
                }),
                outcome,
                change,
            });
            typed.push(event);
        }
        let Some(last) = writes.last().map(|w| w.event.sequence) else {
            return Err(LogError::Serialize("no events to log".to_owned()));
        };
        // Sent under the lock: queue order is sequence order.
        self.log
            .queue
            .send(Pending {
                writes,
                events: typed,
                trail: Some(self.trail.clone()),
                done,
            })
            .map_err(|_| LogError::WriterGone)?;
        state.next_sequence = last + 1;
        state.closed = closed;
        Ok((first, last, ack))
    }
}
