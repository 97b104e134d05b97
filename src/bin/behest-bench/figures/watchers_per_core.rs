//! Watchers per core at one event per second each: the CPU time behest spends keeping many
//! watchers of slow runs fed, against a bare axum/hyper SSE server (the fake provider as its
//! own process) streaming one chunk per second to as many clients.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::sync::Semaphore;

use super::idle_memory::fake_provider_process;
use super::{CONNECT_CONCURRENCY, Ctx, MODEL_PER_CORE, tag, wait_count};
use crate::check::StreamCheck;
use crate::report::{Compare, Dist, Row, ms};
use crate::target::cpu_seconds;
use crate::{BenchError, Result};

/// The tokens of the slow runs are one second apart: one event per second per watcher.
pub const PER_CORE_INTERVAL: Duration = Duration::from_secs(1);

/// What one watcher saw: its run, and when each token arrived.
struct Watched {
    run: usize,
    tokens: Vec<Instant>,
}

pub(super) async fn watchers_per_core(ctx: &Ctx) -> Result<Vec<Row>> {
    let plan = &ctx.plan;
    let watchers = plan.per_core_watchers;
    let window = plan.per_core_window;
    let (base_cores, base_rate) = direct(ctx, watchers, window).await?;

    let mut run_ids = Vec::new();
    let mut tags = Vec::new();
    for _ in 0..plan.per_core_runs.max(1) {
        let run_tag = tag("per-core");
        run_ids.push(ctx.create_run(MODEL_PER_CORE, &run_tag).await?);
        tags.push(run_tag);
    }
    let run_ids = Arc::new(run_ids);
    let ready = Arc::new(AtomicUsize::new(0));
    let permits = Arc::new(Semaphore::new(CONNECT_CONCURRENCY));
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
                let mut tokens = Vec::new();
                while let Some(frame) = reader.next().await? {
                    check.push(&frame);
                    if frame.event == "text_delta" {
                        tokens.push(frame.at);
                    }
                    if frame.event == "model_started" && permit.take().is_some() {
                        ready.fetch_add(1, Ordering::AcqRel);
                    }
                }
                ctx.checks.stream(
                    &format!("slow-run watcher of {}", run_ids[run]),
                    &check.finish(Some("run_cancelled"), None),
                );
                Ok::<_, BenchError>(Watched { run, tokens })
            })
        })
        .collect();
    let connected = wait_count(
        &ready,
        watchers,
        Duration::from_secs(300),
        "slow-run watchers",
    )
    .await;
    ctx.fake.open_gate(MODEL_PER_CORE);
    // The first token's burst of connections settling is not the steady state.
    tokio::time::sleep(PER_CORE_INTERVAL / 2).await;
    let (cpu_before, from) = (cpu_seconds(ctx.behest_pid)?, Instant::now());
    tokio::time::sleep(window).await;
    let (cpu_after, to) = (cpu_seconds(ctx.behest_pid)?, Instant::now());
    for run_id in run_ids.iter() {
        ctx.cancel(run_id).await?;
    }
    ctx.fake.close_gate(MODEL_PER_CORE);
    let mut watched = Vec::new();
    for task in tasks {
        watched.push(task.await??);
    }
    connected?;
    let sent: Vec<Vec<Instant>> = tags.iter().map(|t| ctx.sent(t)).collect();
    let mut lag = Dist::default();
    let mut delivered = 0;
    for watcher in &watched {
        for (arrived, written) in watcher.tokens.iter().zip(&sent[watcher.run]) {
            lag.push(ms(arrived.saturating_duration_since(*written)));
        }
        delivered += watcher
            .tokens
            .iter()
            .filter(|&&at| at >= from && at < to)
            .count();
    }
    let seconds = to.duration_since(from).as_secs_f64();
    let cores = (cpu_after - cpu_before) / seconds;
    let rate = delivered as f64 / seconds;
    let label = format!("{watchers} watchers at 1 event/s");
    Ok(vec![
        Row::new(
            &format!("watchers per core ({label})"),
            "watchers",
            Some(per_core(watchers, base_cores)),
            per_core(watchers, cores),
            Compare::Ratio,
        )
        .samples(watchers)
        .note(format!(
            "CPU over {seconds:.1} s: behest {cores:.3} cores delivering {rate:.0} events/s, \
             the bare SSE server {base_cores:.3} cores delivering {base_rate:.0} events/s; \
             {} runs, tokens 1 s apart",
            run_ids.len()
        )),
        Row::new(
            &format!("delivery lag p99 ({label})"),
            "ms",
            None,
            lag.p(99.0),
            Compare::Difference,
        )
        .samples(lag.len())
        .note("provider writes token k → watcher reads it; every run's tokens at the same instant"),
    ])
}

/// Watchers one core keeps fed, from the cores used by all of them (CPU seconds per second).
fn per_core(watchers: usize, cores: f64) -> f64 {
    watchers as f64 / cores.max(1e-6)
}

/// The baseline: `streams` clients of the fake provider as its own process, one chunk per
/// second each. Returns the cores it used over `window` and the chunks per second delivered.
async fn direct(ctx: &Ctx, streams: usize, window: Duration) -> Result<(f64, f64)> {
    let interval = PER_CORE_INTERVAL.as_millis().to_string();
    // Long enough never to end while measured: the streams are dropped after the window.
    let mut fake = fake_provider_process(&[
        "--ttft-ms",
        "0",
        "--interval-ms",
        &interval,
        "--tokens",
        "3600",
    ])
    .await?;
    let (pid, base_url) = (fake.pid, fake.base_url.clone());
    let ready = Arc::new(AtomicUsize::new(0));
    let counting = Arc::new(std::sync::Mutex::new(None::<(Instant, Instant)>));
    let received = Arc::new(AtomicUsize::new(0));
    let permits = Arc::new(Semaphore::new(CONNECT_CONCURRENCY));
    let tasks: Vec<_> = (0..streams)
        .map(|_| {
            let client = ctx.client.clone();
            let (ready, counting, received) = (ready.clone(), counting.clone(), received.clone());
            let permits = permits.clone();
            let url = format!("{base_url}/chat/completions");
            tokio::spawn(async move {
                let permit = permits.acquire_owned().await;
                let body = json!({
                    "model": "fake-model",
                    "messages": [{"role": "user", "content": tag("per-core-direct")}],
                    "stream": true,
                    "stream_options": {"include_usage": true},
                });
                let response = client.post(url).json(&body).send().await?;
                let mut reader = crate::sse::SseReader::new(response);
                let mut permit = Some(permit);
                while let Some(frame) = reader.next().await? {
                    if permit.take().is_some() {
                        ready.fetch_add(1, Ordering::AcqRel);
                    }
                    let window = *counting.lock().unwrap_or_else(|e| e.into_inner());
                    if window.is_some_and(|(from, to)| frame.at >= from && frame.at < to) {
                        received.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok::<_, BenchError>(())
            })
        })
        .collect();
    let connected = wait_count(
        &ready,
        streams,
        Duration::from_secs(300),
        "direct slow streams",
    )
    .await;
    let from = Instant::now() + PER_CORE_INTERVAL / 2;
    *counting.lock().unwrap_or_else(|e| e.into_inner()) = Some((from, from + window));
    tokio::time::sleep_until(from.into()).await;
    let (cpu_before, from) = (cpu_seconds(pid)?, Instant::now());
    tokio::time::sleep(window).await;
    let (cpu_after, to) = (cpu_seconds(pid)?, Instant::now());
    for task in &tasks {
        task.abort();
    }
    let _ = fake.child.kill().await;
    connected?;
    let seconds = to.duration_since(from).as_secs_f64();
    Ok((
        (cpu_after - cpu_before) / seconds,
        received.load(Ordering::Relaxed) as f64 / seconds,
    ))
}
