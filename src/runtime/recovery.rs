//! Ownership and recovery: each active run is owned by one process through a lease in the
//! store, renewed while the run lives; a run whose lease expired (its process died) is taken
//! over — at startup, and by a periodic scan that later lets any replica on a shared PostgreSQL
//! take over a dead replica's runs — and resumed from its snapshot and committed messages, or
//! failed (`[runtime] recovery`). A run taken over has its log read once, into its trail: the
//! run resumes from it (`resume.rs` decides where) or ends through the close-out (`end.rs`).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use chrono::Utc;

use super::end::{self, EndError};
use super::trail::RunTrail;
use super::{Runtime, TraceContext};
use crate::config::Recovery;
use crate::domain::{ErrorClass, RunEnd, RunId, RunRecord, RunStatus};
use crate::store::{ClaimedRun, Lease, StoreError, unix_ms};

/// Why a claimed run could not be taken over (logged; the run is claimed again once its new
/// lease expires).
#[derive(Debug, thiserror::Error)]
enum AdoptError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The event log's flush failed: the writer stopped, or the batch holding it failed (with
    /// the store's error).
    #[error(transparent)]
    Log(#[from] super::LogError),
}

impl From<EndError> for AdoptError {
    fn from(error: EndError) -> Self {
        match error {
            EndError::Log(error) => Self::Log(error),
            EndError::Store(error) => Self::Store(error),
        }
    }
}

/// Runs one recovery scan takes over at most.
const CLAIM_BATCH: u32 = 1000;

/// How long a takeover waits for an old task of the same run in this process to stop (an
/// aborted task returns at its next await: far less in practice).
const STALE_TASK_BOUND: std::time::Duration = std::time::Duration::from_secs(10);

impl Runtime {
    /// This process's lease on a run, from now.
    pub(super) fn lease(&self) -> Lease {
        let ttl = i64::try_from(self.config.lease_ttl_ms).unwrap_or(i64::MAX);
        Lease {
            owner: self.owner.to_string(),
            expires_ms: self.store_now_ms().saturating_add(ttl),
        }
    }

    /// Now on the database's clock (as last measured), ms since the Unix epoch: the time
    /// leases are given and compared in.
    pub(super) fn store_now_ms(&self) -> i64 {
        unix_ms(Utc::now()).saturating_add(self.clock_offset_ms.load(Ordering::Relaxed))
    }

    /// Measures the database clock's offset from this process's (half the round trip
    /// counted), for [`Self::store_now_ms`].
    async fn measure_clock(&self) -> Result<(), StoreError> {
        let before = unix_ms(Utc::now());
        let Some(database) = self.store.database_now_ms().await? else {
            return Ok(());
        };
        let after = unix_ms(Utc::now());
        let offset = database - (before + (after - before) / 2);
        let previous = self.clock_offset_ms.swap(offset, Ordering::Relaxed);
        if (offset - previous).abs() > 1_000 {
            tracing::warn!(
                offset_ms = offset,
                "this process's clock differs from the database's; lease times use the database's"
            );
        }
        Ok(())
    }

    /// Takes over the runs left non-terminal by processes that are gone, and resumes or fails
    /// each (`[runtime] recovery`). At startup on SQLite (one process by design) every such
    /// run is taken at once; otherwise only runs whose lease has expired. A run whose cancel
    /// was requested meanwhile is cancelled. Returns how many runs were taken over.
    ///
    /// # Errors
    /// The store's.
    pub async fn recover(self: &Arc<Self>) -> Result<usize, StoreError> {
        // Lease times come from the database's clock from the first claim on.
        self.measure_clock().await?;
        self.take_over(self.store.single_process()).await
    }

    async fn take_over(self: &Arc<Self>, all: bool) -> Result<usize, StoreError> {
        if self.is_stopping() {
            return Ok(0);
        }
        let claimed = self
            .store
            .claim_runs(&self.lease(), self.store_now_ms(), all, CLAIM_BATCH)
            .await?;
        let count = claimed.len();
        for run in claimed {
            let run_id = run.record.id;
            if let Err(error) = self.adopt(run).await {
                tracing::error!(%run_id, %error, "could not take over the run");
            }
        }
        if count > 0 {
            tracing::info!(
                runs = count,
                recovery = ?self.config.recovery,
                "took over runs left active by a stopped process"
            );
        }
        Ok(count)
    }

    /// Resumes, fails or cancels a run just claimed, from its log read once.
    ///
    /// # Errors
    /// [`AdoptError`]: the store's error, or the event log's when the flush of a stopped
    /// task's events failed (its store error kept: a database error is not a corrupt log).
    async fn adopt(self: &Arc<Self>, run: ClaimedRun) -> Result<(), AdoptError> {
        let record = run.record;
        let stale = self.active().get(&record.id).map(|run| {
            run.abandon.cancel();
            run.ended.clone()
        });
        if let Some(ended) = stale {
            // This process claimed back a run an old task of its own still executes: it was
            // frozen past its lease, a peer took the run over, and the peer's lease expired in
            // turn. The old task works from a log that has moved on: it stops first, then the
            // run resumes from the stored log (its late events are refused by the store).
            tracing::warn!(run_id = %record.id, "claimed back a run whose old task still ran here; stopping it to resume from the log");
            if tokio::time::timeout(STALE_TASK_BOUND, ended.cancelled())
                .await
                .is_err()
            {
                return Err(StoreError::Timeout("stopping the run's old task").into());
            }
        }
        // Events a stopped task of this run enqueued are committed (or refused) before its
        // log is read, so the resumed run's sequences follow them.
        self.log.flush().await?;
        let trail = RunTrail::load(self.store.as_ref(), record.id).await?;
        if trail.end().is_some() {
            tracing::error!(run_id = %record.id, "the run's log has its terminal event, its record does not; left as it is");
            return Ok(());
        }
        if run.cancel_requested {
            return Ok(self.end_orphan(&record, trail, RunEnd::Cancelled).await?);
        }
        if run.takeovers > self.config.max_takeovers {
            tracing::error!(run_id = %record.id, takeovers = run.takeovers, "the run's process died every time it executed it: failed, not resumed again");
            let end = RunEnd::failed(
                ErrorClass::CrashLoop,
                format!(
                    "the server process executing the run stopped {} times in a row without the \
                     run committing a new message (it was resumed {} times); it is failed \
                     instead of resumed again (`[runtime] max_takeovers` = {})",
                    run.takeovers,
                    run.takeovers - 1,
                    self.config.max_takeovers
                ),
            );
            return Ok(self.end_orphan(&record, trail, end).await?);
        }
        if let Some(error) = trail.broken() {
            tracing::error!(run_id = %record.id, %error, "the run's log does not fold: the run is failed, not resumed");
            let end = RunEnd::failed(
                ErrorClass::Internal,
                format!(
                    "the server stopped while the run was active, and its event log cannot be \
                     resumed ({error})"
                ),
            );
            return Ok(self.end_orphan(&record, trail, end).await?);
        }
        let model = self
            .providers
            .get(&record.provider)
            .and_then(|entry| entry.config.models.get(&record.model).copied());
        // A run waiting for its client was not interrupted: its wait resumes whatever
        // `recovery` says.
        let waiting = record.status == RunStatus::RequiresAction;
        let error = match (self.config.recovery, model) {
            (_, Some(model)) if waiting => {
                let trace = trace_of(&trail, record.id);
                self.start(record, model, trace, trail);
                return Ok(());
            }
            (Recovery::Resume, Some(model)) => {
                let trace = trace_of(&trail, record.id);
                self.start(record, model, trace, trail);
                return Ok(());
            }
            (Recovery::Resume, None) => format!(
                "the server stopped while the run was active, and its model `{}` of provider `{}` \
                 is no longer configured",
                record.model, record.provider
            ),
            (Recovery::Fail, _) => "the server stopped while the run was active".to_owned(),
        };
        Ok(self
            .end_orphan(
                &record,
                trail,
                RunEnd::failed(ErrorClass::Interrupted, error),
            )
            .await?)
    }

    /// Ends a run no task of this process executes (a claimed or orphaned one) as `end`,
    /// through the close-out, from its `trail`.
    pub(super) async fn end_orphan(
        &self,
        run: &RunRecord,
        trail: RunTrail,
        end: RunEnd,
    ) -> Result<(), EndError> {
        let reason = end::open_call_reason(&end);
        let trace = trace_of(&trail, run.id);
        let span = self.run_span(run, trace.clone(), true);
        let emitter = self
            .log
            .emitter(run.id, trail, trace)
            .with_span(span)
            .with_webhook(run.webhook.as_ref());
        end::close_out(&self.store, &emitter, run, end, reason, None)
            .await
            .map(|_| ())
    }
}

/// The trace context of a run continued by this process: its first event's trace (a resumed
/// run stays in its trace), a new span whose parent is the run span of the first event (that of
/// the process that started the run).
fn trace_of(trail: &RunTrail, run_id: RunId) -> TraceContext {
    match trail.trace() {
        Some((trace_id, span_id)) => TraceContext {
            trace_id: trace_id.to_owned(),
            span_id: crate::telemetry::trace::new_span_id(),
            parent_span_id: span_id.to_owned(),
            sampled: true,
        },
        None => TraceContext::for_run(run_id),
    }
}

/// Renews this process's leases every third of the lease time, aborts local runs whose lease
/// another process took, passes on cancels requested through the store, and takes over runs
/// whose lease expired (a scan in its own task: a slow scan never delays a renewal). Ends when
/// the runtime is dropped or stops.
///
/// Fail-stop: on a shared database, when no renewal has confirmed the leases and the next
/// tick would come after they expire, the local runs are stopped where they are (their model
/// and tool calls too), before a peer may take them over; once a renewal succeeds again the
/// runs still leased here are resumed from their logs.
pub(super) async fn lease_loop(runtime: Weak<Runtime>, ttl: Duration) {
    let period = (ttl / 3).max(Duration::from_millis(100));
    let period_ms = i64::try_from(period.as_millis()).unwrap_or(i64::MAX);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    // The expiry the last successful renewal gave this process's leases.
    let mut confirmed_until: Option<i64> = None;
    let mut fail_stopped: Vec<RunId> = Vec::new();
    loop {
        tick.tick().await;
        let Some(runtime) = runtime.upgrade() else {
            return;
        };
        if runtime.stop.is_cancelled() {
            return;
        }
        let lease = runtime.lease();
        // Only runs whose lease was committed before the renewal can be missing from it
        // because another process took them; a run created meanwhile is not lost.
        let leased: Vec<RunId> = runtime
            .active()
            .iter()
            .filter(|(_, run)| run.leased)
            .map(|(id, _)| *id)
            .collect();
        let renewed = tokio::time::timeout(
            period,
            runtime.store.renew_leases(&lease.owner, lease.expires_ms),
        )
        .await
        .unwrap_or_else(|_| Err(StoreError::Timeout("renewing the leases")));
        match renewed {
            Ok(renewal) => {
                confirmed_until = Some(lease.expires_ms);
                runtime.leases_confirmed.store(true, Ordering::Release);
                let lost: Vec<RunId> = leased
                    .into_iter()
                    .filter(|id| !renewal.owned.contains(id))
                    .collect();
                for run_id in lost {
                    // A run that just ended is not renewed either; only a live one was lost.
                    let ended = runtime
                        .store
                        .get_run(run_id)
                        .await
                        .map(|run| run.is_none_or(|run| run.status.is_terminal()));
                    if matches!(ended, Ok(false)) {
                        tracing::warn!(%run_id, "lost the run's lease to another process; stopping it here");
                        runtime.abandon(run_id);
                    }
                }
                for run_id in renewal.cancel_requested {
                    if let Some(run) = runtime.active().get(&run_id) {
                        run.cancel.cancel();
                    }
                }
                fail_stopped = runtime
                    .resume_fail_stopped(fail_stopped, &renewal.owned)
                    .await;
            }
            Err(error) => {
                tracing::warn!(%error, "lease renewal failed");
                // The next decision can come two periods from now (this iteration's clock
                // read and the next renewal are each bounded by a period, and the tick may wait
                // one): the leases are stopped now unless they surely outlive it. Looking one
                // period ahead let a renewal that failed just short of that stop the runs a
                // period after their leases expired.
                let expiring = confirmed_until.is_none_or(|until| {
                    runtime.store_now_ms().saturating_add(2 * period_ms) >= until
                });
                if !runtime.store.single_process() && expiring {
                    runtime.leases_confirmed.store(false, Ordering::Release);
                    for run_id in leased {
                        tracing::warn!(%run_id, "cannot confirm the run's lease before it expires; stopping it here (fail-stop)");
                        runtime.abandon(run_id);
                        if !fail_stopped.contains(&run_id) {
                            fail_stopped.push(run_id);
                        }
                    }
                }
            }
        }
        // After the renewal, and bounded like it: a database that does not answer must not
        // hold the loop before the renewal whose failure stops the runs (fail-stop).
        match tokio::time::timeout(period, runtime.measure_clock()).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(%error, "could not read the database's clock"),
            Err(_) => tracing::warn!("the database's clock did not answer in time"),
        }
        runtime.spawn_scan();
    }
}

impl Runtime {
    /// Starts a takeover scan unless one is running.
    pub(super) fn spawn_scan(self: &Arc<Self>) {
        if self.scanning.swap(true, Ordering::AcqRel) {
            return;
        }
        let runtime = self.clone();
        self.tasks.spawn(async move {
            if let Err(error) = runtime.take_over(false).await {
                tracing::warn!(%error, "recovery scan failed");
            }
            runtime.scanning.store(false, Ordering::Release);
        });
    }

    /// Resumes the runs a fail-stop stopped that this process still holds (the renewal just
    /// extended their leases); returns those still stopping (retried at the next tick).
    async fn resume_fail_stopped(
        self: &Arc<Self>,
        runs: Vec<RunId>,
        owned: &[RunId],
    ) -> Vec<RunId> {
        let mut waiting = Vec::new();
        for run_id in runs {
            if !owned.contains(&run_id) {
                continue;
            }
            if self.active().contains_key(&run_id) {
                waiting.push(run_id);
                continue;
            }
            // The stopped run's last events may still be queued in the writer (its task was
            // aborted after enqueueing them; this process still holds the lease, so they are
            // not fenced): resumed before they commit, the run would reuse their sequences.
            if let Err(error) = self.log.flush().await {
                tracing::warn!(%run_id, %error, "could not resume the run yet");
                waiting.push(run_id);
                continue;
            }
            match self
                .store
                .claim_run(run_id, &self.lease(), self.store_now_ms())
                .await
            {
                Ok(Some(claimed)) => {
                    tracing::info!(%run_id, "the leases are confirmed again; resuming the run");
                    if let Err(error) = self.adopt(claimed).await {
                        tracing::error!(%run_id, %error, "could not resume the run");
                    }
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(%run_id, %error, "could not resume the run yet");
                    waiting.push(run_id);
                }
            }
        }
        waiting
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::Config;
    use crate::domain::{MessageId, SessionId};
    use crate::events::{
        ContextBuilt, EventFeed, EventPayload, ModelStarted, RunStarted, TextDelta,
    };
    use crate::runtime::EventLog;
    use crate::store::{NewRun, RunChange, Store, log_reads};
    use crate::tools::ToolRegistry;

    async fn server(dir: &tempfile::TempDir, recovery: &str) -> (Arc<dyn Store>, Arc<Runtime>) {
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        let store = crate::store::connect(&url).await.unwrap();
        let config = Config::from_toml(&format!(
            "[providers.demo]\nkind = \"scripted\"\ntoken_delay_ms = 0\n\
             [providers.demo.models.demo]\ncontext_window = 32768\nmax_output_tokens = 4096\n\
             [runtime]\nrecovery = \"{recovery}\"\n"
        ))
        .unwrap();
        let runtime =
            crate::server::runtime(&config, store.clone(), Arc::new(ToolRegistry::default()))
                .unwrap();
        (store, runtime)
    }

    /// A run a dead process left in the middle of its first model call's text.
    async fn left_mid_stream(store: &Arc<dyn Store>) -> RunId {
        let run_id = RunId::new();
        let session_id = SessionId::new();
        store
            .create_run(&NewRun {
                id: run_id,
                session_id,
                create_session: true,
                provider: "demo".to_owned(),
                model: "demo".to_owned(),
                tool_choice: crate::domain::ToolChoice::default(),
                metadata: serde_json::json!({}),
                input: crate::domain::RunInput::from("hi").content(),
                user_message_id: MessageId::new(),
                tools: None,
                agent: None,
                definition: Default::default(),
                session_defaults: None,
                max_iterations: 5,
                client_request_id: None,
                request_hash: None,
                created_at: Utc::now(),
                lease: None,
            })
            .await
            .unwrap();
        let log = EventLog::start(
            store.clone(),
            Arc::new(EventFeed::new(8)),
            8,
            Arc::from("dead"),
        );
        let emitter = log.emitter(run_id, RunTrail::new(), TraceContext::for_run(run_id));
        let events = [
            EventPayload::RunStarted(RunStarted {
                session_id,
                provider: "demo".to_owned(),
                model: "demo".to_owned(),
            }),
            EventPayload::ContextBuilt(ContextBuilt { message_count: 1 }),
            EventPayload::ModelStarted(ModelStarted {
                provider: "demo".to_owned(),
                model: "demo".to_owned(),
                iteration: 1,
                message_id: None,
            }),
            EventPayload::TextDelta(TextDelta {
                delta: "Hel".to_owned(),
            }),
        ];
        emitter
            .emit_all(
                events
                    .into_iter()
                    .map(|e| (e, RunChange::default()))
                    .collect(),
            )
            .await
            .unwrap();
        run_id
    }

    async fn ended(store: &Arc<dyn Store>, run_id: RunId) -> RunRecord {
        for _ in 0..400 {
            let record = store.get_run(run_id).await.unwrap().unwrap();
            if record.status.is_terminal() {
                return record;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("run {run_id} did not end");
    }

    /// Recovery reads a taken-over run's log once, whether the run resumes, fails or is
    /// cancelled (a read is one `read_events` call: a log under 1000 events is one page).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn recovery_reads_a_run_s_log_once() {
        let dir = tempfile::tempdir().unwrap();
        let (store, runtime) = server(&dir, "resume").await;
        let resumed = left_mid_stream(&store).await;
        assert_eq!(log_reads::of(resumed), 0);
        assert_eq!(runtime.recover().await.unwrap(), 1);
        let record = ended(&store, resumed).await;
        assert_eq!(record.status, RunStatus::Completed, "{record:?}");
        assert_eq!(log_reads::of(resumed), 1, "the resumed run's log");

        let dir = tempfile::tempdir().unwrap();
        let (store, runtime) = server(&dir, "fail").await;
        let failed = left_mid_stream(&store).await;
        assert_eq!(runtime.recover().await.unwrap(), 1);
        let record = ended(&store, failed).await;
        assert_eq!(
            (record.status, record.error_class),
            (RunStatus::Failed, Some(ErrorClass::Interrupted))
        );
        assert_eq!(log_reads::of(failed), 1, "the failed run's log");

        // A cancel of a run no process executes ends it the same way.
        let cancelled = left_mid_stream(&store).await;
        runtime.cancel_run(cancelled).await.unwrap().unwrap();
        assert_eq!(ended(&store, cancelled).await.status, RunStatus::Cancelled);
        assert_eq!(log_reads::of(cancelled), 1, "the cancelled run's log");
    }

    /// A cancel that ends a run no process executes, whose events the database refuses,
    /// fails with the database's own error (through the event log's batch), not a "corrupt
    /// record".
    #[tokio::test]
    async fn a_failed_orphan_cancel_keeps_the_database_error() {
        let dir = tempfile::tempdir().unwrap();
        let (store, runtime) = server(&dir, "resume").await;
        let run_id = left_mid_stream(&store).await;
        // The log still reads; every new event is refused by the database.
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
        sqlx::query(
            "CREATE TRIGGER refuse_events BEFORE INSERT ON events \
             BEGIN SELECT RAISE(ABORT, 'events refused'); END",
        )
        .execute(&pool)
        .await
        .unwrap();
        let error = runtime.cancel_run(run_id).await.unwrap_err();
        assert!(
            matches!(
                &error,
                crate::runtime::CancelError::Log(crate::runtime::LogError::Store(store_error))
                    if matches!(**store_error, StoreError::Database(_))
            ),
            "{error:?}"
        );
        assert!(error.to_string().contains("events refused"), "{error}");
    }

    /// A takeover whose flush of queued events fails (the batch it rode in could not be
    /// written) ends with the database's own error, not a "corrupt record".
    #[tokio::test]
    async fn a_failed_flush_at_takeover_keeps_the_database_error() {
        let dir = tempfile::tempdir().unwrap();
        let (store, runtime) = server(&dir, "resume").await;
        let run_id = left_mid_stream(&store).await;
        let claimed = store
            .claim_run(run_id, &runtime.lease(), runtime.store_now_ms())
            .await
            .unwrap()
            .expect("claimed");
        // The events table is gone: the next batch fails with the database's error.
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
        sqlx::query("ALTER TABLE events RENAME TO events_gone")
            .execute(&pool)
            .await
            .unwrap();
        // An event queued before the takeover's flush rides in its batch: the writer task
        // runs only once this test's task waits (one thread).
        let emitter = runtime
            .log
            .emitter(run_id, RunTrail::new(), TraceContext::for_run(run_id));
        let queued = emitter.emit(EventPayload::TextDelta(TextDelta {
            delta: "lo".to_owned(),
        }));
        assert!(futures::FutureExt::now_or_never(queued).is_none());
        let error = runtime.adopt(claimed).await.unwrap_err();
        assert!(
            matches!(
                &error,
                AdoptError::Log(crate::runtime::LogError::Store(store_error))
                    if matches!(**store_error, StoreError::Database(_))
            ),
            "{error:?}"
        );
    }
}
