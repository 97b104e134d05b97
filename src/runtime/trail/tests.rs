//! Golden logs of the restart cases, folded and planned (in the manner of steno's saga log
//! recovery tests), and impossible sequences rejected.

use chrono::Utc;
use serde_json::json;

use super::*;
use crate::domain::{
    ContentPart, ErrorClass, FinishReason, Message, PendingKind, PendingToolCall, Role, RunRecord,
    SessionId, TokenUsage, ToolCall,
};
use crate::events::{
    ContextBuilt, DoomLoopDetected, MessageCommitted, ModelRetrying, ModelStarted, OutputRejected,
    RunCompleted, RunResumed, RunStarted, TextDelta, ToolCallCompleted, ToolCallDelta,
    ToolCallStarted, ToolExecutionFinished, ToolExecutionStarted, ToolFailure,
    ToolMessageCommitted, ToolSuccess, UsageRecorded,
};
use crate::runtime::resume::{self, Next};
use crate::runtime::tool_exec::new_message;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const SPAN: &str = "00f067aa0ba902b7";

/// A run's log being written by hand.
struct Log {
    record: RunRecord,
    events: Vec<AgentEvent>,
}

impl Log {
    fn new() -> Self {
        let now = Utc::now();
        let record: RunRecord = serde_json::from_value(json!({
            "id": RunId::new(), "session_id": SessionId::new(), "status": "calling_model",
            "provider": "p", "model": "m", "tool_choice": "auto", "metadata": {},
            "iterations": 1, "total_usage": TokenUsage::default(), "max_iterations": 10,
            "created_at": now, "updated_at": now,
        }))
        .unwrap();
        Self {
            record,
            events: Vec::new(),
        }
    }

    /// A run that began: `run_started`, `context_built`.
    fn opened() -> Self {
        let mut log = Self::new();
        log.push(EventPayload::RunStarted(RunStarted {
            session_id: log.record.session_id,
            provider: "p".to_owned(),
            model: "m".to_owned(),
        }));
        log.push(EventPayload::ContextBuilt(ContextBuilt {
            message_count: 1,
        }));
        log
    }

    fn event(&self, payload: EventPayload) -> AgentEvent {
        AgentEvent {
            sequence: self.events.len() as u64 + 1,
            run_id: self.record.id,
            timestamp: Utc::now(),
            trace_id: TRACE.to_owned(),
            span_id: SPAN.to_owned(),
            payload,
        }
    }

    fn push(&mut self, payload: EventPayload) -> u64 {
        let event = self.event(payload);
        self.events.push(event);
        self.events.len() as u64
    }

    fn push_all(&mut self, payloads: impl IntoIterator<Item = EventPayload>) {
        for payload in payloads {
            self.push(payload);
        }
    }

    /// The fold of the whole log, which must be legal.
    fn fold(&self) -> RunTrail {
        let mut trail = RunTrail::new();
        for event in &self.events {
            if let Err(error) = trail.record(event) {
                panic!("{error}\n{:#?}", self.events);
            }
        }
        trail
    }

    /// What folding `payload` after the log says; the trail is unchanged by a rejection.
    fn then(&self, payload: EventPayload) -> Result<RunTrail, TrailError> {
        let mut trail = self.fold();
        let before = trail.clone();
        match trail.record(&self.event(payload)) {
            Ok(()) => Ok(trail),
            Err(error) => {
                assert_eq!(trail.broken(), Some(&error));
                assert_eq!(trail.last_call(), before.last_call());
                assert_eq!(trail.end(), before.end());
                Err(error)
            }
        }
    }

    fn rejects(&self, payload: EventPayload) -> TrailError {
        self.then(payload).expect_err("the event is rejected")
    }

    /// One model call streaming text and complete calls `ids`, committed; its message.
    fn turn(&mut self, iteration: u32, text: &str, ids: &[&str]) -> Message {
        self.push(model(iteration));
        if !text.is_empty() {
            self.push(text_delta(text));
        }
        for id in ids {
            self.push_all([started(id), delta(id, "{}"), completed(id)]);
        }
        self.push(usage());
        let calls = ids.iter().map(|id| call(id)).collect();
        let content = if text.is_empty() {
            Vec::new()
        } else {
            vec![ContentPart::Text {
                text: text.to_owned(),
            }]
        };
        let message = new_message(&self.record, Role::Assistant, content, calls);
        self.push(commit(message.id));
        message
    }

    fn tool_message(&mut self, id: &str) -> Message {
        let mut message = new_message(&self.record, Role::Tool, Vec::new(), Vec::new());
        message.tool_call_id = Some(id.to_owned());
        self.push(EventPayload::ToolMessageCommitted(ToolMessageCommitted {
            message_id: message.id,
            call_id: Some(id.to_owned()),
        }));
        message
    }
}

fn model(iteration: u32) -> EventPayload {
    EventPayload::ModelStarted(ModelStarted {
        provider: "p".to_owned(),
        model: "m".to_owned(),
        iteration,
        message_id: None,
    })
}

fn text_delta(text: &str) -> EventPayload {
    EventPayload::TextDelta(TextDelta {
        delta: text.to_owned(),
    })
}

fn started(id: &str) -> EventPayload {
    EventPayload::ToolCallStarted(ToolCallStarted {
        call_id: id.to_owned(),
        tool_name: "add".to_owned(),
    })
}

fn delta(id: &str, text: &str) -> EventPayload {
    EventPayload::ToolCallDelta(ToolCallDelta {
        call_id: id.to_owned(),
        delta: text.to_owned(),
    })
}

fn call(id: &str) -> ToolCall {
    ToolCall {
        id: id.to_owned(),
        name: "add".to_owned(),
        arguments: json!({}),
        invalid_arguments: None,
    }
}

fn completed(id: &str) -> EventPayload {
    EventPayload::ToolCallCompleted(ToolCallCompleted { call: call(id) })
}

fn usage() -> EventPayload {
    EventPayload::UsageRecorded(UsageRecorded {
        usage: TokenUsage::default(),
    })
}

fn commit(message_id: MessageId) -> EventPayload {
    EventPayload::AssistantMessageCommitted(MessageCommitted { message_id })
}

fn execution(id: &str) -> EventPayload {
    EventPayload::ToolExecutionStarted(ToolExecutionStarted {
        call_id: id.to_owned(),
        tool_name: "add".to_owned(),
    })
}

fn success(id: &str) -> EventPayload {
    EventPayload::ToolExecutionFinished(ToolExecutionFinished {
        call_id: id.to_owned(),
        tool_name: "add".to_owned(),
        result: ToolExecutionResult::Success(ToolSuccess { output: json!(8) }),
        duration_ms: 3,
    })
}

fn failure(id: &str) -> EventPayload {
    EventPayload::ToolExecutionFinished(ToolExecutionFinished {
        call_id: id.to_owned(),
        tool_name: "add".to_owned(),
        result: ToolExecutionResult::Failure(ToolFailure {
            error: "no".to_owned(),
        }),
        duration_ms: 0,
    })
}

fn resumed(iteration: u32, abandoned_after: Option<u64>) -> EventPayload {
    EventPayload::RunResumed(RunResumed {
        iteration,
        abandoned_after,
    })
}

fn run_completed(iterations: u32) -> EventPayload {
    EventPayload::RunCompleted(RunCompleted {
        finish_reason: FinishReason::Stop,
        iterations,
        parsed: None,
    })
}

fn run_failed() -> EventPayload {
    EventPayload::terminal(&RunEnd::failed(ErrorClass::Internal, "boom"), 0)
}

fn illegal(error: &TrailError) -> &str {
    match error {
        TrailError::Illegal { reason, .. } => reason,
        other => panic!("not an illegal placement: {other}"),
    }
}

// ---------------------------------------------------------------------------------------------
// The restart cases

#[test]
fn a_run_that_never_logged_resumes_at_its_first_call() {
    let log = Log::new();
    let trail = log.fold();
    assert_eq!((trail.last_sequence(), trail.trace()), (0, None));
    let plan = resume::plan(&trail, &log.record, Vec::new(), &[]);
    assert!(matches!(plan.next, Next::ModelCall(1)), "{plan:?}");
    assert_eq!(plan.abandoned_after, None);
    let mut log = log;
    log.push(resumed(1, None));
    log.push(model(1));
    assert_eq!(log.fold().resumed(), 1);
}

#[test]
fn cut_mid_text() {
    let mut log = Log::opened();
    let started_at = log.push(model(1));
    log.push_all([text_delta("Hel"), text_delta("lo")]);
    let trail = log.fold();
    assert_eq!(trail.trace(), Some((TRACE, SPAN)));
    assert_eq!(trail.cut_off_text(), Some("Hello"));
    assert_eq!(trail.cut_off_call().unwrap().sequence, started_at);
    assert_eq!(trail.iterations(), 1);
    assert_eq!(trail.open_calls().count(), 0);
    let plan = resume::plan(&trail, &log.record, Vec::new(), &[]);
    assert_eq!(plan.abandoned_after, Some(started_at));
    assert!(matches!(plan.next, Next::ModelCall(1)), "{plan:?}");

    // Resumed: the call is abandoned (its text is not the run's), and made again.
    log.push(resumed(1, Some(started_at)));
    let trail = log.fold();
    assert_eq!(trail.last_call().unwrap().phase, CallPhase::Abandoned);
    assert_eq!(trail.cut_off_text(), None);
    assert!(illegal(&log.rejects(model(2))).contains("iteration 2, not 1"));
    log.turn(1, "Hello again", &[]);
    log.push(run_completed(1));
    assert_eq!(
        log.fold().end(),
        Some(&RunEnd::Completed {
            finish_reason: FinishReason::Stop,
            parsed: None,
        })
    );
}

#[test]
fn cut_mid_tool_call_arguments() {
    let mut log = Log::opened();
    let started_at = log.push(model(1));
    log.push_all([text_delta("Adding"), started("c1"), delta("c1", "{\"a\":")]);
    let trail = log.fold();
    let open: Vec<(&str, &str)> = trail
        .open_calls()
        .map(|c| (c.id.as_str(), c.arguments.as_str()))
        .collect();
    assert_eq!(open, vec![("c1", "{\"a\":")]);
    // A resumed run completes the call (as invalid) before it says `run_resumed`.
    assert!(illegal(&log.rejects(resumed(1, Some(started_at)))).contains("`c1`"));
    log.push(EventPayload::ToolCallCompleted(ToolCallCompleted {
        call: ToolCall {
            invalid_arguments: Some("{\"a\":".to_owned()),
            ..call("c1")
        },
    }));
    assert_eq!(log.fold().open_calls().count(), 0);
    log.push(resumed(1, Some(started_at)));
    // Ended instead: the close-out completes the call, keeps the text, then ends.
    let mut ended = Log::opened();
    ended.push(model(1));
    ended.push_all([text_delta("Adding"), started("c1"), delta("c1", "{")]);
    assert!(illegal(&ended.rejects(EventPayload::RunCancelled(Default::default()))).contains("c1"));
    assert!(illegal(&ended.rejects(commit(MessageId::new()))).contains("c1"));
    ended.push(completed("c1"));
    ended.push(commit(MessageId::new()));
    ended.push(EventPayload::RunCancelled(Default::default()));
    assert_eq!(ended.fold().end(), Some(&RunEnd::Cancelled));
}

#[test]
fn after_the_commit_with_executions_open() {
    let mut log = Log::opened();
    let message = log.turn(1, "", &["c1", "c2"]);
    log.push_all([execution("c1"), execution("c2"), success("c2")]);
    let trail = log.fold();
    let open: Vec<&str> = trail
        .open_executions()
        .map(|e| e.call_id.as_str())
        .collect();
    assert_eq!(open, vec!["c1"]);
    assert_eq!(trail.cut_off_text(), None);
    let history = vec![message.clone()];
    let plan = resume::plan(&trail, &log.record, vec![message], &history);
    let Next::Tools(pending) = plan.next else {
        panic!("{plan:?}")
    };
    let calls: Vec<&str> = pending.calls.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(calls, vec!["c1", "c2"]);
    assert_eq!(pending.started, vec!["c1", "c2"]);
    assert_eq!(pending.finished.keys().collect::<Vec<_>>(), vec!["c2"]);
    // No model call while an execution is open; a resumed run finishes it (without a start).
    assert!(illegal(&log.rejects(model(2))).contains("`c1`"));
    assert!(illegal(&log.rejects(run_failed())).contains("`c1`"));
    log.push(resumed(2, None));
    log.push(failure("c1"));
    assert!(illegal(&log.rejects(failure("c1"))).contains("second time"));
    assert_eq!(log.fold().open_executions().count(), 0);
}

#[test]
fn results_logged_without_their_tool_message() {
    let mut log = Log::opened();
    let message = log.turn(1, "", &["c1", "c2"]);
    log.push_all([
        execution("c1"),
        execution("c2"),
        success("c1"),
        success("c2"),
    ]);
    let answer = log.tool_message("c1");
    let trail = log.fold();
    assert_eq!(trail.turn().unwrap().tool_messages, vec![answer.id]);
    let history = vec![message.clone(), answer];
    let plan = resume::plan(&trail, &log.record, vec![message], &history);
    let Next::Tools(pending) = plan.next else {
        panic!("{plan:?}")
    };
    let calls: Vec<&str> = pending.calls.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(calls, vec!["c2"], "c1 has its tool message");
    assert!(matches!(
        pending.finished.get("c2"),
        Some(ToolExecutionResult::Success(_))
    ));
    log.push(resumed(2, None));
    log.tool_message("c2");
    assert!(
        illegal(
            &log.rejects(EventPayload::ToolMessageCommitted(ToolMessageCommitted {
                message_id: MessageId::new(),
                call_id: None,
            }))
        )
        .contains("more calls")
    );
    log.push(model(2));
}

#[test]
fn a_doom_loop_logged() {
    let mut log = Log::opened();
    let message = log.turn(1, "", &["c1"]);
    log.push(EventPayload::DoomLoopDetected(DoomLoopDetected {
        description: "add ×3".to_owned(),
    }));
    let trail = log.fold();
    assert_eq!(trail.turn().unwrap().doom_loop.as_deref(), Some("add ×3"));
    let history = vec![message.clone()];
    let plan = resume::plan(&trail, &log.record, vec![message], &history);
    let Next::Tools(pending) = plan.next else {
        panic!("{plan:?}")
    };
    assert_eq!(pending.doom_loop.as_deref(), Some("add ×3"));
    assert!(illegal(&log.rejects(execution("c1"))).contains("doom loop"));
    log.tool_message("c1");
    log.push(EventPayload::terminal(
        &RunEnd::failed(ErrorClass::DoomLoop, "doom loop detected: add ×3"),
        1,
    ));
    assert_eq!(
        log.fold().end().and_then(RunEnd::error_class),
        Some(ErrorClass::DoomLoop)
    );
}

#[test]
fn waiting_in_requires_action() {
    let mut log = Log::opened();
    let message = log.turn(1, "", &["c1", "c2"]);
    let action = RequiredAction {
        message_id: message.id,
        tool_calls: vec![PendingToolCall {
            call_id: "c1".to_owned(),
            tool_name: "add".to_owned(),
            arguments: json!({}),
            kind: PendingKind::ClientTool,
        }],
        expires_at: Utc::now(),
    };
    let other_turn = RequiredAction {
        message_id: MessageId::new(),
        ..action.clone()
    };
    assert!(illegal(&log.rejects(EventPayload::ToolCallsRequired(other_turn))).contains("names"));
    log.push(EventPayload::ToolCallsRequired(action.clone()));
    let trail = log.fold();
    assert_eq!(
        trail.turn().unwrap().required_action.as_ref(),
        Some(&action)
    );
    // The wait survives a restart; the client's answer finishes the call without a start.
    log.push(resumed(2, None));
    log.push_all([success("c1"), execution("c2"), success("c2")]);
    log.tool_message("c1");
    log.tool_message("c2");
    log.turn(2, "Done.", &[]);
    log.push(run_completed(2));
    assert_eq!(log.fold().iterations(), 2);
}

fn decided(id: &str, approved: bool) -> EventPayload {
    EventPayload::ToolApprovalDecided(crate::events::ToolApprovalDecided {
        call_id: id.to_owned(),
        tool_name: "add".to_owned(),
        approved,
        reason: None,
        decided_by: Some("alice".to_owned()),
        api_key: None,
    })
}

#[test]
fn approval_decisions_come_once_per_waiting_call_before_its_result() {
    let mut log = Log::opened();
    let message = log.turn(1, "", &["c1", "c2", "c3"]);
    let pending = |id: &str, kind| PendingToolCall {
        call_id: id.to_owned(),
        tool_name: "add".to_owned(),
        arguments: json!({}),
        kind,
    };
    // Before the pause, nothing waits for a decision.
    assert!(illegal(&log.rejects(decided("c1", true))).contains("does not wait"));
    log.push(EventPayload::ToolCallsRequired(RequiredAction {
        message_id: message.id,
        tool_calls: vec![
            pending("c1", PendingKind::Approval),
            pending("c2", PendingKind::Approval),
            pending("c3", PendingKind::ClientTool),
        ],
        expires_at: Utc::now(),
    }));
    assert!(illegal(&log.rejects(decided("c3", true))).contains("does not wait"));
    log.push_all([decided("c1", true), decided("c2", false)]);
    assert!(illegal(&log.rejects(decided("c1", false))).contains("second time"));
    assert_eq!(
        log.fold().turn().unwrap().decisions,
        vec![("c1".to_owned(), true), ("c2".to_owned(), false)]
    );
    // A restart keeps them (the resumed run does not log them again).
    log.push(resumed(2, None));
    assert_eq!(log.fold().turn().unwrap().decisions.len(), 2);
    log.push_all([execution("c1"), success("c1"), failure("c2"), success("c3")]);
    for id in ["c1", "c2", "c3"] {
        log.tool_message(id);
    }
    log.turn(2, "Done.", &[]);
    log.push(run_completed(2));
    log.fold();

    // A decision after the call's result is out of place.
    let mut late = Log::opened();
    let message = late.turn(1, "", &["c1"]);
    late.push(EventPayload::ToolCallsRequired(RequiredAction {
        message_id: message.id,
        tool_calls: vec![pending("c1", PendingKind::Approval)],
        expires_at: Utc::now(),
    }));
    late.push(failure("c1"));
    assert!(illegal(&late.rejects(decided("c1", false))).contains("after its execution"));
}

#[test]
fn the_message_id_a_call_announces_is_the_one_it_commits() {
    let mut log = Log::opened();
    let announced = MessageId::new();
    log.push(EventPayload::ModelStarted(ModelStarted {
        provider: "p".to_owned(),
        model: "m".to_owned(),
        iteration: 1,
        message_id: Some(announced),
    }));
    log.push_all([text_delta("Hi"), usage()]);
    assert_eq!(
        log.fold().cut_off_call().and_then(|call| call.message_id),
        Some(announced)
    );
    assert!(illegal(&log.rejects(commit(MessageId::new()))).contains("announced"));
    log.push(commit(announced));
    log.push(run_completed(1));
    log.fold();
}

#[test]
fn resumed_twice() {
    let mut log = Log::opened();
    let first = log.push(model(1));
    log.push(text_delta("Hel"));
    // Killed mid-stream, then again before the call was made again.
    log.push(resumed(1, Some(first)));
    assert!(illegal(&log.rejects(resumed(1, None))).contains("abandoned_after"));
    log.push(resumed(1, Some(first)));
    let second = log.push(model(1));
    log.push(text_delta("Hello"));
    log.push(resumed(1, Some(second)));
    let trail = log.fold();
    assert_eq!(trail.resumed(), 3);
    assert_eq!(trail.cut_off_text(), None);
    let message = log.turn(1, "Hello", &["c1"]);
    log.push(execution("c1"));
    // Killed mid-tool, twice.
    log.push(resumed(2, None));
    log.push(resumed(2, None));
    let trail = log.fold();
    let history = vec![message.clone()];
    let plan = resume::plan(&trail, &log.record, vec![message], &history);
    assert!(
        matches!(&plan.next, Next::Tools(p) if p.started == ["c1"] && p.finished.is_empty()),
        "{plan:?}"
    );
    log.push(failure("c1"));
    log.tool_message("c1");
    log.turn(2, "4", &[]);
    log.push(run_completed(2));
    assert_eq!(log.fold().resumed(), 5);
}

#[test]
fn a_resumed_run_whose_answer_was_committed_completes() {
    let mut log = Log::opened();
    let message = log.turn(1, "The answer", &[]);
    let trail = log.fold();
    let plan = resume::plan(&trail, &log.record, vec![message.clone()], &[message]);
    assert!(matches!(plan.next, Next::Complete(FinishReason::Stop)));
    assert!(illegal(&log.rejects(resumed(3, None))).contains("iteration 3"));
    log.push(resumed(1, None));
    log.push(run_completed(1));
}

fn rejected(attempt: u32) -> EventPayload {
    EventPayload::OutputRejected(OutputRejected {
        message_id: MessageId::new(),
        errors: vec![crate::events::OutputViolation {
            instance_path: String::new(),
            message: "the answer is not JSON".to_owned(),
        }],
        attempt,
    })
}

#[test]
fn a_rejected_answer_is_answered_again_also_after_a_restart() {
    let mut log = Log::opened();
    let answer = log.turn(1, "not json", &[]);
    // Counted from 1, once per answer.
    assert!(illegal(&log.rejects(rejected(2))).contains("attempt 2"));
    log.push(rejected(1));
    assert!(illegal(&log.rejects(rejected(2))).contains("once"));
    let trail = log.fold();
    assert_eq!(trail.output_rejections(), 1);
    // Taken over here, the run makes its next model call instead of completing.
    let plan = resume::plan(&trail, &log.record, vec![answer.clone()], &[answer]);
    assert!(matches!(plan.next, Next::ModelCall(2)), "{:?}", plan.next);
    log.push(resumed(2, None));
    log.turn(2, "{}", &[]);
    log.push(run_completed(2));
    // Not after a turn with tool calls.
    let mut tools = Log::opened();
    tools.turn(1, "", &["c1"]);
    assert!(illegal(&tools.rejects(rejected(1))).contains("tool calls"));
}

#[test]
fn terminal() {
    let mut log = Log::opened();
    log.turn(1, "Hi", &[]);
    assert!(illegal(&log.rejects(run_completed(2))).contains("2 iterations"));
    log.push(run_completed(1));
    let trail = log.fold();
    assert!(trail.end().is_some());
    for payload in [run_failed(), text_delta("x"), model(2), resumed(2, None)] {
        assert!(matches!(log.rejects(payload), TrailError::AfterEnd { .. }));
    }
}

#[test]
fn a_reactive_compaction_comes_after_the_rejected_call_s_retry() {
    let mut log = Log::opened();
    log.push(model(1));
    let compacted = EventPayload::CompactionCircuitOpened(crate::events::CompactionCircuitOpened {
        consecutive_failures: 3,
    });
    assert!(illegal(&log.rejects(compacted.clone())).contains("rejection"));
    log.push(EventPayload::ModelRetrying(ModelRetrying {
        attempt: 1,
        error_class: ErrorClass::ContextLengthExceeded,
        delay_ms: 0,
        error: "too long".to_owned(),
    }));
    log.push(compacted);
    log.push(text_delta("ok"));
    let retry = EventPayload::ModelRetrying(ModelRetrying {
        attempt: 1,
        error_class: ErrorClass::Overloaded,
        delay_ms: 0,
        error: "529".to_owned(),
    });
    assert!(illegal(&log.rejects(retry)).contains("output"));
}

#[test]
fn a_compaction_cut_off_is_closed_by_its_estimated_usage_and_resumes_at_its_call() {
    let started = || {
        EventPayload::ContextCompactionStarted(crate::events::ContextCompactionStarted {
            trigger: crate::domain::CompactionTrigger::Auto,
            messages_to_summarise: 4,
            tokens_before: 5_000,
            provider: "p".to_owned(),
            model: "m".to_owned(),
        })
    };
    // Before the first call: open until the call (a failed compaction logs nothing more).
    let mut log = Log::opened();
    log.push(started());
    assert_eq!(log.fold().open_compaction(), Some(3));
    log.push(model(1));
    assert_eq!(log.fold().open_compaction(), None);
    // Inside a call only after its rejection, as `context_compacted`.
    assert!(illegal(&log.rejects(started())).contains("rejection"));

    // Cut off by a cancel: the summariser's estimated usage closes it, outside any call.
    let mut log = Log::opened();
    log.push(started());
    let trail = log.then(usage()).unwrap();
    assert_eq!(trail.open_compaction(), None);
    assert_eq!(trail.last_call(), None, "no model call was made");
    // Without an open compaction, a usage outside a call is illegal.
    let mut closed = Log::opened();
    closed.push(started());
    closed.push(usage());
    assert!(illegal(&closed.rejects(usage())).contains("outside"));
    log.push(usage());
    log.push(EventPayload::terminal(&RunEnd::Cancelled, 0));
    assert!(log.fold().end().is_some());

    // Cut off by a crash: the next process resumes at the first call.
    let mut log = Log::opened();
    log.push(started());
    let plan = resume::plan(&log.fold(), &log.record, Vec::new(), &[]);
    assert!(matches!(plan.next, Next::ModelCall(1)), "{plan:?}");
    assert_eq!(plan.abandoned_after, None);
    log.push(resumed(1, None));
    assert_eq!(log.fold().open_compaction(), None);
    log.push(started());
    log.push(model(1));
    log.fold();
}

// ---------------------------------------------------------------------------------------------
// Impossible sequences

#[test]
fn impossible_sequences_are_rejected() {
    let log = Log::opened();
    let cases: Vec<(EventPayload, &str)> = vec![
        (text_delta("x"), "outside a model call"),
        (delta("c1", "{"), "outside a model call"),
        (completed("c1"), "outside a model call"),
        (usage(), "outside a model call"),
        (commit(MessageId::new()), "without a model call"),
        (execution("c1"), "outside a committed turn"),
        (success("c1"), "outside a committed turn"),
        (model(2), "iteration 2, not 1"),
        (
            EventPayload::RunStarted(RunStarted {
                session_id: log.record.session_id,
                provider: "p".to_owned(),
                model: "m".to_owned(),
            }),
            "first",
        ),
        (run_completed(0), "without a model call"),
    ];
    for (payload, reason) in cases {
        let error = log.rejects(payload);
        assert!(illegal(&error).contains(reason), "{error}");
    }

    let mut streaming = Log::opened();
    streaming.push(model(1));
    streaming.push(started("c1"));
    assert!(illegal(&streaming.rejects(delta("c2", "{"))).contains("not open"));
    assert!(illegal(&streaming.rejects(completed("c2"))).contains("not started"));
    assert!(illegal(&streaming.rejects(started("c1"))).contains("again"));
    assert!(illegal(&streaming.rejects(model(1))).contains("not committed"));
    assert!(
        illegal(&streaming.rejects(EventPayload::CacheMetrics(Default::default())))
            .contains("other than after")
    );

    let mut committed = Log::opened();
    committed.turn(1, "", &["c1"]);
    assert!(illegal(&committed.rejects(text_delta("late"))).contains("outside"));
    assert!(illegal(&committed.rejects(execution("c9"))).contains("not the turn's"));
    assert!(illegal(&committed.rejects(success("c9"))).contains("not the turn's"));
    assert!(illegal(&committed.rejects(run_completed(1))).contains("tool calls"));
    committed.push(execution("c1"));
    assert!(illegal(&committed.rejects(execution("c1"))).contains("second time"));

    // Not contiguous, another run's.
    let mut trail = log.fold();
    let mut event = log.event(text_delta("x"));
    event.sequence = 9;
    assert_eq!(
        trail.record(&event),
        Err(TrailError::NotContiguous { last: 2, got: 9 })
    );
    let mut trail = log.fold();
    let mut event = log.event(model(1));
    event.run_id = RunId::new();
    assert!(matches!(
        trail.record(&event),
        Err(TrailError::OtherRun { .. })
    ));
}

#[test]
fn the_first_rejection_is_remembered() {
    let mut log = Log::opened();
    log.push(model(1));
    let mut trail = log.fold();
    let first = trail.record(&log.event(delta("c1", "x"))).unwrap_err();
    // The later events still fold, after the rejected one's sequence.
    for (sequence, text) in [(5, "a"), (6, "b")] {
        let mut event = log.event(text_delta(text));
        event.sequence = sequence;
        trail.record(&event).unwrap();
    }
    assert_eq!(trail.broken(), Some(&first));
    assert_eq!(trail.cut_off_text(), Some("ab"));
    assert_eq!(trail.last_sequence(), 6);
}
