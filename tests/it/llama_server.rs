//! llama.cpp's own server (`llama-server`), against a fake that answers with the bytes of
//! `tests/fixtures/llama_server/` (recorded from a `llama-server` b11434 with SmolLM2-135M,
//! except the tool call, written from its source; their README says which is which): its
//! `400 exceed_context_size_error` for a request over its window (streaming or not: its first
//! result is an error, answered as a plain JSON response), a streamed tool call (`tool_calls`
//! deltas, usage and `timings` in a last chunk without choices), a text answer, and a stream
//! cut after some text without a finish reason or `[DONE]` (the server killed mid-stream). The fake
//! calls the tool only when asked with `"tool_choice": "required"`, the one forcing form the
//! server reads (behest sends it for a run forcing its only tool). The fake
//! counts each request (`fake_openai::prompt_tokens`) and reports that count in the usage
//! chunk, as the server reports its own. Both store backends.

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

/// The server's window, in tokens (`--ctx-size 2048`).
const SERVER_WINDOW: u64 = 2_048;
/// Each request's output limit.
const MAX_OUTPUT: u64 = 200;
/// `Content-Type` of llama-server's JSON answers (cpp-httplib's `set_content`).
const JSON: &str = "application/json; charset=utf-8";

fn fixture(name: &str) -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llama_server")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A config with the `fake` provider at `base_url` (model `smollm2`, a `window`-token window:
/// maybe larger than the server's) and the `lookup` tool; default provider options.
fn config(base_url: &str, tools: &LookupServer, window: u64) -> Config {
    let toml = format!(
        "[http_tools.lookup]\ndescription = \"Looks a record up by its key.\"\n\
         url = \"{}\"\n\
         parameters = {{ type = \"object\", properties = {{ key = {{ type = \"string\" }} }}, \
         required = [\"key\"] }}\n\
         [providers.fake]\nkind = \"openai\"\nbase_url = \"{base_url}\"\n\
         [providers.fake.timeouts]\nconnect_ms = 2000\nfirst_byte_ms = 5000\nidle_ms = 5000\ntotal_ms = 20000\n\
         [providers.fake.retry]\nmax_attempts = 3\ninitial_backoff_ms = 20\nmax_backoff_ms = 50\n\
         [providers.fake.models.smollm2]\ncontext_window = {window}\nmax_output_tokens = {MAX_OUTPUT}\n",
        tools.url()
    );
    Config::from_toml(&toml).unwrap()
}

/// The fake playing llama-server.
struct LlamaServer {
    /// Requests refused as over the window (the `400`).
    refused: AtomicUsize,
    /// Answers to give instead of the next (non-summariser) requests, in order.
    instead: std::sync::Mutex<std::collections::VecDeque<Reply>>,
}

impl LlamaServer {
    fn attach(fake: &FakeOpenAi) -> Arc<Self> {
        let server = Arc::new(Self {
            refused: AtomicUsize::new(0),
            instead: std::sync::Mutex::new(std::collections::VecDeque::new()),
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
        let prompt = fake_openai::prompt_tokens(body);
        // `n_tokens >= n_ctx` is refused before anything is generated, whether or not the
        // request streams (the same bytes either way).
        if prompt >= SERVER_WINDOW {
            self.refused.fetch_add(1, Ordering::SeqCst);
            let name = if body["stream"] == true {
                "overflow.400.json"
            } else {
                "overflow.nostream.400.json"
            };
            return Reply::raw(400, JSON, &fixture(name));
        }
        let summariser = system_of(body).starts_with(SUMMARISER_PROMPT);
        if !summariser && let Some(reply) = self.instead.lock().unwrap().pop_front() {
            return reply;
        }
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        let last_is_result = messages.last().is_some_and(|m| m["role"] == "tool");
        // It reads `tool_choice` as a string only (`json_value(body, "tool_choice",
        // std::string("auto"))`, b11434): a named function's object becomes "auto", so only
        // "required" forces a call.
        let forced = body["tool_choice"] == "required";
        let name = if forced && !last_is_result && !summariser {
            "tool_call.sse"
        } else {
            "text.sse"
        };
        Reply::sse(&with_prompt_tokens(&fixture(name), prompt))
    }
}

/// The recorded stream with its usage chunk's `prompt_tokens` (and `total_tokens`) set to
/// `prompt`.
fn with_prompt_tokens(bytes: &[u8], prompt: u64) -> Vec<u8> {
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    let mut out = String::new();
    for event in text.split_inclusive("\n\n") {
        let Some(data) = event.strip_prefix("data: ") else {
            out.push_str(event);
            continue;
        };
        let Ok(mut chunk) = serde_json::from_str::<Value>(data.trim_end()) else {
            out.push_str(event);
            continue;
        };
        if chunk.get("usage").is_some() {
            let completion = chunk["usage"]["completion_tokens"].as_u64().unwrap();
            chunk["usage"]["prompt_tokens"] = json!(prompt);
            chunk["usage"]["total_tokens"] = json!(prompt + completion);
            chunk["timings"]["prompt_n"] = json!(prompt);
            out.push_str(&format!(
                "data: {}\n\n",
                serde_json::to_string(&chunk).unwrap()
            ));
        } else {
            out.push_str(event);
        }
    }
    out.into_bytes()
}

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

/// A tool loop: the streamed tool call (its arguments in `tool_calls` pieces after a first
/// delta with the id and the name) is executed, the answer follows, the usage is the server's
/// (from its last chunk, without choices), and every request is valid.
async fn a_streamed_tool_call_runs_the_tool(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let _server = LlamaServer::attach(&fake);
    let tools = LookupServer::start(60).await;
    let Some(server) =
        TestServer::start(backend, config(&fake.base_url(), &tools, SERVER_WINDOW)).await
    else {
        return;
    };
    let (frames, record) = run(&server, turn(1, None)).await;
    assert_eq!(record["status"], "completed", "{record} {frames:?}");
    let completed = of_type(&frames, "tool_call_completed");
    assert_eq!(completed.len(), 1, "{frames:?}");
    let call = completed[0].json()["call"].clone();
    assert_eq!(call["name"], "lookup");
    assert_eq!(call["id"], "Xr2b8KqWm5LzT0vN4cYp7HsJ1eQa9GdU");
    assert_eq!(call["arguments"], json!({"key": "k1"}));
    let finished = of_type(&frames, "tool_execution_finished");
    assert_eq!(finished.len(), 1);
    let output = &finished[0].json()["result"]["Success"]["output"];
    assert_eq!(output["key"], "k1", "{output}");
    let usage: Vec<Value> = of_type(&frames, "usage_recorded")
        .iter()
        .map(|f| f.json()["usage"].clone())
        .collect();
    assert_eq!(usage.len(), 2);
    let requests = fake.requests();
    for (usage, request) in usage.iter().zip(&requests) {
        assert_eq!(usage["estimated"], false, "{usage}");
        assert_eq!(
            usage["input_tokens"].as_u64(),
            Some(fake_openai::prompt_tokens(&request.body))
        );
    }
    assert_eq!(usage[0]["output_tokens"], 14);
    let output = server
        .get_json(&format!("/runs/{}/output", record["id"].as_str().unwrap()))
        .await;
    assert!(
        output
            .to_string()
            .contains("Hello! I'sure I'm not what I'm supposed to be. I"),
        "{output}"
    );
    for request in &requests {
        let errors = validate_openai_request(&request.body);
        assert!(errors.is_empty(), "{errors:?}");
    }
    server.stop().await;
}

/// Overflow: a session grows past the server's window (2,048 tokens) while behest is told a
/// larger one (4,096), so only the server's `400 exceed_context_size_error` says so; it is
/// recognised as `context_length_exceeded`: one compaction, one retry, and every run
/// completes.
async fn its_overflow_error_compacts_once_and_retries(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let llama = LlamaServer::attach(&fake);
    let tools = LookupServer::start(60).await;
    let Some(server) =
        TestServer::start(backend, config(&fake.base_url(), &tools, 2 * SERVER_WINDOW)).await
    else {
        return;
    };
    let mut session: Option<String> = None;
    let mut reactive = 0;
    for n in 1..=14 {
        let (frames, record) = run(&server, turn(n, session.as_deref())).await;
        assert_eq!(
            record["status"], "completed",
            "turn {n}: {record} {frames:?}"
        );
        session = Some(record["session_id"].as_str().unwrap().to_owned());
        let retrying = of_type(&frames, "model_retrying");
        assert!(
            retrying.len() <= 1,
            "one retry after one compaction: {frames:?}"
        );
        for event in retrying {
            let event = event.json();
            assert_eq!(event["error_class"], "context_length_exceeded", "{event}");
            assert!(
                event["error"]
                    .as_str()
                    .unwrap()
                    .contains("exceeds the available context size"),
                "{event}"
            );
            let compacted: Vec<Value> = of_type(&frames, "context_compacted")
                .into_iter()
                .map(Frame::json)
                .filter(|c| c["trigger"] == "reactive")
                .collect();
            assert_eq!(compacted.len(), 1, "{frames:?}");
            reactive += 1;
        }
    }
    assert!(reactive >= 1, "the session outgrew the server's window");
    assert_eq!(llama.refused.load(Ordering::SeqCst), reactive);
    server.stop().await;
}

/// A stream that ends cleanly after some text, with neither a finish reason nor `[DONE]` (what
/// a client of llama-server gets when the server dies mid-stream and a proxy in front of it
/// closes the response), fails the run as `transport`, never `run_completed`; the text shown
/// is kept as an incomplete answer.
async fn a_truncated_stream_is_a_transport_failure(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let llama = LlamaServer::attach(&fake);
    let tools = LookupServer::start(60).await;
    let Some(server) =
        TestServer::start(backend, config(&fake.base_url(), &tools, SERVER_WINDOW)).await
    else {
        return;
    };
    llama.instead_of_next(Reply::sse(&fixture("truncated.sse")));
    let body = json!({"provider": "fake", "model": "smollm2", "input": "Say hello."});
    let (frames, record) = run(&server, body).await;
    assert_eq!(record["status"], "failed", "{record} {frames:?}");
    assert_eq!(record["error_class"], "transport", "{record}");
    let text: String = of_type(&frames, "text_delta")
        .iter()
        .map(|f| f.json()["delta"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(text, "123");
    assert!(of_type(&frames, "run_completed").is_empty());
    // The session goes on.
    let body = json!({"provider": "fake", "model": "smollm2", "input": "Say hello again.",
                      "session_id": record["session_id"]});
    let (frames, record) = run(&server, body).await;
    assert_eq!(record["status"], "completed", "{record} {frames:?}");
    server.stop().await;
}

on_both_backends!(
    a_streamed_tool_call_runs_the_tool,
    its_overflow_error_compacts_once_and_retries,
    a_truncated_stream_is_a_transport_failure,
);
