//! Time to first token and gaps between token events, at 1 concurrent run (`ttft`, `gap1`)
//! and at 100 (`gap100`), each against the same answers read directly from the provider.

use std::time::Instant;

use super::{Ctx, MODEL_DEFAULT, Trace};
use crate::Result;
use crate::report::{Compare, Dist, Row, Target, ms};

/// Time to first token, gaps between tokens and per-token delivery delay (provider write →
/// client read), in ms.
#[derive(Debug, Default, Clone)]
pub(super) struct Latency {
    pub ttft: Dist,
    pub gaps: Dist,
    pub delay: Dist,
    pub total: Dist,
}

impl Latency {
    pub(super) fn add(&mut self, trace: &Trace, sent: &[Instant]) {
        if let Some(first) = trace.tokens.first() {
            self.ttft.push(ms(first.duration_since(trace.sent_at)));
        }
        for pair in trace.tokens.windows(2) {
            self.gaps.push(ms(pair[1].duration_since(pair[0])));
        }
        for (arrived, written) in trace.tokens.iter().zip(sent) {
            self.delay
                .push(ms(arrived.saturating_duration_since(*written)));
        }
        self.total.push(ms(trace.end.duration_since(trace.sent_at)));
    }
}

fn latency_rows(label: &str, base: &Latency, behest: &Latency, targets: bool) -> Vec<Row> {
    let samples = behest.gaps.len();
    let target = |row: Row, limit: f64| {
        if targets {
            row.target(Target::AtMost(limit))
        } else {
            row
        }
    };
    vec![
        Row::new(
            &format!("gap between token events p50 ({label})"),
            "ms",
            Some(base.gaps.p(50.0)),
            behest.gaps.p(50.0),
            Compare::Difference,
        )
        .samples(samples),
        target(
            Row::new(
                &format!("gap between token events p99 ({label})"),
                "ms",
                Some(base.gaps.p(99.0)),
                behest.gaps.p(99.0),
                Compare::Difference,
            )
            .samples(samples),
            10.0,
        ),
        Row::new(
            &format!("token delivery delay p50 ({label})"),
            "ms",
            Some(base.delay.p(50.0)),
            behest.delay.p(50.0),
            Compare::Difference,
        )
        .samples(behest.delay.len())
        .note("provider writes token k → client reads token k"),
        Row::new(
            &format!("token delivery delay p99 ({label})"),
            "ms",
            Some(base.delay.p(99.0)),
            behest.delay.p(99.0),
            Compare::Difference,
        )
        .samples(behest.delay.len()),
    ]
}

pub(super) async fn latency_one(ctx: &Ctx, ttft: bool, gaps: bool) -> Result<Vec<Row>> {
    let plan = &ctx.plan;
    let tokens = plan.profile.tokens;
    let mut base = Latency::default();
    let mut behest = Latency::default();
    // Alternate so that drift of the machine hits both sides alike.
    for _ in 0..plan.latency_runs {
        let trace = ctx.direct_answer(MODEL_DEFAULT, tokens).await?;
        base.add(&trace, &ctx.sent(&trace.tag));
        let trace = ctx.behest_run(MODEL_DEFAULT, tokens).await?;
        behest.add(&trace, &ctx.sent(&trace.tag));
    }
    let n = behest.ttft.len();
    let mut rows = Vec::new();
    if ttft {
        rows.push(
            Row::new(
                "time to first token p50 (1 run)",
                "ms",
                Some(base.ttft.p(50.0)),
                behest.ttft.p(50.0),
                Compare::Difference,
            )
            .target(Target::AtMost(1.0))
            .samples(n),
        );
        rows.push(
            Row::new(
                "time to first token p99 (1 run)",
                "ms",
                Some(base.ttft.p(99.0)),
                behest.ttft.p(99.0),
                Compare::Difference,
            )
            .target(Target::AtMost(10.0))
            .samples(n)
            .note(if n < 100 {
                "few samples: p99 is close to the maximum"
            } else {
                ""
            }),
        );
        rows.push(
            Row::new(
                "whole answer p50 (1 run)",
                "ms",
                Some(base.total.p(50.0)),
                behest.total.p(50.0),
                Compare::Difference,
            )
            .samples(n)
            .note("request sent → [DONE] (direct) / run_completed (behest)"),
        );
    }
    if gaps {
        rows.extend(latency_rows("1 run", &base, &behest, true));
    }
    Ok(rows)
}

pub(super) async fn wave(
    ctx: &Ctx,
    via_behest: bool,
    runs: usize,
    model: &'static str,
) -> Result<Latency> {
    let tokens = ctx.plan.profile.tokens;
    let tasks: Vec<_> = (0..runs)
        .map(|_| {
            let ctx = ctx.clone();
            tokio::spawn(async move { ctx.answer(via_behest, model, tokens).await })
        })
        .collect();
    let mut latency = Latency::default();
    for task in tasks {
        let trace = task.await??;
        latency.add(&trace, &ctx.sent(&trace.tag));
    }
    Ok(latency)
}

pub(super) async fn latency_concurrent(ctx: &Ctx) -> Result<Vec<Row>> {
    let plan = &ctx.plan;
    let mut base = Latency::default();
    let mut behest = Latency::default();
    for _ in 0..plan.concurrent_waves {
        let direct = wave(ctx, false, plan.concurrent_runs, MODEL_DEFAULT).await?;
        let through = wave(ctx, true, plan.concurrent_runs, MODEL_DEFAULT).await?;
        for (into, from) in [(&mut base, direct), (&mut behest, through)] {
            into.ttft.extend(&from.ttft);
            into.gaps.extend(&from.gaps);
            into.delay.extend(&from.delay);
            into.total.extend(&from.total);
        }
    }
    let label = format!("{} runs", plan.concurrent_runs);
    let mut rows = latency_rows(&label, &base, &behest, true);
    rows.push(
        Row::new(
            &format!("time to first token p50 ({label})"),
            "ms",
            Some(base.ttft.p(50.0)),
            behest.ttft.p(50.0),
            Compare::Difference,
        )
        .samples(behest.ttft.len()),
    );
    // Issue 14's targets for many starts at once.
    let limit = match ctx.backend {
        crate::target::Backend::Sqlite => 10.0,
        crate::target::Backend::Postgres => 20.0,
    };
    rows.push(
        Row::new(
            &format!("time to first token p99 ({label})"),
            "ms",
            Some(base.ttft.p(99.0)),
            behest.ttft.p(99.0),
            Compare::Difference,
        )
        .target(Target::AtMost(limit))
        .samples(behest.ttft.len()),
    );
    Ok(rows)
}
