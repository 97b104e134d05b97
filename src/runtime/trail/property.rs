//! Property: for random legal runs — killed and taken over at random points, some ended by
//! a close-out — the trail the emitters keep live equals the stored log folded again, and the
//! stored log folds without a [`TrailError`].

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use chrono::Utc;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::json;

use super::*;
use crate::domain::{
    CompactionTrigger, ErrorClass, FinishReason, PendingKind, PendingToolCall, SessionId,
    TokenUsage, ToolCall,
};
use crate::events::{
    CacheMetrics, CompactionCircuitOpened, ContextBuilt, ContextCompacted,
    ContextCompactionStarted, DoomLoopDetected, EventFeed, MessageCommitted, ModelRetrying,
    ModelStarted, ReasoningDelta, RunResumed, RunStarted, TextDelta, ToolCallCompleted,
    ToolCallDelta, ToolCallStarted, ToolExecutionFinished, ToolExecutionStarted, ToolFailure,
    ToolMessageCommitted, ToolProgress, ToolSuccess, UsageRecorded,
};
use crate::runtime::{EventLog, TraceContext};
use crate::store::{NewRun, RunChange};

/// What the test does to the run: log events in one transaction, kill its process (the next
/// one loads the trail from the store), or end it.
#[derive(Debug)]
enum Step {
    Emit(Vec<EventPayload>),
    /// `tool_calls_required` for the committed turn's first call (its message id is the
    /// trail's).
    RequireFirstCall,
    Crash,
    End(RunEnd),
}

/// Where the simulated run is.
#[derive(Debug)]
enum At {
    Opening,
    /// Before model call `iteration`; `abandoned` is the cut-off call a resumed run makes again.
    BeforeCall {
        iteration: u32,
        abandoned: Option<u64>,
        first: bool,
    },
    /// Before model call `iteration`, its compaction's summariser called
    /// (`context_compaction_started`) and not answered yet.
    Compacting {
        iteration: u32,
        abandoned: Option<u64>,
        first: bool,
    },
    Streaming(Stream),
    Committed(Work),
    Done,
}

#[derive(Debug)]
struct Stream {
    iteration: u32,
    sequence: u64,
    text: String,
    output: bool,
    retried: bool,
    open: Vec<String>,
    calls: Vec<String>,
    steps: u8,
}

#[derive(Debug)]
struct Work {
    iteration: u32,
    calls: Vec<String>,
    started: Vec<bool>,
    finished: Vec<bool>,
    answered: usize,
    touched: bool,
}

/// A legal run, chosen by `choices` the way the run loop, the recovery and the close-out write
/// one.
struct Script<'a> {
    choices: &'a [u8],
    at_choice: usize,
    steps: Vec<Step>,
    group: Vec<EventPayload>,
    sequence: u64,
    next_id: u32,
}

impl Script<'_> {
    fn pick(&mut self, n: u8) -> u8 {
        let choice = self.choices.get(self.at_choice).copied().unwrap_or(0);
        self.at_choice += 1;
        choice % n
    }

    fn one_in(&mut self, n: u8) -> bool {
        self.pick(n) == 0
    }

    fn exhausted(&self) -> bool {
        self.at_choice >= self.choices.len()
    }

    /// Logs `payload`, in the same transaction as the events before it or in a new one.
    fn emit(&mut self, payload: EventPayload) -> u64 {
        if !self.group.is_empty() && self.one_in(2) {
            self.flush();
        }
        self.group.push(payload);
        self.sequence += 1;
        self.sequence
    }

    fn flush(&mut self) {
        if !self.group.is_empty() {
            self.steps.push(Step::Emit(std::mem::take(&mut self.group)));
        }
    }

    fn end(&mut self, end: RunEnd) -> At {
        self.flush();
        self.steps.push(Step::End(end));
        At::Done
    }

    fn build(choices: &[u8]) -> Vec<Step> {
        let mut script = Script {
            choices,
            at_choice: 0,
            steps: Vec::new(),
            group: Vec::new(),
            sequence: 0,
            next_id: 0,
        };
        let mut at = At::Opening;
        while !matches!(at, At::Done) {
            at = if !script.exhausted() && script.one_in(9) {
                script.flush();
                script.steps.push(Step::Crash);
                if script.one_in(3) {
                    script.close_out(at)
                } else {
                    script.resume(at)
                }
            } else {
                script.advance(at)
            };
        }
        script.steps
    }

    fn advance(&mut self, at: At) -> At {
        match at {
            At::Opening => {
                self.emit(EventPayload::RunStarted(RunStarted {
                    session_id: SessionId::new(),
                    provider: "p".to_owned(),
                    model: "m".to_owned(),
                }));
                self.emit(EventPayload::ContextBuilt(ContextBuilt {
                    message_count: 1,
                }));
                At::BeforeCall {
                    iteration: 1,
                    abandoned: None,
                    first: true,
                }
            }
            At::BeforeCall {
                iteration,
                abandoned,
                first,
            } if self.one_in(4) => {
                self.compaction_started(CompactionTrigger::Auto);
                At::Compacting {
                    iteration,
                    abandoned,
                    first,
                }
            }
            At::Compacting { iteration, .. } => {
                // Compacted, failed (the breaker opened, or nothing logged), then the call.
                match self.pick(3) {
                    0 => self.compacted(CompactionTrigger::Auto),
                    1 => {
                        self.emit(EventPayload::CompactionCircuitOpened(
                            CompactionCircuitOpened {
                                consecutive_failures: 3,
                            },
                        ));
                    }
                    _ => {}
                }
                self.model_started(iteration)
            }
            At::BeforeCall { iteration, .. } => {
                if self.one_in(5) {
                    self.emit(EventPayload::CompactionCircuitOpened(
                        CompactionCircuitOpened {
                            consecutive_failures: 3,
                        },
                    ));
                }
                self.model_started(iteration)
            }
            At::Streaming(stream) => self.stream(stream),
            At::Committed(work) => self.work(work),
            At::Done => At::Done,
        }
    }

    fn model_started(&mut self, iteration: u32) -> At {
        let sequence = self.emit(EventPayload::ModelStarted(ModelStarted {
            provider: "p".to_owned(),
            model: "m".to_owned(),
            iteration,
            message_id: None,
        }));
        At::Streaming(Stream {
            iteration,
            sequence,
            text: String::new(),
            output: false,
            retried: false,
            open: Vec::new(),
            calls: Vec::new(),
            steps: 0,
        })
    }

    fn compaction_started(&mut self, trigger: CompactionTrigger) {
        self.emit(EventPayload::ContextCompactionStarted(
            ContextCompactionStarted {
                trigger,
                messages_to_summarise: 6,
                tokens_before: 5_000,
                provider: "p".to_owned(),
                model: "m".to_owned(),
            },
        ));
    }

    fn compacted(&mut self, trigger: CompactionTrigger) {
        self.emit(EventPayload::ContextCompacted(ContextCompacted {
            compaction_id: crate::domain::CompactionId::new(),
            trigger,
            messages_summarised: 6,
            through_message_id: MessageId::new(),
            tokens_before: 5_000,
            tokens_after: 900,
            summary: "Summary.".to_owned(),
            usage: TokenUsage::default(),
            duration_ms: 10,
        }));
    }

    fn stream(&mut self, mut stream: Stream) -> At {
        stream.steps += 1;
        let last_turn = stream.iteration >= 3;
        if stream.steps < 8 && !self.exhausted() {
            match self.pick(8) {
                0 if !stream.output => {
                    stream.retried = true;
                    self.emit(EventPayload::ModelRetrying(ModelRetrying {
                        attempt: 1,
                        error_class: ErrorClass::ContextLengthExceeded,
                        delay_ms: 0,
                        error: "too long".to_owned(),
                    }));
                    if self.one_in(2) {
                        // A reactive compaction that fails ends the run; this one succeeds.
                        self.compaction_started(CompactionTrigger::Reactive);
                        self.compacted(CompactionTrigger::Reactive);
                    } else if self.one_in(2) {
                        self.emit(EventPayload::CompactionCircuitOpened(
                            CompactionCircuitOpened {
                                consecutive_failures: 3,
                            },
                        ));
                    }
                }
                1 | 2 => {
                    stream.output = true;
                    let delta = ["Hel", "lo", " ", "wörld"][usize::from(self.pick(4))].to_owned();
                    stream.text.push_str(&delta);
                    self.emit(EventPayload::TextDelta(TextDelta { delta }));
                }
                3 => {
                    stream.output = true;
                    self.emit(EventPayload::ReasoningDelta(ReasoningDelta {
                        delta: "hmm".to_owned(),
                    }));
                }
                4 if !last_turn => {
                    stream.output = true;
                    self.next_id += 1;
                    let id = format!("call_{}", self.next_id);
                    stream.open.push(id.clone());
                    self.emit(EventPayload::ToolCallStarted(ToolCallStarted {
                        call_id: id,
                        tool_name: "add".to_owned(),
                    }));
                }
                5 if !stream.open.is_empty() => {
                    let id = stream.open[usize::from(self.pick(8)) % stream.open.len()].clone();
                    self.emit(EventPayload::ToolCallDelta(ToolCallDelta {
                        call_id: id,
                        delta: "{\"a\":".to_owned(),
                    }));
                }
                6 if !stream.open.is_empty() => {
                    let id = stream.open.remove(0);
                    self.complete(&id, false);
                    stream.calls.push(id);
                }
                _ => {}
            }
            return At::Streaming(stream);
        }
        // The stream ends: its open calls completed (invalid), usage, maybe cache figures.
        for id in std::mem::take(&mut stream.open) {
            self.complete(&id, true);
            stream.calls.push(id);
        }
        self.emit(EventPayload::UsageRecorded(UsageRecorded {
            usage: TokenUsage::default(),
        }));
        if self.one_in(2) {
            self.emit(EventPayload::CacheMetrics(CacheMetrics::default()));
        }
        if stream.text.is_empty() && stream.calls.is_empty() {
            return self.end(RunEnd::Completed {
                finish_reason: FinishReason::Stop,
                parsed: None,
            });
        }
        self.emit(EventPayload::AssistantMessageCommitted(MessageCommitted {
            message_id: MessageId::new(),
        }));
        if stream.calls.is_empty() {
            return self.end(RunEnd::Completed {
                finish_reason: FinishReason::Stop,
                parsed: None,
            });
        }
        let count = stream.calls.len();
        At::Committed(Work {
            iteration: stream.iteration,
            calls: stream.calls,
            started: vec![false; count],
            finished: vec![false; count],
            answered: 0,
            touched: false,
        })
    }

    fn complete(&mut self, id: &str, invalid: bool) {
        self.emit(EventPayload::ToolCallCompleted(ToolCallCompleted {
            call: ToolCall {
                id: id.to_owned(),
                name: "add".to_owned(),
                arguments: json!({}),
                invalid_arguments: invalid.then(|| "{\"a\":".to_owned()),
            },
        }));
    }

    fn work(&mut self, mut work: Work) -> At {
        if !work.touched {
            work.touched = true;
            match self.pick(6) {
                0 => {
                    self.emit(EventPayload::DoomLoopDetected(DoomLoopDetected {
                        description: "add ×3".to_owned(),
                    }));
                    for _ in work.answered..work.calls.len() {
                        self.tool_message();
                    }
                    return self.end(RunEnd::failed(ErrorClass::DoomLoop, "doom loop"));
                }
                1 => {
                    // A client tool: the run waits in requires_action.
                    self.flush();
                    self.steps.push(Step::RequireFirstCall);
                    self.sequence += 1;
                    return At::Committed(work);
                }
                _ => {}
            }
        }
        let k = work.answered;
        if k == work.calls.len() {
            return if work.iteration >= 3 {
                self.end(RunEnd::failed(ErrorClass::LimitExceeded, "max_iterations"))
            } else {
                At::BeforeCall {
                    iteration: work.iteration + 1,
                    abandoned: None,
                    first: false,
                }
            };
        }
        if work.finished[k] {
            self.tool_message();
            work.answered += 1;
        } else if !work.started[k] && self.one_in(3) {
            // Answered by the client (or a check): finished without a start.
            self.finish(&work.calls[k], true);
            work.finished[k] = true;
        } else if !work.started[k] {
            self.execute(&work.calls[k]);
            work.started[k] = true;
        } else if k + 1 < work.calls.len() && !work.started[k + 1] && self.one_in(2) {
            // Executions run concurrently; results are committed in the calls' order.
            self.execute(&work.calls[k + 1]);
            work.started[k + 1] = true;
        } else {
            let ok = self.one_in(2);
            self.finish(&work.calls[k], ok);
            work.finished[k] = true;
        }
        At::Committed(work)
    }

    fn execute(&mut self, id: &str) {
        self.emit(EventPayload::ToolExecutionStarted(ToolExecutionStarted {
            call_id: id.to_owned(),
            tool_name: "add".to_owned(),
        }));
        if self.one_in(2) {
            self.emit(EventPayload::ToolProgress(ToolProgress {
                call_id: id.to_owned(),
                progress: 1.0,
                total: Some(2.0),
                message: None,
            }));
        }
    }

    fn finish(&mut self, id: &str, ok: bool) {
        self.emit(EventPayload::ToolExecutionFinished(ToolExecutionFinished {
            call_id: id.to_owned(),
            tool_name: "add".to_owned(),
            result: if ok {
                ToolExecutionResult::Success(ToolSuccess { output: json!(8) })
            } else {
                ToolExecutionResult::Failure(ToolFailure {
                    error: "interrupted".to_owned(),
                })
            },
            duration_ms: 1,
        }));
    }

    fn tool_message(&mut self) {
        self.emit(EventPayload::ToolMessageCommitted(ToolMessageCommitted {
            message_id: MessageId::new(),
            call_id: None,
        }));
    }

    /// What a process that takes the run over writes, then where the run goes on.
    fn resume(&mut self, at: At) -> At {
        match at {
            At::Opening => {
                self.resumed(1, None);
                At::BeforeCall {
                    iteration: 1,
                    abandoned: None,
                    first: true,
                }
            }
            At::BeforeCall {
                iteration,
                abandoned,
                first,
            } => {
                self.resumed(iteration, abandoned);
                At::BeforeCall {
                    iteration,
                    abandoned,
                    first,
                }
            }
            At::Compacting {
                iteration,
                abandoned,
                first,
            } => {
                // The summariser's answer was lost with the process: compacted again, maybe.
                self.resumed(iteration, abandoned);
                At::BeforeCall {
                    iteration,
                    abandoned,
                    first,
                }
            }
            At::Streaming(stream) => {
                for id in &stream.open {
                    self.complete(id, true);
                }
                self.resumed(stream.iteration, Some(stream.sequence));
                At::BeforeCall {
                    iteration: stream.iteration,
                    abandoned: Some(stream.sequence),
                    first: false,
                }
            }
            At::Committed(mut work) => {
                self.resumed(work.iteration + 1, None);
                for k in 0..work.calls.len() {
                    if work.started[k] && !work.finished[k] {
                        let id = work.calls[k].clone();
                        self.finish(&id, false);
                        work.finished[k] = true;
                    }
                }
                work.touched = true;
                At::Committed(work)
            }
            At::Done => At::Done,
        }
    }

    fn resumed(&mut self, iteration: u32, abandoned_after: Option<u64>) {
        self.emit(EventPayload::RunResumed(RunResumed {
            iteration,
            abandoned_after,
        }));
    }

    /// A cancel (or `recovery = "fail"`) of the run where it is: the close-out's events.
    fn close_out(&mut self, at: At) -> At {
        let end = if self.one_in(2) {
            RunEnd::Cancelled
        } else {
            RunEnd::failed(ErrorClass::Interrupted, "the server stopped")
        };
        match at {
            At::Streaming(stream) => {
                for id in &stream.open {
                    self.complete(id, true);
                }
                if !stream.text.trim().is_empty() {
                    self.emit(EventPayload::AssistantMessageCommitted(MessageCommitted {
                        message_id: MessageId::new(),
                    }));
                }
            }
            At::Committed(work) => {
                for k in 0..work.calls.len() {
                    if work.started[k] && !work.finished[k] {
                        let id = work.calls[k].clone();
                        self.finish(&id, false);
                    }
                }
                for _ in work.answered..work.calls.len() {
                    self.tool_message();
                }
            }
            At::Compacting { .. } => {
                // The summariser call this process made is estimated; another process (a
                // recovery with `recovery = "fail"`) has none in flight.
                if self.one_in(2) {
                    self.emit(EventPayload::UsageRecorded(UsageRecorded {
                        usage: TokenUsage {
                            input_tokens: 4_000,
                            total_tokens: 4_000,
                            estimated: true,
                            ..TokenUsage::default()
                        },
                    }));
                }
            }
            At::Opening | At::BeforeCall { .. } | At::Done => {}
        }
        self.end(end)
    }
}

/// Runs `steps` through the event log into the store, as the processes of one run would.
async fn play(
    store: &Arc<dyn Store>,
    log: &EventLog,
    steps: Vec<Step>,
) -> Result<(), TestCaseError> {
    let run_id = RunId::new();
    store.create_run(&new_run(run_id)).await.unwrap();
    let trace = TraceContext::for_run(run_id);
    let mut emitter = log.emitter(run_id, RunTrail::new(), trace.clone());
    for step in steps {
        match step {
            Step::RequireFirstCall => {
                let trail = emitter.trail();
                let turn = trail.turn().unwrap();
                let call = &trail.last_call().unwrap().tool_calls[0];
                let action = RequiredAction {
                    message_id: turn.message_id.unwrap(),
                    tool_calls: vec![PendingToolCall {
                        call_id: call.id.clone(),
                        tool_name: call.tool_name.clone(),
                        arguments: json!({}),
                        kind: PendingKind::ClientTool,
                    }],
                    expires_at: Utc::now(),
                };
                emitter
                    .emit(EventPayload::ToolCallsRequired(action))
                    .await
                    .unwrap();
            }
            Step::Emit(payloads) => {
                let events = payloads
                    .into_iter()
                    .map(|p| (p, RunChange::default()))
                    .collect();
                emitter.emit_all(events).await.unwrap();
            }
            Step::Crash => {
                let trail = RunTrail::load(store.as_ref(), run_id).await.unwrap();
                prop_assert_eq!(&trail, &emitter.trail());
                emitter = log.emitter(run_id, trail, trace.clone());
            }
            Step::End(end) => {
                emitter.finish(end).await.unwrap();
            }
        }
    }
    let stored = RunTrail::load(store.as_ref(), run_id).await.unwrap();
    prop_assert_eq!(stored.broken(), None);
    prop_assert!(stored.end().is_some());
    prop_assert_eq!(&stored, &emitter.trail());
    Ok(())
}

fn new_run(id: RunId) -> NewRun {
    NewRun {
        id,
        session_id: SessionId::new(),
        create_session: true,
        provider: "p".to_owned(),
        model: "m".to_owned(),
        tool_choice: crate::domain::ToolChoice::default(),
        metadata: json!({}),
        input: crate::domain::RunInput::from("hi").content(),
        user_message_id: MessageId::new(),
        tools: None,
        agent: None,
        definition: Default::default(),
        session_defaults: None,
        max_iterations: 5,
        client_request_id: None,
        request_hash: None,
        created_at: Utc::now(),
        lease: None,
    }
}

#[test]
fn the_live_trail_is_the_stored_log_folded() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    let (store, log) = runtime.block_on(async {
        let store = crate::store::connect(&url).await.unwrap();
        let log = EventLog::start(
            store.clone(),
            Arc::new(EventFeed::new(64)),
            16,
            Arc::from("test"),
        );
        (store, log)
    });
    let config = Config {
        cases: 64,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let (events, crashes) = (AtomicUsize::new(0), AtomicUsize::new(0));
    runner
        .run(&proptest::collection::vec(any::<u8>(), 0..400), |choices| {
            let steps = Script::build(&choices);
            for step in &steps {
                match step {
                    Step::Emit(payloads) => events.fetch_add(payloads.len(), Ordering::Relaxed),
                    Step::Crash => crashes.fetch_add(1, Ordering::Relaxed),
                    _ => 0,
                };
            }
            runtime.block_on(play(&store, &log, steps))
        })
        .unwrap();
    // The cases were runs, not empty logs.
    let (events, crashes) = (events.into_inner(), crashes.into_inner());
    assert!(
        events > 64 * 10 && crashes > 64,
        "{events} events, {crashes} crashes"
    );
}
