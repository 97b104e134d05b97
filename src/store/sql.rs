//! SQL shared by both backends: row types and the [`Store`](super::Store) implementation, which
//! a macro instantiates once per backend (the queries are the same text; sqlx's types differ).
//! JSON is stored as text on both backends so it reads back byte for byte.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{StoreError, StoreResult};
use crate::domain::{
    CircuitBreaker, Compaction, CompactionConfig, CompactionId, CompactionTrigger, FinishReason,
    Message, MessageId, MessageStatus, Role, RunDefinition, RunId, RunRecord, RunStatus, Session,
    SessionId, Snapshot, TokenUsage,
};
use crate::events::{LoggedEvent, StoredEnvelope, StoredEvent};

pub(super) const RUN_COLUMNS: &str = "id, session_id, status, provider, model, tool_choice, \
     metadata, iterations, finish_reason, input_tokens, output_tokens, total_tokens, error, \
     tools, max_iterations, client_request_id, created_at, updated_at, reasoning_tokens, \
     usage_estimated, events_removed_at, agent, definition, required_action";

pub(super) const SNAPSHOT_COLUMNS: &str = "run_id, session_id, status, iteration, input_tokens, \
     output_tokens, total_tokens, reasoning_tokens, usage_estimated, tool_calls, last_sequence, \
     created_at";

pub(super) const MESSAGE_COLUMNS: &str = "id, session_id, run_id, role, content, tool_calls, tool_call_id, tool_name, created_at, \
     reasoning, status";

pub(super) const SESSION_COLUMNS: &str = "id, created_at, updated_at, title, metadata, defaults";

pub(super) const COMPACTION_COLUMNS: &str = "id, session_id, run_id, cause, through_message_id, \
     messages_summarised, tokens_before, tokens_after, summary, provider, model, input_tokens, \
     output_tokens, total_tokens, reasoning_tokens, usage_estimated, created_at";

pub(super) const SETTINGS_COLUMNS: &str = "auto, prune, buffer_tokens, keep_tokens, tail_turns, \
     model, provider, circuit_breaker_threshold";

#[derive(sqlx::FromRow)]
pub(super) struct CompactionRow {
    id: Uuid,
    session_id: Uuid,
    run_id: Option<Uuid>,
    cause: String,
    through_message_id: Uuid,
    messages_summarised: i64,
    tokens_before: i64,
    tokens_after: i64,
    summary: String,
    provider: String,
    model: String,
    input_tokens: i64,
    output_tokens: i64,
    total_tokens: i64,
    reasoning_tokens: i64,
    usage_estimated: bool,
    created_at: DateTime<Utc>,
}

impl TryFrom<CompactionRow> for Compaction {
    type Error = StoreError;

    fn try_from(row: CompactionRow) -> StoreResult<Self> {
        Ok(Self {
            id: CompactionId(row.id),
            session_id: SessionId(row.session_id),
            run_id: row.run_id.map(RunId),
            trigger: CompactionTrigger::parse(&row.cause)
                .ok_or_else(|| corrupt("compaction cause", &row.cause))?,
            through_message_id: MessageId(row.through_message_id),
            messages_summarised: u32::try_from(row.messages_summarised).unwrap_or(u32::MAX),
            tokens_before: count(row.tokens_before),
            tokens_after: count(row.tokens_after),
            summary: row.summary,
            provider: row.provider,
            model: row.model,
            usage: TokenUsage {
                input_tokens: count(row.input_tokens),
                output_tokens: count(row.output_tokens),
                total_tokens: count(row.total_tokens),
                reasoning_tokens: count(row.reasoning_tokens),
                estimated: row.usage_estimated,
            },
            created_at: row.created_at,
        })
    }
}

pub(super) fn compactions(rows: Vec<CompactionRow>) -> StoreResult<Vec<Compaction>> {
    rows.into_iter().map(TryInto::try_into).collect()
}

#[derive(sqlx::FromRow)]
pub(super) struct SettingsRow {
    auto: bool,
    prune: bool,
    buffer_tokens: i64,
    keep_tokens: i64,
    tail_turns: i64,
    model: String,
    provider: String,
    circuit_breaker_threshold: i64,
}

impl From<SettingsRow> for CompactionConfig {
    fn from(row: SettingsRow) -> Self {
        Self {
            auto: row.auto,
            prune: row.prune,
            buffer_tokens: count(row.buffer_tokens),
            keep_tokens: count(row.keep_tokens),
            tail_turns: u32::try_from(row.tail_turns).unwrap_or(u32::MAX),
            model: row.model,
            provider: row.provider,
            circuit_breaker_threshold: u32::try_from(row.circuit_breaker_threshold)
                .unwrap_or(u32::MAX),
        }
    }
}

#[derive(sqlx::FromRow)]
pub(super) struct BreakerRow {
    pub(super) consecutive_failures: i64,
    pub(super) is_open: bool,
    opened_at: Option<DateTime<Utc>>,
    last_error: Option<String>,
}

impl BreakerRow {
    pub(super) fn with_threshold(self, threshold: u32) -> CircuitBreaker {
        CircuitBreaker {
            is_open: self.is_open,
            consecutive_failures: u32::try_from(self.consecutive_failures).unwrap_or(u32::MAX),
            threshold,
            opened_at: self.opened_at,
            last_error: self.last_error,
        }
    }
}

/// The calibration columns of a session row.
#[derive(sqlx::FromRow)]
pub(super) struct CalibrationRow {
    context_reported_tokens: Option<i64>,
    context_counted_tokens: Option<i64>,
}

impl CalibrationRow {
    pub(super) fn calibration(&self) -> Option<super::Calibration> {
        match (self.context_reported_tokens, self.context_counted_tokens) {
            (Some(reported), Some(counted)) if reported > 0 && counted > 0 => {
                Some(super::Calibration {
                    reported_tokens: count(reported),
                    counted_tokens: count(counted),
                })
            }
            _ => None,
        }
    }
}

#[derive(sqlx::FromRow)]
pub(super) struct RunRow {
    id: Uuid,
    session_id: Uuid,
    status: String,
    provider: String,
    model: String,
    tool_choice: String,
    metadata: String,
    iterations: i64,
    finish_reason: Option<String>,
    input_tokens: i64,
    output_tokens: i64,
    total_tokens: i64,
    error: Option<String>,
    tools: Option<String>,
    max_iterations: i64,
    client_request_id: Option<String>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    reasoning_tokens: i64,
    usage_estimated: bool,
    events_removed_at: Option<DateTime<Utc>>,
    agent: Option<String>,
    definition: String,
    required_action: Option<String>,
}

#[derive(sqlx::FromRow)]
pub(super) struct SnapshotRow {
    run_id: Uuid,
    session_id: Uuid,
    status: String,
    iteration: i64,
    input_tokens: i64,
    output_tokens: i64,
    total_tokens: i64,
    reasoning_tokens: i64,
    usage_estimated: bool,
    tool_calls: i64,
    last_sequence: i64,
    created_at: DateTime<Utc>,
}

impl TryFrom<SnapshotRow> for Snapshot {
    type Error = StoreError;

    fn try_from(row: SnapshotRow) -> StoreResult<Self> {
        Ok(Self {
            run_id: RunId(row.run_id),
            session_id: SessionId(row.session_id),
            status: RunStatus::parse(&row.status).ok_or_else(|| corrupt("status", &row.status))?,
            iteration: u32::try_from(row.iteration).unwrap_or(u32::MAX),
            total_usage: TokenUsage {
                input_tokens: count(row.input_tokens),
                output_tokens: count(row.output_tokens),
                total_tokens: count(row.total_tokens),
                reasoning_tokens: count(row.reasoning_tokens),
                estimated: row.usage_estimated,
            },
            tool_calls: u32::try_from(row.tool_calls).unwrap_or(u32::MAX),
            last_sequence: count(row.last_sequence),
            timestamp: row.created_at,
        })
    }
}

pub(super) fn snapshots(rows: Vec<SnapshotRow>) -> StoreResult<Vec<Snapshot>> {
    rows.into_iter().map(TryInto::try_into).collect()
}

/// A claimed run with the cancel requested while nobody owned it.
#[derive(sqlx::FromRow)]
pub(super) struct ClaimRow {
    #[sqlx(flatten)]
    pub(super) run: RunRow,
    pub(super) cancel_requested: bool,
}

fn corrupt(what: &str, value: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!("{what}: {value}"))
}

fn json<T: serde::de::DeserializeOwned>(what: &str, text: &str) -> StoreResult<T> {
    serde_json::from_str(text).map_err(|e| corrupt(what, e))
}

pub(super) fn to_json<T: serde::Serialize>(value: &T) -> StoreResult<String> {
    serde_json::to_string(value).map_err(|e| corrupt("serialize", e))
}

fn count(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

/// A string for a TEXT column: U+0000, which PostgreSQL cannot store in TEXT, becomes U+FFFD
/// (on both backends, so they agree). Client values with NUL are rejected before this (422);
/// this catches what comes from outside: provider error text, model-chosen tool call ids and
/// names. JSON columns need nothing: serde_json writes U+0000 as the escape `\u0000`.
pub(super) fn text(value: &str) -> std::borrow::Cow<'_, str> {
    if value.contains('\0') {
        std::borrow::Cow::Owned(value.replace('\0', "\u{fffd}"))
    } else {
        std::borrow::Cow::Borrowed(value)
    }
}

pub(super) fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

impl TryFrom<RunRow> for RunRecord {
    type Error = StoreError;

    fn try_from(row: RunRow) -> StoreResult<Self> {
        let definition: RunDefinition = json("definition", &row.definition)?;
        Ok(Self {
            agent: row.agent,
            instructions: definition.instructions,
            parameters: definition.parameters,
            provider_options: definition.provider_options,
            approval: definition.approval,
            tool_timeout_ms: definition.tool_timeout_ms,
            action_timeout_ms: definition.action_timeout_ms,
            doom_loop: definition.doom_loop,
            required_action: row
                .required_action
                .map(|a| json("required_action", &a))
                .transpose()?,
            id: RunId(row.id),
            session_id: SessionId(row.session_id),
            status: RunStatus::parse(&row.status).ok_or_else(|| corrupt("status", &row.status))?,
            provider: row.provider,
            model: row.model,
            tool_choice: json("tool_choice", &row.tool_choice)?,
            metadata: json("metadata", &row.metadata)?,
            iterations: u32::try_from(row.iterations).unwrap_or(u32::MAX),
            finish_reason: row
                .finish_reason
                .map(|r| FinishReason::parse(&r).ok_or_else(|| corrupt("finish_reason", r)))
                .transpose()?,
            total_usage: TokenUsage {
                reasoning_tokens: count(row.reasoning_tokens),
                estimated: row.usage_estimated,
                input_tokens: count(row.input_tokens),
                output_tokens: count(row.output_tokens),
                total_tokens: count(row.total_tokens),
            },
            error: row.error,
            tools: row.tools.map(|t| json("tools", &t)).transpose()?,
            max_iterations: u32::try_from(row.max_iterations).unwrap_or(u32::MAX),
            client_request_id: row.client_request_id,
            created_at: row.created_at,
            updated_at: row.updated_at,
            events_removed_at: row.events_removed_at,
        })
    }
}

#[derive(sqlx::FromRow)]
pub(super) struct CompactionWithSeq {
    #[sqlx(flatten)]
    pub(super) compaction: CompactionRow,
    pub(super) through_seq: i64,
}

#[derive(sqlx::FromRow)]
pub(super) struct RunWithHash {
    #[sqlx(flatten)]
    pub(super) run: RunRow,
    pub(super) request_hash: Option<String>,
}

#[derive(sqlx::FromRow)]
pub(super) struct MessageRow {
    id: Uuid,
    session_id: Uuid,
    run_id: Uuid,
    role: String,
    content: String,
    tool_calls: String,
    tool_call_id: Option<String>,
    tool_name: Option<String>,
    created_at: DateTime<Utc>,
    reasoning: String,
    status: String,
}

impl TryFrom<MessageRow> for Message {
    type Error = StoreError;

    fn try_from(row: MessageRow) -> StoreResult<Self> {
        Ok(Self {
            id: MessageId(row.id),
            session_id: SessionId(row.session_id),
            run_id: RunId(row.run_id),
            role: Role::parse(&row.role).ok_or_else(|| corrupt("role", &row.role))?,
            content: json("content", &row.content)?,
            tool_calls: json("tool_calls", &row.tool_calls)?,
            reasoning: json("reasoning", &row.reasoning)?,
            tool_call_id: row.tool_call_id,
            tool_name: row.tool_name,
            created_at: row.created_at,
            status: MessageStatus::parse(&row.status)
                .ok_or_else(|| corrupt("status", &row.status))?,
        })
    }
}

/// A row of `events` (migration 0006): see [`crate::events::StoredEvent`].
#[derive(sqlx::FromRow)]
pub(super) struct EventRow {
    sequence: i64,
    kind: i16,
    emitted_at: Option<i64>,
    span_id: Option<Vec<u8>>,
    trace_id: Option<Vec<u8>>,
    body: String,
}

/// The logged events of `run_id`'s rows, `data` derived again from the stored values.
pub(super) fn events(
    run_id: crate::domain::RunId,
    rows: Vec<EventRow>,
) -> StoreResult<Vec<LoggedEvent>> {
    rows.into_iter()
        .map(|row| {
            let envelope = row.emitted_at.map(|emitted_at| StoredEnvelope {
                emitted_at,
                span_id: row.span_id.unwrap_or_default(),
                trace_id: row.trace_id,
            });
            let stored = StoredEvent {
                kind: row.kind,
                envelope,
                body: row.body,
            };
            stored
                .decode(run_id, count(row.sequence))
                .map_err(|error| corrupt("event", error))
        })
        .collect()
}

#[derive(sqlx::FromRow)]
pub(super) struct SessionRow {
    id: Uuid,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    title: Option<String>,
    metadata: String,
    defaults: String,
}

impl TryFrom<SessionRow> for Session {
    type Error = StoreError;

    fn try_from(row: SessionRow) -> StoreResult<Self> {
        Ok(Self {
            id: SessionId(row.id),
            created_at: row.created_at,
            updated_at: row.updated_at,
            title: row.title,
            metadata: json("metadata", &row.metadata)?,
            defaults: json("defaults", &row.defaults)?,
        })
    }
}

pub(super) fn sessions(rows: Vec<SessionRow>) -> StoreResult<Vec<Session>> {
    rows.into_iter().map(TryInto::try_into).collect()
}

/// Parses stored answers `(call_id, answer JSON)`.
pub(super) fn answers(
    rows: Vec<(String, String)>,
) -> StoreResult<Vec<(String, crate::domain::ActionAnswer)>> {
    rows.into_iter()
        .map(|(call_id, answer)| Ok((call_id, json("answer", &answer)?)))
        .collect()
}

/// Parses a stored `required_action`.
pub(super) fn required_action(text: &str) -> StoreResult<crate::domain::RequiredAction> {
    json("required_action", text)
}

pub(super) fn runs<R: TryInto<RunRecord, Error = StoreError>>(
    rows: Vec<R>,
) -> StoreResult<Vec<RunRecord>> {
    rows.into_iter().map(TryInto::try_into).collect()
}

pub(super) fn messages(rows: Vec<MessageRow>) -> StoreResult<Vec<Message>> {
    rows.into_iter().map(TryInto::try_into).collect()
}

/// Implements [`Store`](super::Store) for a backend struct with a `pool` field and an
/// `async fn begin_write(&self)` that opens a write transaction.
macro_rules! impl_store {
    ($store:ty, $db:ty) => {
        #[async_trait::async_trait]
        impl $crate::store::RunStore for $store {
            #[tracing::instrument(skip_all, fields(run_id = %run.id))]
            async fn create_run(
                &self,
                run: &$crate::store::NewRun,
            ) -> $crate::store::StoreResult<$crate::domain::RunRecord> {
                self.create_runs(std::slice::from_ref(run))
                    .await
                    .pop()
                    .unwrap_or_else(|| Err($crate::store::StoreError::Corrupt("no run created".to_owned())))
            }

            async fn create_runs(
                &self,
                runs: &[$crate::store::NewRun],
            ) -> Vec<$crate::store::StoreResult<$crate::domain::RunRecord>> {
                match self.create_runs_once(runs).await {
                    Ok(created) => {
                        let mut results = Vec::with_capacity(runs.len());
                        for (run, created) in runs.iter().zip(created) {
                            results.push(match created {
                                Some(created) => Ok(created),
                                None => Err(self.explain_conflict(run).await.unwrap_or_else(|| {
                                    $crate::store::StoreError::Corrupt(format!(
                                        "run {} conflicted with a row that is gone",
                                        run.id
                                    ))
                                })),
                            });
                        }
                        results
                    }
                    // One run's failure must not fail the others: each alone, so the error is
                    // its own.
                    Err(_) if runs.len() > 1 => {
                        let mut results = Vec::with_capacity(runs.len());
                        for run in runs {
                            results.push(self.create_run(run).await);
                        }
                        results
                    }
                    Err(error) => vec![Err(error)],
                }
            }

            async fn get_run(
                &self,
                id: $crate::domain::RunId,
            ) -> $crate::store::StoreResult<Option<$crate::domain::RunRecord>> {
                use $crate::store::sql::RUN_COLUMNS;
                let row: Option<$crate::store::sql::RunRow> =
                    sqlx::query_as(&format!("SELECT {RUN_COLUMNS} FROM runs WHERE id = $1"))
                        .bind(id.0)
                        .fetch_optional(&self.pool)
                        .await?;
                row.map(TryInto::try_into).transpose()
            }

            async fn list_runs(
                &self,
                filter: &$crate::store::RunFilter,
            ) -> $crate::store::StoreResult<Vec<$crate::domain::RunRecord>> {
                use $crate::store::sql::RUN_COLUMNS;
                let mut query = sqlx::QueryBuilder::<$db>::new(format!("SELECT {RUN_COLUMNS} FROM runs WHERE 1 = 1"));
                if let Some(session_id) = filter.session_id {
                    query.push(" AND session_id = ").push_bind(session_id.0);
                }
                if let Some(status) = filter.status {
                    query.push(" AND status = ").push_bind(status.as_str());
                }
                if let Some(before) = filter.before {
                    query.push(" AND id < ").push_bind(before.0);
                }
                query.push(" ORDER BY id DESC LIMIT ").push_bind(i64::from(filter.limit));
                let rows: Vec<$crate::store::sql::RunRow> =
                    query.build_query_as().fetch_all(&self.pool).await?;
                $crate::store::sql::runs(rows)
            }

            async fn active_runs(
                &self,
            ) -> $crate::store::StoreResult<Vec<$crate::domain::RunRecord>> {
                use $crate::store::sql::RUN_COLUMNS;
                let rows: Vec<$crate::store::sql::RunRow> = sqlx::query_as(&format!(
                    "SELECT {RUN_COLUMNS} FROM runs \
                     WHERE status NOT IN ('completed', 'failed', 'cancelled') ORDER BY id"
                ))
                .fetch_all(&self.pool)
                .await?;
                $crate::store::sql::runs(rows)
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::EventStore for $store {
            async fn append_events_as(
                &self,
                owner: Option<&str>,
                events: &[$crate::store::EventWrite],
            ) -> $crate::store::StoreResult<Vec<$crate::domain::RunId>> {
                use $crate::store::sql::to_i64;
                if events.is_empty() {
                    return Ok(Vec::new());
                }
                // Encoded before the transaction opens: it stays as short as before.
                let encoded: Vec<$crate::events::StoredEvent> = events
                    .iter()
                    .map(|write| $crate::events::StoredEvent::encode(write.run_id, &write.event))
                    .collect();
                let mut tx = self.begin_write().await?;
                // Fencing: only runs this process (still) holds the lease of are written. The
                // check holds until the commit: SQLite's write transaction excludes every other
                // writer; PostgreSQL's `FOR SHARE` row locks make a takeover wait for it.
                let mut fenced = Vec::new();
                let kept;
                let all = events;
                let events = if let Some(owner) = owner {
                    let mut runs: Vec<uuid::Uuid> = events.iter().map(|w| w.run_id.0).collect();
                    runs.sort_unstable();
                    runs.dedup();
                    let mut check = sqlx::QueryBuilder::<$db>::new(
                        "SELECT id FROM runs WHERE (lease_owner IS NULL OR lease_owner = ",
                    );
                    check.push_bind(owner).push(") AND id IN (");
                    let mut list = check.separated(", ");
                    for run in &runs {
                        list.push_bind(*run);
                    }
                    check.push(")").push(Self::ROW_LOCK);
                    let owned: Vec<uuid::Uuid> =
                        check.build_query_scalar().fetch_all(&mut *tx).await?;
                    if owned.len() == runs.len() {
                        events
                    } else {
                        fenced = runs
                            .into_iter()
                            .filter(|run| !owned.contains(run))
                            .map($crate::domain::RunId)
                            .collect();
                        kept = events
                            .iter()
                            .filter(|w| !fenced.contains(&w.run_id))
                            .cloned()
                            .collect::<Vec<_>>();
                        if kept.is_empty() {
                            return Ok(fenced);
                        }
                        &kept[..]
                    }
                } else {
                    events
                };
                let stored: Vec<_> = all
                    .iter()
                    .zip(&encoded)
                    .filter(|(write, _)| !fenced.contains(&write.run_id))
                    .collect();
                // One multi-row INSERT per chunk keeps group commit to a few statements.
                for chunk in stored.chunks(200) {
                    let mut insert = sqlx::QueryBuilder::<$db>::new(
                        "INSERT INTO events (run_id, sequence, kind, emitted_at, span_id, \
                         trace_id, body) ",
                    );
                    insert.push_values(chunk, |mut row, (write, stored)| {
                        let envelope = stored.envelope.as_ref();
                        row.push_bind(write.run_id.0)
                            .push_bind(to_i64(write.event.sequence))
                            .push_bind(stored.kind)
                            .push_bind(envelope.map(|e| e.emitted_at))
                            .push_bind(envelope.map(|e| e.span_id.as_slice()))
                            .push_bind(envelope.and_then(|e| e.trace_id.as_deref()))
                            .push_bind(stored.body.as_str());
                    });
                    insert.build().execute(&mut *tx).await?;
                }
                // A run's status and progress changes that follow one another in the batch are
                // written as one UPDATE (e.g. a start's `run_started`, `context_built` and
                // `model_started`): the later values win, as they would one after another.
                let mut carried: Option<(
                    $crate::domain::RunId,
                    Option<$crate::domain::RunStatus>,
                    Option<(u32, $crate::domain::TokenUsage)>,
                )> = None;
                for (index, write) in events.iter().enumerate() {
                    let change = &write.change;
                    if let Some(message) = &change.message {
                        Self::insert_message(&mut tx, message).await?;
                    }
                    if let Some(snapshot) = &change.snapshot {
                        Self::upsert_snapshot(&mut tx, write, snapshot).await?;
                    }
                    if let Some(compaction) = &change.compaction {
                        Self::insert_compaction_row(&mut tx, compaction).await?;
                    }
                    if let Some((session_id, calibration)) = &change.calibration {
                        sqlx::query(
                            "UPDATE sessions SET context_reported_tokens = $2, \
                             context_counted_tokens = $3 WHERE id = $1",
                        )
                        .bind(session_id.0)
                        .bind(to_i64(calibration.reported_tokens))
                        .bind(to_i64(calibration.counted_tokens))
                        .execute(&mut *tx)
                        .await?;
                    }
                    if let Some(reason) = change.finish_reason {
                        sqlx::query("UPDATE runs SET finish_reason = $2 WHERE id = $1")
                            .bind(write.run_id.0)
                            .bind(reason.as_str())
                            .execute(&mut *tx)
                            .await?;
                    }
                    let (mut status, mut progress) = (change.status, change.progress);
                    if let Some((run_id, earlier_status, earlier_progress)) = carried.take() {
                        if run_id == write.run_id {
                            status = status.or(earlier_status);
                            progress = progress.or(earlier_progress);
                        } else {
                            Self::update_run_progress(&mut tx, run_id, earlier_status, earlier_progress)
                                .await?;
                        }
                    }
                    if status.is_some() || progress.is_some() {
                        // Carried into the next write of the same run, unless this one ends or
                        // pauses the run, or the next pauses it (which keeps `required_action`).
                        let carry = write.outcome.is_none()
                            && change.required_action.is_none()
                            && events.get(index + 1).is_some_and(|next| {
                                next.run_id == write.run_id
                                    && next.change.status
                                        != Some($crate::domain::RunStatus::RequiresAction)
                            });
                        if carry {
                            carried = Some((write.run_id, status, progress));
                        } else {
                            Self::update_run_progress(&mut tx, write.run_id, status, progress).await?;
                        }
                    }
                    if let Some(action) = &change.required_action {
                        sqlx::query(
                            "UPDATE runs SET required_action = $2 WHERE id = $1 \
                             AND status NOT IN ('completed', 'failed', 'cancelled')",
                        )
                        .bind(write.run_id.0)
                        .bind($crate::store::sql::to_json(action)?)
                        .execute(&mut *tx)
                        .await?;
                    }
                    let Some(outcome) = &write.outcome else { continue };
                    sqlx::query(
                        "UPDATE runs SET status = $2, finish_reason = $3, error = $4, updated_at = $5, \
                         required_action = NULL WHERE id = $1",
                    )
                    .bind(write.run_id.0)
                    .bind(outcome.status.as_str())
                    .bind(outcome.finish_reason.map(|r| r.as_str()))
                    .bind(outcome.error.as_deref().map($crate::store::sql::text))
                    .bind(chrono::Utc::now())
                    .execute(&mut *tx)
                    .await?;
                    // The snapshot of a finished run shows how it ended.
                    sqlx::query(
                        "UPDATE snapshots SET status = $2, last_sequence = $3, created_at = $4, \
                         (iteration, input_tokens, output_tokens, total_tokens, reasoning_tokens, \
                         usage_estimated) = (SELECT iterations, input_tokens, output_tokens, \
                         total_tokens, reasoning_tokens, usage_estimated FROM runs WHERE id = $1) \
                         WHERE run_id = $1",
                    )
                    .bind(write.run_id.0)
                    .bind(outcome.status.as_str())
                    .bind(to_i64(write.event.sequence))
                    .bind(chrono::Utc::now())
                    .execute(&mut *tx)
                    .await?;
                }
                tx.commit().await?;
                Ok(fenced)
            }

            async fn read_events(
                &self,
                run_id: $crate::domain::RunId,
                after: u64,
                limit: u32,
            ) -> $crate::store::StoreResult<Vec<$crate::events::LoggedEvent>> {
                use $crate::store::sql::to_i64;
                let rows: Vec<$crate::store::sql::EventRow> = sqlx::query_as(
                    "SELECT sequence, kind, emitted_at, span_id, trace_id, body FROM events \
                     WHERE run_id = $1 AND sequence > $2 ORDER BY sequence LIMIT $3",
                )
                .bind(run_id.0)
                .bind(to_i64(after))
                .bind(i64::from(limit))
                .fetch_all(&self.pool)
                .await?;
                $crate::store::sql::events(run_id, rows)
            }

            async fn last_sequence(
                &self,
                run_id: $crate::domain::RunId,
            ) -> $crate::store::StoreResult<u64> {
                let last: Option<i64> =
                    sqlx::query_scalar("SELECT MAX(sequence) FROM events WHERE run_id = $1")
                        .bind(run_id.0)
                        .fetch_one(&self.pool)
                        .await?;
                Ok(last.and_then(|s| u64::try_from(s).ok()).unwrap_or(0))
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::SessionStore for $store {
            async fn get_session(
                &self,
                id: $crate::domain::SessionId,
            ) -> $crate::store::StoreResult<Option<$crate::domain::Session>> {
                use $crate::store::sql::SESSION_COLUMNS;
                let row: Option<$crate::store::sql::SessionRow> =
                    sqlx::query_as(&format!("SELECT {SESSION_COLUMNS} FROM sessions WHERE id = $1"))
                        .bind(id.0)
                        .fetch_optional(&self.pool)
                        .await?;
                row.map(TryInto::try_into).transpose()
            }

            async fn list_sessions(
                &self,
                before: Option<$crate::domain::SessionId>,
                limit: u32,
            ) -> $crate::store::StoreResult<Vec<$crate::domain::Session>> {
                use $crate::store::sql::SESSION_COLUMNS;
                let mut query = sqlx::QueryBuilder::<$db>::new(format!(
                    "SELECT {SESSION_COLUMNS} FROM sessions WHERE 1 = 1"
                ));
                if let Some(before) = before {
                    query.push(" AND id < ").push_bind(before.0);
                }
                query.push(" ORDER BY id DESC LIMIT ").push_bind(i64::from(limit));
                let rows: Vec<$crate::store::sql::SessionRow> =
                    query.build_query_as().fetch_all(&self.pool).await?;
                $crate::store::sql::sessions(rows)
            }

            async fn create_session(
                &self,
                session: &$crate::domain::Session,
            ) -> $crate::store::StoreResult<$crate::domain::Session> {
                use $crate::store::sql::{SESSION_COLUMNS, to_json};
                let row: $crate::store::sql::SessionRow = sqlx::query_as(&format!(
                    "INSERT INTO sessions ({SESSION_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6) \
                     RETURNING {SESSION_COLUMNS}"
                ))
                .bind(session.id.0)
                .bind(session.created_at)
                .bind(session.updated_at)
                .bind(session.title.as_deref())
                .bind(to_json(&session.metadata)?)
                .bind(to_json(&session.defaults)?)
                .fetch_one(&self.pool)
                .await?;
                row.try_into()
            }

            async fn update_session(
                &self,
                id: $crate::domain::SessionId,
                patch: &$crate::store::SessionPatch,
                now: chrono::DateTime<chrono::Utc>,
            ) -> $crate::store::StoreResult<Option<$crate::domain::Session>> {
                use $crate::store::sql::{SESSION_COLUMNS, to_json};
                let metadata = patch.metadata.as_ref().map(to_json).transpose()?;
                let row: Option<$crate::store::sql::SessionRow> = sqlx::query_as(&format!(
                    "UPDATE sessions SET updated_at = $2, \
                     title = CASE WHEN $3 THEN $4 ELSE title END, \
                     metadata = COALESCE($5, metadata) WHERE id = $1 RETURNING {SESSION_COLUMNS}"
                ))
                .bind(id.0)
                .bind(now)
                .bind(patch.title.is_some())
                .bind(patch.title.clone().flatten())
                .bind(metadata)
                .fetch_optional(&self.pool)
                .await?;
                row.map(TryInto::try_into).transpose()
            }

            async fn delete_session(
                &self,
                id: $crate::domain::SessionId,
            ) -> $crate::store::StoreResult<bool> {
                let mut tx = self.begin_write().await?;
                let active: Option<uuid::Uuid> = sqlx::query_scalar(
                    "SELECT id FROM runs WHERE session_id = $1 \
                     AND status NOT IN ('completed', 'failed', 'cancelled') LIMIT 1",
                )
                .bind(id.0)
                .fetch_optional(&mut *tx)
                .await?;
                if let Some(run) = active {
                    return Err($crate::store::StoreError::SessionBusy {
                        session_id: id,
                        active_run: $crate::domain::RunId(run),
                    });
                }
                let deleted = sqlx::query("DELETE FROM sessions WHERE id = $1")
                    .bind(id.0)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(deleted.rows_affected() > 0)
            }

            async fn session_messages(
                &self,
                session_id: $crate::domain::SessionId,
            ) -> $crate::store::StoreResult<Vec<$crate::domain::Message>> {
                use $crate::store::sql::MESSAGE_COLUMNS;
                let rows: Vec<$crate::store::sql::MessageRow> = sqlx::query_as(&format!(
                    "SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 ORDER BY seq"
                ))
                .bind(session_id.0)
                .fetch_all(&self.pool)
                .await?;
                $crate::store::sql::messages(rows)
            }

            async fn session_messages_page(
                &self,
                session_id: $crate::domain::SessionId,
                after: Option<$crate::domain::MessageId>,
                limit: u32,
            ) -> $crate::store::StoreResult<Option<Vec<$crate::domain::Message>>> {
                use $crate::store::sql::MESSAGE_COLUMNS;
                let from: i64 = match after {
                    None => 0,
                    Some(after) => {
                        let seq: Option<i64> = sqlx::query_scalar(
                            "SELECT seq FROM messages WHERE id = $1 AND session_id = $2",
                        )
                        .bind(after.0)
                        .bind(session_id.0)
                        .fetch_optional(&self.pool)
                        .await?;
                        match seq {
                            Some(seq) => seq,
                            None => return Ok(None),
                        }
                    }
                };
                let rows: Vec<$crate::store::sql::MessageRow> = sqlx::query_as(&format!(
                    "SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 AND seq > $2 \
                     ORDER BY seq LIMIT $3"
                ))
                .bind(session_id.0)
                .bind(from)
                .bind(i64::from(limit))
                .fetch_all(&self.pool)
                .await?;
                $crate::store::sql::messages(rows).map(Some)
            }

            async fn run_messages(
                &self,
                run_id: $crate::domain::RunId,
                role: $crate::domain::Role,
            ) -> $crate::store::StoreResult<Vec<$crate::domain::Message>> {
                use $crate::store::sql::MESSAGE_COLUMNS;
                let rows: Vec<$crate::store::sql::MessageRow> = sqlx::query_as(&format!(
                    "SELECT {MESSAGE_COLUMNS} FROM messages WHERE run_id = $1 AND role = $2 ORDER BY seq"
                ))
                .bind(run_id.0)
                .bind(role.as_str())
                .fetch_all(&self.pool)
                .await?;
                $crate::store::sql::messages(rows)
            }

            async fn session_context(
                &self,
                session_id: $crate::domain::SessionId,
            ) -> $crate::store::StoreResult<$crate::store::SessionContext> {
                use $crate::store::sql::{COMPACTION_COLUMNS, MESSAGE_COLUMNS};
                let calibration = Self::calibration(&self.pool, session_id).await?;
                let latest: Option<($crate::store::sql::CompactionRow, i64)> = {
                    let row: Option<$crate::store::sql::CompactionWithSeq> = sqlx::query_as(&format!(
                        "SELECT {COMPACTION_COLUMNS}, through_seq FROM compactions \
                         WHERE session_id = $1 ORDER BY through_seq DESC, id DESC LIMIT 1"
                    ))
                    .bind(session_id.0)
                    .fetch_optional(&self.pool)
                    .await?;
                    row.map(|row| (row.compaction, row.through_seq))
                };
                let Some((compaction, through_seq)) = latest else {
                    let messages = self.session_messages(session_id).await?;
                    return Ok($crate::store::SessionContext {
                        compaction: None,
                        messages,
                        calibration,
                    });
                };
                let mut rows: Vec<$crate::store::sql::MessageRow> = sqlx::query_as(&format!(
                    "SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 \
                     AND role = 'system' AND seq <= $2 ORDER BY seq"
                ))
                .bind(session_id.0)
                .bind(through_seq)
                .fetch_all(&self.pool)
                .await?;
                // The latest user input is kept verbatim, even when the compaction covers it.
                let pinned: Option<$crate::store::sql::MessageRow> = sqlx::query_as(&format!(
                    "SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 \
                     AND role = 'user' AND seq <= $2 AND NOT EXISTS (SELECT 1 FROM messages \
                     WHERE session_id = $1 AND role = 'user' AND seq > $2) \
                     ORDER BY seq DESC LIMIT 1"
                ))
                .bind(session_id.0)
                .bind(through_seq)
                .fetch_optional(&self.pool)
                .await?;
                rows.extend(pinned);
                let after: Vec<$crate::store::sql::MessageRow> = sqlx::query_as(&format!(
                    "SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 AND seq > $2 \
                     ORDER BY seq"
                ))
                .bind(session_id.0)
                .bind(through_seq)
                .fetch_all(&self.pool)
                .await?;
                rows.extend(after);
                Ok($crate::store::SessionContext {
                    compaction: Some(compaction.try_into()?),
                    messages: $crate::store::sql::messages(rows)?,
                    calibration,
                })
            }

            async fn session_context_after(
                &self,
                session_id: $crate::domain::SessionId,
                after: Option<$crate::domain::MessageId>,
            ) -> $crate::store::StoreResult<$crate::store::ContextUpdate> {
                use $crate::store::sql::MESSAGE_COLUMNS;
                let compacted: Option<uuid::Uuid> = sqlx::query_scalar(
                    "SELECT id FROM compactions WHERE session_id = $1 LIMIT 1",
                )
                .bind(session_id.0)
                .fetch_optional(&self.pool)
                .await?;
                if compacted.is_some() {
                    return Ok($crate::store::ContextUpdate::Compacted(Box::new(
                        self.session_context(session_id).await?,
                    )));
                }
                let calibration = Self::calibration(&self.pool, session_id).await?;
                // After a message that is not the session's: nothing (`seq > NULL`).
                let after_clause = if after.is_some() {
                    "seq > (SELECT seq FROM messages WHERE id = $2 AND session_id = $1)"
                } else {
                    "$2 IS NULL"
                };
                let rows: Vec<$crate::store::sql::MessageRow> = sqlx::query_as(&format!(
                    "SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 \
                     AND {after_clause} ORDER BY seq"
                ))
                .bind(session_id.0)
                .bind(after.map(|id| id.0))
                .fetch_all(&self.pool)
                .await?;
                Ok($crate::store::ContextUpdate::Appended {
                    messages: $crate::store::sql::messages(rows)?,
                    calibration,
                })
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::LeaseStore for $store {
            fn single_process(&self) -> bool {
                Self::SINGLE_PROCESS
            }

            async fn claim_runs(
                &self,
                lease: &$crate::store::Lease,
                now_ms: i64,
                all: bool,
                limit: u32,
            ) -> $crate::store::StoreResult<Vec<$crate::store::ClaimedRun>> {
                use $crate::store::sql::RUN_COLUMNS;
                let mut tx = self.begin_write().await?;
                let candidates: Vec<uuid::Uuid> = sqlx::query_scalar(
                    "SELECT id FROM runs WHERE status NOT IN ('completed', 'failed', 'cancelled') \
                     AND (lease_owner IS NULL OR lease_owner <> $1) \
                     AND ($2 OR lease_owner IS NULL OR lease_expires_ms IS NULL OR lease_expires_ms < $3) \
                     ORDER BY id LIMIT $4",
                )
                .bind(&lease.owner)
                .bind(all)
                .bind(now_ms)
                .bind(i64::from(limit))
                .fetch_all(&mut *tx)
                .await?;
                let mut claimed = Vec::with_capacity(candidates.len());
                for id in candidates {
                    // Re-checked under the row lock: a concurrent claimer that won is skipped.
                    let row: Option<$crate::store::sql::ClaimRow> = sqlx::query_as(&format!(
                        "UPDATE runs SET lease_owner = $2, lease_expires_ms = $3 WHERE id = $1 \
                         AND status NOT IN ('completed', 'failed', 'cancelled') \
                         AND (lease_owner IS NULL OR lease_owner <> $2) \
                         AND ($4 OR lease_owner IS NULL OR lease_expires_ms IS NULL OR lease_expires_ms < $5) \
                         RETURNING {RUN_COLUMNS}, cancel_requested"
                    ))
                    .bind(id)
                    .bind(&lease.owner)
                    .bind(lease.expires_ms)
                    .bind(all)
                    .bind(now_ms)
                    .fetch_optional(&mut *tx)
                    .await?;
                    if let Some(row) = row {
                        claimed.push($crate::store::ClaimedRun {
                            record: row.run.try_into()?,
                            cancel_requested: row.cancel_requested,
                        });
                    }
                }
                tx.commit().await?;
                Ok(claimed)
            }

            async fn claim_run(
                &self,
                run_id: $crate::domain::RunId,
                lease: &$crate::store::Lease,
                now_ms: i64,
            ) -> $crate::store::StoreResult<Option<$crate::store::ClaimedRun>> {
                use $crate::store::sql::RUN_COLUMNS;
                let row: Option<$crate::store::sql::ClaimRow> = sqlx::query_as(&format!(
                    "UPDATE runs SET lease_owner = $2, lease_expires_ms = $3 WHERE id = $1 \
                     AND status NOT IN ('completed', 'failed', 'cancelled') \
                     AND (lease_owner IS NULL OR lease_owner = $2 OR lease_expires_ms IS NULL \
                     OR lease_expires_ms < $4) \
                     RETURNING {RUN_COLUMNS}, cancel_requested"
                ))
                .bind(run_id.0)
                .bind(&lease.owner)
                .bind(lease.expires_ms)
                .bind(now_ms)
                .fetch_optional(&self.pool)
                .await?;
                row.map(|row| {
                    Ok($crate::store::ClaimedRun {
                        record: row.run.try_into()?,
                        cancel_requested: row.cancel_requested,
                    })
                })
                .transpose()
            }

            async fn renew_leases(
                &self,
                owner: &str,
                expires_ms: i64,
            ) -> $crate::store::StoreResult<$crate::store::LeaseRenewal> {
                let rows: Vec<(uuid::Uuid, bool)> = sqlx::query_as(
                    "UPDATE runs SET lease_expires_ms = $2 WHERE lease_owner = $1 \
                     AND status NOT IN ('completed', 'failed', 'cancelled') \
                     RETURNING id, cancel_requested",
                )
                .bind(owner)
                .bind(expires_ms)
                .fetch_all(&self.pool)
                .await?;
                let mut renewal = $crate::store::LeaseRenewal::default();
                for (id, cancel_requested) in rows {
                    let id = $crate::domain::RunId(id);
                    renewal.owned.push(id);
                    if cancel_requested {
                        renewal.cancel_requested.push(id);
                    }
                }
                Ok(renewal)
            }

            async fn release_leases(&self, owner: &str) -> $crate::store::StoreResult<()> {
                sqlx::query(
                    "UPDATE runs SET lease_expires_ms = 0 WHERE lease_owner = $1 \
                     AND status NOT IN ('completed', 'failed', 'cancelled')",
                )
                .bind(owner)
                .execute(&self.pool)
                .await?;
                Ok(())
            }

            async fn request_cancel(
                &self,
                run_id: $crate::domain::RunId,
            ) -> $crate::store::StoreResult<bool> {
                let updated = sqlx::query(
                    "UPDATE runs SET cancel_requested = TRUE WHERE id = $1 \
                     AND status NOT IN ('completed', 'failed', 'cancelled')",
                )
                .bind(run_id.0)
                .execute(&self.pool)
                .await?;
                Ok(updated.rows_affected() > 0)
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::ActionStore for $store {
            async fn submit_answers(
                &self,
                run_id: $crate::domain::RunId,
                message_id: $crate::domain::MessageId,
                answers: &[(String, $crate::domain::ActionAnswer)],
                now_ms: i64,
            ) -> $crate::store::StoreResult<$crate::store::SubmitOutcome> {
                use $crate::store::SubmitOutcome;
                let mut tx = self.begin_write().await?;
                // The run's row is locked until the commit: submissions and `close_action`
                // follow one another.
                let row: Option<(String, Option<String>)> = sqlx::query_as(&format!(
                    "SELECT status, required_action FROM runs WHERE id = $1{}",
                    Self::ROW_LOCK_UPDATE
                ))
                .bind(run_id.0)
                .fetch_optional(&mut *tx)
                .await?;
                let Some((status, action)) = row else {
                    return Ok(SubmitOutcome::NotFound);
                };
                let status = $crate::domain::RunStatus::parse(&status)
                    .ok_or_else(|| $crate::store::StoreError::Corrupt(format!("status: {status}")))?;
                let action = match action {
                    Some(text) if status == $crate::domain::RunStatus::RequiresAction => {
                        $crate::store::sql::required_action(&text)?
                    }
                    _ => return Ok(SubmitOutcome::NotWaiting(status)),
                };
                if action.message_id != message_id {
                    return Ok(SubmitOutcome::NotWaiting(status));
                }
                if $crate::store::unix_ms(action.expires_at) <= now_ms {
                    return Ok(SubmitOutcome::Expired);
                }
                let answered: Vec<String> = sqlx::query_scalar(
                    "SELECT call_id FROM action_answers WHERE run_id = $1 AND message_id = $2",
                )
                .bind(run_id.0)
                .bind(message_id.0)
                .fetch_all(&mut *tx)
                .await?;
                if let Some((call_id, _)) = answers.iter().find(|(id, _)| answered.contains(id)) {
                    return Ok(SubmitOutcome::AlreadyAnswered(call_id.clone()));
                }
                let now = chrono::Utc::now();
                for (call_id, answer) in answers {
                    sqlx::query(
                        "INSERT INTO action_answers (run_id, message_id, call_id, answer, \
                         created_at) VALUES ($1, $2, $3, $4, $5)",
                    )
                    .bind(run_id.0)
                    .bind(message_id.0)
                    .bind($crate::store::sql::text(call_id))
                    .bind($crate::store::sql::to_json(answer)?)
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
                }
                tx.commit().await?;
                Ok(SubmitOutcome::Accepted)
            }

            async fn action_answers(
                &self,
                run_id: $crate::domain::RunId,
                message_id: $crate::domain::MessageId,
            ) -> $crate::store::StoreResult<Vec<(String, $crate::domain::ActionAnswer)>> {
                let rows: Vec<(String, String)> = sqlx::query_as(
                    "SELECT call_id, answer FROM action_answers \
                     WHERE run_id = $1 AND message_id = $2",
                )
                .bind(run_id.0)
                .bind(message_id.0)
                .fetch_all(&self.pool)
                .await?;
                $crate::store::sql::answers(rows)
            }

            async fn close_action(
                &self,
                run_id: $crate::domain::RunId,
                message_id: $crate::domain::MessageId,
            ) -> $crate::store::StoreResult<Vec<(String, $crate::domain::ActionAnswer)>> {
                let mut tx = self.begin_write().await?;
                // Waits for a submission holding the row's lock to commit.
                let _: Option<uuid::Uuid> = sqlx::query_scalar(&format!(
                    "SELECT id FROM runs WHERE id = $1{}",
                    Self::ROW_LOCK_UPDATE
                ))
                .bind(run_id.0)
                .fetch_optional(&mut *tx)
                .await?;
                let rows: Vec<(String, String)> = sqlx::query_as(
                    "SELECT call_id, answer FROM action_answers \
                     WHERE run_id = $1 AND message_id = $2",
                )
                .bind(run_id.0)
                .bind(message_id.0)
                .fetch_all(&mut *tx)
                .await?;
                tx.commit().await?;
                $crate::store::sql::answers(rows)
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::SnapshotStore for $store {
            async fn get_snapshot(
                &self,
                run_id: $crate::domain::RunId,
            ) -> $crate::store::StoreResult<Option<$crate::domain::Snapshot>> {
                use $crate::store::sql::SNAPSHOT_COLUMNS;
                let row: Option<$crate::store::sql::SnapshotRow> = sqlx::query_as(&format!(
                    "SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE run_id = $1"
                ))
                .bind(run_id.0)
                .fetch_optional(&self.pool)
                .await?;
                row.map(TryInto::try_into).transpose()
            }

            async fn list_snapshots(
                &self,
                filter: &$crate::store::SnapshotFilter,
            ) -> $crate::store::StoreResult<Vec<$crate::domain::Snapshot>> {
                use $crate::store::sql::SNAPSHOT_COLUMNS;
                let mut query = sqlx::QueryBuilder::<$db>::new(format!(
                    "SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE 1 = 1"
                ));
                if let Some(session_id) = filter.session_id {
                    query.push(" AND session_id = ").push_bind(session_id.0);
                }
                if let Some(status) = filter.status {
                    query.push(" AND status = ").push_bind(status.as_str());
                }
                if let Some(before) = filter.before {
                    query.push(" AND run_id < ").push_bind(before.0);
                }
                query.push(" ORDER BY run_id DESC LIMIT ").push_bind(i64::from(filter.limit));
                let rows: Vec<$crate::store::sql::SnapshotRow> =
                    query.build_query_as().fetch_all(&self.pool).await?;
                $crate::store::sql::snapshots(rows)
            }

            async fn delete_snapshot(
                &self,
                run_id: $crate::domain::RunId,
            ) -> $crate::store::StoreResult<bool> {
                let mut tx = self.begin_write().await?;
                let status: Option<String> =
                    sqlx::query_scalar("SELECT status FROM runs WHERE id = $1")
                        .bind(run_id.0)
                        .fetch_optional(&mut *tx)
                        .await?;
                let terminal = status
                    .as_deref()
                    .and_then($crate::domain::RunStatus::parse)
                    .is_none_or(|status| status.is_terminal());
                if !terminal {
                    return Err($crate::store::StoreError::RunActive(run_id));
                }
                let deleted = sqlx::query("DELETE FROM snapshots WHERE run_id = $1")
                    .bind(run_id.0)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(deleted.rows_affected() > 0)
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::CompactionStore for $store {
            async fn session_compactions(
                &self,
                session_id: $crate::domain::SessionId,
            ) -> $crate::store::StoreResult<Vec<$crate::domain::Compaction>> {
                use $crate::store::sql::COMPACTION_COLUMNS;
                let rows: Vec<$crate::store::sql::CompactionRow> = sqlx::query_as(&format!(
                    "SELECT {COMPACTION_COLUMNS} FROM compactions WHERE session_id = $1 \
                     ORDER BY through_seq, id"
                ))
                .bind(session_id.0)
                .fetch_all(&self.pool)
                .await?;
                $crate::store::sql::compactions(rows)
            }

            async fn insert_compaction(
                &self,
                compaction: &$crate::domain::Compaction,
            ) -> $crate::store::StoreResult<()> {
                let mut tx = self.begin_write().await?;
                let active: Option<uuid::Uuid> = sqlx::query_scalar(
                    "SELECT id FROM runs WHERE session_id = $1 \
                     AND status NOT IN ('completed', 'failed', 'cancelled') LIMIT 1",
                )
                .bind(compaction.session_id.0)
                .fetch_optional(&mut *tx)
                .await?;
                if let Some(run) = active {
                    return Err($crate::store::StoreError::SessionBusy {
                        session_id: compaction.session_id,
                        active_run: $crate::domain::RunId(run),
                    });
                }
                Self::insert_compaction_row(&mut tx, compaction).await?;
                tx.commit().await?;
                Ok(())
            }

            async fn compaction_config(
                &self,
            ) -> $crate::store::StoreResult<Option<$crate::domain::CompactionConfig>> {
                use $crate::store::sql::SETTINGS_COLUMNS;
                let row: Option<$crate::store::sql::SettingsRow> = sqlx::query_as(&format!(
                    "SELECT {SETTINGS_COLUMNS} FROM compaction_settings WHERE id = 1"
                ))
                .fetch_optional(&self.pool)
                .await?;
                Ok(row.map(Into::into))
            }

            async fn put_compaction_config(
                &self,
                config: &$crate::domain::CompactionConfig,
            ) -> $crate::store::StoreResult<()> {
                use $crate::store::sql::{SETTINGS_COLUMNS, text, to_i64};
                sqlx::query(&format!(
                    "INSERT INTO compaction_settings (id, {SETTINGS_COLUMNS}, updated_at) \
                     VALUES (1, $1, $2, $3, $4, $5, $6, $7, $8, $9) \
                     ON CONFLICT (id) DO UPDATE SET auto = excluded.auto, prune = excluded.prune, \
                     buffer_tokens = excluded.buffer_tokens, keep_tokens = excluded.keep_tokens, \
                     tail_turns = excluded.tail_turns, model = excluded.model, \
                     provider = excluded.provider, \
                     circuit_breaker_threshold = excluded.circuit_breaker_threshold, \
                     updated_at = excluded.updated_at"
                ))
                .bind(config.auto)
                .bind(config.prune)
                .bind(to_i64(config.buffer_tokens))
                .bind(to_i64(config.keep_tokens))
                .bind(i64::from(config.tail_turns))
                .bind(text(&config.model))
                .bind(text(&config.provider))
                .bind(i64::from(config.circuit_breaker_threshold))
                .bind(chrono::Utc::now())
                .execute(&self.pool)
                .await?;
                Ok(())
            }

            async fn circuit_breaker(
                &self,
                threshold: u32,
            ) -> $crate::store::StoreResult<$crate::domain::CircuitBreaker> {
                let row: $crate::store::sql::BreakerRow = sqlx::query_as(
                    "SELECT consecutive_failures, is_open, opened_at, last_error \
                     FROM compaction_breaker WHERE id = 1",
                )
                .fetch_one(&self.pool)
                .await?;
                Ok(row.with_threshold(threshold))
            }

            async fn record_compaction_failure(
                &self,
                error: &str,
                threshold: u32,
            ) -> $crate::store::StoreResult<$crate::store::BreakerFailure> {
                let mut tx = self.begin_write().await?;
                // Read under a lock that holds until the commit, so concurrent failures (other
                // runs, other replicas) are counted one after the other.
                let before: $crate::store::sql::BreakerRow = sqlx::query_as(&format!(
                    "SELECT consecutive_failures, is_open, opened_at, last_error \
                     FROM compaction_breaker WHERE id = 1{}",
                    Self::ROW_LOCK_UPDATE
                ))
                .fetch_one(&mut *tx)
                .await?;
                let failures = before.consecutive_failures.saturating_add(1);
                let open = before.is_open || failures >= i64::from(threshold);
                let opened = open && !before.is_open;
                let row: $crate::store::sql::BreakerRow = sqlx::query_as(
                    "UPDATE compaction_breaker SET consecutive_failures = $1, is_open = $2, \
                     opened_at = CASE WHEN $3 THEN $4 ELSE opened_at END, last_error = $5 \
                     WHERE id = 1 RETURNING consecutive_failures, is_open, opened_at, last_error",
                )
                .bind(failures)
                .bind(open)
                .bind(opened)
                .bind(chrono::Utc::now())
                .bind($crate::store::sql::text(error))
                .fetch_one(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok($crate::store::BreakerFailure {
                    breaker: row.with_threshold(threshold),
                    opened,
                })
            }

            async fn reset_circuit_breaker(
                &self,
                threshold: u32,
            ) -> $crate::store::StoreResult<$crate::domain::CircuitBreaker> {
                let row: $crate::store::sql::BreakerRow = sqlx::query_as(
                    "UPDATE compaction_breaker SET consecutive_failures = 0, is_open = FALSE, \
                     opened_at = NULL, last_error = NULL WHERE id = 1 \
                     RETURNING consecutive_failures, is_open, opened_at, last_error",
                )
                .fetch_one(&self.pool)
                .await?;
                Ok(row.with_threshold(threshold))
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::RetentionStore for $store {
            async fn remove_expired_events(
                &self,
                ended_before: chrono::DateTime<chrono::Utc>,
                limit: u32,
            ) -> $crate::store::StoreResult<u32> {
                let mut tx = self.begin_write().await?;
                let runs: Vec<uuid::Uuid> = sqlx::query_scalar(
                    "SELECT id FROM runs WHERE status IN ('completed', 'failed', 'cancelled') \
                     AND events_removed_at IS NULL AND updated_at < $1 ORDER BY updated_at LIMIT $2",
                )
                .bind(ended_before)
                .bind(i64::from(limit))
                .fetch_all(&mut *tx)
                .await?;
                if runs.is_empty() {
                    return Ok(0);
                }
                let now = chrono::Utc::now();
                for statement in [
                    "DELETE FROM events WHERE run_id IN (",
                    "DELETE FROM snapshots WHERE run_id IN (",
                    "DELETE FROM action_answers WHERE run_id IN (",
                    "UPDATE runs SET events_removed_at = ",
                ] {
                    let mut query = sqlx::QueryBuilder::<$db>::new(statement);
                    if statement.starts_with("UPDATE") {
                        query.push_bind(now).push(" WHERE id IN (");
                    }
                    let mut list = query.separated(", ");
                    for run in &runs {
                        list.push_bind(*run);
                    }
                    query.push(")");
                    query.build().execute(&mut *tx).await?;
                }
                tx.commit().await?;
                Ok(u32::try_from(runs.len()).unwrap_or(u32::MAX))
            }
        }
    };
}

/// Backend helpers: message inserts, and explaining a unique violation on insert: a reused client request id first (a retry of the
/// same request is not "busy"), then an active run in the session.
macro_rules! impl_explain_conflict {
    ($store:ty, $db:ty) => {
        impl $store {
            /// Creates the runs in one transaction: each run, its user message and its new
            /// session (or the existing session's `updated_at` and first defaults). A run whose
            /// session is missing is `Err` for the whole batch; a run that conflicts with a
            /// unique index (its `client_request_id` is taken, its session has an active run) is
            /// `None` and writes nothing, the others are written.
            async fn create_runs_once(
                &self,
                runs: &[$crate::store::NewRun],
            ) -> $crate::store::StoreResult<Vec<Option<$crate::domain::RunRecord>>> {
                use $crate::store::sql::{MESSAGE_COLUMNS, RUN_COLUMNS, to_json};
                let mut tx = self.begin_write().await?;
                let mut created = Vec::with_capacity(runs.len());
                for run in runs {
                    let defaults = run.session_defaults.as_ref().map(to_json).transpose()?;
                    if run.create_session {
                        sqlx::query(
                            "INSERT INTO sessions (id, created_at, updated_at, defaults) \
                             VALUES ($1, $2, $2, $3)",
                        )
                        .bind(run.session_id.0)
                        .bind(run.created_at)
                        .bind(defaults.as_deref().unwrap_or("{}"))
                        .execute(&mut *tx)
                        .await?;
                    } else {
                        // Locked until the commit (PostgreSQL): a concurrent delete cannot break
                        // the run's foreign key, which would fail the whole batch.
                        let found: Option<uuid::Uuid> = sqlx::query_scalar(&format!(
                            "SELECT id FROM sessions WHERE id = $1{}",
                            Self::ROW_LOCK
                        ))
                        .bind(run.session_id.0)
                        .fetch_optional(&mut *tx)
                        .await?;
                        if found.is_none() {
                            return Err($crate::store::StoreError::SessionNotFound(run.session_id));
                        }
                    }
                    let tools = run.tools.as_ref().map(to_json).transpose()?;
                    let row: Option<$crate::store::sql::RunRow> = sqlx::query_as(&format!(
                        "INSERT INTO runs (id, session_id, status, provider, model, tool_choice, \
                         metadata, iterations, input_tokens, output_tokens, total_tokens, tools, \
                         max_iterations, client_request_id, request_hash, created_at, updated_at, \
                         lease_owner, lease_expires_ms, agent, definition) \
                         VALUES ($1, $2, 'pending', $3, $4, $5, $6, 0, 0, 0, 0, $7, $8, $9, $10, \
                         $11, $11, $12, $13, $14, $15) \
                         ON CONFLICT DO NOTHING RETURNING {RUN_COLUMNS}"
                    ))
                    .bind(run.id.0)
                    .bind(run.session_id.0)
                    .bind($crate::store::sql::text(&run.provider))
                    .bind($crate::store::sql::text(&run.model))
                    .bind(to_json(&run.tool_choice)?)
                    .bind(to_json(&run.metadata)?)
                    .bind(tools)
                    .bind(i64::from(run.max_iterations))
                    .bind(run.client_request_id.as_deref().map($crate::store::sql::text))
                    .bind(run.request_hash.as_deref())
                    .bind(run.created_at)
                    .bind(run.lease.as_ref().map(|lease| lease.owner.as_str()))
                    .bind(run.lease.as_ref().map(|lease| lease.expires_ms))
                    .bind(run.agent.as_deref())
                    .bind(to_json(&run.definition)?)
                    .fetch_optional(&mut *tx)
                    .await?;
                    let Some(row) = row else {
                        if run.create_session {
                            sqlx::query("DELETE FROM sessions WHERE id = $1")
                                .bind(run.session_id.0)
                                .execute(&mut *tx)
                                .await?;
                        }
                        created.push(None);
                        continue;
                    };
                    if !run.create_session {
                        // A session remembers what its first run was defined with.
                        sqlx::query(
                            "UPDATE sessions SET updated_at = $2, defaults = CASE \
                             WHEN CAST($3 AS TEXT) IS NOT NULL AND NOT EXISTS (SELECT 1 FROM runs \
                             WHERE session_id = $1 AND id <> $4) THEN CAST($3 AS TEXT) \
                             ELSE defaults END WHERE id = $1",
                        )
                        .bind(run.session_id.0)
                        .bind(run.created_at)
                        .bind(defaults.as_deref())
                        .bind(run.id.0)
                        .execute(&mut *tx)
                        .await?;
                    }
                    let content = to_json(&[$crate::domain::ContentPart::Text {
                        text: run.input.clone(),
                    }])?;
                    sqlx::query(&format!(
                        "INSERT INTO messages ({MESSAGE_COLUMNS}) VALUES ($1, $2, $3, 'user', $4, \
                         '[]', NULL, NULL, $5, '[]', 'completed')"
                    ))
                    .bind(run.user_message_id.0)
                    .bind(run.session_id.0)
                    .bind(run.id.0)
                    .bind(content)
                    .bind(run.created_at)
                    .execute(&mut *tx)
                    .await?;
                    created.push(Some(row.try_into()?));
                }
                tx.commit().await?;
                Ok(created)
            }

            /// A run's new status and progress (`None`: unchanged); a status other than
            /// `requires_action` clears what the run waited for. A terminal run is left alone.
            async fn update_run_progress(
                connection: &mut <$db as sqlx::Database>::Connection,
                run_id: $crate::domain::RunId,
                status: Option<$crate::domain::RunStatus>,
                progress: Option<(u32, $crate::domain::TokenUsage)>,
            ) -> $crate::store::StoreResult<()> {
                use $crate::store::sql::to_i64;
                let (iterations, usage) = progress.unzip();
                sqlx::query(
                    "UPDATE runs SET status = COALESCE($2, status), \
                     required_action = CASE WHEN $2 IS NULL OR $2 = 'requires_action' \
                     THEN required_action ELSE NULL END, \
                     iterations = COALESCE($3, iterations), \
                     input_tokens = COALESCE($4, input_tokens), \
                     output_tokens = COALESCE($5, output_tokens), \
                     total_tokens = COALESCE($6, total_tokens), updated_at = $7, \
                     reasoning_tokens = COALESCE($8, reasoning_tokens), \
                     usage_estimated = COALESCE($9, usage_estimated) \
                     WHERE id = $1 AND status NOT IN ('completed', 'failed', 'cancelled')",
                )
                .bind(run_id.0)
                .bind(status.map(|s| s.as_str()))
                .bind(iterations.map(i64::from))
                .bind(usage.map(|u| to_i64(u.input_tokens)))
                .bind(usage.map(|u| to_i64(u.output_tokens)))
                .bind(usage.map(|u| to_i64(u.total_tokens)))
                .bind(chrono::Utc::now())
                .bind(usage.map(|u| to_i64(u.reasoning_tokens)))
                .bind(usage.map(|u| u.estimated))
                .execute(connection)
                .await?;
                Ok(())
            }

            /// The calibration of the session's last model call, if one reported its usage.
            async fn calibration(
                pool: &sqlx::Pool<$db>,
                session_id: $crate::domain::SessionId,
            ) -> $crate::store::StoreResult<Option<$crate::store::Calibration>> {
                let row: Option<$crate::store::sql::CalibrationRow> = sqlx::query_as(
                    "SELECT context_reported_tokens, context_counted_tokens FROM sessions \
                     WHERE id = $1",
                )
                .bind(session_id.0)
                .fetch_optional(pool)
                .await?;
                Ok(row.and_then(|row| row.calibration()))
            }

            /// Inserts one message on a connection or in a transaction.
            async fn insert_message(
                connection: &mut <$db as sqlx::Database>::Connection,
                message: &$crate::domain::Message,
            ) -> $crate::store::StoreResult<()> {
                use $crate::store::sql::{MESSAGE_COLUMNS, to_json};
                sqlx::query(&format!(
                    "INSERT INTO messages ({MESSAGE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"
                ))
                .bind(message.id.0)
                .bind(message.session_id.0)
                .bind(message.run_id.0)
                .bind(message.role.as_str())
                .bind(to_json(&message.content)?)
                .bind(to_json(&message.tool_calls)?)
                .bind(message.tool_call_id.as_deref().map($crate::store::sql::text))
                .bind(message.tool_name.as_deref().map($crate::store::sql::text))
                .bind(message.created_at)
                .bind(to_json(&message.reasoning)?)
                .bind(message.status.as_str())
                .execute(connection)
                .await?;
                Ok(())
            }

            /// Stores a compaction (its `through_seq` read from its last message) and closes
            /// the circuit breaker: a successful compaction ends a run of failures.
            async fn insert_compaction_row(
                connection: &mut <$db as sqlx::Database>::Connection,
                compaction: &$crate::domain::Compaction,
            ) -> $crate::store::StoreResult<()> {
                use $crate::store::sql::{COMPACTION_COLUMNS, text, to_i64};
                let usage = compaction.usage;
                let inserted = sqlx::query(&format!(
                    "INSERT INTO compactions ({COMPACTION_COLUMNS}, through_seq) \
                     SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, \
                     $16, $17, seq FROM messages WHERE id = $5"
                ))
                .bind(compaction.id.0)
                .bind(compaction.session_id.0)
                .bind(compaction.run_id.map(|id| id.0))
                .bind(compaction.trigger.as_str())
                .bind(compaction.through_message_id.0)
                .bind(i64::from(compaction.messages_summarised))
                .bind(to_i64(compaction.tokens_before))
                .bind(to_i64(compaction.tokens_after))
                .bind(text(&compaction.summary))
                .bind(text(&compaction.provider))
                .bind(text(&compaction.model))
                .bind(to_i64(usage.input_tokens))
                .bind(to_i64(usage.output_tokens))
                .bind(to_i64(usage.total_tokens))
                .bind(to_i64(usage.reasoning_tokens))
                .bind(usage.estimated)
                .bind(compaction.created_at)
                .execute(&mut *connection)
                .await?;
                if inserted.rows_affected() == 0 {
                    return Err($crate::store::StoreError::Corrupt(format!(
                        "compaction {}: its last message {} is not stored",
                        compaction.id, compaction.through_message_id
                    )));
                }
                sqlx::query(
                    "UPDATE compaction_breaker SET consecutive_failures = 0, is_open = FALSE, \
                     opened_at = NULL, last_error = NULL WHERE id = 1",
                )
                .execute(connection)
                .await?;
                Ok(())
            }

            /// Writes the run's snapshot at an iteration boundary (one row per run).
            async fn upsert_snapshot(
                connection: &mut <$db as sqlx::Database>::Connection,
                write: &$crate::store::EventWrite,
                snapshot: &$crate::store::SnapshotWrite,
            ) -> $crate::store::StoreResult<()> {
                use $crate::store::sql::{SNAPSHOT_COLUMNS, to_i64};
                let usage = snapshot.total_usage;
                sqlx::query(&format!(
                    "INSERT INTO snapshots ({SNAPSHOT_COLUMNS}) \
                     VALUES ($1, $2, 'calling_model', $3, $4, $5, $6, $7, $8, $9, $10, $11) \
                     ON CONFLICT (run_id) DO UPDATE SET status = excluded.status, \
                     iteration = excluded.iteration, input_tokens = excluded.input_tokens, \
                     output_tokens = excluded.output_tokens, total_tokens = excluded.total_tokens, \
                     reasoning_tokens = excluded.reasoning_tokens, \
                     usage_estimated = excluded.usage_estimated, tool_calls = excluded.tool_calls, \
                     last_sequence = excluded.last_sequence, created_at = excluded.created_at"
                ))
                .bind(write.run_id.0)
                .bind(snapshot.session_id.0)
                .bind(i64::from(snapshot.iteration))
                .bind(to_i64(usage.input_tokens))
                .bind(to_i64(usage.output_tokens))
                .bind(to_i64(usage.total_tokens))
                .bind(to_i64(usage.reasoning_tokens))
                .bind(usage.estimated)
                .bind(i64::from(snapshot.tool_calls))
                .bind(to_i64(write.event.sequence))
                .bind(chrono::Utc::now())
                .execute(connection)
                .await?;
                Ok(())
            }

            async fn explain_conflict(
                &self,
                run: &$crate::store::NewRun,
            ) -> Option<$crate::store::StoreError> {
                use $crate::store::sql::RUN_COLUMNS;
                if let Some(key) = &run.client_request_id {
                    let found: Option<$crate::store::sql::RunWithHash> = sqlx::query_as(&format!(
                        "SELECT {RUN_COLUMNS}, request_hash FROM runs WHERE client_request_id = $1"
                    ))
                    .bind(key)
                    .fetch_optional(&self.pool)
                    .await
                    .ok()?;
                    if let Some(found) = found {
                        let same_request = found.request_hash == run.request_hash;
                        let existing: $crate::domain::RunRecord = found.run.try_into().ok()?;
                        return Some($crate::store::StoreError::DuplicateRequest {
                            existing: Box::new(existing),
                            same_request,
                        });
                    }
                }
                let active: Option<uuid::Uuid> = sqlx::query_scalar(
                    "SELECT id FROM runs WHERE session_id = $1 \
                     AND status NOT IN ('completed', 'failed', 'cancelled') LIMIT 1",
                )
                .bind(run.session_id.0)
                .fetch_optional(&self.pool)
                .await
                .ok()?;
                active.map(|id| $crate::store::StoreError::SessionBusy {
                    session_id: run.session_id,
                    active_run: $crate::domain::RunId(id),
                })
            }
        }
    };
}

pub(super) use {impl_explain_conflict, impl_store};
