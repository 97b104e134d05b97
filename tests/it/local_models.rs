//! Local model servers (issue 24), against a fake that replays the exact bytes a real
//! `llama-cpp-python[server]` (SmolLM2-135M, a 2,048-token window) sent for each case, recorded
//! in `tests/fixtures/llama_cpp_python/`: a tool call, a text answer, the `500` it answers to an
//! assistant message with `"content": null`, the empty `200` event stream it answers to a
//! streaming request over its window and the `400 context_length_exceeded` it answers to the
//! same request without streaming. The fake plays that server: it looks at each request the way
//! the server does (a null content, the request's size against its window) and answers with the
//! recorded bytes. Both store backends.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use behest::config::Config;
use behest::runtime::compaction::SUMMARISER_PROMPT;
use serde_json::{Value, json};
use support::db::Backend;
use support::fake_openai::{self, FakeOpenAi, RecordedRequest, Reply};
use support::lookup::LookupServer;
use support::schema::EventSchema;
use support::server::{Frame, TestServer};
use support::validate::validate_openai_request;

/// The server's real window, in tokens (`--n_ctx 2048`).
const SERVER_WINDOW: u64 = 2_048;
/// Each request's output limit.
const MAX_OUTPUT: u64 = 200;

/// A recorded answer of `tests/fixtures/llama_cpp_python/`.
fn fixture(name: &str) -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llama_cpp_python")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A config with the `fake` provider at `base_url` (its model `smollm2` with a `window`-token
/// window, maybe larger than the server's), the `lookup` tool, and `extra` TOML (provider
/// options, `[compaction]`) — default provider options unless `extra` sets some, except
/// `forced_tool_choice = "named"`, which this server needs to force a tool.
fn config(base_url: &str, tools: &LookupServer, window: u64, provider_extra: &str) -> Config {
    let toml = format!(
        "[http_tools.lookup]\ndescription = \"Looks a record up by its key.\"\n\
         url = \"{}\"\n\
         parameters = {{ type = \"object\", properties = {{ key = {{ type = \"string\" }} }}, \
         required = [\"key\"] }}\n\
         [providers.fake]\nkind = \"openai\"\nbase_url = \"{base_url}\"\n\
         forced_tool_choice = \"named\"\n{provider_extra}\n\
         [providers.fake.timeouts]\nconnect_ms = 2000\nfirst_byte_ms = 5000\nidle_ms = 5000\ntotal_ms = 20000\n\
         [providers.fake.retry]\nmax_attempts = 3\ninitial_backoff_ms = 20\nmax_backoff_ms = 50\n\
         [providers.fake.models.smollm2]\ncontext_window = {window}\nmax_output_tokens = {MAX_OUTPUT}\n",
        tools.url()
    );
    Config::from_toml(&toml).unwrap()
}

// ---------------------------------------------------------------------------------------------
// The server

/// How the fake server reports usage.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Usage {
    /// As recorded: none in streams.
    Recorded,
    /// `factor` × the fake's count of the request (another tokenizer than behest's), for
    /// calibration.
    Scaled(f64),
}

/// The fake playing `llama-cpp-python`'s server.
struct LlamaCppPython {
    usage: Usage,
    /// Requests answered with the recorded `500` (an assistant message with null content).
    null_content: AtomicUsize,
    /// Streaming requests over the window answered with an empty `200` event stream.
    empty_streams: AtomicUsize,
    /// Requests over the window answered without streaming (the `400`).
    refused: AtomicUsize,
    /// Answers to give instead of the next (non-summariser) requests, in order.
    instead: std::sync::Mutex<std::collections::VecDeque<Reply>>,
    /// Whether the window is enforced (default true).
    enforcing: std::sync::atomic::AtomicBool,
}

impl LlamaCppPython {
    fn attach(fake: &FakeOpenAi, usage: Usage) -> Arc<Self> {
        let server = Arc::new(Self {
            usage,
            null_content: AtomicUsize::new(0),
            empty_streams: AtomicUsize::new(0),
            refused: AtomicUsize::new(0),
            instead: std::sync::Mutex::new(std::collections::VecDeque::new()),
            enforcing: std::sync::atomic::AtomicBool::new(true),
        });
        let answering = Arc::clone(&server);
        fake.respond_with(move |request| Some(answering.answer(request)));
        server
    }

    fn instead_of_next(&self, reply: Reply) {
        self.instead.lock().unwrap().push_back(reply);
    }

    fn answer(&self, request: &RecordedRequest) -> Reply {
        let body = &request.body;
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        // Its request model refuses a null content (pydantic), before anything else.
        if messages
            .iter()
            .any(|m| m["role"] == "assistant" && m.get("content") == Some(&Value::Null))
        {
            self.null_content.fetch_add(1, Ordering::SeqCst);
            return Reply::raw(500, "application/json", &fixture("content_null.500.json"));
        }
        let prompt = fake_openai::prompt_tokens(body);
        let max_tokens = body["max_tokens"].as_u64().unwrap_or(MAX_OUTPUT);
        if self.enforcing.load(Ordering::SeqCst) && prompt + max_tokens > SERVER_WINDOW {
            if body["stream"] == true {
                self.empty_streams.fetch_add(1, Ordering::SeqCst);
                return Reply::sse(&fixture("overflow.sse"));
            }
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Reply::raw(400, "application/json", &fixture("overflow.400.json"));
        }
        if !is_summariser(body)
            && let Some(reply) = self.instead.lock().unwrap().pop_front()
        {
            return reply;
        }
        if body["stream"] != true {
            // Only an over-long request is asked again without streaming here; answered as
            // recorded otherwise.
            return Reply::raw(200, "application/json", &fixture("text.json"));
        }
        let last_is_result = messages.last().is_some_and(|m| m["role"] == "tool");
        // Its default chat handler forces a call (a grammar) only for a named function's
        // object; a "required" string is accepted and ignored.
        let forced = body["tool_choice"]["type"] == "function";
        let name = if forced && !last_is_result {
            "tool_call.sse"
        } else {
            "text.sse"
        };
        Reply::sse(&self.with_usage(&fixture(name), prompt))
    }

    /// The recorded stream (the server reports no usage in streams) with a usage chunk before
    /// `[DONE]` when this fake reports usage.
    fn with_usage(&self, bytes: &[u8], prompt: u64) -> Vec<u8> {
        let Usage::Scaled(factor) = self.usage else {
            return bytes.to_vec();
        };
        let input = (prompt as f64 * factor).round() as u64;
        let text = String::from_utf8_lossy(bytes).into_owned();
        let usage = fake_openai::sse_data(&json!({
            "id": "chatcmpl-usage", "object": "chat.completion.chunk", "created": 1796382329,
            "model": "smollm2", "choices": [],
            "usage": {"prompt_tokens": input, "completion_tokens": 8, "total_tokens": input + 8},
        }));
        text.replace("data: [DONE]", &format!("{usage}data: [DONE]"))
            .into_bytes()
    }
}

/// The system prompt of a Chat Completions request (its system messages).
fn system_of(body: &Value) -> String {
    body["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["role"] == "system")
        .filter_map(|m| m["content"].as_str())
        .collect::<Vec<_>>()
        .join("\n\n")
}

fn is_summariser(body: &Value) -> bool {
    system_of(body).starts_with(SUMMARISER_PROMPT)
}

// ---------------------------------------------------------------------------------------------
// Driving runs

async fn run(server: &TestServer, body: Value) -> (Vec<Frame>, Value) {
    let created = server.create_run(body).await;
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    let frames = tokio::time::timeout(Duration::from_secs(30), server.events(&run_id, None))
        .await
        .expect("the run ends within 30 s");
    static SCHEMA: std::sync::LazyLock<EventSchema> = std::sync::LazyLock::new(EventSchema::new);
    for frame in &frames {
        SCHEMA.check(&frame.json());
    }
    let record = server.get_json(&format!("/runs/{run_id}")).await;
    (frames, record)
}

/// A turn: "Turn N: look k N up." with the `lookup` tool forced on its first call.
fn turn(n: usize, session: Option<&str>) -> Value {
    let mut body = json!({
        "provider": "fake", "model": "smollm2",
        "input": format!("Turn {n}: look k{n} up and tell me what it says."),
        "tools": ["lookup"],
        "tool_choice": {"type": "function", "name": "lookup"},
    });
    if let Some(session) = session {
        body["session_id"] = Value::from(session);
    }
    body
}

fn of_type<'a>(frames: &'a [Frame], event: &str) -> Vec<&'a Frame> {
    frames.iter().filter(|f| f.event == event).collect()
}

/// Runs `turns` turns in one session; every run must complete. Returns each run's frames.
async fn session(server: &TestServer, turns: usize) -> (String, Vec<Vec<Frame>>) {
    let mut session: Option<String> = None;
    let mut all = Vec::new();
    for n in 1..=turns {
        let (frames, record) = run(server, turn(n, session.as_deref())).await;
        assert_eq!(
            record["status"], "completed",
            "turn {n}: {record} {frames:?}"
        );
        session = Some(record["session_id"].as_str().unwrap().to_owned());
        all.push(frames);
    }
    (session.unwrap(), all)
}

// ---------------------------------------------------------------------------------------------
// Tests

/// Item 1: with default provider options a tool loop works against the server (an assistant
/// message with tool calls carries `"content": ""`, which it accepts), every request is valid.
async fn a_tool_loop_works_with_default_options(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let server_model = LlamaCppPython::attach(&fake, Usage::Recorded);
    let tools = LookupServer::start(60).await;
    let Some(server) =
        TestServer::start(backend, config(&fake.base_url(), &tools, SERVER_WINDOW, "")).await
    else {
        return;
    };
    let (_, runs) = session(&server, 3).await;
    for frames in &runs {
        assert_eq!(of_type(frames, "tool_execution_finished").len(), 1);
        assert!(of_type(frames, "model_retrying").is_empty(), "{frames:?}");
    }
    assert_eq!(server_model.null_content.load(Ordering::SeqCst), 0);
    let requests = fake.requests();
    let model_calls = requests.iter().filter(|r| !is_summariser(&r.body)).count();
    assert_eq!(model_calls, 6, "two calls a turn, none retried");
    let mut tool_call_messages = 0;
    for request in &requests {
        assert_eq!(validate_openai_request(&request.body), Vec::<String>::new());
        for message in request.body["messages"].as_array().unwrap() {
            if message["tool_calls"].is_array() {
                assert_eq!(message["content"], "", "{message}");
                tool_call_messages += 1;
            }
        }
    }
    assert!(
        tool_call_messages >= 3,
        "every turn's second call: {tool_call_messages}"
    );
    server.stop().await;
}

/// Item 1: with `assistant_tool_call_content = "null"` the server's `500` (a pydantic
/// validation failure) is not retried, and the run's error keeps the line that names the
/// cause, not the first of the list.
async fn a_validation_500_is_not_retried_and_names_its_cause(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let server_model = LlamaCppPython::attach(&fake, Usage::Recorded);
    let tools = LookupServer::start(60).await;
    let extra = "assistant_tool_call_content = \"null\"";
    let Some(server) = TestServer::start(
        backend,
        config(&fake.base_url(), &tools, SERVER_WINDOW, extra),
    )
    .await
    else {
        return;
    };
    let (frames, record) = run(&server, turn(1, None)).await;
    assert_eq!(record["status"], "failed", "{record}");
    assert_eq!(record["error_class"], "invalid_request", "{record}");
    assert!(of_type(&frames, "model_retrying").is_empty(), "{frames:?}");
    assert_eq!(server_model.null_content.load(Ordering::SeqCst), 1);
    assert_eq!(fake.requests().len(), 2, "the tool call, then the 500 once");
    let error = record["error"].as_str().unwrap();
    assert!(error.contains(SPECIFIC_LINE), "{error}");
    assert!(!error.contains(FIRST_LINE), "{error}");
    // The session's next run works once the option is fixed: its history is valid.
    server.stop().await;
}

/// The line of the recorded `500` that names the cause (an assistant message's content must
/// be a string), and the list's first line, which does not.
const SPECIFIC_LINE: &str =
    "body.messages.1.ChatCompletionRequestAssistantMessage.content: Input should be a valid string";
const FIRST_LINE: &str = "Input should be 'system'";

/// Item 2: the server answers a streaming request over its window with an empty `200` event
/// stream; behest asks again without streaming, reads the `400 context_length_exceeded`,
/// compacts once and makes the call again. The configured window (4,096) is larger than the
/// server's (2,048): only the server's answers show it.
async fn an_empty_stream_over_the_window_compacts_and_retries(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let server_model = LlamaCppPython::attach(&fake, Usage::Recorded);
    let tools = LookupServer::start(60).await;
    let Some(server) = TestServer::start(
        backend,
        config(&fake.base_url(), &tools, 2 * SERVER_WINDOW, ""),
    )
    .await
    else {
        return;
    };
    let (_, runs) = session(&server, 12).await;
    assert!(
        server_model.empty_streams.load(Ordering::SeqCst) >= 1,
        "the session outgrew the server's window"
    );
    let reactive: Vec<Value> = runs
        .iter()
        .flat_map(|frames| of_type(frames, "context_compacted"))
        .map(Frame::json)
        .filter(|event| event["trigger"] == "reactive")
        .collect();
    assert!(!reactive.is_empty(), "a reactive compaction");
    for frames in &runs {
        let retrying: Vec<Value> = of_type(frames, "model_retrying")
            .into_iter()
            .map(Frame::json)
            .collect();
        for event in &retrying {
            assert_eq!(event["error_class"], "context_length_exceeded", "{event}");
        }
        assert!(retrying.len() <= 1, "one retry after one compaction");
    }
    // Each empty stream was asked again once without streaming, and refused.
    let unstreamed = fake
        .requests()
        .iter()
        .filter(|r| r.body["stream"] == false)
        .count();
    assert_eq!(
        unstreamed,
        server_model.empty_streams.load(Ordering::SeqCst)
    );
    assert_eq!(
        server_model.refused.load(Ordering::SeqCst),
        server_model.empty_streams.load(Ordering::SeqCst)
    );
    server.stop().await;
}

/// Item 2: an HTTP `413` (the server's or a proxy's) is an overflow too: one compaction, one
/// retry.
async fn a_413_compacts_once_and_retries(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let server_model = LlamaCppPython::attach(&fake, Usage::Recorded);
    let tools = LookupServer::start(60).await;
    let Some(server) =
        TestServer::start(backend, config(&fake.base_url(), &tools, SERVER_WINDOW, "")).await
    else {
        return;
    };
    let (session_id, _) = session(&server, 3).await;
    server_model.instead_of_next(Reply::raw(
        413,
        "text/html",
        b"<html>\r\n<head><title>413 Request Entity Too Large</title></head>\r\n<body>\r\n\
          <center><h1>413 Request Entity Too Large</h1></center>\r\n<hr><center>nginx</center>\r\n\
          </body>\r\n</html>\r\n",
    ));
    let (frames, record) = run(&server, turn(4, Some(&session_id))).await;
    assert_eq!(record["status"], "completed", "{record} {frames:?}");
    let retrying = of_type(&frames, "model_retrying");
    assert_eq!(retrying.len(), 1, "{frames:?}");
    assert_eq!(retrying[0].json()["error_class"], "context_length_exceeded");
    // The reactive compaction comes right after the retry announcement, announced before its
    // summariser is called (an automatic one may follow before the turn's next call: the
    // window is small).
    let compacted = of_type(&frames, "context_compacted");
    let reactive: Vec<_> = compacted
        .iter()
        .filter(|f| f.json()["trigger"] == "reactive")
        .collect();
    assert_eq!(reactive.len(), 1, "{frames:?}");
    let next = frames
        .iter()
        .find(|f| f.sequence() == retrying[0].sequence() + 1)
        .unwrap();
    assert_eq!(next.event, "context_compaction_started", "{frames:?}");
    assert_eq!(next.json()["trigger"], "reactive");
    assert_eq!(reactive[0].sequence(), retrying[0].sequence() + 2);
    server.stop().await;
}

/// Item 7: a stream closed cleanly after some text, without `[DONE]` or a finish reason, fails
/// the run as `transport` (never `run_completed`); cut before any output it is retried.
async fn a_truncated_stream_is_a_transport_failure(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let server_model = LlamaCppPython::attach(&fake, Usage::Recorded);
    let tools = LookupServer::start(60).await;
    let Some(server) =
        TestServer::start(backend, config(&fake.base_url(), &tools, SERVER_WINDOW, "")).await
    else {
        return;
    };
    // The recorded text answer up to its second content chunk, then a clean end.
    let text = String::from_utf8(fixture("text.sse")).unwrap();
    let events: Vec<&str> = text.split_inclusive("\n\n").collect();
    let with_text: String = events.iter().take(3).copied().collect();
    assert!(with_text.contains("\"content\": \"!\""), "{with_text}");
    server_model.instead_of_next(Reply::sse(with_text.as_bytes()));
    let body = json!({"provider": "fake", "model": "smollm2", "input": "Say hello."});
    let (frames, record) = run(&server, body).await;
    assert_eq!(record["status"], "failed", "{record} {frames:?}");
    assert_eq!(record["error_class"], "transport", "{record}");
    assert!(!of_type(&frames, "text_delta").is_empty());
    // Cut before any output (the role chunk only): retried, and the retry answers.
    let role_only: String = events.iter().take(1).copied().collect();
    server_model.instead_of_next(Reply::sse(role_only.as_bytes()));
    let body = json!({"provider": "fake", "model": "smollm2", "input": "Say hello again.",
                      "session_id": record["session_id"]});
    let (frames, record) = run(&server, body).await;
    assert_eq!(record["status"], "completed", "{record} {frames:?}");
    let retrying = of_type(&frames, "model_retrying");
    assert_eq!(retrying.len(), 1, "{frames:?}");
    assert_eq!(retrying[0].json()["error_class"], "transport");
    assert!(!of_type(&frames, "text_delta").is_empty());
    server.stop().await;
}

/// Item 5: after a compaction, the call's usage is of the request that was sent (the
/// compacted one): with a server that reports no usage in streams (as recorded), the call's
/// estimated input is within 10 % of the request's size (it was the uncompacted history's).
/// Calibration: with a server that counts 1.3 × the fake's count, each compaction's estimate
/// of the compacted request is within 10 % of what the server then reports for it.
async fn usage_after_a_compaction_is_the_request_sent(backend: Backend) {
    for usage in [Usage::Scaled(1.3), Usage::Recorded] {
        let fake = FakeOpenAi::start().await;
        let _server_model = LlamaCppPython::attach(&fake, usage);
        let tools = LookupServer::start(60).await;
        // A window inside the server's, so that only auto compaction happens (never the
        // server's refusal): 2,000 tokens, compacting past 2,000 − 200 − 1,000.
        let toml = "[compaction]\nbuffer_tokens = 1000\nkeep_tokens = 500\ntail_turns = 1\n";
        let mut config = config(&fake.base_url(), &tools, 2_000, "");
        let extra = Config::from_toml(toml).unwrap();
        config.compaction = extra.compaction;
        let Some(server) = TestServer::start(backend, config).await else {
            return;
        };
        let (_, runs) = session(&server, 10).await;
        let mut checked = 0;
        let mut compactions = 0;
        for frames in &runs {
            let compacted = of_type(frames, "context_compacted");
            assert!(compacted.len() <= 1, "{frames:?}");
            let Some(compacted) = compacted.first().map(|f| f.json()) else {
                continue;
            };
            assert_eq!(compacted["trigger"], "auto");
            // The usage of the call right after the compaction.
            let after = frames
                .iter()
                .skip_while(|f| f.event != "context_compacted")
                .find(|f| f.event == "usage_recorded")
                .unwrap()
                .json();
            let input = after["usage"]["input_tokens"].as_u64().unwrap() as f64;
            let expected = match usage {
                Usage::Recorded => {
                    assert_eq!(after["usage"]["estimated"], true);
                    // The request sent right after the compaction, as the fake counts it.
                    compacted_request_tokens(&fake, compactions) as f64
                }
                _ => compacted["tokens_after"].as_u64().unwrap() as f64,
            };
            let off = (input - expected).abs() / input;
            assert!(
                off <= 0.10,
                "{usage:?}: {input} reported vs {expected} estimated ({:.0} %)",
                off * 100.0
            );
            checked += 1;
            compactions += 1;
        }
        assert!(checked >= 2, "{usage:?}: {checked} compactions");
        server.stop().await;
    }
}

/// The fake's count of the first model request after the `n`th (from 0) summariser request.
fn compacted_request_tokens(fake: &FakeOpenAi, n: usize) -> u64 {
    let requests: Vec<Value> = fake.requests().into_iter().map(|r| r.body).collect();
    let summariser = requests
        .iter()
        .enumerate()
        .filter(|(_, body)| is_summariser(body))
        .nth(n)
        .map(|(i, _)| i)
        .expect("the summariser request");
    requests[summariser..]
        .iter()
        .find(|body| !is_summariser(body))
        .map(fake_openai::prompt_tokens)
        .expect("a request after the summary")
}

/// Item 3: the summariser's own overflow, and a manual compaction of a history larger than the
/// server's window. The session grows past the server's window while the fake does not enforce
/// it (`auto` off: nothing compacts); then, enforced, `POST /sessions/{id}/compact` sends the
/// summariser the whole history, which the server refuses (an empty stream, then the `400`):
/// the transcript is summarised in smaller parts instead of failing (the breaker counts
/// nothing), and the session's next run fits.
async fn the_summarisers_overflow_is_split(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let server_model = LlamaCppPython::attach(&fake, Usage::Recorded);
    server_model.enforcing.store(false, Ordering::SeqCst);
    let tools = LookupServer::start(60).await;
    let mut config = config(&fake.base_url(), &tools, 4 * SERVER_WINDOW, "");
    config.compaction = Config::from_toml("[compaction]\nauto = false\n")
        .unwrap()
        .compaction;
    let Some(server) = TestServer::start(backend, config).await else {
        return;
    };
    let (session_id, _) = session(&server, 8).await;
    let history = fake
        .requests()
        .last()
        .map(|r| fake_openai::prompt_tokens(&r.body))
        .unwrap();
    assert!(history > SERVER_WINDOW, "{history} tokens");
    server_model.enforcing.store(true, Ordering::SeqCst);
    let before = fake.requests().len();
    let response = server
        .client
        .post(server.url(&format!("/sessions/{session_id}/compact")))
        .send()
        .await
        .unwrap();
    let status = response.status();
    let body: Value = response.json().await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["trigger"], "manual");
    let summariser: Vec<Value> = fake.requests()[before..]
        .iter()
        .map(|r| r.body.clone())
        .filter(is_summariser)
        .collect();
    let too_long = |body: &Value| {
        fake_openai::prompt_tokens(body) + body["max_tokens"].as_u64().unwrap_or(0) > SERVER_WINDOW
    };
    assert!(
        summariser.iter().any(too_long),
        "the summariser was refused at least once: {summariser:?}"
    );
    assert!(
        summariser.iter().any(|body| !too_long(body)),
        "then answered in smaller parts"
    );
    let breaker = server.get_json("/compaction/circuit-breaker").await;
    assert_eq!(breaker["consecutive_failures"], 0, "{breaker}");
    let (frames, record) = run(&server, turn(9, Some(&session_id))).await;
    assert_eq!(record["status"], "completed", "{record} {frames:?}");
    server.stop().await;
}

on_both_backends!(
    a_tool_loop_works_with_default_options,
    a_validation_500_is_not_retried_and_names_its_cause,
    an_empty_stream_over_the_window_compacts_and_retries,
    a_413_compacts_once_and_retries,
    a_truncated_stream_is_a_transport_failure,
    usage_after_a_compaction_is_the_request_sent,
    the_summarisers_overflow_is_split,
);
