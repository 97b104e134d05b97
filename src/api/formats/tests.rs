//! The folds on hand-written logs: a replay equals the live rendering byte for byte, and a
//! resume at every frame id (inside multi-frame events too) gives exactly the rest, after an
//! AG-UI prelude that a fresh verifier accepts.

#![allow(clippy::unwrap_used, clippy::panic, reason = "tests")]

use std::collections::HashSet;

use chrono::Utc;
use serde_json::{Value, json};

use super::*;
use crate::domain::{
    FinishReason, PendingToolCall, RequiredAction, SessionId, TokenUsage, ToolCall,
};
use crate::events::{
    ContextBuilt, MessageCommitted, ModelStarted, ReasoningDelta, RunCompleted, RunResumed,
    RunStarted, TextDelta, ToolCallCompleted, ToolCallDelta, ToolCallStarted,
    ToolExecutionFinished, ToolExecutionResult, ToolExecutionStarted, ToolFailure,
    ToolMessageCommitted, ToolProgress, ToolSuccess, UsageRecorded,
};

struct Log {
    run: RunContext,
    session_id: SessionId,
    events: Vec<AgentEvent>,
}

impl Log {
    fn new() -> Self {
        let run_id = RunId::new();
        let session_id = SessionId::new();
        let mut log = Self {
            run: RunContext {
                run_id,
                thread_id: session_id.to_string(),
                ag_ui_run_id: run_id.to_string(),
                client_tools: HashSet::from(["get_location".to_owned()]),
                approval_tools: HashSet::from(["delete_file".to_owned()]),
            },
            session_id,
            events: Vec::new(),
        };
        log.push(EventPayload::RunStarted(RunStarted {
            session_id,
            provider: "demo".to_owned(),
            model: "demo".to_owned(),
        }));
        log.push(EventPayload::ContextBuilt(ContextBuilt {
            message_count: 1,
        }));
        log
    }

    fn push(&mut self, payload: EventPayload) {
        let sequence = self.events.len() as u64 + 1;
        self.events.push(AgentEvent {
            sequence,
            run_id: self.run.run_id,
            timestamp: Utc::now(),
            trace_id: String::new(),
            span_id: String::new(),
            payload,
        });
    }

    fn model(&mut self, iteration: u32) {
        self.push(EventPayload::ModelStarted(ModelStarted {
            provider: "demo".to_owned(),
            model: "demo".to_owned(),
            iteration,
            message_id: None,
        }));
    }

    /// A model call that announces the id of its assistant message; that id.
    fn model_with_id(&mut self, iteration: u32) -> crate::domain::MessageId {
        let id = crate::domain::MessageId::new();
        self.push(EventPayload::ModelStarted(ModelStarted {
            provider: "demo".to_owned(),
            model: "demo".to_owned(),
            iteration,
            message_id: Some(id),
        }));
        id
    }

    /// The sequence of the `n`th `model_started` (from 1).
    fn model_call(&self, n: usize) -> u64 {
        self.events
            .iter()
            .filter(|event| matches!(event.payload, EventPayload::ModelStarted(_)))
            .nth(n - 1)
            .unwrap()
            .sequence
    }

    fn decided(&mut self, id: &str, name: &str, approved: bool, reason: Option<&str>) {
        self.push(EventPayload::ToolApprovalDecided(
            crate::events::ToolApprovalDecided {
                call_id: id.to_owned(),
                tool_name: name.to_owned(),
                approved,
                reason: reason.map(str::to_owned),
                decided_by: Some("alice".to_owned()),
                api_key: Some(0),
            },
        ));
    }

    fn commit_as(&mut self, message_id: crate::domain::MessageId) {
        self.push(EventPayload::UsageRecorded(UsageRecorded {
            usage: TokenUsage::default(),
        }));
        self.push(EventPayload::AssistantMessageCommitted(MessageCommitted {
            message_id,
        }));
    }

    fn text(&mut self, text: &str) {
        self.push(EventPayload::TextDelta(TextDelta {
            delta: text.to_owned(),
        }));
    }

    fn call(&mut self, id: &str, name: &str, args: &[&str]) {
        self.push(EventPayload::ToolCallStarted(ToolCallStarted {
            call_id: id.to_owned(),
            tool_name: name.to_owned(),
        }));
        for piece in args {
            self.push(EventPayload::ToolCallDelta(ToolCallDelta {
                call_id: id.to_owned(),
                delta: (*piece).to_owned(),
            }));
        }
        self.push(EventPayload::ToolCallCompleted(ToolCallCompleted {
            call: ToolCall {
                id: id.to_owned(),
                name: name.to_owned(),
                arguments: serde_json::from_str(&args.concat()).unwrap_or(json!({})),
                invalid_arguments: None,
            },
        }));
    }

    fn end_call(&mut self) {
        self.push(EventPayload::UsageRecorded(UsageRecorded {
            usage: TokenUsage::default(),
        }));
        self.push(EventPayload::AssistantMessageCommitted(MessageCommitted {
            message_id: crate::domain::MessageId::new(),
        }));
    }

    fn execute(&mut self, id: &str, name: &str, result: ToolExecutionResult) {
        self.push(EventPayload::ToolExecutionStarted(ToolExecutionStarted {
            call_id: id.to_owned(),
            tool_name: name.to_owned(),
        }));
        self.answered(id, name, result);
    }

    /// An execution that reports progress twice before its result.
    fn execute_reporting(&mut self, id: &str, name: &str, result: ToolExecutionResult) {
        self.push(EventPayload::ToolExecutionStarted(ToolExecutionStarted {
            call_id: id.to_owned(),
            tool_name: name.to_owned(),
        }));
        for (progress, message) in [(1.0, None), (2.0, Some("almost".to_owned()))] {
            self.push(EventPayload::ToolProgress(ToolProgress {
                call_id: id.to_owned(),
                progress,
                total: Some(3.0),
                message,
            }));
        }
        self.answered(id, name, result);
    }

    fn answered(&mut self, id: &str, name: &str, result: ToolExecutionResult) {
        self.push(EventPayload::ToolExecutionFinished(ToolExecutionFinished {
            call_id: id.to_owned(),
            tool_name: name.to_owned(),
            result,
            duration_ms: 3,
        }));
        self.push(EventPayload::ToolMessageCommitted(ToolMessageCommitted {
            message_id: crate::domain::MessageId::new(),
            call_id: Some(id.to_owned()),
        }));
    }

    fn complete(&mut self, iterations: u32) {
        self.push(EventPayload::RunCompleted(RunCompleted {
            finish_reason: FinishReason::Stop,
            iterations,
            parsed: None,
        }));
    }

    fn pause(&mut self, id: &str, name: &str, kind: PendingKind) {
        self.push(EventPayload::ToolCallsRequired(RequiredAction {
            message_id: crate::domain::MessageId::new(),
            tool_calls: vec![PendingToolCall {
                call_id: id.to_owned(),
                tool_name: name.to_owned(),
                arguments: json!({}),
                kind,
            }],
            expires_at: Utc::now(),
        }));
    }
}

fn ok(output: Value) -> ToolExecutionResult {
    ToolExecutionResult::Success(ToolSuccess { output })
}

/// Reasoning, text, a server tool (the demo model's `call_1`), text again.
fn server_tool_run() -> Log {
    let mut log = Log::new();
    log.model(1);
    log.push(EventPayload::ReasoningDelta(ReasoningDelta {
        delta: "think".to_owned(),
    }));
    log.text("Let me ");
    log.text("check.");
    log.call("call_1", "get_time", &["{\"tz\":", "\"UTC\"}"]);
    log.end_call();
    log.execute_reporting("call_1", "get_time", ok(json!("12:00")));
    log.push(EventPayload::ContextBuilt(ContextBuilt {
        message_count: 3,
    }));
    log.model(2);
    log.text("It is ");
    log.text("noon.");
    log.call("call_1", "get_time", &["{}"]);
    log.end_call();
    log.execute(
        "call_1",
        "get_time",
        ToolExecutionResult::Failure(ToolFailure {
            error: "down".to_owned(),
        }),
    );
    log.model(3);
    log.text("Bye.");
    log.end_call();
    log.complete(3);
    log
}

/// A client tool, then an approval that is rejected; each pause is a segment.
fn paused_run() -> Log {
    let mut log = Log::new();
    log.model(1);
    log.call("call_1", "get_location", &["{}"]);
    log.end_call();
    log.pause("call_1", "get_location", PendingKind::ClientTool);
    log.answered("call_1", "get_location", ok(json!({"city": "Oslo"})));
    log.model(2);
    log.text("Deleting.");
    log.call("call_1", "delete_file", &["{\"path\":\"a\"}"]);
    log.end_call();
    log.pause("call_1", "delete_file", PendingKind::Approval);
    log.answered(
        "call_1",
        "delete_file",
        ToolExecutionResult::Failure(ToolFailure {
            error: "rejected by the user".to_owned(),
        }),
    );
    log.model(3);
    log.text("Not deleted.");
    log.end_call();
    log.complete(3);
    log
}

/// A call cut off by a crash and made again.
fn resumed_run() -> Log {
    let mut log = Log::new();
    log.model(1);
    log.text("Half a sen");
    log.push(EventPayload::RunResumed(RunResumed {
        iteration: 1,
        abandoned_after: Some(3),
    }));
    log.model(1);
    log.text("A whole sentence.");
    log.end_call();
    log.complete(1);
    log
}

/// Two approvals decided (one approved and executed, one rejected), with the ids the calls'
/// messages are stored with announced by their `model_started`.
fn decided_run() -> Log {
    let mut log = Log::new();
    let first = log.model_with_id(1);
    log.text("Deleting.");
    log.call("call_1", "delete_file", &["{\"path\":\"a\"}"]);
    log.call("call_2", "delete_file", &["{\"path\":\"b\"}"]);
    log.commit_as(first);
    log.push(EventPayload::ToolCallsRequired(RequiredAction {
        message_id: first,
        tool_calls: ["call_1", "call_2"]
            .map(|id| PendingToolCall {
                call_id: id.to_owned(),
                tool_name: "delete_file".to_owned(),
                arguments: json!({}),
                kind: PendingKind::Approval,
            })
            .to_vec(),
        expires_at: Utc::now(),
    }));
    log.decided("call_1", "delete_file", true, None);
    log.decided("call_2", "delete_file", false, Some("keep b"));
    log.execute("call_1", "delete_file", ok(json!("deleted")));
    log.answered(
        "call_2",
        "delete_file",
        ToolExecutionResult::Failure(ToolFailure {
            error: "rejected by the user: keep b".to_owned(),
        }),
    );
    let second = log.model_with_id(2);
    log.text("Deleted a only.");
    log.commit_as(second);
    log.complete(2);
    log
}

/// A call cut off by a crash after it began a tool call, made again: the provider says
/// `call_1` in both, in the same iteration.
fn resumed_tool_run() -> Log {
    let mut log = Log::new();
    log.model(1);
    log.text("Let me ");
    log.push(EventPayload::ToolCallStarted(ToolCallStarted {
        call_id: "call_1".to_owned(),
        tool_name: "get_time".to_owned(),
    }));
    log.push(EventPayload::ToolCallDelta(ToolCallDelta {
        call_id: "call_1".to_owned(),
        delta: "{\"tz\"".to_owned(),
    }));
    log.push(EventPayload::ToolCallCompleted(ToolCallCompleted {
        call: ToolCall {
            id: "call_1".to_owned(),
            name: "get_time".to_owned(),
            arguments: json!({}),
            invalid_arguments: Some("{\"tz\"".to_owned()),
        },
    }));
    log.push(EventPayload::RunResumed(RunResumed {
        iteration: 1,
        abandoned_after: Some(3),
    }));
    log.model(1);
    log.text("Checking.");
    log.call("call_1", "get_time", &["{}"]);
    log.end_call();
    log.execute("call_1", "get_time", ok(json!("12:00")));
    log.model(2);
    log.text("Noon.");
    log.end_call();
    log.complete(2);
    log
}

/// Every hand-written log of these tests.
fn every_log() -> [Log; 5] {
    [
        server_tool_run(),
        paused_run(),
        resumed_run(),
        decided_run(),
        resumed_tool_run(),
    ]
}

/// `(id, data)` of every frame rendered after `after`, up to the end of the response.
fn render<P: Projection>(
    projection: P,
    log: &Log,
    after: Option<Cursor>,
) -> Vec<(Option<String>, String)> {
    let mut renderer = Renderer::new(projection, after);
    let mut out = Vec::new();
    for event in &log.events {
        let rendered = renderer.render(event);
        out.extend(rendered.frames.iter().map(parse));
        if rendered.end {
            out.extend(renderer.done().iter().map(parse));
            break;
        }
    }
    out
}

fn parse(bytes: &Bytes) -> (Option<String>, String) {
    let text = std::str::from_utf8(bytes).unwrap();
    let body = text.strip_suffix("\n\n").unwrap();
    assert!(!body.contains('\r') && !body.contains("event:"), "{text}");
    let mut id = None;
    let mut data = None;
    for line in body.split('\n') {
        if let Some(rest) = line.strip_prefix("id: ") {
            id = Some(rest.to_owned());
        } else if let Some(rest) = line.strip_prefix("data: ") {
            assert!(data.is_none(), "one data line: {text}");
            data = Some(rest.to_owned());
        } else {
            panic!("unexpected line in {text}");
        }
    }
    (id, data.unwrap())
}

/// Every segment of a full rendering: from the start, then after each segment's last frame.
fn segments<P: Projection>(make: impl Fn() -> P, log: &Log) -> Vec<Vec<(Option<String>, String)>> {
    let mut all = Vec::new();
    let mut after = None;
    loop {
        let segment = render(make(), log, after);
        let last = segment.iter().rev().find_map(|(id, _)| id.clone());
        if segment.is_empty() {
            break;
        }
        all.push(segment);
        match last {
            Some(last) if last != log.events.len().to_string() => {
                after = Some(Cursor::parse(&last, true).unwrap());
            }
            _ => break,
        }
    }
    all
}

/// For every frame id of every segment: the resumed stream is the prelude (ids = the cursor)
/// then exactly the frames after it in that segment. `check` sees what a reader reads: with
/// `fresh`, a new reader per response (AG-UI's verifier); else one reader that kept its state
/// (the AI SDK's), fed everything before the cut, then the resumed stream.
fn every_cut_resumes_exactly<P: Projection>(
    make: impl Fn() -> P,
    log: &Log,
    fresh: bool,
    check: impl Fn(&[(Option<String>, String)]),
) -> usize {
    let mut cuts = 0;
    let mut history: Vec<(Option<String>, String)> = Vec::new();
    for segment in segments(&make, log) {
        if fresh {
            check(&segment);
        }
        // After a segment's last frame comes the next segment (checked as a whole).
        let last = segment.iter().rposition(|(id, _)| id.is_some()).unwrap();
        for (index, (id, _)) in segment.iter().enumerate().take(last) {
            let Some(id) = id else { continue };
            let cursor = Cursor::parse(id, true).unwrap();
            let resumed = render(make(), log, Some(cursor));
            let rest = &segment[index + 1..];
            let prelude = resumed.len() - rest.len();
            assert_eq!(&resumed[prelude..], rest, "resumed at {id}");
            assert!(
                resumed[..prelude]
                    .iter()
                    .all(|(pid, _)| pid.as_ref() == Some(id))
            );
            if fresh {
                check(&resumed);
            } else {
                let mut read = history.clone();
                read.extend_from_slice(&segment[..=index]);
                read.extend(resumed);
                check(&read);
            }
            cuts += 1;
        }
        history.extend(segment);
    }
    if !fresh {
        check(&history);
    }
    cuts
}

/// The rules `processUIMessageStream` enforces that a stream can break on its own: deltas and
/// ends need an open start with that id.
fn check_ai_sdk(frames: &[(Option<String>, String)]) {
    let mut open: HashSet<String> = HashSet::new();
    let mut tools: HashSet<String> = HashSet::new();
    for (_, data) in frames {
        if data == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        let kind = chunk["type"].as_str().unwrap();
        let id = chunk["id"].as_str().unwrap_or_default().to_owned();
        let call = chunk["toolCallId"].as_str().unwrap_or_default().to_owned();
        match kind {
            "text-start" | "reasoning-start" => assert!(open.insert(id), "{data}"),
            "text-delta" | "reasoning-delta" => assert!(open.contains(&id), "{data}"),
            "text-end" | "reasoning-end" => assert!(open.remove(&id), "{data}"),
            "tool-input-start" => {
                tools.insert(call);
            }
            "tool-input-delta" => assert!(tools.contains(&call), "{data}"),
            "tool-input-available" | "tool-input-error" => {
                tools.insert(call);
            }
            "tool-output-available"
            | "tool-output-error"
            | "tool-output-denied"
            | "tool-approval-request" => {
                assert!(tools.contains(&call), "{data}");
                assert!(split_tool_call_id(&call).is_some(), "{data}");
            }
            _ => {}
        }
    }
}

/// A fresh client's `verifyEvents` (the rules of `@ag-ui/client` 1.0 it could break):
/// `RUN_STARTED` first, starts for ids not open, contents and ends for open ones, nothing
/// open at `RUN_FINISHED`, nothing but `RUN_STARTED` after it.
fn check_ag_ui(frames: &[(Option<String>, String)]) {
    let mut running = false;
    let mut open: HashSet<(String, String)> = HashSet::new();
    for (index, (_, data)) in frames.iter().enumerate() {
        let event: Value = serde_json::from_str(data).unwrap();
        let kind = event["type"].as_str().unwrap().to_owned();
        if index == 0 {
            assert!(
                kind == "RUN_STARTED" || kind == "RUN_ERROR",
                "first: {data}"
            );
        }
        let key = |field: &str, family: &str| {
            (family.to_owned(), event[field].as_str().unwrap().to_owned())
        };
        match kind.as_str() {
            "RUN_STARTED" => {
                assert!(!running, "{data}");
                running = true;
            }
            "RUN_FINISHED" => {
                assert!(running && open.is_empty(), "{data} with {open:?}");
                running = false;
            }
            "RUN_ERROR" => running = false,
            _ => assert!(running, "{data} outside a run"),
        }
        let (family, field, action) = match kind.as_str() {
            "STEP_STARTED" => ("step", "stepName", 1),
            "STEP_FINISHED" => ("step", "stepName", -1),
            "TEXT_MESSAGE_START" => ("text", "messageId", 1),
            "TEXT_MESSAGE_CONTENT" => ("text", "messageId", 0),
            "TEXT_MESSAGE_END" => ("text", "messageId", -1),
            "REASONING_START" => ("span", "messageId", 1),
            "REASONING_END" => ("span", "messageId", -1),
            "REASONING_MESSAGE_START" => ("reasoning", "messageId", 1),
            "REASONING_MESSAGE_CONTENT" => ("reasoning", "messageId", 0),
            "REASONING_MESSAGE_END" => ("reasoning", "messageId", -1),
            "TOOL_CALL_START" => ("call", "toolCallId", 1),
            "TOOL_CALL_ARGS" => ("call", "toolCallId", 0),
            "TOOL_CALL_END" => ("call", "toolCallId", -1),
            _ => continue,
        };
        let key = key(field, family);
        match action {
            1 => assert!(open.insert(key), "{data} already open"),
            0 => assert!(open.contains(&key), "{data} not open"),
            _ => assert!(open.remove(&key), "{data} not open"),
        }
        if kind.ends_with("_CONTENT") || kind == "TOOL_CALL_ARGS" {
            assert!(!event["delta"].as_str().unwrap().is_empty(), "{data}");
        }
    }
}

#[test]
fn a_replay_is_the_live_rendering_byte_for_byte() {
    let log = server_tool_run();
    for dialect in [AiSdkDialect::V6, AiSdkDialect::V7] {
        let live = render(AiSdk::new(log.run.clone(), dialect), &log, None);
        assert_eq!(
            live,
            render(AiSdk::new(log.run.clone(), dialect), &log, None)
        );
    }
    let live = render(AgUi::new(log.run.clone()), &log, None);
    assert_eq!(live, render(AgUi::new(log.run.clone()), &log, None));
}

#[test]
fn the_ai_sdk_stream_of_a_server_tool_run() {
    let log = server_tool_run();
    let frames = render(AiSdk::new(log.run.clone(), AiSdkDialect::V6), &log, None);
    check_ai_sdk(&frames);
    let types: Vec<String> = frames
        .iter()
        .map(|(_, data)| {
            serde_json::from_str::<Value>(data)
                .map_or(data.clone(), |v| v["type"].as_str().unwrap().to_owned())
        })
        .collect();
    assert_eq!(types.first().map(String::as_str), Some("start"));
    assert_eq!(&types[types.len() - 2..], ["finish", "[DONE]"]);
    assert_eq!(frames.last().unwrap().0, None, "[DONE] has no id");
    // Two calls named `call_1` by the provider get two ids.
    let first = tool_call_id(log.run.run_id, log.model_call(1), "call_1");
    let second = tool_call_id(log.run.run_id, log.model_call(2), "call_1");
    assert!(
        frames
            .iter()
            .any(|(_, d)| d.contains(&first) && d.contains("tool-output-available"))
    );
    assert!(
        frames
            .iter()
            .any(|(_, d)| d.contains(&second) && d.contains("tool-output-error"))
    );
    assert!(
        frames
            .iter()
            .any(|(_, d)| d.contains("\"providerExecuted\":true"))
    );
    assert_eq!(
        split_tool_call_id(&second),
        Some((log.run.run_id, log.model_call(2), "call_1"))
    );
    // The reasoning delta (seq 4) opens r4 and text-start closes it first: 4 → 2 frames.
    let ids: Vec<&str> = frames.iter().filter_map(|(id, _)| id.as_deref()).collect();
    assert!(
        ids.contains(&"5.1") && ids.contains(&"5.2") && ids.contains(&"5"),
        "{ids:?}"
    );
}

#[test]
fn tool_progress_is_a_data_part_per_call_and_an_ag_ui_custom_event() {
    let log = server_tool_run();
    let id = tool_call_id(log.run.run_id, log.model_call(1), "call_1");
    for dialect in [AiSdkDialect::V6, AiSdkDialect::V7] {
        let frames = render(AiSdk::new(log.run.clone(), dialect), &log, None);
        let parts: Vec<Value> = frames
            .iter()
            .filter_map(|(_, data)| serde_json::from_str::<Value>(data).ok())
            .filter(|chunk| chunk["type"] == "data-behest-tool-progress")
            .collect();
        // The same id: the second replaces the first in the client's message.
        assert_eq!(
            parts,
            [
                json!({"type": "data-behest-tool-progress", "id": id,
                       "data": {"toolCallId": id, "progress": 1.0, "total": 3.0, "message": null}}),
                json!({"type": "data-behest-tool-progress", "id": id,
                       "data": {"toolCallId": id, "progress": 2.0, "total": 3.0, "message": "almost"}}),
            ]
        );
    }
    let frames = render(AgUi::new(log.run.clone()), &log, None);
    let custom: Vec<Value> = frames
        .iter()
        .filter_map(|(_, data)| serde_json::from_str::<Value>(data).ok())
        .filter(|event| event["type"] == "CUSTOM" && event["name"] == "behest.tool_progress")
        .collect();
    assert_eq!(custom.len(), 2, "{frames:?}");
    assert_eq!(
        custom[1]["value"],
        json!({"toolCallId": id, "progress": 2.0, "total": 3.0, "message": "almost"})
    );
}

#[test]
fn every_cut_of_every_ai_sdk_stream_resumes_exactly() {
    for log in every_log() {
        for dialect in [AiSdkDialect::V6, AiSdkDialect::V7] {
            let cuts = every_cut_resumes_exactly(
                || AiSdk::new(log.run.clone(), dialect),
                &log,
                false,
                check_ai_sdk,
            );
            assert!(cuts > 10, "{cuts}");
        }
    }
}

#[test]
fn every_cut_of_every_ag_ui_stream_resumes_exactly_after_a_prelude_the_verifier_accepts() {
    for log in every_log() {
        let cuts =
            every_cut_resumes_exactly(|| AgUi::new(log.run.clone()), &log, true, check_ag_ui);
        assert!(cuts > 10, "{cuts}");
    }
}

#[test]
fn a_pause_ends_the_segment_and_the_next_opens_with_the_same_ids() {
    let log = paused_run();
    let ai = segments(|| AiSdk::new(log.run.clone(), AiSdkDialect::V7), &log);
    assert_eq!(ai.len(), 3, "{ai:#?}");
    let run_id = log.run.run_id.to_string();
    for segment in &ai {
        let start: Value = serde_json::from_str(&segment[0].1).unwrap();
        assert_eq!(
            (start["type"].as_str(), start["messageId"].as_str()),
            (Some("start"), Some(run_id.as_str()))
        );
        assert_eq!(segment.last().unwrap().1, "[DONE]");
    }
    // The rejected approval reads as denied, and ai 7 also gets the decision.
    let second = ai[2]
        .iter()
        .map(|(_, d)| d.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        second.contains("tool-output-denied") && second.contains("\"approved\":false"),
        "{second}"
    );
    let v6: String = segments(|| AiSdk::new(log.run.clone(), AiSdkDialect::V6), &log)
        .concat()
        .iter()
        .map(|(_, d)| d.clone())
        .collect();
    assert!(!v6.contains("tool-approval-response") && !v6.contains("interrupted"));

    let ag = segments(|| AgUi::new(log.run.clone()), &log);
    assert_eq!(ag.len(), 3);
    let first_end: Value = serde_json::from_str(&ag[0].last().unwrap().1).unwrap();
    assert_eq!(first_end["outcome"]["type"], "success");
    assert_eq!(
        first_end["outcome"]["pendingToolCallIds"],
        json!([tool_call_id(log.run.run_id, log.model_call(1), "call_1")])
    );
    let second_end: Value = serde_json::from_str(&ag[1].last().unwrap().1).unwrap();
    assert_eq!(
        second_end["outcome"]["interrupts"][0]["reason"],
        "tool_approval"
    );
    for segment in &ag {
        let start: Value = serde_json::from_str(&segment[0].1).unwrap();
        assert_eq!(start["runId"].as_str(), Some(run_id.as_str()));
        assert_eq!(
            start["threadId"].as_str(),
            Some(log.session_id.to_string().as_str())
        );
    }
}

#[test]
fn an_abandoned_call_is_reset_for_ai_7_and_flagged_for_the_others() {
    let log = resumed_run();
    let joined = |frames: Vec<(Option<String>, String)>| {
        frames
            .into_iter()
            .map(|(_, d)| d)
            .collect::<Vec<_>>()
            .join("\n")
    };
    let v7 = joined(render(
        AiSdk::new(log.run.clone(), AiSdkDialect::V7),
        &log,
        None,
    ));
    assert!(v7.contains("reset-step") && !v7.contains("data-behest-call-abandoned"));
    let v6 = joined(render(
        AiSdk::new(log.run.clone(), AiSdkDialect::V6),
        &log,
        None,
    ));
    assert!(!v6.contains("reset-step") && v6.contains("data-behest-call-abandoned"));
    let ag = joined(render(AgUi::new(log.run.clone()), &log, None));
    assert!(ag.contains("behest.call_abandoned"));
}

#[test]
fn the_ag_ui_run_id_of_a_run_started_through_ag_ui_is_the_clients() {
    let now = Utc::now();
    let mut record: RunRecord = serde_json::from_value(json!({
        "id": RunId::new(), "session_id": SessionId::new(), "status": "calling_model",
        "provider": "p", "model": "m", "tool_choice": "auto", "metadata": {},
        "iterations": 1, "total_usage": TokenUsage::default(), "max_iterations": 10,
        "created_at": now, "updated_at": now,
    }))
    .unwrap();
    let tools = ToolRegistry::default();
    assert_eq!(
        RunContext::new(&record, &tools).ag_ui_run_id,
        record.id.to_string()
    );
    record.client_request_id = Some(format!(
        "{AG_UI_RUN_PREFIX}{}:client-run-7",
        record.session_id
    ));
    assert_eq!(
        RunContext::new(&record, &tools).ag_ui_run_id,
        "client-run-7"
    );
    // A runId with colons of its own keeps them.
    record.client_request_id = Some(format!("{AG_UI_RUN_PREFIX}{}:a:b", record.session_id));
    assert_eq!(RunContext::new(&record, &tools).ag_ui_run_id, "a:b");
    record.client_request_id = Some("plain-key".to_owned());
    assert_eq!(
        RunContext::new(&record, &tools).ag_ui_run_id,
        record.id.to_string()
    );
    // A key naming another session (written through POST /runs) does not rename the run.
    record.client_request_id = Some(format!("{AG_UI_RUN_PREFIX}{}:spoofed", SessionId::new()));
    assert_eq!(
        RunContext::new(&record, &tools).ag_ui_run_id,
        record.id.to_string()
    );
}

/// A run with an `output_schema` completes with its answer parsed: the AI SDK's `finish`
/// carries it in `messageMetadata.parsed` (both dialects), AG-UI's `RUN_FINISHED` in
/// `result.parsed`; a replay renders the same bytes.
#[test]
fn the_parsed_answer_is_in_the_finish_of_every_rendering() {
    let mut log = Log::new();
    log.model(1);
    log.text("{\"city\": \"Oslo\"}");
    log.end_call();
    log.push(EventPayload::RunCompleted(RunCompleted {
        finish_reason: FinishReason::Stop,
        iterations: 1,
        parsed: Some(json!({"city": "Oslo"})),
    }));
    let last = |frames: &[(Option<String>, String)], kind: &str| -> Value {
        frames
            .iter()
            .rev()
            .filter_map(|(_, data)| serde_json::from_str::<Value>(data).ok())
            .find(|chunk| chunk["type"] == kind)
            .unwrap_or(Value::Null)
    };
    for dialect in [AiSdkDialect::V6, AiSdkDialect::V7] {
        let live = render(AiSdk::new(log.run.clone(), dialect), &log, None);
        assert_eq!(
            live,
            render(AiSdk::new(log.run.clone(), dialect), &log, None)
        );
        let finish = last(&live, "finish");
        assert_eq!(finish["messageMetadata"]["parsed"], json!({"city": "Oslo"}));
        assert_eq!(finish["messageMetadata"]["behest"]["iterations"], 1);
        check_ai_sdk(&live);
    }
    let live = render(AgUi::new(log.run.clone()), &log, None);
    assert_eq!(live, render(AgUi::new(log.run.clone()), &log, None));
    let finished = last(&live, "RUN_FINISHED");
    assert_eq!(finished["result"]["parsed"], json!({"city": "Oslo"}));
    check_ag_ui(&live);
}

fn chunks(frames: &[(Option<String>, String)]) -> Vec<Value> {
    frames
        .iter()
        .filter_map(|(_, data)| serde_json::from_str(data).ok())
        .collect()
}

#[test]
fn approval_decisions_are_rendered_with_who_decided() {
    let log = decided_run();
    let first = tool_call_id(log.run.run_id, log.model_call(1), "call_1");
    let second = tool_call_id(log.run.run_id, log.model_call(1), "call_2");
    for dialect in [AiSdkDialect::V6, AiSdkDialect::V7] {
        let all: Vec<Value> = segments(|| AiSdk::new(log.run.clone(), dialect), &log)
            .iter()
            .flat_map(|segment| chunks(segment))
            .collect();
        let notices: Vec<&Value> = all
            .iter()
            .filter(|c| c["type"] == "data-behest-tool-approval-decided")
            .collect();
        assert_eq!(notices.len(), 2, "{dialect:?}");
        assert_eq!(notices[1]["transient"], true);
        assert_eq!(notices[1]["data"]["toolCallId"], second.as_str());
        assert_eq!(notices[1]["data"]["approved"], false);
        assert_eq!(notices[1]["data"]["decided_by"], "alice");
        assert_eq!(notices[1]["data"]["api_key"], 0);
        let responses: Vec<(Value, Value, Value)> = all
            .iter()
            .filter(|c| c["type"] == "tool-approval-response")
            .map(|c| {
                (
                    c["approvalId"].clone(),
                    c["approved"].clone(),
                    c["reason"].clone(),
                )
            })
            .collect();
        let denied: Vec<&Value> = all
            .iter()
            .filter(|c| c["type"] == "tool-output-denied")
            .map(|c| &c["toolCallId"])
            .collect();
        assert_eq!(denied, [&json!(second)], "{dialect:?}");
        if dialect == AiSdkDialect::V7 {
            // One response per decision, from the decision (not again at the execution).
            assert_eq!(
                responses,
                [
                    (json!(first), json!(true), Value::Null),
                    (json!(second), json!(false), json!("keep b"))
                ]
            );
        } else {
            assert!(responses.is_empty());
        }
    }
    let ag: Vec<Value> = segments(|| AgUi::new(log.run.clone()), &log)
        .iter()
        .flat_map(|segment| chunks(segment))
        .collect();
    let custom: Vec<&Value> = ag
        .iter()
        .filter(|e| e["type"] == "CUSTOM" && e["name"] == "behest.tool_approval_decided")
        .collect();
    assert_eq!(custom.len(), 2);
    assert_eq!(custom[0]["value"]["toolCallId"], first.as_str());
    assert_eq!(custom[0]["value"]["approved"], true);
    assert_eq!(custom[1]["value"]["reason"], "keep b");
    // The rejected call still gets its result, so it is not left pending.
    assert!(
        ag.iter()
            .any(|e| e["type"] == "TOOL_CALL_RESULT" && e["toolCallId"] == second.as_str())
    );
}

#[test]
fn the_stored_assistant_message_id_is_known_from_the_first_event_of_its_call() {
    let log = decided_run();
    let announced: Vec<String> = log
        .events
        .iter()
        .filter_map(|event| match &event.payload {
            EventPayload::ModelStarted(started) => started.message_id.map(|id| id.to_string()),
            _ => None,
        })
        .collect();
    let committed: Vec<String> = log
        .events
        .iter()
        .filter_map(|event| match &event.payload {
            EventPayload::AssistantMessageCommitted(c) => Some(c.message_id.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(announced, committed);
    let ag: Vec<Value> = segments(|| AgUi::new(log.run.clone()), &log)
        .iter()
        .flat_map(|segment| chunks(segment))
        .collect();
    let text_ids: Vec<&str> = ag
        .iter()
        .filter(|e| e["type"] == "TEXT_MESSAGE_START")
        .map(|e| e["messageId"].as_str().unwrap())
        .collect();
    assert_eq!(text_ids, announced);
    assert!(
        ag.iter()
            .filter(|e| e["type"] == "TOOL_CALL_START")
            .all(|e| e["parentMessageId"] == announced[0].as_str())
    );
    let ai = chunks(&render(
        AiSdk::new(log.run.clone(), AiSdkDialect::V6),
        &log,
        None,
    ));
    let steps: Vec<&str> = ai
        .iter()
        .filter(|c| c["type"] == "data-behest-model-started")
        .map(|c| c["data"]["messageId"].as_str().unwrap())
        .collect();
    // The first segment ends at the pause; the step right after `start-step`.
    assert_eq!(steps, [announced[0].as_str()]);
    let at = ai.iter().position(|c| c["type"] == "start-step").unwrap();
    assert_eq!(ai[at + 1]["type"], "data-behest-model-started");
    assert_eq!(ai[at + 1]["transient"], true);
    // A log of an older version (no id announced) keeps the derived id.
    let old = server_tool_run();
    let ag = chunks(&render(AgUi::new(old.run.clone()), &old, None));
    let start = ag
        .iter()
        .find(|e| e["type"] == "TEXT_MESSAGE_START")
        .unwrap();
    assert_eq!(
        start["messageId"],
        format!("{}:{}", old.run.run_id, old.model_call(1))
    );
}

#[test]
fn a_call_id_the_provider_says_again_after_a_resume_gets_a_new_namespaced_id() {
    let log = resumed_tool_run();
    let abandoned = tool_call_id(log.run.run_id, log.model_call(1), "call_1");
    let remade = tool_call_id(log.run.run_id, log.model_call(2), "call_1");
    assert_ne!(abandoned, remade);
    for dialect in [AiSdkDialect::V6, AiSdkDialect::V7] {
        let ai = chunks(&render(AiSdk::new(log.run.clone(), dialect), &log, None));
        let starts: Vec<&str> = ai
            .iter()
            .filter(|c| c["type"] == "tool-input-start")
            .map(|c| c["toolCallId"].as_str().unwrap())
            .collect();
        assert_eq!(starts, [abandoned.as_str(), remade.as_str()], "{dialect:?}");
        let output = ai
            .iter()
            .find(|c| c["type"] == "tool-output-available")
            .unwrap();
        assert_eq!(output["toolCallId"], remade.as_str());
    }
    let ag = chunks(&render(AgUi::new(log.run.clone()), &log, None));
    let starts: Vec<&str> = ag
        .iter()
        .filter(|e| e["type"] == "TOOL_CALL_START")
        .map(|e| e["toolCallId"].as_str().unwrap())
        .collect();
    assert_eq!(starts, [abandoned.as_str(), remade.as_str()]);
    let result = ag.iter().find(|e| e["type"] == "TOOL_CALL_RESULT").unwrap();
    assert_eq!(result["toolCallId"], remade.as_str());
}

/// Item 2: an AG-UI tool result is the stored tool message (`TOOL_CALL_RESULT.messageId` =
/// `tool_message_committed.message_id`, sent at that event); a log of an older version, whose
/// `tool_message_committed` names no call, keeps the derived id and still gives every server
/// call its result.
#[test]
fn an_ag_ui_tool_result_carries_the_id_of_the_stored_tool_message() {
    let log = server_tool_run();
    let stored: Vec<String> = log
        .events
        .iter()
        .filter_map(|event| match &event.payload {
            EventPayload::ToolMessageCommitted(c) => Some(c.message_id.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(stored.len(), 2);
    let frames = render(AgUi::new(log.run.clone()), &log, None);
    let results: Vec<(String, Value)> = frames
        .iter()
        .filter_map(|(id, data)| {
            let event: Value = serde_json::from_str(data).ok()?;
            (event["type"] == "TOOL_CALL_RESULT").then(|| (id.clone().unwrap(), event))
        })
        .collect();
    let first = tool_call_id(log.run.run_id, log.model_call(1), "call_1");
    let second = tool_call_id(log.run.run_id, log.model_call(2), "call_1");
    let got: Vec<(&Value, &Value, &Value)> = results
        .iter()
        .map(|(_, e)| (&e["messageId"], &e["toolCallId"], &e["content"]))
        .collect();
    assert_eq!(
        got,
        [
            (&json!(stored[0]), &json!(first), &json!("12:00")),
            (&json!(stored[1]), &json!(second), &json!("error: down")),
        ]
    );
    // Each is the frame of its tool message's commit.
    let commits: Vec<String> = log
        .events
        .iter()
        .filter(|e| matches!(e.payload, EventPayload::ToolMessageCommitted(_)))
        .map(|e| e.sequence.to_string())
        .collect();
    let ids: Vec<&String> = results.iter().map(|(id, _)| id).collect();
    assert_eq!(ids, commits.iter().collect::<Vec<_>>());

    let mut old = server_tool_run();
    for event in &mut old.events {
        if let EventPayload::ToolMessageCommitted(committed) = &mut event.payload {
            committed.call_id = None;
        }
    }
    let ag = chunks(&render(AgUi::new(old.run.clone()), &old, None));
    let derived: Vec<(&Value, &Value)> = ag
        .iter()
        .filter(|e| e["type"] == "TOOL_CALL_RESULT")
        .map(|e| (&e["messageId"], &e["toolCallId"]))
        .collect();
    let first = tool_call_id(old.run.run_id, old.model_call(1), "call_1");
    let second = tool_call_id(old.run.run_id, old.model_call(2), "call_1");
    assert_eq!(
        derived,
        [
            (&json!(format!("{first}:result")), &json!(first)),
            (&json!(format!("{second}:result")), &json!(second)),
        ]
    );
}

/// How the watchers of one shared rendering take turns.
#[derive(Clone, Copy, Debug)]
enum Turns {
    /// One event each, in turn.
    Lockstep,
    /// Each to its end, the latest cursor first (they hand their folds to the shared one).
    LatestFirst,
    /// Each to its end, the earliest cursor first (the later ones join a shared one ahead).
    EarliestFirst,
}

/// The log's events as the watch stream gives them.
fn event_frames(log: &Log) -> Vec<crate::events::EventFrame> {
    log.events
        .iter()
        .map(|event| crate::events::EventFrame {
            sequence: event.sequence,
            terminal: event.is_terminal(),
            bytes: Bytes::new(),
            data: serde_json::to_string(event).unwrap().into(),
        })
        .collect()
}

/// The `(id, data)` of the frames one response sent.
type Sent = Vec<(Option<String>, String)>;

/// What [`render`] gives after each of `afters`, rendered by watchers of one shared rendering
/// taking `turns`; and how many times a watcher fell behind and folded the log again.
fn render_shared<P: Projection>(
    fresh: &P,
    format: Format,
    log: &Log,
    afters: &[Option<Cursor>],
    turns: Turns,
) -> (Vec<Sent>, usize)
where
    P::Frame: Send,
{
    let frames = event_frames(log);
    let renderings = Renderings::default();
    let run_id = log.run.run_id;
    let mut watchers: Vec<(Watcher<P>, usize, bool)> = afters
        .iter()
        .map(|after| {
            let shared = renderings.share(run_id, format, || fresh.clone());
            (Watcher::new(shared, *after), 0, false)
        })
        .collect();
    assert_eq!(renderings.len(), 1);
    let mut out = vec![Vec::new(); afters.len()];
    let mut restarts = 0;
    let mut step = |index: usize, watchers: &mut Vec<(Watcher<P>, usize, bool)>| {
        let (watcher, next, ended) = &mut watchers[index];
        if *ended {
            return;
        }
        match watcher.render(&frames[*next]).unwrap() {
            Some(rendered) => {
                out[index].extend(rendered.frames.iter().map(parse));
                *next += 1;
                if rendered.end {
                    out[index].extend(done_frame::<P>().iter().map(parse));
                }
                *ended = rendered.end || *next == frames.len();
            }
            None => {
                restarts += 1;
                *next = usize::try_from(watcher.from()).unwrap();
            }
        }
    };
    let mut order: Vec<usize> = (0..afters.len()).collect();
    let position = |index: &usize| afters[*index].map(|cursor| (cursor.sequence, cursor.frame));
    match turns {
        Turns::Lockstep => {
            while watchers.iter().any(|(_, _, ended)| !ended) {
                for index in 0..watchers.len() {
                    step(index, &mut watchers);
                }
            }
        }
        Turns::LatestFirst | Turns::EarliestFirst => {
            order.sort_by_key(position);
            if matches!(turns, Turns::LatestFirst) {
                order.reverse();
            }
            for index in order {
                while !watchers[index].2 {
                    step(index, &mut watchers);
                }
            }
        }
    }
    drop(watchers);
    assert_eq!(renderings.len(), 0, "dropped with its last watcher");
    (out, restarts)
}

/// Every frame id of every segment of the log's rendering, and the start.
fn every_cursor<P: Projection>(make: impl Fn() -> P, log: &Log) -> Vec<Option<Cursor>> {
    let mut afters = vec![None];
    for segment in segments(&make, log) {
        for (id, _) in segment {
            if let Some(id) = id {
                afters.push(Some(Cursor::parse(&id, true).unwrap()));
            }
        }
    }
    afters
}

#[test]
fn watchers_of_one_shared_rendering_send_what_each_would_render_alone() {
    for log in every_log() {
        let ai_sdk = |dialect| AiSdk::new(log.run.clone(), dialect);
        for turns in [Turns::Lockstep, Turns::LatestFirst, Turns::EarliestFirst] {
            for dialect in [AiSdkDialect::V6, AiSdkDialect::V7] {
                let afters = every_cursor(|| ai_sdk(dialect), &log);
                let (shared, restarts) = render_shared(
                    &ai_sdk(dialect),
                    Format::AiSdk(dialect),
                    &log,
                    &afters,
                    turns,
                );
                assert_eq!(restarts, 0);
                for (after, got) in afters.iter().zip(&shared) {
                    assert_eq!(
                        got,
                        &render(ai_sdk(dialect), &log, *after),
                        "{after:?} {turns:?}"
                    );
                }
            }
            let ag_ui = || AgUi::new(log.run.clone());
            let afters = every_cursor(ag_ui, &log);
            let (shared, _) = render_shared(&ag_ui(), Format::AgUi, &log, &afters, turns);
            for (after, got) in afters.iter().zip(&shared) {
                assert_eq!(got, &render(ag_ui(), &log, *after), "{after:?} {turns:?}");
            }
        }
    }
}

#[test]
fn a_watcher_behind_what_the_shared_rendering_keeps_folds_the_log_again() {
    // More events than it keeps, then fewer events but more bytes than it keeps.
    let big = "x".repeat(64 << 10);
    for (deltas, text) in [(shared::RECENT + 50, "x"), (100, big.as_str())] {
        let mut log = Log::new();
        log.model(1);
        for _ in 0..deltas {
            log.text(text);
        }
        log.end_call();
        log.complete(1);
        let fresh = AgUi::new(log.run.clone());
        let frames = event_frames(&log);
        let renderings = Renderings::default();
        let mut slow = Watcher::new(
            renderings.share(log.run.run_id, Format::AgUi, || fresh.clone()),
            None,
        );
        let mut fast = Watcher::new(
            renderings.share(log.run.run_id, Format::AgUi, || fresh.clone()),
            None,
        );
        let mut slow_out: Vec<(Option<String>, String)> = Vec::new();
        let first = slow.render(&frames[0]).unwrap().unwrap();
        slow_out.extend(first.frames.iter().map(parse));
        for frame in &frames {
            fast.render(frame).unwrap().unwrap();
        }
        // The shared rendering no longer keeps event 2: the slow watcher starts again, from
        // the log's first event (no projection is kept before event 2).
        assert!(
            slow.render(&frames[1]).unwrap().is_none(),
            "{deltas} deltas"
        );
        assert_eq!(slow.from(), 0);
        for frame in &frames {
            let rendered = slow.render(frame).unwrap().unwrap();
            slow_out.extend(rendered.frames.iter().map(parse));
        }
        assert_eq!(slow_out, render(fresh, &log, None));
    }
}

#[test]
fn a_watcher_behind_on_a_long_log_folds_again_from_a_kept_projection() {
    // Model calls of text and a server tool, over three kept projections' worth of events, so
    // that the events around each kept one open and close text, calls and steps. Every call
    // is `call_1`, as the demo model names them: each one's id in the frames depends on how
    // many came before (`tool_call_id`), so a kept projection that missed one shows.
    let every = shared::CHECKPOINT_EVERY;
    let mut log = Log::new();
    // A first model call as long as needed for event 2,048 to start one of the 12-event model
    // calls below (a kept projection that missed it names that call's frames by the previous
    // model call).
    log.model(1);
    for _ in 0..2 {
        log.text("Hm. ");
    }
    log.end_call();
    let mut iteration = 1;
    let id = "call_1";
    while log.events.len() < 3 * usize::try_from(every).unwrap() {
        iteration += 1;
        log.model(iteration);
        log.text("Looking ");
        log.text("it up.");
        log.call(id, "lookup", &["{\"q\":", "1}"]);
        log.end_call();
        log.execute(id, "lookup", ok(json!({"n": iteration})));
    }
    log.model(iteration + 1);
    log.text("Done.");
    log.end_call();
    log.complete(iteration + 1);
    assert!(matches!(
        log.events[usize::try_from(2 * every - 1).unwrap()].payload,
        EventPayload::ModelStarted(_)
    ));
    let dialect = AiSdkDialect::V7;
    long_log_case(|| AgUi::new(log.run.clone()), Format::AgUi, &log);
    long_log_case(
        || AiSdk::new(log.run.clone(), dialect),
        Format::AiSdk(dialect),
        &log,
    );
}

/// [`a_watcher_behind_on_a_long_log_folds_again_from_a_kept_projection`] in one format:
/// watchers that fall behind at each event around the second kept projection fold again from
/// the latest one kept before that event, not from the log's start, and resumes at each frame
/// id around it start from the latest one kept before their cursor's event (a resume's
/// prelude is made from the state before it); every one sends what a lone renderer sends.
fn long_log_case<P: Projection>(make: impl Fn() -> P, format: Format, log: &Log)
where
    P::Frame: Send,
{
    let every = shared::CHECKPOINT_EVERY;
    let frames = event_frames(log);
    let index = |sequence: u64| usize::try_from(sequence).unwrap();
    // The frames after `from` through `watcher`, which must take them all.
    let feed = |watcher: &mut Watcher<P>, from: u64, out: &mut Sent| {
        for frame in &frames[index(from)..] {
            let rendered = watcher.render(frame).unwrap().unwrap();
            out.extend(rendered.frames.iter().map(parse));
            if rendered.end {
                out.extend(done_frame::<P>().iter().map(parse));
            }
        }
    };
    let alone = render(make(), log, None);
    for behind in 2 * every - 3..=2 * every + 3 {
        let renderings = Renderings::default();
        let run_id = log.run.run_id;
        let mut slow = Watcher::new(renderings.share(run_id, format, &make), None);
        let mut fast = Watcher::new(renderings.share(run_id, format, &make), None);
        let mut out: Sent = Vec::new();
        for frame in &frames[..index(behind)] {
            let rendered = slow.render(frame).unwrap().unwrap();
            out.extend(rendered.frames.iter().map(parse));
        }
        for frame in &frames {
            fast.render(frame).unwrap().unwrap();
        }
        // Event `behind + 1` is no longer kept: fold again through `behind`.
        assert!(slow.render(&frames[index(behind)]).unwrap().is_none());
        let kept = if behind >= 2 * every {
            2 * every
        } else {
            every
        };
        assert_eq!(slow.from(), kept, "{format:?} behind {behind}");
        feed(&mut slow, kept, &mut out);
        assert_eq!(out, alone, "{format:?} behind {behind}");
    }
    // One shared rendering through the whole log, then resumes around the second kept
    // projection.
    let renderings = Renderings::default();
    let mut first = Watcher::new(renderings.share(log.run.run_id, format, &make), None);
    feed(&mut first, 0, &mut Vec::new());
    let cursors = segments(&make, log)
        .into_iter()
        .flatten()
        .filter_map(|(id, _)| Cursor::parse(&id?, true).ok())
        .filter(|cursor| (2 * every - 6..=2 * every + 6).contains(&cursor.sequence));
    let mut resumes = 0;
    for cursor in cursors {
        let after = Some(cursor);
        let mut resumed = Watcher::new(renderings.share(log.run.run_id, format, &make), after);
        let kept = if cursor.sequence > 2 * every {
            2 * every
        } else {
            every
        };
        assert_eq!(resumed.from(), kept, "{format:?} {cursor}");
        let mut out: Sent = Vec::new();
        feed(&mut resumed, kept, &mut out);
        assert_eq!(out, render(make(), log, after), "{format:?} {cursor}");
        resumes += 1;
    }
    assert!(
        resumes >= 5,
        "{format:?}: {resumes} cursors around event {}",
        2 * every
    );
}
