//! Compaction: a session's compactions, the settings stored through `/compaction`, and the
//! circuit breaker counted across processes.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{corrupt, count, text, to_i64};
use crate::domain::{
    CircuitBreaker, Compaction, CompactionConfig, CompactionId, CompactionTrigger, MessageId,
    RunId, SessionId, TokenUsage,
};
use crate::store::{
    BreakerFailure, CompactionStore, PostgresStore, SqliteStore, StoreError, StoreResult,
};

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
pub(super) struct CompactionWithSeq {
    #[sqlx(flatten)]
    pub(super) compaction: CompactionRow,
    pub(super) through_seq: i64,
}

#[derive(sqlx::FromRow)]
pub(super) struct SettingsRow {
    auto: bool,
    prune: bool,
    buffer_tokens: Option<i64>,
    keep_tokens: Option<i64>,
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
            buffer_tokens: row.buffer_tokens.map(count),
            keep_tokens: row.keep_tokens.map(count),
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

/// Implements [`CompactionStore`] for a backend struct (see `sql/mod.rs`).
macro_rules! impl_compaction_store {
    ($store:ty, $db:ty) => {
        #[async_trait::async_trait]
        impl CompactionStore for $store {
            async fn session_compactions(
                &self,
                session_id: SessionId,
            ) -> StoreResult<Vec<Compaction>> {
                let rows: Vec<CompactionRow> = sqlx::query_as(&format!(
                    "SELECT {COMPACTION_COLUMNS} FROM compactions WHERE session_id = $1 \
                     ORDER BY through_seq, id"
                ))
                .bind(session_id.0)
                .fetch_all(&self.pool)
                .await?;
                compactions(rows)
            }

            async fn insert_compaction(&self, compaction: &Compaction) -> StoreResult<()> {
                let mut tx = self.begin_write().await?;
                let active: Option<uuid::Uuid> = sqlx::query_scalar(
                    "SELECT id FROM runs WHERE session_id = $1 \
                     AND status NOT IN ('completed', 'failed', 'cancelled') LIMIT 1",
                )
                .bind(compaction.session_id.0)
                .fetch_optional(&mut *tx)
                .await?;
                if let Some(run) = active {
                    return Err(StoreError::SessionBusy {
                        session_id: compaction.session_id,
                        active_run: RunId(run),
                    });
                }
                Self::insert_compaction_row(&mut tx, compaction).await?;
                tx.commit().await?;
                Ok(())
            }

            async fn compaction_config(&self) -> StoreResult<Option<CompactionConfig>> {
                let row: Option<SettingsRow> = sqlx::query_as(&format!(
                    "SELECT {SETTINGS_COLUMNS} FROM compaction_settings WHERE id = 1"
                ))
                .fetch_optional(&self.pool)
                .await?;
                Ok(row.map(Into::into))
            }

            async fn put_compaction_config(&self, config: &CompactionConfig) -> StoreResult<()> {
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
                .bind(config.buffer_tokens.map(to_i64))
                .bind(config.keep_tokens.map(to_i64))
                .bind(i64::from(config.tail_turns))
                .bind(text(&config.model))
                .bind(text(&config.provider))
                .bind(i64::from(config.circuit_breaker_threshold))
                .bind(chrono::Utc::now())
                .execute(&self.pool)
                .await?;
                Ok(())
            }

            async fn circuit_breaker(&self, threshold: u32) -> StoreResult<CircuitBreaker> {
                let row: BreakerRow = sqlx::query_as(
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
            ) -> StoreResult<BreakerFailure> {
                let mut tx = self.begin_write().await?;
                // Read under a lock that holds until the commit, so concurrent failures (other
                // runs, other replicas) are counted one after the other.
                let before: BreakerRow = sqlx::query_as(&format!(
                    "SELECT consecutive_failures, is_open, opened_at, last_error \
                     FROM compaction_breaker WHERE id = 1{}",
                    Self::ROW_LOCK_UPDATE
                ))
                .fetch_one(&mut *tx)
                .await?;
                let failures = before.consecutive_failures.saturating_add(1);
                let open = before.is_open || failures >= i64::from(threshold);
                let opened = open && !before.is_open;
                let row: BreakerRow = sqlx::query_as(
                    "UPDATE compaction_breaker SET consecutive_failures = $1, is_open = $2, \
                     opened_at = CASE WHEN $3 THEN $4 ELSE opened_at END, last_error = $5 \
                     WHERE id = 1 RETURNING consecutive_failures, is_open, opened_at, last_error",
                )
                .bind(failures)
                .bind(open)
                .bind(opened)
                .bind(chrono::Utc::now())
                .bind(text(error))
                .fetch_one(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok(BreakerFailure {
                    breaker: row.with_threshold(threshold),
                    opened,
                })
            }

            async fn reset_circuit_breaker(&self, threshold: u32) -> StoreResult<CircuitBreaker> {
                let row: BreakerRow = sqlx::query_as(
                    "UPDATE compaction_breaker SET consecutive_failures = 0, is_open = FALSE, \
                     opened_at = NULL, last_error = NULL WHERE id = 1 \
                     RETURNING consecutive_failures, is_open, opened_at, last_error",
                )
                .fetch_one(&self.pool)
                .await?;
                Ok(row.with_threshold(threshold))
            }
        }

        impl $store {
            /// Stores a compaction (its `through_seq` read from its last message) and closes
            /// the circuit breaker: a successful compaction ends a run of failures.
            pub(super) async fn insert_compaction_row(
                connection: &mut <$db as sqlx::Database>::Connection,
                compaction: &Compaction,
            ) -> StoreResult<()> {
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
                    return Err(StoreError::Corrupt(format!(
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
        }
    };
}

impl_compaction_store!(SqliteStore, sqlx::Sqlite);
impl_compaction_store!(PostgresStore, sqlx::Postgres);
