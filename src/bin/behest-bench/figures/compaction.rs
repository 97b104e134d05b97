//! Compaction: the time the check before each model call adds — in this process, on behest's
//! own code, for sessions of 10, 100 and 1,000 messages, against building the request alone —
//! and what summarising costs a 200-turn session run through behest against a model with an
//! 8,000-token window (summariser calls, tokens and time against the session's own).

use std::hint::black_box;
use std::time::{Duration, Instant};

use behest::domain::{ContentPart, Message, MessageId, Role, RunId, SessionId, ToolCall};
use behest::provider::ToolSpec;
use behest::runtime::compaction::Conversation;
use behest::runtime::tokens::Tokenizer;
use behest::store::{Calibration, SessionContext};
use serde_json::{Value, json};

use super::{Ctx, MODEL_COMPACT, tag};
use crate::Result;
use crate::check::StreamCheck;
use crate::report::{Compare, Dist, Row, Target, ms};

/// The model the check is timed for (a real tokenizer: `o200k_base`).
const CHECK_MODEL: &str = "gpt-4o-mini";

/// The session sizes the check is timed at, in messages.
const SIZES: [usize; 3] = [10, 100, 1_000];

/// Message `n` of a session of tool-using turns: a user input, a tool call, its result, an
/// answer (some 30 to 150 tokens each).
fn message(n: usize, session_id: SessionId, run_id: RunId) -> Message {
    let (role, text, calls, call_id) = match n % 4 {
        0 => (
            Role::User,
            format!(
                "Request {n}: please look up the shipping status of order {n} and tell me \
                 whether it will arrive before Friday, and what the carrier said."
            ),
            Vec::new(),
            None,
        ),
        1 => (
            Role::Assistant,
            String::new(),
            vec![ToolCall {
                id: format!("call_{n}"),
                name: "lookup_order".to_owned(),
                arguments: json!({"order_id": n, "fields": ["status", "carrier", "eta"]}),
                invalid_arguments: None,
            }],
            None,
        ),
        2 => (
            Role::Tool,
            json!({"order_id": n, "status": "in transit", "carrier": "Parcelio",
                   "eta": "2026-12-04", "events": (0..8).map(|k| format!("scan {k} at hub {}", n + k)).collect::<Vec<_>>()})
            .to_string(),
            Vec::new(),
            Some(format!("call_{}", n - 1)),
        ),
        _ => (
            Role::Assistant,
            format!(
                "Order {} is in transit with Parcelio; its estimated arrival is December 4th, \
                 so it should arrive before Friday. The last scan was at hub {}.",
                n - 3,
                n + 4
            ),
            Vec::new(),
            None,
        ),
    };
    Message {
        id: MessageId::new(),
        session_id,
        run_id,
        role,
        content: if text.is_empty() {
            Vec::new()
        } else {
            vec![ContentPart::Text { text }]
        },
        reasoning: Vec::new(),
        tool_calls: calls,
        tool_call_id: call_id,
        tool_name: (role == Role::Tool).then(|| "lookup_order".to_owned()),
        status: Default::default(),
        created_at: chrono::Utc::now(),
    }
}

fn tools() -> Vec<ToolSpec> {
    ["lookup_order", "cancel_order", "contact_carrier"]
        .iter()
        .map(|name| ToolSpec {
            name: (*name).to_owned(),
            description: format!("{name}: acts on one order by its id."),
            parameters: json!({"type": "object", "properties": {"order_id": {"type": "integer"},
                "fields": {"type": "array", "items": {"type": "string"}}}, "required": ["order_id"]}),
        })
        .collect()
}

fn context(messages: Vec<Message>) -> SessionContext {
    SessionContext {
        compaction: None,
        messages,
        calibration: Some(Calibration {
            reported_tokens: 1_100,
            counted_tokens: 1_000,
        }),
    }
}

/// Per model call at each size: the request built as before compaction existed (the history
/// cloned) against the same with the check (the request's size measured, a new message counted
/// once, the request built from the conversation). Each sample is one call at that size: the
/// conversation holds `size − 1` messages already counted (by earlier calls of the run), and the
/// call adds one new message.
pub(super) fn check(ctx: &Ctx) -> Vec<Row> {
    Tokenizer::O200k.warm_up();
    let samples = if ctx.plan.smoke { 20 } else { 300 };
    let tools = tools();
    let session_id = SessionId::new();
    let run_id = RunId::new();
    let mut rows = Vec::new();
    for size in SIZES {
        let history: Vec<Message> = (0..size - 1)
            .map(|n| message(n, session_id, run_id))
            .collect();
        let mut baseline = Dist::default();
        let mut with_check = Dist::default();
        for sample in 0..samples {
            let new = message(size - 1 + sample * 4, session_id, run_id);
            // Before: the history cloned into the request.
            let mut messages = history.clone();
            messages.push(new.clone());
            let started = Instant::now();
            black_box(messages.clone());
            baseline.push(ms(started.elapsed()));
            // With the check: a conversation whose earlier messages this run counted already.
            let mut conversation = Conversation::new(context(history.clone()), CHECK_MODEL);
            conversation.measure(&tools);
            conversation.push(new);
            let started = Instant::now();
            black_box(conversation.measure(&tools));
            black_box(conversation.request_messages());
            with_check.push(ms(started.elapsed()));
        }
        // The target: under 1 ms at 1,000 messages, for the typical call (p50); the p99
        // also holds whatever preempted the bench on a shared machine.
        let target = (size == 1_000).then_some(Target::AtMost(1.0));
        for (p, name) in [(50.0, "p50"), (99.0, "p99")] {
            let mut row = Row::new(
                &format!("compaction check per model call, {size} messages, {name}"),
                "ms",
                Some(baseline.p(p)),
                with_check.p(p),
                Compare::Difference,
            )
            .samples(samples);
            if let (Some(target), 50.0) = (target, p) {
                row = row.target(target);
            }
            if p == 50.0 {
                row = row.note(format!(
                    "in process ({CHECK_MODEL}, o200k_base): baseline = the request's messages \
                     cloned, as before compaction; behest = the same plus measuring the request \
                     and counting its new message"
                ));
            }
            rows.push(row);
        }
    }
    // The first call of a run: its conversation counts every message once, from the
    // process-wide cache (another run of the session counted them) or with the tokenizer
    // (nothing counted yet: the first run after a restart).
    let history: Vec<Message> = (0..1_000).map(|n| message(n, session_id, run_id)).collect();
    // An earlier run of the session counted them.
    Conversation::new(context(history.clone()), CHECK_MODEL).measure(&tools);
    let mut warm = Dist::default();
    let mut cold = Dist::default();
    for _ in 0..if ctx.plan.smoke { 1 } else { 30 } {
        let mut conversation = Conversation::new(context(history.clone()), CHECK_MODEL);
        let started = Instant::now();
        black_box(conversation.measure(&tools));
        warm.push(ms(started.elapsed()));
        let fresh: Vec<Message> = history
            .iter()
            .map(|m| Message {
                id: MessageId::new(),
                ..m.clone()
            })
            .collect();
        let mut conversation = Conversation::new(context(fresh), CHECK_MODEL);
        let started = Instant::now();
        black_box(conversation.measure(&tools));
        cold.push(ms(started.elapsed()));
    }
    rows.push(
        Row::new(
            "compaction check, first call of a run, 1,000 messages counted before p50",
            "ms",
            None,
            warm.p(50.0),
            Compare::None,
        )
        .samples(warm.len())
        .note(
            "the process-wide cache holds their counts (another run of the session counted them)",
        ),
    );
    rows.push(
        Row::new(
            "compaction check, first call after a restart, 1,000 messages p50",
            "ms",
            None,
            cold.p(50.0),
            Compare::None,
        )
        .samples(cold.len())
        .note("nothing counted yet: every message tokenized; once per session and process"),
    );
    rows
}

/// What one run of the session showed.
struct Turn {
    /// From sending the request to the terminal event.
    duration: Duration,
    /// Its `context_compacted` events (the summariser's usage and time).
    compactions: Vec<Value>,
    /// Tokens of its own model calls (`usage_recorded`).
    model_tokens: u64,
}

/// `POST /runs/stream` in `session` (a new one when `None`), read to the end through the hard
/// check.
async fn turn(ctx: &Ctx, session: Option<&str>, input: &str) -> Result<(String, Turn)> {
    let (sent_at, mut reader) = ctx.stream_turn(MODEL_COMPACT, input, session).await?;
    let mut check = StreamCheck::new(0);
    let mut compactions = Vec::new();
    let mut model_tokens = 0;
    let mut session_id = session.map(str::to_owned);
    let mut end = sent_at;
    while let Some(frame) = reader.next().await? {
        check.push(&frame);
        end = frame.at;
        let data: Value = serde_json::from_str(&frame.data).unwrap_or(Value::Null);
        match frame.event.as_str() {
            "run_started" => session_id = data["session_id"].as_str().map(str::to_owned),
            "context_compacted" => compactions.push(data),
            "usage_recorded" => {
                model_tokens += data["usage"]["total_tokens"].as_u64().unwrap_or(0);
            }
            _ => {}
        }
    }
    let tokens = ctx.plan.profile.tokens;
    ctx.checks.stream(
        &format!("compaction turn in {session_id:?}"),
        &check.finish(Some("run_completed"), Some(tokens)),
    );
    let session_id =
        session_id.ok_or_else(|| crate::BenchError("a run without run_started".to_owned()))?;
    Ok((
        session_id,
        Turn {
            duration: end.duration_since(sent_at),
            compactions,
            model_tokens,
        },
    ))
}

/// A 200-turn session (each input some 250 tokens, each answer the default profile's token
/// count without pacing) against `MODEL_COMPACT` (8,000-token window, `[compaction]` of the
/// bench's config): how often it compacts, the summariser's tokens against the model calls'
/// own, the summariser's time against the session's, and the added time of a turn that
/// compacts against one that does not.
pub(super) async fn session_cost(ctx: &Ctx) -> Result<Vec<Row>> {
    let turns = if ctx.plan.smoke { 40 } else { 200 };
    let filler = "The customer also mentioned their previous orders, the delivery address, the \
                  preferred time window and a note for the courier about the side entrance. "
        .repeat(6);
    let mut session: Option<String> = None;
    let mut all = Vec::with_capacity(turns);
    let started = Instant::now();
    for n in 1..=turns {
        let input = format!("{} turn {n}: {filler}", tag("compaction"));
        let (id, turn) = turn(ctx, session.as_deref(), &input).await?;
        session = Some(id);
        all.push(turn);
    }
    let wall = started.elapsed();
    let compactions: Vec<&Value> = all.iter().flat_map(|t| t.compactions.iter()).collect();
    if compactions.is_empty() {
        bail!("the {turns}-turn session never compacted");
    }
    let summariser_tokens: u64 = compactions
        .iter()
        .map(|c| c["usage"]["total_tokens"].as_u64().unwrap_or(0))
        .sum();
    let summariser_ms: u64 = compactions
        .iter()
        .map(|c| c["duration_ms"].as_u64().unwrap_or(0))
        .sum();
    let model_tokens: u64 = all.iter().map(|t| t.model_tokens).sum();
    let mut plain = Dist::default();
    let mut compacting = Dist::default();
    for turn in &all {
        if turn.compactions.is_empty() {
            plain.push(ms(turn.duration));
        } else {
            compacting.push(ms(turn.duration));
        }
    }
    let messages_summarised: u64 = compactions
        .iter()
        .map(|c| c["messages_summarised"].as_u64().unwrap_or(0))
        .sum();
    Ok(vec![
        Row::new(
            &format!("{turns}-turn session: compactions"),
            "count",
            None,
            compactions.len() as f64,
            Compare::None,
        )
        .samples(turns)
        .note(format!(
            "{messages_summarised} messages summarised in all; an 8,000-token window, \
             buffer_tokens 1000, keep_tokens 2000, tail_turns 2"
        )),
        Row::new(
            &format!("{turns}-turn session: summariser tokens / model calls' tokens"),
            "tokens",
            Some(model_tokens as f64),
            summariser_tokens as f64,
            Compare::Ratio,
        )
        .samples(compactions.len())
        .note("baseline: the tokens of the session's own model calls; behest: the summariser's"),
        Row::new(
            &format!("{turns}-turn session: summariser time / session time"),
            "ms",
            Some(ms(wall)),
            summariser_ms as f64,
            Compare::Ratio,
        )
        .samples(compactions.len())
        .note(
            "the fake summariser answers at once (no pacing): this is behest's side of it; a \
             real summariser adds its own generation time",
        ),
        Row::new(
            "turn that compacts vs one that does not p50",
            "ms",
            Some(plain.p(50.0)),
            compacting.p(50.0),
            Compare::Difference,
        )
        .samples(compacting.len()),
    ])
}
