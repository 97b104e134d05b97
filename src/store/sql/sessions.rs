//! Sessions and messages: their rows, pages, the context a run starts from, and the
//! session's token calibration.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::compaction::{COMPACTION_COLUMNS, CompactionRow, CompactionWithSeq};
use super::{corrupt, count, json, text, to_json};
use crate::domain::{Message, MessageId, MessageStatus, Role, RunId, Session, SessionId};
use crate::store::{
    Calibration, ContextUpdate, PostgresStore, SessionContext, SessionPatch, SessionStore,
    SqliteStore, StoreError, StoreResult,
};

pub(super) const SESSION_COLUMNS: &str =
    "id, created_at, updated_at, title, metadata, defaults, external_id";

pub(super) const MESSAGE_COLUMNS: &str = "id, session_id, run_id, role, content, tool_calls, tool_call_id, tool_name, created_at, \
     reasoning, status";

#[derive(sqlx::FromRow)]
pub(super) struct SessionRow {
    id: Uuid,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    title: Option<String>,
    metadata: String,
    defaults: String,
    external_id: Option<String>,
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
            external_id: row.external_id,
        })
    }
}

pub(super) fn sessions(rows: Vec<SessionRow>) -> StoreResult<Vec<Session>> {
    rows.into_iter().map(TryInto::try_into).collect()
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

pub(super) fn messages(rows: Vec<MessageRow>) -> StoreResult<Vec<Message>> {
    rows.into_iter().map(TryInto::try_into).collect()
}

/// The calibration columns of a session row.
#[derive(sqlx::FromRow)]
pub(super) struct CalibrationRow {
    context_reported_tokens: Option<i64>,
    context_counted_tokens: Option<i64>,
}

impl CalibrationRow {
    pub(super) fn calibration(&self) -> Option<Calibration> {
        match (self.context_reported_tokens, self.context_counted_tokens) {
            (Some(reported), Some(counted)) if reported > 0 && counted > 0 => Some(Calibration {
                reported_tokens: count(reported),
                counted_tokens: count(counted),
            }),
            _ => None,
        }
    }
}

/// Implements [`SessionStore`] for a backend struct (see `sql/mod.rs`).
macro_rules! impl_session_store {
    ($store:ty, $db:ty) => {
        #[async_trait::async_trait]
        impl SessionStore for $store {
            async fn get_session(&self, id: SessionId) -> StoreResult<Option<Session>> {
                let row: Option<SessionRow> = sqlx::query_as(&format!(
                    "SELECT {SESSION_COLUMNS} FROM sessions WHERE id = $1"
                ))
                .bind(id.0)
                .fetch_optional(&self.pool)
                .await?;
                row.map(TryInto::try_into).transpose()
            }

            async fn list_sessions(
                &self,
                before: Option<SessionId>,
                limit: u32,
            ) -> StoreResult<Vec<Session>> {
                let mut query = sqlx::QueryBuilder::<$db>::new(format!(
                    "SELECT {SESSION_COLUMNS} FROM sessions WHERE 1 = 1"
                ));
                if let Some(before) = before {
                    query.push(" AND id < ").push_bind(before.0);
                }
                query
                    .push(" ORDER BY id DESC LIMIT ")
                    .push_bind(i64::from(limit));
                let rows: Vec<SessionRow> = query.build_query_as().fetch_all(&self.pool).await?;
                sessions(rows)
            }

            async fn create_session(&self, session: &Session) -> StoreResult<Session> {
                let inserted = sqlx::query_as::<_, SessionRow>(&format!(
                    "INSERT INTO sessions ({SESSION_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7) \
                     RETURNING {SESSION_COLUMNS}"
                ))
                .bind(session.id.0)
                .bind(session.created_at)
                .bind(session.updated_at)
                .bind(session.title.as_deref())
                .bind(to_json(&session.metadata)?)
                .bind(to_json(&session.defaults)?)
                .bind(session.external_id.as_deref())
                .fetch_one(&self.pool)
                .await;
                match inserted {
                    Ok(row) => row.try_into(),
                    Err(sqlx::Error::Database(error))
                        if error.is_unique_violation() && session.external_id.is_some() =>
                    {
                        Err(StoreError::ExternalIdTaken(
                            session.external_id.clone().unwrap_or_default(),
                        ))
                    }
                    Err(error) => Err(error.into()),
                }
            }

            async fn session_by_external_id(
                &self,
                external_id: &str,
            ) -> StoreResult<Option<Session>> {
                let row: Option<SessionRow> = sqlx::query_as(&format!(
                    "SELECT {SESSION_COLUMNS} FROM sessions WHERE external_id = $1"
                ))
                .bind(external_id)
                .fetch_optional(&self.pool)
                .await?;
                row.map(TryInto::try_into).transpose()
            }

            async fn update_session(
                &self,
                id: SessionId,
                patch: &SessionPatch,
                now: chrono::DateTime<chrono::Utc>,
            ) -> StoreResult<Option<Session>> {
                let metadata = patch.metadata.as_ref().map(to_json).transpose()?;
                let row: Option<SessionRow> = sqlx::query_as(&format!(
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

            async fn delete_session(&self, id: SessionId) -> StoreResult<bool> {
                let mut tx = self.begin_write().await?;
                let active: Option<uuid::Uuid> = sqlx::query_scalar(
                    "SELECT id FROM runs WHERE session_id = $1 \
                     AND status NOT IN ('completed', 'failed', 'cancelled') LIMIT 1",
                )
                .bind(id.0)
                .fetch_optional(&mut *tx)
                .await?;
                if let Some(run) = active {
                    return Err(StoreError::SessionBusy {
                        session_id: id,
                        active_run: RunId(run),
                    });
                }
                let deleted = sqlx::query("DELETE FROM sessions WHERE id = $1")
                    .bind(id.0)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(deleted.rows_affected() > 0)
            }

            async fn session_messages(&self, session_id: SessionId) -> StoreResult<Vec<Message>> {
                let rows: Vec<MessageRow> = sqlx::query_as(&format!(
                    "SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 ORDER BY seq"
                ))
                .bind(session_id.0)
                .fetch_all(&self.pool)
                .await?;
                messages(rows)
            }

            async fn session_messages_page(
                &self,
                session_id: SessionId,
                after: Option<MessageId>,
                limit: u32,
            ) -> StoreResult<Option<Vec<Message>>> {
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
                let rows: Vec<MessageRow> = sqlx::query_as(&format!(
                    "SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 AND seq > $2 \
                     ORDER BY seq LIMIT $3"
                ))
                .bind(session_id.0)
                .bind(from)
                .bind(i64::from(limit))
                .fetch_all(&self.pool)
                .await?;
                messages(rows).map(Some)
            }

            async fn run_messages(&self, run_id: RunId, role: Role) -> StoreResult<Vec<Message>> {
                let rows: Vec<MessageRow> = sqlx::query_as(&format!(
                    "SELECT {MESSAGE_COLUMNS} FROM messages WHERE run_id = $1 AND role = $2 ORDER BY seq"
                ))
                .bind(run_id.0)
                .bind(role.as_str())
                .fetch_all(&self.pool)
                .await?;
                messages(rows)
            }

            async fn session_context(&self, session_id: SessionId) -> StoreResult<SessionContext> {
                let calibration = Self::calibration(&self.pool, session_id).await?;
                let latest: Option<(CompactionRow, i64)> = {
                    let row: Option<CompactionWithSeq> = sqlx::query_as(&format!(
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
                    return Ok(SessionContext {
                        compaction: None,
                        messages,
                        calibration,
                    });
                };
                let mut rows: Vec<MessageRow> = sqlx::query_as(&format!(
                    "SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 \
                     AND role = 'system' AND seq <= $2 ORDER BY seq"
                ))
                .bind(session_id.0)
                .bind(through_seq)
                .fetch_all(&self.pool)
                .await?;
                // The user input of the turn the compaction ends in is kept verbatim, though
                // the compaction covers it: the latest input, and an older one whose turn goes
                // on after the compaction (its assistant message and tool results follow), so
                // the messages never start with an assistant's (which Anthropic refuses).
                let pinned: Option<MessageRow> = sqlx::query_as(&format!(
                    "SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 \
                     AND role = 'user' AND seq <= $2 AND (NOT EXISTS (SELECT 1 FROM messages \
                     WHERE session_id = $1 AND role = 'user' AND seq > $2) \
                     OR (SELECT role FROM messages WHERE session_id = $1 AND seq > $2 \
                     AND role <> 'system' ORDER BY seq LIMIT 1) <> 'user') \
                     ORDER BY seq DESC LIMIT 1"
                ))
                .bind(session_id.0)
                .bind(through_seq)
                .fetch_optional(&self.pool)
                .await?;
                rows.extend(pinned);
                let after: Vec<MessageRow> = sqlx::query_as(&format!(
                    "SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 AND seq > $2 \
                     ORDER BY seq"
                ))
                .bind(session_id.0)
                .bind(through_seq)
                .fetch_all(&self.pool)
                .await?;
                rows.extend(after);
                Ok(SessionContext {
                    compaction: Some(compaction.try_into()?),
                    messages: messages(rows)?,
                    calibration,
                })
            }

            async fn session_context_after(
                &self,
                session_id: SessionId,
                after: Option<MessageId>,
            ) -> StoreResult<ContextUpdate> {
                let compacted: Option<uuid::Uuid> =
                    sqlx::query_scalar("SELECT id FROM compactions WHERE session_id = $1 LIMIT 1")
                        .bind(session_id.0)
                        .fetch_optional(&self.pool)
                        .await?;
                if compacted.is_some() {
                    return Ok(ContextUpdate::Compacted(Box::new(
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
                let rows: Vec<MessageRow> = sqlx::query_as(&format!(
                    "SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = $1 \
                     AND {after_clause} ORDER BY seq"
                ))
                .bind(session_id.0)
                .bind(after.map(|id| id.0))
                .fetch_all(&self.pool)
                .await?;
                Ok(ContextUpdate::Appended {
                    messages: messages(rows)?,
                    calibration,
                })
            }
        }

        impl $store {
            /// The calibration of the session's last model call, if one reported its usage.
            async fn calibration(
                pool: &sqlx::Pool<$db>,
                session_id: SessionId,
            ) -> StoreResult<Option<Calibration>> {
                let row: Option<CalibrationRow> = sqlx::query_as(
                    "SELECT context_reported_tokens, context_counted_tokens FROM sessions \
                     WHERE id = $1",
                )
                .bind(session_id.0)
                .fetch_optional(pool)
                .await?;
                Ok(row.and_then(|row| row.calibration()))
            }

            /// Inserts one message on a connection or in a transaction.
            pub(super) async fn insert_message(
                connection: &mut <$db as sqlx::Database>::Connection,
                message: &Message,
            ) -> StoreResult<()> {
                sqlx::query(&format!(
                    "INSERT INTO messages ({MESSAGE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"
                ))
                .bind(message.id.0)
                .bind(message.session_id.0)
                .bind(message.run_id.0)
                .bind(message.role.as_str())
                .bind(to_json(&message.content)?)
                .bind(to_json(&message.tool_calls)?)
                .bind(message.tool_call_id.as_deref().map(text))
                .bind(message.tool_name.as_deref().map(text))
                .bind(message.created_at)
                .bind(to_json(&message.reasoning)?)
                .bind(message.status.as_str())
                .execute(connection)
                .await?;
                Ok(())
            }
        }
    };
}

impl_session_store!(SqliteStore, sqlx::Sqlite);
impl_session_store!(PostgresStore, sqlx::Postgres);
