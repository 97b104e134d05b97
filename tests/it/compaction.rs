//! Context management (issue #10) over HTTP, against the fake provider speaking each wire format
//! with a small context window (8,000 tokens, 1,024 of them for the answer) that it enforces: a
//! request that does not fit gets the provider's real error body. The fake plays a model that
//! looks a record up with a tool, then answers, and a summariser (requests carrying behest's
//! summariser prompt), counted apart. Every request it receives is checked against the
//! provider's own validation rules (`support::validate`). Both store backends.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use behest::config::Config;
use behest::runtime::compaction::SUMMARISER_PROMPT;
use serde_json::{Value, json};
use support::db::{Backend, TestDb};
use support::fake_anthropic;
use support::fake_openai::{self, FakeOpenAi, RecordedRequest, Reply};
use support::lookup::LookupServer;
use support::schema::EventSchema;
use support::server::{Frame, TestServer};
use support::validate::{validate_anthropic_request, validate_openai_request};

/// The model's context window, in tokens.
const WINDOW: u64 = 8_000;
/// Its output limit (every request asks for it).
const MAX_OUTPUT: u64 = 1_024;
/// `[compaction]` of most tests: compact past 8,000 − 1,024 − 1,000 = 5,976 tokens, keep two
/// turns within 2,000 tokens.
const COMPACTION: &str = "[compaction]\nbuffer_tokens = 1000\nkeep_tokens = 2000\ntail_turns = 2\n";
const THRESHOLD: u64 = WINDOW - MAX_OUTPUT - 1_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wire {
    OpenAi,
    Anthropic,
}

const WIRES: [Wire; 2] = [Wire::OpenAi, Wire::Anthropic];

fn config(wire: Wire, base_url: &str, tools: &LookupServer, compaction: &str) -> Config {
    let kind = match wire {
        Wire::OpenAi => "openai",
        Wire::Anthropic => "anthropic",
    };
    let toml = format!(
        "{compaction}\n\
         [http_tools.lookup]\ndescription = \"Looks a record up by its key.\"\n\
         url = \"{}\"\n\
         parameters = {{ type = \"object\", properties = {{ key = {{ type = \"string\" }}, \
         size = {{ type = \"integer\" }} }}, required = [\"key\"] }}\n\
         [providers.fake]\nkind = \"{kind}\"\nbase_url = \"{base_url}\"\n\
         [providers.fake.timeouts]\nconnect_ms = 2000\nfirst_byte_ms = 5000\nidle_ms = 5000\ntotal_ms = 20000\n\
         [providers.fake.retry]\nmax_attempts = 1\n\
         [providers.fake.models.fake-model]\ncontext_window = {WINDOW}\nmax_output_tokens = {MAX_OUTPUT}\n",
        tools.url()
    );
    Config::from_toml(&toml).unwrap()
}

// ---------------------------------------------------------------------------------------------
// The fake model

/// What the summariser answers.
#[derive(Debug, Clone, Copy)]
enum Summaries {
    /// "Summary N: …" of a few dozen words.
    Short,
    /// An HTTP 500.
    Fail,
    /// No text.
    Empty,
    /// A summary longer than what it replaces.
    Huge,
    /// A summary of this many words (shorter than what it replaces, but long).
    Words(usize),
    /// Some text, then the connection is cut (no finish reason, no usage).
    Cut,
    /// A short summary, its stream paused this long after its first byte (a large local
    /// model writing a summary).
    Slow(Duration),
}

/// The fake's behaviour: summariser requests answer a summary, the others call `lookup` once
/// per user input (its `size` words), then answer; usage reports the fake's own count.
struct Model {
    wire: Wire,
    size: u64,
    /// What the next summariser calls answer, in order; then `Short`.
    summaries: Mutex<std::collections::VecDeque<Summaries>>,
    summarised: AtomicUsize,
    /// Bodies answered instead of the next model (not summariser) request, once each.
    refusals: Mutex<Vec<(u16, Value)>>,
    /// The reported prompt tokens are this × the fake's count (another tokenizer than the
    /// fake's `o200k_base`); 1 unless set.
    usage_scale: Mutex<f64>,
}

impl Model {
    fn new(wire: Wire, size: u64) -> Arc<Self> {
        Arc::new(Self {
            wire,
            size,
            summaries: Mutex::new(std::collections::VecDeque::new()),
            summarised: AtomicUsize::new(0),
            refusals: Mutex::new(Vec::new()),
            usage_scale: Mutex::new(1.0),
        })
    }

    /// The prompt tokens the fake reports for a request: its count × the usage scale.
    fn reported_prompt(&self, body: &Value) -> u64 {
        let scale = *self.usage_scale.lock().unwrap();
        (fake_openai::prompt_tokens(body) as f64 * scale).round() as u64
    }

    fn summaries(&self, summaries: &[Summaries]) {
        self.summaries
            .lock()
            .unwrap()
            .extend(summaries.iter().cloned());
    }

    fn refuse_next(&self, status: u16, body: Value) {
        self.refusals.lock().unwrap().push((status, body));
    }

    fn attach(self: &Arc<Self>, fake: &FakeOpenAi) {
        let model = Arc::clone(self);
        fake.respond_with(move |request| Some(model.answer(request)));
    }

    fn answer(&self, request: &RecordedRequest) -> Reply {
        let prompt = self.reported_prompt(&request.body);
        if is_summariser(&request.body) {
            let n = self.summarised.fetch_add(1, Ordering::SeqCst) + 1;
            let next = self.summaries.lock().unwrap().pop_front();
            let text = match next.unwrap_or(Summaries::Short) {
                Summaries::Slow(pause) => {
                    let text = format!("Summary {n}: the user asked for records one by one.");
                    return self.text(&[&text], prompt).split_at(vec![1]).delay(pause);
                }
                Summaries::Fail => {
                    return Reply::status(
                        500,
                        json!({"error": {"message": "The server had an error while processing your request.", "type": "server_error", "param": null, "code": null}}),
                    );
                }
                Summaries::Cut => {
                    return Reply::close_after(
                        fake_openai::chunk(
                            json!({"role": "assistant", "content": "Summary: the user asked for records one by one and"}),
                            None,
                        )
                        .as_bytes(),
                    );
                }
                Summaries::Empty => String::new(),
                Summaries::Huge => "The conversation went on at length. ".repeat(900),
                Summaries::Words(words) => "word ".repeat(words),
                Summaries::Short => format!(
                    "Summary {n}: the user asked for records one by one; each was looked up \
                     with the lookup tool and reported. The latest input came last."
                ),
            };
            return self.text(&[&text], prompt);
        }
        if let Some((status, body)) = self.refusals.lock().unwrap().pop() {
            return Reply::status(status, body);
        }
        let (last_is_result, input) = last_turn(self.wire, &request.body);
        if last_is_result {
            return self.text(&["Done: ", &input], prompt);
        }
        let key = input
            .split_whitespace()
            .find(|w| w.starts_with('k'))
            .unwrap_or("k?")
            .trim_matches(|c: char| !c.is_alphanumeric())
            .to_owned();
        let arguments = json!({"key": key, "size": self.size});
        let id = format!("call_{}", uuid::Uuid::new_v4().simple());
        match self.wire {
            Wire::OpenAi => Reply::sse(&fake_openai::tool_calls_stream_with_usage(
                &[(&id, "lookup", arguments)],
                prompt,
            )),
            Wire::Anthropic => Reply::sse(&fake_anthropic::tool_use_stream_with_usage(
                &[(&id, "lookup", arguments)],
                prompt,
            )),
        }
    }

    fn text(&self, deltas: &[&str], prompt: u64) -> Reply {
        match self.wire {
            Wire::OpenAi => Reply::sse(&fake_openai::text_stream_with_usage(deltas, prompt)),
            Wire::Anthropic => Reply::sse(&fake_anthropic::text_stream_with_usage(deltas, prompt)),
        }
    }
}

/// The text of a content value (a string, or text parts / blocks).
fn text_of(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| part["text"].as_str())
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// The system prompt of a request body (Chat Completions: its system messages; Messages: its
/// `system`).
fn system_of(body: &Value) -> String {
    match body.get("system") {
        Some(system) => text_of(system),
        None => body["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|m| m["role"] == "system")
            .map(|m| text_of(&m["content"]))
            .collect::<Vec<_>>()
            .join("\n\n"),
    }
}

fn is_summariser(body: &Value) -> bool {
    system_of(body).starts_with(SUMMARISER_PROMPT)
}

/// Whether the request ends with a tool result, and the latest user input's text.
fn last_turn(wire: Wire, body: &Value) -> (bool, String) {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let last = messages.last().cloned().unwrap_or(Value::Null);
    let is_result = match wire {
        Wire::OpenAi => last["role"] == "tool",
        Wire::Anthropic => last["content"]
            .as_array()
            .is_some_and(|blocks| blocks.iter().any(|b| b["type"] == "tool_result")),
    };
    let input = messages
        .iter()
        .rev()
        .filter(|m| m["role"] == "user")
        .map(|m| match &m["content"] {
            Value::Array(blocks) => blocks
                .iter()
                .filter(|b| b["type"] == "text")
                .filter_map(|b| b["text"].as_str())
                .collect::<Vec<_>>()
                .join(""),
            other => text_of(other),
        })
        .find(|text| !text.is_empty())
        .unwrap_or_default();
    (is_result, input)
}

/// The model requests (not the summariser's) the fake received.
fn model_requests(fake: &FakeOpenAi) -> Vec<Value> {
    fake.requests()
        .into_iter()
        .map(|r| r.body)
        .filter(|body| !is_summariser(body))
        .collect()
}

fn summariser_requests(fake: &FakeOpenAi) -> Vec<Value> {
    fake.requests()
        .into_iter()
        .map(|r| r.body)
        .filter(is_summariser)
        .collect()
}

/// Every request fits the window and passes the provider's validation.
fn assert_valid_and_fitting(wire: Wire, fake: &FakeOpenAi) {
    assert_eq!(
        fake.rejected(),
        0,
        "the fake refused requests that did not fit"
    );
    for body in fake.requests().iter().map(|r| &r.body) {
        let tokens = fake_openai::prompt_tokens(body);
        let output = body["max_tokens"]
            .as_u64()
            .or(body["max_completion_tokens"].as_u64())
            .unwrap();
        assert!(tokens + output <= WINDOW, "{tokens} + {output} tokens");
        let errors = match wire {
            Wire::OpenAi => validate_openai_request(body),
            Wire::Anthropic => validate_anthropic_request(body),
        };
        assert!(errors.is_empty(), "{errors:?} in {body}");
    }
}

// ---------------------------------------------------------------------------------------------
// Driving runs

async fn run(
    server: &TestServer,
    input: &str,
    session: Option<&str>,
) -> (String, Vec<Frame>, Value) {
    let run_id = server.start_run(input, session).await;
    // The stream ends after the run's terminal event.
    let frames = tokio::time::timeout(Duration::from_secs(30), server.events(&run_id, None))
        .await
        .expect("the run ends within 30 s");
    assert!(
        frames.last().is_some_and(|f| f.event.starts_with("run_")),
        "{frames:?}"
    );
    // Every event (`context_compacted` and `compaction_circuit_opened` among them) matches
    // the document's schema.
    static SCHEMA: std::sync::LazyLock<EventSchema> = std::sync::LazyLock::new(EventSchema::new);
    for frame in &frames {
        SCHEMA.check(&frame.json());
    }
    let record = server.get_json(&format!("/runs/{run_id}")).await;
    (run_id, frames, record)
}

fn of_type<'a>(frames: &'a [Frame], event: &str) -> Vec<&'a Frame> {
    frames.iter().filter(|f| f.event == event).collect()
}

/// Runs `turns` turns in one session (input "Turn N: look up kN, please."); returns the session
/// id and every run's frames.
async fn session(server: &TestServer, turns: usize) -> (String, Vec<Vec<Frame>>) {
    let mut session: Option<String> = None;
    let mut all = Vec::new();
    for n in 1..=turns {
        let input = format!("Turn {n}: look up k{n}, please.");
        let (_, frames, record) = run(server, &input, session.as_deref()).await;
        assert_eq!(
            record["status"], "completed",
            "turn {n}: {record} {frames:?}"
        );
        session = Some(record["session_id"].as_str().unwrap().to_owned());
        all.push(frames);
    }
    (session.unwrap(), all)
}

async fn start(
    backend: Backend,
    wire: Wire,
    compaction: &str,
    size: u64,
) -> Option<(TestServer, FakeOpenAi, Arc<Model>, LookupServer)> {
    let fake = FakeOpenAi::start().await;
    fake.with_context_window(WINDOW);
    let model = Model::new(wire, size);
    model.attach(&fake);
    let tools = LookupServer::start(20).await;
    let config = config(wire, &fake.base_url(), &tools, compaction);
    let server = TestServer::start(backend, config).await?;
    Some((server, fake, model, tools))
}

// ---------------------------------------------------------------------------------------------
// Tests

/// The issue's "done when": a scripted 200-turn session with a tool call in every turn against
/// an 8,000-token window completes, and every request it sends (summariser's included) fits
/// the window and is valid; it compacted, each time past the threshold, and the stored history
/// keeps every original message.
async fn a_200_turn_session_stays_inside_the_window(backend: Backend) {
    for wire in WIRES {
        let Some((server, fake, model, _tools)) = start(backend, wire, COMPACTION, 60).await else {
            return;
        };
        let (session, runs) = session(&server, 200).await;
        assert_valid_and_fitting(wire, &fake);
        let compacted: Vec<Value> = runs
            .iter()
            .flat_map(|frames| of_type(frames, "context_compacted"))
            .map(Frame::json)
            .collect();
        let summaries = model.summarised.load(Ordering::SeqCst);
        assert!(
            compacted.len() >= 5,
            "{wire:?}: {} compactions",
            compacted.len()
        );
        assert!(
            summaries >= compacted.len(),
            "a summariser call (or more) per compaction"
        );
        for event in &compacted {
            assert_eq!(event["trigger"], "auto");
            let before = event["tokens_before"].as_u64().unwrap();
            let after = event["tokens_after"].as_u64().unwrap();
            assert!(before > THRESHOLD, "compacted at {before} tokens: {event}");
            assert!(after < before && after <= THRESHOLD, "{event}");
            assert!(
                event["messages_summarised"].as_u64().unwrap() > 0,
                "{event}"
            );
        }
        // Every original message is stored, with the compactions at their place.
        let mut messages = Vec::new();
        let mut compactions = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let path = match &cursor {
                Some(c) => format!("/sessions/{session}/messages?cursor={c}"),
                None => format!("/sessions/{session}/messages"),
            };
            let page = server.get_json(&path).await;
            messages.extend(page["messages"].as_array().unwrap().iter().cloned());
            compactions.extend(page["compactions"].as_array().unwrap().iter().cloned());
            match page["next_cursor"].as_str() {
                Some(next) => cursor = Some(next.to_owned()),
                None => break,
            }
        }
        assert_eq!(messages.len(), 800, "user, tool call, result, answer × 200");
        assert_eq!(compactions.len(), compacted.len());
        for (event, stored) in compacted.iter().zip(&compactions) {
            assert_eq!(event["compaction_id"], stored["id"]);
            assert_eq!(event["summary"], stored["summary"]);
            assert!(
                messages
                    .iter()
                    .any(|m| m["id"] == stored["through_message_id"]),
                "{stored}"
            );
        }
        server.stop().await;
    }
}

/// After a compaction the next request holds the system summary, then the newest turns from a
/// user message on; the second summariser request carries the first summary and none of the
/// messages it covered; the summariser's usage is part of the run's.
async fn summaries_are_incremental_and_the_tail_is_whole(backend: Backend) {
    for wire in WIRES {
        let Some((server, fake, model, _tools)) = start(backend, wire, COMPACTION, 60).await else {
            return;
        };
        let mut session: Option<String> = None;
        let mut n = 0;
        let mut compaction_runs = Vec::new();
        while model.summarised.load(Ordering::SeqCst) < 2 {
            n += 1;
            assert!(n < 80, "no second compaction after {n} turns");
            let input = format!("Turn {n}: look up k{n}, please.");
            let (_, frames, record) = run(&server, &input, session.as_deref()).await;
            session = Some(record["session_id"].as_str().unwrap().to_owned());
            if !of_type(&frames, "context_compacted").is_empty() {
                compaction_runs.push((frames, record));
            }
        }
        let summaries = summariser_requests(&fake);
        assert_eq!(summaries.len(), 2);
        let transcript = |body: &Value| {
            text_of(&body["messages"].as_array().unwrap().last().unwrap()["content"])
        };
        let first = transcript(&summaries[0]);
        let second = transcript(&summaries[1]);
        assert!(first.contains("Turn 1: look up k1"), "{first}");
        assert!(second.contains("Summary 1:"), "{second}");
        assert!(
            !second.contains("Turn 1: look up k1"),
            "the originals again: {second}"
        );
        // The summariser's requests are plain text: no tools.
        for body in &summaries {
            assert!(body.get("tools").is_none(), "{body}");
        }
        // The request after the first compaction: the summary first, the tail from a user input.
        let requests = model_requests(&fake);
        let after = requests
            .iter()
            .find(|body| system_of(body).contains("Summary 1:"))
            .expect("a request with the first summary");
        let turns = after["messages"].as_array().unwrap();
        let first_turn = turns.iter().find(|m| m["role"] != "system").unwrap();
        assert_eq!(first_turn["role"], "user", "{after}");
        assert!(
            !text_of(&first_turn["content"]).contains("Turn 1:"),
            "{after}"
        );
        // The compaction's usage is in the run's total.
        let (frames, record) = &compaction_runs[0];
        let input = |event: &str| -> u64 {
            of_type(frames, event)
                .iter()
                .map(|f| f.json()["usage"]["input_tokens"].as_u64().unwrap())
                .sum()
        };
        let recorded = input("usage_recorded");
        let summariser = input("context_compacted");
        assert!(summariser > 0);
        assert_eq!(
            record["total_usage"]["input_tokens"].as_u64().unwrap(),
            recorded + summariser,
            "{record}"
        );
        assert_valid_and_fitting(wire, &fake);
        server.stop().await;
    }
}

/// With `prune` on, old tool outputs are replaced in the request by a marker before any summary
/// is considered; the stored messages keep them whole.
async fn prune_replaces_old_tool_outputs_in_requests_only(backend: Backend) {
    let compaction = format!("{COMPACTION}prune = true\n");
    for wire in WIRES {
        // Records of 250 words: outputs dominate the context, so pruning makes room.
        let Some((server, fake, model, _tools)) = start(backend, wire, &compaction, 250).await
        else {
            return;
        };
        let (session, _) = session(&server, 12).await;
        let requests = model_requests(&fake);
        let marker = "pruned by behest";
        let pruned = requests
            .iter()
            .find(|body| body.to_string().contains(marker))
            .expect("a request with pruned outputs");
        // The newest results are whole, the old ones are markers.
        let text = pruned.to_string();
        assert!(!text.contains("k1-fact-100"), "the first record is pruned");
        assert_eq!(
            model.summarised.load(Ordering::SeqCst),
            0,
            "pruning was enough"
        );
        let messages = server
            .get_json(&format!("/sessions/{session}/messages"))
            .await;
        let stored = messages["messages"].to_string();
        assert!(
            stored.contains("k1-fact-249"),
            "stored outputs are untouched"
        );
        assert!(!stored.contains(marker));
        assert_valid_and_fitting(wire, &fake);
        server.stop().await;
    }
}

/// The context-length error bodies of each server (tests/fixtures/context_length/): a call the
/// provider rejects triggers one compaction and one retry, and the run completes; rejected
/// again, the run fails with `context_length_exceeded`. `auto` is off, so nothing is compacted
/// before the rejection.
async fn a_context_length_error_compacts_once_and_retries(backend: Backend) {
    let compaction = format!("{COMPACTION}auto = false\n");
    let shapes: [(Wire, &str, u16); 8] = [
        (Wire::OpenAi, "openai.json", 400),
        (Wire::OpenAi, "vllm_legacy.json", 400),
        (Wire::OpenAi, "vllm.json", 400),
        (Wire::OpenAi, "llamacpp.json", 400),
        (Wire::OpenAi, "ollama.json", 500),
        (Wire::OpenAi, "lmstudio.json", 400),
        (Wire::Anthropic, "anthropic.json", 400),
        (Wire::Anthropic, "anthropic_max_tokens.json", 400),
    ];
    for (wire, file, status) in shapes {
        let path = format!(
            "{}/tests/fixtures/context_length/{file}",
            env!("CARGO_MANIFEST_DIR")
        );
        let body: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let Some((server, fake, model, _tools)) = start(backend, wire, &compaction, 20).await
        else {
            return;
        };
        let (session, _) = session(&server, 3).await;
        model.refuse_next(status, body.clone());
        let (_, frames, record) = run(&server, "Turn 4: look up k4, please.", Some(&session)).await;
        assert_eq!(record["status"], "completed", "{file}: {record}");
        let kinds: Vec<&str> = frames.iter().map(|f| f.event.as_str()).collect();
        let retry = kinds
            .iter()
            .position(|k| *k == "model_retrying")
            .expect(file);
        assert_eq!(
            kinds[retry + 1..retry + 3],
            ["context_compaction_started", "context_compacted"],
            "{file}: {kinds:?}"
        );
        let retrying = frames[retry].json();
        assert_eq!(retrying["error_class"], "context_length_exceeded", "{file}");
        assert_eq!(frames[retry + 1].json()["trigger"], "reactive", "{file}");
        assert_eq!(frames[retry + 2].json()["trigger"], "reactive", "{file}");
        assert_eq!(model.summarised.load(Ordering::SeqCst), 1, "{file}");
        // Rejected twice: one compaction, then the run fails, clearly.
        model.refuse_next(status, body.clone());
        model.refuse_next(status, body);
        let (_, frames, record) = run(&server, "Turn 5: look up k5, please.", Some(&session)).await;
        assert_eq!(record["status"], "failed", "{file}: {record}");
        let failed = of_type(&frames, "run_failed")[0].json();
        assert_eq!(
            failed["error_class"], "context_length_exceeded",
            "{file}: {failed}"
        );
        assert!(
            failed["error"]
                .as_str()
                .unwrap()
                .contains("still too long after a compaction"),
            "{file}: {failed}"
        );
        assert_eq!(of_type(&frames, "model_retrying").len(), 1, "never a loop");
        assert_eq!(model.summarised.load(Ordering::SeqCst), 2, "{file}");
        assert_valid_and_fitting(wire, &fake);
        server.stop().await;
    }
}

/// A failing summariser (an error, an empty summary, a summary that does not shrink the
/// context) trips the breaker after exactly `circuit_breaker_threshold` failures; the run that
/// tripped it says so once; then the fake receives no summariser request at all, and a run whose
/// request does not fit fails with `context_length_exceeded`. A reset, then a good summary,
/// close it again.
async fn a_failing_summariser_trips_the_breaker(backend: Backend) {
    for wire in WIRES {
        let Some((server, fake, model, _tools)) = start(backend, wire, COMPACTION, 60).await else {
            return;
        };
        let breaker = server.get_json("/compaction/circuit-breaker").await;
        assert_eq!(
            breaker,
            json!({"is_open": false, "consecutive_failures": 0, "threshold": 3,
                   "opened_at": null, "last_error": null})
        );
        let mut session: Option<String> = None;
        let mut n = 0;
        let mut opened = Vec::new();
        model.summaries(&[Summaries::Fail, Summaries::Empty, Summaries::Huge]);
        while model.summarised.load(Ordering::SeqCst) < 3 {
            n += 1;
            assert!(n < 80, "no third compaction attempt after {n} turns");
            let input = format!("Turn {n}: look up k{n}, please.");
            let (_, frames, record) = run(&server, &input, session.as_deref()).await;
            session = Some(record["session_id"].as_str().unwrap().to_owned());
            assert!(of_type(&frames, "context_compacted").is_empty());
            opened.extend(
                of_type(&frames, "compaction_circuit_opened")
                    .into_iter()
                    .cloned(),
            );
        }
        assert_eq!(opened.len(), 1, "the run that tripped it says so, once");
        // The metrics count the failed attempts (the process's recorder is shared by the tests
        // running beside this one, so at least these three) and show the breaker.
        let metrics = server.get_text("/metrics").await;
        let failed_auto: f64 = metrics
            .lines()
            .filter(|line| {
                line.starts_with("behest_compactions_total{")
                    && line.contains("trigger=\"auto\"")
                    && line.contains("outcome=\"failed\"")
            })
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert!(failed_auto >= 3.0, "{metrics}");
        assert!(
            metrics
                .lines()
                .any(|line| line.starts_with("behest_compaction_circuit_open ")),
            "{metrics}"
        );
        assert_eq!(opened[0].json()["consecutive_failures"], 3);
        let breaker = server.get_json("/compaction/circuit-breaker").await;
        assert_eq!(breaker["is_open"], true, "{breaker}");
        assert_eq!(breaker["consecutive_failures"], 3);
        assert!(breaker["opened_at"].is_string());
        // The last one: a summary longer than what it replaces (whether the head was
        // summarised in one part or more).
        let last_error = breaker["last_error"].as_str().unwrap();
        assert!(
            ["did not shrink", "the summary grew"]
                .iter()
                .any(|said| last_error.contains(said)),
            "{breaker}"
        );
        // Open: more turns, no summariser request, until a request does not fit.
        let mut failed = None;
        for _ in 0..40 {
            n += 1;
            let input = format!("Turn {n}: look up k{n}, please.");
            let (_, frames, record) = run(&server, &input, session.as_deref()).await;
            if record["status"] == "failed" {
                failed = Some(of_type(&frames, "run_failed")[0].json());
                break;
            }
            assert_eq!(record["status"], "completed", "{record}");
        }
        let failed = failed.expect("a request that does not fit");
        assert_eq!(failed["error_class"], "context_length_exceeded", "{failed}");
        assert!(
            failed["error"]
                .as_str()
                .unwrap()
                .contains("circuit breaker is open"),
            "{failed}"
        );
        assert_eq!(
            model.summarised.load(Ordering::SeqCst),
            3,
            "no summariser request while open"
        );
        // behest's estimate is calibrated by the provider's count of the call before: the
        // request that does not fit is not sent, or (when the estimate was a little short) the
        // provider refuses it once, and the run fails the same way.
        assert!(fake.rejected() <= 1, "{}", fake.rejected());
        let manual = server
            .client
            .post(server.url(&format!(
                "/sessions/{}/compact",
                session.as_deref().unwrap()
            )))
            .send()
            .await
            .unwrap();
        assert_eq!(manual.status(), 409);
        let problem: Value = manual.json().await.unwrap();
        assert_eq!(problem["code"], "compaction_circuit_open");
        // Reset: the next turn compacts (a good summary), which keeps it closed.
        let reset: Value = server
            .client
            .post(server.url("/compaction/circuit-breaker/reset"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(reset["is_open"], false);
        assert_eq!(reset["consecutive_failures"], 0);
        n += 1;
        let input = format!("Turn {n}: look up k{n}, please.");
        let (_, frames, record) = run(&server, &input, session.as_deref()).await;
        assert_eq!(record["status"], "completed", "{record}");
        assert_eq!(of_type(&frames, "context_compacted").len(), 1);
        // The context was close to the window: its head is summarised in one or two parts
        // (each fitting the compaction model's window).
        let calls = model.summarised.load(Ordering::SeqCst);
        assert!((4..=5).contains(&calls), "{calls}");
        let breaker = server.get_json("/compaction/circuit-breaker").await;
        assert_eq!(breaker["is_open"], false);
        assert_eq!(breaker["last_error"], Value::Null);
        server.stop().await;
    }
}

async fn send(
    server: &TestServer,
    method: &str,
    path: &str,
    body: Option<&str>,
    content_type: &str,
) -> (u16, Value) {
    let request = match method {
        "PUT" => server.client.put(server.url(path)),
        "PATCH" => server.client.patch(server.url(path)),
        _ => server.client.post(server.url(path)),
    };
    let request = match body {
        Some(body) => request
            .header("content-type", content_type)
            .body(body.to_owned()),
        None => request,
    };
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// `/compaction`: the config file's values first; PATCH merges (RFC 7396, `null` restores the
/// initial value), PUT replaces; bad values and combinations are 422 naming the field and
/// change nothing; the stored settings survive a restart and win over the file.
async fn the_settings_are_edited_checked_and_kept(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let tools = LookupServer::start(20).await;
    let config = config(Wire::OpenAi, &fake.base_url(), &tools, COMPACTION);
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let server = TestServer::on_store(db.store().await, config.clone(), None).await;
    let initial = json!({"auto": true, "prune": false, "buffer_tokens": 1000, "keep_tokens": 2000,
        "tail_turns": 2, "model": "", "provider": "", "circuit_breaker_threshold": 3});
    assert_eq!(server.get_json("/compaction").await, initial);
    let merge = "application/merge-patch+json";
    let (status, patched) = send(
        &server,
        "PATCH",
        "/compaction",
        Some(r#"{"prune": true, "tail_turns": 4}"#),
        merge,
    )
    .await;
    assert_eq!(status, 200, "{patched}");
    assert_eq!(patched["prune"], true);
    assert_eq!(patched["tail_turns"], 4);
    assert_eq!(patched["keep_tokens"], 2000, "untouched");
    let (status, patched) = send(
        &server,
        "PATCH",
        "/compaction",
        Some(r#"{"tail_turns": null, "provider": "fake", "model": "fake-model"}"#),
        "application/json",
    )
    .await;
    assert_eq!(status, 200, "{patched}");
    assert_eq!(patched["tail_turns"], 2, "null restores the initial value");
    assert_eq!(patched["provider"], "fake");
    let before = server.get_json("/compaction").await;
    let bad: [(&str, &str, &str, &str); 14] = [
        (
            "PATCH",
            r#"{"provider": "nope", "model": "m"}"#,
            "provider",
            "unknown_provider",
        ),
        (
            "PATCH",
            r#"{"model": "gpt-none"}"#,
            "model",
            "unknown_model",
        ),
        ("PATCH", r#"{"provider": ""}"#, "provider", "invalid_field"),
        (
            "PATCH",
            r#"{"keep_tokens": 6000}"#,
            "keep_tokens",
            "invalid_field",
        ),
        (
            "PATCH",
            r#"{"buffer_tokens": 7000}"#,
            "buffer_tokens",
            "invalid_field",
        ),
        (
            "PATCH",
            r#"{"circuit_breaker_threshold": 0}"#,
            "circuit_breaker_threshold",
            "invalid_field",
        ),
        (
            "PATCH",
            r#"{"circuit_breaker_threshold": 1001}"#,
            "circuit_breaker_threshold",
            "invalid_field",
        ),
        (
            "PATCH",
            r#"{"tail_turns": 1001}"#,
            "tail_turns",
            "invalid_field",
        ),
        ("PATCH", r#"{"auto": "yes"}"#, "auto", "invalid_field"),
        (
            "PATCH",
            r#"{"keep_tokens": -1}"#,
            "keep_tokens",
            "invalid_field",
        ),
        (
            "PATCH",
            r#"{"keep_tokens": 1.5}"#,
            "keep_tokens",
            "invalid_field",
        ),
        (
            "PATCH",
            r#"{"keeep_tokens": 1}"#,
            "keeep_tokens",
            "invalid_body",
        ),
        ("PUT", r#"{"auto": false}"#, "prune", "missing_field"),
        (
            "PUT",
            r#"{"auto": null, "prune": false, "buffer_tokens": 1000, "keep_tokens": 2000, "tail_turns": 2, "model": "", "provider": "", "circuit_breaker_threshold": 3}"#,
            "auto",
            "invalid_field",
        ),
    ];
    for (method, body, field, code) in bad {
        let (status, problem) = send(
            &server,
            method,
            "/compaction",
            Some(body),
            "application/json",
        )
        .await;
        assert_eq!(status, 422, "{method} {body}: {problem}");
        assert_eq!(problem["field"], field, "{method} {body}: {problem}");
        assert_eq!(problem["code"], code, "{method} {body}: {problem}");
        assert_eq!(
            server.get_json("/compaction").await,
            before,
            "{body} changed nothing"
        );
    }
    let (status, _) = send(
        &server,
        "PATCH",
        "/compaction",
        Some("[1]"),
        "application/json",
    )
    .await;
    assert_eq!(status, 422);
    let (status, _) = send(
        &server,
        "PATCH",
        "/compaction",
        Some("{"),
        "application/json",
    )
    .await;
    assert_eq!(status, 400);
    let replaced = r#"{"auto": false, "prune": true, "buffer_tokens": 500, "keep_tokens": 1500, "tail_turns": 3, "model": "", "provider": "", "circuit_breaker_threshold": 5}"#;
    let (status, put) = send(
        &server,
        "PUT",
        "/compaction",
        Some(replaced),
        "application/json",
    )
    .await;
    assert_eq!(status, 200, "{put}");
    assert_eq!(put, serde_json::from_str::<Value>(replaced).unwrap());
    assert_eq!(
        server.get_json("/compaction/circuit-breaker").await["threshold"],
        5
    );
    // A restart over the same database: the stored settings, not the file's.
    server.stop().await;
    let restarted = TestServer::on_store(db.store().await, config, None).await;
    assert_eq!(restarted.get_json("/compaction").await, put);
    restarted.stop().await;
    db.cleanup().await;
}

/// `POST /sessions/{id}/compact` compacts now and lists the compaction with the messages; a
/// busy session is 409 `session_busy`, an unknown one 404, one with nothing to summarise 409.
async fn a_session_is_compacted_on_request(backend: Backend) {
    let Some((server, fake, model, _tools)) = start(backend, Wire::OpenAi, COMPACTION, 20).await
    else {
        return;
    };
    let (tiny, _) = session(&server, 1).await;
    let (status, problem) = send(
        &server,
        "POST",
        &format!("/sessions/{tiny}/compact"),
        None,
        "",
    )
    .await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (409, Some("nothing_to_compact")),
        "{problem}"
    );
    let (status, problem) = send(
        &server,
        "POST",
        &format!("/sessions/{}/compact", uuid::Uuid::now_v7()),
        None,
        "",
    )
    .await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (404, Some("session_not_found"))
    );
    let (session, _) = session(&server, 4).await;
    let (status, compaction) = send(
        &server,
        "POST",
        &format!("/sessions/{session}/compact"),
        None,
        "",
    )
    .await;
    assert_eq!(status, 200, "{compaction}");
    assert_eq!(compaction["trigger"], "manual");
    assert_eq!(compaction["run_id"], Value::Null);
    assert!(
        compaction["summary"]
            .as_str()
            .unwrap()
            .starts_with("Summary 1:")
    );
    assert!(compaction["messages_summarised"].as_u64().unwrap() >= 4);
    assert_eq!(model.summarised.load(Ordering::SeqCst), 1);
    let listed = server
        .get_json(&format!("/sessions/{session}/messages"))
        .await;
    let listed_ids: Vec<&Value> = listed["compactions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| &c["id"])
        .collect();
    assert_eq!(listed_ids, vec![&compaction["id"]]);
    assert_eq!(listed["compactions"][0]["summary"], compaction["summary"]);
    assert_eq!(
        listed["messages"].as_array().unwrap().len(),
        16,
        "every message stays"
    );
    // The next run starts from the summary.
    let (_, _, record) = run(&server, "Turn 5: look up k5, please.", Some(&session)).await;
    assert_eq!(record["status"], "completed");
    let last = model_requests(&fake).pop().unwrap();
    assert!(system_of(&last).contains("Summary 1:"), "{last}");
    assert!(!last.to_string().contains("Turn 1: look up"), "{last}");
    // Busy: a run held by a stalled reply.
    fake.respond_with(|_| Some(Reply::stall_after(b"")));
    let run_id = server.start_run("Turn 6: look up k6", Some(&session)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, problem) = send(
        &server,
        "POST",
        &format!("/sessions/{session}/compact"),
        None,
        "",
    )
    .await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (409, Some("session_busy")),
        "{problem}"
    );
    assert_eq!(problem["run_id"].as_str(), Some(run_id.as_str()));
    server
        .client
        .post(server.url(&format!("/runs/{run_id}/cancel")))
        .send()
        .await
        .unwrap();
    server.finished_run(&run_id).await;
    server.stop().await;
}

/// A summariser call cut midway (some text, then the connection closed) is a failed
/// compaction whose cost is not lost: the run's total usage counts the request's estimated size
/// plus the streamed text (`estimated: true`) on top of what its own model calls reported.
async fn a_summariser_cut_midway_counts_its_estimated_usage(backend: Backend) {
    let Some((server, _fake, model, _tools)) = start(backend, Wire::OpenAi, COMPACTION, 60).await
    else {
        return;
    };
    model.summaries(&[Summaries::Cut]);
    let mut session: Option<String> = None;
    let mut n = 0;
    let (frames, record) = loop {
        n += 1;
        assert!(n < 80, "no compaction attempt after {n} turns");
        let input = format!("Turn {n}: look up k{n}, please.");
        let (_, frames, record) = run(&server, &input, session.as_deref()).await;
        assert_eq!(record["status"], "completed", "{record}");
        session = Some(record["session_id"].as_str().unwrap().to_owned());
        if model.summarised.load(Ordering::SeqCst) > 0 {
            break (frames, record);
        }
    };
    assert!(of_type(&frames, "context_compacted").is_empty());
    let reported: u64 = of_type(&frames, "usage_recorded")
        .iter()
        .map(|f| f.json()["usage"]["input_tokens"].as_u64().unwrap())
        .sum();
    let total = &record["total_usage"];
    assert_eq!(total["estimated"], true, "{record}");
    // The summariser's request holds the whole head of the session: hundreds of tokens.
    let summariser = total["input_tokens"].as_u64().unwrap() - reported;
    assert!(
        summariser > 300,
        "{summariser} tokens for the cut summariser call: {record}"
    );
    assert!(total["output_tokens"].as_u64().unwrap() > 0, "{record}");
    let breaker = server.get_json("/compaction/circuit-breaker").await;
    assert_eq!(breaker["consecutive_failures"], 1, "{breaker}");
    server.stop().await;
}

/// A change of the settings applies from the next model call: a session past the threshold
/// with `auto` off is not compacted; turned on, the next run compacts.
async fn settings_apply_from_the_next_model_call(backend: Backend) {
    // Past 8,000 − 1,024 − 3,000 = 3,976 tokens, and far from the window.
    let compaction = "[compaction]\nauto = false\nbuffer_tokens = 3000\nkeep_tokens = 2000\n";
    let Some((server, fake, model, _tools)) = start(backend, Wire::OpenAi, compaction, 60).await
    else {
        return;
    };
    let mut session: Option<String> = None;
    for n in 1..=30 {
        let input = format!("Turn {n}: look up k{n}, please.");
        let (_, _, record) = run(&server, &input, session.as_deref()).await;
        assert_eq!(record["status"], "completed", "{record}");
        session = Some(record["session_id"].as_str().unwrap().to_owned());
        let last = model_requests(&fake).pop().unwrap();
        if fake_openai::prompt_tokens(&last) > 4_200 {
            break;
        }
    }
    let session = session.unwrap();
    assert_eq!(
        model.summarised.load(Ordering::SeqCst),
        0,
        "past the threshold, not compacted"
    );
    let (status, _) = send(
        &server,
        "PATCH",
        "/compaction",
        Some(r#"{"auto": true}"#),
        "application/json",
    )
    .await;
    assert_eq!(status, 200);
    let (_, frames, _) = run(&server, "Turn 9: look up k9, please.", Some(&session)).await;
    assert_eq!(of_type(&frames, "context_compacted").len(), 1);
    assert_valid_and_fitting(Wire::OpenAi, &fake);
    server.stop().await;
}

/// The built-in demo model summarises too (README, "The built-in model"): a manual compaction
/// of a session against it shrinks the context and the session goes on; a session too short to
/// shrink is `409 nothing_to_compact`, which the circuit breaker does not count.
async fn the_demo_model_compacts_a_session(backend: Backend) {
    let mut config = behest::provider::scripted::with_demo(Config::default());
    if let Some(demo) = config.providers.get_mut("demo") {
        demo.token_delay_ms = Some(0);
    }
    let Some(server) = TestServer::start(backend, config).await else {
        return;
    };
    let turn = |session: Option<String>, input: String| {
        let server = &server;
        async move {
            let mut body = json!({"provider": "demo", "model": "demo", "input": input});
            if let Some(session) = session {
                body["session_id"] = Value::from(session);
            }
            let run_id = server.create_run(body).await["run_id"]
                .as_str()
                .unwrap()
                .to_owned();
            let record = server.finished_run(&run_id).await;
            assert_eq!(record["status"], "completed", "{record}");
            record["session_id"].as_str().unwrap().to_owned()
        }
    };
    let tiny = turn(None, "hello".to_owned()).await;
    let (status, problem) = send(
        &server,
        "POST",
        &format!("/sessions/{tiny}/compact"),
        None,
        "",
    )
    .await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (409, Some("nothing_to_compact")),
        "{problem}"
    );
    let mut session = None;
    for n in 1..=4 {
        session = Some(turn(session, format!("Turn {n}: count to 60, please.")).await);
    }
    let session = session.unwrap();
    let (status, compaction) = send(
        &server,
        "POST",
        &format!("/sessions/{session}/compact"),
        None,
        "",
    )
    .await;
    assert_eq!(status, 200, "{compaction}");
    assert!(
        compaction["summary"]
            .as_str()
            .is_some_and(|s| s.starts_with("Summary of ") && s.contains("Turn 2: count to 60")),
        "{compaction}"
    );
    assert!(
        compaction["tokens_after"].as_u64() < compaction["tokens_before"].as_u64(),
        "{compaction}"
    );
    let breaker = server.get_json("/compaction/circuit-breaker").await;
    assert_eq!(breaker["consecutive_failures"], 0, "{breaker}");
    turn(Some(session), "And now?".to_owned()).await;
    server.stop().await;
}

/// Reads a run's event stream live: each frame with when it arrived.
struct LiveEvents {
    stream: std::pin::Pin<
        Box<
            dyn futures::Stream<
                    Item = Result<
                        eventsource_stream::Event,
                        eventsource_stream::EventStreamError<reqwest::Error>,
                    >,
                > + Send,
        >,
    >,
    frames: Vec<(Frame, std::time::Instant)>,
}

impl LiveEvents {
    async fn watch(server: &TestServer, run_id: &str) -> Self {
        use eventsource_stream::Eventsource;
        let response = server.watch(run_id, None).await;
        assert_eq!(response.status(), 200);
        Self {
            stream: Box::pin(response.bytes_stream().eventsource()),
            frames: Vec::new(),
        }
    }

    /// The next frame, or `None` once the server closed the stream.
    async fn next(&mut self) -> Option<Frame> {
        use futures::StreamExt;
        let event = tokio::time::timeout(Duration::from_secs(30), self.stream.next())
            .await
            .expect("an event or the stream's end within 30 s")?
            .expect("well-formed SSE");
        let frame = Frame {
            id: event.id,
            event: event.event,
            data: event.data,
        };
        self.frames.push((frame.clone(), std::time::Instant::now()));
        Some(frame)
    }

    /// Reads to the end of the stream; every frame read.
    async fn rest(mut self) -> Vec<(Frame, std::time::Instant)> {
        while self.next().await.is_some() {}
        self.frames
    }

    fn types(&self) -> Vec<&str> {
        self.frames.iter().map(|(f, _)| f.event.as_str()).collect()
    }
}

/// `[compaction]` of the tests that compact before a run's first model call: off at first,
/// compacting past 8,000 − 1,024 − 3,000 = 3,976 tokens once turned on.
const COMPACTION_LATER: &str =
    "[compaction]\nauto = false\nbuffer_tokens = 3000\nkeep_tokens = 2000\n";

/// Grows a session past the threshold of [`COMPACTION_LATER`] with `auto` off, turns `auto`
/// on, and starts the session's next run, watched live up to its `context_compaction_started`:
/// its first model call is compacted first. Returns the run's id, its session and its stream.
async fn until_compaction_starts(
    server: &TestServer,
    fake: &FakeOpenAi,
    model: &Model,
) -> (String, String, LiveEvents) {
    let mut session: Option<String> = None;
    for n in 1..=30 {
        let input = format!("Turn {n}: look up k{n}, please.");
        let (_, _, record) = run(server, &input, session.as_deref()).await;
        assert_eq!(record["status"], "completed", "{record}");
        session = Some(record["session_id"].as_str().unwrap().to_owned());
        let last = model_requests(fake).pop().unwrap();
        if fake_openai::prompt_tokens(&last) > 4_200 {
            break;
        }
    }
    assert_eq!(model.summarised.load(Ordering::SeqCst), 0);
    let (status, _) = send(
        server,
        "PATCH",
        "/compaction",
        Some(r#"{"auto": true}"#),
        "application/json",
    )
    .await;
    assert_eq!(status, 200);
    let session = session.unwrap();
    let run_id = server
        .start_run("Turn 31: look up k31, please.", Some(&session))
        .await;
    let mut live = LiveEvents::watch(server, &run_id).await;
    while let Some(frame) = live.next().await {
        if frame.event == "context_compaction_started" {
            return (run_id, session, live);
        }
    }
    panic!("the run did not compact: {:?}", live.types());
}

/// Issue 24 item 4: a compaction is visible while the summariser works. With a summariser
/// that takes 3 s, the run's stream has `run_started` and `context_built` at once, then
/// `context_compaction_started` (its trigger, size and model) while the summary is being
/// written — `context_compacted` arrives about 3 s later — and `GET /runs/{id}` says
/// `compacting` meanwhile; then the run goes on and completes.
async fn compaction_is_visible_while_the_summariser_works(backend: Backend) {
    let Some((server, fake, model, _tools)) =
        start(backend, Wire::OpenAi, COMPACTION_LATER, 60).await
    else {
        return;
    };
    let pause = Duration::from_secs(3);
    model.summaries(&[Summaries::Slow(pause)]);
    let (run_id, _, live) = until_compaction_starts(&server, &fake, &model).await;
    assert_eq!(
        live.types(),
        ["run_started", "context_built", "context_compaction_started"],
        "the run's opening events come before the summariser's answer"
    );
    // The event is logged just before the summariser is called.
    for _ in 0..100 {
        if model.summarised.load(Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        model.summarised.load(Ordering::SeqCst),
        1,
        "the summariser was called"
    );
    let record = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(record["status"], "compacting", "{record}");
    let started = live.frames[2].0.json();
    assert_eq!(started["trigger"], "auto", "{started}");
    assert_eq!(started["provider"], "fake");
    assert_eq!(started["model"], "fake-model");
    assert!(
        started["messages_to_summarise"].as_u64() > Some(0),
        "{started}"
    );
    assert!(started["tokens_before"].as_u64() > Some(3_976), "{started}");
    let started_at = live.frames[2].1;
    let frames = live.rest().await;
    let (compacted, compacted_at) = frames
        .iter()
        .find(|(f, _)| f.event == "context_compacted")
        .expect("context_compacted");
    assert!(
        compacted_at.duration_since(started_at) >= pause - Duration::from_millis(500),
        "context_compaction_started came {:?} before the summary",
        compacted_at.duration_since(started_at)
    );
    assert_eq!(
        compacted.json()["tokens_before"],
        started["tokens_before"],
        "the same estimate"
    );
    let types: Vec<&str> = frames.iter().map(|(f, _)| f.event.as_str()).collect();
    let at = |t: &str| types.iter().position(|x| *x == t).unwrap();
    assert!(at("context_compacted") < at("model_started"), "{types:?}");
    assert_eq!(types.last(), Some(&"run_completed"), "{types:?}");
    static SCHEMA: std::sync::LazyLock<EventSchema> = std::sync::LazyLock::new(EventSchema::new);
    for (frame, _) in &frames {
        SCHEMA.check(&frame.json());
    }
    let record = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(record["status"], "completed", "{record}");
    server.stop().await;
}

/// A cancel while the summariser works is an ordinary cancel of a started run: the stream
/// ends with `run_cancelled` (no `context_compacted`), the cut summariser call's estimated
/// usage is recorded (`usage_recorded`, `estimated: true`, counted in the run's
/// `total_usage`), the circuit breaker counts no failure, and the session's next input is
/// accepted and compacts.
async fn a_cancel_during_compaction_is_an_ordinary_cancel(backend: Backend) {
    let Some((server, fake, model, _tools)) =
        start(backend, Wire::OpenAi, COMPACTION_LATER, 60).await
    else {
        return;
    };
    model.summaries(&[Summaries::Slow(Duration::from_secs(4))]);
    let (run_id, session, live) = until_compaction_starts(&server, &fake, &model).await;
    let response = server
        .client
        .post(server.url(&format!("/runs/{run_id}/cancel")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
    let frames = live.rest().await;
    let types: Vec<&str> = frames.iter().map(|(f, _)| f.event.as_str()).collect();
    assert_eq!(
        types,
        [
            "run_started",
            "context_built",
            "context_compaction_started",
            "usage_recorded",
            "run_cancelled"
        ]
    );
    let usage = frames[3].0.json()["usage"].clone();
    assert_eq!(usage["estimated"], true, "{usage}");
    // The summariser was sent the older turns: hundreds of tokens.
    assert!(usage["input_tokens"].as_u64() > Some(300), "{usage}");
    let record = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(record["status"], "cancelled", "{record}");
    assert_eq!(record["total_usage"]["estimated"], true, "{record}");
    assert_eq!(record["total_usage"]["input_tokens"], usage["input_tokens"]);
    let breaker = server.get_json("/compaction/circuit-breaker").await;
    assert_eq!(breaker["consecutive_failures"], 0, "{breaker}");
    // The session takes its next input; its run compacts (the summariser answers at once now).
    let (_, frames, record) = run(&server, "Turn 99: look up k99, please.", Some(&session)).await;
    assert_eq!(record["status"], "completed", "{record}");
    assert_eq!(of_type(&frames, "context_compacted").len(), 1, "{frames:?}");
    server.stop().await;
}

/// A server stopped while the summariser works (the run stopped where it was, its log ending
/// with `context_compaction_started`) leaves the run resumable: the next process resumes it
/// (`run_resumed` at iteration 1, nothing abandoned), compacts again and completes it; the
/// log folds.
async fn a_run_stopped_while_compacting_resumes(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let fake = FakeOpenAi::start().await;
    fake.with_context_window(WINDOW);
    let model = Model::new(Wire::OpenAi, 60);
    model.attach(&fake);
    let tools = LookupServer::start(20).await;
    let config = config(Wire::OpenAi, &fake.base_url(), &tools, COMPACTION_LATER);
    let server = TestServer::on_store(db.store().await, config.clone(), None).await;
    model.summaries(&[Summaries::Slow(Duration::from_secs(4))]);
    let (run_id, session, live) = until_compaction_starts(&server, &fake, &model).await;
    drop(live);
    // The shutdown's grace (2 s) ends before the summary (4 s): the run stops where it is.
    server.stop().await;
    assert_eq!(model.summarised.load(Ordering::SeqCst), 1);
    let stopped = db.store().await;
    let record = stopped
        .get_run(run_id.parse().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.status.as_str(), "compacting", "{record:?}");

    let restarted = TestServer::on_store(db.store().await, config, None).await;
    assert_eq!(restarted.runtime.recover().await.unwrap(), 1);
    let record = restarted.finished_run(&run_id).await;
    assert_eq!(record["status"], "completed", "{record}");
    let frames = restarted.events(&run_id, None).await;
    let types: Vec<&str> = frames.iter().map(|f| f.event.as_str()).collect();
    assert_eq!(
        types[..6],
        [
            "run_started",
            "context_built",
            "context_compaction_started",
            "run_resumed",
            "context_compaction_started",
            "context_compacted"
        ],
        "{types:?}"
    );
    let resumed = frames[3].json();
    assert_eq!(resumed["iteration"], 1, "{resumed}");
    assert_eq!(resumed["abandoned_after"], Value::Null, "{resumed}");
    assert_eq!(model.summarised.load(Ordering::SeqCst), 2);
    let (_, _, record) = run(&restarted, "And now?", Some(&session)).await;
    assert_eq!(record["status"], "completed", "{record}");
    restarted.stop().await;
    db.cleanup().await;
}

/// Issue 24 item 5: calibration against a server that reports usage in the real OpenAI wire
/// format (a last chunk with `usage`, `choices: []`) and counts 1.6 × what behest's estimate
/// (`o200k_base` × 1.2 for a model it does not know) would say — a small-vocabulary model's
/// tokenizer. Over a 40-turn session with a tool call per turn: each auto compaction's
/// estimate of the compacted request (`context_compacted.tokens_after`) is within 10 % of
/// what the server then reports for the call made with it (measured from the compacted
/// request, far below `tokens_before`); and every request, as the server counts it, fit its
/// window (without calibration the threshold would be passed by a third).
async fn calibration_follows_a_server_that_counts_differently(backend: Backend) {
    let Some((server, fake, model, _tools)) = start(backend, Wire::OpenAi, COMPACTION, 60).await
    else {
        return;
    };
    *model.usage_scale.lock().unwrap() = 1.6;
    let (_, runs) = session(&server, 40).await;
    let mut compactions = 0;
    for frames in &runs {
        let Some(at) = frames.iter().position(|f| f.event == "context_compacted") else {
            continue;
        };
        let compacted = frames[at].json();
        assert_eq!(compacted["trigger"], "auto", "{compacted}");
        let reported = frames[at..]
            .iter()
            .find(|f| f.event == "usage_recorded")
            .map(|f| f.json()["usage"].clone())
            .expect("a model call after the compaction");
        assert_eq!(
            reported["estimated"], false,
            "the server reported it: {reported}"
        );
        let reported = reported["input_tokens"].as_u64().unwrap() as f64;
        let estimated = compacted["tokens_after"].as_u64().unwrap() as f64;
        let before = compacted["tokens_before"].as_u64().unwrap() as f64;
        let off = (estimated - reported).abs() / reported;
        assert!(
            off <= 0.10,
            "compaction {compactions}: {estimated} estimated vs {reported} reported ({:.1} %)",
            off * 100.0
        );
        assert!(
            reported < before * 0.8,
            "{reported} reported, {before} before"
        );
        compactions += 1;
    }
    assert!(compactions >= 3, "{compactions} compactions in 40 turns");
    for body in model_requests(&fake) {
        let reported = model.reported_prompt(&body);
        assert!(
            reported + MAX_OUTPUT <= WINDOW,
            "a request of {reported} tokens (as the server counts) did not fit"
        );
    }
    server.stop().await;
}

/// Runs `body` (on the fake model) to its end; returns its frames and its record.
async fn run_body(server: &TestServer, mut body: Value) -> (Vec<Frame>, Value) {
    body["provider"] = json!("fake");
    body["model"] = json!("fake-model");
    let created = server.create_run(body).await;
    let run_id = created["run_id"].as_str().unwrap();
    let frames = tokio::time::timeout(Duration::from_secs(30), server.events(run_id, None))
        .await
        .expect("the run ends within 30 s");
    (frames, server.get_json(&format!("/runs/{run_id}")).await)
}

/// A request that cannot fit whatever compaction does — an input, or a short input with
/// instructions or tool definitions, longer than the window (every request carries all three)
/// — is refused at create (`422 input_too_large`): nothing is stored, nothing is sent.
async fn a_request_that_cannot_fit_is_refused_at_create(backend: Backend) {
    let Some((server, fake, _model, _tools)) = start(backend, Wire::OpenAi, COMPACTION, 60).await
    else {
        return;
    };
    let sessions = server.get_json("/sessions").await;
    let runs = server.get_json("/runs").await;
    let long_tool = json!([{"name": "lookup_everything", "description": "word ".repeat(7_000)}]);
    for (body, field) in [
        (json!({"input": "word ".repeat(7_000)}), "input"),
        (
            json!({"input": "Hello.", "instructions": "word ".repeat(7_000)}),
            "instructions",
        ),
        (json!({"input": "Hello.", "tools": long_tool}), "tools"),
    ] {
        let mut body = body;
        body["provider"] = json!("fake");
        body["model"] = json!("fake-model");
        let problem = server.refused("/runs", &body, 422, "input_too_large").await;
        assert_eq!(problem["field"], field, "{problem}");
        assert!(
            problem["detail"].as_str().unwrap().contains("fake-model"),
            "{problem}"
        );
    }
    assert!(model_requests(&fake).is_empty(), "nothing was sent");
    // Short enough with its instructions: created.
    let (_, record) = run_body(
        &server,
        json!({"input": "Hello.", "instructions": "word ".repeat(50)}),
    )
    .await;
    assert_ne!(record["status"], "failed", "{record}");
    let runs_after = server.get_json("/runs").await;
    assert_eq!(
        runs_after["runs"].as_array().map(Vec::len),
        runs["runs"].as_array().map(|r| r.len() + 1),
        "only the run that fits was created"
    );
    assert_eq!(
        server.get_json("/sessions").await["sessions"]
            .as_array()
            .map(Vec::len),
        sessions["sessions"].as_array().map(|s| s.len() + 1),
        "only the run that fits created a session"
    );
    server.db.as_ref().unwrap().assert_logs_fold().await;
    server.stop().await;
}

/// A session whose default `instructions` no run could send with its default model — over
/// the window less the answer with a one-word input — is refused at `POST /sessions` with the
/// run's `422 input_too_large`, naming `defaults.instructions`; nothing is stored. Defaults
/// without a model leave the check to each run.
async fn session_defaults_that_cannot_fit_are_refused_at_create(backend: Backend) {
    let Some((server, fake, _model, _tools)) = start(backend, Wire::OpenAi, COMPACTION, 60).await
    else {
        return;
    };
    let post = |body: Value| {
        let request = server.client.post(server.url("/sessions")).json(&body);
        async move { request.send().await.unwrap() }
    };
    let long = "word ".repeat(7_000);
    let too_long = json!({"defaults": {"provider": "fake", "model": "fake-model",
                                       "instructions": long}});
    let problem = server
        .refused("/sessions", &too_long, 422, "input_too_large")
        .await;
    assert_eq!(problem["field"], "defaults.instructions", "{problem}");
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("fake-model"), "{problem}");
    assert_eq!(
        server.get_json("/sessions").await["sessions"],
        json!([]),
        "nothing was stored"
    );
    // Short enough: created, and its run runs.
    let fits = post(
        json!({"defaults": {"provider": "fake", "model": "fake-model",
                                        "instructions": "word ".repeat(50)}}),
    )
    .await;
    assert_eq!(fits.status(), 201);
    let session: Value = fits.json().await.unwrap();
    let (_, record) = run_body(
        &server,
        json!({"session_id": session["id"], "input": "Hello."}),
    )
    .await;
    assert_ne!(record["status"], "failed", "{record}");
    let sent = model_requests(&fake).len();
    // No model in the defaults: accepted; a run taking them is refused as before.
    let unbound = post(json!({"defaults": {"instructions": long}})).await;
    assert_eq!(unbound.status(), 201);
    let session: Value = unbound.json().await.unwrap();
    let body = json!({"session_id": session["id"], "input": "Hello.",
                      "provider": "fake", "model": "fake-model"});
    let problem = server.refused("/runs", &body, 422, "input_too_large").await;
    assert_eq!(problem["field"], "instructions", "{problem}");
    assert_eq!(
        model_requests(&fake).len(),
        sent,
        "the refused run sent nothing"
    );
    // A default `max_output_tokens` above the model's would refuse every run: refused here.
    let above = json!({"defaults": {"provider": "fake", "model": "fake-model",
                                    "parameters": {"max_output_tokens": MAX_OUTPUT + 1}}});
    let problem = server
        .refused("/sessions", &above, 422, "invalid_field")
        .await;
    assert_eq!(problem["field"], "defaults", "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("max_output_tokens"),
        "{problem}"
    );
    // The longest default instructions accepted leave room for the tool definitions every
    // run of the session offers: a run taking them with a one-word input is accepted.
    let session_of = |words: usize| {
        post(
            json!({"defaults": {"provider": "fake", "model": "fake-model",
                                 "instructions": "word ".repeat(words)}}),
        )
    };
    let (mut fits, mut too_long) = (50_usize, 7_000_usize);
    while too_long - fits > 1 {
        let words = usize::midpoint(fits, too_long);
        let response = session_of(words).await;
        match response.status().as_u16() {
            201 => fits = words,
            422 => too_long = words,
            other => panic!("POST /sessions answered {other}"),
        }
    }
    let session: Value = session_of(fits).await.json().await.unwrap();
    let run = server
        .client
        .post(server.url("/runs"))
        .json(&json!({"session_id": session["id"], "input": "x"}))
        .send()
        .await
        .unwrap();
    let status = run.status();
    assert_eq!(
        status,
        202,
        "{fits} words of instructions: {}",
        run.text().await.unwrap()
    );
    server.stop().await;
}

/// A request still over the window after compaction (what compaction keeps verbatim — the
/// latest input with its instructions, the summary, the run's own turn — is too long) is not
/// sent: the run fails with `context_length_exceeded`, the model never sees a request over its
/// window, and the session goes on — the next input is accepted and answered with a valid
/// history.
async fn a_compacted_request_still_too_long_is_not_sent(backend: Backend) {
    for wire in WIRES {
        let Some((server, fake, model, _tools)) = start(backend, wire, COMPACTION, 200).await
        else {
            return;
        };
        // Four turns, summarised in 500 words: the first call fits, the tool result after it
        // does not, and nothing is left to compact.
        let (session, _) = session(&server, 4).await;
        model.summaries(&[Summaries::Words(500); 3]);
        let (frames, record) = run_body(
            &server,
            // Alone with its instructions the input fits (else it is refused at create).
            json!({"session_id": session, "input": "word ".repeat(3_700),
                   "instructions": "word ".repeat(1_800)}),
        )
        .await;
        assert_eq!(record["status"], "failed", "{record}");
        assert!(
            !of_type(&frames, "context_compacted").is_empty(),
            "{frames:?}"
        );
        let failed = frames.last().unwrap().json();
        assert_eq!(failed["error_class"], "context_length_exceeded", "{failed}");
        assert_eq!(fake.rejected(), 0, "no request over the window was sent");
        let (_, _, record) = run(&server, "Turn 5: look up k5, please.", Some(&session)).await;
        assert_eq!(record["status"], "completed", "{record}");
        assert_valid_and_fitting(wire, &fake);
        server.db.as_ref().unwrap().assert_logs_fold().await;
        server.stop().await;
    }
}

on_both_backends!(
    a_request_that_cannot_fit_is_refused_at_create,
    session_defaults_that_cannot_fit_are_refused_at_create,
    a_compacted_request_still_too_long_is_not_sent,
    calibration_follows_a_server_that_counts_differently,
    compaction_is_visible_while_the_summariser_works,
    a_run_stopped_while_compacting_resumes,
    a_cancel_during_compaction_is_an_ordinary_cancel,
    the_demo_model_compacts_a_session,
    a_200_turn_session_stays_inside_the_window,
    summaries_are_incremental_and_the_tail_is_whole,
    prune_replaces_old_tool_outputs_in_requests_only,
    a_context_length_error_compacts_once_and_retries,
    a_failing_summariser_trips_the_breaker,
    the_settings_are_edited_checked_and_kept,
    a_session_is_compacted_on_request,
    a_summariser_cut_midway_counts_its_estimated_usage,
    settings_apply_from_the_next_model_call,
);
