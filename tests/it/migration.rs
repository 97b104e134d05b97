//! Migration 0006 (compact events) on both backends: a log written in the 0005 layout
//! (`event_type`, `data`, `terminal`) reads back byte for byte after the migration, and every
//! row the server's serializer wrote becomes compact; what the compact values could not give
//! back exactly stays verbatim.

use crate::support;

use std::borrow::Cow;
use std::str::FromStr;

use behest::domain::{RunId, SessionId};
use behest::events::{AgentEvent, EventPayload, LoggedEvent};
use chrono::{DateTime, Utc};
use serde_json::json;
use sqlx::migrate::Migrator;
use support::db::{Backend, TestDb};

/// One payload of every variant, as the run loop emits them.
fn payloads(session_id: SessionId) -> Vec<serde_json::Value> {
    let call = json!({"id": "call_1", "name": "get_weather", "arguments": {"city": "Zürich"}});
    let usage = json!({"input_tokens": 12, "output_tokens": 64, "total_tokens": 76});
    vec![
        json!({"type": "run_started", "session_id": session_id, "provider": "fake", "model": "m"}),
        json!({"type": "context_built", "message_count": 3}),
        json!({"type": "model_started", "provider": "fake", "model": "m", "iteration": 1}),
        json!({"type": "reasoning_delta", "delta": "hmm"}),
        json!({"type": "text_delta", "delta": " t1"}),
        json!({"type": "text_delta", "delta": "\"quoted\"\n\u{1f30d} é\\"}),
        json!({"type": "tool_call_started", "call_id": "call_1", "tool_name": "get_weather"}),
        json!({"type": "tool_call_delta", "call_id": "call_1", "delta": "{\"city\":"}),
        json!({"type": "tool_call_completed", "call": call}),
        json!({"type": "usage_recorded", "usage": usage}),
        json!({"type": "cache_metrics", "cache_creation_input_tokens": 0,
               "cache_read_input_tokens": 5, "cached_input_tokens": 0}),
        json!({"type": "assistant_message_committed", "message_id": uuid::Uuid::now_v7()}),
        json!({"type": "tool_calls_required", "message_id": uuid::Uuid::now_v7(),
               "tool_calls": [{"call_id": "call_1", "tool_name": "get_weather",
                               "arguments": {}, "kind": "approval"}],
               "expires_at": "2026-12-03T14:00:00Z"}),
        json!({"type": "tool_execution_started", "call_id": "call_1", "tool_name": "get_weather"}),
        json!({"type": "tool_execution_finished", "call_id": "call_1", "tool_name": "get_weather",
               "result": {"Success": {"output": {"temp": 3}}}, "duration_ms": 12}),
        json!({"type": "tool_message_committed", "message_id": uuid::Uuid::now_v7()}),
        json!({"type": "model_retrying", "attempt": 1, "error_class": "overloaded",
               "delay_ms": 500, "error": "529"}),
        json!({"type": "context_compacted", "compaction_id": uuid::Uuid::now_v7(),
               "trigger": "auto", "messages_summarised": 4,
               "through_message_id": uuid::Uuid::now_v7(), "tokens_before": 9000,
               "tokens_after": 1000, "summary": "so far", "usage": usage, "duration_ms": 80}),
        json!({"type": "compaction_circuit_opened", "consecutive_failures": 3}),
        json!({"type": "doom_loop_detected", "description": "get_weather ×3"}),
        json!({"type": "run_resumed", "iteration": 2, "abandoned_after": null}),
        json!({"type": "run_resumed", "iteration": 2, "abandoned_after": 3}),
        json!({"type": "run_failed", "error": "boom"}),
        json!({"type": "run_failed", "error": "boom", "error_class": "internal"}),
        json!({"type": "run_cancelled"}),
        json!({"type": "run_completed", "finish_reason": "stop", "iterations": 1}),
    ]
}

/// Timestamps with every fraction length the serializer writes (none, 3, 6 and 9 digits).
fn timestamp(index: usize) -> DateTime<Utc> {
    let nanos = [0, 120_000_000, 123_400_000, 123_456_789][index % 4];
    DateTime::from_timestamp(1_764_770_292 + index as i64, nanos).unwrap()
}

/// The events of one run as the 0005 server wrote them: `(event_type, data, terminal)`.
fn old_log(
    run_id: RunId,
    session_id: SessionId,
    trace_id: &str,
    span_id: &str,
) -> Vec<LoggedEvent> {
    payloads(session_id)
        .into_iter()
        .enumerate()
        .map(|(index, payload)| {
            let payload: EventPayload = serde_json::from_value(payload).unwrap();
            let sequence = index as u64 + 1;
            let event = AgentEvent {
                sequence,
                run_id,
                timestamp: timestamp(index),
                trace_id: trace_id.to_owned(),
                span_id: span_id.to_owned(),
                payload,
            };
            LoggedEvent {
                sequence,
                event_type: event.payload.event_type().to_owned(),
                data: serde_json::to_string(&event).unwrap().into(),
                terminal: event.is_terminal(),
            }
        })
        .collect()
}

/// The migrations up to and including `version`.
fn up_to(migrator: Migrator, version: i64) -> Migrator {
    let migrations: Vec<_> = migrator
        .migrations
        .iter()
        .filter(|migration| migration.version <= version)
        .cloned()
        .collect();
    Migrator {
        migrations: Cow::Owned(migrations),
        ..migrator
    }
}

/// Writes sessions, runs and their 0005-layout events with plain SQL (the same text on both
/// backends).
macro_rules! write_old_logs {
    ($pool:expr, $logs:expr) => {{
        for (run_id, session_id, events) in $logs {
            let now = Utc::now();
            sqlx::query("INSERT INTO sessions (id, created_at, updated_at) VALUES ($1, $2, $2)")
                .bind(session_id.0)
                .bind(now)
                .execute($pool)
                .await
                .unwrap();
            sqlx::query(
                "INSERT INTO runs (id, session_id, status, provider, model, tool_choice, metadata, \
                 iterations, input_tokens, output_tokens, total_tokens, max_iterations, \
                 created_at, updated_at) \
                 VALUES ($1, $2, 'completed', 'fake', 'm', '\"auto\"', '{}', 1, 0, 0, 0, 25, $3, $3)",
            )
            .bind(run_id.0)
            .bind(session_id.0)
            .bind(now)
            .execute($pool)
            .await
            .unwrap();
            for event in events {
                sqlx::query(
                    "INSERT INTO events (run_id, sequence, event_type, data, terminal) \
                     VALUES ($1, $2, $3, $4, $5)",
                )
                .bind(run_id.0)
                .bind(event.sequence as i64)
                .bind(event.event_type.as_str())
                .bind(&*event.data)
                .bind(event.terminal)
                .execute($pool)
                .await
                .unwrap();
            }
        }
    }};
}

async fn a_0005_log_reads_back_byte_for_byte_after_0006(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    // Runs as 0005 servers wrote them: the default trace (the run id), a caller's
    // `traceparent`, no trace context at all (empty ids: stays verbatim), and rows no
    // serializer of ours wrote (stay verbatim).
    let mut logs = Vec::new();
    let default_trace = RunId::new();
    logs.push((
        default_trace,
        SessionId::new(),
        default_trace.0.simple().to_string(),
        "00f067aa0ba902b7".to_owned(),
    ));
    logs.push((
        RunId::new(),
        SessionId::new(),
        "4bf92f3577b34da6a3ce929d0e0e4736".to_owned(),
        "a3ce929d0e0e4736".to_owned(),
    ));
    logs.push((RunId::new(), SessionId::new(), String::new(), String::new()));
    let mut logs: Vec<(RunId, SessionId, Vec<LoggedEvent>)> = logs
        .into_iter()
        .map(|(run_id, session_id, trace_id, span_id)| {
            let events = old_log(run_id, session_id, &trace_id, &span_id);
            (run_id, session_id, events)
        })
        .collect();
    let odd_run = RunId::new();
    let odd = |sequence: u64, event_type: &str, data: String| LoggedEvent {
        sequence,
        event_type: event_type.to_owned(),
        terminal: event_type == "run_completed",
        data: data.into(),
    };
    let envelope = |sequence: u64, timestamp: &str, span_id: &str| {
        format!(
            "{{\"sequence\":{sequence},\"run_id\":\"{odd_run}\",\"timestamp\":\"{timestamp}\",\
             \"trace_id\":\"{}\",\"span_id\":\"{span_id}\"",
            odd_run.0.simple()
        )
    };
    logs.push((
        odd_run,
        SessionId::new(),
        vec![
            // A type this version does not know.
            odd(
                1,
                "brand_new",
                format!(
                    "{},\"type\":\"brand_new\",\"x\":1}}",
                    envelope(1, "2026-12-03T13:58:12Z", "00f067aa0ba902b7")
                ),
            ),
            // A fraction the serializer never writes (it would write `.100`).
            odd(
                2,
                "text_delta",
                format!(
                    "{},\"type\":\"text_delta\",\"delta\":\"a\"}}",
                    envelope(2, "2026-12-03T13:58:12.100000Z", "00f067aa0ba902b7")
                ),
            ),
            // Upper-case hex, a timestamp with an offset, another key order, not JSON at all.
            odd(
                3,
                "text_delta",
                format!(
                    "{},\"type\":\"text_delta\",\"delta\":\"b\"}}",
                    envelope(3, "2026-12-03T13:58:12Z", "00F067AA0BA902B7")
                ),
            ),
            odd(
                4,
                "text_delta",
                format!(
                    "{},\"type\":\"text_delta\",\"delta\":\"c\"}}",
                    envelope(4, "2026-12-03T14:58:12+01:00", "00f067aa0ba902b7")
                ),
            ),
            odd(
                5,
                "text_delta",
                r#"{"type":"text_delta","sequence":5,"delta":"d"}"#.to_owned(),
            ),
            odd(6, "text_delta", "not json".to_owned()),
            // A well-formed one in the same run.
            odd(
                7,
                "run_completed",
                format!(
                    "{},\"type\":\"run_completed\",\"finish_reason\":\"stop\",\"iterations\":1}}",
                    envelope(7, "2026-12-03T13:58:12.500Z", "00f067aa0ba902b7")
                ),
            ),
        ],
    ));
    let verbatim_expected = logs[2].2.len() + 6;
    let compact_expected: usize = logs
        .iter()
        .map(|(_, _, events)| events.len())
        .sum::<usize>()
        - verbatim_expected;

    match backend {
        Backend::Sqlite => {
            let options = sqlx::sqlite::SqliteConnectOptions::from_str(&db.url)
                .unwrap()
                .create_if_missing(true)
                .foreign_keys(true);
            let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
            up_to(sqlx::migrate!("./migrations/sqlite"), 5)
                .run(&pool)
                .await
                .unwrap();
            write_old_logs!(&pool, &logs);
            pool.close().await;
        }
        Backend::Postgres => {
            let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
            up_to(sqlx::migrate!("./migrations/postgres"), 5)
                .run(&pool)
                .await
                .unwrap();
            write_old_logs!(&pool, &logs);
            pool.close().await;
        }
    }

    // Opening the store applies 0006.
    let store = db.store().await;
    for (run_id, _, events) in &logs {
        let read = store.read_events(*run_id, 0, 1000).await.unwrap();
        assert_eq!(read.len(), events.len());
        for (read, written) in read.iter().zip(events) {
            assert_eq!(read.data, written.data, "run {run_id}");
            assert_eq!(read.event_type, written.event_type);
            assert_eq!(read.sequence, written.sequence);
            assert_eq!(read.terminal, written.terminal);
        }
        // Resuming mid-log reads the same bytes.
        let tail = store.read_events(*run_id, 3, 1000).await.unwrap();
        assert_eq!(tail, read[3..]);
    }
    // What the rows hold now.
    let (compact, verbatim): (i64, i64) = match backend {
        Backend::Sqlite => {
            let pool = sqlx::SqlitePool::connect(&db.url).await.unwrap();
            let counts = sqlx::query_as(
                "SELECT COUNT(emitted_at), COUNT(*) - COUNT(emitted_at) FROM events",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            pool.close().await;
            counts
        }
        Backend::Postgres => {
            let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
            let counts = sqlx::query_as(
                "SELECT COUNT(emitted_at), COUNT(*) - COUNT(emitted_at) FROM events",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            pool.close().await;
            counts
        }
    };
    assert_eq!(
        (compact as usize, verbatim as usize),
        (compact_expected, verbatim_expected)
    );
    drop(store);
    db.cleanup().await;
}

/// A failed run's `run_failed` of one of the logs 0007 reads: compact (the default trace) or
/// verbatim (no trace context), with a class or, from an older server, without one.
fn failed_log(
    run_id: RunId,
    session_id: SessionId,
    verbatim: bool,
    class: Option<&str>,
) -> Vec<LoggedEvent> {
    let mut failed = json!({"type": "run_failed", "error": "boom \"quoted\""});
    if let Some(class) = class {
        failed["error_class"] = json!(class);
    }
    let payloads = [
        json!({"type": "run_started", "session_id": session_id, "provider": "fake", "model": "m"}),
        failed,
    ];
    let (trace_id, span_id) = if verbatim {
        (String::new(), String::new())
    } else {
        (run_id.0.simple().to_string(), "00f067aa0ba902b7".to_owned())
    };
    payloads
        .into_iter()
        .enumerate()
        .map(|(index, payload)| {
            let event = AgentEvent {
                sequence: index as u64 + 1,
                run_id,
                timestamp: timestamp(index),
                trace_id: trace_id.clone(),
                span_id: span_id.clone(),
                payload: serde_json::from_value::<EventPayload>(payload).unwrap(),
            };
            LoggedEvent {
                sequence: event.sequence,
                event_type: event.payload.event_type().to_owned(),
                data: serde_json::to_string(&event).unwrap().into(),
                terminal: event.is_terminal(),
            }
        })
        .collect()
}

/// Migration 0007 gives the runs that failed before it their `error_class`, read from their
/// `run_failed` event (compact or verbatim); a run whose event has none keeps none.
async fn failed_runs_get_their_error_class_from_their_log(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let runs = [
        (false, Some("rate_limited")),
        (true, Some("doom_loop")),
        (false, None),
    ];
    let logs: Vec<(RunId, SessionId, Vec<LoggedEvent>)> = runs
        .iter()
        .map(|(verbatim, class)| {
            let (run_id, session_id) = (RunId::new(), SessionId::new());
            (
                run_id,
                session_id,
                failed_log(run_id, session_id, *verbatim, *class),
            )
        })
        .collect();
    match backend {
        Backend::Sqlite => {
            let options = sqlx::sqlite::SqliteConnectOptions::from_str(&db.url)
                .unwrap()
                .create_if_missing(true)
                .foreign_keys(true);
            let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
            up_to(sqlx::migrate!("./migrations/sqlite"), 5)
                .run(&pool)
                .await
                .unwrap();
            write_old_logs!(&pool, &logs);
            sqlx::query("UPDATE runs SET status = 'failed'")
                .execute(&pool)
                .await
                .unwrap();
            pool.close().await;
        }
        Backend::Postgres => {
            let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
            up_to(sqlx::migrate!("./migrations/postgres"), 5)
                .run(&pool)
                .await
                .unwrap();
            write_old_logs!(&pool, &logs);
            sqlx::query("UPDATE runs SET status = 'failed'")
                .execute(&pool)
                .await
                .unwrap();
            pool.close().await;
        }
    }
    // Opening the store applies 0006 and 0007.
    let store = db.store().await;
    for ((run_id, _, _), (_, class)) in logs.iter().zip(runs) {
        let run = store.get_run(*run_id).await.unwrap().unwrap();
        assert_eq!(run.error_class.map(|c| c.as_str()), class, "run {run_id}");
    }
    drop(store);
    db.cleanup().await;
}

on_both_backends!(
    a_0005_log_reads_back_byte_for_byte_after_0006,
    failed_runs_get_their_error_class_from_their_log
);
