//! A run's trail: the one typed fold of its event log. Every event goes through
//! [`RunTrail::record`], the same way live (the run's emitter records each event once it is
//! durable) and at recovery (the stored log read once and folded), and an event that cannot
//! follow the ones before it is a [`TrailError`]. What a restart resumes, what a run's end
//! completes, finishes and keeps, and the trace a run continues in are read from the trail,
//! never from the log's JSON.
//!
//! The fold follows one iteration of the run loop: `model_started`, what the call streams
//! (`model_retrying` and a reactive `context_compacted` before any output; text, reasoning and
//! tool calls; `usage_recorded`, `cache_metrics`), `assistant_message_committed`, then the
//! turn's tool work (`doom_loop_detected`, `tool_calls_required`, `tool_approval_decided`,
//! executions, tool messages).
//! A compaction (`context_compaction_started`, then `context_compacted` when it succeeds) comes
//! where a compaction may: before a call, or after a call's rejection as too long; one cut off
//! by the run's end is closed by its summariser's estimated `usage_recorded`.
//! `run_resumed` may come anywhere before the end: it abandons a call cut off before its
//! commit. The terminal event comes once, last.

use chrono::{DateTime, Utc};

use crate::domain::{MessageId, PendingKind, RequiredAction, RunEnd, RunId};
use crate::events::{AgentEvent, EventPayload, ToolExecutionResult};
use crate::store::{Store, StoreError};

/// Why an event cannot follow the events of the run before it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrailError {
    /// Its sequence is not the next one.
    #[error("event {got} follows event {last}: sequences are contiguous from 1")]
    NotContiguous {
        /// The sequence of the event before.
        last: u64,
        /// The event's.
        got: u64,
    },
    /// It belongs to another run.
    #[error("event {sequence} belongs to run {got}, not {expected}")]
    OtherRun {
        /// The event's sequence.
        sequence: u64,
        /// The run of the events before.
        expected: RunId,
        /// The event's run.
        got: RunId,
    },
    /// It follows the run's terminal event (a second terminal event included).
    #[error("event {sequence} (`{event_type}`) follows the run's terminal event")]
    AfterEnd {
        /// The event's sequence.
        sequence: u64,
        /// Its type.
        event_type: &'static str,
    },
    /// It cannot come where it is.
    #[error("event {sequence} (`{event_type}`) {reason}")]
    Illegal {
        /// The event's sequence.
        sequence: u64,
        /// Its type.
        event_type: &'static str,
        /// Why not.
        reason: String,
    },
    /// The stored event is not one this version reads.
    #[error("event {sequence} cannot be read: {reason}")]
    Unreadable {
        /// The event's sequence.
        sequence: u64,
        /// What is wrong with it.
        reason: String,
    },
}

/// Where the run's last model call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallPhase {
    /// Streaming (`model_started` logged, usage not yet).
    Streaming,
    /// Its stream ended (`usage_recorded`), its turn is not committed.
    Streamed,
    /// Its assistant message is committed; the turn's tool work follows.
    Committed,
    /// Cut off before its commit and abandoned by a resumed run (`run_resumed`): made again.
    Abandoned,
}

/// A tool call a model call streamed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamedCall {
    /// The call id.
    pub id: String,
    /// The tool's name.
    pub tool_name: String,
    /// The argument text streamed so far (`tool_call_delta`s).
    pub arguments: String,
    /// `tool_call_completed` was logged.
    pub completed: bool,
}

/// What the log says of one call's execution in the turn.
#[derive(Debug, Clone, PartialEq)]
pub struct Execution {
    /// The call id.
    pub call_id: String,
    /// The tool's name.
    pub tool_name: String,
    /// The sequence and time of its `tool_execution_started`, when one was logged (an answer
    /// from the client has none).
    pub started: Option<(u64, DateTime<Utc>)>,
    /// Its result (`tool_execution_finished`), once logged.
    pub result: Option<ToolExecutionResult>,
}

impl Execution {
    /// Started and not finished.
    #[must_use]
    pub fn is_open(&self) -> bool {
        self.started.is_some() && self.result.is_none()
    }
}

/// The tool work after a model call's commit.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Turn {
    /// The committed assistant message.
    pub message_id: Option<MessageId>,
    /// Executions started or finished, in the order of their first event.
    pub executions: Vec<Execution>,
    /// Tool messages committed (each answers one of the turn's calls).
    pub tool_messages: Vec<MessageId>,
    /// The doom loop logged for the turn.
    pub doom_loop: Option<String>,
    /// The calls the turn paused for (`tool_calls_required`).
    pub required_action: Option<RequiredAction>,
    /// The approval decisions logged (`tool_approval_decided`): `(call id, approved)`, in
    /// order.
    pub decisions: Vec<(String, bool)>,
    /// Its answer did not match the run's `output_schema` (`output_rejected`): a corrective
    /// user message follows it and the model is called again.
    pub output_rejected: bool,
}

/// The run's last model call and what followed it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelCall {
    /// The sequence of its `model_started`.
    pub sequence: u64,
    /// Its iteration, from 1.
    pub iteration: u32,
    /// The id its assistant message is stored with (`model_started.message_id`; `None` in
    /// logs of older versions).
    pub message_id: Option<MessageId>,
    /// Where it is.
    pub phase: CallPhase,
    /// The answer text streamed (`text_delta`s).
    pub text: String,
    /// The reasoning text streamed (`reasoning_delta`s): counted when a cut-off call's usage
    /// is estimated.
    pub reasoning: String,
    /// Text, reasoning or a tool call was streamed (a retry or a reactive compaction may only
    /// come before).
    pub output: bool,
    /// A `model_retrying` was logged.
    pub retried: bool,
    /// The tool calls it streamed, in order.
    pub tool_calls: Vec<StreamedCall>,
    /// After its commit: the turn's tool work.
    pub turn: Turn,
}

impl ModelCall {
    /// The tool calls started and not completed.
    pub fn open_calls(&self) -> impl Iterator<Item = &StreamedCall> {
        self.tool_calls.iter().filter(|call| !call.completed)
    }

    fn has_completed(&self, call_id: &str) -> bool {
        self.tool_calls
            .iter()
            .any(|call| call.completed && call.id == call_id)
    }

    fn completed_count(&self) -> usize {
        self.tool_calls.iter().filter(|call| call.completed).count()
    }
}

/// The fold of a run's events (see the module's documentation).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunTrail {
    run_id: Option<RunId>,
    last_sequence: u64,
    /// The first event's trace id and span id.
    trace: Option<(String, String)>,
    started: bool,
    call: Option<ModelCall>,
    /// The iteration the last `run_resumed` announced, until the next `model_started`.
    next_iteration: Option<u32>,
    /// The sequence of a `context_compaction_started` whose outcome is not logged yet.
    compaction: Option<u64>,
    resumed: u32,
    /// `output_rejected` events so far (corrective turns used).
    output_rejections: u32,
    end: Option<RunEnd>,
    broken: Option<TrailError>,
}

impl RunTrail {
    /// The trail of a run with an empty log.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads the run's log once (in pages of 1000 events) and folds it. Events that cannot
    /// follow the ones before them are kept out of the fold; the first such error is
    /// [`RunTrail::broken`].
    ///
    /// # Errors
    /// The store's.
    pub async fn load(store: &dyn Store, run_id: RunId) -> Result<Self, StoreError> {
        let mut trail = Self::new();
        crate::store::read_log(store, run_id, |sequence, event| {
            let recorded = match event {
                Ok(event) => trail.record(&event),
                Err(error) => trail.unreadable(sequence, error.to_string()),
            };
            if let Err(error) = recorded {
                tracing::debug!(%run_id, %error, "an event of the run's log does not fold");
            }
            Ok(())
        })
        .await?;
        Ok(trail)
    }

    /// Folds the next event of the run. An event that cannot follow the ones before it changes
    /// nothing but the trail's last sequence, and is remembered as [`RunTrail::broken`] when it
    /// is the first such one.
    ///
    /// # Errors
    /// [`TrailError`] saying why the event cannot come here.
    pub fn record(&mut self, event: &AgentEvent) -> Result<(), TrailError> {
        let result = self.apply(event);
        self.last_sequence = self.last_sequence.max(event.sequence);
        if let Err(error) = &result {
            self.broken.get_or_insert_with(|| error.clone());
        }
        result
    }

    fn unreadable(&mut self, sequence: u64, reason: String) -> Result<(), TrailError> {
        let error = TrailError::Unreadable { sequence, reason };
        self.last_sequence = self.last_sequence.max(sequence);
        self.broken.get_or_insert_with(|| error.clone());
        Err(error)
    }

    /// The sequence of the run's last event (0 for an empty log).
    #[must_use]
    pub fn last_sequence(&self) -> u64 {
        self.last_sequence
    }

    /// The trace id and span id of the run's first event: the trace a resumed run continues in,
    /// and the span of the process that started it.
    #[must_use]
    pub fn trace(&self) -> Option<(&str, &str)> {
        self.trace
            .as_ref()
            .map(|(trace, span)| (trace.as_str(), span.as_str()))
    }

    /// The run's last model call, with what followed it.
    #[must_use]
    pub fn last_call(&self) -> Option<&ModelCall> {
        self.call.as_ref()
    }

    /// The iteration of the last model call (0 before the first): the `iterations` of a run
    /// that completes now.
    #[must_use]
    pub fn iterations(&self) -> u32 {
        self.call.as_ref().map_or(0, |call| call.iteration)
    }

    /// The model call cut off before its commit, not abandoned: the one a run that ends now
    /// ended in, or the one a resumed run abandons.
    #[must_use]
    pub fn cut_off_call(&self) -> Option<&ModelCall> {
        self.call
            .as_ref()
            .filter(|call| matches!(call.phase, CallPhase::Streaming | CallPhase::Streamed))
    }

    /// The tool calls the last model call started and did not complete.
    pub fn open_calls(&self) -> impl Iterator<Item = &StreamedCall> {
        self.cut_off_call()
            .into_iter()
            .flat_map(ModelCall::open_calls)
    }

    /// The text of the call a run that ends now ended in ([`RunTrail::cut_off_call`]).
    #[must_use]
    pub fn cut_off_text(&self) -> Option<&str> {
        self.cut_off_call().map(|call| call.text.as_str())
    }

    /// The turn after the last model call's commit.
    #[must_use]
    pub fn turn(&self) -> Option<&Turn> {
        self.call
            .as_ref()
            .filter(|call| call.phase == CallPhase::Committed)
            .map(|call| &call.turn)
    }

    /// Whether `call_id` is a call of the committed turn whose result is not logged yet (no
    /// `tool_execution_finished`): its execution never started (it waits for the client, or
    /// was never reached) or is open.
    #[must_use]
    pub fn awaits_result(&self, call_id: &str) -> bool {
        self.call
            .as_ref()
            .filter(|call| call.phase == CallPhase::Committed)
            .is_some_and(|call| {
                call.has_completed(call_id)
                    && !call
                        .turn
                        .executions
                        .iter()
                        .any(|execution| execution.call_id == call_id && execution.result.is_some())
            })
    }

    /// The executions started and not finished.
    pub fn open_executions(&self) -> impl Iterator<Item = &Execution> {
        self.turn()
            .into_iter()
            .flat_map(|turn| turn.executions.iter().filter(|e| e.is_open()))
    }

    /// The sequence of the `context_compaction_started` whose summariser call has no outcome in
    /// the log yet (no `context_compacted`, `compaction_circuit_opened`, `model_started`,
    /// `usage_recorded` or `run_resumed` after it): the compaction a run that ends now was
    /// cut off in.
    #[must_use]
    pub fn open_compaction(&self) -> Option<u64> {
        self.compaction
    }

    /// How many times the run was resumed (`run_resumed`).
    #[must_use]
    pub fn resumed(&self) -> u32 {
        self.resumed
    }

    /// Corrective turns logged so far (`output_rejected` events).
    #[must_use]
    pub fn output_rejections(&self) -> u32 {
        self.output_rejections
    }

    /// How the run ended, once its terminal event is logged.
    #[must_use]
    pub fn end(&self) -> Option<&RunEnd> {
        self.end.as_ref()
    }

    /// The first event that did not fold, if any: the log is not one behest writes.
    #[must_use]
    pub fn broken(&self) -> Option<&TrailError> {
        self.broken.as_ref()
    }

    fn apply(&mut self, event: &AgentEvent) -> Result<(), TrailError> {
        let sequence = event.sequence;
        if sequence != self.last_sequence + 1 {
            return Err(TrailError::NotContiguous {
                last: self.last_sequence,
                got: sequence,
            });
        }
        if let Some(expected) = self.run_id
            && expected != event.run_id
        {
            return Err(TrailError::OtherRun {
                sequence,
                expected,
                got: event.run_id,
            });
        }
        if self.run_id.is_none() {
            self.run_id = Some(event.run_id);
            self.trace = Some((event.trace_id.clone(), event.span_id.clone()));
        }
        let event_type = event.payload.event_type();
        if self.end.is_some() {
            return Err(TrailError::AfterEnd {
                sequence,
                event_type,
            });
        }
        self.next(sequence, &event.timestamp, &event.payload)
            .map_err(|reason| TrailError::Illegal {
                sequence,
                event_type,
                reason,
            })
    }

    /// The transition of one event: checks it can come now, then applies it; `Err` says why
    /// not (and nothing was applied).
    #[expect(
        clippy::too_many_lines,
        reason = "one arm per event type, read as a table"
    )]
    fn next(
        &mut self,
        sequence: u64,
        timestamp: &DateTime<Utc>,
        payload: &EventPayload,
    ) -> Result<(), String> {
        match payload {
            EventPayload::RunStarted(_) => {
                if sequence != 1 {
                    return Err("comes after other events; it is a run's first".to_owned());
                }
                self.started = true;
            }
            EventPayload::ContextBuilt(_) => {
                if !self.started || self.call.is_some() {
                    return Err("comes only after run_started, before the first model call".into());
                }
            }
            EventPayload::ModelStarted(started) => {
                let expected = match &self.call {
                    None => self.next_iteration.unwrap_or(1),
                    Some(call) => match call.phase {
                        CallPhase::Committed => call.iteration.saturating_add(1),
                        CallPhase::Abandoned => call.iteration,
                        CallPhase::Streaming | CallPhase::Streamed => {
                            return Err(format!(
                                "comes while model call {} is not committed",
                                call.sequence
                            ));
                        }
                    },
                };
                if let Some(execution) = self.open_executions().next() {
                    return Err(format!(
                        "comes while the execution of call `{}` is open",
                        execution.call_id
                    ));
                }
                if let Some(announced) = self.next_iteration
                    && announced != expected
                {
                    return Err(format!(
                        "comes after run_resumed announced iteration {announced}, not {expected}"
                    ));
                }
                if started.iteration != expected {
                    return Err(format!(
                        "has iteration {}, not {expected}",
                        started.iteration
                    ));
                }
                self.next_iteration = None;
                self.compaction = None;
                self.call = Some(ModelCall {
                    sequence,
                    iteration: started.iteration,
                    message_id: started.message_id,
                    phase: CallPhase::Streaming,
                    text: String::new(),
                    reasoning: String::new(),
                    output: false,
                    retried: false,
                    tool_calls: Vec::new(),
                    turn: Turn::default(),
                });
            }
            EventPayload::TextDelta(delta) => {
                let call = self.streaming()?;
                call.text.push_str(&delta.delta);
                call.output = true;
            }
            EventPayload::ReasoningDelta(delta) => {
                let call = self.streaming()?;
                call.reasoning.push_str(&delta.delta);
                call.output = true;
            }
            EventPayload::ToolCallStarted(started) => {
                let call = self.streaming()?;
                if call.open_calls().any(|open| open.id == started.call_id) {
                    return Err(format!("starts call `{}` again", started.call_id));
                }
                call.tool_calls.push(StreamedCall {
                    id: started.call_id.clone(),
                    tool_name: started.tool_name.clone(),
                    arguments: String::new(),
                    completed: false,
                });
                call.output = true;
            }
            EventPayload::ToolCallDelta(delta) => {
                let call = self.streaming()?;
                let open = call
                    .tool_calls
                    .iter_mut()
                    .rev()
                    .find(|open| !open.completed && open.id == delta.call_id)
                    .ok_or_else(|| {
                        format!("continues call `{}`, which is not open", delta.call_id)
                    })?;
                open.arguments.push_str(&delta.delta);
            }
            EventPayload::ToolCallCompleted(completed) => {
                let call = self.streaming()?;
                let open = call
                    .tool_calls
                    .iter_mut()
                    .find(|open| !open.completed && open.id == completed.call.id)
                    .ok_or_else(|| {
                        format!(
                            "completes call `{}`, which was not started",
                            completed.call.id
                        )
                    })?;
                open.completed = true;
            }
            EventPayload::ModelRetrying(_) => {
                let call = self.streaming()?;
                if call.output {
                    return Err("follows output of the call (a retry comes before any)".into());
                }
                call.retried = true;
            }
            EventPayload::ContextCompacted(_)
            | EventPayload::CompactionCircuitOpened(_)
            | EventPayload::ContextCompactionStarted(_) => {
                let allowed = match &self.call {
                    None => true,
                    Some(call) => match call.phase {
                        CallPhase::Committed | CallPhase::Abandoned => true,
                        // Reactive: the call was rejected as too long before any output.
                        CallPhase::Streaming => call.retried && !call.output,
                        CallPhase::Streamed => false,
                    },
                };
                if !allowed {
                    return Err(
                        "comes inside a model call other than after its rejection (model_retrying)"
                            .into(),
                    );
                }
                self.compaction = match payload {
                    EventPayload::ContextCompactionStarted(_) => Some(sequence),
                    _ => None,
                };
            }
            // The estimated usage of a summariser call cut off by the run's end closes the
            // compaction; any other is a model call's.
            EventPayload::UsageRecorded(_) if self.compaction.is_some() => self.compaction = None,
            EventPayload::UsageRecorded(_) => self.streaming()?.phase = CallPhase::Streamed,
            EventPayload::CacheMetrics(_) => {
                if self.call.as_ref().map(|call| call.phase) != Some(CallPhase::Streamed) {
                    return Err("comes other than after a call's usage_recorded".into());
                }
            }
            EventPayload::AssistantMessageCommitted(committed) => {
                let call = self
                    .cut_off_call_mut()
                    .ok_or("comes without a model call to commit")?;
                if let Some(open) = call.open_calls().next() {
                    return Err(format!("comes while call `{}` is not completed", open.id));
                }
                if let Some(announced) = call.message_id
                    && announced != committed.message_id
                {
                    return Err(format!(
                        "commits message {}, not {announced}, the one its model_started announced",
                        committed.message_id
                    ));
                }
                call.phase = CallPhase::Committed;
                call.turn.message_id = Some(committed.message_id);
            }
            EventPayload::ToolCallsRequired(action) => {
                let call = self.committed()?;
                if call.turn.message_id != Some(action.message_id) {
                    return Err(format!(
                        "names message {}, not the turn's",
                        action.message_id
                    ));
                }
                if let Some(pending) = action
                    .tool_calls
                    .iter()
                    .find(|pending| !call.has_completed(&pending.call_id))
                {
                    return Err(format!("names call `{}`, not the turn's", pending.call_id));
                }
                call.turn.required_action = Some(action.clone());
            }
            EventPayload::ToolApprovalDecided(decided) => {
                let call = self.committed()?;
                let waits = call.turn.required_action.as_ref().is_some_and(|action| {
                    action.tool_calls.iter().any(|pending| {
                        pending.call_id == decided.call_id && pending.kind == PendingKind::Approval
                    })
                });
                if !waits {
                    return Err(format!(
                        "decides call `{}`, which the turn does not wait an approval for",
                        decided.call_id
                    ));
                }
                if call
                    .turn
                    .decisions
                    .iter()
                    .any(|(id, _)| *id == decided.call_id)
                {
                    return Err(format!("decides call `{}` a second time", decided.call_id));
                }
                if call
                    .turn
                    .executions
                    .iter()
                    .any(|execution| execution.call_id == decided.call_id)
                {
                    return Err(format!(
                        "decides call `{}` after its execution or result",
                        decided.call_id
                    ));
                }
                call.turn
                    .decisions
                    .push((decided.call_id.clone(), decided.approved));
            }
            EventPayload::OutputRejected(rejected) => {
                let call = self
                    .call
                    .as_mut()
                    .filter(|call| matches!(call.phase, CallPhase::Committed | CallPhase::Streamed))
                    .ok_or("comes without a model call that ended")?;
                if !call.tool_calls.is_empty() || call.turn.output_rejected {
                    return Err("comes other than once after an answer without tool calls".into());
                }
                if rejected.attempt != self.output_rejections + 1 {
                    return Err(format!(
                        "says attempt {} after {} rejections",
                        rejected.attempt, self.output_rejections
                    ));
                }
                // An empty answer was not committed; the corrective turn closes the call too.
                call.phase = CallPhase::Committed;
                call.turn.output_rejected = true;
                self.output_rejections += 1;
            }
            EventPayload::DoomLoopDetected(detected) => {
                let call = self.committed()?;
                let turn = &call.turn;
                if !turn.executions.is_empty()
                    || !turn.tool_messages.is_empty()
                    || turn.doom_loop.is_some()
                {
                    return Err("comes after the turn's tool work began".into());
                }
                call.turn.doom_loop = Some(detected.description.clone());
            }
            EventPayload::ToolExecutionStarted(started) => {
                let call = self.committed()?;
                if !call.has_completed(&started.call_id) {
                    return Err(format!(
                        "executes call `{}`, not the turn's",
                        started.call_id
                    ));
                }
                if call.turn.doom_loop.is_some() {
                    return Err("comes after the turn's doom loop".into());
                }
                if call
                    .turn
                    .executions
                    .iter()
                    .any(|execution| execution.call_id == started.call_id)
                {
                    return Err(format!("executes call `{}` a second time", started.call_id));
                }
                call.turn.executions.push(Execution {
                    call_id: started.call_id.clone(),
                    tool_name: started.tool_name.clone(),
                    started: Some((sequence, *timestamp)),
                    result: None,
                });
            }
            EventPayload::ToolExecutionFinished(finished) => {
                // Without a start when the result came from the client (or a check of its
                // call), or when a resumed run finishes an execution cut off by a crash.
                let call = self.committed()?;
                if !call.has_completed(&finished.call_id) {
                    return Err(format!(
                        "finishes call `{}`, not the turn's",
                        finished.call_id
                    ));
                }
                match call
                    .turn
                    .executions
                    .iter_mut()
                    .find(|execution| execution.call_id == finished.call_id)
                {
                    Some(execution) if execution.result.is_some() => {
                        return Err(format!(
                            "finishes call `{}` a second time",
                            finished.call_id
                        ));
                    }
                    Some(execution) => execution.result = Some(finished.result.clone()),
                    None => call.turn.executions.push(Execution {
                        call_id: finished.call_id.clone(),
                        tool_name: finished.tool_name.clone(),
                        started: None,
                        result: Some(finished.result.clone()),
                    }),
                }
            }
            EventPayload::ToolProgress(progress) => {
                if !self
                    .open_executions()
                    .any(|execution| execution.call_id == progress.call_id)
                {
                    return Err(format!(
                        "reports progress of call `{}`, whose execution is not open",
                        progress.call_id
                    ));
                }
            }
            EventPayload::ToolMessageCommitted(committed) => {
                let call = self.committed()?;
                if call.turn.tool_messages.len() >= call.completed_count() {
                    return Err("answers more calls than the turn made".into());
                }
                call.turn.tool_messages.push(committed.message_id);
            }
            EventPayload::RunResumed(resumed) => {
                let abandoned = self.cut_off_call().map(|call| call.sequence).or_else(|| {
                    self.call
                        .as_ref()
                        .filter(|call| call.phase == CallPhase::Abandoned)
                        .map(|call| call.sequence)
                });
                if resumed.abandoned_after != abandoned {
                    return Err(format!(
                        "says abandoned_after {:?}; the call cut off is {abandoned:?}",
                        resumed.abandoned_after
                    ));
                }
                if let Some(open) = self.open_calls().next() {
                    return Err(format!(
                        "comes while call `{}` is not completed (a resumed run completes it first)",
                        open.id
                    ));
                }
                let iteration_ok = match &self.call {
                    None => resumed.iteration >= 1,
                    Some(call) if call.phase == CallPhase::Committed => {
                        resumed.iteration == call.iteration
                            || resumed.iteration == call.iteration.saturating_add(1)
                    }
                    Some(call) => resumed.iteration == call.iteration,
                };
                if !iteration_ok {
                    return Err(format!(
                        "announces iteration {} after model call {}",
                        resumed.iteration,
                        self.iterations()
                    ));
                }
                if let Some(call) = self.cut_off_call_mut() {
                    call.phase = CallPhase::Abandoned;
                }
                self.next_iteration = Some(resumed.iteration);
                self.compaction = None;
                self.resumed += 1;
            }
            EventPayload::RunCompleted(completed) => {
                let call = self
                    .call
                    .as_ref()
                    .filter(|call| matches!(call.phase, CallPhase::Committed | CallPhase::Streamed))
                    .ok_or("comes without a model call that ended")?;
                if completed.iterations != call.iteration {
                    return Err(format!(
                        "says {} iterations after model call {}",
                        completed.iterations, call.iteration
                    ));
                }
                if !call.tool_calls.is_empty() {
                    return Err("follows a turn with tool calls".into());
                }
                self.end = payload.run_end();
            }
            EventPayload::RunFailed(_) | EventPayload::RunCancelled(_) => {
                if let Some(open) = self.open_calls().next() {
                    return Err(format!("comes while call `{}` is not completed", open.id));
                }
                if let Some(open) = self.open_executions().next() {
                    return Err(format!(
                        "comes while the execution of call `{}` is open",
                        open.call_id
                    ));
                }
                self.end = payload.run_end();
            }
        }
        Ok(())
    }

    fn cut_off_call_mut(&mut self) -> Option<&mut ModelCall> {
        self.call
            .as_mut()
            .filter(|call| matches!(call.phase, CallPhase::Streaming | CallPhase::Streamed))
    }

    /// The last model call while it streams.
    fn streaming(&mut self) -> Result<&mut ModelCall, String> {
        self.call
            .as_mut()
            .filter(|call| call.phase == CallPhase::Streaming)
            .ok_or_else(|| "comes outside a model call's stream".to_owned())
    }

    /// The last model call once its turn is committed.
    fn committed(&mut self) -> Result<&mut ModelCall, String> {
        self.call
            .as_mut()
            .filter(|call| call.phase == CallPhase::Committed)
            .ok_or_else(|| "comes outside a committed turn".to_owned())
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod property;
