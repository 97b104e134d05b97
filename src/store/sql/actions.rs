//! A paused run's required action: the client's answers, recorded while the run waits and
//! read once its wait is closed.

use super::{json, text, to_json};
use crate::domain::{ActionAnswer, MessageId, RequiredAction, RunId, RunStatus};
use crate::store::{
    ActionStore, PostgresStore, SqliteStore, StoreError, StoreResult, SubmitOutcome, unix_ms,
};

/// Parses stored answers `(call_id, answer JSON)`.
pub(super) fn answers(rows: Vec<(String, String)>) -> StoreResult<Vec<(String, ActionAnswer)>> {
    rows.into_iter()
        .map(|(call_id, answer)| Ok((call_id, json("answer", &answer)?)))
        .collect()
}

/// Parses a stored `required_action`.
pub(super) fn required_action(text: &str) -> StoreResult<RequiredAction> {
    json("required_action", text)
}

/// Implements [`ActionStore`] for a backend struct (see `sql/mod.rs`).
macro_rules! impl_action_store {
    ($store:ty, $db:ty) => {
        #[async_trait::async_trait]
        impl ActionStore for $store {
            async fn submit_answers(
                &self,
                run_id: RunId,
                message_id: MessageId,
                answers: &[(String, ActionAnswer)],
                now_ms: i64,
            ) -> StoreResult<SubmitOutcome> {
                let mut tx = self.begin_write().await?;
                // The run's row is locked until the commit: submissions and `close_action`
                // follow one another.
                let row: Option<(String, Option<String>, bool)> = sqlx::query_as(&format!(
                    "SELECT status, required_action, cancel_requested FROM runs WHERE id = $1{}",
                    Self::ROW_LOCK_UPDATE
                ))
                .bind(run_id.0)
                .fetch_optional(&mut *tx)
                .await?;
                let Some((status, action, cancel_requested)) = row else {
                    return Ok(SubmitOutcome::NotFound);
                };
                let status = RunStatus::parse(&status)
                    .ok_or_else(|| StoreError::Corrupt(format!("status: {status}")))?;
                // A cancel recorded before the answer wins: the run is ending, not waiting.
                let action = match action {
                    Some(text) if status == RunStatus::RequiresAction && !cancel_requested => {
                        required_action(&text)?
                    }
                    _ => return Ok(SubmitOutcome::NotWaiting(status)),
                };
                if action.message_id != message_id {
                    return Ok(SubmitOutcome::NotWaiting(status));
                }
                if unix_ms(action.expires_at) <= now_ms {
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
                    .bind(text(call_id))
                    .bind(to_json(answer)?)
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
                }
                tx.commit().await?;
                Ok(SubmitOutcome::Accepted)
            }

            async fn action_answers(
                &self,
                run_id: RunId,
                message_id: MessageId,
            ) -> StoreResult<Vec<(String, ActionAnswer)>> {
                let rows: Vec<(String, String)> = sqlx::query_as(
                    "SELECT call_id, answer FROM action_answers \
                     WHERE run_id = $1 AND message_id = $2",
                )
                .bind(run_id.0)
                .bind(message_id.0)
                .fetch_all(&self.pool)
                .await?;
                answers(rows)
            }

            async fn close_action(
                &self,
                run_id: RunId,
                message_id: MessageId,
            ) -> StoreResult<Vec<(String, ActionAnswer)>> {
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
                answers(rows)
            }
        }
    };
}

impl_action_store!(SqliteStore, sqlx::Sqlite);
impl_action_store!(PostgresStore, sqlx::Postgres);
