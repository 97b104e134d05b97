//! Events per second to many watchers of a few runs, and their delivery lag.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use super::{CONNECT_CONCURRENCY, Ctx, MODEL_FANOUT, tag, wait_count};
use crate::check::{DirectCheck, StreamCheck, StreamSummary};
use crate::report::{Compare, Dist, Row, Target, ms};
use crate::sse::SseReader;
use crate::{BenchError, Result};

/// What one fan-out watcher saw.
struct Watched {
    run: usize,
    frames: Vec<Instant>,
    tokens: Vec<Instant>,
    summary: StreamSummary,
}

/// Frames delivered per second after `open`, and how many.
pub(super) fn delivery(open: Instant, frames: &[Vec<Instant>]) -> (f64, usize) {
    let mut count = 0;
    let mut last = open;
    for watcher in frames {
        for &at in watcher {
            if at >= open {
                count += 1;
                last = last.max(at);
            }
        }
    }
    let seconds = last.duration_since(open).as_secs_f64().max(1e-3);
    (count as f64 / seconds, count)
}

/// One run of [`MODEL_FANOUT`] watched live by many watchers.
pub(super) struct GatedRun<T> {
    /// The run's tag (its input, the provider exchange's key).
    pub tag: String,
    /// The run.
    pub run_id: String,
    /// When the provider's gate opened.
    pub open: Instant,
    /// What each watcher's follower returned, in order.
    pub watched: Vec<T>,
}

/// A run of [`MODEL_FANOUT`] created through `on` (tagged `phase`), held at the provider's
/// gate while `watchers` watchers connect (`attach(i, run_id)`, one after the other), then let
/// go; each watcher read to its end on a task of its own by `follow(i, run_id, reader)`.
pub(super) async fn gated_run<T, A, AF, F, FF>(
    on: &Ctx,
    phase: &str,
    watchers: usize,
    mut attach: A,
    follow: F,
) -> Result<GatedRun<T>>
where
    A: FnMut(usize, &str) -> AF,
    AF: Future<Output = Result<SseReader>>,
    F: Fn(usize, &str, SseReader) -> FF,
    FF: Future<Output = Result<T>> + Send + 'static,
    T: Send + 'static,
{
    let (run_tag, run_id) = on.create_held_run(MODEL_FANOUT, phase).await?;
    let mut readers = Vec::with_capacity(watchers);
    for i in 0..watchers {
        readers.push(attach(i, &run_id).await?);
    }
    let open = Instant::now();
    on.fake.open_gate(MODEL_FANOUT);
    let tasks: Vec<_> = readers
        .into_iter()
        .enumerate()
        .map(|(i, reader)| tokio::spawn(follow(i, &run_id, reader)))
        .collect();
    let mut watched = Vec::with_capacity(tasks.len());
    for task in tasks {
        watched.push(task.await??);
    }
    on.fake.close_gate(MODEL_FANOUT);
    Ok(GatedRun {
        tag: run_tag,
        run_id,
        open,
        watched,
    })
}

/// Adds to `lag` each delivery lag: token k written by the provider (`sent[k]`) → read by a
/// watcher (`arrivals[k]`).
pub(super) fn lags(lag: &mut Dist, arrivals: &[Instant], sent: &[Instant]) {
    for (arrived, written) in arrivals.iter().zip(sent) {
        lag.push(ms(arrived.saturating_duration_since(*written)));
    }
}

pub(super) async fn fanout(ctx: &Ctx) -> Result<Vec<Row>> {
    let plan = &ctx.plan;
    let watchers = plan.fanout_watchers;
    let runs = plan.fanout_runs.max(1);
    let tokens = plan.fanout_tokens;

    // Baseline: every watcher is its own request to the fake provider.
    let ready = Arc::new(AtomicUsize::new(0));
    let permits = Arc::new(Semaphore::new(CONNECT_CONCURRENCY));
    let tasks: Vec<_> = (0..watchers)
        .map(|_| {
            let ctx = ctx.clone();
            let ready = ready.clone();
            let permits = permits.clone();
            tokio::spawn(async move {
                let tag = tag("fanout-direct");
                let permit = permits.acquire_owned().await;
                let (_, mut reader) = ctx.direct(MODEL_FANOUT, &tag).await?;
                drop(permit);
                ready.fetch_add(1, Ordering::AcqRel);
                let mut check = DirectCheck::default();
                let mut frames = Vec::with_capacity(tokens as usize + 4);
                let mut arrivals = Vec::with_capacity(tokens as usize);
                while let Some(frame) = reader.next().await? {
                    frames.push(frame.at);
                    if check.push(&frame) {
                        arrivals.push(frame.at);
                    }
                }
                ctx.checks
                    .stream(&format!("direct fan-out {tag}"), &check.finish(tokens));
                Ok::<_, BenchError>((tag, frames, arrivals))
            })
        })
        .collect();
    wait_count(&ready, watchers, Duration::from_secs(120), "direct fan-out").await?;
    let open = Instant::now();
    ctx.fake.open_gate(MODEL_FANOUT);
    let mut base_frames = Vec::new();
    let mut base_lag = Dist::default();
    for task in tasks {
        let (tag, frames, arrivals) = task.await??;
        lags(&mut base_lag, &arrivals, &ctx.sent(&tag));
        base_frames.push(frames);
    }
    ctx.fake.close_gate(MODEL_FANOUT);
    let (base_rate, _) = delivery(open, &base_frames);
    drop(base_frames);

    // behest: `runs` runs, each watched by watchers / runs clients.
    let mut run_ids = Vec::new();
    let mut tags = Vec::new();
    for _ in 0..runs {
        let run_tag = tag("fanout");
        run_ids.push(ctx.create_run(MODEL_FANOUT, &run_tag).await?);
        tags.push(run_tag);
    }
    let run_ids = Arc::new(run_ids);
    let ready = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..watchers)
        .map(|w| {
            let ctx = ctx.clone();
            let ready = ready.clone();
            let permits = permits.clone();
            let run_ids = run_ids.clone();
            tokio::spawn(async move {
                let run = w % run_ids.len();
                let permit = permits.acquire_owned().await;
                let mut reader = ctx.watch(&run_ids[run], None).await?;
                let mut permit = Some(permit);
                let mut check = StreamCheck::new(0);
                let mut frames = Vec::with_capacity(tokens as usize + 8);
                let mut arrivals = Vec::with_capacity(tokens as usize);
                while let Some(frame) = reader.next().await? {
                    check.push(&frame);
                    frames.push(frame.at);
                    if frame.event == "text_delta" {
                        arrivals.push(frame.at);
                    }
                    if frame.event == "model_started" && permit.take().is_some() {
                        ready.fetch_add(1, Ordering::AcqRel);
                    }
                }
                let summary = check.finish(Some("run_completed"), Some(tokens));
                Ok::<_, BenchError>(Watched {
                    run,
                    frames,
                    tokens: arrivals,
                    summary,
                })
            })
        })
        .collect();
    wait_count(
        &ready,
        watchers,
        Duration::from_secs(300),
        "behest fan-out watchers",
    )
    .await?;
    let open = Instant::now();
    ctx.fake.open_gate(MODEL_FANOUT);
    let mut watched = Vec::new();
    for task in tasks {
        watched.push(task.await??);
    }
    ctx.fake.close_gate(MODEL_FANOUT);
    let sent: Vec<Vec<Instant>> = tags.iter().map(|t| ctx.sent(t)).collect();
    let mut lag = Dist::default();
    let mut hashes: Vec<Option<u64>> = vec![None; runs];
    for watcher in &watched {
        ctx.checks.stream(
            &format!("fan-out watcher of {}", run_ids[watcher.run]),
            &watcher.summary,
        );
        lags(&mut lag, &watcher.tokens, &sent[watcher.run]);
        match hashes[watcher.run] {
            None => hashes[watcher.run] = Some(watcher.summary.hash),
            Some(hash) if hash != watcher.summary.hash => ctx.checks.fail(format!(
                "watchers of run {} received different events",
                run_ids[watcher.run]
            )),
            Some(_) => {}
        }
    }
    // What the store replays must be what the watchers saw live.
    for (run, run_id) in run_ids.iter().enumerate() {
        let mut reader = ctx.watch(run_id, None).await?;
        let mut check = StreamCheck::new(0);
        while let Some(frame) = reader.next().await? {
            check.push(&frame);
        }
        let summary = check.finish(Some("run_completed"), Some(tokens));
        if hashes[run].is_some_and(|hash| hash != summary.hash) {
            ctx.checks.fail(format!(
                "run {run_id}: the replay differs from the live stream"
            ));
        }
        ctx.checks.stream(&format!("replay of {run_id}"), &summary);
    }
    let frames: Vec<Vec<Instant>> = watched.into_iter().map(|w| w.frames).collect();
    let (rate, count) = delivery(open, &frames);
    // Every watcher gets one token event per interval.
    let offered = watchers as f64 / plan.fanout_interval.as_secs_f64().max(1e-3);
    let label = format!("{watchers} watchers of {runs} runs");
    Ok(vec![
        Row::new(
            &format!("events/s delivered ({label})"),
            "events/s",
            Some(base_rate),
            rate,
            Compare::Ratio,
        )
        .target_absolute(Target::AtLeast(100_000.0))
        .samples(count)
        .note(format!(
            "tokens every {} ms per run: ≈{offered:.0} token events/s offered; baseline: {watchers} \
             direct streams from the fake provider",
            plan.fanout_interval.as_millis()
        )),
        Row::new(
            &format!("delivery lag p50 ({label})"),
            "ms",
            Some(base_lag.p(50.0)),
            lag.p(50.0),
            Compare::Difference,
        )
        .samples(lag.len())
        .note("provider writes token k → watcher reads it"),
        Row::new(
            &format!("delivery lag p99 ({label})"),
            "ms",
            Some(base_lag.p(99.0)),
            lag.p(99.0),
            Compare::Difference,
        )
        .target_absolute(Target::AtMost(50.0))
        .samples(lag.len()),
    ])
}
