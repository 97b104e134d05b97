//! The provider adapters and the run loop together, over HTTP (issue #8): a real behest
//! server against the fake provider replaying the committed fixtures, on each wire format
//! (OpenAI Chat Completions, Anthropic Messages) and each store backend.
//!
//! - Reasoning (DeepSeek `reasoning_content` with a tool call; Anthropic extended thinking with
//!   a signature, a redacted block and two interleaved `tool_use` blocks) is streamed as
//!   `reasoning_delta`, never `text_delta`, stored with the assistant message, and replayed in
//!   the next request (DeepSeek with `reasoning_replay = "tool_turns"`: `reasoning_content`;
//!   Anthropic: the thinking blocks first, with their signature and data).
//! - A retry of a model call is a `model_retrying` event between `model_started` and the
//!   answer; when every attempt fails the run fails with the last attempt's class.
//! - Garbled tool calls (llama.cpp style; Anthropic cut by `max_tokens`) get a `Failure` the
//!   model sees in its next request, and the run goes on.
//!
//! Every request the fake receives passes `support::validate`; every event validates against
//! the OpenAPI document's `AgentEvent` schema.

use crate::support;

use behest::config::Config;
use serde_json::{Value, json};
use support::db::Backend;
use support::fake_anthropic;
use support::fake_openai::{self, FakeOpenAi, RecordedRequest, Reply};
use support::schema::EventSchema;
use support::server::{Frame, TestServer};
use support::validate::{validate_anthropic_request, validate_openai_request};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wire {
    OpenAi,
    Anthropic,
}

/// One provider `fake` of this wire format; `extra` is added to its table (e.g.
/// `reasoning_replay`), `retry` is its `[providers.fake.retry]` table.
fn config(wire: Wire, base_url: &str, extra: &str, retry: &str) -> Config {
    let kind = match wire {
        Wire::OpenAi => "openai",
        Wire::Anthropic => "anthropic",
    };
    let toml = format!(
        "[providers.fake]\nkind = \"{kind}\"\nbase_url = \"{base_url}\"\n{extra}\n\
         [providers.fake.timeouts]\nconnect_ms = 2000\nfirst_byte_ms = 5000\nidle_ms = 1500\ntotal_ms = 20000\n\
         [providers.fake.retry]\n{retry}\n\
         [providers.fake.models.fake-model]\ncontext_window = 128000\nmax_output_tokens = 1024\n"
    );
    Config::from_toml(&toml).unwrap()
}

fn text(wire: Wire, text: &str) -> Vec<u8> {
    match wire {
        Wire::OpenAi => fake_openai::text_stream(&[text]),
        Wire::Anthropic => fake_anthropic::text_stream(&[text]),
    }
}

fn kinds(frames: &[Frame]) -> Vec<&str> {
    frames.iter().map(|f| f.event.as_str()).collect()
}

fn of_kind(frames: &[Frame], kind: &str) -> Vec<Value> {
    frames
        .iter()
        .filter(|f| f.event == kind)
        .map(Frame::json)
        .collect()
}

/// The `delta` of every event of `kind` (`text_delta`, `reasoning_delta`), in order.
fn deltas(frames: &[Frame], kind: &str) -> Vec<String> {
    of_kind(frames, kind)
        .iter()
        .map(|e| e["delta"].as_str().unwrap().to_owned())
        .collect()
}

/// Runs `input` (in `session` if given) to its end; every event validates against the schema.
async fn run(server: &TestServer, input: &str, session: Option<&str>) -> (Vec<Frame>, Value) {
    let run_id = server.start_run(input, session).await;
    let record = server.finished_run(&run_id).await;
    let frames = server.events(&run_id, None).await;
    let schema = EventSchema::new();
    for frame in &frames {
        let event = frame.json();
        assert_eq!(event["type"], frame.event.as_str(), "{event}");
        schema.check(&event);
    }
    (frames, record)
}

/// Every request passes the wire's validators.
fn assert_valid(wire: Wire, requests: &[RecordedRequest]) {
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
}

/// The session's stored messages.
async fn messages(server: &TestServer, session: &str) -> Vec<Value> {
    server
        .get_json(&format!("/sessions/{session}/messages"))
        .await["messages"]
        .as_array()
        .unwrap()
        .clone()
}

// ---------------------------------------------------------------------------------------------
// 1. Reasoning: streamed as its own event, stored, replayed.

async fn deepseek_reasoning_is_streamed_stored_and_replayed(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let config = config(
        Wire::OpenAi,
        &fake.base_url(),
        "reasoning_replay = \"tool_turns\"",
        "max_attempts = 1",
    );
    let Some(server) = TestServer::start(backend, config).await else {
        return;
    };
    fake.push(Reply::sse(&fake_openai::fixture(
        "deepseek_reasoning_tool_call.sse",
    )));
    fake.push(Reply::sse(&text(Wire::OpenAi, "The notes are empty.")));
    let (frames, record) = run(&server, "what is in notes.md?", None).await;
    assert_eq!(record["status"], "completed", "{:?}", kinds(&frames));
    let reasoning = deltas(&frames, "reasoning_delta");
    assert_eq!(reasoning, ["I should look ", "up the file first."]);
    let text: String = deltas(&frames, "text_delta").concat();
    assert_eq!(text, "The notes are empty.");
    // Reasoning tokens reported by the server are counted.
    let usage = &of_kind(&frames, "usage_recorded")[0]["usage"];
    assert_eq!(usage["reasoning_tokens"], 37, "{usage}");
    assert_eq!(usage["estimated"], false, "{usage}");

    let session = record["session_id"].as_str().unwrap();
    let stored = messages(&server, session).await;
    let with_call = stored
        .iter()
        .find(|m| m["role"] == "assistant" && m["tool_calls"][0]["name"] == "read_file")
        .expect("the tool turn is stored");
    assert_eq!(
        with_call["reasoning"],
        json!([{"text": "I should look up the file first."}])
    );

    let requests = fake.requests();
    assert_eq!(requests.len(), 2);
    let replayed = requests[1].body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "assistant")
        .expect("the tool turn is replayed")
        .clone();
    assert_eq!(
        replayed["reasoning_content"], "I should look up the file first.",
        "{replayed}"
    );
    assert_eq!(
        replayed["tool_calls"][0]["id"], "call_00_Vw9dEfHk2mXoP4rT",
        "{replayed}"
    );
    assert_valid(Wire::OpenAi, &requests);
    server.stop().await;
}

async fn anthropic_thinking_is_streamed_stored_and_replayed_first(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let config = config(Wire::Anthropic, &fake.base_url(), "", "max_attempts = 1");
    let Some(server) = TestServer::start(backend, config).await else {
        return;
    };
    fake.push(Reply::sse(&fake_anthropic::fixture(
        "thinking_interleaved_tool_use.sse",
    )));
    fake.push(Reply::sse(&text(Wire::Anthropic, "Sunny, 14:00.")));
    let (frames, record) = run(&server, "weather and time in Paris?", None).await;
    assert_eq!(record["status"], "completed", "{:?}", kinds(&frames));
    let reasoning = deltas(&frames, "reasoning_delta");
    assert_eq!(
        reasoning,
        [
            "The user wants weather and time. ",
            "Two independent calls."
        ]
    );
    let text = deltas(&frames, "text_delta");
    assert_eq!(text, ["Checking both.", "Sunny, 14:00."]);
    let calls: Vec<Value> = of_kind(&frames, "tool_call_completed")
        .iter()
        .map(|e| e["call"].clone())
        .collect();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(calls[0]["arguments"], json!({"location": "Paris"}));
    assert_eq!(calls[1]["arguments"], json!({"timezone": "Europe/Paris"}));

    let session = record["session_id"].as_str().unwrap();
    let stored = messages(&server, session).await;
    let with_calls = stored
        .iter()
        .find(|m| {
            m["role"] == "assistant" && m["tool_calls"].as_array().is_some_and(|c| c.len() == 2)
        })
        .expect("the tool turn is stored");
    assert_eq!(
        with_calls["reasoning"],
        json!([
            {"text": "The user wants weather and time. Two independent calls.",
             "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds"},
            {"text": "", "redacted_data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIwxtE3rAFBa8cr3qpP"},
        ])
    );

    let requests = fake.requests();
    assert_eq!(requests.len(), 2);
    let turn = requests[1].body["messages"][1].clone();
    assert_eq!(turn["role"], "assistant", "{turn}");
    let types: Vec<&str> = turn["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        [
            "thinking",
            "redacted_thinking",
            "text",
            "tool_use",
            "tool_use"
        ],
        "{turn}"
    );
    assert_eq!(
        turn["content"][0],
        json!({"type": "thinking",
               "thinking": "The user wants weather and time. Two independent calls.",
               "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds"})
    );
    assert_eq!(
        turn["content"][1],
        json!({"type": "redacted_thinking",
               "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIwxtE3rAFBa8cr3qpP"})
    );
    assert_valid(Wire::Anthropic, &requests);
    server.stop().await;
}

/// Thinking on and a forced first call: the forced call goes without thinking (the API does
/// not allow both), and so does the rest of that tool-use loop (one thinking configuration per
/// assistant turn: with thinking on, the API rejects a final assistant turn that does not start
/// with a thinking block); the session's next run thinks again.
async fn anthropic_forced_call_with_thinking_keeps_one_configuration_per_turn(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let toml = format!(
        "builtin_tools = [\"current_time\"]\n\
         [providers.fake]\nkind = \"anthropic\"\nbase_url = \"{}\"\nthinking_budget_tokens = 2048\n\
         [providers.fake.retry]\nmax_attempts = 1\n\
         [providers.fake.models.fake-model]\ncontext_window = 128000\nmax_output_tokens = 4096\n",
        fake.base_url()
    );
    let Some(server) = TestServer::start(backend, Config::from_toml(&toml).unwrap()).await else {
        return;
    };
    let tool_use = {
        use fake_anthropic::{event, message_end, message_start};
        let mut body = message_start(30);
        body.push_str(&event(&json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "tool_use", "id": "toolu_forced", "name": "current_time", "input": {}}})));
        body.push_str(&event(&json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": "{}"}})));
        body.push_str(&event(&json!({"type": "content_block_stop", "index": 0})));
        body.push_str(&message_end("tool_use", 12));
        body.into_bytes()
    };
    fake.push(Reply::sse(&tool_use));
    fake.push(Reply::sse(&text(Wire::Anthropic, "It is noon.")));
    let created = server
        .create_run(
            json!({"provider": "fake", "model": "fake-model", "input": "time?",
                           "tool_choice": {"name": "current_time"}}),
        )
        .await;
    let run_id = created["run_id"].as_str().unwrap();
    let record = server.finished_run(run_id).await;
    assert_eq!(record["status"], "completed", "{record}");
    let session = record["session_id"].as_str().unwrap();
    fake.push(Reply::sse(&fake_anthropic::fixture(
        "thinking_interleaved_tool_use.sse",
    )));
    fake.push(Reply::sse(&text(Wire::Anthropic, "Sunny, 14:00.")));
    let (frames, record) = run(&server, "weather and time in Paris?", Some(session)).await;
    assert_eq!(record["status"], "completed", "{:?}", kinds(&frames));

    let requests = fake.requests();
    assert_eq!(requests.len(), 4);
    let thinking: Vec<&Value> = requests.iter().map(|r| &r.body["thinking"]).collect();
    let on = json!({"type": "enabled", "budget_tokens": 2048});
    assert_eq!(thinking, [&Value::Null, &Value::Null, &on, &on]);
    assert_eq!(
        requests[0].body["tool_choice"],
        json!({"type": "tool", "name": "current_time"})
    );
    assert_eq!(requests[1].body["tool_choice"], json!({"type": "auto"}));
    assert_valid(Wire::Anthropic, &requests);
    server.stop().await;
}

/// What one recorded OpenAI-compatible turn shows over HTTP.
struct Recorded {
    fixture: &'static str,
    /// The reasoning streamed as `reasoning_delta`s, joined.
    reasoning: &'static str,
    /// The answer text streamed as `text_delta`s, joined (the follow-up answer when the turn
    /// calls tools).
    text: &'static str,
    /// The names of the calls completed.
    calls: &'static [&'static str],
    finish_reason: &'static str,
    reasoning_tokens: Option<u64>,
}

/// One session through the recorded streams of llama.cpp, Ollama, vLLM, OpenAI (refusal,
/// reasoning tokens) and an interrupted generation: reasoning is never answer text, every call
/// completes once, each run ends with the right finish reason, and every request of the
/// session is valid.
async fn openai_compatible_servers_in_one_session(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let config = config(
        Wire::OpenAi,
        &fake.base_url(),
        "reasoning_replay = \"tool_turns\"",
        "max_attempts = 1",
    );
    let Some(server) = TestServer::start(backend, config).await else {
        return;
    };
    let turns = [
        Recorded {
            fixture: "llamacpp_reasoning_tool_call.sse",
            reasoning: "The user wants the weather in Paris. I will call get_weather.",
            text: "Done.",
            calls: &["get_weather"],
            finish_reason: "stop",
            reasoning_tokens: None,
        },
        Recorded {
            fixture: "ollama_reasoning_tool_call.sse",
            reasoning: "Need the time in Tokyo.",
            text: "Done.",
            calls: &["get_time"],
            finish_reason: "stop",
            reasoning_tokens: None,
        },
        Recorded {
            fixture: "vllm_reasoning_text.sse",
            reasoning: "2 + 2: add the units.",
            text: "The answer is 4.",
            calls: &[],
            finish_reason: "stop",
            reasoning_tokens: None,
        },
        Recorded {
            fixture: "openai_refusal.sse",
            reasoning: "",
            text: "I'm sorry, I can't help with that.",
            calls: &[],
            finish_reason: "content_filter",
            reasoning_tokens: None,
        },
        Recorded {
            fixture: "no_finish_reason.sse",
            reasoning: "",
            text: "The report covers three",
            calls: &[],
            finish_reason: "unknown",
            reasoning_tokens: None,
        },
        Recorded {
            fixture: "openai_reasoning_tokens.sse",
            reasoning: "",
            text: "Paris is the capital.",
            calls: &[],
            finish_reason: "stop",
            reasoning_tokens: Some(192),
        },
    ];
    let mut session: Option<String> = None;
    for turn in &turns {
        fake.push(Reply::sse(&fake_openai::fixture(turn.fixture)));
        if !turn.calls.is_empty() {
            fake.push(Reply::sse(&text(Wire::OpenAi, turn.text)));
        }
        let (frames, record) = run(&server, turn.fixture, session.as_deref()).await;
        let name = turn.fixture;
        assert_eq!(
            record["status"],
            "completed",
            "{name}: {:?}",
            kinds(&frames)
        );
        assert_eq!(record["finish_reason"], turn.finish_reason, "{name}");
        session = record["session_id"].as_str().map(str::to_owned);
        let joined = |kind: &str| -> String {
            of_kind(&frames, kind)
                .iter()
                .map(|e| e["delta"].as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(joined("reasoning_delta"), turn.reasoning, "{name}");
        assert_eq!(joined("text_delta"), turn.text, "{name}");
        let calls: Vec<String> = of_kind(&frames, "tool_call_completed")
            .iter()
            .map(|e| {
                assert!(e["call"]["invalid_arguments"].is_null(), "{name}: {e}");
                e["call"]["name"].as_str().unwrap().to_owned()
            })
            .collect();
        assert_eq!(calls, turn.calls, "{name}");
        if let Some(tokens) = turn.reasoning_tokens {
            let usage = &of_kind(&frames, "usage_recorded")[0]["usage"];
            assert_eq!(usage["reasoning_tokens"], tokens, "{name}: {usage}");
        }
    }
    // The session goes on; its history carries all of the above.
    fake.push(Reply::sse(&text(Wire::OpenAi, "Still here.")));
    let (frames, record) = run(&server, "still there?", session.as_deref()).await;
    assert_eq!(record["status"], "completed", "{:?}", kinds(&frames));
    let requests = fake.requests();
    assert_eq!(requests.len(), turns.len() + 2 + 1);
    let last = requests.last().unwrap().body["messages"].to_string();
    assert!(
        last.contains("\"reasoning_content\":\"Need the time in Tokyo.\""),
        "{last}"
    );
    assert_valid(Wire::OpenAi, &requests);
    server.stop().await;
}

// ---------------------------------------------------------------------------------------------
// 2. Retries are visible.

/// Retries without waiting: three attempts, 1 ms backoff, no jitter.
const FAST_RETRY: &str =
    "max_attempts = 3\ninitial_backoff_ms = 1\nmax_backoff_ms = 5\njitter = false";

/// A 503 and the class it gets: OpenAI-compatible by status (`overloaded`), Anthropic by its
/// error type first (`api_error`: `server`).
fn server_error(wire: Wire) -> (Reply, &'static str) {
    match wire {
        Wire::OpenAi => (
            Reply::status(
                503,
                json!({"error": {"message": "The server is overloaded", "type": "server_error"}}),
            ),
            "overloaded",
        ),
        Wire::Anthropic => (
            Reply::status(
                503,
                fake_anthropic::error_body("api_error", "Service unavailable"),
            ),
            "server",
        ),
    }
}

fn rate_limited(wire: Wire) -> Reply {
    let body = match wire {
        Wire::OpenAi => {
            json!({"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}})
        }
        Wire::Anthropic => fake_anthropic::error_body("rate_limit_error", "Rate limited"),
    };
    Reply::status(429, body).header("retry-after", "0")
}

async fn a_retry_is_an_event_then_the_answer(backend: Backend, wire: Wire) {
    let fake = FakeOpenAi::start().await;
    let Some(server) =
        TestServer::start(backend, config(wire, &fake.base_url(), "", FAST_RETRY)).await
    else {
        return;
    };

    // A 503 once, then a good stream.
    let (unavailable, class) = server_error(wire);
    fake.push(unavailable.clone());
    fake.push(Reply::sse(&text(wire, "Recovered.")));
    let (frames, record) = run(&server, "hello", None).await;
    assert_eq!(record["status"], "completed", "{:?}", kinds(&frames));
    let k = kinds(&frames);
    let started = k.iter().position(|e| *e == "model_started").unwrap();
    let retrying = k.iter().position(|e| *e == "model_retrying").unwrap();
    let first_text = k.iter().position(|e| *e == "text_delta").unwrap();
    assert!(started < retrying && retrying < first_text, "{k:?}");
    assert_eq!(k.iter().filter(|e| **e == "model_retrying").count(), 1);
    let retry = frames[retrying].json();
    assert_eq!(retry["attempt"], 1, "{retry}");
    assert_eq!(retry["error_class"], class, "{retry}");
    assert_eq!(retry["delay_ms"], 1, "{retry}");
    // The provider's own message.
    assert!(
        ["The server is overloaded", "Service unavailable"]
            .iter()
            .any(|m| retry["error"].as_str().unwrap().contains(m)),
        "{retry}"
    );
    let run_id = frames[0].json()["run_id"].as_str().unwrap().to_owned();
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(output["messages"][0]["content"][0]["text"], "Recovered.");

    // A 429 with `retry-after: 0`, then a good stream in the same session.
    let session = record["session_id"].as_str().unwrap().to_owned();
    fake.push(rate_limited(wire));
    fake.push(Reply::sse(&text(wire, "Again.")));
    let (frames, record) = run(&server, "again", Some(&session)).await;
    assert_eq!(record["status"], "completed", "{:?}", kinds(&frames));
    let retries = of_kind(&frames, "model_retrying");
    assert_eq!(retries.len(), 1, "{:?}", kinds(&frames));
    assert_eq!(retries[0]["attempt"], 1);
    assert_eq!(retries[0]["error_class"], "rate_limited");
    assert_eq!(retries[0]["delay_ms"], 0);

    // Every attempt fails: two retries, then `run_failed` with the last attempt's class.
    for _ in 0..3 {
        fake.push(unavailable.clone());
    }
    let (frames, record) = run(&server, "once more", Some(&session)).await;
    assert_eq!(record["status"], "failed", "{:?}", kinds(&frames));
    let retries = of_kind(&frames, "model_retrying");
    assert_eq!(
        retries
            .iter()
            .map(|r| r["attempt"].clone())
            .collect::<Vec<_>>(),
        [json!(1), json!(2)]
    );
    assert_eq!(retries[1]["delay_ms"], 2, "exponential: {retries:?}");
    assert!(retries.iter().all(|r| r["error_class"] == class));
    let last = frames.last().unwrap();
    assert_eq!(last.event, "run_failed", "{:?}", kinds(&frames));
    assert_eq!(last.json()["error_class"], class, "{}", last.data);
    assert!(!kinds(&frames).contains(&"text_delta"));

    let requests = fake.requests();
    assert_eq!(requests.len(), 7);
    assert_valid(wire, &requests);
    server.stop().await;
}

async fn openai_retries(backend: Backend) {
    a_retry_is_an_event_then_the_answer(backend, Wire::OpenAi).await;
}

async fn anthropic_retries(backend: Backend) {
    a_retry_is_an_event_then_the_answer(backend, Wire::Anthropic).await;
}

// ---------------------------------------------------------------------------------------------
// 3. Garbled tool calls: a Failure the model sees, and the run goes on.

async fn garbled_calls_are_failures_the_model_sees(backend: Backend, wire: Wire) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(
        backend,
        config(wire, &fake.base_url(), "", "max_attempts = 1"),
    )
    .await
    else {
        return;
    };
    // The fixture, its call ids, and which calls' argument text is not JSON (llama.cpp style:
    // a raw newline inside a string is tolerated; two concatenated objects and a call cut by
    // `length` are not).
    let (fixture, ids, invalid): (Vec<u8>, Vec<&str>, Vec<bool>) = match wire {
        Wire::OpenAi => (
            fake_openai::fixture("garbled_tool_calls.sse"),
            vec!["c0", "c1", "c2"],
            vec![false, true, true],
        ),
        Wire::Anthropic => (
            fake_anthropic::fixture("max_tokens_in_tool_use.sse"),
            vec!["toolu_01C29s92sy92ns139057ns1"],
            vec![true],
        ),
    };
    fake.push(Reply::sse(&fixture));
    fake.push(Reply::sse(&text(wire, "Those calls were broken.")));
    let (frames, record) = run(&server, "write the files", None).await;
    assert_eq!(record["status"], "completed", "{:?}", kinds(&frames));
    assert_eq!(record["finish_reason"], "stop");

    // Every started call completes, with its raw text when it was not JSON, and gets a
    // Failure result.
    let started: Vec<Value> = of_kind(&frames, "tool_call_started")
        .iter()
        .map(|e| e["call_id"].clone())
        .collect();
    let completed: Vec<Value> = of_kind(&frames, "tool_call_completed")
        .iter()
        .map(|e| e["call"].clone())
        .collect();
    assert_eq!(
        completed
            .iter()
            .map(|c| c["id"].clone())
            .collect::<Vec<_>>(),
        started
    );
    assert_eq!(started, ids.iter().map(|id| json!(id)).collect::<Vec<_>>());
    for (call, invalid) in completed.iter().zip(&invalid) {
        assert_eq!(call["invalid_arguments"].is_string(), *invalid, "{call}");
        if *invalid {
            assert_eq!(call["arguments"], json!({}), "{call}");
        }
    }
    // Each call gets a Failure: the invalid ones for their arguments, the others because no
    // such tool is configured.
    let finished = of_kind(&frames, "tool_execution_finished");
    assert_eq!(finished.len(), ids.len(), "{:?}", kinds(&frames));
    for (result, invalid) in finished.iter().zip(&invalid) {
        let error = result["result"]["Failure"]["error"].as_str().unwrap();
        assert_eq!(
            error.starts_with("the arguments were not valid JSON"),
            *invalid,
            "{error}"
        );
    }

    let requests = fake.requests();
    assert_eq!(requests.len(), 2);
    let next = &requests[1].body["messages"];
    match wire {
        Wire::OpenAi => {
            let results: Vec<&Value> = next
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m["role"] == "tool")
                .collect();
            assert_eq!(results.len(), 3, "{next}");
            for (result, id) in results.iter().zip(&ids) {
                assert_eq!(result["tool_call_id"], *id);
                assert!(
                    result["content"].as_str().unwrap().starts_with("error: "),
                    "{result}"
                );
            }
        }
        Wire::Anthropic => {
            let turn = next.as_array().unwrap().last().unwrap();
            assert_eq!(turn["role"], "user", "{next}");
            let result = turn["content"]
                .as_array()
                .unwrap()
                .iter()
                .find(|b| b["type"] == "tool_result")
                .expect("a tool_result");
            assert_eq!(result["tool_use_id"], ids[0]);
            assert_eq!(result["is_error"], true, "{result}");
        }
    }
    assert_valid(wire, &requests);
    server.stop().await;
}

async fn openai_garbled_calls(backend: Backend) {
    garbled_calls_are_failures_the_model_sees(backend, Wire::OpenAi).await;
}

async fn anthropic_cut_call(backend: Backend) {
    garbled_calls_are_failures_the_model_sees(backend, Wire::Anthropic).await;
}

on_both_backends!(
    deepseek_reasoning_is_streamed_stored_and_replayed,
    anthropic_thinking_is_streamed_stored_and_replayed_first,
    anthropic_forced_call_with_thinking_keeps_one_configuration_per_turn,
    openai_compatible_servers_in_one_session,
    openai_retries,
    anthropic_retries,
    openai_garbled_calls,
    anthropic_cut_call,
);
