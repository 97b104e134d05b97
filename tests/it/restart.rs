//! Crash and restart at process level (issue 9): the real `behest serve` binary, against the
//! fake OpenAI provider and HTTP tools of this process, is killed with SIGKILL at five points
//! of multi-step tool runs (right after `POST /runs`, mid model stream, between iterations,
//! mid tool, right after a tool result) and restarted on the same database; then every run
//! must end (completed when resumed, `run_failed` `interrupted` with `recovery = "fail"`), its
//! event log must be contiguous with one terminal event and keep the prefix a watcher saw
//! byte for byte, a watcher reconnecting with `Last-Event-ID` must get exactly the rest, no
//! tool may run twice (but an idempotent one cut mid-call), and the session history must be
//! valid. Also SIGTERM mid-stream: a drain that keeps the listener open, then a resume.
//!
//! Each scenario runs several runs concurrently in one server; a summary per kill point is
//! printed (see with `--nocapture`, or `scripts/crash-matrix.sh`).

use crate::support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::{Value, json};
use support::db::{Backend, TestDb};
use support::fake_openai::{
    FakeOpenAi, RecordedRequest, Reply, chunk, text_stream, tool_calls_stream,
};
use support::process::{ServerProcess, ToolServer, config_toml};
use support::server::{Frame, TERMINAL};
use support::validate::validate_openai_request;

/// How long a kill point may take to be reached, or a run to end after the restart.
const WAIT: Duration = Duration::from_secs(60);

/// How long a tool held for a kill mid tool sleeps: until the test releases it after the kill.
const HELD_TOOL_MS: u64 = 600_000;

/// Text of a model call cut off by the kill; never in the output or the history.
const ABANDONED: &str = "ABANDONED draft";

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------------------------------------
// What the fake model does

/// One model call of a run's script.
#[derive(Debug, Clone)]
enum Step {
    /// The model calls these tools, in parallel: `(tool, sleep_ms)`.
    Tools(Vec<(&'static str, u64)>),
    /// The model answers with text: the run completes.
    Text,
}

/// How the reply to one step is held back until the kill (only before the kill).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// Headers, then nothing.
    Stall,
    /// The first text piece (`ABANDONED draft …`), then nothing.
    CutText,
}

/// A run's script: the model's reply to its `n`th call is `steps[n]` (the call is recognised
/// by the input text and the number of assistant messages in the request).
#[derive(Debug, Clone)]
struct Plan {
    tag: String,
    input: String,
    steps: Vec<Step>,
    /// `(generation, step, hold)`: the reply to `step` is held while the server is the
    /// `generation`th process (1: the first).
    holds: Vec<(u32, usize, Hold)>,
}

impl Plan {
    fn new(tag: &str, steps: Vec<Step>, hold: Option<(usize, Hold)>) -> Self {
        Self {
            tag: tag.to_owned(),
            input: format!("job {tag}: use the tools, then answer"),
            steps,
            holds: hold
                .map(|(step, hold)| (1, step, hold))
                .into_iter()
                .collect(),
        }
    }

    /// Also holds the reply to `step` while the server is the `generation`th process.
    fn hold_in(mut self, generation: u32, step: usize, hold: Hold) -> Self {
        self.holds.push((generation, step, hold));
        self
    }

    fn call_id(&self, step: usize, index: usize) -> String {
        format!("call_{}_{step}_{index}", self.tag)
    }

    fn marker(&self, step: usize, index: usize) -> String {
        format!("{}/{step}/{index}", self.tag)
    }

    /// `(tool, marker, call id)` of the calls whose tool sleeps (the ones a kill mid tool
    /// cuts).
    fn held_calls(&self) -> Vec<(&'static str, String, String)> {
        let mut held = Vec::new();
        for (step, s) in self.steps.iter().enumerate() {
            if let Step::Tools(tools) = s {
                for (index, (tool, sleep_ms)) in tools.iter().enumerate() {
                    if *sleep_ms > 0 {
                        held.push((*tool, self.marker(step, index), self.call_id(step, index)));
                    }
                }
            }
        }
        held
    }

    fn final_text(&self) -> String {
        format!("Final answer for {}", self.tag)
    }

    fn reply(&self, step: usize, generation: u32) -> Reply {
        if let Some(&(_, _, hold)) = self
            .holds
            .iter()
            .find(|(g, held, _)| *g == generation && *held == step)
        {
            return match hold {
                Hold::Stall => Reply::stall_after(b""),
                Hold::CutText => {
                    let body = chunk(
                        json!({"role": "assistant", "content": "", "refusal": null}),
                        None,
                    ) + &chunk(
                        json!({"content": format!("{ABANDONED} of {} ", self.tag)}),
                        None,
                    );
                    Reply::stall_after(body.as_bytes())
                }
            };
        }
        match self.steps.get(step) {
            Some(Step::Tools(tools)) => {
                let calls: Vec<(String, &str, Value)> = tools
                    .iter()
                    .enumerate()
                    .map(|(index, (tool, sleep_ms))| {
                        let mut arguments = json!({"marker": self.marker(step, index)});
                        if *sleep_ms > 0 {
                            arguments["sleep_ms"] = json!(sleep_ms);
                        }
                        (self.call_id(step, index), *tool, arguments)
                    })
                    .collect();
                let calls: Vec<(&str, &str, Value)> = calls
                    .iter()
                    .map(|(id, tool, arguments)| (id.as_str(), *tool, arguments.clone()))
                    .collect();
                Reply::sse(&tool_calls_stream(&calls))
            }
            Some(Step::Text) | None => Reply::sse(&text_stream(&[
                "Final answer ",
                &format!("for {}", self.tag),
            ])),
        }
    }
}

/// The text of a request message's content (a string or text parts).
fn content_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

// ---------------------------------------------------------------------------------------------
// A watcher of a run's events

/// A `GET /runs/{id}/events` client that collects frames as they come.
struct Watcher {
    frames: Arc<Mutex<Vec<Frame>>>,
    /// `Some(Ok)` when the stream ended cleanly, `Some(Err)` on a transport error.
    ended: Arc<Mutex<Option<Result<(), String>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Watcher {
    fn start(server: &ServerProcess, run_id: &str, last_event_id: Option<u64>) -> Self {
        let frames = Arc::new(Mutex::new(Vec::new()));
        let ended = Arc::new(Mutex::new(None));
        let mut request = server
            .client
            .get(server.url(&format!("/runs/{run_id}/events")));
        if let Some(id) = last_event_id {
            request = request.header("Last-Event-ID", id.to_string());
        }
        let (task_frames, task_ended) = (Arc::clone(&frames), Arc::clone(&ended));
        let task = tokio::spawn(async move {
            let outcome = async {
                let response = request.send().await.map_err(|e| e.to_string())?;
                if response.status() != 200 {
                    return Err(format!("watch answered {}", response.status()));
                }
                let mut stream = response.bytes_stream().eventsource();
                while let Some(event) = stream.next().await {
                    let event = event.map_err(|e| e.to_string())?;
                    lock(&task_frames).push(Frame {
                        id: event.id,
                        event: event.event,
                        data: event.data,
                    });
                }
                Ok(())
            }
            .await;
            *lock(&task_ended) = Some(outcome);
        });
        Self {
            frames,
            ended,
            task,
        }
    }

    fn saw(&self, event: &str) -> usize {
        lock(&self.frames)
            .iter()
            .filter(|f| f.event == event)
            .count()
    }

    /// Waits (at most `timeout`) for the stream to end: its frames and how it ended.
    async fn finish(self, timeout: Duration, what: &str) -> (Vec<Frame>, Result<(), String>) {
        let Self {
            frames,
            ended,
            task,
        } = self;
        if tokio::time::timeout(timeout, task).await.is_err() {
            panic!(
                "{what}: the watch did not end within {timeout:?}; frames: {:?}",
                kinds(&lock(&frames))
            );
        }
        let frames = lock(&frames).clone();
        let ended = lock(&ended).clone().unwrap_or(Err("no outcome".to_owned()));
        (frames, ended)
    }
}

fn kinds(frames: &[Frame]) -> Vec<String> {
    frames
        .iter()
        .map(|f| format!("{}:{}", f.id, f.event))
        .collect()
}

/// Polls `check` every 10 ms until it holds; panics with `what` after `timeout`.
async fn wait_until(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// The harness: database, fake provider, tool server

/// Where the first process is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KillPoint {
    AfterCreate,
    MidStream,
    BetweenIterations,
    MidTool,
    AfterToolResult,
}

/// What the restarted server does with the interrupted runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Recovery {
    Resume,
    Fail,
}

struct Harness {
    backend: Backend,
    db: TestDb,
    fake: FakeOpenAi,
    tools: ToolServer,
    plans: Arc<Mutex<HashMap<String, Plan>>>,
    /// Which process is serving: 1 for the first, 2 after the first restart, …
    generation: Arc<AtomicU32>,
}

impl Harness {
    async fn new(backend: Backend) -> Option<Self> {
        let db = TestDb::new(backend).await?;
        let fake = FakeOpenAi::start().await;
        let tools = ToolServer::start().await;
        let plans: Arc<Mutex<HashMap<String, Plan>>> = Arc::default();
        let generation = Arc::new(AtomicU32::new(1));
        let (responder_plans, responder_generation) = (Arc::clone(&plans), Arc::clone(&generation));
        fake.respond_with(move |request: &RecordedRequest| {
            let messages = request.body["messages"].as_array()?;
            let input = messages
                .iter()
                .find(|m| m["role"] == "user")
                .map(|m| content_text(&m["content"]))?;
            let step = messages.iter().filter(|m| m["role"] == "assistant").count();
            let plan = lock(&responder_plans).get(&input).cloned()?;
            Some(plan.reply(step, responder_generation.load(Ordering::SeqCst)))
        });
        Some(Self {
            backend,
            db,
            fake,
            tools,
            plans,
            generation,
        })
    }

    fn config(&self, runtime_extra: &str) -> String {
        config_toml(&self.fake.base_url(), &self.tools, runtime_extra)
    }

    async fn server(&self, name: &str, runtime_extra: &str) -> ServerProcess {
        ServerProcess::start(name, &self.config(runtime_extra), &self.db.url).await
    }

    /// Starts a run of `plan` (in a new session) and a watcher of its events.
    async fn start_run(&self, server: &ServerProcess, plan: Plan) -> (Tracked, Watcher) {
        lock(&self.plans).insert(plan.input.clone(), plan.clone());
        let (status, _, body) = server
            .post(
                "/runs",
                &json!({"provider": "fake", "model": "fake-model", "input": plan.input}),
            )
            .await;
        assert_eq!(status, 202, "POST /runs: {body}");
        let run_id = body["run_id"].as_str().expect("run_id").to_owned();
        let session_id = body["session_id"].as_str().expect("session_id").to_owned();
        let watcher = Watcher::start(server, &run_id, None);
        (
            Tracked {
                plan,
                run_id,
                session_id,
            },
            watcher,
        )
    }

    async fn cleanup(self) {
        self.db.assert_logs_fold().await;
        self.db.cleanup().await;
    }
}

/// A run of a scenario.
struct Tracked {
    plan: Plan,
    run_id: String,
    session_id: String,
}

/// Is `run` at `point` (as its watcher and the tool server see it)?
fn reached(point: KillPoint, run: &Tracked, watcher: &Watcher, tools: &ToolServer) -> bool {
    match point {
        KillPoint::AfterCreate => true,
        KillPoint::MidStream => watcher.saw("text_delta") > 0,
        KillPoint::BetweenIterations => {
            let first_step_calls = match run.plan.steps.first() {
                Some(Step::Tools(tools)) => tools.len(),
                _ => 1,
            };
            watcher.saw("tool_message_committed") >= first_step_calls
        }
        KillPoint::MidTool => run
            .plan
            .held_calls()
            .iter()
            .all(|(_, marker, _)| tools.count(marker) > 0),
        KillPoint::AfterToolResult => watcher.saw("tool_execution_finished") > 0,
    }
}

// ---------------------------------------------------------------------------------------------
// Checks after the restart

/// What one run looked like, for the summary.
#[derive(Debug, Default)]
struct RunReport {
    events: usize,
    seen_before_kill: usize,
    /// `run_resumed` events in its log.
    resumes: usize,
    tools_executed: usize,
    /// Its terminal event's type.
    terminal: String,
}

/// Prints one line of the crash matrix (see it with `--nocapture`): every number in it was
/// checked by then (no run left running, no event lost or duplicated, no tool executed twice
/// but idempotent ones cut mid-call, every history valid).
fn summary(
    h: &Harness,
    scenario: &str,
    reports: &[RunReport],
    total_runs: usize,
    requests_after: usize,
    began: Instant,
) {
    let mut ends: Vec<String> = Vec::new();
    for kind in TERMINAL {
        let n = reports.iter().filter(|r| r.terminal == kind).count();
        if n > 0 {
            ends.push(format!("{n} {}", kind.trim_start_matches("run_")));
        }
    }
    let mut per_marker: HashMap<String, usize> = HashMap::new();
    for execution in h.tools.executions().iter().filter(|e| e.tool == "idem") {
        *per_marker.entry(execution.marker.clone()).or_default() += 1;
    }
    let idempotent_reruns: usize = per_marker.values().map(|n| n.saturating_sub(1)).sum();
    println!(
        "\ncrash matrix | {:<8} | {scenario:<44} | {} runs ({total_runs} listed): {}, 0 left \
         running | {} events ({} seen before the stop), 0 lost, 0 duplicated | {} run_resumed | \
         {} tool executions, none twice but {idempotent_reruns} idempotent re-run(s) | histories \
         valid, {requests_after} model requests after the restart valid | {:.1} s",
        format!("{:?}", h.backend),
        reports.len(),
        ends.join(", "),
        reports.iter().map(|r| r.events).sum::<usize>(),
        reports.iter().map(|r| r.seen_before_kill).sum::<usize>(),
        reports.iter().map(|r| r.resumes).sum::<usize>(),
        reports.iter().map(|r| r.tools_executed).sum::<usize>(),
        began.elapsed().as_secs_f64()
    );
}

fn message_text(message: &Value) -> String {
    message["content"]
        .as_array()
        .map(|parts| {
            parts
                .iter()
                .map(|p| match p["type"].as_str() {
                    Some("text") => p["text"].as_str().unwrap_or_default().to_owned(),
                    _ => p["value"].to_string(),
                })
                .collect::<Vec<_>>()
                .join("")
        })
        .unwrap_or_default()
}

/// Checks one run after the restart: its end, its log against what the watcher saw before the
/// kill and what a reconnecting watcher gets, its history, its output and its tools.
async fn verify_run(
    h: &Harness,
    server: &ServerProcess,
    run: &Tracked,
    before: &[Frame],
    recovery: Recovery,
) -> RunReport {
    let what = format!("run {} ({})", run.plan.tag, run.run_id);
    // A watcher reconnecting to the new process where it left off.
    let reconnect = Watcher::start(server, &run.run_id, before.last().map(Frame::sequence));
    let (after, ended) = reconnect.finish(WAIT, &what).await;
    assert_eq!(ended, Ok(()), "{what}: the reconnected watch ended cleanly");
    assert!(
        after
            .last()
            .is_some_and(|f| TERMINAL.contains(&f.event.as_str())),
        "{what}: the reconnected watch ends with the terminal event: {:?}",
        kinds(&after)
    );
    // The whole log, read again.
    let (full, ended) = Watcher::start(server, &run.run_id, None)
        .finish(Duration::from_secs(20), &what)
        .await;
    assert_eq!(ended, Ok(()), "{what}: full read");
    for (index, frame) in full.iter().enumerate() {
        assert_eq!(
            frame.sequence(),
            index as u64 + 1,
            "{what}: the log is contiguous from 1: {:?}",
            kinds(&full)
        );
    }
    let terminals: Vec<usize> = full
        .iter()
        .enumerate()
        .filter(|(_, f)| TERMINAL.contains(&f.event.as_str()))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(
        terminals,
        vec![full.len() - 1],
        "{what}: exactly one terminal event, last: {:?}",
        kinds(&full)
    );
    assert!(
        full.starts_with(before),
        "{what}: the prefix seen before the kill is unchanged\nbefore: {before:#?}\nnow: {:#?}",
        &full[..before.len().min(full.len())]
    );
    let joined: Vec<Frame> = before.iter().chain(after.iter()).cloned().collect();
    assert!(
        joined == full,
        "{what}: (frames before the kill) ++ (frames after reconnecting) == the log\nbefore: {:?}\nafter: {:?}\nlog: {:?}",
        kinds(before),
        kinds(&after),
        kinds(&full)
    );
    let started: Vec<usize> = full
        .iter()
        .enumerate()
        .filter(|(_, f)| f.event == "run_started")
        .map(|(i, _)| i)
        .collect();
    assert_eq!(
        started,
        vec![0],
        "{what}: one run_started, first: {:?}",
        kinds(&full)
    );
    let resumes = check_resume_markers(&what, &full);
    let last = full.last().expect("terminal").json();
    match recovery {
        Recovery::Resume => assert_eq!(
            full.last().map(|f| f.event.as_str()),
            Some("run_completed"),
            "{what}: resumed runs complete: {last}"
        ),
        Recovery::Fail => {
            assert_eq!(
                full.last().map(|f| f.event.as_str()),
                Some("run_failed"),
                "{what}: {last}"
            );
            assert_eq!(last["error_class"], "interrupted", "{what}: {last}");
        }
    }

    // Per call: at most one execution started, exactly one result.
    let mut per_call: HashMap<String, (usize, usize)> = HashMap::new();
    for frame in &full {
        let counter = match frame.event.as_str() {
            "tool_execution_started" => 0,
            "tool_execution_finished" => 1,
            _ => continue,
        };
        let call = frame.json()["call_id"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let entry = per_call.entry(call).or_default();
        if counter == 0 {
            entry.0 += 1;
        } else {
            entry.1 += 1;
        }
    }
    for (call, (started, finished)) in &per_call {
        assert!(
            *started <= 1 && *finished == 1,
            "{what}: call {call}: {started} tool_execution_started, {finished} \
             tool_execution_finished: {:?}",
            kinds(&full)
        );
    }

    // The run record.
    let record = server.get_json(&format!("/runs/{}", run.run_id)).await;
    let status = match recovery {
        Recovery::Resume => "completed",
        Recovery::Fail => "failed",
    };
    assert_eq!(record["status"], status, "{what}: {record}");

    // The session history.
    let history = server
        .get_json(&format!("/sessions/{}/messages", run.session_id))
        .await;
    assert!(
        history["next_cursor"].is_null(),
        "{what}: one page: {history}"
    );
    let messages = history["messages"].as_array().expect("messages").clone();
    let users: Vec<String> = messages
        .iter()
        .filter(|m| m["role"] == "user")
        .map(message_text)
        .collect();
    assert_eq!(
        users,
        vec![run.plan.input.clone()],
        "{what}: the input stored once"
    );
    let mut calls: Vec<(String, String, String)> = Vec::new(); // (id, tool, marker)
    for (index, message) in messages.iter().enumerate() {
        // A resumed run drops the text of the call the kill cut off; a run that ends there
        // (`recovery = "fail"`) keeps it, marked incomplete.
        assert!(
            !message_text(message).contains(ABANDONED)
                || (recovery == Recovery::Fail && message["status"] == "incomplete"),
            "{what}: no abandoned text in the history: {message}"
        );
        if message["role"] == "tool" {
            let id = message["tool_call_id"].as_str().unwrap_or_default();
            let asked_before = messages[..index].iter().any(|m| {
                m["role"] == "assistant"
                    && m["tool_calls"]
                        .as_array()
                        .is_some_and(|c| c.iter().any(|c| c["id"] == id))
            });
            assert!(
                asked_before,
                "{what}: tool message {id} answers an earlier call"
            );
        }
        for call in message["tool_calls"].as_array().into_iter().flatten() {
            calls.push((
                call["id"].as_str().unwrap_or_default().to_owned(),
                call["name"].as_str().unwrap_or_default().to_owned(),
                call["arguments"]["marker"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            ));
        }
    }
    let mut ids: Vec<&str> = calls.iter().map(|(id, _, _)| id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(
        ids.len(),
        calls.len(),
        "{what}: each tool call is stored once: {calls:?}"
    );
    let assistants = messages.iter().filter(|m| m["role"] == "assistant").count();
    let committed = full
        .iter()
        .filter(|f| f.event == "assistant_message_committed")
        .count();
    assert_eq!(
        assistants, committed,
        "{what}: one stored assistant message per assistant_message_committed"
    );
    let mut tools_executed = 0;
    for (id, tool, marker) in &calls {
        let answers: Vec<String> = messages
            .iter()
            .filter(|m| m["role"] == "tool" && m["tool_call_id"] == id.as_str())
            .map(message_text)
            .collect();
        assert_eq!(
            answers.len(),
            1,
            "{what}: call {id} answered exactly once: {answers:?}"
        );
        let answer = &answers[0];
        let executions = h.tools.count(marker);
        tools_executed += executions;
        let real = answer.contains(&format!("{tool} result for {marker}"));
        if tool == "idem" {
            if recovery == Recovery::Resume {
                assert!(
                    real && executions >= 1,
                    "{what}: idempotent call {id} has its real result ({executions} executions): {answer}"
                );
            }
        } else {
            assert!(
                executions <= 1,
                "{what}: call {id} ({tool}) executed {executions} times"
            );
            if real {
                assert_eq!(executions, 1, "{what}: call {id} has a result, so it ran");
            } else if executions == 1 {
                assert!(
                    answer.contains("interrupted"),
                    "{what}: call {id} began before the kill and has no result: its answer \
                     says interrupted: {answer}"
                );
            }
        }
    }
    // Every executed marker of this run belongs to a call of its history.
    for execution in h.tools.executions() {
        if execution.marker.starts_with(&format!("{}/", run.plan.tag)) {
            assert!(
                calls.iter().any(|(_, _, m)| *m == execution.marker),
                "{what}: executed {execution:?} belongs to a stored call: {calls:?}"
            );
        }
    }

    // The output.
    let (status, output) = server.get(&format!("/runs/{}/output", run.run_id)).await;
    assert_eq!(status, 200, "{what}: output: {output}");
    let cut_off_kept = output["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m.to_string().contains(ABANDONED))
        .all(|m| recovery == Recovery::Fail && m["status"] == "incomplete");
    let streamed_cut_off = full
        .iter()
        .any(|f| f.event == "text_delta" && f.data.contains(ABANDONED));
    if recovery == Recovery::Fail && streamed_cut_off {
        assert!(
            output["messages"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|m| { m["status"] == "incomplete" && m.to_string().contains(ABANDONED) }),
            "{what}: the text streamed before the kill is kept, incomplete: {output}"
        );
    }
    assert!(
        cut_off_kept,
        "{what}: the output never contains abandoned text (but an interrupted run's cut-off text, \
         marked incomplete): {output}"
    );
    if recovery == Recovery::Resume {
        assert!(
            output.to_string().contains(&run.plan.final_text()),
            "{what}: the output has the final answer: {output}"
        );
    }
    RunReport {
        events: full.len(),
        seen_before_kill: before.len(),
        resumes,
        tools_executed,
        terminal: full.last().map(|f| f.event.clone()).unwrap_or_default(),
    }
}

/// Every `run_resumed` of a log: `abandoned_after` is the sequence of the last `model_started`
/// before it when that call's assistant message was not committed (and the call is made again
/// with a `model_started` of the same iteration), else null. Returns how many there are.
fn check_resume_markers(what: &str, full: &[Frame]) -> usize {
    let mut resumed = 0;
    for (at, frame) in full.iter().enumerate() {
        if frame.event != "run_resumed" {
            continue;
        }
        resumed += 1;
        let payload = frame.json();
        assert!(
            at > 0,
            "{what}: run_resumed continues a log: {:?}",
            kinds(full)
        );
        if let Some(next) = full[at..].iter().find(|f| f.event == "model_started") {
            assert_eq!(
                next.json()["iteration"],
                payload["iteration"],
                "{what}: the next model_started has run_resumed's iteration: {:?}",
                kinds(full)
            );
        }
        let cut = full[..at]
            .iter()
            .rposition(|f| f.event == "model_started")
            .filter(|&m| {
                !full[m..at]
                    .iter()
                    .any(|f| f.event == "assistant_message_committed")
            });
        match cut {
            Some(m) => {
                assert_eq!(
                    payload["abandoned_after"],
                    json!(full[m].sequence()),
                    "{what}: run_resumed names the cut model_started: {:?}",
                    kinds(full)
                );
                let again = full[at..]
                    .iter()
                    .find(|f| f.event == "model_started")
                    .unwrap_or_else(|| panic!("{what}: the cut call is made again"));
                assert_eq!(
                    again.json()["iteration"],
                    full[m].json()["iteration"],
                    "{what}: the call is made again at the same iteration"
                );
            }
            None => assert!(
                payload["abandoned_after"].is_null(),
                "{what}: nothing was cut, abandoned_after is null: {payload}"
            ),
        }
    }
    resumed
}

/// No run of the server is left non-terminal.
async fn assert_none_running(server: &ServerProcess) -> usize {
    let page = server.get_json("/runs?limit=200").await;
    let runs = page["runs"].as_array().expect("runs").clone();
    let open: Vec<&Value> = runs
        .iter()
        .filter(|r| {
            !["completed", "failed", "cancelled"].contains(&r["status"].as_str().unwrap_or(""))
        })
        .collect();
    assert!(open.is_empty(), "runs left non-terminal: {open:?}");
    runs.len()
}

/// The requests the fake got after the restart are valid OpenAI requests that send the
/// history once: one user message (each run has its own session), each tool call once, each
/// tool result once.
fn assert_valid_requests(fake: &FakeOpenAi, from: usize) -> usize {
    let requests = fake.requests();
    for request in &requests[from..] {
        let violations = validate_openai_request(&request.body);
        assert!(
            violations.is_empty(),
            "a request after the restart breaks OpenAI's rules: {violations:?}\n{}",
            request.body
        );
        let messages = request.body["messages"].as_array().expect("messages");
        let users = messages.iter().filter(|m| m["role"] == "user").count();
        assert_eq!(users, 1, "the input is sent once: {}", request.body);
        let mut calls: Vec<&str> = messages
            .iter()
            .flat_map(|m| m["tool_calls"].as_array().into_iter().flatten())
            .filter_map(|c| c["id"].as_str())
            .collect();
        let mut answers: Vec<&str> = messages
            .iter()
            .filter_map(|m| m["tool_call_id"].as_str())
            .collect();
        let (n_calls, n_answers) = (calls.len(), answers.len());
        calls.sort_unstable();
        calls.dedup();
        answers.sort_unstable();
        answers.dedup();
        assert!(
            calls.len() == n_calls && answers.len() == n_answers,
            "each tool call and each result is sent once: {}",
            request.body
        );
    }
    requests.len() - from
}

// ---------------------------------------------------------------------------------------------
// The scenarios

fn plans_for(point: KillPoint) -> Vec<Plan> {
    use Step::{Text, Tools};
    let p = match point {
        KillPoint::AfterCreate => "a",
        KillPoint::MidStream => "b",
        KillPoint::BetweenIterations => "c",
        KillPoint::MidTool => "d",
        KillPoint::AfterToolResult => "e",
    };
    let tag = |n: u32| format!("{p}{n}");
    match point {
        KillPoint::AfterCreate => (1..=3)
            .map(|n| {
                Plan::new(
                    &tag(n),
                    vec![Tools(vec![("quick", 0)]), Tools(vec![("quick", 0)]), Text],
                    Some((1, Hold::Stall)),
                )
            })
            .collect(),
        KillPoint::MidStream => vec![
            Plan::new(&tag(1), vec![Text], Some((0, Hold::CutText))),
            Plan::new(
                &tag(2),
                vec![Tools(vec![("quick", 0)]), Text],
                Some((1, Hold::CutText)),
            ),
            Plan::new(
                &tag(3),
                vec![
                    Tools(vec![("quick", 0), ("quick", 0)]),
                    Tools(vec![("quick", 0)]),
                    Text,
                ],
                Some((2, Hold::CutText)),
            ),
        ],
        KillPoint::BetweenIterations => vec![
            Plan::new(
                &tag(1),
                vec![Tools(vec![("quick", 0)]), Text],
                Some((1, Hold::Stall)),
            ),
            Plan::new(
                &tag(2),
                vec![
                    Tools(vec![("quick", 0), ("quick", 0)]),
                    Tools(vec![("quick", 0)]),
                    Text,
                ],
                Some((1, Hold::Stall)),
            ),
        ],
        KillPoint::MidTool => vec![
            Plan::new(
                &tag(1),
                vec![Tools(vec![("slow", HELD_TOOL_MS)]), Text],
                None,
            ),
            Plan::new(
                &tag(2),
                vec![Tools(vec![("idem", HELD_TOOL_MS)]), Text],
                None,
            ),
            Plan::new(
                &tag(3),
                vec![
                    Tools(vec![("quick", 0)]),
                    Tools(vec![("slow", HELD_TOOL_MS), ("idem", HELD_TOOL_MS)]),
                    Text,
                ],
                None,
            ),
        ],
        KillPoint::AfterToolResult => vec![
            Plan::new(
                &tag(1),
                vec![Tools(vec![("quick", 0)]), Tools(vec![("quick", 0)]), Text],
                Some((1, Hold::Stall)),
            ),
            Plan::new(
                &tag(2),
                vec![Tools(vec![("quick", 0), ("idem", HELD_TOOL_MS)]), Text],
                None,
            ),
        ],
    }
}

/// Starts a server, starts the runs of `point`, SIGKILLs it at the point, restarts it on the
/// same database (with `recovery`), and checks everything.
async fn crash_at(backend: Backend, point: KillPoint, recovery: Recovery) {
    let Some(h) = Harness::new(backend).await else {
        return;
    };
    let began = Instant::now();
    let mut first = h.server("first", "").await;
    let plans = plans_for(point);
    let (runs, watchers): (Vec<Tracked>, Vec<Watcher>) =
        futures::future::join_all(plans.into_iter().map(|plan| h.start_run(&first, plan)))
            .await
            .into_iter()
            .unzip();
    wait_until(&format!("{point:?} in every run"), WAIT, || {
        runs.iter()
            .zip(&watchers)
            .all(|(run, watcher)| reached(point, run, watcher, &h.tools))
    })
    .await;
    first.kill().await;
    let executions_at_kill = h.tools.executions();
    h.generation.store(2, Ordering::SeqCst);
    h.tools.release();
    let requests_before = h.fake.requests().len();

    // What each watcher saw before the kill (its stream breaks with the process).
    let mut seen = Vec::new();
    for (run, watcher) in runs.iter().zip(watchers) {
        let (frames, _) = watcher.finish(Duration::from_secs(10), &run.plan.tag).await;
        seen.push(frames);
    }
    if point == KillPoint::MidTool {
        for run in &runs {
            for (_, marker, _) in run.plan.held_calls() {
                let cut = executions_at_kill.iter().filter(|e| e.marker == marker);
                assert!(
                    cut.clone().count() == 1 && cut.clone().all(|e| !e.finished),
                    "the kill came while {marker} was executing: {executions_at_kill:?}"
                );
            }
        }
    }

    let extra = match recovery {
        Recovery::Resume => "",
        Recovery::Fail => "recovery = \"fail\"",
    };
    let second = h.server("restarted", extra).await;
    let mut reports = Vec::new();
    for (run, before) in runs.iter().zip(&seen) {
        let report = verify_run(&h, &second, run, before, recovery).await;
        reports.push(report);
    }
    // Scenario-specific promises.
    for (run, before) in runs.iter().zip(&seen) {
        let (full, _) = Watcher::start(&second, &run.run_id, None)
            .finish(Duration::from_secs(20), &run.plan.tag)
            .await;
        match (point, recovery) {
            (KillPoint::MidStream, Recovery::Resume) => {
                let cut = before
                    .iter()
                    .rev()
                    .find(|f| f.event == "model_started")
                    .expect("the watcher saw the cut model_started");
                let resumed = full
                    .iter()
                    .find(|f| f.event == "run_resumed")
                    .unwrap_or_else(|| panic!("{}: run_resumed: {:?}", run.plan.tag, kinds(&full)))
                    .json();
                assert_eq!(
                    resumed["abandoned_after"],
                    json!(cut.sequence()),
                    "{}: abandoned_after names the model_started whose text the watcher saw",
                    run.plan.tag
                );
            }
            (KillPoint::MidTool, Recovery::Resume) => {
                for (tool, marker, call_id) in run.plan.held_calls() {
                    let executions = h.tools.count(&marker);
                    if tool == "idem" {
                        assert_eq!(
                            executions, 2,
                            "{marker}: an idempotent tool cut mid-call runs again"
                        );
                        let keys: Vec<Option<String>> = h
                            .tools
                            .executions()
                            .into_iter()
                            .filter(|e| e.marker == marker)
                            .map(|e| e.idempotency_key)
                            .collect();
                        let key = format!("{}:{call_id}", run.run_id);
                        assert_eq!(
                            keys,
                            vec![Some(key.clone()), Some(key)],
                            "{marker}: both executions carry the call's idempotency key"
                        );
                    } else {
                        assert_eq!(
                            executions, 1,
                            "{marker}: a tool cut mid-call never runs again"
                        );
                        let finished = full
                            .iter()
                            .filter(|f| f.event == "tool_execution_finished")
                            .map(Frame::json)
                            .find(|f| f["call_id"] == call_id.as_str())
                            .unwrap_or_else(|| panic!("{marker}: its result"));
                        assert!(
                            finished["result"]["Failure"]["error"]
                                .as_str()
                                .is_some_and(|e| e.contains("interrupted")),
                            "{marker}: the cut call's result says interrupted: {finished}"
                        );
                    }
                }
            }
            _ => {}
        }
    }
    let total_runs = assert_none_running(&second).await;
    let requests_after = assert_valid_requests(&h.fake, requests_before);
    let non_idempotent_twice: Vec<_> = {
        let executions = h.tools.executions();
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for e in executions.iter().filter(|e| e.tool != "idem") {
            *counts.entry(e.marker.as_str()).or_default() += 1;
        }
        counts
            .into_iter()
            .filter(|(_, n)| *n > 1)
            .map(|(m, n)| format!("{m}×{n}"))
            .collect()
    };
    assert!(
        non_idempotent_twice.is_empty(),
        "tools executed twice: {non_idempotent_twice:?}"
    );
    let scenario = match recovery {
        Recovery::Resume => format!("SIGKILL {point:?}"),
        Recovery::Fail => format!("SIGKILL {point:?}, recovery = fail"),
    };
    summary(&h, &scenario, &reports, total_runs, requests_after, began);
    drop(second);
    drop(first);
    h.cleanup().await;
}

async fn kill_after_create(backend: Backend) {
    crash_at(backend, KillPoint::AfterCreate, Recovery::Resume).await;
}

async fn kill_mid_model_stream(backend: Backend) {
    crash_at(backend, KillPoint::MidStream, Recovery::Resume).await;
}

async fn kill_between_iterations(backend: Backend) {
    crash_at(backend, KillPoint::BetweenIterations, Recovery::Resume).await;
}

async fn kill_mid_tool(backend: Backend) {
    crash_at(backend, KillPoint::MidTool, Recovery::Resume).await;
}

async fn kill_after_tool_result(backend: Backend) {
    crash_at(backend, KillPoint::AfterToolResult, Recovery::Resume).await;
}

async fn recovery_fail_mid_model_stream(backend: Backend) {
    crash_at(backend, KillPoint::MidStream, Recovery::Fail).await;
}

async fn recovery_fail_mid_tool(backend: Backend) {
    crash_at(backend, KillPoint::MidTool, Recovery::Fail).await;
}

/// Polls `/readyz` after a SIGTERM until it answers 503 (at most 2 s): the listener must stay
/// open during the drain. Returns the problem body. The drain closes idle kept-alive
/// connections, so a request sent on one just then fails; the next (a new connection) must be
/// answered.
async fn readyz_while_draining(server: &ServerProcess) -> Value {
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut failed_in_a_row = 0;
    loop {
        match server.try_get("/readyz").await {
            Ok((503, body)) => return body,
            Ok((status, body)) => {
                failed_in_a_row = 0;
                assert!(
                    Instant::now() < deadline,
                    "/readyz still answers {status} 2 s after SIGTERM: {body}"
                );
            }
            Err(error) => {
                failed_in_a_row += 1;
                assert!(
                    failed_in_a_row < 3,
                    "the listener closed at SIGTERM (GET /readyz: {error}); it must stay open \
                     during the drain"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// SIGTERM with a run mid model stream (its reply held) and one mid tool (a 1 s tool): the
/// listener stays open during the drain (a `GET` answers, `POST /runs` and `/readyz` answer 503
/// `shutting_down`), the process exits by itself after the grace, both runs are left
/// non-terminal, the watchers' streams end cleanly without a terminal event, and after a
/// restart both resume and complete (the tool ran once).
async fn sigterm_mid_stream_then_resume(backend: Backend) {
    const GRACE_MS: u64 = 3_000;
    let Some(h) = Harness::new(backend).await else {
        return;
    };
    let started = Instant::now();
    let runtime = format!("shutdown_grace_ms = {GRACE_MS}");
    let mut first = h.server("first", &runtime).await;
    let streaming = Plan::new(
        "t1",
        vec![Step::Tools(vec![("quick", 0)]), Step::Text],
        Some((1, Hold::CutText)),
    );
    let tooling = Plan::new(
        "t2",
        vec![Step::Tools(vec![("slow", 1_000)]), Step::Text],
        None,
    );
    let tool_marker = tooling.marker(0, 0);
    let (runs, watchers): (Vec<Tracked>, Vec<Watcher>) =
        futures::future::join_all([streaming, tooling].map(|plan| h.start_run(&first, plan)))
            .await
            .into_iter()
            .unzip();
    wait_until(
        "a text_delta of the held stream, and the slow tool running",
        WAIT,
        || watchers[0].saw("text_delta") > 0 && h.tools.count(&tool_marker) > 0,
    )
    .await;
    let began = Instant::now();
    first.terminate().await;
    // The drain: the listener answers.
    let readyz = readyz_while_draining(&first).await;
    assert_eq!(readyz["code"], "shutting_down", "{readyz}");
    let (status, record) = first.get(&format!("/runs/{}", runs[0].run_id)).await;
    assert_eq!(status, 200, "a GET during the drain answers: {record}");
    let (status, retry_after, problem) = first
        .post(
            "/runs",
            &json!({"provider": "fake", "model": "fake-model", "input": "too late"}),
        )
        .await;
    assert_eq!(status, 503, "POST /runs during the drain: {problem}");
    assert_eq!(problem["code"], "shutting_down", "{problem}");
    assert!(retry_after.is_some(), "503 shutting_down has Retry-After");
    // A drain's 503s are "not now", not errors of the server.
    let log = first.log();
    assert!(
        !log.lines()
            .any(|line| line.contains("ERROR") && line.contains("503")),
        "a 503 of the drain is logged at ERROR:\n{log}"
    );
    let exit = first
        .wait_exit(Duration::from_millis(GRACE_MS) + Duration::from_secs(10))
        .await;
    assert!(exit.is_some(), "the server exits by itself after the grace");
    let exit_code = exit.and_then(|status| status.code());
    let exited_after = began.elapsed();
    let mut seen = Vec::new();
    for (run, watcher) in runs.iter().zip(watchers) {
        let (before, ended) = watcher.finish(Duration::from_secs(10), &run.plan.tag).await;
        assert_eq!(
            ended,
            Ok(()),
            "{}: the SSE stream ended cleanly at shutdown: {:?}",
            run.plan.tag,
            kinds(&before)
        );
        assert!(
            before.iter().all(|f| !TERMINAL.contains(&f.event.as_str())),
            "{}: no terminal event at shutdown: {:?}",
            run.plan.tag,
            kinds(&before)
        );
        seen.push(before);
    }
    {
        let store = h.db.store().await;
        for run in &runs {
            let id = run.run_id.parse().expect("run id");
            let record = store.get_run(id).await.expect("read run").expect("run");
            assert!(
                !record.status.is_terminal(),
                "{}: the run is left non-terminal: {record:?}",
                run.plan.tag
            );
        }
    }
    h.generation.store(2, Ordering::SeqCst);
    let requests_before = h.fake.requests().len();
    let second = h.server("restarted", "").await;
    let mut reports = Vec::new();
    for (run, before) in runs.iter().zip(&seen) {
        let report = verify_run(&h, &second, run, before, Recovery::Resume).await;
        assert_eq!(report.resumes, 1, "{}: the run was resumed", run.plan.tag);
        reports.push(report);
    }
    assert_eq!(h.tools.count(&tool_marker), 1, "the slow tool ran once");
    let total_runs = assert_none_running(&second).await;
    let requests_after = assert_valid_requests(&h.fake, requests_before);
    summary(
        &h,
        &format!(
            "SIGTERM mid stream + mid tool (exit {exit_code:?} after {:.1} s)",
            exited_after.as_secs_f64()
        ),
        &reports,
        total_runs,
        requests_after,
        started,
    );
    drop(second);
    drop(first);
    h.cleanup().await;
}

/// Two crashes in a row: SIGKILL mid stream, restart, SIGKILL of the resumed runs (one mid
/// stream again, one mid tool), restart: each run ends with two `run_resumed` in one log, and
/// a watcher that follows it across both restarts (reconnecting with `Last-Event-ID`) sees
/// every event exactly once.
async fn crash_twice(backend: Backend) {
    use Step::{Text, Tools};
    let Some(h) = Harness::new(backend).await else {
        return;
    };
    let began = Instant::now();
    let plans = vec![
        Plan::new(
            "x1",
            vec![Tools(vec![("quick", 0)]), Tools(vec![("quick", 0)]), Text],
            Some((1, Hold::CutText)),
        )
        .hold_in(2, 2, Hold::CutText),
        Plan::new(
            "x2",
            vec![
                Tools(vec![("quick", 0)]),
                Tools(vec![("slow", HELD_TOOL_MS)]),
                Text,
            ],
            Some((1, Hold::CutText)),
        ),
    ];
    let slow_marker = plans[1].marker(1, 0);
    let mut first = h.server("first", "").await;
    let (runs, watchers): (Vec<Tracked>, Vec<Watcher>) =
        futures::future::join_all(plans.into_iter().map(|plan| h.start_run(&first, plan)))
            .await
            .into_iter()
            .unzip();
    wait_until("a text_delta in every run", WAIT, || {
        watchers.iter().all(|w| w.saw("text_delta") > 0)
    })
    .await;
    first.kill().await;
    h.generation.store(2, Ordering::SeqCst);
    let mut seen = Vec::new();
    for (run, watcher) in runs.iter().zip(watchers) {
        seen.push(
            watcher
                .finish(Duration::from_secs(10), &run.plan.tag)
                .await
                .0,
        );
    }

    let mut second = h.server("restarted once", "").await;
    let watchers: Vec<Watcher> = runs
        .iter()
        .zip(&seen)
        .map(|(run, before)| {
            Watcher::start(&second, &run.run_id, before.last().map(Frame::sequence))
        })
        .collect();
    // Each watcher has read its run's `run_resumed` too: a watcher that connected before this
    // process took its run over polls the store, and the kill must not come before its poll.
    wait_until(
        "x1 streaming its last reply and x2 in its slow tool, after the resume",
        WAIT,
        || {
            watchers[0].saw("text_delta") > 0
                && h.tools.count(&slow_marker) > 0
                && watchers.iter().all(|w| w.saw("run_resumed") > 0)
        },
    )
    .await;
    second.kill().await;
    let executions_at_kill = h.tools.executions();
    h.generation.store(3, Ordering::SeqCst);
    h.tools.release();
    assert!(
        executions_at_kill
            .iter()
            .any(|e| e.marker == slow_marker && !e.finished),
        "the second kill came while {slow_marker} was executing: {executions_at_kill:?}"
    );
    let requests_before = h.fake.requests().len();
    for ((run, watcher), before) in runs.iter().zip(watchers).zip(&mut seen) {
        let (frames, _) = watcher.finish(Duration::from_secs(10), &run.plan.tag).await;
        assert!(
            frames.iter().any(|f| f.event == "run_resumed"),
            "{}: the watcher of the second process saw the run resume: {:?}",
            run.plan.tag,
            kinds(&frames)
        );
        before.extend(frames);
    }

    let third = h.server("restarted twice", "").await;
    let mut reports = Vec::new();
    for (run, before) in runs.iter().zip(&seen) {
        let report = verify_run(&h, &third, run, before, Recovery::Resume).await;
        assert_eq!(report.resumes, 2, "{}: resumed twice", run.plan.tag);
        reports.push(report);
    }
    assert_eq!(
        h.tools.count(&slow_marker),
        1,
        "the cut slow tool never runs again"
    );
    let total_runs = assert_none_running(&third).await;
    let requests_after = assert_valid_requests(&h.fake, requests_before);
    summary(
        &h,
        "SIGKILL twice (mid stream; mid stream + tool)",
        &reports,
        total_runs,
        requests_after,
        began,
    );
    drop(third);
    drop(second);
    drop(first);
    h.cleanup().await;
}

/// A second SIGTERM during the drain exits at once (the grace is long); the run mid stream is
/// left non-terminal and resumes after a restart.
async fn second_sigterm_exits_at_once(backend: Backend) {
    let Some(h) = Harness::new(backend).await else {
        return;
    };
    let started = Instant::now();
    let mut first = h.server("first", "shutdown_grace_ms = 600000").await;
    let plan = Plan::new(
        "u1",
        vec![Step::Tools(vec![("quick", 0)]), Step::Text],
        Some((1, Hold::CutText)),
    );
    let (run, watcher) = h.start_run(&first, plan).await;
    wait_until("a text_delta of the held stream", WAIT, || {
        watcher.saw("text_delta") > 0
    })
    .await;
    first.terminate().await;
    readyz_while_draining(&first).await;
    first.terminate().await;
    let exit = first.wait_exit(Duration::from_secs(20)).await;
    assert!(
        exit.is_some(),
        "a second SIGTERM exits at once, not after the 600 s grace"
    );
    let exit_code = exit.and_then(|status| status.code());
    let (before, _) = watcher.finish(Duration::from_secs(10), "u1").await;
    assert!(
        before.iter().all(|f| !TERMINAL.contains(&f.event.as_str())),
        "no terminal event: {:?}",
        kinds(&before)
    );
    h.generation.store(2, Ordering::SeqCst);
    let requests_before = h.fake.requests().len();
    let second = h.server("restarted", "").await;
    let report = verify_run(&h, &second, &run, &before, Recovery::Resume).await;
    assert_eq!(report.resumes, 1, "the run was resumed");
    let total_runs = assert_none_running(&second).await;
    let requests_after = assert_valid_requests(&h.fake, requests_before);
    summary(
        &h,
        &format!("SIGTERM twice mid stream (exit {exit_code:?})"),
        &[report],
        total_runs,
        requests_after,
        started,
    );
    drop(second);
    drop(first);
    h.cleanup().await;
}

on_both_backends!(
    kill_after_create,
    kill_mid_model_stream,
    kill_between_iterations,
    kill_mid_tool,
    kill_after_tool_result,
    recovery_fail_mid_model_stream,
    recovery_fail_mid_tool,
    crash_twice,
    sigterm_mid_stream_then_resume,
    second_sigterm_exits_at_once,
);
