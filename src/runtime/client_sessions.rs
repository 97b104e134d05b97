//! Sessions that web clients name by ids they generate themselves (a `useChat` chat id, an
//! AG-UI `threadId`): found by the session's `external_id`, created on first use, and the run
//! of such a session that is in progress.

use chrono::Utc;

use super::{CreateRunError, Runtime};
use crate::domain::{
    ActionAnswer, MessageId, RunId, RunRecord, RunStatus, Session, SessionDefaults, SessionId,
};
use crate::events::{AgentEvent, EventPayload};
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

impl Runtime {
    /// The sequence of run `run_id`'s latest `tool_calls_required` event that waited for one of
    /// `call_ids` (provider call ids): the pause a client's answers were for, after which the
    /// run's continuation begins. `None` when no pause of the run waited for them.
    ///
    /// # Errors
    /// The store's.
    pub async fn pause_answered(
        &self,
        run_id: RunId,
        call_ids: &[&str],
    ) -> Result<Option<u64>, StoreError> {
        Ok(self
            .pauses(run_id, call_ids)
            .await?
            .last()
            .map(|(sequence, _)| *sequence))
    }

    /// The first of `given` (provider call ids of run `run_id` with a client's answers) whose
    /// call an earlier post answered with another answer of its kind (a client tool's output or
    /// error, an approval decision; a tool result shown on an approved call is not a decision),
    /// if any.
    ///
    /// # Errors
    /// The store's.
    pub async fn conflicting_answer(
        &self,
        run_id: RunId,
        given: &[(&str, &ActionAnswer)],
    ) -> Result<Option<String>, StoreError> {
        let ids: Vec<&str> = given.iter().map(|(id, _)| *id).collect();
        let mut recorded = Vec::new();
        for (_, message_id) in self.pauses(run_id, &ids).await? {
            recorded.extend(self.store.action_answers(run_id, message_id).await?);
        }
        let decision = |answer: &ActionAnswer| matches!(answer, ActionAnswer::Approval { .. });
        Ok(given.iter().find_map(|(call_id, answer)| {
            recorded
                .iter()
                .find(|(id, before)| id == call_id && decision(before) == decision(answer))
                .filter(|(_, before)| before != *answer)
                .map(|_| (*call_id).to_owned())
        }))
    }

    /// The sequence and assistant message of each `tool_calls_required` of run `run_id` that
    /// waited for one of `call_ids`, in the log's order.
    async fn pauses(
        &self,
        run_id: RunId,
        call_ids: &[&str],
    ) -> Result<Vec<(u64, MessageId)>, StoreError> {
        const PAGE: u32 = 1000;
        let mut after = 0;
        let mut found = Vec::new();
        loop {
            let page = self.store.read_events(run_id, after, PAGE).await?;
            let Some(last) = page.last() else {
                return Ok(found);
            };
            after = last.sequence;
            // Every event is read typed (the log is matched by variant, never by its tag).
            for logged in &page {
                let Ok(event) = serde_json::from_str::<AgentEvent>(&logged.data) else {
                    continue;
                };
                if let EventPayload::ToolCallsRequired(action) = event.payload
                    && action
                        .tool_calls
                        .iter()
                        .any(|call| call_ids.contains(&call.call_id.as_str()))
                {
                    found.push((logged.sequence, action.message_id));
                }
            }
        }
    }
}

/// Whether a run is in progress: not ended, and not paused for the client in
/// `requires_action` (a paused run continues on the client's next request).
#[must_use]
pub fn in_progress(run: &RunRecord) -> bool {
    !run.status.is_terminal() && run.status != RunStatus::RequiresAction
}
