//! Long sessions: the start of a run must not grow with its session's length. One session of
//! many turns against a fast model (no pacing, 40 tokens per answer); each turn timed from
//! sending `POST /runs/stream` to reading its `model_started`, i.e. admission, loading the
//! session, building the context and the compaction check. The first turns are the baseline,
//! the last ones (1,000 turns in: 2,000 stored messages) the figure.

use super::{Ctx, MODEL_LONG, tag};
use crate::check::StreamCheck;
use crate::report::{Compare, Dist, Row, Target, ms};
use crate::{BenchError, Result};

/// Turns timed at each end of the session.
const SAMPLES: usize = 25;

/// Tokens of each answer of [`MODEL_LONG`].
pub(super) const LONG_TOKENS: u32 = 40;

/// One turn in `session` (a new one when `None`): the session's id and request → `model_started`.
async fn turn(ctx: &Ctx, session: Option<&str>, n: usize) -> Result<(String, f64)> {
    let input = format!("{} turn {n}: what comes next?", tag("long-session"));
    let (sent_at, mut reader) = ctx.stream_turn(MODEL_LONG, &input, session).await?;
    let mut check = StreamCheck::new(0);
    let mut session_id = session.map(str::to_owned);
    let mut started = None;
    while let Some(frame) = reader.next().await? {
        check.push(&frame);
        match frame.event.as_str() {
            "run_started" => {
                let data: serde_json::Value = serde_json::from_str(&frame.data).unwrap_or_default();
                session_id = data["session_id"].as_str().map(str::to_owned);
            }
            "model_started" if started.is_none() => {
                started = Some(ms(frame.at.duration_since(sent_at)));
            }
            _ => {}
        }
    }
    ctx.checks.stream(
        &format!("long session turn {n}"),
        &check.finish(Some("run_completed"), Some(LONG_TOKENS)),
    );
    let session_id =
        session_id.ok_or_else(|| BenchError("a run without run_started".to_owned()))?;
    let started = started.ok_or_else(|| BenchError("a run without model_started".to_owned()))?;
    Ok((session_id, started))
}

/// Request → `model_started` at the session's first turns against its last ones.
pub(super) async fn long_session(ctx: &Ctx) -> Result<Vec<Row>> {
    let turns = if ctx.plan.smoke { 30 } else { 1_000 };
    let mut session: Option<String> = None;
    let (mut first, mut last) = (Dist::default(), Dist::default());
    for n in 1..=turns {
        let (id, started) = turn(ctx, session.as_deref(), n).await?;
        session = Some(id);
        if n <= SAMPLES {
            first.push(started);
        } else if n > turns - SAMPLES {
            last.push(started);
        }
    }
    let target = (!ctx.plan.smoke).then_some(Target::AtMost(2.0));
    let mut row = Row::new(
        &format!("request → model_started at turn {turns} p50"),
        "ms",
        Some(first.p(50.0)),
        last.p(50.0),
        Compare::Difference,
    )
    .samples(last.len())
    .note(format!(
        "one session, {LONG_TOKENS}-token answers without pacing; baseline: turns 1–{SAMPLES}; \
         behest: the last {SAMPLES} turns ({} stored messages before each)",
        2 * (turns - 1)
    ));
    if let Some(target) = target {
        row = row.target(target);
    }
    Ok(vec![row])
}
