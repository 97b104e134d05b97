//! Structured output (issue #26, item 1): a run's `output_schema` reaches each wire format in its
//! own form (OpenAI-compatible `response_format` `json_schema`, Anthropic
//! `output_config.format`; in words in the instructions with `structured_output = "prompt"`),
//! the final answer is validated, an invalid one gets a corrective turn (`output_rejected`,
//! a stored user message), a second invalid one fails the run with `output_invalid`, and the
//! parsed value is on `run_completed` and the run's output. The built-in model answers with a
//! minimal valid instance. Every request the fake receives passes the provider's own
//! validation rules — also the session's next one after a correction or a failure — and every
//! event validates against the OpenAPI document.

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

/// Provider `fake` of this wire format (its table gets `extra`), the built-in model as `demo`,
/// and a preset `extractor` on the demo model with an output schema.
fn config(wire: Wire, base_url: &str, extra: &str) -> Config {
    let kind = match wire {
        Wire::OpenAi => "openai",
        Wire::Anthropic => "anthropic",
    };
    let toml = format!(
        "[providers.fake]\nkind = \"{kind}\"\nbase_url = \"{base_url}\"\n{extra}\n\
         [providers.fake.retry]\nmax_attempts = 1\n\
         [providers.fake.models.fake-model]\ncontext_window = 128000\nmax_output_tokens = 1024\n\
         [providers.demo]\nkind = \"scripted\"\ntoken_delay_ms = 1\n\
         [providers.demo.models.demo]\ncontext_window = 32768\nmax_output_tokens = 4096\n\
         [agents.extractor]\nprovider = \"demo\"\nmodel = \"demo\"\n\
         output_schema = {{ type = \"object\", properties = {{ city = {{ type = \"string\", minLength = 1 }}, \
         days = {{ type = \"integer\", minimum = 1 }} }}, required = [\"city\", \"days\"] }}\n"
    );
    Config::from_toml(&toml).unwrap()
}

/// A schema that qualifies for OpenAI's strict mode.
fn weather_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "temperature_c": {"type": "number"},
            "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rain"]},
        },
        "required": ["city", "temperature_c", "conditions"],
        "additionalProperties": false,
    })
}

fn answer(wire: Wire, text: &str) -> Reply {
    Reply::sse(&match wire {
        Wire::OpenAi => fake_openai::text_stream(&[text]),
        Wire::Anthropic => fake_anthropic::text_stream(&[text]),
    })
}

/// Creates a run from `body`, waits for its end; its record and its events (each valid
/// against the OpenAPI document).
async fn run(server: &TestServer, body: Value) -> (Value, Vec<Frame>) {
    let (status, created) = server.post("/runs", &body).await;
    assert_eq!(status, 202, "{body}: {created}");
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    let record = server.finished_run(&run_id).await;
    let frames = server.events(&run_id, None).await;
    let schema = EventSchema::new();
    for frame in &frames {
        schema.check(&frame.json());
    }
    (record, frames)
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

/// The text of a wire message's content (a string, or the text blocks/parts joined).
fn content_text(message: &Value) -> String {
    match &message["content"] {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| part["text"].as_str())
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// The schema as the wire format carries it in `body`.
fn sent_schema(wire: Wire, body: &Value) -> Value {
    match wire {
        Wire::OpenAi => {
            let format = &body["response_format"];
            assert_eq!(format["type"], "json_schema", "{body}");
            assert_eq!(format["json_schema"]["name"], "output", "{body}");
            format["json_schema"]["schema"].clone()
        }
        Wire::Anthropic => {
            let format = &body["output_config"]["format"];
            assert_eq!(format["type"], "json_schema", "{body}");
            format["schema"].clone()
        }
    }
}

// ---------------------------------------------------------------------------------------------

async fn valid_answer_is_parsed(backend: Backend, wire: Wire) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config(wire, &fake.base_url(), "")).await else {
        return;
    };
    let value = json!({"city": "Oslo", "temperature_c": -3.5, "conditions": "cloudy"});
    // Streamed in pieces: the text still streams as text_delta.
    let text = value.to_string();
    let (head, tail) = text.split_at(10);
    fake.push(Reply::sse(&match wire {
        Wire::OpenAi => fake_openai::text_stream(&[head, tail]),
        Wire::Anthropic => fake_anthropic::text_stream(&[head, tail]),
    }));
    let (record, frames) = run(
        &server,
        json!({"provider": "fake", "model": "fake-model", "input": "Weather in Oslo?",
               "output_schema": weather_schema()}),
    )
    .await;
    assert_eq!(record["status"], "completed", "{:?}", kinds(&frames));
    assert_eq!(record["output_schema"], weather_schema());
    let deltas: Vec<Value> = of_kind(&frames, "text_delta");
    assert_eq!(deltas.len(), 2);
    let completed = of_kind(&frames, "run_completed");
    assert_eq!(completed[0]["parsed"], value, "{completed:?}");
    let run_id = record["id"].as_str().unwrap();
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(output["parsed"], value, "{output}");

    let requests = fake.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(sent_schema(wire, &requests[0].body), weather_schema());
    if wire == Wire::OpenAi {
        // Closed objects with every property required: strict mode.
        assert_eq!(
            requests[0].body["response_format"]["json_schema"]["strict"],
            true
        );
    }
    assert_valid(wire, &requests);

    // An open schema (optional property, extra properties allowed) is not strict; a run
    // without a schema sends none and has no `parsed`.
    fake.push(answer(wire, r#"{"city": "Rome"}"#));
    let open = json!({"type": "object", "properties": {"city": {"type": "string"},
                      "note": {"type": "string"}}, "required": ["city"]});
    let (record, _) = run(
        &server,
        json!({"provider": "fake", "model": "fake-model", "input": "Just the city",
               "output_schema": open}),
    )
    .await;
    assert_eq!(record["status"], "completed");
    fake.push(answer(wire, "plain text"));
    let (plain, frames) = run(
        &server,
        json!({"provider": "fake", "model": "fake-model", "input": "hi"}),
    )
    .await;
    assert_eq!(plain["status"], "completed");
    assert!(of_kind(&frames, "run_completed")[0].get("parsed").is_none());
    let plain_id = plain["id"].as_str().unwrap();
    let output = server.get_json(&format!("/runs/{plain_id}/output")).await;
    assert!(output.get("parsed").is_none(), "{output}");
    let requests = fake.requests();
    if wire == Wire::OpenAi {
        assert_eq!(
            requests[1].body["response_format"]["json_schema"]["strict"],
            false
        );
        assert!(requests[2].body.get("response_format").is_none());
    } else {
        assert!(requests[2].body.get("output_config").is_none());
    }
    server.stop().await;
}

async fn invalid_answer_is_corrected(backend: Backend, wire: Wire) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config(wire, &fake.base_url(), "")).await else {
        return;
    };
    fake.push(answer(wire, r#"{"city": "Oslo", "temperature_c": "cold"}"#));
    let good = json!({"city": "Oslo", "temperature_c": -3, "conditions": "sunny"});
    fake.push(answer(wire, &format!("```json\n{good}\n```")));
    let (record, frames) = run(
        &server,
        json!({"provider": "fake", "model": "fake-model", "input": "Weather in Oslo?",
               "output_schema": weather_schema()}),
    )
    .await;
    assert_eq!(record["status"], "completed", "{:?}", kinds(&frames));
    assert_eq!(record["iterations"], 2);
    let rejected = of_kind(&frames, "output_rejected");
    assert_eq!(rejected.len(), 1, "{:?}", kinds(&frames));
    assert_eq!(rejected[0]["attempt"], 1);
    // A list of {instance_path, message}, the path a JSON Pointer.
    let errors = rejected[0]["errors"].as_array().unwrap();
    assert!(
        errors
            .iter()
            .any(|e| e["instance_path"] == "/temperature_c"),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e["instance_path"] == ""
                && e["message"].as_str().unwrap().contains("conditions")),
        "{errors:?}"
    );
    assert_eq!(of_kind(&frames, "run_completed")[0]["parsed"], good);
    let run_id = record["id"].as_str().unwrap();
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(output["parsed"], good, "{output}");
    assert_eq!(output["messages"].as_array().unwrap().len(), 2);

    // The correction is a stored user message, announced by the event.
    let session = record["session_id"].as_str().unwrap();
    let stored = server
        .get_json(&format!("/sessions/{session}/messages"))
        .await["messages"]
        .as_array()
        .unwrap()
        .clone();
    let roles: Vec<&str> = stored.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "assistant", "user", "assistant"]);
    assert_eq!(stored[2]["id"], rejected[0]["message_id"]);

    // The second request carries the rejected answer and the errors; the session's next
    // request (a run without a schema) is valid too.
    fake.push(answer(wire, "Anything else?"));
    let (next, _) = run(
        &server,
        json!({"provider": "fake", "model": "fake-model", "input": "thanks",
               "session_id": session}),
    )
    .await;
    assert_eq!(next["status"], "completed");
    let requests = fake.requests();
    assert_eq!(requests.len(), 3);
    let second = requests[1].body["messages"].as_array().unwrap();
    let correction = second.last().unwrap();
    assert_eq!(correction["role"], "user", "{correction}");
    assert!(
        content_text(correction).contains("/temperature_c"),
        "{correction}"
    );
    assert!(content_text(&second[second.len() - 2]).contains("cold"));
    assert_valid(wire, &requests);
    server.stop().await;
}

async fn invalid_twice_fails(backend: Backend, wire: Wire) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config(wire, &fake.base_url(), "")).await else {
        return;
    };
    fake.push(answer(wire, "It is cold in Oslo."));
    fake.push(answer(wire, r#"{"city": "Oslo"}"#));
    let (record, frames) = run(
        &server,
        json!({"provider": "fake", "model": "fake-model", "input": "Weather in Oslo?",
               "output_schema": weather_schema()}),
    )
    .await;
    assert_eq!(record["status"], "failed", "{:?}", kinds(&frames));
    assert_eq!(record["error_class"], "output_invalid", "{record}");
    let failed = of_kind(&frames, "run_failed");
    assert_eq!(failed[0]["error_class"], "output_invalid");
    let error = failed[0]["error"].as_str().unwrap();
    assert!(error.contains("after 1 corrective turn"), "{error}");
    assert!(error.contains("temperature_c"), "{error}");
    let rejected = of_kind(&frames, "output_rejected");
    assert_eq!(rejected.len(), 1);
    let errors = rejected[0]["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0]["instance_path"], "");
    assert!(errors[0]["message"].as_str().unwrap().contains("not JSON"));
    let run_id = record["id"].as_str().unwrap();
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(output["error_class"], "output_invalid");
    assert!(output.get("parsed").is_none(), "{output}");

    // The session goes on: both answers and the correction are valid history.
    let session = record["session_id"].as_str().unwrap();
    fake.push(answer(wire, "Sorry about that."));
    let (next, _) = run(
        &server,
        json!({"provider": "fake", "model": "fake-model", "input": "try again later",
               "session_id": session}),
    )
    .await;
    assert_eq!(next["status"], "completed");
    let requests = fake.requests();
    assert_eq!(requests.len(), 3);
    assert_valid(wire, &requests);
    server.stop().await;
}

async fn openai_invalid_twice_fails(backend: Backend) {
    invalid_twice_fails(backend, Wire::OpenAi).await;
}

async fn anthropic_invalid_twice_fails(backend: Backend) {
    invalid_twice_fails(backend, Wire::Anthropic).await;
}

async fn openai_valid_answer(backend: Backend) {
    valid_answer_is_parsed(backend, Wire::OpenAi).await;
}

async fn anthropic_valid_answer(backend: Backend) {
    valid_answer_is_parsed(backend, Wire::Anthropic).await;
}

async fn openai_corrected(backend: Backend) {
    invalid_answer_is_corrected(backend, Wire::OpenAi).await;
}

async fn anthropic_corrected(backend: Backend) {
    invalid_answer_is_corrected(backend, Wire::Anthropic).await;
}

/// `structured_output = "prompt"`: no `response_format`; the schema is in the system message.
async fn prompt_mode_puts_the_schema_in_the_instructions(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let config = config(
        Wire::OpenAi,
        &fake.base_url(),
        "structured_output = \"prompt\"",
    );
    let Some(server) = TestServer::start(backend, config).await else {
        return;
    };
    let value = json!({"city": "Oslo", "temperature_c": 1, "conditions": "rain"});
    fake.push(answer(Wire::OpenAi, &value.to_string()));
    let (record, _) = run(
        &server,
        json!({"provider": "fake", "model": "fake-model", "input": "Weather in Oslo?",
               "instructions": "Be brief.", "output_schema": weather_schema()}),
    )
    .await;
    assert_eq!(record["status"], "completed");
    let run_id = record["id"].as_str().unwrap();
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(output["parsed"], value);
    let body = &fake.requests()[0].body;
    assert!(body.get("response_format").is_none(), "{body}");
    let system = &body["messages"][0];
    assert_eq!(system["role"], "system");
    let text = content_text(system);
    assert!(text.starts_with("Be brief."), "{text}");
    assert!(text.contains("\"temperature_c\""), "{text}");
    server.stop().await;
}

/// The built-in model answers with the schema's minimal instance: from a preset's schema, and
/// from a run's, which replaces it.
async fn demo_model_honours_the_schema(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config(Wire::OpenAi, &fake.base_url(), "")).await
    else {
        return;
    };
    let (record, frames) = run(
        &server,
        json!({"agent": "extractor", "input": "Trip: 3 days in Oslo"}),
    )
    .await;
    assert_eq!(record["status"], "completed", "{:?}", kinds(&frames));
    let parsed = &of_kind(&frames, "run_completed")[0]["parsed"];
    assert_eq!(parsed, &json!({"city": "x", "days": 1}));
    let text: String = of_kind(&frames, "text_delta")
        .iter()
        .map(|d| d["delta"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), *parsed);

    let (record, _) = run(
        &server,
        json!({"agent": "extractor", "input": "Weather?", "output_schema": weather_schema()}),
    )
    .await;
    let run_id = record["id"].as_str().unwrap();
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(
        output["parsed"],
        json!({"city": "", "temperature_c": 0, "conditions": "sunny"})
    );
    assert!(fake.requests().is_empty());
    server.stop().await;
}

/// A schema that cannot be used is refused at create, naming `output_schema`; nothing runs.
async fn unusable_schemas_are_refused(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config(Wire::OpenAi, &fake.base_url(), "")).await
    else {
        return;
    };
    let huge: serde_json::Map<String, Value> = (0..10_001)
        .map(|i| (format!("p{i}"), json!({"type": "string"})))
        .collect();
    let cases = [
        (json!("a string"), "output_schema", "JSON Schema object"),
        (json!({"allOf": [{"$ref": "#"}]}), "output_schema", "cycle"),
        (
            json!({"$ref": "#/$defs/missing"}),
            "output_schema",
            "does not resolve",
        ),
        (
            json!({"type": "object", "properties": huge}),
            "output_schema",
            "10000",
        ),
        (
            json!({"type": 12}),
            "output_schema",
            "not a valid JSON Schema",
        ),
    ];
    for (schema, field, words) in cases {
        let body = json!({"provider": "fake", "model": "fake-model", "input": "hi",
                          "output_schema": schema});
        let (status, problem) = server.post("/runs", &body).await;
        assert_eq!(
            (status, problem["code"].as_str(), problem["field"].as_str()),
            (422, Some("invalid_field"), Some(field)),
            "{problem}"
        );
        assert!(
            problem["detail"].as_str().unwrap().contains(words),
            "{words}: {problem}"
        );
    }
    // Two output formats at once.
    let body = json!({"provider": "fake", "model": "fake-model", "input": "hi",
                      "output_schema": weather_schema(),
                      "provider_options": {"response_format": {"type": "json_object"}}});
    let (status, problem) = server.post("/runs", &body).await;
    assert_eq!(
        (status, problem["field"].as_str()),
        (422, Some("provider_options")),
        "{problem}"
    );
    assert!(fake.requests().is_empty(), "refused runs call no model");
    server.stop().await;
}

on_both_backends!(
    openai_valid_answer,
    anthropic_valid_answer,
    openai_corrected,
    anthropic_corrected,
    openai_invalid_twice_fails,
    anthropic_invalid_twice_fails,
    prompt_mode_puts_the_schema_in_the_instructions,
    demo_model_honours_the_schema,
    unusable_schemas_are_refused,
);
