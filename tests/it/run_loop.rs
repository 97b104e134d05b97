//! The run loop end to end against a fake OpenAI-compatible server speaking the real wire
//! format: event order, exact stored text, history, and every failure ending in `run_failed`.

use crate::support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::db::{Backend, TestDb};
use support::fake_anthropic as anthropic;
use support::fake_openai::{FakeOpenAi, Reply, chunk, fixture, refused_base_url, text_stream};
use support::schema::EventSchema;
use support::server::{Frame, TERMINAL, TestServer, config_for};

const FIXTURE_TEXT: &str = "Héllo wörld — 你好 🌍!";

fn types(frames: &[Frame]) -> Vec<&str> {
    frames.iter().map(|f| f.event.as_str()).collect()
}

/// Byte offsets that cut the fixture inside a JSON object and inside multi-byte characters.
fn awkward_offsets(bytes: &[u8]) -> Vec<usize> {
    let text = std::str::from_utf8(bytes).unwrap();
    let mut cuts = Vec::new();
    for needle in ["é", "ö", "你", "🌍"] {
        let at = text.find(needle).unwrap();
        cuts.push(at + 1); // inside the character's UTF-8 bytes
    }
    cuts.push(text.find("\"delta\"").unwrap() + 3); // inside a JSON object
    cuts.sort_unstable();
    cuts
}

async fn streams_a_run_end_to_end(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let body = fixture("text.sse");
    fake.push(Reply::sse(&body).split_at(awkward_offsets(&body)));
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let created = server
        .create_run(json!({"provider": "fake", "model": "fake-model", "input": "Say hello", "metadata": {"ticket": 42}}))
        .await;
    let run_id = created["run_id"].as_str().unwrap();
    let frames = server.events(run_id, None).await;

    let kinds = types(&frames);
    let deltas = kinds.iter().filter(|k| **k == "text_delta").count();
    let mut expected = vec!["run_started", "context_built", "model_started"];
    expected.extend(std::iter::repeat_n("text_delta", deltas));
    // The fixture reports `prompt_tokens_details.cached_tokens`: cache statistics follow usage.
    expected.extend([
        "usage_recorded",
        "cache_metrics",
        "assistant_message_committed",
        "run_completed",
    ]);
    assert_eq!(kinds, expected);
    assert!(deltas >= 5, "the fixture streams several deltas");

    let schema = EventSchema::new();
    for (index, frame) in frames.iter().enumerate() {
        let event = frame.json();
        assert_eq!(frame.sequence(), index as u64 + 1, "contiguous from 1");
        assert_eq!(event["sequence"], index + 1);
        assert_eq!(event["type"], frame.event, "event: is the type");
        assert_eq!(event["run_id"], run_id);
        assert_eq!(event["trace_id"].as_str().unwrap().len(), 32);
        schema.check(&event);
    }
    let streamed: String = frames
        .iter()
        .filter(|f| f.event == "text_delta")
        .map(|f| f.json()["delta"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(streamed, FIXTURE_TEXT);

    let run = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "completed");
    assert_eq!(run["finish_reason"], "stop");
    assert_eq!(run["metadata"], json!({"ticket": 42}));
    assert_eq!(run["iterations"], 1);
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(
        output["messages"][0]["content"][0]["text"], FIXTURE_TEXT,
        "stored text is exact"
    );
    assert_eq!(output["messages"][0]["role"], "assistant");
    assert_eq!(output["finish_reason"], "stop");
    assert_eq!(output["iterations"], 1);
    let usage = &frames
        .iter()
        .find(|f| f.event == "usage_recorded")
        .unwrap()
        .json()["usage"];
    assert_eq!(output["total_usage"], *usage);
    assert!(usage["total_tokens"].as_u64().unwrap() > 0);

    let request = &fake.requests()[0].body;
    assert_eq!(request["model"], "fake-model");
    assert_eq!(request["stream"], true);
    assert_eq!(
        request["messages"],
        json!([{"role": "user", "content": "Say hello"}])
    );
    server.stop().await;
}

async fn next_run_sends_the_session_history(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&text_stream(&["Paris", " is the capital."])));
    fake.push(Reply::sse(&text_stream(&["About 2.1 million."])));
    fake.push(Reply::sse(&text_stream(&["In 1801."])));
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let first = server
        .create_run(
            json!({"provider": "fake", "model": "fake-model", "input": "Capital of France?"}),
        )
        .await;
    let session = first["session_id"].as_str().unwrap();
    server.finished_run(first["run_id"].as_str().unwrap()).await;
    let second = server.start_run("Its population?", Some(session)).await;
    let run = server.finished_run(&second).await;
    assert_eq!(run["status"], "completed");
    assert_eq!(run["session_id"], session);
    let history = &fake.requests()[1].body["messages"];
    assert_eq!(
        *history,
        json!([
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris is the capital."},
            {"role": "user", "content": "Its population?"},
        ])
    );
    // A third run starts from what this process cached of the first two and what they stored
    // since: the whole history, once, in order.
    let third = server.start_run("Counted when?", Some(session)).await;
    assert_eq!(server.finished_run(&third).await["status"], "completed");
    assert_eq!(
        fake.requests()[2].body["messages"],
        json!([
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris is the capital."},
            {"role": "user", "content": "Its population?"},
            {"role": "assistant", "content": "About 2.1 million."},
            {"role": "user", "content": "Counted when?"},
        ])
    );
    let runs = server
        .get_json(&format!("/runs?session_id={session}"))
        .await;
    assert_eq!(runs["runs"].as_array().unwrap().len(), 3);
    assert_eq!(runs["runs"][0]["id"], third.as_str(), "newest first");
    // Cursor pagination: one run per page, newest first, the last page without a cursor.
    let mut paged = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let query = cursor.map_or_else(String::new, |c| format!("&cursor={c}"));
        let page = server
            .get_json(&format!("/runs?session_id={session}&limit=1{query}"))
            .await;
        assert_eq!(page["runs"].as_array().unwrap().len(), 1, "{page}");
        paged.push(page["runs"][0]["id"].as_str().unwrap().to_owned());
        match &page["next_cursor"] {
            Value::Null => break,
            next => cursor = Some(next.as_str().unwrap().to_owned()),
        }
        assert!(paged.len() < 3, "a cursor after the last run: {page}");
    }
    assert_eq!(
        paged,
        vec![
            third.clone(),
            second.clone(),
            first["run_id"].as_str().unwrap().to_owned()
        ]
    );
    let sessions = server.get_json("/sessions?limit=1").await;
    assert_eq!(sessions["sessions"][0]["id"], session);
    assert_eq!(sessions["next_cursor"], Value::Null);
    server.stop().await;
}

/// Runs one failing provider reply and checks the run ends `failed` with a readable error and
/// the provider error's class (`None`: no `error_class` in the event).
async fn assert_fails(server: &TestServer, expect_in_error: &str, class: Option<&str>) {
    let run_id = server.start_run("hi", None).await;
    let frames = server.events(&run_id, None).await;
    let last = frames.last().unwrap();
    assert_eq!(last.event, "run_failed", "{frames:?}");
    assert_eq!(
        frames
            .iter()
            .filter(|f| support::server::TERMINAL.contains(&f.event.as_str()))
            .count(),
        1
    );
    let error = last.json()["error"].as_str().unwrap().to_owned();
    assert!(
        error.contains(expect_in_error),
        "error `{error}` mentions `{expect_in_error}`"
    );
    assert_eq!(
        last.json().get("error_class").and_then(Value::as_str),
        class,
        "{error}"
    );
    let run = server.get_json(&format!("/runs/{run_id}")).await;
    assert_eq!(run["status"], "failed");
    assert_eq!(run["error"], error);
    // The class is the run's too: on its record, in the run list, its output and snapshot.
    assert_eq!(run["error_class"].as_str(), class, "{run}");
    let listed = server.get_json("/runs?status=failed&limit=100").await;
    let listed = listed["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == run_id.as_str())
        .cloned()
        .unwrap();
    assert_eq!(listed["error_class"].as_str(), class);
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(output["status"], "failed");
    assert_eq!(output["finish_reason"], "error");
    assert_eq!(output["error_class"].as_str(), class);
    let snapshot = server.get_json(&format!("/snapshots/{run_id}")).await;
    assert_eq!(
        (
            snapshot["status"].as_str(),
            snapshot["error_class"].as_str()
        ),
        (Some("failed"), class),
        "{snapshot}"
    );
}

async fn provider_failures_end_in_run_failed(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    fake.push(Reply::status(401, json!({"error": {"message": "Incorrect API key provided: sk-te***", "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}})));
    assert_fails(&server, "auth", Some("auth")).await;
    fake.push(Reply::status(500, json!({"error": {"message": "The server had an error while processing your request.", "type": "server_error", "param": null, "code": null}})));
    assert_fails(&server, "server", Some("server")).await;
    let mut malformed = text_stream(&["Hel"]);
    malformed.splice(
        0..0,
        b"data: {\"id\": \"chatcmpl-1\", \"choices\": [{\"delta\": {\"content\": \n\n"
            .iter()
            .copied(),
    );
    fake.push(Reply::sse(&malformed));
    assert_fails(&server, "malformed", Some("server")).await;
    let partial = &text_stream(&["Hel", "lo"])[..300];
    fake.push(Reply::stall_after(partial));
    assert_fails(&server, "timeout", Some("timeout")).await;
    fake.push(Reply::close_after(partial));
    assert_fails(&server, "transport", Some("transport")).await;
    server.stop().await;

    let refused = refused_base_url().await;
    let Some(server) = TestServer::start(backend, config_for(&refused)).await else {
        return;
    };
    assert_fails(&server, "transport", Some("transport")).await;
    server.stop().await;
}

async fn cancel_ends_a_streaming_run(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let partial = &text_stream(&["Hel", "lo"])[..300];
    fake.push(Reply::stall_after(partial));
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let run_id = server.start_run("hi", None).await;
    // Wait until the model call is streaming.
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.get_json(&format!("/runs/{run_id}")).await["status"] != "calling_model" {
        assert!(Instant::now() < deadline, "run reaches calling_model");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let started = Instant::now();
    let response = server
        .client
        .post(server.url(&format!("/runs/{run_id}/cancel?wait=true")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let record: Value = response.json().await.unwrap();
    assert_eq!(record["status"], "cancelled");
    assert_eq!(
        record["error_class"],
        Value::Null,
        "only a failed run has one"
    );
    assert_eq!(record["iterations"], 1, "the interrupted model call counts");
    // The record and the output agree on the finish reason.
    assert_eq!(record["finish_reason"], "unknown");
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(output["finish_reason"], "unknown");
    // The provider connection was closed.
    let deadline = Instant::now() + Duration::from_secs(1);
    while fake.abandoned() == 0 {
        assert!(Instant::now() < deadline, "the model stream was abandoned");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "cancelled within 1 s"
    );
    let frames = server.events(&run_id, None).await;
    assert_eq!(frames.last().unwrap().event, "run_cancelled");
    assert_eq!(
        frames
            .iter()
            .filter(|f| f.event.starts_with("run_c"))
            .count(),
        1
    );
    // Another cancel of the cancelled run: the same answer (idempotent); it ends nothing twice.
    server.cancel_again(&run_id).await;
    let frames = server.events(&run_id, None).await;
    assert_eq!(
        frames
            .iter()
            .filter(|f| f.event.starts_with("run_c"))
            .count(),
        1
    );
    server.stop().await;
}

async fn restart_fails_runs_left_active(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let store = db.store().await;
    let orphan = behest::store::NewRun {
        id: behest::domain::RunId::new(),
        session_id: behest::domain::SessionId::new(),
        create_session: true,
        provider: "fake".to_owned(),
        model: "fake-model".to_owned(),
        tool_choice: Default::default(),
        metadata: json!({}),
        input: behest::domain::RunInput::from("left behind").content(),
        user_message_id: behest::domain::MessageId::new(),
        tools: None,
        agent: None,
        definition: Default::default(),
        session_defaults: None,
        max_iterations: 25,
        client_request_id: None,
        request_hash: None,
        created_at: chrono::Utc::now(),
        lease: None,
    };
    store.create_run(&orphan).await.unwrap();
    // `recovery = "fail"`: runs left active are failed, not resumed.
    let config =
        support::server::config_with("http://127.0.0.1:9/v1", "[runtime]\nrecovery = \"fail\"\n");
    let server = TestServer::on_store(store, config, Some(db)).await;
    assert_eq!(server.runtime.recover().await.unwrap(), 1);
    let frames = server.events(&orphan.id.to_string(), None).await;
    // Every log opens with `run_started`, also one that nothing wrote before its end.
    assert_eq!(types(&frames), vec!["run_started", "run_failed"]);
    assert_eq!(frames[1].json()["error_class"], "interrupted");
    assert_eq!(
        server.get_json(&format!("/runs/{}", orphan.id)).await["status"],
        "failed"
    );
    assert_eq!(
        server.runtime.recover().await.unwrap(),
        0,
        "recovery is idempotent"
    );
    server.stop().await;
}

/// A configuration with one Anthropic provider `fake` (model `fake-model`, 1024 output
/// tokens at most) and no retries.
fn anthropic_config(base_url: &str) -> behest::config::Config {
    let toml = format!(
        "[providers.fake]\nkind = \"anthropic\"\nbase_url = \"{base_url}\"\n\
         [providers.fake.timeouts]\nconnect_ms = 2000\nfirst_byte_ms = 5000\nidle_ms = 1500\ntotal_ms = 20000\n\
         [providers.fake.retry]\nmax_attempts = 1\n\
         [providers.fake.models.fake-model]\ncontext_window = 200000\nmax_output_tokens = 1024\n"
    );
    behest::config::Config::from_toml(&toml).unwrap()
}

async fn anthropic_run_end_to_end(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let body = anthropic::fixture("text.sse");
    fake.push(Reply::sse(&body).split_at(awkward_offsets(&body)));
    let Some(server) = TestServer::start(backend, anthropic_config(&fake.base_url())).await else {
        return;
    };
    let run_id = server.start_run("Say hello", None).await;
    let frames = server.events(&run_id, None).await;
    let kinds = types(&frames);
    assert_eq!(kinds.last(), Some(&"run_completed"), "{kinds:?}");
    let schema = EventSchema::new();
    for frame in &frames {
        schema.check(&frame.json());
    }
    let streamed: String = frames
        .iter()
        .filter(|f| f.event == "text_delta")
        .map(|f| f.json()["delta"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(streamed, FIXTURE_TEXT);
    let usage = frames
        .iter()
        .find(|f| f.event == "usage_recorded")
        .unwrap()
        .json();
    assert_eq!(
        usage["usage"],
        json!({"input_tokens": 12, "output_tokens": 15, "total_tokens": 27, "reasoning_tokens": 0, "estimated": false})
    );
    let cache = frames
        .iter()
        .find(|f| f.event == "cache_metrics")
        .unwrap()
        .json();
    assert_eq!(cache["cache_read_input_tokens"], 0);

    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(output["messages"][0]["content"][0]["text"], FIXTURE_TEXT);
    assert_eq!(output["finish_reason"], "stop");
    assert_eq!(output["total_usage"], usage["usage"]);

    let requests = fake.requests();
    assert_eq!(requests[0].path, "/v1/messages");
    assert_eq!(
        requests[0].body,
        json!({
            "model": "fake-model",
            "max_tokens": 1024,
            "stream": true,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello"}]}],
        })
    );
    server.stop().await;
}

async fn anthropic_parallel_tool_use_results_go_back_in_one_message(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&anthropic::fixture("parallel_tool_use.sse")).chunks_every(90));
    fake.push(Reply::sse(&anthropic::text_stream(&[
        "Sorry, ",
        "no tools.",
    ])));
    let Some(server) = TestServer::start(backend, anthropic_config(&fake.base_url())).await else {
        return;
    };
    let run_id = server.start_run("Weather and time in Paris?", None).await;
    let run = server.finished_run(&run_id).await;
    assert_eq!(run["status"], "completed");
    assert_eq!(run["iterations"], 2);
    let second = &fake.requests()[1].body;
    assert_eq!(
        second["messages"],
        json!([
            {"role": "user", "content": [{"type": "text", "text": "Weather and time in Paris?"}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": "get_weather", "input": {"location": "Paris"}},
                {"type": "tool_use", "id": "toolu_01B19r91rx91mr028946mr0", "name": "get_time", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01A09q90qw90lq917835lq9", "content": "error: no tool named `get_weather` is available", "is_error": true},
                {"type": "tool_result", "tool_use_id": "toolu_01B19r91rx91mr028946mr0", "content": "error: no tool named `get_time` is available", "is_error": true},
            ]},
        ])
    );
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    let messages = output["messages"].as_array().unwrap();
    assert_eq!(
        messages.last().unwrap()["content"][0]["text"],
        "Sorry, no tools."
    );
    server.stop().await;
}

async fn anthropic_overloaded_fails_the_run_with_its_class(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, anthropic_config(&fake.base_url())).await else {
        return;
    };
    fake.push(Reply::status(
        529,
        anthropic::error_body("overloaded_error", "Overloaded"),
    ));
    assert_fails(&server, "Overloaded", Some("overloaded")).await;
    fake.push(Reply::status(
        400,
        anthropic::error_body(
            "invalid_request_error",
            "prompt is too long: 208000 tokens > 200000 maximum",
        ),
    ));
    assert_fails(
        &server,
        "prompt is too long",
        Some("context_length_exceeded"),
    )
    .await;
    fake.push(Reply::sse(&anthropic::fixture("error_in_stream.sse")));
    assert_fails(&server, "overloaded", Some("overloaded")).await;
    server.stop().await;
}

async fn retried_rate_limit_completes_the_run(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let mut config = config_for(&fake.base_url());
    for provider in config.providers.values_mut() {
        provider.retry.max_attempts = 3;
        provider.retry.initial_backoff_ms = 10;
    }
    fake.push(
        Reply::status(429, json!({"error": {"message": "Rate limit reached", "type": "requests", "param": null, "code": "rate_limit_exceeded"}}))
            .header("retry-after", "0"),
    );
    fake.push(Reply::sse(&text_stream(&["Hel", "lo"])));
    let Some(server) = TestServer::start(backend, config).await else {
        return;
    };
    let run_id = server.start_run("hi", None).await;
    let run = server.finished_run(&run_id).await;
    assert_eq!(run["status"], "completed");
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(output["messages"][0]["content"][0]["text"], "Hello");
    assert_eq!(fake.requests().len(), 2);
    server.stop().await;
}

/// Runs cancelled at once: whichever cancel lands before `model_started` means the model was
/// never called for that run (whatever the timing, this must hold for every run).
async fn a_run_cancelled_before_its_model_call_never_calls_the_model(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let mut runs = Vec::new();
    for i in 0..8 {
        let input = format!("cancel me {i}");
        let run_id = server.start_run(&input, None).await;
        let response = server
            .client
            .post(server.url(&format!("/runs/{run_id}/cancel")))
            .send()
            .await
            .unwrap();
        assert!([200, 202, 409].contains(&response.status().as_u16()));
        runs.push((run_id, input));
    }
    for (run_id, input) in &runs {
        let frames = server.events(run_id, None).await;
        let called = fake
            .requests()
            .iter()
            .any(|r| r.body["messages"][0]["content"] == input.as_str());
        if !frames.iter().any(|f| f.event == "model_started") {
            assert!(!called, "run {run_id} was cancelled before its model call");
        }
        assert_eq!(
            frames
                .iter()
                .filter(|f| TERMINAL.contains(&f.event.as_str()))
                .count(),
            1
        );
    }
    server.stop().await;
}

/// A finish reason the provider sent that behest does not know completes the run with
/// `unknown`, never a clean `stop`.
async fn an_unknown_finish_reason_is_not_a_clean_stop(backend: Backend) {
    use support::fake_openai::{DONE, chunk, usage_chunk};
    let fake = FakeOpenAi::start().await;
    let mut body = chunk(json!({"role": "assistant", "content": ""}), None);
    body.push_str(&chunk(json!({"content": "Half an answ"}), None));
    body.push_str(&chunk(json!({}), Some("interrupted_by_server")));
    body.push_str(&usage_chunk(10, 3, 0));
    body.push_str(DONE);
    fake.push(Reply::sse(body.as_bytes()));
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let run_id = server.start_run("hi", None).await;
    let run = server.finished_run(&run_id).await;
    assert_eq!(run["status"], "completed");
    assert_eq!(run["finish_reason"], "unknown");
    let frames = server.events(&run_id, None).await;
    assert_eq!(frames.last().unwrap().json()["finish_reason"], "unknown");
    let output = server.get_json(&format!("/runs/{run_id}/output")).await;
    assert_eq!(output["finish_reason"], "unknown");
    server.stop().await;
}

/// A cancel while the model is streaming a tool call's arguments: the started call still gets
/// its `tool_call_completed`, with the text streamed so far as `invalid_arguments`; nothing runs.
async fn cancel_mid_tool_call_completes_the_started_call(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let started = chunk(
        json!({"role": "assistant", "tool_calls": [{"index": 0, "id": "call_cut", "type": "function",
            "function": {"name": "lookup", "arguments": ""}}]}),
        None,
    );
    let piece = chunk(
        json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"q\": \"par"}}]}),
        None,
    );
    fake.push(Reply::stall_after(format!("{started}{piece}").as_bytes()));
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let run_id = server.start_run("look it up", None).await;
    // Watch live until the call's arguments stream, then cancel.
    let mut live = server.watch(&run_id, None).await;
    let mut seen = String::new();
    while !seen.contains("event: tool_call_delta") {
        let piece = tokio::time::timeout(Duration::from_secs(5), live.chunk())
            .await
            .expect("the call's arguments stream")
            .unwrap()
            .expect("the stream stays open");
        seen.push_str(&String::from_utf8_lossy(&piece));
    }
    drop(live);
    let response = server
        .client
        .post(server.url(&format!("/runs/{run_id}/cancel?wait=true")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let frames = server.events(&run_id, None).await;
    let kinds: Vec<&str> = frames.iter().map(|f| f.event.as_str()).collect();
    let started_at = kinds
        .iter()
        .position(|k| *k == "tool_call_started")
        .unwrap();
    let completed_at = kinds.iter().position(|k| *k == "tool_call_completed");
    assert!(completed_at.is_some_and(|at| at > started_at), "{kinds:?}");
    let completed = frames[completed_at.unwrap()].json();
    assert_eq!(completed["call"]["id"], "call_cut");
    assert_eq!(completed["call"]["arguments"], json!({}));
    assert_eq!(completed["call"]["invalid_arguments"], "{\"q\": \"par");
    assert!(!kinds.contains(&"tool_execution_started"), "{kinds:?}");
    assert_eq!(kinds.last(), Some(&"run_cancelled"));
    server.stop().await;
}

/// Streams until `event` is seen live.
async fn watch_until(server: &TestServer, run_id: &str, event: &str) {
    let mut live = server.watch(run_id, None).await;
    let mut seen = String::new();
    while !seen.contains(&format!("event: {event}")) {
        let piece = tokio::time::timeout(Duration::from_secs(5), live.chunk())
            .await
            .expect("the event streams")
            .unwrap()
            .expect("the stream stays open");
        seen.push_str(&String::from_utf8_lossy(&piece));
    }
}

/// A model call cut off by a cancel, or by a failure after some output, still costs tokens:
/// the run records an estimated `usage_recorded` (its request's estimated size plus what
/// streamed), counted in the run's totals, its output and its snapshot.
async fn a_cut_call_records_its_estimated_usage(backend: Backend) {
    let fake = FakeOpenAi::start().await;
    let stream = text_stream(&["Counting: one, two, three, four, five, six", " and more"]);
    let cut = stream
        .windows(2)
        .position(|w| w == b"\n\n")
        .map(|at| at + 2)
        .unwrap();
    let first_event =
        &stream[..stream[cut..].windows(2).position(|w| w == b"\n\n").unwrap() + cut + 2];
    // A cancel while the call streams; then a stream the server closes after some text.
    fake.push(Reply::stall_after(first_event));
    fake.push(Reply::close_after(first_event));
    let Some(server) = TestServer::start(backend, config_for(&fake.base_url())).await else {
        return;
    };
    let cancelled = server.start_run("count for me", None).await;
    watch_until(&server, &cancelled, "text_delta").await;
    let response = server
        .client
        .post(server.url(&format!("/runs/{cancelled}/cancel?wait=true")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let failed = server.start_run("count again", None).await;
    let failed_record = server.finished_run(&failed).await;
    assert_eq!(failed_record["status"], "failed", "{failed_record}");
    for (run_id, end) in [(&cancelled, "run_cancelled"), (&failed, "run_failed")] {
        let frames = server.events(run_id, None).await;
        let kinds: Vec<&str> = frames.iter().map(|f| f.event.as_str()).collect();
        assert_eq!(kinds.last(), Some(&end), "{kinds:?}");
        let usages: Vec<Value> = frames
            .iter()
            .filter(|f| f.event == "usage_recorded")
            .map(|f| f.json()["usage"].clone())
            .collect();
        assert_eq!(usages.len(), 1, "{run_id}: {kinds:?}");
        let usage = &usages[0];
        assert_eq!(usage["estimated"], true, "{usage}");
        assert!(usage["input_tokens"].as_u64().unwrap() > 0, "{usage}");
        // "Counting: one, two, three, four, five, six" is more than 5 tokens in any tokenizer.
        assert!(usage["output_tokens"].as_u64().unwrap() > 5, "{usage}");
        // Before the kept text's commit and the terminal event.
        let at = kinds.iter().position(|k| *k == "usage_recorded").unwrap();
        let committed = kinds
            .iter()
            .position(|k| *k == "assistant_message_committed")
            .unwrap();
        assert!(at < committed, "{kinds:?}");
        let record = server.get_json(&format!("/runs/{run_id}")).await;
        assert_eq!(&record["total_usage"], usage, "the run's totals");
        let output = server.get_json(&format!("/runs/{run_id}/output")).await;
        assert_eq!(&output["total_usage"], usage, "the output's totals");
        let snapshot = server.get_json(&format!("/snapshots/{run_id}")).await;
        assert_eq!(&snapshot["total_usage"], usage, "the snapshot's totals");
    }
    server.stop().await;
}

on_both_backends!(
    a_cut_call_records_its_estimated_usage,
    cancel_mid_tool_call_completes_the_started_call,
    an_unknown_finish_reason_is_not_a_clean_stop,
    a_run_cancelled_before_its_model_call_never_calls_the_model,
    anthropic_run_end_to_end,
    anthropic_parallel_tool_use_results_go_back_in_one_message,
    anthropic_overloaded_fails_the_run_with_its_class,
    retried_rate_limit_completes_the_run,
    streams_a_run_end_to_end,
    next_run_sends_the_session_history,
    provider_failures_end_in_run_failed,
    cancel_ends_a_streaming_run,
    restart_fails_runs_left_active,
);
