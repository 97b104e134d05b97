//! The runtime: admits runs, executes each in a task it owns, cancels them, recovers runs left
//! non-terminal by a previous process, keeps their context inside the model's window
//! (compaction), and serves watches of the event log.

mod admission;
mod agents;
pub mod client_sessions;
pub mod compaction;
mod doom_loop;
mod end;
mod event_log;
mod images;
mod model_turn;
mod recovery;
mod relay;
mod resume;
mod retention;
mod run_loop;
mod sessions;
mod signals;
mod structured;
pub mod tokens;
mod tool_exec;
mod tool_progress;
pub mod trail;
mod watch;
mod webhooks;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use chrono::Utc;
use futures::Stream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{AgentPreset, ModelConfig, ProviderConfig, RuntimeConfig};
use crate::domain::{
    CompactionConfig, CreateRunRequest, MessageId, RunEnd, RunId, RunRecord, RunStatus, SessionId,
};
use crate::events::{EventFeed, EventFrame};
use crate::provider::Provider;
use crate::store::{NewRun, Signal, Store, StoreError};
use crate::tools::ToolRegistry;

pub use agents::{Answer, AnswerError};
pub use compaction::{CompactError, SettingsError};
pub use doom_loop::{DoomLoopDetector, canonical_json};
pub use event_log::{EventLog, LogError, RunEmitter, TraceContext};
pub use structured::parsed_output;
pub use trail::{RunTrail, TrailError};
pub use webhooks::{WebhookProblem, Webhooks, is_private};

/// A configured provider: its adapter and its models.
#[derive(Debug, Clone)]
pub struct ProviderEntry {
    /// The adapter.
    pub provider: Arc<dyn Provider>,
    /// Its configuration (models, timeouts).
    pub config: ProviderConfig,
}

/// Why a run could not be created.
#[derive(Debug, thiserror::Error)]
pub enum CreateRunError {
    /// A required field is missing or empty.
    #[error("`{0}` is required")]
    MissingField(&'static str),
    /// A field has a bad value.
    #[error("`{field}`: {reason}")]
    InvalidField {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// No provider with this id is configured.
    #[error("no provider `{0}` is configured")]
    UnknownProvider(String),
    /// No agent preset with this name is configured.
    #[error("no agent `{0}` is configured (GET /agents lists them)")]
    UnknownAgent(String),
    /// The provider has no model with this name.
    #[error("provider `{provider}` has no model `{model}` configured")]
    UnknownModel {
        /// The provider id.
        provider: String,
        /// The model name.
        model: String,
    },
    /// The named session does not exist.
    #[error("session {0} not found")]
    SessionNotFound(SessionId),
    /// The session has an active run.
    #[error("session {session_id} already has an active run ({active_run})")]
    SessionBusy {
        /// The session.
        session_id: SessionId,
        /// Its active run.
        active_run: RunId,
    },
    /// The client request id was used for a different request.
    #[error(
        "idempotency key `{key}` (client_request_id or the Idempotency-Key header) was used for a different request (run {existing})"
    )]
    IdempotencyKeyReused {
        /// The key.
        key: String,
        /// The run created with it.
        existing: RunId,
    },
    /// A tool named in `tools` or `tool_choice` is not configured.
    #[error("no tool named `{0}` is configured")]
    UnknownTool(String),
    /// The server is shutting down and admits no new runs.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// `[runtime] max_active_runs` runs are active in this process.
    #[error("{0} runs are active, the most this server runs at once; retry shortly")]
    TooManyActiveRuns(usize),
    /// The input, with the run's instructions and tool definitions that every request
    /// carries, does not fit the model's context window less the answer's `max_output_tokens`
    /// (estimated as compaction estimates a request): no run could send it.
    #[error(
        "the input with the run's instructions and tool definitions (about {estimated} tokens) \
         does not fit the context window of model `{model}`: a request may hold at most {limit} \
         tokens (its context_window less the answer's max_output_tokens); shorten `{field}`"
    )]
    InputTooLarge {
        /// The model.
        model: String,
        /// The request's estimated tokens.
        estimated: u64,
        /// The most tokens a request of the model may hold.
        limit: u64,
        /// What to shorten: `input` when it alone does not fit, else the larger of
        /// `instructions` and `tools`.
        field: &'static str,
    },
    /// A session's default `instructions` (`POST /sessions`), in a request with a one-word
    /// input and the tools a run taking the defaults offers, do not fit the context window of
    /// the model its defaults name less the answer's `max_output_tokens` (the bound of
    /// [`CreateRunError::InputTooLarge`]): no run taking them could be sent.
    #[error(
        "the session's default instructions (about {estimated} tokens in a request with a \
         one-word input and the tools its runs offer) do not fit the context window of model \
         `{model}`: a request may hold at most {limit} tokens (its context_window less the \
         answer's max_output_tokens); shorten `defaults.instructions`"
    )]
    InstructionsTooLarge {
        /// The model the session's defaults name.
        model: String,
        /// The request's estimated tokens.
        estimated: u64,
        /// The most tokens a request of the model may hold.
        limit: u64,
    },
    /// The run's webhook is refused (webhooks off, or a URL not allowed).
    #[error(transparent)]
    Webhook(WebhookProblem),
    /// The store failed.
    #[error(transparent)]
    Store(StoreError),
}

/// A created run, or the existing one an idempotent retry names.
#[derive(Debug, Clone, PartialEq)]
pub struct CreatedRun {
    /// The run.
    pub record: RunRecord,
    /// True when the request repeated an earlier one (same `client_request_id` and body).
    pub replayed: bool,
}

/// Why `cancel_run` failed: the store's error, or the event log's while it ended a run no
/// process executed (a batch the store refused keeps the store's error and its kind, a database
/// error stays one; the writer stopped at shutdown).
#[derive(Debug, thiserror::Error)]
pub enum CancelError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The run's end could not be logged.
    #[error(transparent)]
    Log(#[from] LogError),
}

impl From<end::EndError> for CancelError {
    fn from(error: end::EndError) -> Self {
        match error {
            end::EndError::Log(error) => Self::Log(error),
            end::EndError::Store(error) => Self::Store(error),
        }
    }
}

/// What `cancel_run` did.
#[derive(Debug, Clone, PartialEq)]
pub enum CancelOutcome {
    /// Cancellation was requested (or completed); the record as it is now.
    Cancelling(RunRecord),
    /// The run had already finished; nothing changed.
    AlreadyFinished(RunRecord),
}

#[derive(Debug)]
struct ActiveRun {
    /// Cancelled by a client's cancel: the run ends with `run_cancelled`.
    cancel: CancellationToken,
    /// Cancelled when another process took the run over: the run stops here, writing nothing.
    abandon: CancellationToken,
    /// The run's lease is committed in the store (its renewal can be checked).
    leased: bool,
    /// Notified when answers to the calls it waits for were stored by this process.
    answered: Arc<tokio::sync::Notify>,
    /// Cancelled once the run's task has returned (its end, if any, is written).
    ended: CancellationToken,
}

impl ActiveRun {
    fn new(leased: bool) -> Self {
        Self {
            cancel: CancellationToken::new(),
            abandon: CancellationToken::new(),
            leased,
            answered: Arc::new(tokio::sync::Notify::new()),
            ended: CancellationToken::new(),
        }
    }
}

/// The agent runtime; one per process, shared by the HTTP handlers.
#[derive(Debug)]
pub struct Runtime {
    store: Arc<dyn Store>,
    log: EventLog,
    /// Stores new runs, group-committed.
    admission: admission::Admission,
    providers: HashMap<String, ProviderEntry>,
    tools: Arc<ToolRegistry>,
    config: RuntimeConfig,
    /// Agent presets (`[agents.<name>]`), by name.
    agents: BTreeMap<String, AgentPreset>,
    /// The compaction settings (initial and stored).
    compaction: compaction::Settings,
    active: Mutex<HashMap<RunId, ActiveRun>>,
    /// The contexts of sessions this process ran, read since their last message only.
    contexts: sessions::ContextCache,
    tasks: TaskTracker,
    /// This process's id as a lease owner: `{replica_id}/{UUID v7}`, new at each start.
    owner: Arc<str>,
    /// Cancelled when a shutdown begins: runs stop at their next boundary, resumable.
    draining: CancellationToken,
    /// Cancelled when the shutdown's grace has passed: runs stop where they are, resumable.
    stop: CancellationToken,
    /// The database's clock minus this process's, in ms, measured at each lease renewal (0 on
    /// a store one process uses): lease times are the database's, so a replica whose clock
    /// runs ahead cannot take runs whose lease has not expired.
    clock_offset_ms: std::sync::atomic::AtomicI64,
    /// Whether a takeover scan is running (one at a time, beside the lease renewals).
    scanning: std::sync::atomic::AtomicBool,
    /// Other replicas' signals: wake-ups of watchers of runs executing elsewhere.
    signals: signals::Signals,
    /// False while this process cannot confirm its leases (fail-stop; `/readyz`).
    leases_confirmed: std::sync::atomic::AtomicBool,
    /// Webhooks, once enabled ([`Runtime::enable_webhooks`]); unset: a run naming a webhook
    /// is refused.
    webhooks: std::sync::OnceLock<Arc<webhooks::Webhooks>>,
}

impl Runtime {
    /// A runtime over a store and providers, with the config file's compaction settings as the
    /// initial ones; starts the event log writer (and loads the tokenizer in the background).
    /// Must be called within a Tokio runtime.
    #[must_use]
    pub fn new(
        store: Arc<dyn Store>,
        providers: HashMap<String, ProviderEntry>,
        tools: Arc<ToolRegistry>,
        config: RuntimeConfig,
        compaction: CompactionConfig,
    ) -> Arc<Self> {
        Self::with_agents(
            store,
            providers,
            tools,
            config,
            compaction,
            BTreeMap::new(),
            &crate::config::DatabaseConfig::default().replica_id(),
        )
    }

    /// [`Runtime::new`] with agent presets (check them with [`Runtime::check_agents`]), as
    /// replica `replica_id` (`[database] replica_id`: the first part of its lease owner id).
    #[must_use]
    pub fn with_agents(
        store: Arc<dyn Store>,
        providers: HashMap<String, ProviderEntry>,
        tools: Arc<ToolRegistry>,
        config: RuntimeConfig,
        compaction: CompactionConfig,
        agents: BTreeMap<String, AgentPreset>,
        replica_id: &str,
    ) -> Arc<Self> {
        let owner: Arc<str> = Arc::from(format!("{replica_id}/{}", uuid::Uuid::now_v7()));
        let feed = Arc::new(EventFeed::new(config.feed_capacity));
        let log = EventLog::start(store.clone(), feed, config.max_batch_events, owner.clone());
        // The tokenizers' tables are loaded when a model's request is first measured
        // (`tokens::Tokenizer::ready_or_load`), not here: an idle server does not hold them.
        let ttl = Duration::from_millis(config.lease_ttl_ms);
        let runtime = Arc::new(Self {
            admission: admission::Admission::start(store.clone()),
            store,
            log,
            providers,
            tools,
            config,
            agents,
            compaction: compaction::Settings::new(compaction),
            active: Mutex::new(HashMap::new()),
            contexts: sessions::ContextCache::default(),
            tasks: TaskTracker::new(),
            owner,
            draining: CancellationToken::new(),
            stop: CancellationToken::new(),
            clock_offset_ms: std::sync::atomic::AtomicI64::new(0),
            scanning: std::sync::atomic::AtomicBool::new(false),
            signals: signals::Signals::default(),
            leases_confirmed: std::sync::atomic::AtomicBool::new(true),
            webhooks: std::sync::OnceLock::new(),
        });
        tokio::spawn(recovery::lease_loop(Arc::downgrade(&runtime), ttl));
        tokio::spawn(retention::sweep_loop(Arc::downgrade(&runtime)));
        runtime
    }

    /// Enables webhooks with `config` (when it has a secret) and starts this process's
    /// delivery worker, which also delivers what the outbox held before (a restart). Returns
    /// whether webhooks are on; a second call changes nothing.
    ///
    /// # Errors
    /// When the delivery client cannot be built.
    pub fn enable_webhooks(
        self: &Arc<Self>,
        config: &crate::config::WebhooksConfig,
    ) -> Result<bool, String> {
        if self.webhooks.get().is_some() {
            return Ok(true);
        }
        let Some(hooks) = webhooks::Webhooks::new(config, self.log.webhook_wake())? else {
            return Ok(false);
        };
        let hooks = Arc::new(hooks);
        if self.webhooks.set(hooks.clone()).is_ok() {
            tokio::spawn(webhooks::delivery_loop(Arc::downgrade(self), hooks));
        }
        Ok(true)
    }

    /// This process's id as the owner of its runs' leases.
    #[must_use]
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The store.
    #[must_use]
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The configured providers.
    #[must_use]
    pub fn providers(&self) -> &HashMap<String, ProviderEntry> {
        &self.providers
    }

    /// The configured tools.
    #[must_use]
    pub fn tools(&self) -> &Arc<ToolRegistry> {
        &self.tools
    }

    /// The runtime limits in force.
    #[must_use]
    pub fn config(&self) -> &RuntimeConfig {
        &self.config
    }

    fn active(&self) -> std::sync::MutexGuard<'_, HashMap<RunId, ActiveRun>> {
        self.active.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Validates the request, stores the run with its user message, and starts executing it.
    /// A request repeating an earlier one (same `client_request_id`, same body) returns the
    /// existing run and starts nothing.
    ///
    /// # Errors
    /// [`CreateRunError`] for a missing field, an unknown provider/model/tool/session, a busy
    /// session, a reused idempotency key, or the store.
    #[tracing::instrument(skip_all, fields(provider = request.provider.as_deref(), model = request.model.as_deref()))]
    pub async fn create_run(
        self: &Arc<Self>,
        request: CreateRunRequest,
        trace: Option<TraceContext>,
    ) -> Result<CreatedRun, CreateRunError> {
        if self.is_stopping() {
            return Err(CreateRunError::ShuttingDown);
        }
        request
            .check(self.config.max_iterations_cap)
            .map_err(|problem| match problem {
                crate::domain::RequestProblem::Missing(field) => {
                    CreateRunError::MissingField(field)
                }
                crate::domain::RequestProblem::Invalid { field, reason } => {
                    CreateRunError::InvalidField { field, reason }
                }
            })?;
        let (session_id, session) = match request.session_id.as_deref() {
            None => (SessionId::new(), None),
            Some(raw) => {
                let id: SessionId = raw.parse().map_err(|_| CreateRunError::InvalidField {
                    field: "session_id",
                    reason: "not a UUID".to_owned(),
                })?;
                let session = self
                    .store
                    .get_session(id)
                    .await
                    .map_err(CreateRunError::Store)?
                    .ok_or(CreateRunError::SessionNotFound(id))?;
                (id, Some(session))
            }
        };
        let resolved = self.resolve(&request, session.as_ref())?;
        if let Some(webhook) = &resolved.definition.webhook {
            let hooks = self
                .webhooks
                .get()
                .ok_or(CreateRunError::Webhook(WebhookProblem::Disabled))?;
            hooks
                .check(&webhook.url)
                .await
                .map_err(CreateRunError::Webhook)?;
        }
        let model = resolved.model;
        let request_hash = request
            .client_request_id
            .as_ref()
            .map(|_| fingerprint(&request));
        let session_defaults = match &session {
            None => resolved.remember.clone(),
            Some(session) => session.defaults.clone().filled_from(&resolved.remember),
        };
        let effective = resolved.request;
        let run_id = RunId::new();
        let new_run = NewRun {
            id: run_id,
            session_id,
            create_session: session.is_none(),
            provider: effective.provider.unwrap_or_default(),
            model: effective.model.unwrap_or_default(),
            tool_choice: effective.tool_choice.unwrap_or_default(),
            metadata: effective.metadata.unwrap_or_else(|| serde_json::json!({})),
            input: effective.input.unwrap_or_default().content(),
            user_message_id: MessageId::new(),
            tools: effective.tools,
            agent: effective.agent,
            definition: resolved.definition,
            session_defaults: Some(session_defaults),
            max_iterations: effective
                .max_iterations
                .unwrap_or(self.config.max_iterations),
            client_request_id: effective.client_request_id,
            request_hash,
            created_at: Utc::now(),
            lease: Some(self.lease()),
        };
        let max_output = new_run
            .definition
            .parameters
            .max_output_tokens
            .unwrap_or(model.max_output_tokens);
        compaction::check_input(
            new_run.user_message(),
            new_run.definition.instructions.clone(),
            agents::tool_specs_of(self, new_run.tools.as_deref()),
            &new_run.model,
            compaction::Window::of(model, max_output),
        )
        .await
        .map_err(|too_large| CreateRunError::InputTooLarge {
            model: new_run.model.clone(),
            estimated: too_large.estimated,
            limit: too_large.limit,
            field: too_large.field,
        })?;
        // Registered (and its live feed opened) before the run is visible, so neither a cancel
        // nor a watcher can find it unowned.
        {
            let mut active = self.active();
            if let Some(max) = self.config.max_active_runs
                && active.len() >= max
            {
                return Err(CreateRunError::TooManyActiveRuns(max));
            }
            active.insert(run_id, ActiveRun::new(false));
        }
        self.log.feed().open(run_id);
        let client_request_id = new_run.client_request_id.clone();
        let input = new_run.create_session.then(|| new_run.user_message());
        let trace = trace.unwrap_or_else(|| TraceContext::for_run(run_id));
        // Stored and started in a task of its own: a client that goes away while its run is
        // being stored never leaves a stored run that nothing executes.
        let runtime = self.clone();
        let stored = tokio::spawn(async move {
            let stored = runtime.admission.create(new_run).await;
            match &stored {
                Ok(record) => {
                    if let Some(run) = runtime.active().get_mut(&run_id) {
                        run.leased = true;
                    }
                    if let Some(input) = input {
                        runtime.contexts.created(record.session_id, input);
                    }
                    crate::telemetry::metrics::run_created();
                    runtime.start(record.clone(), model, trace, trail::RunTrail::new());
                }
                Err(_) => {
                    runtime.active().remove(&run_id);
                    runtime.log.feed().close(run_id);
                }
            }
            stored
        })
        .await
        .unwrap_or_else(|_| Err(StoreError::Database(sqlx::Error::WorkerCrashed)));
        let record = match stored {
            Ok(record) => record,
            Err(StoreError::SessionNotFound(id)) => {
                return Err(CreateRunError::SessionNotFound(id));
            }
            Err(StoreError::SessionBusy {
                session_id,
                active_run,
            }) => {
                return Err(CreateRunError::SessionBusy {
                    session_id,
                    active_run,
                });
            }
            Err(StoreError::DuplicateRequest {
                existing,
                same_request,
            }) => {
                if same_request {
                    return Ok(CreatedRun {
                        record: *existing,
                        replayed: true,
                    });
                }
                return Err(CreateRunError::IdempotencyKeyReused {
                    key: client_request_id.unwrap_or_default(),
                    existing: existing.id,
                });
            }
            Err(other) => return Err(CreateRunError::Store(other)),
        };
        Ok(CreatedRun {
            record,
            replayed: false,
        })
    }

    /// Executes the run in a task of this process: from its start when its log is empty, else
    /// resumed after the last event of its `trail`.
    fn start(
        self: &Arc<Self>,
        record: RunRecord,
        model: ModelConfig,
        trace: TraceContext,
        trail: trail::RunTrail,
    ) {
        let resumed = trail.last_sequence() > 0;
        let run_id = record.id;
        let (cancel, abandon, answered, ended) = {
            let mut active = self.active();
            let run = active.entry(run_id).or_insert_with(|| ActiveRun::new(true));
            (
                run.cancel.clone(),
                run.abandon.clone(),
                run.answered.clone(),
                run.ended.clone(),
            )
        };
        self.log.feed().open(run_id);
        let span = self.run_span(&record, trace.clone(), resumed);
        let emitter = Arc::new(
            self.log
                .emitter(run_id, trail, trace)
                .with_span(span)
                .with_webhook(record.webhook.as_ref()),
        );
        let runtime = self.clone();
        let tokens = run_loop::Tokens {
            cancel,
            abandon,
            answered,
        };
        crate::telemetry::metrics::runs_active(1.0);
        self.tasks.spawn(async move {
            run_loop::supervise(&runtime, record, model, emitter, tokens, resumed).await;
            // However the run stopped here — also a cancel or failure whose end another
            // process's lease fenced — its live feed closes, so the watchers here go on from
            // the store (woken by the new owner's signals) instead of waiting on it for ever.
            runtime.log.feed().close(run_id);
            runtime.active().remove(&run_id);
            ended.cancel();
            crate::telemetry::metrics::runs_active(-1.0);
        });
    }

    /// The span of a run executing (or ended) in this process.
    fn run_span(
        &self,
        record: &RunRecord,
        trace: TraceContext,
        resumed: bool,
    ) -> crate::telemetry::trace::Span {
        let (run_id, session_id) = (record.id.to_string(), record.session_id.to_string());
        let info = crate::telemetry::spans::RunInfo {
            run_id: &run_id,
            session_id: &session_id,
            provider_id: &record.provider,
            provider_kind: self.providers.get(&record.provider).map(|e| e.config.kind),
            model: &record.model,
            resumed,
        };
        crate::telemetry::spans::run(trace, &info)
    }

    /// Stops a run in this process without writing anything (another process owns it now).
    fn abandon(&self, run_id: RunId) {
        if let Some(run) = self.active().get(&run_id) {
            run.abandon.cancel();
        }
    }

    /// Requests cancellation. A run that had finished before the request is left alone and
    /// reported as such ([`CancelOutcome::AlreadyFinished`]); a run not executing in this
    /// process is ended with `run_cancelled` directly.
    ///
    /// Cancel is the same whoever asks: a run that was cancelled at or after `asked_at` (when
    /// the request arrived), by a concurrent cancel, is [`CancelOutcome::Cancelling`] too, so
    /// concurrent cancels all get the same answer.
    ///
    /// # Errors
    /// [`CancelError`]: the store's, or the event log's while ending a run no process executes;
    /// `Ok(None)` when the run does not exist.
    pub async fn cancel_run(&self, run_id: RunId) -> Result<Option<CancelOutcome>, CancelError> {
        let Some(record) = self.store.get_run(run_id).await? else {
            return Ok(None);
        };
        if record.status.is_terminal() {
            return Ok(Some(Self::finished_outcome(record)));
        }
        let local = self
            .active()
            .get(&run_id)
            .map(|run| (run.cancel.clone(), run.ended.clone()));
        match local {
            Some((token, ended)) => {
                // Recorded first: an answer to a waiting run that comes after this cancel is
                // refused (`run_not_waiting`) instead of accepted and dropped. Not recorded:
                // the run ended in the meantime, and its end stands.
                if !self.store.request_cancel(run_id).await? {
                    return Ok(self.ended_before_cancel(run_id, record).await?);
                }
                token.cancel();
                // This process may have just lost the run: its new owner hears it at once.
                self.send_signal(Signal::Cancel(run_id)).await;
                if record.status == RunStatus::RequiresAction {
                    // Nothing runs in a waiting run: it ends at once, and the answer comes
                    // after its end, so the session's next input is accepted.
                    let _ended =
                        tokio::time::timeout(WAITING_CANCEL_BOUND, ended.cancelled()).await;
                }
            }
            None => {
                // Not executing here. Owned by no live process: take it over and end it (two
                // cancels may race; the loser's write fails on the taken sequence, and the run
                // is then terminal). Owned by another process: the store carries the cancel to
                // it (or to whoever takes the run over).
                let claimed = self
                    .store
                    .claim_run(run_id, &self.lease(), self.store_now_ms())
                    .await?;
                if claimed.is_some() {
                    let ended = match trail::RunTrail::load(self.store.as_ref(), run_id).await {
                        Ok(trail) => self
                            .end_orphan(&record, trail, RunEnd::Cancelled)
                            .await
                            .map_err(CancelError::from),
                        Err(error) => Err(error.into()),
                    };
                    if let Err(error) = ended {
                        let now = self.store.get_run(run_id).await?;
                        if !now.is_some_and(|run| run.status.is_terminal()) {
                            return Err(error);
                        }
                    }
                } else {
                    if !self.store.request_cancel(run_id).await? {
                        return Ok(self.ended_before_cancel(run_id, record).await?);
                    }
                    self.send_signal(Signal::Cancel(run_id)).await;
                }
            }
        }
        let now = self.store.get_run(run_id).await?.unwrap_or(record);
        Ok(Some(CancelOutcome::Cancelling(now)))
    }

    /// A cancel's outcome for a run that ended before the cancel could be recorded (the
    /// store's conditional update found it terminal): its end, as it is stored.
    async fn ended_before_cancel(
        &self,
        run_id: RunId,
        record: RunRecord,
    ) -> Result<Option<CancelOutcome>, StoreError> {
        let now = self.store.get_run(run_id).await?.unwrap_or(record);
        Ok(Some(Self::finished_outcome(now)))
    }

    /// A cancel's outcome for a run found terminal. Cancel is idempotent: a cancelled run
    /// (whichever cancel ended it, however long ago) gets the same answer as the cancel that
    /// ended it, so concurrent cancels never disagree; a completed or failed run is already
    /// finished.
    fn finished_outcome(record: RunRecord) -> CancelOutcome {
        if record.status == RunStatus::Cancelled {
            CancelOutcome::Cancelling(record)
        } else {
            CancelOutcome::AlreadyFinished(record)
        }
    }

    /// The run's events after `after`, live, each once, ending with the terminal event.
    pub fn watch(
        &self,
        run_id: RunId,
        after: u64,
    ) -> impl Stream<Item = Result<Arc<EventFrame>, StoreError>> + Send + 'static {
        let live = self.log.feed().subscribe(run_id);
        let mut wakeup = self.signals.wakeup(run_id);
        // A run executing elsewhere: its frames come from the store, read once for every
        // watcher of the run here.
        let live = live.or_else(|| {
            wakeup
                .as_mut()
                .and_then(|wakeup| wakeup.relay(&self.store, run_id))
        });
        watch::watch(self.store.clone(), run_id, live, wakeup, after)
    }

    /// Stops admitting runs; each active run stops at its next boundary (before its next model
    /// call) within `grace`, and those still going then stop where they are. Nothing terminal
    /// is written: every run stays resumable, and this process's leases are released so the
    /// next process takes the runs over at once.
    pub async fn shutdown(&self, grace: Duration) {
        self.draining.cancel();
        self.tasks.close();
        if tokio::time::timeout(grace, self.tasks.wait())
            .await
            .is_err()
        {
            self.stop.cancel();
            self.tasks.wait().await;
        }
        self.stop.cancel();
        if let Err(error) = self.store.release_leases(&self.owner).await {
            tracing::warn!(%error, "could not release the runs' leases");
        } else {
            // Peers take the runs over now, not at their next scan.
            self.send_signal(Signal::Released).await;
        }
        let left = self
            .store
            .active_runs()
            .await
            .map(|runs| runs.len())
            .unwrap_or(0);
        if left > 0 {
            tracing::info!(runs = left, "runs left resumable for the next start");
        }
    }

    /// Whether the runtime is stopping (a shutdown began).
    #[must_use]
    pub fn is_stopping(&self) -> bool {
        self.draining.is_cancelled()
    }
}

/// How long a cancel of a run in `requires_action` waits for the run's end before it answers.
const WAITING_CANCEL_BOUND: Duration = Duration::from_secs(10);

/// SHA-256 of the request's canonical JSON without its idempotency key: what "the same body"
/// means for a reused `client_request_id`.
fn fingerprint(request: &CreateRunRequest) -> String {
    use sha2::Digest;
    let mut body = request.clone();
    body.client_request_id = None;
    let canonical = serde_json::to_value(&body)
        .map(|value| canonical_json(&value))
        .unwrap_or_default();
    sha2::Sha256::digest(canonical.as_bytes())
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

impl TraceContext {
    /// A fresh trace for a run with no incoming `traceparent`: the run id as trace id.
    #[must_use]
    pub fn for_run(run_id: RunId) -> Self {
        Self {
            trace_id: run_id.0.simple().to_string(),
            span_id: crate::telemetry::trace::new_span_id(),
            parent_span_id: String::new(),
            sampled: true,
        }
    }

    /// Parses a W3C `traceparent` header (`00-<32 hex>-<16 hex>-<2 hex>`); the run gets a new
    /// span id under the caller's trace. `None` when malformed or all-zero.
    ///
    /// ```
    /// use behest::runtime::TraceContext;
    /// let header = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    /// let trace = TraceContext::from_traceparent(header).unwrap();
    /// assert_eq!(trace.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
    /// assert_eq!(trace.span_id.len(), 16);
    /// assert_eq!(trace.parent_span_id, "00f067aa0ba902b7");
    /// assert!(trace.sampled);
    /// assert!(TraceContext::from_traceparent("00-00000000000000000000000000000000-00f067aa0ba902b7-01").is_none());
    /// assert!(TraceContext::from_traceparent("garbage").is_none());
    /// ```
    #[must_use]
    pub fn from_traceparent(header: &str) -> Option<Self> {
        let mut parts = header.trim().split('-');
        let (version, trace_id, parent, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |s: &str, len: usize| {
            s.len() == len
                && s.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        let valid = hex(version, 2)
            && version != "ff"
            && hex(trace_id, 32)
            && hex(parent, 16)
            && hex(flags, 2)
            && trace_id.bytes().any(|b| b != b'0')
            && parent.bytes().any(|b| b != b'0');
        let sampled = u8::from_str_radix(flags, 16).is_ok_and(|flags| flags & 1 == 1);
        valid.then(|| Self {
            trace_id: trace_id.to_owned(),
            span_id: crate::telemetry::trace::new_span_id(),
            parent_span_id: parent.to_owned(),
            sampled,
        })
    }
}
