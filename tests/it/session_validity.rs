//! A session never becomes unusable (issue #8, "done when"): one multi-turn session over each
//! wire format (OpenAI Chat Completions, Anthropic Messages) and each store backend goes through
//! tool calls, recorded reasoning turns (DeepSeek `reasoning_content`, Anthropic extended
//! thinking), a malformed tool call, an empty answer, a refusal, a cancel and a cut in the
//! middle of an answer (whose text is kept, marked incomplete), a cancel in the middle of a
//! tool and a crash (state left active in the store, then a new server over the same database
//! recovers it), and keeps working to the end; every request the fake provider received passes
//! the provider's own validation rules (`support::validate`).

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use behest::config::Config;
use behest::domain::{
    ContentPart, Message, MessageId, Role, RunId, RunStatus, SessionId, ToolCall,
};
use behest::events::{
    AgentEvent, EventPayload, LoggedEvent, MessageCommitted, ModelStarted, ToolCallCompleted,
    ToolCallStarted, ToolExecutionStarted, UsageRecorded,
};
use behest::store::{EventWrite, NewRun, RunChange, Store};
use serde_json::{Value, json};
use support::db::{Backend, TestDb};
use support::fake_anthropic;
use support::fake_openai::{self, DONE, FakeOpenAi, Reply, chunk, text_stream, tool_calls_stream};
use support::server::{Frame, TestServer};
use support::validate::{validate_anthropic_request, validate_openai_request};

const FIXTURE: &str = env!("CARGO_BIN_EXE_behest-mcp-fixture");

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wire {
    OpenAi,
    Anthropic,
}

fn config(wire: Wire, base_url: &str, log: &std::path::Path) -> Config {
    // DeepSeek thinking mode needs the reasoning of tool turns sent back.
    let (kind, extra) = match wire {
        Wire::OpenAi => ("openai", "reasoning_replay = \"tool_turns\"\n"),
        Wire::Anthropic => ("anthropic", ""),
    };
    let toml = format!(
        "[mcp_servers.fixture]\ntransport = \"stdio\"\ncommand = \"{FIXTURE}\"\n\
         env = {{ BEHEST_MCP_FIXTURE_LOG = \"{}\" }}\n\
         [providers.fake]\nkind = \"{kind}\"\nbase_url = \"{base_url}\"\n{extra}\
         [providers.fake.timeouts]\nconnect_ms = 2000\nfirst_byte_ms = 5000\nidle_ms = 1500\ntotal_ms = 20000\n\
         [providers.fake.retry]\nmax_attempts = 1\n\
         [providers.fake.models.fake-model]\ncontext_window = 128000\nmax_output_tokens = 1024\n",
        log.display()
    );
    Config::from_toml(&toml).unwrap()
}

/// The scripted replies of one wire format.
struct Script {
    wire: Wire,
}

impl Script {
    fn text(&self, text: &str) -> Vec<u8> {
        match self.wire {
            Wire::OpenAi => text_stream(&[text]),
            Wire::Anthropic => fake_anthropic::text_stream(&[text]),
        }
    }

    fn tool_call(&self, id: &str, name: &str, arguments: &Value) -> Vec<u8> {
        match self.wire {
            Wire::OpenAi => tool_calls_stream(&[(id, name, arguments.clone())]),
            Wire::Anthropic => self.anthropic_tool_use(id, name, &[&arguments.to_string()]),
        }
    }

    /// A call whose argument text is not JSON (a truncated object).
    fn malformed_call(&self, id: &str, name: &str) -> Vec<u8> {
        match self.wire {
            Wire::OpenAi => {
                let mut body = chunk(json!({"role": "assistant", "content": null}), None);
                body.push_str(&chunk(
                    json!({"tool_calls": [{"index": 0, "id": id, "type": "function",
                                           "function": {"name": name, "arguments": "{\"a\": 1, \"b\""}}]}),
                    None,
                ));
                body.push_str(&chunk(json!({}), Some("tool_calls")));
                body.push_str(&fake_openai::usage_chunk(20, 8, 0));
                body.push_str(DONE);
                body.into_bytes()
            }
            Wire::Anthropic => self.anthropic_tool_use(id, name, &["{\"a\": 1, ", "\"b\""]),
        }
    }

    /// The start of a text answer that never ends: held open (`cut` false) or cut.
    fn partial(&self, text: &str, cut: bool) -> Reply {
        let body = match self.wire {
            Wire::OpenAi => (chunk(json!({"role": "assistant", "content": ""}), None)
                + &chunk(json!({"content": text}), None))
                .into_bytes(),
            Wire::Anthropic => fake_anthropic::text_start(text),
        };
        if cut {
            Reply::close_after(&body)
        } else {
            Reply::stall_after(&body)
        }
    }

    /// An answer with no text and no tool call.
    fn empty(&self) -> Vec<u8> {
        match self.wire {
            Wire::OpenAi => {
                let mut body = chunk(json!({"role": "assistant", "content": ""}), None);
                body.push_str(&chunk(json!({}), Some("stop")));
                body.push_str(&fake_openai::usage_chunk(12, 0, 0));
                body.push_str(DONE);
                body.into_bytes()
            }
            Wire::Anthropic => {
                let mut body = fake_anthropic::message_start(12);
                body.push_str(&fake_anthropic::message_end("end_turn", 0));
                body.into_bytes()
            }
        }
    }

    /// A refusal: text and a content-filter stop. The OpenAI stream carries no usage (as many
    /// compatible servers send), so the run's usage is estimated.
    fn refusal(&self, text: &str) -> Vec<u8> {
        match self.wire {
            Wire::OpenAi => {
                let mut body = chunk(json!({"role": "assistant", "content": ""}), None);
                body.push_str(&chunk(json!({"content": text}), None));
                body.push_str(&chunk(json!({}), Some("content_filter")));
                body.push_str(DONE);
                body.into_bytes()
            }
            Wire::Anthropic => {
                let mut body = fake_anthropic::message_start(10);
                body.push_str(&fake_anthropic::event(&json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})));
                body.push_str(&fake_anthropic::text_delta(0, text));
                body.push_str(&fake_anthropic::event(
                    &json!({"type": "content_block_stop", "index": 0}),
                ));
                body.push_str(&fake_anthropic::message_end("refusal", 5));
                body.into_bytes()
            }
        }
    }

    /// A recorded turn with reasoning and tool calls (of tools the server does not have):
    /// DeepSeek `reasoning_content` and one call; Anthropic extended thinking (signed and
    /// redacted blocks), text and two interleaved `tool_use` blocks.
    fn reasoning_tool_turn(&self) -> Vec<u8> {
        match self.wire {
            Wire::OpenAi => fake_openai::fixture("deepseek_reasoning_tool_call.sse"),
            Wire::Anthropic => fake_anthropic::fixture("thinking_interleaved_tool_use.sse"),
        }
    }

    fn anthropic_tool_use(&self, id: &str, name: &str, pieces: &[&str]) -> Vec<u8> {
        use fake_anthropic::{event, message_end, message_start};
        let mut body = message_start(30);
        body.push_str(&event(&json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}})));
        for piece in pieces {
            body.push_str(&event(&json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": piece}})));
        }
        body.push_str(&event(&json!({"type": "content_block_stop", "index": 0})));
        body.push_str(&message_end("tool_use", 12));
        body.into_bytes()
    }
}

fn kinds(frames: &[Frame]) -> Vec<&str> {
    frames.iter().map(|f| f.event.as_str()).collect()
}

/// Every `tool_call_started` has one `tool_call_completed`, every `tool_execution_started` one
/// `tool_execution_finished`, and a call's `tool_execution_finished` precedes its
/// `tool_message_committed`.
fn assert_calls_paired(frames: &[Frame]) {
    let ids = |kind: &str| -> Vec<String> {
        frames
            .iter()
            .filter(|f| f.event == kind)
            .map(|f| {
                let data = f.json();
                data["call_id"]
                    .as_str()
                    .or(data["call"]["id"].as_str())
                    .unwrap()
                    .to_owned()
            })
            .collect()
    };
    let mut started = ids("tool_call_started");
    let mut completed = ids("tool_call_completed");
    started.sort();
    completed.sort();
    assert_eq!(started, completed, "{:?}", kinds(frames));
    let mut executing = ids("tool_execution_started");
    let mut executed = ids("tool_execution_finished");
    executing.sort();
    executed.sort();
    assert_eq!(executing, executed, "{:?}", kinds(frames));
    let last_finished = frames
        .iter()
        .rposition(|f| f.event == "tool_execution_finished");
    let first_committed = frames
        .iter()
        .position(|f| f.event == "tool_message_committed");
    if let (Some(finished), Some(committed)) = (last_finished, first_committed) {
        // Results are committed in call order after the turn's executions ended.
        assert!(finished < committed, "{:?}", kinds(frames));
    }
}

async fn run(server: &TestServer, body: Value) -> (String, Vec<Frame>, Value) {
    let created = server.create_run(body).await;
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    let record = server.finished_run(&run_id).await;
    let frames = server.events(&run_id, None).await;
    assert_calls_paired(&frames);
    (run_id, frames, record)
}

fn body(input: &str, session: Option<&str>) -> Value {
    let mut body = json!({"provider": "fake", "model": "fake-model", "input": input});
    if let Some(session) = session {
        body["session_id"] = json!(session);
    }
    body
}

/// Leaves a run of the session as a crashed process would: an assistant message with a tool
/// call committed, its execution started, no result, status `waiting_for_tools`.
async fn leave_a_crashed_run(store: &Arc<dyn Store>, session: SessionId) -> (RunId, String) {
    let run_id = RunId::new();
    let now = chrono::Utc::now();
    store
        .create_run(&NewRun {
            id: run_id,
            session_id: session,
            create_session: false,
            provider: "fake".to_owned(),
            model: "fake-model".to_owned(),
            tool_choice: Default::default(),
            metadata: json!({}),
            input: behest::domain::RunInput::from("add 4 and 4").content(),
            user_message_id: MessageId::new(),
            tools: None,
            agent: None,
            definition: Default::default(),
            session_defaults: None,
            max_iterations: 25,
            client_request_id: None,
            request_hash: None,
            created_at: now,
            lease: None,
        })
        .await
        .unwrap();
    let call_id = "call_crash".to_owned();
    let assistant = Message {
        id: MessageId::new(),
        session_id: session,
        run_id,
        role: Role::Assistant,
        content: vec![ContentPart::Text {
            text: "Adding.".to_owned(),
        }],
        reasoning: Vec::new(),
        tool_calls: vec![ToolCall {
            id: call_id.clone(),
            name: "add".to_owned(),
            arguments: json!({"a": 4, "b": 4}),
            invalid_arguments: None,
        }],
        tool_call_id: None,
        tool_name: None,
        created_at: now,
        status: Default::default(),
    };
    let event = |sequence: u64, payload: EventPayload| {
        let event = AgentEvent {
            sequence,
            run_id,
            timestamp: now,
            trace_id: String::new(),
            span_id: String::new(),
            payload,
        };
        Arc::new(LoggedEvent {
            sequence,
            event_type: event.payload.event_type().to_owned(),
            data: Arc::from(serde_json::to_string(&event).unwrap()),
            terminal: false,
        })
    };
    // The model call that made the call, as the run loop logs it.
    let call = assistant.tool_calls[0].clone();
    let model_call = [
        EventPayload::ModelStarted(ModelStarted {
            provider: "fake".to_owned(),
            model: "fake-model".to_owned(),
            iteration: 1,
            message_id: None,
        }),
        EventPayload::ToolCallStarted(ToolCallStarted {
            call_id: call.id.clone(),
            tool_name: call.name.clone(),
        }),
        EventPayload::ToolCallCompleted(ToolCallCompleted { call }),
        EventPayload::UsageRecorded(UsageRecorded {
            usage: Default::default(),
        }),
    ];
    let mut writes: Vec<EventWrite> = (1..)
        .zip(model_call)
        .map(|(sequence, payload)| EventWrite {
            run_id,
            event: event(sequence, payload),
            outcome: None,
            change: RunChange::default(),
        })
        .collect();
    writes.extend([
        EventWrite {
            run_id,
            event: event(
                5,
                EventPayload::AssistantMessageCommitted(MessageCommitted {
                    message_id: assistant.id,
                }),
            ),
            outcome: None,
            change: RunChange {
                status: Some(RunStatus::Persisting),
                message: Some(assistant),
                ..RunChange::default()
            },
        },
        EventWrite {
            run_id,
            event: event(
                6,
                EventPayload::ToolExecutionStarted(ToolExecutionStarted {
                    call_id: call_id.clone(),
                    tool_name: "add".to_owned(),
                }),
            ),
            outcome: None,
            change: RunChange {
                status: Some(RunStatus::WaitingForTools),
                ..RunChange::default()
            },
        },
    ]);
    store.append_events(&writes).await.unwrap();
    (run_id, call_id)
}

async fn a_session_survives_everything(backend: Backend, wire: Wire) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let fake = FakeOpenAi::start().await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let config = config(wire, &fake.base_url(), log.path());
    let script = Script { wire };
    let server = TestServer::on_store(db.store().await, config.clone(), None).await;

    // 1. A forced tool call, then an answer: the forced choice applies to the first call only.
    fake.push(Reply::sse(&script.tool_call(
        "call_add",
        "add",
        &json!({"a": 2, "b": 3}),
    )));
    fake.push(Reply::sse(&script.text("The sum is 5.")));
    let mut first = body("add 2 and 3", None);
    first["tool_choice"] = json!({"name": "add"});
    let (_, frames, record) = run(&server, first).await;
    assert_eq!(record["status"], "completed", "{:?}", kinds(&frames));
    let session = record["session_id"].as_str().unwrap().to_owned();
    let requests = fake.requests();
    match wire {
        Wire::OpenAi => {
            assert_eq!(
                requests[0].body["tool_choice"],
                json!({"type": "function", "function": {"name": "add"}})
            );
            assert_eq!(requests[1].body["tool_choice"], "auto");
        }
        Wire::Anthropic => {
            assert_eq!(
                requests[0].body["tool_choice"],
                json!({"type": "tool", "name": "add"})
            );
            assert_eq!(requests[1].body["tool_choice"], json!({"type": "auto"}));
        }
    }

    // 1b. A reasoning turn from the recorded fixtures: reasoning streamed as its own event,
    // stored, and replayed (checked by the validators on every later request).
    fake.push(Reply::sse(&script.reasoning_tool_turn()));
    fake.push(Reply::sse(&script.text("Neither tool exists here.")));
    let (_, frames, record) = run(&server, body("think, then use tools", Some(&session))).await;
    assert_eq!(record["status"], "completed", "{:?}", kinds(&frames));
    assert!(kinds(&frames).contains(&"reasoning_delta"));
    let replayed = fake.requests().last().unwrap().body["messages"].to_string();
    match wire {
        Wire::OpenAi => assert!(
            replayed.contains("\"reasoning_content\":\"I should look up the file first.\""),
            "{replayed}"
        ),
        Wire::Anthropic => assert!(
            replayed.contains(
                "\"signature\":\"EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds\""
            ),
            "{replayed}"
        ),
    }

    // 2. A malformed call: completed as a call, a Failure the model sees, the loop goes on.
    fake.push(Reply::sse(&script.malformed_call("call_bad", "add")));
    fake.push(Reply::sse(&script.text("Sorry, let me stop there.")));
    let (_, frames, record) = run(&server, body("add again", Some(&session))).await;
    assert_eq!(record["status"], "completed", "{:?}", kinds(&frames));
    let failure = frames
        .iter()
        .find(|f| f.event == "tool_execution_finished")
        .expect("the malformed call gets a result")
        .json();
    let error = failure["result"]["Failure"]["error"].as_str().unwrap();
    assert!(
        error.starts_with("the arguments were not valid JSON: {\"a\": 1,"),
        "{error}"
    );
    let completed = frames
        .iter()
        .find(|f| f.event == "tool_call_completed")
        .unwrap()
        .json();
    assert_eq!(completed["call"]["id"], "call_bad");
    assert!(completed["call"]["invalid_arguments"].is_string());
    let seen = fake.requests().last().unwrap().body["messages"].clone();
    assert!(seen.to_string().contains("not valid JSON"), "{seen}");

    // 3. An empty answer: the run completes, nothing is stored.
    fake.push(Reply::sse(&script.empty()));
    let (run_id, frames, record) = run(&server, body("say nothing", Some(&session))).await;
    assert_eq!(record["status"], "completed", "{:?}", kinds(&frames));
    assert_eq!(record["finish_reason"], "stop");
    assert!(!kinds(&frames).contains(&"assistant_message_committed"));
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(output["messages"], json!([]));

    // 4. A refusal: visible text, finish reason `content_filter`.
    fake.push(Reply::sse(&script.refusal("I can't help with that.")));
    let (run_id, frames, record) = run(&server, body("something bad", Some(&session))).await;
    assert_eq!(record["status"], "completed", "{:?}", kinds(&frames));
    assert_eq!(record["finish_reason"], "content_filter");
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(output["finish_reason"], "content_filter");
    assert_eq!(
        output["messages"][0]["content"][0]["text"],
        "I can't help with that."
    );
    if wire == Wire::OpenAi {
        // No usage reported: a tokenizer estimate, marked, on the event and the run.
        let usage = frames
            .iter()
            .find(|f| f.event == "usage_recorded")
            .unwrap()
            .json();
        assert_eq!(usage["usage"]["estimated"], true);
        assert!(usage["usage"]["input_tokens"].as_u64().unwrap() > 20);
        assert_eq!(
            usage["usage"]["output_tokens"].as_u64().unwrap(),
            behest::runtime::tokens::count_text("I can't help with that.")
        );
        assert_eq!(record["total_usage"]["estimated"], true);
        assert_eq!(
            record["total_usage"]["input_tokens"],
            usage["usage"]["input_tokens"]
        );
    }

    // 4b. A cancel mid-stream: the text streamed so far is kept as an assistant message marked
    // incomplete, shown in the run's output and sent as context next time.
    fake.push(script.partial("Half an answer", false));
    let run_id = server
        .create_run(body("start answering", Some(&session)))
        .await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    {
        use eventsource_stream::Eventsource;
        use futures::StreamExt;
        let mut stream = server
            .watch(&run_id, None)
            .await
            .bytes_stream()
            .eventsource();
        while let Some(event) = stream.next().await {
            if event.unwrap().event == "text_delta" {
                break;
            }
        }
    }
    let response = server
        .client
        .post(server.url(&format!("/runs/{run_id}/cancel?wait=true")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(output["status"], "cancelled");
    assert_eq!(
        (
            output["messages"][0]["status"].as_str(),
            output["messages"][0]["content"][0]["text"].as_str()
        ),
        (Some("incomplete"), Some("Half an answer"))
    );
    // 4c. A stream cut mid-answer fails the run; its text is kept the same way.
    fake.push(script.partial("Cut answer", true));
    let (run_id, _, record) = run(&server, body("answer and break", Some(&session))).await;
    assert_eq!(record["status"], "failed");
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(output["messages"][0]["status"], "incomplete");
    assert_eq!(output["messages"][0]["content"][0]["text"], "Cut answer");

    // 5. A cancel while a tool runs.
    fake.push(Reply::sse(&script.tool_call(
        "call_hang",
        "sleep",
        &json!({"ms": 60_000}),
    )));
    let run_id = server.create_run(body("hang", Some(&session))).await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(log.path())
        .unwrap_or_default()
        .contains("called sleep")
    {
        assert!(Instant::now() < deadline, "the sleep tool was called");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let response = server
        .client
        .post(server.url(&format!("/runs/{run_id}/cancel?wait=true")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let record: Value = response.json().await.unwrap();
    assert_eq!(record["status"], "cancelled");
    assert_eq!(record["finish_reason"], "unknown");
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(output["finish_reason"], record["finish_reason"]);
    let frames = server.events(&run_id, None).await;
    assert_calls_paired(&frames);
    let finished = frames
        .iter()
        .position(|f| f.event == "tool_execution_finished")
        .expect("the cancelled execution is finished");
    let committed = frames
        .iter()
        .position(|f| f.event == "tool_message_committed")
        .unwrap();
    assert!(finished < committed, "{:?}", kinds(&frames));
    assert!(
        frames[finished].json()["result"]["Failure"]["error"]
            .as_str()
            .unwrap()
            .starts_with("cancelled")
    );
    server.stop().await;

    // 6. A crash: a run left active in the store; a new server over the same database
    // recovers it, answering its open call as interrupted.
    let store = db.store().await;
    let session_id: SessionId = session.parse().unwrap();
    let (crashed, call_id) = leave_a_crashed_run(&store, session_id).await;
    // `recovery = "fail"` (a resumed run is tests/it/restart.rs's subject).
    let mut config = config;
    config.runtime.recovery = behest::config::Recovery::Fail;
    let server = TestServer::on_store(store, config, None).await;
    assert_eq!(server.runtime.recover().await.unwrap(), 1);
    let frames = server.events(&crashed.to_string(), None).await;
    // After the model call that made the call.
    let frames = &frames[4..];
    assert_eq!(
        kinds(frames),
        vec![
            "assistant_message_committed",
            "tool_execution_started",
            "tool_execution_finished",
            "tool_message_committed",
            "run_failed"
        ]
    );
    assert_eq!(frames[4].json()["error_class"], "interrupted");
    assert!(
        frames[2].json()["result"]["Failure"]["error"]
            .as_str()
            .unwrap()
            .starts_with("interrupted")
    );
    let messages = server
        .get_json(&format!("/sessions/{session}/messages"))
        .await;
    let interrupted = messages["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["tool_call_id"] == call_id.as_str())
        .expect("the open call has a tool message");
    assert!(
        interrupted["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("interrupted: the server stopped before this tool call finished")
    );

    // 7. The session keeps working.
    fake.push(Reply::sse(&script.text("Still here.")));
    let (_, frames, record) = run(&server, body("still there?", Some(&session))).await;
    assert_eq!(record["status"], "completed", "{:?}", kinds(&frames));
    server.stop().await;

    // Every request of the session is one the provider accepts.
    let requests = fake.requests();
    assert_eq!(requests.len(), 12);
    // The incomplete answers were context for the next model call.
    let next = requests[10].body["messages"].to_string();
    assert!(
        next.contains("Half an answer") && next.contains("Cut answer"),
        "{next}"
    );
    for (n, request) in requests.iter().enumerate() {
        let errors = match wire {
            Wire::OpenAi => validate_openai_request(&request.body),
            Wire::Anthropic => validate_anthropic_request(&request.body),
        };
        assert!(
            errors.is_empty(),
            "request {n} is invalid: {errors:?}\n{}",
            serde_json::to_string_pretty(&request.body["messages"]).unwrap()
        );
    }
    db.cleanup().await;
}

async fn openai_session(backend: Backend) {
    a_session_survives_everything(backend, Wire::OpenAi).await;
}

async fn anthropic_session(backend: Backend) {
    a_session_survives_everything(backend, Wire::Anthropic).await;
}

on_both_backends!(openai_session, anthropic_session);

/// The validators reject what the providers reject.
#[test]
fn the_validators_catch_broken_histories() {
    let unanswered = json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "user", "content": "again"},
    ]});
    assert!(!validate_openai_request(&unanswered).is_empty());
    let empty = json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": ""},
    ]});
    assert!(!validate_openai_request(&empty).is_empty());
    let bad_arguments = json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\":"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "error"},
    ]});
    assert!(!validate_openai_request(&bad_arguments).is_empty());
    let orphan_result = json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "tool", "tool_call_id": "c9", "content": "x"},
    ]});
    assert!(!validate_openai_request(&orphan_result).is_empty());
    let good = json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "assistant", "content": "3"},
    ]});
    assert_eq!(validate_openai_request(&good), Vec::<String>::new());

    let thinking_last = json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "add", "input": {}},
            {"type": "thinking", "thinking": "hm", "signature": "s"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"}]},
    ]});
    assert!(!validate_anthropic_request(&thinking_last).is_empty());
    let empty_text = json!({"messages": [
        {"role": "user", "content": [{"type": "text", "text": ""}]},
    ]});
    assert!(!validate_anthropic_request(&empty_text).is_empty());
    let unanswered = json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "add", "input": {}}]},
        {"role": "user", "content": "again"},
    ]});
    assert!(!validate_anthropic_request(&unanswered).is_empty());
    let good = json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "tool_use", "id": "t1", "name": "add", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"}]},
    ]});
    assert_eq!(validate_anthropic_request(&good), Vec::<String>::new());
    let mut thinking_on = good.clone();
    thinking_on["thinking"] = json!({"type": "enabled", "budget_tokens": 2048});
    assert_eq!(
        validate_anthropic_request(&thinking_on),
        Vec::<String>::new()
    );
    let toggled = json!({"thinking": {"type": "enabled", "budget_tokens": 2048}, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "add", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"}]},
    ]});
    assert!(!validate_anthropic_request(&toggled).is_empty());
}
