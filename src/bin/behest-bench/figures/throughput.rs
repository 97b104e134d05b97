//! Sustained short runs per second, against the same answers straight from the provider.

use std::time::Instant;

use super::{Ctx, MODEL_SHORT};
use crate::report::{Compare, Dist, Row, Target, ms};
use crate::target::Backend;
use crate::{BenchError, Result};

pub(super) async fn throughput(ctx: &Ctx) -> Result<Vec<Row>> {
    let plan = &ctx.plan;
    let (base_rate, base_latency) = closed_loop(ctx, false).await?;
    let cpu_before = crate::target::cpu_seconds(ctx.behest_pid)? * 1000.0;
    let (rate, latency) = closed_loop(ctx, true).await?;
    let cpu_per_run = (crate::target::cpu_seconds(ctx.behest_pid)? * 1000.0 - cpu_before)
        / latency.len().max(1) as f64;
    let label = format!(
        "{} tokens, {} clients",
        plan.short_tokens, plan.short_concurrency
    );
    let mut row = Row::new(
        &format!("sustained short runs per second ({label})"),
        "runs/s",
        Some(base_rate),
        rate,
        Compare::Ratio,
    )
    .samples(latency.len())
    .note("baseline: the same answers straight from the fake provider");
    let mut cpu = Row::new(
        &format!("behest CPU per short run ({label})"),
        "ms",
        None,
        cpu_per_run,
        Compare::None,
    )
    .samples(latency.len())
    .note("user + system time of the behest process over the load (/proc/PID/stat), per run");
    let mut p99 = Row::new(
        &format!("short run duration p99 ({label})"),
        "ms",
        Some(base_latency.p(99.0)),
        latency.p(99.0),
        Compare::Difference,
    )
    .samples(latency.len());
    if !plan.smoke {
        cpu = cpu.target_absolute(Target::AtMost(1.0));
        p99 = p99.target(Target::AtMost(20.0));
        if ctx.backend == Backend::Sqlite {
            row = row.target_absolute(Target::AtLeast(1_000.0));
        }
    }
    Ok(vec![
        row,
        cpu,
        Row::new(
            &format!("short run duration p50 ({label})"),
            "ms",
            Some(base_latency.p(50.0)),
            latency.p(50.0),
            Compare::Difference,
        )
        .samples(latency.len()),
        p99,
    ])
}

/// Clients run short answers back to back for the plan's duration: answers per second and
/// their durations.
async fn closed_loop(ctx: &Ctx, via_behest: bool) -> Result<(f64, Dist)> {
    let plan = &ctx.plan;
    let started = Instant::now();
    let deadline = started + plan.short_duration;
    let tasks: Vec<_> = (0..plan.short_concurrency)
        .map(|_| {
            let ctx = ctx.clone();
            tokio::spawn(async move {
                let mut durations = Dist::default();
                while Instant::now() < deadline {
                    let trace = ctx
                        .answer(via_behest, MODEL_SHORT, ctx.plan.short_tokens)
                        .await?;
                    durations.push(ms(trace.end.duration_since(trace.sent_at)));
                }
                Ok::<_, BenchError>(durations)
            })
        })
        .collect();
    let mut durations = Dist::default();
    for task in tasks {
        durations.extend(&task.await??);
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok((durations.len() as f64 / elapsed, durations))
}
