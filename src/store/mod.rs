//! Persistence of sessions, messages, runs and events: a trait per concern ([`RunStore`],
//! [`EventStore`], [`SessionStore`], [`LeaseStore`], [`ActionStore`], [`SnapshotStore`],
//! [`CompactionStore`], [`RetentionStore`], [`WebhookStore`]) and one [`Store`] that combines them, implemented for
//! SQLite (the embedded default) and PostgreSQL. Both share the SQL in `sql/`, a file per
//! concern, and pass the same test suite.

mod lock;
mod postgres;
mod sql;
mod sqlite;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use crate::domain::{
    ActionAnswer, CircuitBreaker, Compaction, CompactionConfig, FinishReason, Message, MessageId,
    RequiredAction, Role, RunDefinition, RunEnd, RunId, RunRecord, RunStatus, RunTool, Session,
    SessionDefaults, SessionId, Snapshot, TokenUsage, ToolChoice, WebhookAttempt, WebhookClaim,
    WebhookDelivery, WebhookEventType,
};
use crate::events::LoggedEvent;

pub use lock::{DatabaseLock, lock_sqlite};
pub use postgres::{PostgresStore, SignalListener};
pub use sqlite::SqliteStore;

/// Applies the `migrator`'s pending migrations on `conn` and logs each one applied (`applied
/// migration`, with its version and description), or `database schema up to date`.
async fn migrate<C: sqlx::migrate::Migrate>(
    migrator: &sqlx::migrate::Migrator,
    conn: &mut C,
) -> Result<(), sqlx::migrate::MigrateError> {
    conn.lock().await?;
    let before = match conn.ensure_migrations_table().await {
        Ok(()) => conn.list_applied_migrations().await,
        Err(error) => Err(error),
    };
    conn.unlock().await?;
    let before: std::collections::HashSet<i64> =
        before?.iter().map(|applied| applied.version).collect();
    migrator.run_direct(conn).await?;
    let mut applied = 0;
    for migration in migrator.iter() {
        if !migration.migration_type.is_down_migration() && !before.contains(&migration.version) {
            applied += 1;
            tracing::info!(
                version = migration.version,
                description = %migration.description,
                "applied migration"
            );
        }
    }
    if applied == 0 {
        tracing::info!(migrations = before.len(), "database schema up to date");
    }
    Ok(())
}

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database failed or is unreachable.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// Migrations could not be applied.
    #[error("migration error: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The session named by a new run does not exist.
    #[error("session {0} not found")]
    SessionNotFound(SessionId),
    /// The session already has an active run.
    #[error("session {session_id} has an active run: {active_run}")]
    SessionBusy {
        /// The session.
        session_id: SessionId,
        /// Its active run.
        active_run: RunId,
    },
    /// Another session has this `external_id`.
    #[error("a session with external_id `{0}` exists")]
    ExternalIdTaken(String),
    /// A run with this client request id exists already.
    #[error("a run with this client_request_id exists: {}", existing.id)]
    DuplicateRequest {
        /// The existing run.
        existing: Box<RunRecord>,
        /// Whether the stored request fingerprint equals the new one.
        same_request: bool,
    },
    /// A stored value could not be read back (a bug or a foreign write).
    #[error("corrupt record: {0}")]
    Corrupt(String),
    /// The database URL is neither `sqlite:` nor `postgres:`.
    #[error(
        "unsupported database URL: supported are sqlite: (sqlite://PATH) and postgres: \
         (postgres://USER@HOST/DATABASE)"
    )]
    UnsupportedUrl,
    /// The run is not terminal (its snapshot cannot be deleted yet).
    #[error("run {0} is still active")]
    RunActive(RunId),
    /// Notifications sent through the database do not arrive on a listening connection.
    #[error("{0}")]
    SignalsUnavailable(String),
    /// The database did not answer in time (what was being done).
    #[error("the database did not answer in time ({0})")]
    Timeout(&'static str),
    /// Another process holds the SQLite database's lock (see [`lock_sqlite`]).
    #[error(
        "another behest process is using the SQLite database {} (it holds {}); stop it, or \
         give this server another --database-url",
        database.display(),
        lock.display()
    )]
    InUse {
        /// The database file.
        database: std::path::PathBuf,
        /// Its lock file.
        lock: std::path::PathBuf,
    },
    /// The SQLite database's lock file could not be created or locked.
    #[error("cannot lock the SQLite database: {}: {error}", path.display())]
    Lock {
        /// The lock file.
        path: std::path::PathBuf,
        /// Why.
        error: std::io::Error,
    },
}

/// Reads of each run's event log ([`Store::read_events`] calls), counted in the crate's unit
/// tests (e.g. that recovery reads a run's log once).
#[cfg(test)]
pub(crate) mod log_reads {
    use std::collections::HashMap;
    use std::sync::{Mutex, PoisonError};

    use crate::domain::RunId;

    static READS: Mutex<Option<HashMap<RunId, u32>>> = Mutex::new(None);

    pub(crate) fn count(run_id: RunId) {
        let mut reads = READS.lock().unwrap_or_else(PoisonError::into_inner);
        *reads
            .get_or_insert_with(HashMap::new)
            .entry(run_id)
            .or_default() += 1;
    }

    /// The run's log reads so far.
    pub(crate) fn of(run_id: RunId) -> u32 {
        let reads = READS.lock().unwrap_or_else(PoisonError::into_inner);
        reads
            .as_ref()
            .and_then(|r| r.get(&run_id))
            .copied()
            .unwrap_or(0)
    }
}

/// Shorthand for store results.
pub type StoreResult<T> = Result<T, StoreError>;

/// A run to create, with its first (user) message.
#[derive(Debug, Clone)]
pub struct NewRun {
    /// The new run's id.
    pub id: RunId,
    /// The session: an existing one, or a new one to create with this id.
    pub session_id: SessionId,
    /// True when `session_id` is new and must be created.
    pub create_session: bool,
    /// Provider id.
    pub provider: String,
    /// Model name.
    pub model: String,
    /// Tool choice.
    pub tool_choice: ToolChoice,
    /// Client metadata (a JSON object).
    pub metadata: serde_json::Value,
    /// The user's input, stored as one user message with id `user_message_id` (its content
    /// parts: text, images).
    pub input: Vec<crate::domain::ContentPart>,
    /// Id of the user message.
    pub user_message_id: MessageId,
    /// The run's tools (server tool names, client tool definitions); `None`: every server tool.
    pub tools: Option<Vec<RunTool>>,
    /// The agent preset the run was defined from.
    pub agent: Option<String>,
    /// Instructions, parameters, provider options, approvals and limits in force.
    pub definition: RunDefinition,
    /// The session's defaults to store: for a new session, its defaults; for an existing
    /// session, written only when it has no run yet (its first run fills in what it lacks).
    pub session_defaults: Option<SessionDefaults>,
    /// Model calls the run may make at most.
    pub max_iterations: u32,
    /// Idempotency key.
    pub client_request_id: Option<String>,
    /// Fingerprint of the request, compared when the key is reused.
    pub request_hash: Option<String>,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// The creating process's lease on the run (none: unowned, any process may write it).
    pub lease: Option<Lease>,
}

/// A process's lease on a run: only the owner writes the run's events, and renews the lease
/// while the run lives; another process takes the run over once it has expired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The owning process's id (UUID v7, new at each start).
    pub owner: String,
    /// Expiry, in ms since the Unix epoch.
    pub expires_ms: i64,
}

/// The milliseconds since the Unix epoch of `time` (lease expiries).
#[must_use]
pub fn unix_ms(time: DateTime<Utc>) -> i64 {
    time.timestamp_millis()
}

/// A run taken over from a process whose lease expired.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedRun {
    /// The run as stored.
    pub record: RunRecord,
    /// A cancel was requested while another process owned it.
    pub cancel_requested: bool,
    /// How many times in a row the run was taken over from a process that died, without
    /// committing a message in between (this takeover included; 0 when it was released,
    /// or waits for its client).
    pub takeovers: u32,
}

/// What renewing a process's leases found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaseRenewal {
    /// The active runs the process still owns (their leases were extended).
    pub owned: Vec<RunId>,
    /// Those of them a cancel was requested for through the store (by another process).
    pub cancel_requested: Vec<RunId>,
}

/// Filter and page of `list_snapshots`, newest run first.
#[derive(Debug, Clone, Default)]
pub struct SnapshotFilter {
    /// Only snapshots of this session's runs.
    pub session_id: Option<SessionId>,
    /// Only snapshots in this status.
    pub status: Option<RunStatus>,
    /// Only runs older than this one (the cursor).
    pub before: Option<RunId>,
    /// Page size.
    pub limit: u32,
}

/// The snapshot an iteration boundary writes, in the transaction of its `model_started` (the
/// store adds the event's sequence, the status and the time).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SnapshotWrite {
    /// The run's session.
    pub session_id: SessionId,
    /// The iteration that begins.
    pub iteration: u32,
    /// Usage so far, in tokens.
    pub total_usage: TokenUsage,
    /// Tool calls made so far.
    pub tool_calls: u32,
}

/// Filter and page of `list_runs`, newest first.
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    /// Only runs of this session.
    pub session_id: Option<SessionId>,
    /// Only runs in this status.
    pub status: Option<RunStatus>,
    /// Only runs older than this one (the cursor).
    pub before: Option<RunId>,
    /// Page size.
    pub limit: u32,
}

/// One event to append, already serialized.
#[derive(Debug, Clone)]
pub struct EventWrite {
    /// The run.
    pub run_id: RunId,
    /// The event, as it will be replayed.
    pub event: Arc<LoggedEvent>,
    /// For the terminal event: how the run ended (its status, finish reason, error and error
    /// class), written in the same transaction.
    pub outcome: Option<RunEnd>,
    /// What else the event's transaction writes (status, progress, a message).
    pub change: RunChange,
}

/// The writes of a batch [`EventStore::append_events_as`] did not make.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Refused {
    /// Runs this writer may not write: another process holds the lease, or the batch's events
    /// of the run do not continue its stored log (a stopped emitter's late events after the
    /// run was resumed from the log). None of their events in the batch were written.
    pub fenced: Vec<RunId>,
    /// Runs whose terminal event (a completion or failure) was not written because a cancel
    /// had been recorded first (`request_cancel`); their other events were.
    pub cancelled: Vec<RunId>,
}

impl Refused {
    /// Nothing was refused.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.fenced.is_empty() && self.cancelled.is_empty()
    }
}

/// Writes that belong with an event, committed in its transaction: the event is the proof
/// that they happened, so neither can exist without the other.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunChange {
    /// A new non-terminal status (ignored once the run is terminal).
    pub status: Option<RunStatus>,
    /// Iterations so far and total usage, after a model call.
    pub progress: Option<(u32, TokenUsage)>,
    /// A message the event announces (`assistant_message_committed`, `tool_message_committed`).
    pub message: Option<Message>,
    /// The run's snapshot at an iteration boundary (`model_started`).
    pub snapshot: Option<SnapshotWrite>,
    /// Why the model stopped, recorded with the assistant message of a run's last turn so a
    /// run resumed before its terminal event still knows it.
    pub finish_reason: Option<FinishReason>,
    /// What the run waits for from now on (`tool_calls_required`, with status
    /// `requires_action`); any later status change clears it.
    pub required_action: Option<RequiredAction>,
    /// A compaction the event announces (`context_compacted`): stored, and the circuit breaker
    /// closed, in the event's transaction.
    pub compaction: Option<Compaction>,
    /// The session's token calibration after a model call that reported its usage
    /// (`usage_recorded`).
    pub calibration: Option<(SessionId, Calibration)>,
    /// A webhook delivery the event causes (a run's terminal event or `tool_calls_required`,
    /// for a run with a webhook): written to the outbox in the event's transaction, its
    /// payload the run record as the transaction leaves it.
    pub webhook: Option<WebhookDue>,
}

/// A delivery an event owes the run's webhook ([`RunChange::webhook`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookDue {
    /// The delivery's id (UUID v7): its `webhook-id`.
    pub id: uuid::Uuid,
    /// Where it is posted.
    pub url: Arc<str>,
    /// What it tells.
    pub event_type: WebhookEventType,
    /// When its first attempt is due, in ms since the Unix epoch.
    pub due_ms: i64,
}

/// The outbox as a delivery worker sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutboxState {
    /// Deliveries not delivered or failed yet.
    pub pending: u64,
    /// When the earliest of them is due, in ms since the Unix epoch.
    pub next_due_ms: Option<i64>,
}

/// The end of one delivery attempt, recorded by [`WebhookStore::record_webhook_attempt`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptRecord {
    /// The attempt as shown to clients.
    pub attempt: WebhookAttempt,
    /// When the next attempt is due (ms since the Unix epoch), for outcome `retry`.
    pub next_attempt_ms: Option<i64>,
}

/// What recording a client's answers to a paused run did.
#[derive(Debug, Clone, PartialEq)]
pub enum SubmitOutcome {
    /// Stored; the run may resume.
    Accepted,
    /// No such run.
    NotFound,
    /// The run is not waiting for these calls (any more): its status now.
    NotWaiting(RunStatus),
    /// The wait passed its deadline.
    Expired,
    /// This call was answered before.
    AlreadyAnswered(String),
}

/// A change of a session's title and metadata (`PATCH /sessions/{id}`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SessionPatch {
    /// A new title (`Some(None)` clears it).
    pub title: Option<Option<String>>,
    /// A new metadata object.
    pub metadata: Option<serde_json::Value>,
}

/// A session's token calibration: the input tokens the provider reported for the session's
/// last model call, and behest's own count of that same request. Their ratio corrects the next
/// estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Calibration {
    /// Input tokens the provider reported.
    pub reported_tokens: u64,
    /// behest's count of the same request (its tokenizer or estimate, uncorrected).
    pub counted_tokens: u64,
}

/// What a run starts from: the session's context as the model sees it, which does not grow with
/// the session's length once it has been compacted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SessionContext {
    /// The latest compaction (the one covering the most messages); `None` when the session was
    /// never compacted.
    pub compaction: Option<Compaction>,
    /// Without a compaction: every message, oldest first. After one: the session's system
    /// messages up to it, then the user input of the turn it ends in when the compaction covers
    /// it (the latest input, or an older one whose assistant message follows the compaction),
    /// then every message after the compaction, oldest first.
    pub messages: Vec<Message>,
    /// The calibration of the session's last model call, if one reported its usage.
    pub calibration: Option<Calibration>,
}

impl NewRun {
    /// The user message the run is stored with, as the store holds it.
    #[must_use]
    pub fn user_message(&self) -> Message {
        Message {
            id: self.user_message_id,
            session_id: self.session_id,
            run_id: self.id,
            role: crate::domain::Role::User,
            content: self.input.clone(),
            reasoning: Vec::new(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            tool_name: None,
            created_at: self.created_at,
            status: crate::domain::MessageStatus::default(),
        }
    }
}

/// A session's context since an earlier read ([`SessionStore::session_context_after`]).
#[derive(Debug, Clone, PartialEq)]
pub enum ContextUpdate {
    /// The session was never compacted: the messages after the earlier read, oldest first.
    Appended {
        /// The new messages.
        messages: Vec<Message>,
        /// The calibration of the session's last model call, if one reported its usage.
        calibration: Option<Calibration>,
    },
    /// The session was compacted: its whole context.
    Compacted(Box<SessionContext>),
}

/// The circuit breaker after a failed compaction was counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerFailure {
    /// Its state now.
    pub breaker: CircuitBreaker,
    /// True when this failure opened it (it was closed before).
    pub opened: bool,
}

/// The persistence the runtime and the API need: every concern's trait, implemented together
/// by [`SqliteStore`] and [`PostgresStore`]. Callers hold an `Arc<dyn Store>`; the concerns'
/// methods are called on it without importing their traits.
pub trait Store:
    RunStore
    + EventStore
    + SessionStore
    + LeaseStore
    + ActionStore
    + SnapshotStore
    + CompactionStore
    + RetentionStore
    + WebhookStore
    + std::fmt::Debug
{
}

impl<T> Store for T where
    T: RunStore
        + EventStore
        + SessionStore
        + LeaseStore
        + ActionStore
        + SnapshotStore
        + CompactionStore
        + RetentionStore
        + WebhookStore
        + std::fmt::Debug
{
}

/// Runs: admission (a run with its user message, in one transaction), reads and the runs
/// left active.
///
/// SQL: `store/sql/runs.rs`.
#[async_trait]
pub trait RunStore: Send + Sync {
    /// Creates the run (and its session when new) and stores the user input as one message,
    /// all in one transaction.
    ///
    /// # Errors
    /// [`StoreError::SessionNotFound`] when an existing session was named and is missing;
    /// [`StoreError::DuplicateRequest`] when the client request id was used before;
    /// [`StoreError::SessionBusy`] when the session has an active run. Nothing is written then.
    async fn create_run(&self, run: &NewRun) -> StoreResult<RunRecord>;

    /// [`RunStore::create_run`] for each run, in one transaction (group commit of starts): the
    /// results in the runs' order, each run's error its own (nothing of a failed run is
    /// written; the others are).
    async fn create_runs(&self, runs: &[NewRun]) -> Vec<StoreResult<RunRecord>>;

    /// The run, if it exists.
    async fn get_run(&self, id: RunId) -> StoreResult<Option<RunRecord>>;

    /// A page of runs, newest first.
    async fn list_runs(&self, filter: &RunFilter) -> StoreResult<Vec<RunRecord>>;

    /// Every run not in a terminal status (for recovery at startup).
    async fn active_runs(&self) -> StoreResult<Vec<RunRecord>>;
}

/// A run's event log: appending batches (with the writes each event proves, fenced by the
/// lease) and reading them back.
///
/// SQL: `store/sql/events.rs`.
#[async_trait]
pub trait EventStore: Send + Sync {
    /// Appends events (any runs, each run's in sequence order) in one transaction, with their
    /// [`RunChange`]s and terminal outcomes, without a lease check.
    async fn append_events(&self, events: &[EventWrite]) -> StoreResult<()> {
        self.append_events_as(None, events).await.map(|_| ())
    }

    /// Appends events like [`EventStore::append_events`], as the process `owner`: the events of a
    /// run whose lease another process holds are not written (fencing: a process that lost a
    /// run cannot write to its log), nor the events of a run that do not continue its stored
    /// log (the next sequences, in order: a stale writer's), nor a completion or failure of a
    /// run whose cancel was recorded first (it ends cancelled); the others are, in one
    /// transaction, so one run's stale writer never fails another run's events. Returns what
    /// was refused. `None` checks neither lease nor sequences.
    async fn append_events_as(
        &self,
        owner: Option<&str>,
        events: &[EventWrite],
    ) -> StoreResult<Refused>;

    /// Up to `limit` events of the run with `sequence > after`, in order.
    async fn read_events(
        &self,
        run_id: RunId,
        after: u64,
        limit: u32,
    ) -> StoreResult<Vec<LoggedEvent>>;

    /// The highest sequence stored for the run (0 when none).
    async fn last_sequence(&self, run_id: RunId) -> StoreResult<u64>;
}

/// Sessions and their messages, and the context a run starts from (with the session's token
/// calibration).
///
/// SQL: `store/sql/sessions.rs`.
#[async_trait]
pub trait SessionStore: Send + Sync {
    /// The session, if it exists.
    async fn get_session(&self, id: SessionId) -> StoreResult<Option<Session>>;

    /// A page of sessions, newest first, older than `before` when given.
    async fn list_sessions(
        &self,
        before: Option<SessionId>,
        limit: u32,
    ) -> StoreResult<Vec<Session>>;

    /// Creates a session without runs; returns it as stored (PostgreSQL keeps microseconds).
    /// [`StoreError::ExternalIdTaken`] when another session has its `external_id`.
    async fn create_session(&self, session: &Session) -> StoreResult<Session>;

    /// The session whose `external_id` (the id a web client chose) is `external_id`, if any.
    async fn session_by_external_id(&self, external_id: &str) -> StoreResult<Option<Session>>;

    /// Changes a session's title and metadata (and `updated_at`); `None` when it does not
    /// exist.
    async fn update_session(
        &self,
        id: SessionId,
        patch: &SessionPatch,
        now: DateTime<Utc>,
    ) -> StoreResult<Option<Session>>;

    /// Deletes the session with its runs, messages and events.
    ///
    /// # Errors
    /// [`StoreError::SessionBusy`] while it has an active run (nothing is deleted).
    async fn delete_session(&self, id: SessionId) -> StoreResult<bool>;

    /// The session's messages, oldest first.
    async fn session_messages(&self, session_id: SessionId) -> StoreResult<Vec<Message>>;

    /// Up to `limit` of the session's messages, oldest first, after the message `after` (from
    /// the start when `None`); reads only that page. `None` when `after` is not a message of
    /// the session.
    async fn session_messages_page(
        &self,
        session_id: SessionId,
        after: Option<MessageId>,
        limit: u32,
    ) -> StoreResult<Option<Vec<Message>>>;

    /// The run's messages with this role, oldest first.
    async fn run_messages(&self, run_id: RunId, role: Role) -> StoreResult<Vec<Message>>;

    /// The session's context for a run (see [`SessionContext`]): a few indexed reads whatever
    /// the session's length.
    async fn session_context(&self, session_id: SessionId) -> StoreResult<SessionContext>;

    /// What a session's context became since a run of this process loaded it up to the
    /// message `after` (`None`: nothing loaded yet): the messages stored after it while the
    /// session was never compacted (none when `after` is not the session's), its whole context
    /// (as [`SessionStore::session_context`] reads it) once it was. A few indexed reads
    /// whatever the session's length.
    async fn session_context_after(
        &self,
        session_id: SessionId,
        after: Option<MessageId>,
    ) -> StoreResult<ContextUpdate>;
}

/// Leases: which process owns an active run, takeovers of expired ones, and cancels requested
/// across processes.
///
/// SQL: `store/sql/leases.rs`.
#[async_trait]
pub trait LeaseStore: Send + Sync {
    /// True when only one process may use the store (SQLite): at startup, every run left
    /// active belongs to a process that is gone.
    fn single_process(&self) -> bool {
        false
    }

    /// Takes over non-terminal runs not owned by `lease.owner` whose lease has expired at
    /// `now_ms` (or that have none) — every one of them when `all` (a store only one process
    /// uses, at startup) — giving them `lease`. At most `limit`, oldest first.
    async fn claim_runs(
        &self,
        lease: &Lease,
        now_ms: i64,
        all: bool,
        limit: u32,
    ) -> StoreResult<Vec<ClaimedRun>>;

    /// Takes over one run like [`LeaseStore::claim_runs`] (for a cancel of a run no process owns).
    /// `None` when it is terminal, missing, or leased by a live owner.
    async fn claim_run(
        &self,
        run_id: RunId,
        lease: &Lease,
        now_ms: i64,
    ) -> StoreResult<Option<ClaimedRun>>;

    /// The database's clock, ms since the Unix epoch, for lease times that every replica reads
    /// the same (PostgreSQL's `clock_timestamp()`); `None` for a store one process uses, whose
    /// clock is the process's.
    async fn database_now_ms(&self) -> StoreResult<Option<i64>>;

    /// Sends `signal` to every replica listening (PostgreSQL `NOTIFY`); nothing on a store one
    /// process uses.
    async fn send_signal(&self, signal: Signal) -> StoreResult<()>;

    /// This process's listener for other replicas' [`Signal`]s (one connection), checked by a
    /// probe: a signal sent through the pool must arrive within 2 s. `None` on a store one
    /// process uses.
    ///
    /// # Errors
    /// [`StoreError::SignalsUnavailable`] when the probe does not arrive (e.g. through a
    /// transaction-mode pooler, which does not carry `LISTEN`), or the connection's error.
    async fn listen(&self) -> StoreResult<Option<SignalListener>>;

    /// Extends the lease of every active run `owner` holds to `expires_ms`.
    async fn renew_leases(&self, owner: &str, expires_ms: i64) -> StoreResult<LeaseRenewal>;

    /// Ends `owner`'s leases (at shutdown) so the next process takes its runs over at once.
    async fn release_leases(&self, owner: &str) -> StoreResult<()>;

    /// Records a cancel for the process that owns (or next takes over) an active run. False
    /// when the run is terminal or missing.
    async fn request_cancel(&self, run_id: RunId) -> StoreResult<bool>;
}

/// A paused run's required action: the client's answers to the calls it waits for.
///
/// SQL: `store/sql/actions.rs`.
#[async_trait]
pub trait ActionStore: Send + Sync {
    /// Records answers to the calls a paused run waits for, in one transaction serialized with
    /// [`ActionStore::close_action`]: only while the run is `requires_action` for the assistant
    /// message `message_id` and before its deadline (`now_ms`), and only for calls not answered
    /// before (all or none are stored).
    async fn submit_answers(
        &self,
        run_id: RunId,
        message_id: MessageId,
        answers: &[(String, ActionAnswer)],
        now_ms: i64,
    ) -> StoreResult<SubmitOutcome>;

    /// The answers recorded for the calls of the run's turn `message_id` (the assistant
    /// message that made them), by call id.
    async fn action_answers(
        &self,
        run_id: RunId,
        message_id: MessageId,
    ) -> StoreResult<Vec<(String, ActionAnswer)>>;

    /// The answers recorded for the calls of the run's turn `message_id`, read after every
    /// submission that began before this call has committed (its deadline passed: none after
    /// it is accepted).
    async fn close_action(
        &self,
        run_id: RunId,
        message_id: MessageId,
    ) -> StoreResult<Vec<(String, ActionAnswer)>>;
}

/// Snapshots: each run's state at its last iteration boundary (written with the event log).
///
/// SQL: `store/sql/snapshots.rs`.
#[async_trait]
pub trait SnapshotStore: Send + Sync {
    /// The run's snapshot, if one exists.
    async fn get_snapshot(&self, run_id: RunId) -> StoreResult<Option<Snapshot>>;

    /// A page of snapshots, newest run first.
    async fn list_snapshots(&self, filter: &SnapshotFilter) -> StoreResult<Vec<Snapshot>>;

    /// Deletes a finished run's snapshot; false when there is none.
    ///
    /// # Errors
    /// [`StoreError::RunActive`] while the run is not terminal (nothing is deleted).
    async fn delete_snapshot(&self, run_id: RunId) -> StoreResult<bool>;
}

/// Compaction: a session's compactions, the settings stored through `/compaction` and the
/// circuit breaker.
///
/// SQL: `store/sql/compaction.rs`.
#[async_trait]
pub trait CompactionStore: Send + Sync {
    /// Every compaction of the session, in the order of the messages they cover.
    async fn session_compactions(&self, session_id: SessionId) -> StoreResult<Vec<Compaction>>;

    /// Stores a compaction made outside a run (`POST /sessions/{id}/compact`) and closes the
    /// circuit breaker, in one transaction.
    ///
    /// # Errors
    /// [`StoreError::SessionBusy`] when the session has an active run (nothing is written).
    async fn insert_compaction(&self, compaction: &Compaction) -> StoreResult<()>;

    /// The compaction settings stored through `/compaction`; `None` before the first change.
    async fn compaction_config(&self) -> StoreResult<Option<CompactionConfig>>;

    /// Stores the compaction settings (replacing them).
    async fn put_compaction_config(&self, config: &CompactionConfig) -> StoreResult<()>;

    /// The circuit breaker's state (`threshold` is the one in force, shown with it).
    async fn circuit_breaker(&self, threshold: u32) -> StoreResult<CircuitBreaker>;

    /// Counts a failed compaction (atomically, across processes): the breaker opens when the
    /// consecutive failures reach `threshold`.
    async fn record_compaction_failure(
        &self,
        error: &str,
        threshold: u32,
    ) -> StoreResult<BreakerFailure>;

    /// Closes the breaker and clears its count and last error.
    async fn reset_circuit_breaker(&self, threshold: u32) -> StoreResult<CircuitBreaker>;
}

/// Retention: removing the logs of runs that ended long ago.
///
/// SQL: `store/sql/retention.rs`.
#[async_trait]
pub trait RetentionStore: Send + Sync {
    /// Removes the events, snapshots, recorded tool answers and finished webhook deliveries of
    /// up to `limit` runs that ended before `ended_before` (one transaction) and marks them `events_removed_at`; returns how
    /// many runs.
    async fn remove_expired_events(
        &self,
        ended_before: DateTime<Utc>,
        limit: u32,
    ) -> StoreResult<u32>;
}

/// The webhook outbox: deliveries written with the events that cause them
/// ([`RunChange::webhook`]), claimed by one process's worker at a time, and their attempts.
///
/// SQL: `store/sql/webhooks.rs`.
#[async_trait]
pub trait WebhookStore: Send + Sync {
    /// Claims up to `limit` pending deliveries due at `now_ms` that no live claim holds, for
    /// `owner` until `claim_until_ms` (rows another transaction holds are skipped, never
    /// waited for: PostgreSQL `FOR UPDATE SKIP LOCKED`), earliest due first. Each claim is an
    /// attempt: numbered, and listed as `interrupted` until its end is recorded. A delivery
    /// whose `max_attempts` were all made (the last interrupted) is marked failed instead.
    /// Counts the attempts it finds interrupted (a claim that expired unrecorded).
    async fn claim_webhook_deliveries(
        &self,
        owner: &str,
        now_ms: i64,
        claim_until_ms: i64,
        limit: u32,
        max_attempts: u32,
    ) -> StoreResult<WebhookClaim>;

    /// Records an attempt of a claimed delivery and what follows (delivered, another attempt
    /// at `next_attempt_ms`, or failed), releasing the claim, in one transaction.
    async fn record_webhook_attempt(
        &self,
        delivery_id: uuid::Uuid,
        record: &AttemptRecord,
    ) -> StoreResult<()>;

    /// Releases `owner`'s claims of deliveries still pending (at its shutdown); how many: each
    /// was an attempt cut short (`interrupted`).
    async fn release_webhook_claims(&self, owner: &str) -> StoreResult<u64>;

    /// How many deliveries are pending and when the earliest is due.
    async fn webhook_outbox(&self) -> StoreResult<OutboxState>;

    /// The run's deliveries with their attempts, oldest first.
    async fn webhook_deliveries(&self, run_id: RunId) -> StoreResult<Vec<WebhookDelivery>>;
}

/// Opens the store a URL names, creating the SQLite file when missing, and applies migrations.
///
/// # Errors
/// [`StoreError::UnsupportedUrl`], or the connection/migration error.
pub async fn connect(url: &str) -> StoreResult<Arc<dyn Store>> {
    connect_with(url, &ConnectOptions::default()).await
}

/// [`connect`] with the pool's size and, on PostgreSQL, each connection's time limits.
///
/// # Errors
/// [`StoreError::UnsupportedUrl`], or the connection/migration error.
pub async fn connect_with(url: &str, options: &ConnectOptions) -> StoreResult<Arc<dyn Store>> {
    if url.starts_with("sqlite:") {
        Ok(Arc::new(SqliteStore::connect_with(url, options).await?))
    } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
        Ok(Arc::new(PostgresStore::connect_with(url, options).await?))
    } else {
        Err(StoreError::UnsupportedUrl)
    }
}

/// How the store's pool connects (`[database]` in the configuration).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Connections in the pool at most; `None`: 16 on PostgreSQL, 8 on SQLite.
    pub max_connections: Option<u32>,
    /// A connection idle this long is closed (`None`: never).
    pub idle_timeout: Option<Duration>,
    /// PostgreSQL `statement_timeout`: a statement running longer is cancelled.
    pub statement_timeout: Duration,
    /// PostgreSQL `lock_timeout`: a statement waiting longer for a lock fails.
    pub lock_timeout: Duration,
    /// PostgreSQL `idle_in_transaction_session_timeout`: a session idle this long inside a
    /// transaction (its process frozen or gone) is ended by the server, releasing its locks.
    pub idle_in_transaction_timeout: Duration,
    /// PostgreSQL `tcp_keepalives_idle`: the server probes a silent client connection after
    /// this long (then every 10 s, 3 times), so a vanished replica's locks are released.
    pub tcp_keepalive_idle: Duration,
    /// PostgreSQL `application_name` of every connection (the replica id, so
    /// `pg_stat_activity` tells replicas apart), unless the URL sets one; `None`: the driver's.
    pub application_name: Option<String>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            application_name: None,
            max_connections: None,
            idle_timeout: Some(Duration::from_secs(600)),
            statement_timeout: Duration::from_secs(30),
            lock_timeout: Duration::from_secs(5),
            idle_in_transaction_timeout: Duration::from_secs(10),
            tcp_keepalive_idle: Duration::from_secs(30),
        }
    }
}

/// A wake-up one replica sends the others through the database (PostgreSQL `NOTIFY` on the
/// channel `behest`, payload `<kind> <run id>`): a hint that something changed, never the
/// change itself — the store stays the source of truth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// Events of the run were committed.
    Events(RunId),
    /// A cancel of the run was recorded.
    Cancel(RunId),
    /// Answers to the run's required action were recorded.
    Answers(RunId),
    /// A process released its leases (a shutdown): its runs may be taken over now.
    Released,
    /// A replica's check of its own listener (payload `probe <uuid>`): every replica sends
    /// one to itself now and then; one that does not come back means the listener went
    /// silent.
    Probe(uuid::Uuid),
}

impl Signal {
    /// The `NOTIFY` channel.
    pub const CHANNEL: &str = "behest";

    /// The notification's payload.
    #[must_use]
    pub fn payload(self) -> String {
        match self {
            Self::Events(run) => format!("events {run}"),
            Self::Cancel(run) => format!("cancel {run}"),
            Self::Answers(run) => format!("answers {run}"),
            Self::Released => "released".to_owned(),
            Self::Probe(id) => format!("probe {id}"),
        }
    }

    /// A payload read back; `None` for another kind (a newer version's).
    #[must_use]
    pub fn parse(payload: &str) -> Option<Self> {
        if payload == "released" {
            return Some(Self::Released);
        }
        let (kind, id) = payload.split_once(' ')?;
        let id = uuid::Uuid::parse_str(id).ok()?;
        if kind == "probe" {
            return Some(Self::Probe(id));
        }
        let run = RunId(id);
        match kind {
            "events" => Some(Self::Events(run)),
            "cancel" => Some(Self::Cancel(run)),
            "answers" => Some(Self::Answers(run)),
            _ => None,
        }
    }
}

/// Events per query when a whole log is read (a log shorter than this is one read).
const LOG_PAGE: u32 = 1000;

/// Reads run `run_id`'s whole log in order, handing `each` every event typed (or why its stored
/// JSON does not read as an [`crate::events::AgentEvent`], with its sequence): the one way a
/// log is read to fold it. Stops at the first error `each` returns.
///
/// # Errors
/// The store's, or the first of `each`.
pub async fn read_log(
    store: &dyn Store,
    run_id: RunId,
    mut each: impl FnMut(u64, Result<crate::events::AgentEvent, serde_json::Error>) -> StoreResult<()>
    + Send,
) -> StoreResult<()> {
    let mut after = 0;
    loop {
        let page = store.read_events(run_id, after, LOG_PAGE).await?;
        for logged in &page {
            each(logged.sequence, serde_json::from_str(&logged.data))?;
        }
        match page.last() {
            Some(last) if page.len() == LOG_PAGE as usize => after = last.sequence,
            _ => return Ok(()),
        }
    }
}
