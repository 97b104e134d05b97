//! Sessions that web clients name by ids they generate themselves (a `useChat` chat id, an
//! AG-UI `threadId`): found by the session's `external_id`, created on first use, the run
//! of such a session that is in progress, and the pauses of a run its answers are matched to.

use chrono::Utc;

use super::{CreateRunError, Runtime};
use crate::domain::{MessageId, RunId, RunRecord, RunStatus, Session, SessionDefaults, SessionId};
use crate::events::{CallNames, EventPayload};
use crate::store::{RunFilter, StoreError};

impl Runtime {
    /// The session a client names `id`: the session with that id when `id` is one of behest's
    /// session ids (a client may create a session first and pass its id), else the session
    /// whose `external_id` is `id`, else a new session with `external_id = id` (two requests
    /// racing to create it get the same one). The flag is true when this call created it.
    ///
    /// # Errors
    /// [`CreateRunError::InvalidField`] (`field`) when `id` is not a valid external id (see
    /// [`crate::domain::is_external_id`]); the store's.
    pub async fn client_session(
        &self,
        field: &'static str,
        id: &str,
    ) -> Result<(Session, bool), CreateRunError> {
        if let Ok(own) = id.parse::<SessionId>()
            && let Some(session) = self
                .store
                .get_session(own)
                .await
                .map_err(CreateRunError::Store)?
        {
            return Ok((session, false));
        }
        if !crate::domain::is_external_id(id) {
            return Err(CreateRunError::InvalidField {
                field,
                reason: crate::domain::EXTERNAL_ID_RULE.to_owned(),
            });
        }
        if let Some(session) = self
            .store
            .session_by_external_id(id)
            .await
            .map_err(CreateRunError::Store)?
        {
            return Ok((session, false));
        }
        let now = Utc::now();
        let session = Session {
            id: SessionId::new(),
            created_at: now,
            updated_at: now,
            title: None,
            metadata: serde_json::json!({}),
            defaults: SessionDefaults::default(),
            external_id: Some(id.to_owned()),
        };
        match self.store.create_session(&session).await {
            Ok(created) => Ok((created, true)),
            Err(StoreError::ExternalIdTaken(_)) => self
                .store
                .session_by_external_id(id)
                .await
                .map_err(CreateRunError::Store)?
                .map(|session| (session, false))
                .ok_or_else(|| {
                    CreateRunError::Store(StoreError::Corrupt(format!(
                        "session with external_id `{id}` vanished while it was created"
                    )))
                }),
            Err(other) => Err(CreateRunError::Store(other)),
        }
    }

    /// The session's latest run (a session runs one at a time, so the only one that can be
    /// active), if any.
    ///
    /// # Errors
    /// The store's.
    pub async fn latest_run(&self, session: SessionId) -> Result<Option<RunRecord>, StoreError> {
        let filter = RunFilter {
            session_id: Some(session),
            status: None,
            before: None,
            limit: 1,
        };
        Ok(self.store.list_runs(&filter).await?.into_iter().next())
    }
}

/// One pause of a run: a `tool_calls_required` of its log, with the calls it waited for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pause {
    /// The sequence of the `tool_calls_required`: the run's continuation begins after it.
    pub sequence: u64,
    /// The assistant message whose calls it waited for (the answers are recorded by it).
    pub message_id: MessageId,
    /// The calls it waited for, in its order.
    pub calls: Vec<PausedCall>,
}

/// A call a pause waited for, by both its names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PausedCall {
    /// The provider's call id (what `POST /runs/{id}/tool_outputs` and `/approvals` take).
    pub call_id: String,
    /// Its namespaced id ([`crate::events::tool_call_id`]): the id web frontends received it
    /// by, unique in the session where the provider's may repeat.
    pub name: String,
}

impl Runtime {
    /// Every pause of run `run_id`, in the log's order, its calls named by the fold the
    /// frontend renderings name them by ([`CallNames`]): a client's answers under those names
    /// find the one pause they answer, even when a provider said `call_1` in two of them.
    ///
    /// # Errors
    /// The store's.
    pub async fn pauses(&self, run_id: RunId) -> Result<Vec<Pause>, StoreError> {
        let mut names = CallNames::new(run_id);
        let mut found = Vec::new();
        // Every event is read typed (the log is matched by variant, never by its tag).
        crate::store::read_log(self.store.as_ref(), run_id, |sequence, event| {
            let event = event.map_err(|error| {
                StoreError::Corrupt(format!(
                    "event {sequence} of run {run_id} does not read: {error}"
                ))
            })?;
            names.record(&event);
            if let EventPayload::ToolCallsRequired(action) = event.payload {
                found.push(Pause {
                    sequence,
                    message_id: action.message_id,
                    calls: action
                        .tool_calls
                        .iter()
                        .map(|call| PausedCall {
                            name: names.name(&call.call_id),
                            call_id: call.call_id.clone(),
                        })
                        .collect(),
                });
            }
            Ok(())
        })
        .await?;
        Ok(found)
    }
}

/// Whether a run is in progress: not ended, and not paused for the client in
/// `requires_action` (a paused run continues on the client's next request).
#[must_use]
pub fn in_progress(run: &RunRecord) -> bool {
    !run.status.is_terminal() && run.status != RunStatus::RequiresAction
}
