//! Easy to watch, against the real `behest serve` binary: `/metrics` scraped during and after
//! a run and parsed with a Prometheus text parser (the counters match the run); the run's
//! spans exported over OTLP/HTTP to a collector this test runs (decoded with the
//! `opentelemetry-proto` types: names, parentage, GenAI attributes, and every event's
//! `span_id` is the span it was emitted in); API keys in none of the logs, metrics or spans;
//! and a stdio MCP server that gets a minimal environment, not the provider's key.

use crate::support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::{Value, json};
use support::db::{Backend, TestDb};
use support::fake_openai::{FakeOpenAi, Reply, text_stream, tool_calls_stream};
use support::process::{ServerProcess, ToolServer, config_toml};
use support::server::{Frame, collect_frames};

const KEY: &str = "observe-key-5f2a9c";

fn body(input: &str) -> Value {
    json!({"provider": "fake", "model": "fake-model", "input": input})
}

async fn sqlite() -> TestDb {
    TestDb::new(Backend::Sqlite).await.expect("SQLite")
}

/// A run that calls tool `quick`, then answers in 30 tokens 30 ms apart.
fn push_tool_run(fake: &FakeOpenAi, also: &[(&str, &str, Value)]) {
    let mut calls = vec![("call_ok", "quick", json!({"marker": "m1"}))];
    calls.extend(also.iter().cloned());
    fake.push(Reply::sse(&tool_calls_stream(&calls)));
    let tokens: Vec<String> = (1..=30).map(|n| format!(" t{n}")).collect();
    let tokens: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let answer = text_stream(&tokens);
    // Cut after every chunk of the stream (each ends with a blank line): one token per write.
    let cuts: Vec<usize> = answer
        .windows(2)
        .enumerate()
        .filter(|(_, w)| w == b"\n\n")
        .map(|(i, _)| i + 2)
        .collect();
    fake.push(
        Reply::sse(&answer)
            .split_at(cuts)
            .delay(Duration::from_millis(30)),
    );
}

async fn scrape(server: &ServerProcess) -> (String, prometheus_parse::Scrape) {
    let text = server
        .client
        .get(server.url("/metrics"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let lines = text.lines().map(|line| Ok(line.to_owned()));
    let parsed = prometheus_parse::Scrape::parse(lines).unwrap();
    (text, parsed)
}

/// The value of the sample `name` whose labels include `labels` (0 when absent).
fn value(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match &s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => *v,
            prometheus_parse::Value::Histogram(buckets) => {
                buckets.iter().map(|b| b.count).fold(0.0, f64::max)
            }
            prometheus_parse::Value::Summary(_) => panic!("{name} is a summary, not a histogram"),
        })
        .sum()
}

/// Whether `name` is exposed as a Prometheus histogram with buckets.
fn is_histogram(scrape: &prometheus_parse::Scrape, name: &str) -> bool {
    scrape.samples.iter().any(|s| {
        s.metric == name && matches!(&s.value, prometheus_parse::Value::Histogram(b) if b.len() > 5)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_a_run_and_keys_stay_out_of_the_log() {
    let fake = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    push_tool_run(&fake, &[]);
    let db = sqlite().await;
    let toml = format!(
        "{}\n[auth]\nkeys = [\"{KEY}\"]\n",
        config_toml(&fake.base_url(), &tools, "")
    );
    // Request spans (with their URIs) are logged at debug.
    let server = ServerProcess::start_with_env(
        "metrics",
        &toml,
        &db.url,
        &[(
            "RUST_LOG",
            "debug,sqlx=warn,hyper=info,h2=info,reqwest=info,rmcp=info",
        )],
    )
    .await;
    let without = server
        .client
        .get(server.url("/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(without.status(), 401, "/metrics needs the key");

    let created = server
        .client
        .post(server.url("/runs"))
        .bearer_auth(KEY)
        .json(&body("use the tool"))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 202);
    let run_id = created.json::<Value>().await.unwrap()["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    // Watched as a browser does: the key in the query.
    let response = server
        .client
        .get(server.url(&format!("/runs/{run_id}/events")))
        .query(&[("access_token", KEY)])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut stream = eventsource_stream::Eventsource::eventsource(response.bytes_stream());
    let mut frames = Vec::new();
    let mut during = None;
    while let Some(event) = futures::StreamExt::next(&mut stream).await {
        let event = event.unwrap();
        frames.push(Frame {
            id: event.id,
            event: event.event,
            data: event.data,
        });
        let deltas = frames.iter().filter(|f| f.event == "text_delta").count();
        if deltas == 3 && during.is_none() {
            // Mid-run: the run is active and this stream is counted.
            during = Some(scrape(&server).await.1);
        }
    }
    let during = during.expect("scraped during the run");
    assert_eq!(value(&during, "behest_runs_active", &[]), 1.0);
    assert_eq!(value(&during, "behest_sse_watchers", &[]), 1.0);
    assert_eq!(value(&during, "behest_runs_created_total", &[]), 1.0);
    assert_eq!(frames.last().unwrap().event, "run_completed", "{frames:?}");

    let refused = server
        .client
        .delete(server.url("/runs"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 405);

    // After the run: every counter matches it.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (text, after) = loop {
        let (text, scrape) = scrape(&server).await;
        let settled = value(&scrape, "behest_sse_watchers", &[]) == 0.0
            && value(&scrape, "behest_runs_active", &[]) == 0.0;
        if settled || Instant::now() > deadline {
            break (text, scrape);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(value(&after, "behest_sse_watchers", &[]), 0.0, "{text}");
    assert_eq!(value(&after, "behest_runs_active", &[]), 0.0, "{text}");
    assert_eq!(
        value(
            &after,
            "behest_runs_finished_total",
            &[("status", "completed")]
        ),
        1.0
    );
    let fake_model = [("provider", "fake"), ("model", "fake-model")];
    let calls = [fake_model[0], fake_model[1], ("outcome", "ok")];
    assert_eq!(value(&after, "behest_model_calls_total", &calls), 2.0);
    let run: Value = server
        .client
        .get(server.url(&format!("/runs/{run_id}")))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let usage = &run["total_usage"];
    for (kind, field) in [("input", "input_tokens"), ("output", "output_tokens")] {
        let labels = [fake_model[0], fake_model[1], ("kind", kind)];
        assert_eq!(
            value(&after, "behest_model_tokens_total", &labels),
            usage[field].as_f64().unwrap(),
            "{kind} tokens"
        );
    }
    assert_eq!(
        value(
            &after,
            "behest_tool_executions_total",
            &[("tool", "quick"), ("result", "success")]
        ),
        1.0
    );
    assert_eq!(
        value(&after, "behest_events_persisted_total", &[]),
        frames.len() as f64,
        "every event of the run was persisted once"
    );
    assert_eq!(
        value(
            &after,
            "behest_http_requests_total",
            &[("method", "POST"), ("route", "/runs"), ("status", "202")]
        ),
        1.0
    );
    assert_eq!(
        value(
            &after,
            "behest_http_requests_total",
            &[("route", "/metrics"), ("status", "401")]
        ),
        1.0
    );
    // A 405 is counted under its route's template, not `unmatched`.
    assert_eq!(
        value(
            &after,
            "behest_http_requests_total",
            &[("method", "DELETE"), ("route", "/runs"), ("status", "405")]
        ),
        1.0
    );
    for histogram in [
        "behest_http_request_duration_seconds",
        "behest_model_call_duration_seconds",
        "behest_model_time_to_first_token_seconds",
        "behest_tool_execution_duration_seconds",
        "behest_event_log_commit_seconds",
        "behest_event_log_batch_events",
    ] {
        assert!(
            is_histogram(&after, histogram),
            "{histogram} has buckets:\n{text}"
        );
    }
    assert_eq!(
        value(
            &after,
            "behest_model_time_to_first_token_seconds_count",
            &fake_model
        ),
        2.0
    );
    assert_eq!(value(&after, "behest_doom_loops_total", &[]), 0.0);
    // The compaction circuit breaker, read from the store: closed, nothing counted.
    for gauge in [
        "behest_compaction_circuit_open",
        "behest_compaction_consecutive_failures",
    ] {
        assert!(
            after.samples.iter().any(|s| s.metric == gauge),
            "{gauge} is exposed:\n{text}"
        );
        assert_eq!(value(&after, gauge, &[]), 0.0);
    }

    // The key is nowhere: not in the metrics, not in the log (whose request lines show the
    // event stream's URI with the token redacted).
    assert!(!text.contains(KEY));
    let log = server.log();
    assert!(!log.contains(KEY), "the key is in the log:\n{log}");
    assert!(
        log.contains("access_token=[redacted]"),
        "the watch's URI is logged, redacted:\n{log}"
    );
    db.assert_logs_fold().await;
    db.cleanup().await;
}

/// What the collector received: every span, and the `service.name` of each batch.
#[derive(Default)]
struct Collected {
    spans: Vec<Span>,
    services: Vec<String>,
}

async fn receive_traces(
    State(collected): State<Arc<Mutex<Collected>>>,
    body: Bytes,
) -> ([(&'static str, &'static str); 1], Vec<u8>) {
    let request = ExportTraceServiceRequest::decode(body).unwrap();
    let mut collected = collected.lock().unwrap();
    for resource in request.resource_spans {
        if let Some(resource) = &resource.resource {
            for attribute in &resource.attributes {
                if attribute.key == "service.name" {
                    collected.services.push(text_of(attribute.value.as_ref()));
                }
            }
        }
        for scope in resource.scope_spans {
            collected.spans.extend(scope.spans);
        }
    }
    (
        [("content-type", "application/x-protobuf")],
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
}

fn text_of(value: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::ArrayValue(a)) => a
            .values
            .iter()
            .map(|v| text_of(Some(v)))
            .collect::<Vec<_>>()
            .join(","),
        _ => String::new(),
    }
}

fn attributes(span: &Span) -> HashMap<String, String> {
    span.attributes
        .iter()
        .map(|a| (a.key.clone(), text_of(a.value.as_ref())))
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_otlp_collector_with_the_gen_ai_conventions() {
    let collected = Arc::new(Mutex::new(Collected::default()));
    let app = axum::Router::new()
        .route("/v1/traces", axum::routing::post(receive_traces))
        .with_state(collected.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let collector = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let fake = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    push_tool_run(&fake, &[("call_bad", "nope", json!({}))]);
    let db = sqlite().await;
    let toml = format!(
        "{}\n[auth]\nkeys = [\"{KEY}\"]\n[telemetry]\notlp_endpoint = \"{collector}\"\n",
        config_toml(&fake.base_url(), &tools, "")
    );
    let server = ServerProcess::start_with_env(
        "traces",
        &toml,
        &db.url,
        &[("OTEL_BSP_SCHEDULE_DELAY", "100")],
    )
    .await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let created = server
        .client
        .post(server.url("/runs"))
        .bearer_auth(KEY)
        .header("traceparent", format!("00-{trace_id}-{caller_span}-01"))
        .json(&body("use the tools"))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 202);
    let run_id = created.json::<Value>().await.unwrap()["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let response = server
        .client
        .get(server.url(&format!("/runs/{run_id}/events")))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    let frames = collect_frames(response).await;
    assert_eq!(frames.last().unwrap().event, "run_completed");

    // The run span ends last; it arrives within the batch delay.
    let deadline = Instant::now() + Duration::from_secs(20);
    let spans = loop {
        let spans = collected.lock().unwrap().spans.clone();
        if spans.iter().any(|s| s.name == "invoke_agent") || Instant::now() > deadline {
            break spans;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let services = collected.lock().unwrap().services.clone();
    assert!(
        services.iter().all(|s| s == "behest") && !services.is_empty(),
        "{services:?}"
    );
    let named = |name: &str| -> Vec<&Span> { spans.iter().filter(|s| s.name == name).collect() };
    let run_spans = named("invoke_agent");
    assert_eq!(
        run_spans.len(),
        1,
        "one run span: {:?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    let run = run_spans[0];
    let run_span_id = hex(&run.span_id);
    assert_eq!(hex(&run.trace_id), trace_id, "the caller's trace continues");
    assert_eq!(
        hex(&run.parent_span_id),
        caller_span,
        "under the caller's span"
    );
    let run_attributes = attributes(run);
    for (key, expected) in [
        ("gen_ai.operation.name", "invoke_agent"),
        ("gen_ai.provider.name", "openai"),
        ("gen_ai.request.model", "fake-model"),
        ("behest.run.id", run_id.as_str()),
        ("behest.run.status", "completed"),
    ] {
        assert_eq!(
            run_attributes.get(key).map(String::as_str),
            Some(expected),
            "{key}"
        );
    }

    let chats = named("chat fake-model");
    assert_eq!(chats.len(), 2, "one span per model call");
    let usage: Vec<Value> = frames
        .iter()
        .filter(|f| f.event == "usage_recorded")
        .map(|f| f.json()["usage"].clone())
        .collect();
    for (chat, usage) in chats.iter().zip(&usage) {
        assert_eq!(hex(&chat.parent_span_id), run_span_id);
        assert_eq!(hex(&chat.trace_id), trace_id);
        assert_eq!(chat.kind, 3, "CLIENT");
        let a = attributes(chat);
        assert_eq!(a["gen_ai.operation.name"], "chat");
        assert_eq!(a["gen_ai.provider.name"], "openai");
        assert_eq!(a["gen_ai.request.model"], "fake-model");
        assert_eq!(
            a["gen_ai.usage.input_tokens"],
            usage["input_tokens"].to_string()
        );
        assert_eq!(
            a["gen_ai.usage.output_tokens"],
            usage["output_tokens"].to_string()
        );
        assert!(a.contains_key("gen_ai.response.finish_reasons"));
    }

    let quick = named("execute_tool quick");
    let bad = named("execute_tool nope");
    assert_eq!(
        (quick.len(), bad.len()),
        (1, 1),
        "one span per tool execution"
    );
    let (quick, bad) = (quick[0], bad[0]);
    for (span, tool, call) in [(quick, "quick", "call_ok"), (bad, "nope", "call_bad")] {
        assert_eq!(hex(&span.parent_span_id), run_span_id);
        let a = attributes(span);
        assert_eq!(a["gen_ai.operation.name"], "execute_tool");
        assert_eq!(a["gen_ai.tool.name"], tool);
        assert_eq!(a["gen_ai.tool.call.id"], call);
    }
    assert!(!attributes(quick).contains_key("error.type"));
    assert_eq!(attributes(bad)["error.type"], "tool_not_found");
    assert_eq!(
        bad.status.as_ref().map(|s| s.code),
        Some(2),
        "an error status"
    );

    // Every event's span is the one it was emitted in.
    let chat_ids: Vec<String> = chats.iter().map(|s| hex(&s.span_id)).collect();
    let mut iteration = 0;
    for frame in &frames {
        let event = frame.json();
        assert_eq!(event["trace_id"], trace_id);
        let span_id = event["span_id"].as_str().unwrap().to_owned();
        let expected = match frame.event.as_str() {
            "text_delta"
            | "reasoning_delta"
            | "tool_call_started"
            | "tool_call_delta"
            | "tool_call_completed"
            | "model_retrying" => chat_ids[iteration - 1].clone(),
            "tool_execution_started" | "tool_execution_finished" => {
                if event["call_id"] == "call_ok" {
                    hex(&quick.span_id)
                } else {
                    hex(&bad.span_id)
                }
            }
            other => {
                if other == "model_started" {
                    iteration += 1;
                }
                run_span_id.clone()
            }
        };
        assert_eq!(span_id, expected, "{} #{}", frame.event, frame.id);
    }
    let everything = format!("{spans:?}");
    assert!(!everything.contains(KEY), "the key is in a span");
    db.assert_logs_fold().await;
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_child_gets_a_minimal_environment_not_the_provider_key() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::sse(&tool_calls_stream(&[(
        "call_env",
        "env",
        json!({}),
    )])));
    fake.push(Reply::sse(&text_stream(&["done"])));
    let db = sqlite().await;
    let secret = "sk-test-provider-secret-4711";
    let toml = format!(
        "[providers.fake]\nkind = \"openai\"\nbase_url = \"{}\"\napi_key_env = \"FAKE_PROVIDER_KEY\"\n\
         [providers.fake.retry]\nmax_attempts = 1\n\
         [providers.fake.models.fake-model]\ncontext_window = 128000\nmax_output_tokens = 1024\n\
         [mcp_servers.fixture]\ntransport = \"stdio\"\ncommand = \"{}\"\n\
         inherit_env = [\"INHERITED_VAR\"]\n\
         env = {{ BEHEST_MCP_FIXTURE_ENV_TOOL = \"1\", FROM_CONFIG = \"set\" }}\n",
        fake.base_url(),
        env!("CARGO_BIN_EXE_behest-mcp-fixture"),
    );
    let server = ServerProcess::start_with_env(
        "mcp-env",
        &toml,
        &db.url,
        &[
            ("FAKE_PROVIDER_KEY", secret),
            ("INHERITED_VAR", "passed-on"),
            ("UNRELATED_VAR", "kept-back"),
            ("LC_ALL", "C.UTF-8"),
        ],
    )
    .await;
    let (status, _, created) = server.post("/runs", &body("show your environment")).await;
    assert_eq!(status, 202, "{created}");
    let run_id = created["run_id"].as_str().unwrap();
    let response = server
        .client
        .get(server.url(&format!("/runs/{run_id}/events")))
        .send()
        .await
        .unwrap();
    let frames = collect_frames(response).await;
    let finished = frames
        .iter()
        .find(|f| f.event == "tool_execution_finished")
        .expect("the env tool ran")
        .json();
    let vars = finished["result"]["Success"]["output"]["vars"]
        .as_object()
        .unwrap_or_else(|| panic!("{finished}"));
    assert!(vars.contains_key("PATH"), "{vars:?}");
    assert_eq!(vars["LC_ALL"], "C.UTF-8");
    assert_eq!(
        vars["INHERITED_VAR"], "passed-on",
        "inherit_env passes it on"
    );
    assert_eq!(vars["FROM_CONFIG"], "set", "env sets it");
    for kept in ["FAKE_PROVIDER_KEY", "UNRELATED_VAR", "RUST_LOG"] {
        assert!(
            !vars.contains_key(kept),
            "{kept} reached the MCP child: {vars:?}"
        );
    }
    assert!(
        vars.values().all(|v| v.as_str() != Some(secret)),
        "the provider key reached the MCP child"
    );
    // The key is real: the provider got it.
    let sent = fake.requests()[0].headers["authorization"]
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(sent, format!("Bearer {secret}"));
    db.assert_logs_fold().await;
    db.cleanup().await;
}
