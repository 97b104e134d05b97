//! Agents you can define (issue 11), over HTTP against the fake providers on both store
//! backends: instructions in each wire format's native place, model parameters in the
//! request, `provider_options` that cannot override what behest owns, presets plus overrides
//! (and `GET /agents`), client-executed tools through `requires_action` → `tool_outputs` on both
//! wire formats with parallel calls (errors for missing, unknown, duplicate and late outputs; a
//! cancel and an expiry while waiting), approvals granted and rejected, sessions as resources,
//! and a validation error for each field. Restarts while waiting: `tests/it/agents_restart.rs`.

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use behest::config::Config;
use serde_json::{Value, json};
use support::db::Backend;
use support::fake_anthropic;
use support::fake_openai::{FakeOpenAi, RecordedRequest, Reply, text_stream, tool_calls_stream};
use support::server::{Frame, TestServer};
use support::validate::{validate_anthropic_request, validate_openai_request};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wire {
    OpenAi,
    Anthropic,
}

impl Wire {
    /// The provider id of this wire format in [`config`].
    fn provider(self) -> &'static str {
        match self {
            Self::OpenAi => "fake",
            Self::Anthropic => "claude",
        }
    }

    fn text(self, text: &str) -> Reply {
        Reply::sse(&match self {
            Self::OpenAi => text_stream(&[text]),
            Self::Anthropic => fake_anthropic::text_stream(&[text]),
        })
    }

    fn tool_calls(self, calls: &[(&str, &str, Value)]) -> Reply {
        Reply::sse(&match self {
            Self::OpenAi => tool_calls_stream(calls),
            Self::Anthropic => fake_anthropic::tool_use_stream(calls),
        })
    }

    fn path(self) -> &'static str {
        match self {
            Self::OpenAi => "/v1/chat/completions",
            Self::Anthropic => "/v1/messages",
        }
    }

    /// `(call id, result text)` of every tool result in a request body, in order.
    fn tool_results(self, body: &Value) -> Vec<(String, String)> {
        let messages = body["messages"].as_array().unwrap();
        match self {
            Self::OpenAi => messages
                .iter()
                .filter(|m| m["role"] == "tool")
                .map(|m| {
                    (
                        m["tool_call_id"].as_str().unwrap().to_owned(),
                        m["content"].as_str().unwrap().to_owned(),
                    )
                })
                .collect(),
            Self::Anthropic => messages
                .iter()
                .filter_map(|m| m["content"].as_array())
                .flatten()
                .filter(|block| block["type"] == "tool_result")
                .map(|block| {
                    (
                        block["tool_use_id"].as_str().unwrap().to_owned(),
                        block["content"].as_str().unwrap().to_owned(),
                    )
                })
                .collect(),
        }
    }

    fn assert_valid(self, requests: &[RecordedRequest]) {
        for (n, request) in requests
            .iter()
            .filter(|r| r.path == self.path())
            .enumerate()
        {
            let errors = match self {
                Self::OpenAi => validate_openai_request(&request.body),
                Self::Anthropic => validate_anthropic_request(&request.body),
            };
            assert!(
                errors.is_empty(),
                "{self:?} request {n} is invalid: {errors:?}\n{}",
                serde_json::to_string_pretty(&request.body["messages"]).unwrap()
            );
        }
    }
}

const BOTH: [Wire; 2] = [Wire::OpenAi, Wire::Anthropic];

/// Providers `fake` (OpenAI Chat Completions), `dev` (the same with `instructions_role =
/// "developer"`) and `claude` (Anthropic Messages), all at the fake's `base_url`, each with
/// the model `fake-model` (at most 1024 output tokens); `extra` TOML goes first.
fn config(base_url: &str, extra: &str) -> Config {
    let provider = |id: &str, kind: &str, options: &str| {
        format!(
            "[providers.{id}]\nkind = \"{kind}\"\nbase_url = \"{base_url}\"\n{options}\
             [providers.{id}.timeouts]\nconnect_ms = 2000\nfirst_byte_ms = 5000\nidle_ms = 5000\ntotal_ms = 20000\n\
             [providers.{id}.retry]\nmax_attempts = 1\n\
             [providers.{id}.models.fake-model]\ncontext_window = 128000\nmax_output_tokens = 1024\n"
        )
    };
    let toml = format!(
        "{extra}\n{}{}{}",
        provider("fake", "openai", ""),
        provider("dev", "openai", "instructions_role = \"developer\"\n"),
        provider("claude", "anthropic", ""),
    );
    Config::from_toml(&toml).expect("test config")
}

/// Starts a run; returns its id.
async fn start(server: &TestServer, body: Value) -> String {
    let (status, created) = server.post("/runs", &body).await;
    assert_eq!(status, 202, "{body}: {created}");
    created["run_id"].as_str().unwrap().to_owned()
}

/// Polls the run until `done` holds for its record (at most 20 s); returns the record.
async fn wait_for(server: &TestServer, run_id: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let run = server.get_json(&format!("/runs/{run_id}")).await;
        if done(&run) {
            return run;
        }
        assert!(Instant::now() < deadline, "the run never got there: {run}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn waiting(server: &TestServer, run_id: &str) -> Value {
    wait_for(server, run_id, |run| run["status"] == "requires_action").await
}

fn kinds(frames: &[Frame]) -> Vec<&str> {
    frames.iter().map(|f| f.event.as_str()).collect()
}

fn requests_to(fake: &FakeOpenAi, wire: Wire) -> Vec<RecordedRequest> {
    fake.requests()
        .into_iter()
        .filter(|r| r.path == wire.path())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Instructions, parameters, provider options

async fn instructions_and_parameters_reach_both_wire_formats(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config(&fake.base_url(), "")).await else {
        return;
    };
    let tool = json!({"name": "lookup", "description": "Looks a key up.", "parameters": {"type": "object"}});

    fake.push(Wire::OpenAi.text("ok"));
    let run_id = start(
        &server,
        json!({"provider": "fake", "model": "fake-model", "input": "hi",
               "instructions": "Be brief.", "temperature": 0.3, "top_p": 0.9,
               "max_output_tokens": 200, "stop": ["END"], "seed": 7, "parallel_tool_calls": false,
               "provider_options": {"user": "u-1", "logit_bias": {"50256": -100}},
               "tools": [tool]}),
    )
    .await;
    let run = server.finished_run(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    let sent = &fake.requests()[0].body;
    assert_eq!(
        sent["messages"][0],
        json!({"role": "system", "content": "Be brief."})
    );
    assert_eq!(sent["messages"][1]["role"], "user");
    for (key, value) in [
        ("model", json!("fake-model")),
        ("stream", json!(true)),
        ("temperature", json!(0.3)),
        ("top_p", json!(0.9)),
        ("max_tokens", json!(200)),
        ("stop", json!(["END"])),
        ("seed", json!(7)),
        ("parallel_tool_calls", json!(false)),
        ("user", json!("u-1")),
        ("logit_bias", json!({"50256": -100})),
    ] {
        assert_eq!(sent[key], value, "{key} in {sent}");
    }
    assert_eq!(sent["tools"][0]["function"]["name"], "lookup");
    // Stored on the run record and shown.
    assert_eq!(run["instructions"], "Be brief.");
    assert_eq!(
        run["parameters"],
        json!({"temperature": 0.3, "top_p": 0.9, "max_output_tokens": 200, "stop": ["END"],
               "seed": 7, "parallel_tool_calls": false})
    );
    assert_eq!(run["provider_options"]["user"], "u-1");
    assert_eq!(run["tools"], json!([tool]));

    // The developer role, where the provider is configured for it.
    fake.push(Wire::OpenAi.text("ok"));
    let run_id = start(
        &server,
        json!({"provider": "dev", "model": "fake-model", "input": "hi", "instructions": "Be brief."}),
    )
    .await;
    server.finished_run(&run_id).await;
    assert_eq!(
        fake.requests()[1].body["messages"][0],
        json!({"role": "developer", "content": "Be brief."})
    );
    // No parameters given: none sent (the provider's defaults), the output limit is the model's.
    for key in [
        "temperature",
        "top_p",
        "stop",
        "seed",
        "parallel_tool_calls",
    ] {
        assert!(fake.requests()[1].body.get(key).is_none(), "{key}");
    }
    assert_eq!(fake.requests()[1].body["max_tokens"], 1024);

    // Anthropic: top-level `system`, `stop_sequences`, `disable_parallel_tool_use`.
    fake.push(Wire::Anthropic.text("ok"));
    let run_id = start(
        &server,
        json!({"provider": "claude", "model": "fake-model", "input": "hi",
               "instructions": "Be brief.", "temperature": 0.3, "top_p": 0.9,
               "max_output_tokens": 200, "stop": ["END"], "parallel_tool_calls": false,
               "provider_options": {"top_k": 5, "metadata": {"user_id": "u-1"}},
               "tools": [tool]}),
    )
    .await;
    assert_eq!(server.finished_run(&run_id).await["status"], "completed");
    let sent = &fake.requests()[2].body;
    assert_eq!(fake.requests()[2].path, "/v1/messages");
    assert_eq!(sent["system"], "Be brief.");
    assert_eq!(sent["messages"][0]["role"], "user");
    for (key, value) in [
        ("temperature", json!(0.3)),
        ("top_p", json!(0.9)),
        ("max_tokens", json!(200)),
        ("stop_sequences", json!(["END"])),
        (
            "tool_choice",
            json!({"type": "auto", "disable_parallel_tool_use": true}),
        ),
        ("top_k", json!(5)),
        ("metadata", json!({"user_id": "u-1"})),
        ("stream", json!(true)),
    ] {
        assert_eq!(sent[key], value, "{key} in {sent}");
    }
    assert!(sent.get("seed").is_none() && sent.get("stop").is_none());

    // provider_options may not set what behest owns, on either wire format.
    for (provider, key) in [
        ("fake", "messages"),
        ("fake", "stream"),
        ("fake", "tools"),
        ("fake", "model"),
        ("fake", "max_tokens"),
        ("fake", "temperature"),
        ("fake", "n"),
        ("claude", "messages"),
        ("claude", "system"),
        ("claude", "thinking"),
        ("claude", "stream"),
        ("claude", "stop_sequences"),
    ] {
        let body = json!({"provider": provider, "model": "fake-model", "input": "hi",
                          "provider_options": {key: false}});
        let (status, problem) = server.post("/runs", &body).await;
        assert_eq!(
            (status, problem["code"].as_str(), problem["field"].as_str()),
            (422, Some("invalid_field"), Some("provider_options")),
            "{provider} {key}: {problem}"
        );
        assert!(
            problem["detail"]
                .as_str()
                .unwrap()
                .contains(&format!("`{key}`")),
            "{problem}"
        );
    }
    assert_eq!(fake.requests().len(), 3, "refused runs call no model");
    server.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Presets

const PRESETS: &str = r#"
[agents.support]
description = "Answers support questions."
provider = "fake"
model = "fake-model"
instructions = "You are support."
max_iterations = 3
tools = [{ name = "lookup_order", description = "An order by id.", parameters = { type = "object", properties = { id = { type = "string" } }, required = ["id"] } }]
provider_options = { user = "preset" }

[agents.support.parameters]
temperature = 0.2
seed = 5

[agents.support.doom_loop]
threshold = 4

[agents.terse]
provider = "claude"
model = "fake-model"
instructions = "Answer in one word."
"#;

async fn a_preset_plus_overrides(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config(&fake.base_url(), PRESETS)).await else {
        return;
    };
    let agents = server.get_json("/agents").await;
    let names: Vec<&str> = agents["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["support", "terse"]);
    let support = &agents["agents"][0];
    assert_eq!(support["instructions"], "You are support.");
    assert_eq!(
        support["parameters"],
        json!({"temperature": 0.2, "seed": 5})
    );
    assert_eq!(
        support["doom_loop"],
        json!({"enabled": true, "threshold": 4, "allow": []})
    );
    assert_eq!(support["tools"][0]["name"], "lookup_order");
    assert_eq!(support["max_iterations"], 3);

    // The preset, with the request's fields over it.
    fake.push(Wire::OpenAi.text("ok"));
    let run_id = start(
        &server,
        json!({"agent": "support", "input": "where is my order?", "temperature": 0.9,
               "provider_options": {"metadata": {"ticket": "t-1"}}}),
    )
    .await;
    let run = server.finished_run(&run_id).await;
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(
        (
            run["agent"].as_str(),
            run["provider"].as_str(),
            run["max_iterations"].as_u64()
        ),
        (Some("support"), Some("fake"), Some(3))
    );
    assert_eq!(run["parameters"], json!({"temperature": 0.9, "seed": 5}));
    assert_eq!(run["doom_loop"]["threshold"], 4);
    assert_eq!(
        run["provider_options"],
        json!({"user": "preset", "metadata": {"ticket": "t-1"}})
    );
    let sent = &fake.requests()[0].body;
    assert_eq!(
        sent["messages"][0],
        json!({"role": "system", "content": "You are support."})
    );
    assert_eq!(
        (sent["temperature"].as_f64(), sent["seed"].as_i64()),
        (Some(0.9), Some(5))
    );
    assert_eq!(sent["user"], "preset");
    assert_eq!(sent["tools"][0]["function"]["name"], "lookup_order");
    let session = run["session_id"].as_str().unwrap().to_owned();

    // The session remembers the agent of its first run.
    let remembered = server.get_json(&format!("/sessions/{session}")).await;
    assert_eq!(remembered["defaults"], json!({"agent": "support"}));
    fake.push(Wire::OpenAi.text("ok"));
    let run_id = start(&server, json!({"session_id": session, "input": "and now?"})).await;
    let run = server.finished_run(&run_id).await;
    assert_eq!(run["agent"], "support");
    let sent = &fake.requests()[1].body;
    assert_eq!(sent["messages"][0]["content"], "You are support.");
    assert_eq!(
        sent["temperature"], 0.2,
        "the first run's override was its own"
    );

    // A run overrides the instructions, or removes them with "".
    for (instructions, first) in [
        (
            json!("Be terse."),
            json!({"role": "system", "content": "Be terse."}),
        ),
        (json!(""), json!("user")),
    ] {
        fake.push(Wire::OpenAi.text("ok"));
        let run_id = start(
            &server,
            json!({"session_id": session, "input": "again", "instructions": instructions}),
        )
        .await;
        server.finished_run(&run_id).await;
        let sent = fake.requests().last().unwrap().body.clone();
        if first.is_string() {
            assert_eq!(sent["messages"][0]["role"], first);
        } else {
            assert_eq!(sent["messages"][0], first);
        }
    }

    // Another agent in the same session: its own provider (Anthropic) and instructions.
    fake.push(Wire::Anthropic.text("Yes."));
    let run_id = start(
        &server,
        json!({"session_id": session, "input": "ok?", "agent": "terse"}),
    )
    .await;
    assert_eq!(server.finished_run(&run_id).await["provider"], "claude");
    let sent = fake.requests().last().unwrap().body.clone();
    assert_eq!(sent["system"], "Answer in one word.");
    Wire::OpenAi.assert_valid(&fake.requests());
    Wire::Anthropic.assert_valid(&fake.requests());

    let (status, problem) = server
        .post("/runs", &json!({"agent": "nobody", "input": "hi"}))
        .await;
    assert_eq!(
        (status, problem["code"].as_str(), problem["field"].as_str()),
        (422, Some("unknown_agent"), Some("agent"))
    );
    server.stop().await;
}

/// A preset that would not run stops startup, naming it.
#[tokio::test]
async fn a_bad_preset_stops_startup() {
    let db = support::db::TestDb::new(Backend::Sqlite).await.unwrap();
    for (preset, named) in [
        ("provider = \"nope\"\nmodel = \"m\"\n", "no provider `nope`"),
        (
            "provider = \"fake\"\nmodel = \"fake-model\"\n[agents.bad.parameters]\nmax_output_tokens = 5000\n",
            "max_output_tokens",
        ),
        (
            "provider = \"fake\"\nmodel = \"fake-model\"\ntools = [\"missing_tool\"]\n",
            "missing_tool",
        ),
        (
            "provider = \"claude\"\nmodel = \"fake-model\"\n[agents.bad.parameters]\nseed = 1\n",
            "seed",
        ),
        (
            "provider = \"fake\"\nmodel = \"fake-model\"\noutput_schema = { allOf = [{ \"$ref\" = \"#\" }] }\n",
            "`output_schema`: has a `$ref` cycle",
        ),
    ] {
        let config = config("http://127.0.0.1:9/v1", &format!("[agents.bad]\n{preset}"));
        let tools = Arc::new(behest::tools::ToolRegistry::default());
        let error = behest::server::runtime(&config, db.store().await, tools)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            error.contains("agents.bad") && error.contains(named),
            "{preset}: {error}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Client-executed tools

fn client_tools() -> Value {
    json!([
        {"name": "get_location", "description": "Where the user is."},
        {"name": "get_weather", "description": "The weather in a city.",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                        "required": ["city"]}}
    ])
}

/// Outputs for the calls of [`parallel_calls`] after the run ended (`run_status`): `409
/// run_not_waiting`.
async fn assert_late(server: &TestServer, run_id: &str, run_status: &str) {
    let (status, problem) = server
        .post(
            &format!("/runs/{run_id}/tool_outputs"),
            &json!({"tool_outputs": [{"call_id": "call_loc", "output": 1},
                                 {"call_id": "call_wx", "output": 2}]}),
        )
        .await;
    assert_eq!(
        (
            status,
            problem["code"].as_str(),
            problem["run_status"].as_str()
        ),
        (409, Some("run_not_waiting"), Some(run_status)),
        "{problem}"
    );
}

/// The model calls two client tools and one with arguments its schema refuses, in parallel.
fn parallel_calls(wire: Wire) -> Reply {
    wire.tool_calls(&[
        ("call_loc", "get_location", json!({})),
        ("call_wx", "get_weather", json!({"city": "Paris"})),
        ("call_bad", "get_weather", json!({"town": "Paris"})),
    ])
}

async fn client_tool_round_trip(backend: Backend) {
    for wire in BOTH {
        let fake = FakeOpenAi::start().await;
        let Some(server) = TestServer::start(backend, config(&fake.base_url(), "")).await else {
            return;
        };
        fake.push(parallel_calls(wire));
        fake.push(wire.text("It is sunny in Paris."));
        let run_id = start(
            &server,
            json!({"provider": wire.provider(), "model": "fake-model",
                   "input": "what is the weather here?", "tools": client_tools()}),
        )
        .await;
        let run = waiting(&server, &run_id).await;
        let action = &run["required_action"];
        let pending: Vec<(&str, &str, &str)> = action["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["call_id"].as_str().unwrap(),
                    c["tool_name"].as_str().unwrap(),
                    c["kind"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            pending,
            [
                ("call_loc", "get_location", "client_tool"),
                ("call_wx", "get_weather", "client_tool")
            ],
            "{wire:?}: the call whose arguments fail the schema is not handed out"
        );
        assert_eq!(
            action["tool_calls"][1]["arguments"],
            json!({"city": "Paris"})
        );
        assert!(action["expires_at"].is_string());
        assert_eq!(fake.requests().len(), 1, "the model waits");

        let path = format!("/runs/{run_id}/tool_outputs");
        let output = |id: &str, value: Value| json!({"call_id": id, "output": value});
        for (body, status, code) in [
            (
                json!({"tool_outputs": [output("call_loc", json!({"city": "Paris"}))]}),
                422,
                "missing_tool_calls",
            ),
            (
                json!({"tool_outputs": [output("call_loc", json!(1)), output("call_nope", json!(1))]}),
                422,
                "unknown_tool_call",
            ),
            (
                json!({"tool_outputs": [output("call_loc", json!(1)), output("call_loc", json!(2))]}),
                422,
                "duplicate_tool_call",
            ),
            (
                json!({"tool_outputs": [output("call_bad", json!(1))]}),
                422,
                "unknown_tool_call",
            ),
            (
                json!({"tool_outputs": [{"call_id": "call_loc", "output": 1, "error": "x"},
                                        output("call_wx", json!(1))]}),
                422,
                "invalid_field",
            ),
            (
                json!({"tool_outputs": [{"call_id": "call_loc"}, output("call_wx", json!(1))]}),
                422,
                "invalid_field",
            ),
            (json!({"outputs": []}), 422, "invalid_body"),
        ] {
            let (got, problem) = server.post(&path, &body).await;
            assert_eq!(
                (got, problem["code"].as_str()),
                (status, Some(code)),
                "{wire:?} {body}: {problem}"
            );
            if code != "invalid_body" {
                assert_eq!(problem["field"], "tool_outputs", "{problem}");
            }
        }
        let (status, problem) = server
            .post(
                &format!("/runs/{run_id}/approvals"),
                &json!({"approvals": [{"call_id": "call_loc", "approve": true}]}),
            )
            .await;
        assert_eq!(
            (
                status,
                problem["code"].as_str(),
                problem["run_status"].as_str()
            ),
            (409, Some("run_not_waiting"), Some("requires_action")),
            "{problem}"
        );
        assert_eq!(waiting(&server, &run_id).await["status"], "requires_action");

        let (status, accepted) = server
            .post(
                &path,
                &json!({"tool_outputs": [
                    {"call_id": "call_wx", "error": "weather service down"},
                    output("call_loc", json!({"city": "Paris"}))
                ]}),
            )
            .await;
        assert_eq!(status, 202, "{accepted}");
        assert_eq!(accepted["id"], run_id.as_str());
        let run = server.finished_run(&run_id).await;
        assert_eq!(run["status"], "completed", "{run}");
        assert!(run.get("required_action").is_none(), "{run}");

        // The results are committed like server tool results, in the model's call order.
        let frames = server.events(&run_id, None).await;
        let kinds = kinds(&frames);
        assert_eq!(
            kinds
                .iter()
                .filter(|k| **k == "tool_calls_required")
                .count(),
            1
        );
        assert!(!kinds.contains(&"tool_execution_started"), "{kinds:?}");
        let required = kinds
            .iter()
            .position(|k| *k == "tool_calls_required")
            .unwrap();
        let finished: Vec<Value> = frames
            .iter()
            .filter(|f| f.event == "tool_execution_finished")
            .map(Frame::json)
            .collect();
        let calls: Vec<&str> = finished
            .iter()
            .map(|f| f["call_id"].as_str().unwrap())
            .collect();
        assert_eq!(calls, ["call_loc", "call_wx", "call_bad"], "{wire:?}");
        assert_eq!(
            finished[0]["result"],
            json!({"Success": {"output": {"city": "Paris"}}})
        );
        assert_eq!(
            finished[1]["result"],
            json!({"Failure": {"error": "weather service down"}})
        );
        assert!(
            finished[2]["result"]["Failure"]["error"]
                .as_str()
                .unwrap()
                .starts_with("invalid arguments for `get_weather`"),
            "{}",
            finished[2]
        );
        let first_finished = kinds
            .iter()
            .position(|k| *k == "tool_execution_finished")
            .unwrap();
        assert!(required < first_finished, "{kinds:?}");
        assert_eq!(
            kinds
                .iter()
                .filter(|k| **k == "tool_message_committed")
                .count(),
            3
        );
        // What the model saw next.
        let requests = requests_to(&fake, wire);
        assert_eq!(requests.len(), 2);
        let results = wire.tool_results(&requests[1].body);
        assert_eq!(
            results[0],
            ("call_loc".to_owned(), "{\"city\":\"Paris\"}".to_owned())
        );
        assert_eq!(
            results[1],
            (
                "call_wx".to_owned(),
                "error: weather service down".to_owned()
            )
        );
        assert!(
            results[2].1.starts_with("error: invalid arguments"),
            "{results:?}"
        );
        wire.assert_valid(&requests);
        let output = server.get_json(&format!("/runs/{run_id}/output")).await;
        assert_eq!(
            output["messages"].as_array().unwrap().last().unwrap()["content"][0]["text"],
            "It is sunny in Paris."
        );

        // Late: the run is over. The same outputs again (a retry after a lost response) are
        // accepted again: the run as it is now; other outputs are refused, naming the pause
        // already answered and the answer that stands.
        let (status, again) = server
            .post(
                &path,
                &json!({"tool_outputs": [
                    {"call_id": "call_loc", "output": {"city": "Paris"}},
                    {"call_id": "call_wx", "error": "weather service down"}
                ]}),
            )
            .await;
        assert_eq!(status, 202, "{again}");
        assert_eq!(
            (again["id"].as_str(), again["status"].as_str()),
            (Some(run_id.as_str()), Some("completed")),
            "{again}"
        );
        let (status, problem) = server
            .post(
                &path,
                &json!({"tool_outputs": [{"call_id": "call_loc", "output": {"city": "Paris"}},
                                     {"call_id": "call_wx", "output": "sunny"}]}),
            )
            .await;
        assert_eq!(
            (status, problem["code"].as_str(), problem["field"].as_str()),
            (409, Some("action_conflict"), Some("tool_outputs")),
            "{problem}"
        );
        let detail = problem["detail"].as_str().unwrap();
        let sequence = &frames
            .iter()
            .find(|f| f.event == "tool_calls_required")
            .unwrap()
            .id;
        assert!(
            detail.contains(&format!("pause at event {sequence} "))
                && detail.contains("already answered")
                && detail.contains("`call_wx`")
                && detail.contains("error \"weather service down\""),
            "{detail}"
        );
        // A retry that leaves a call out is refused, naming the call it leaves out.
        let (status, problem) = server
            .post(
                &path,
                &json!({"tool_outputs": [{"call_id": "call_loc", "output": {"city": "Paris"}}]}),
            )
            .await;
        assert_eq!(
            (status, problem["code"].as_str()),
            (409, Some("action_conflict")),
            "{problem}"
        );
        let detail = problem["detail"].as_str().unwrap();
        assert!(
            detail.contains("`call_wx`") && detail.contains("this request leaves it out"),
            "{detail}"
        );
        assert_eq!(
            server.get_json(&format!("/runs/{run_id}")).await,
            run,
            "nothing changed"
        );
        assert_eq!(requests_to(&fake, wire).len(), 2, "nothing was sent");
        server.stop().await;
    }
}

async fn cancel_while_waiting(backend: Backend) {
    for wire in BOTH {
        let fake = FakeOpenAi::start().await;
        let Some(server) = TestServer::start(backend, config(&fake.base_url(), "")).await else {
            return;
        };
        fake.push(parallel_calls(wire));
        let run_id = start(
            &server,
            json!({"provider": wire.provider(), "model": "fake-model", "input": "weather?",
                   "tools": client_tools()}),
        )
        .await;
        let session = waiting(&server, &run_id).await["session_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let response = server
            .client
            .post(server.url(&format!("/runs/{run_id}/cancel?wait=true")))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let run: Value = response.json().await.unwrap();
        assert_eq!(run["status"], "cancelled");
        assert!(run.get("required_action").is_none());
        let frames = server.events(&run_id, None).await;
        assert_eq!(frames.last().unwrap().event, "run_cancelled");
        let messages = server
            .get_json(&format!("/sessions/{session}/messages"))
            .await;
        let tool_texts: Vec<String> = messages["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] == "tool")
            .map(|m| m["content"][0]["text"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(tool_texts.len(), 3, "every call has a result");
        assert!(
            tool_texts.iter().all(|t| t.starts_with("error: cancelled")),
            "{tool_texts:?}"
        );
        assert_late(&server, &run_id, "cancelled").await;
        // The session goes on.
        fake.push(wire.text("Still here."));
        let next = start(
            &server,
            json!({"session_id": session, "provider": wire.provider(), "model": "fake-model",
                   "input": "still there?"}),
        )
        .await;
        assert_eq!(server.finished_run(&next).await["status"], "completed");
        wire.assert_valid(&fake.requests());
        server.stop().await;
    }
}

/// A cancel of a waiting run answers once the run has ended (nothing runs in a waiting run), so
/// the session's very next input is accepted, and an answer sent after the cancel is refused
/// with `run_not_waiting`.
async fn a_cancelled_wait_frees_the_session_at_once(backend: Backend) {
    let wire = BOTH[0];
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config(&fake.base_url(), "")).await else {
        return;
    };
    let mut session: Option<String> = None;
    for attempt in 0..5 {
        fake.push(wire.tool_calls(&[("call_loc", "get_location", json!({}))]));
        let mut body = json!({"provider": wire.provider(), "model": "fake-model",
                              "input": "where am I?", "tools": client_tools()});
        if let Some(session) = &session {
            body["session_id"] = json!(session);
        }
        let run_id = start(&server, body).await;
        let run = waiting(&server, &run_id).await;
        session = Some(run["session_id"].as_str().unwrap().to_owned());
        let cancel = server
            .client
            .post(server.url(&format!("/runs/{run_id}/cancel")))
            .send()
            .await
            .unwrap();
        assert_eq!(cancel.status(), 202, "attempt {attempt}");
        let cancelled: Value = cancel.json().await.unwrap();
        assert_eq!(
            cancelled["status"], "cancelled",
            "attempt {attempt}: {cancelled}"
        );
        let (status, late) = server
            .post(
                &format!("/runs/{run_id}/tool_outputs"),
                &json!({"tool_outputs": [{"call_id": "call_loc", "output": "Lyon"}]}),
            )
            .await;
        assert_eq!(
            (status, late["code"].as_str()),
            (409, Some("run_not_waiting")),
            "{late}"
        );
        fake.push(wire.text("Still here."));
        let (status, next) = server
            .post(
                "/runs",
                &json!({"session_id": session, "provider": wire.provider(), "model": "fake-model",
                   "input": "still there?"}),
            )
            .await;
        assert_eq!(
            status, 202,
            "attempt {attempt}: the next input at once: {next}"
        );
        let next = next["run_id"].as_str().unwrap();
        assert_eq!(server.finished_run(next).await["status"], "completed");
    }
    wire.assert_valid(&fake.requests());
    server.stop().await;
}

/// An answer and a cancel sent at the same moment: whichever wins, the call has exactly one
/// result in the session (the answer's or the cancel's), and the session's next request is
/// valid. Raced many times, since the window is a few milliseconds.
async fn an_answer_racing_a_cancel_leaves_one_result(backend: Backend) {
    let wire = BOTH[0];
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config(&fake.base_url(), "")).await else {
        return;
    };
    for attempt in 0..30 {
        fake.push(wire.tool_calls(&[("call_loc", "get_location", json!({}))]));
        let run_id = start(
            &server,
            json!({"provider": wire.provider(), "model": "fake-model", "input": "where am I?",
                   "tools": client_tools()}),
        )
        .await;
        let session = waiting(&server, &run_id).await["session_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let (path, body) = (
            format!("/runs/{run_id}/tool_outputs"),
            json!({"tool_outputs": [{"call_id": "call_loc", "output": "Lyon"}]}),
        );
        let answer = server.post(&path, &body);
        // The cancel 0 to 4 ms after the answer: the window where both land.
        let cancel = async {
            tokio::time::sleep(Duration::from_millis(attempt % 5)).await;
            server
                .client
                .post(server.url(&format!("/runs/{run_id}/cancel?wait=true")))
                .send()
                .await
        };
        let (_, cancelled) = tokio::join!(answer, cancel);
        let cancelled = cancelled.unwrap().status();
        let run = server.finished_run(&run_id).await;
        // An accepted cancel ends the run cancelled; one the run's end beat (the answer let it
        // complete first) is refused, 409 `run_finished`, and the completion stands.
        match cancelled.as_u16() {
            200 => assert_eq!(run["status"], "cancelled", "attempt {attempt}"),
            409 => assert_eq!(run["status"], "completed", "attempt {attempt}"),
            other => panic!("attempt {attempt}: the cancel answered {other}"),
        }
        let frames = server.events(&run_id, None).await;
        let committed = kinds(&frames)
            .iter()
            .filter(|kind| **kind == "tool_message_committed")
            .count();
        let messages = server
            .get_json(&format!("/sessions/{session}/messages"))
            .await;
        let results: Vec<&Value> = messages["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] == "tool")
            .collect();
        assert_eq!(
            (results.len(), committed),
            (1, 1),
            "attempt {attempt}, run {}: one result for the call: {results:?}",
            run["status"]
        );
        if run["status"] == "completed" {
            continue;
        }
        fake.push(wire.text("Still here."));
        let next = start(
            &server,
            json!({"session_id": session, "provider": wire.provider(), "model": "fake-model",
                   "input": "still there?"}),
        )
        .await;
        assert_eq!(server.finished_run(&next).await["status"], "completed");
    }
    wire.assert_valid(&fake.requests());
    server.stop().await;
}

/// A model that uses a call id again in a later turn (after a compaction dropped the earlier
/// turn from its context, or a server that numbers its calls) gets that turn's call answered
/// by the client again: an earlier turn's answer is never reused.
async fn a_call_id_used_again_waits_for_its_own_answer(backend: Backend) {
    for wire in BOTH {
        let fake = FakeOpenAi::start().await;
        let Some(server) = TestServer::start(backend, config(&fake.base_url(), "")).await else {
            return;
        };
        fake.push(wire.tool_calls(&[("call_1", "get_location", json!({}))]));
        fake.push(wire.tool_calls(&[("call_1", "get_location", json!({}))]));
        fake.push(wire.text("You moved from Paris to Lyon."));
        let run_id = start(
            &server,
            json!({"provider": wire.provider(), "model": "fake-model", "input": "where am I?",
                   "tools": client_tools()}),
        )
        .await;
        for city in ["Paris", "Lyon"] {
            let run = waiting(&server, &run_id).await;
            // The id the model sent again may be made unique in the session's history
            // (`call_1_2`): the client answers the id the run reports.
            let call_id = run["required_action"]["tool_calls"][0]["call_id"].clone();
            assert!(
                call_id.as_str().is_some_and(|id| id.starts_with("call_1")),
                "{run}"
            );
            let turn = run["required_action"]["message_id"].clone();
            let (status, answer) = server
                .post(
                    &format!("/runs/{run_id}/tool_outputs"),
                    &json!({"tool_outputs": [{"call_id": call_id, "output": {"city": city}}]}),
                )
                .await;
            assert_eq!(status, 202, "{answer}");
            // The run moves on before the next turn waits.
            wait_for(&server, &run_id, |run| {
                run["required_action"]["message_id"] != turn
            })
            .await;
        }
        let run = server.finished_run(&run_id).await;
        assert_eq!(run["status"], "completed", "{run}");
        let frames = server.events(&run_id, None).await;
        assert_eq!(
            kinds(&frames)
                .iter()
                .filter(|kind| **kind == "tool_calls_required")
                .count(),
            2,
            "each turn asks the client"
        );
        let outputs: Vec<String> = frames
            .iter()
            .filter(|frame| frame.event == "tool_execution_finished")
            .map(|frame| frame.json()["result"].to_string())
            .collect();
        assert_eq!(outputs.len(), 2);
        assert!(
            outputs[0].contains("Paris") && outputs[1].contains("Lyon"),
            "{outputs:?}"
        );
        wire.assert_valid(&fake.requests());
        server.stop().await;
    }
}

async fn an_expired_wait_ends_the_run(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    for (runtime, ending) in [
        ("[runtime]\naction_timeout_ms = 1000\n", "run_failed"),
        ("[runtime]\naction_expiry = \"cancel\"\n", "run_cancelled"),
    ] {
        let Some(server) = TestServer::start(backend, config(&fake.base_url(), runtime)).await
        else {
            return;
        };
        fake.push(parallel_calls(Wire::OpenAi));
        // The second server's runs wait 1 s by their own `action_timeout_ms`.
        let run_id = start(
            &server,
            json!({"provider": "fake", "model": "fake-model", "input": "weather?",
                   "tools": client_tools(), "action_timeout_ms": 1000}),
        )
        .await;
        let started = Instant::now();
        let run = server.finished_run(&run_id).await;
        assert!(started.elapsed() >= Duration::from_millis(900));
        let frames = server.events(&run_id, None).await;
        let last = frames.last().unwrap();
        assert_eq!(last.event, ending, "{:?}", kinds(&frames));
        if ending == "run_failed" {
            assert_eq!(last.json()["error_class"], "action_expired");
            assert!(
                run["error"].as_str().unwrap().contains("call_loc, call_wx"),
                "{run}"
            );
        }
        let session = run["session_id"].as_str().unwrap();
        let messages = server
            .get_json(&format!("/sessions/{session}/messages"))
            .await;
        let expired = messages["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| {
                m["role"] == "tool"
                    && m["content"][0]["text"]
                        .as_str()
                        .unwrap()
                        .starts_with("error: expired")
            })
            .count();
        assert_eq!(expired, 3, "every call of the turn is answered");
        let ended = if ending == "run_failed" {
            "failed"
        } else {
            "cancelled"
        };
        assert_late(&server, &run_id, ended).await;
        server.stop().await;
    }
}

// ---------------------------------------------------------------------------------------------
// Approvals

/// An HTTP tool server: `POST /{tool}` records the call and answers `{"tool", "arguments"}`.
async fn tool_server() -> (String, Arc<Mutex<Vec<(String, Value)>>>) {
    let calls = Arc::new(Mutex::new(Vec::new()));
    let recorded = calls.clone();
    let app = axum::Router::new().route(
        "/{tool}",
        axum::routing::post(
            move |axum::extract::Path(tool): axum::extract::Path<String>,
                  Json(arguments): Json<Value>| {
                let recorded = recorded.clone();
                async move {
                    recorded
                        .lock()
                        .unwrap()
                        .push((tool.clone(), arguments.clone()));
                    Json(json!({"tool": tool, "arguments": arguments}))
                }
            },
        ),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), calls)
}

async fn approvals_granted_and_rejected(backend: Backend) {
    let (tools_url, executed) = tool_server().await;
    let extra = format!(
        "[http_tools.lookup]\ndescription = \"Looks a key up.\"\nurl = \"{tools_url}/lookup\"\n\
         parameters = {{ type = \"object\", properties = {{ key = {{ type = \"string\" }} }}, required = [\"key\"] }}\n\
         requires_approval = true\n\
         [http_tools.echo]\ndescription = \"Echoes.\"\nurl = \"{tools_url}/echo\"\n"
    );
    for wire in BOTH {
        let fake = FakeOpenAi::start().await;
        let Some(server) = TestServer::start(backend, config(&fake.base_url(), &extra)).await
        else {
            return;
        };
        let tools = server.get_json("/tools").await;
        let flags: Vec<(&str, bool)> = tools["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["name"].as_str().unwrap(),
                    t["requires_approval"].as_bool().unwrap(),
                )
            })
            .collect();
        assert_eq!(flags, [("echo", false), ("lookup", true)]);
        executed.lock().unwrap().clear();

        // Granted: the configured tool waits, then runs (with the call that needed no approval).
        fake.push(wire.tool_calls(&[
            ("call_l", "lookup", json!({"key": "k1"})),
            ("call_e", "echo", json!({"say": "hi"})),
        ]));
        fake.push(wire.text("Found it."));
        let run_id = start(
            &server,
            json!({"provider": wire.provider(), "model": "fake-model", "input": "look k1 up"}),
        )
        .await;
        let run = waiting(&server, &run_id).await;
        assert_eq!(
            run["required_action"]["tool_calls"],
            json!([{"call_id": "call_l", "tool_name": "lookup", "arguments": {"key": "k1"},
                    "kind": "approval"}])
        );
        assert!(
            executed.lock().unwrap().is_empty(),
            "nothing runs before the approval"
        );
        let (status, problem) = server
            .post(
                &format!("/runs/{run_id}/tool_outputs"),
                &json!({"tool_outputs": [{"call_id": "call_l", "output": 1}]}),
            )
            .await;
        assert_eq!(
            (status, problem["code"].as_str()),
            (409, Some("run_not_waiting"))
        );
        let (status, body) = server
            .post(
                &format!("/runs/{run_id}/approvals"),
                &json!({"approvals": [{"call_id": "call_l", "approve": true}]}),
            )
            .await;
        assert_eq!(status, 202, "{body}");
        let run = server.finished_run(&run_id).await;
        assert_eq!(run["status"], "completed", "{run}");
        let names: Vec<String> = executed
            .lock()
            .unwrap()
            .iter()
            .map(|(tool, _)| tool.clone())
            .collect();
        assert_eq!(names.len(), 2);
        assert!(names.contains(&"lookup".to_owned()) && names.contains(&"echo".to_owned()));
        let frames = server.events(&run_id, None).await;
        let started = frames
            .iter()
            .filter(|f| f.event == "tool_execution_started")
            .count();
        assert_eq!(started, 2, "approved calls execute as usual");
        let session = run["session_id"].as_str().unwrap().to_owned();
        let requests = requests_to(&fake, wire);
        let results = wire.tool_results(&requests[1].body);
        assert!(results[0].1.contains("\"tool\":\"lookup\""), "{results:?}");

        // Rejected: a tool the run's `approval` names; the model is told why.
        fake.push(wire.tool_calls(&[("call_e2", "echo", json!({"say": "bye"}))]));
        fake.push(wire.text("Understood."));
        let run_id = start(
            &server,
            json!({"session_id": session, "provider": wire.provider(), "model": "fake-model",
                   "input": "echo bye", "approval": ["echo"]}),
        )
        .await;
        let run = waiting(&server, &run_id).await;
        assert_eq!(run["approval"], json!(["echo"]));
        assert_eq!(run["required_action"]["tool_calls"][0]["kind"], "approval");
        let (status, problem) = server
            .post(
                &format!("/runs/{run_id}/approvals"),
                &json!({"approvals": []}),
            )
            .await;
        assert_eq!(
            (status, problem["code"].as_str(), problem["field"].as_str()),
            (422, Some("missing_tool_calls"), Some("approvals"))
        );
        let (status, _) = server.post(&format!("/runs/{run_id}/approvals"),
            &json!({"approvals": [{"call_id": "call_e2", "approve": false, "reason": "not now"}]}),
        )
        .await;
        assert_eq!(status, 202);
        let run = server.finished_run(&run_id).await;
        assert_eq!(run["status"], "completed");
        assert_eq!(
            executed.lock().unwrap().len(),
            2,
            "the rejected call never ran"
        );
        let frames = server.events(&run_id, None).await;
        let finished = frames
            .iter()
            .find(|f| f.event == "tool_execution_finished")
            .unwrap()
            .json();
        assert_eq!(
            finished["result"],
            json!({"Failure": {"error": "rejected by the user: not now"}})
        );
        // A retry of the decision is accepted again; another decision is refused.
        let (status, again) = server.post(&format!("/runs/{run_id}/approvals"),
            &json!({"approvals": [{"call_id": "call_e2", "approve": false, "reason": "not now"}]}),
        )
        .await;
        assert_eq!(
            (status, again["status"].as_str()),
            (202, Some("completed")),
            "{again}"
        );
        let (status, problem) = server
            .post(
                &format!("/runs/{run_id}/approvals"),
                &json!({"approvals": [{"call_id": "call_e2", "approve": true}]}),
            )
            .await;
        assert_eq!(
            (status, problem["code"].as_str()),
            (409, Some("action_conflict")),
            "{problem}"
        );
        assert!(
            problem["detail"]
                .as_str()
                .unwrap()
                .contains("`call_e2` was answered with approve: false"),
            "{problem}"
        );
        let requests = requests_to(&fake, wire);
        let results = wire.tool_results(&requests.last().unwrap().body);
        assert_eq!(
            results.last().unwrap(),
            &(
                "call_e2".to_owned(),
                "error: rejected by the user: not now".to_owned()
            )
        );
        wire.assert_valid(&requests);
        server.stop().await;
    }
}

// ---------------------------------------------------------------------------------------------
// Sessions

async fn sessions_are_resources(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config(&fake.base_url(), "")).await else {
        return;
    };
    let (status, session) = server
        .post(
            "/sessions",
            &json!({"title": "Support chat", "metadata": {"customer": "c-42"},
                "defaults": {"provider": "fake", "model": "fake-model",
                             "instructions": "Answer in French.",
                             "parameters": {"temperature": 0.2}}}),
        )
        .await;
    assert_eq!(status, 201, "{session}");
    let id = session["id"].as_str().unwrap().to_owned();
    assert_eq!(session["title"], "Support chat");
    assert_eq!(session["metadata"], json!({"customer": "c-42"}));
    // Its runs take its defaults.
    for n in 0..3 {
        fake.push(Wire::OpenAi.text(&format!("réponse {n}")));
        let run_id = start(
            &server,
            json!({"session_id": id, "input": format!("question {n}")}),
        )
        .await;
        let run = server.finished_run(&run_id).await;
        assert_eq!(
            (run["provider"].as_str(), run["instructions"].as_str()),
            (Some("fake"), Some("Answer in French."))
        );
        assert_eq!(run["parameters"]["temperature"], 0.2);
    }
    let sent = &fake.requests()[0].body;
    assert_eq!(sent["messages"][0]["content"], "Answer in French.");
    assert_eq!(sent["temperature"], 0.2);

    // PATCH: title and metadata; null removes the title.
    let patch = |body: Value| {
        let server = &server;
        let id = id.clone();
        async move {
            let response = server
                .client
                .patch(server.url(&format!("/sessions/{id}")))
                .json(&body)
                .send()
                .await
                .unwrap();
            (
                response.status().as_u16(),
                response.json::<Value>().await.unwrap(),
            )
        }
    };
    let (status, changed) =
        patch(json!({"title": "Billing", "metadata": {"customer": "c-43"}})).await;
    assert_eq!(status, 200, "{changed}");
    assert_eq!(
        (changed["title"].as_str(), &changed["metadata"]),
        (Some("Billing"), &json!({"customer": "c-43"}))
    );
    assert_eq!(changed["defaults"]["instructions"], "Answer in French.");
    let (_, changed) = patch(json!({"title": null})).await;
    assert!(changed.get("title").is_none(), "{changed}");
    assert_eq!(changed["metadata"], json!({"customer": "c-43"}));
    let (status, problem) = patch(json!({"metadata": [1]})).await;
    assert_eq!((status, problem["field"].as_str()), (422, Some("metadata")));
    let (status, problem) = patch(json!({"defaults": {}})).await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (422, Some("invalid_body"))
    );
    let missing = server
        .client
        .patch(server.url(&format!("/sessions/{}", uuid::Uuid::now_v7())))
        .json(&json!({"title": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);

    // Messages, page by page: `limit`, then the cursor.
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let uri = match &cursor {
            Some(c) => format!("/sessions/{id}/messages?limit=2&cursor={c}"),
            None => format!("/sessions/{id}/messages?limit=2"),
        };
        let page = server.get_json(&uri).await;
        let messages = page["messages"].as_array().unwrap();
        assert!(messages.len() <= 2);
        seen.extend(
            messages
                .iter()
                .map(|m| m["content"][0]["text"].as_str().unwrap().to_owned()),
        );
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(
        seen,
        [
            "question 0",
            "réponse 0",
            "question 1",
            "réponse 1",
            "question 2",
            "réponse 2"
        ]
    );
    // A cursor of another session's message is not this session's.
    fake.push(Wire::OpenAi.text("hi"));
    let other = start(
        &server,
        json!({"provider": "fake", "model": "fake-model", "input": "x"}),
    )
    .await;
    let other = server.finished_run(&other).await;
    let other_session = other["session_id"].as_str().unwrap();
    let foreign = server
        .get_json(&format!("/sessions/{other_session}/messages"))
        .await["messages"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let response = server
        .client
        .get(server.url(&format!("/sessions/{id}/messages?cursor={foreign}")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    // A session made by its first run remembers its provider, model and instructions.
    fake.push(Wire::OpenAi.text("one"));
    fake.push(Wire::OpenAi.text("two"));
    let first = start(
        &server,
        json!({"provider": "fake", "model": "fake-model", "input": "hi", "instructions": "Be kind."}),
    )
    .await;
    let session = server.finished_run(&first).await["session_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let second = start(&server, json!({"session_id": session, "input": "and?"})).await;
    assert_eq!(
        server.finished_run(&second).await["instructions"],
        "Be kind."
    );
    assert_eq!(
        server.get_json(&format!("/sessions/{session}")).await["defaults"],
        json!({"provider": "fake", "model": "fake-model", "instructions": "Be kind."})
    );
    server.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Validation

async fn every_field_is_validated(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let (tools_url, _) = tool_server().await;
    let extra = format!(
        "[http_tools.lookup]\ndescription = \"Looks a key up.\"\nurl = \"{tools_url}/lookup\"\n"
    );
    let Some(server) = TestServer::start(backend, config(&fake.base_url(), &extra)).await else {
        return;
    };
    let base = |provider: &str, field: &str, value: Value| {
        let mut body = json!({"provider": provider, "model": "fake-model", "input": "hi"});
        body[field] = value;
        body
    };
    let def = |name: &str, parameters: Value| json!({"name": name, "parameters": parameters});
    let object = json!({"type": "object"});
    fake.respond_with(|request| {
        Some(if request.path == Wire::Anthropic.path() {
            Wire::Anthropic.text("ok")
        } else {
            Wire::OpenAi.text("ok")
        })
    });
    for (provider, field, value, code) in [
        ("fake", "agent", json!("nobody"), "unknown_agent"),
        ("fake", "agent", json!(""), "invalid_field"),
        ("fake", "agent", json!(3), "invalid_body"),
        ("fake", "instructions", json!("a\u{0}b"), "invalid_field"),
        ("fake", "instructions", json!(["a"]), "invalid_body"),
        ("fake", "temperature", json!(2.5), "invalid_field"),
        ("fake", "temperature", json!("hot"), "invalid_body"),
        ("claude", "temperature", json!(1.5), "invalid_field"),
        ("fake", "top_p", json!(1.01), "invalid_field"),
        ("fake", "top_p", json!(null), "ok"),
        ("fake", "max_output_tokens", json!(0), "invalid_field"),
        ("fake", "max_output_tokens", json!(1025), "invalid_field"),
        ("fake", "max_output_tokens", json!(1024), "ok"),
        ("fake", "max_output_tokens", json!(-1), "invalid_body"),
        (
            "fake",
            "stop",
            json!(["a", "b", "c", "d", "e"]),
            "invalid_field",
        ),
        ("fake", "stop", json!([""]), "invalid_field"),
        ("fake", "stop", json!(["\n"]), "ok"),
        ("claude", "stop", json!(["\n"]), "invalid_field"),
        ("fake", "stop", json!("END"), "invalid_body"),
        ("claude", "seed", json!(1), "invalid_field"),
        ("fake", "seed", json!(1.5), "invalid_body"),
        ("fake", "parallel_tool_calls", json!("yes"), "invalid_body"),
        ("fake", "provider_options", json!([]), "invalid_field"),
        (
            "fake",
            "provider_options",
            json!({"messages": []}),
            "invalid_field",
        ),
        (
            "fake",
            "provider_options",
            json!({"k\u{0}": 1}),
            "invalid_field",
        ),
        (
            "fake",
            "tools",
            json!([def("a b", object.clone())]),
            "invalid_field",
        ),
        (
            "fake",
            "tools",
            json!([def("x", json!({"type": "string"}))]),
            "invalid_field",
        ),
        (
            "fake",
            "tools",
            json!([def("x", json!({"type": "object", "properties": 5}))]),
            "invalid_field",
        ),
        (
            "fake",
            "tools",
            json!([def("lookup", object.clone())]),
            "invalid_field",
        ),
        (
            "fake",
            "tools",
            json!([def("x", object.clone()), def("x", object.clone())]),
            "invalid_field",
        ),
        (
            "fake",
            "tools",
            json!([{"name": "x", "extra": 1}]),
            "invalid_body",
        ),
        ("fake", "tools", json!(["nope"]), "unknown_tool"),
        (
            "fake",
            "tools",
            json!(["lookup", def("x", object.clone())]),
            "ok",
        ),
        ("fake", "approval", json!(["nope"]), "invalid_field"),
        ("fake", "approval", json!("lookup"), "invalid_body"),
        ("fake", "action_timeout_ms", json!(999), "invalid_field"),
        (
            "fake",
            "action_timeout_ms",
            json!(604_800_001_u64),
            "invalid_field",
        ),
        ("fake", "action_timeout_ms", json!("1s"), "invalid_body"),
    ] {
        let body = base(provider, field, value.clone());
        let (status, problem) = server.post("/runs", &body).await;
        if code == "ok" {
            assert_eq!(status, 202, "{field} = {value}: {problem}");
            continue;
        }
        assert_eq!(
            (status, problem["code"].as_str(), problem["field"].as_str()),
            (422, Some(code), Some(field)),
            "{provider} {field} = {value}: {problem}"
        );
    }
    // A tool_choice may name a defined tool; an approval, only a server tool of the run.
    let mut body = base("fake", "tools", json!(["lookup", def("x", object.clone())]));
    body["tool_choice"] = json!({"name": "x"});
    assert_eq!(server.post("/runs", &body).await.0, 202);
    body["approval"] = json!(["x"]);
    let (status, problem) = server.post("/runs", &body).await;
    assert_eq!((status, problem["field"].as_str()), (422, Some("approval")));
    // Without a provider (nor an agent or session that gives one).
    let (status, problem) = server
        .post("/runs", &json!({"model": "fake-model", "input": "hi"}))
        .await;
    assert_eq!(
        (status, problem["code"].as_str(), problem["field"].as_str()),
        (422, Some("missing_field"), Some("provider"))
    );
    // Session bodies.
    for (body, code, field) in [
        (json!({"title": "t".repeat(1001)}), "invalid_field", "title"),
        (json!({"metadata": "x"}), "invalid_field", "metadata"),
        (
            json!({"defaults": {"agent": "nobody"}}),
            "unknown_agent",
            "defaults.agent",
        ),
        (
            json!({"defaults": {"provider": "nope"}}),
            "unknown_provider",
            "defaults.provider",
        ),
        (
            json!({"defaults": {"provider": "fake", "model": "nope"}}),
            "unknown_model",
            "defaults.model",
        ),
        (
            json!({"defaults": {"parameters": {"temperature": 9}}}),
            "invalid_field",
            "defaults",
        ),
        (
            json!({"defaults": {"colour": "red"}}),
            "invalid_body",
            "defaults",
        ),
        (json!({"name": "x"}), "invalid_body", "name"),
    ] {
        let (status, problem) = server.post("/sessions", &body).await;
        assert_eq!(
            (status, problem["code"].as_str(), problem["field"].as_str()),
            (422, Some(code), Some(field)),
            "{body}: {problem}"
        );
    }
    server.stop().await;
}

on_both_backends!(
    instructions_and_parameters_reach_both_wire_formats,
    a_preset_plus_overrides,
    client_tool_round_trip,
    cancel_while_waiting,
    a_cancelled_wait_frees_the_session_at_once,
    an_answer_racing_a_cancel_leaves_one_result,
    a_call_id_used_again_waits_for_its_own_answer,
    an_expired_wait_ends_the_run,
    approvals_granted_and_rejected,
    sessions_are_resources,
    every_field_is_validated,
);
