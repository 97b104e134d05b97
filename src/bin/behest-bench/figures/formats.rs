//! Each rendering of the log (`?format=ai-sdk`, `ai-sdk-v7`, `ag-ui`) against behest's own
//! format, in the same run:
//!
//! - **CPU per event replayed**: watchers replay one finished run in each format in turn, and
//!   behest's CPU time over the replay is divided by the events served.
//! - **Live fan-out**: one gated run of [`MODEL_FANOUT`](super::MODEL_FANOUT) per format,
//!   watched live by `fanout_watchers` watchers in that format: text deltas per second
//!   delivered from the gate's opening to the last, their delivery lag, and behest's CPU per
//!   delta delivered.
//!   Every watcher's stream goes through the format's hard check, and must equal a replay of
//!   the finished run in the same format.

use std::time::Instant;

use futures::future::try_join_all;

use super::fanout::{delivery, gated_run, lags};
use super::{Ctx, MODEL_FAST, tag};
use crate::Result;
use crate::check::{Projected, ProjectedCheck, StreamCheck, StreamSummary};
use crate::report::{Compare, Dist, Row};
use crate::sse::SseReader;
use crate::target::cpu_seconds;

/// The formats measured, behest's own first (the baseline).
const FORMATS: [&str; 4] = ["behest", "ai-sdk", "ai-sdk-v7", "ag-ui"];

pub(super) async fn formats(ctx: &Ctx) -> Result<Vec<Row>> {
    let mut rows = replay_cpu(ctx).await?;
    rows.extend(live(ctx).await?);
    Ok(rows)
}

async fn replay_cpu(ctx: &Ctx) -> Result<Vec<Row>> {
    let (_, run_id, mut reader) = ctx.stream_run(MODEL_FAST, &tag("formats")).await?;
    let mut events = 0_u64;
    while reader.next().await?.is_some() {
        events += 1;
    }
    let watchers = if ctx.plan.smoke { 4 } else { 200 };
    // Enough rounds that behest's CPU over a format's replays is about a second (the kernel
    // counts it in 10 ms ticks); the formats in order, then in reverse, so that a drift of the
    // machine falls on all of them.
    let rounds = if ctx.plan.smoke { 1 } else { 10 };
    let mut cpu = [0.0_f64; FORMATS.len()];
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..FORMATS.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for index in order {
            cpu[index] += replay(ctx, &run_id, FORMATS[index], watchers).await?;
        }
    }
    // µs of behest CPU per event per watcher.
    let served = events as f64 * f64::from(watchers) * f64::from(rounds);
    let per_event: Vec<f64> = cpu.iter().map(|cpu| cpu * 1e6 / served).collect();
    let baseline = per_event[0];
    Ok(FORMATS
        .iter()
        .zip(&per_event)
        .skip(1)
        .map(|(format, value)| {
            Row::new(
                &format!("CPU per event replayed, ?format={format} ÷ behest's format"),
                "µs",
                Some(baseline),
                *value,
                Compare::Ratio,
            )
            .samples(usize::try_from(events).unwrap_or(usize::MAX) * (watchers * rounds) as usize)
            .note(format!(
                "{watchers} watchers replay a {events}-event run in each format in turn, \
                 {rounds} rounds; the issue's target is a ratio of at most 1.10"
            ))
        })
        .collect())
}

/// behest's CPU seconds while `watchers` watchers replay run `run_id` in `format` at once.
async fn replay(ctx: &Ctx, run_id: &str, format: &str, watchers: u32) -> Result<f64> {
    let before = cpu_seconds(ctx.behest_pid)?;
    let replays = (0..watchers).map(|_| {
        let url = ctx.url(&format!("/runs/{run_id}/events?format={format}"));
        let request = ctx.keyed(ctx.client.get(url));
        async move {
            let response = request.send().await?;
            if !response.status().is_success() {
                bail!("GET events?format={format} answered {}", response.status());
            }
            Ok(response.bytes().await?.len())
        }
    });
    let bytes: usize = try_join_all(replays).await?.into_iter().sum();
    if bytes == 0 {
        ctx.checks
            .fail(format!("format {format}: nothing replayed"));
    }
    Ok(cpu_seconds(ctx.behest_pid)? - before)
}

/// A watcher's stream in `format` read to its end from the run's start, through the format's
/// hard check (behest's: a completed run; `tokens` text deltas when given): when each text
/// delta arrived, and the summary.
pub(super) async fn read_checked(
    mut reader: SseReader,
    format: &str,
    tokens: Option<u32>,
) -> Result<(Vec<Instant>, StreamSummary)> {
    let mut deltas = Vec::with_capacity(tokens.unwrap_or(0) as usize);
    let summary = match projected(format) {
        None => {
            let mut check = StreamCheck::new(0);
            while let Some(frame) = reader.next().await? {
                check.push(&frame);
                if frame.event == "text_delta" {
                    deltas.push(frame.at);
                }
            }
            check.finish(Some("run_completed"), tokens)
        }
        Some(projected) => {
            let mut check = ProjectedCheck::new(projected);
            while let Some(frame) = reader.next().await? {
                if check.push(&frame) {
                    deltas.push(frame.at);
                }
            }
            check.finish(tokens)
        }
    };
    Ok((deltas, summary))
}

/// How `format` (of [`FORMATS`]) renders text and ends; `None` for behest's own.
fn projected(format: &str) -> Option<Projected> {
    match format {
        "ag-ui" => Some(Projected::AG_UI),
        "behest" => None,
        _ => Some(Projected::AI_SDK),
    }
}

/// What the live fan-out of one format gave over its rounds.
#[derive(Default)]
struct Live {
    /// Text deltas per second, one per round.
    rates: Vec<f64>,
    /// Text deltas delivered.
    delivered: usize,
    lag: Dist,
    /// behest's CPU seconds over the rounds.
    cpu: f64,
}

/// The live fan-out: one gated run per format and round, watched by many watchers in it.
async fn live(ctx: &Ctx) -> Result<Vec<Row>> {
    let watchers = ctx.plan.fanout_watchers;
    let tokens = ctx.plan.fanout_tokens;
    let mut live: Vec<Live> = FORMATS.iter().map(|_| Live::default()).collect();
    // Forward, then backward: a machine that speeds up or slows down favours no format.
    let rounds = if ctx.plan.smoke { 1 } else { 2 };
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..FORMATS.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for index in order {
            let format = FORMATS[index];
            let before = cpu_seconds(ctx.behest_pid)?;
            let run = gated_run(
                ctx,
                &format!("formats-live {format}"),
                watchers,
                |_, run_id| {
                    let run_id = run_id.to_owned();
                    async move { ctx.watch_as(&run_id, format).await }
                },
                |_, _, reader| read_checked(reader, format, Some(tokens)),
            )
            .await?;
            let cpu = cpu_seconds(ctx.behest_pid)? - before;
            let run_id = &run.run_id;
            let replay = ctx.watch_as(run_id, format).await?;
            let (_, replay) = read_checked(replay, format, Some(tokens)).await?;
            ctx.checks
                .stream(&format!("replay of {run_id} ?format={format}"), &replay);
            let sent = ctx.sent(&run.tag);
            let figures = &mut live[index];
            let mut deltas = Vec::with_capacity(run.watched.len());
            for (i, (arrivals, summary)) in run.watched.into_iter().enumerate() {
                let label = format!("run {run_id} ?format={format} watcher {i}");
                ctx.checks.stream(&label, &summary);
                if summary.hash != replay.hash {
                    ctx.checks
                        .fail(format!("{label}: the live stream differs from the replay"));
                }
                lags(&mut figures.lag, &arrivals, &sent);
                deltas.push(arrivals);
            }
            let (rate, count) = delivery(run.open, &deltas);
            figures.rates.push(rate);
            figures.delivered += count;
            figures.cpu += cpu;
        }
    }
    let offered = watchers as f64 / ctx.plan.fanout_interval.as_secs_f64().max(1e-3);
    let mean = |rates: &[f64]| rates.iter().sum::<f64>() / rates.len().max(1) as f64;
    let cpu_per_delta = |live: &Live| live.cpu * 1e6 / live.delivered.max(1) as f64;
    let base = &live[0];
    let mut rows = Vec::new();
    for (format, figures) in FORMATS.iter().zip(&live).skip(1) {
        let rates = |live: &Live| {
            live.rates
                .iter()
                .map(|rate| format!("{rate:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        rows.push(
            Row::new(
                &format!(
                    "text deltas/s delivered live to {watchers} watchers of one run, \
                     ?format={format} ÷ behest's format"
                ),
                "events/s",
                Some(mean(&base.rates)),
                mean(&figures.rates),
                Compare::Ratio,
            )
            .samples(figures.delivered)
            .note(format!(
                "tokens every {} ms: ≈{offered:.0} text deltas/s offered; mean of {rounds} \
                 rounds (behest: {}; {format}: {}); the issue's target is the same events/s",
                ctx.plan.fanout_interval.as_millis(),
                rates(base),
                rates(figures)
            )),
        );
        rows.push(
            Row::new(
                &format!(
                    "delivery lag p99 live to {watchers} watchers, ?format={format} − behest's \
                     format"
                ),
                "ms",
                Some(base.lag.p(99.0)),
                figures.lag.p(99.0),
                Compare::Difference,
            )
            .samples(figures.lag.len())
            .note("provider writes token k → watcher reads its text delta"),
        );
        rows.push(
            Row::new(
                &format!("CPU per text delta delivered live, ?format={format} ÷ behest's format"),
                "µs",
                Some(cpu_per_delta(base)),
                cpu_per_delta(figures),
                Compare::Ratio,
            )
            .samples(figures.delivered)
            .note(
                "behest's CPU over each round (the watchers' connections included) ÷ the text \
                 deltas delivered",
            ),
        );
    }
    Ok(rows)
}
