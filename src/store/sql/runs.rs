//! Runs: admission (a run, its user message and its new session in one transaction), reads,
//! the runs left active, and the status and progress an event writes.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::sessions::MESSAGE_COLUMNS;
use super::{corrupt, count, error_class, json, text, to_i64, to_json};
use crate::domain::{
    FinishReason, RunDefinition, RunId, RunRecord, RunStatus, SessionId, TokenUsage,
};
use crate::store::{
    NewRun, PostgresStore, RunFilter, RunStore, SqliteStore, StoreError, StoreResult,
};

pub(super) const RUN_COLUMNS: &str = "id, session_id, status, provider, model, tool_choice, \
     metadata, iterations, finish_reason, input_tokens, output_tokens, total_tokens, error, \
     tools, max_iterations, client_request_id, created_at, updated_at, reasoning_tokens, \
     usage_estimated, events_removed_at, agent, definition, required_action, error_class";

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
    error_class: Option<String>,
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
            output_schema: definition.output_schema,
            webhook: definition.webhook,
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
            error_class: row.error_class.map(|c| error_class(&c)).transpose()?,
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
pub(super) struct RunWithHash {
    #[sqlx(flatten)]
    pub(super) run: RunRow,
    pub(super) request_hash: Option<String>,
}

pub(super) fn runs<R: TryInto<RunRecord, Error = StoreError>>(
    rows: Vec<R>,
) -> StoreResult<Vec<RunRecord>> {
    rows.into_iter().map(TryInto::try_into).collect()
}

/// Implements [`RunStore`] for a backend struct (see `sql/mod.rs`).
macro_rules! impl_run_store {
    ($store:ty, $db:ty) => {
        #[async_trait::async_trait]
        impl RunStore for $store {
            #[tracing::instrument(skip_all, fields(run_id = %run.id))]
            async fn create_run(&self, run: &NewRun) -> StoreResult<RunRecord> {
                self.create_runs(std::slice::from_ref(run))
                    .await
                    .pop()
                    .unwrap_or_else(|| Err(StoreError::Corrupt("no run created".to_owned())))
            }

            async fn create_runs(&self, runs: &[NewRun]) -> Vec<StoreResult<RunRecord>> {
                match self.create_runs_once(runs).await {
                    Ok(created) => {
                        let mut results = Vec::with_capacity(runs.len());
                        for (run, created) in runs.iter().zip(created) {
                            results.push(match created {
                                Some(created) => Ok(created),
                                None => {
                                    Err(self.explain_conflict(run).await.unwrap_or_else(|| {
                                        StoreError::Corrupt(format!(
                                            "run {} conflicted with a row that is gone",
                                            run.id
                                        ))
                                    }))
                                }
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

            async fn get_run(&self, id: RunId) -> StoreResult<Option<RunRecord>> {
                let row: Option<RunRow> =
                    sqlx::query_as(&format!("SELECT {RUN_COLUMNS} FROM runs WHERE id = $1"))
                        .bind(id.0)
                        .fetch_optional(&self.pool)
                        .await?;
                row.map(TryInto::try_into).transpose()
            }

            async fn list_runs(&self, filter: &RunFilter) -> StoreResult<Vec<RunRecord>> {
                let mut query = sqlx::QueryBuilder::<$db>::new(format!(
                    "SELECT {RUN_COLUMNS} FROM runs WHERE 1 = 1"
                ));
                if let Some(session_id) = filter.session_id {
                    query.push(" AND session_id = ").push_bind(session_id.0);
                }
                if let Some(status) = filter.status {
                    query.push(" AND status = ").push_bind(status.as_str());
                }
                if let Some(before) = filter.before {
                    query.push(" AND id < ").push_bind(before.0);
                }
                query
                    .push(" ORDER BY id DESC LIMIT ")
                    .push_bind(i64::from(filter.limit));
                let rows: Vec<RunRow> = query.build_query_as().fetch_all(&self.pool).await?;
                runs(rows)
            }

            async fn active_runs(&self) -> StoreResult<Vec<RunRecord>> {
                let rows: Vec<RunRow> = sqlx::query_as(&format!(
                    "SELECT {RUN_COLUMNS} FROM runs \
                     WHERE status NOT IN ('completed', 'failed', 'cancelled') ORDER BY id"
                ))
                .fetch_all(&self.pool)
                .await?;
                runs(rows)
            }
        }

        impl $store {
            /// Creates the runs in one transaction: each run, its user message and its new
            /// session (or the existing session's `updated_at` and first defaults). A run whose
            /// session is missing is `Err` for the whole batch; a run that conflicts with a
            /// unique index (its `client_request_id` is taken, its session has an active run) is
            /// `None` and writes nothing, the others are written.
            async fn create_runs_once(
                &self,
                runs: &[NewRun],
            ) -> StoreResult<Vec<Option<RunRecord>>> {
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
                        // Locked until the commit (PostgreSQL), for the update below: a
                        // concurrent delete cannot break the run's foreign key, which would fail
                        // the whole batch, and concurrent inputs to the session queue here and
                        // meet the active run's index entry (`SessionBusy`) instead of
                        // deadlocking on the update.
                        let found: Option<uuid::Uuid> = sqlx::query_scalar(&format!(
                            "SELECT id FROM sessions WHERE id = $1{}",
                            Self::ROW_LOCK_NO_KEY_UPDATE
                        ))
                        .bind(run.session_id.0)
                        .fetch_optional(&mut *tx)
                        .await?;
                        if found.is_none() {
                            return Err(StoreError::SessionNotFound(run.session_id));
                        }
                    }
                    let tools = run.tools.as_ref().map(to_json).transpose()?;
                    let row: Option<RunRow> = sqlx::query_as(&format!(
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
                    .bind(text(&run.provider))
                    .bind(text(&run.model))
                    .bind(to_json(&run.tool_choice)?)
                    .bind(to_json(&run.metadata)?)
                    .bind(tools)
                    .bind(i64::from(run.max_iterations))
                    .bind(run.client_request_id.as_deref().map(text))
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
                    let content = to_json(&run.input)?;
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
            pub(super) async fn update_run_progress(
                connection: &mut <$db as sqlx::Database>::Connection,
                run_id: RunId,
                status: Option<RunStatus>,
                progress: Option<(u32, TokenUsage)>,
            ) -> StoreResult<()> {
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

            /// Explains a unique violation on insert: a reused client request id first (a retry
            /// of the same request is not "busy"), then an active run in the session.
            async fn explain_conflict(&self, run: &NewRun) -> Option<StoreError> {
                if let Some(key) = &run.client_request_id {
                    let found: Option<RunWithHash> = sqlx::query_as(&format!(
                        "SELECT {RUN_COLUMNS}, request_hash FROM runs WHERE client_request_id = $1"
                    ))
                    .bind(key)
                    .fetch_optional(&self.pool)
                    .await
                    .ok()?;
                    if let Some(found) = found {
                        let same_request = found.request_hash == run.request_hash;
                        let existing: RunRecord = found.run.try_into().ok()?;
                        return Some(StoreError::DuplicateRequest {
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
                active.map(|id| StoreError::SessionBusy {
                    session_id: run.session_id,
                    active_run: RunId(id),
                })
            }
        }
    };
}

impl_run_store!(SqliteStore, sqlx::Sqlite);
impl_run_store!(PostgresStore, sqlx::Postgres);
