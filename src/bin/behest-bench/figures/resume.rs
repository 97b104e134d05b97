//! Reconnect with `Last-Event-ID` → first replayed event, against a new request to the provider.

use std::time::Instant;

use super::{Ctx, MODEL_FAST, tag};
use crate::Result;
use crate::check::StreamCheck;
use crate::report::{Compare, Dist, Row, Target, ms};
use crate::sse::Frame;

pub(super) async fn resume(ctx: &Ctx) -> Result<Vec<Row>> {
    let plan = &ctx.plan;
    let tokens = plan.profile.tokens;
    let run_tag = tag("resume");
    let (_, run_id, mut reader) = ctx.stream_run(MODEL_FAST, &run_tag).await?;
    let mut full: Vec<Frame> = Vec::new();
    let mut check = StreamCheck::new(0);
    while let Some(frame) = reader.next().await? {
        check.push(&frame);
        full.push(frame);
    }
    ctx.checks.stream(
        &format!("run {run_id}"),
        &check.finish(Some("run_completed"), Some(tokens)),
    );
    if full.len() < 2 {
        bail!("the resume run has {} events", full.len());
    }
    let mut behest = Dist::default();
    for i in 0..plan.resume_samples {
        // Resume after sequence k: the first replayed event is full[k].
        let k = 1 + i % (full.len() - 1);
        let sent_at = Instant::now();
        let mut reader = ctx.watch(&run_id, Some(k as u64)).await?;
        let Some(first) = reader.next().await? else {
            ctx.checks
                .fail(format!("resume of {run_id} after {k}: no event replayed"));
            continue;
        };
        behest.push(ms(first.at.duration_since(sent_at)));
        if !first.same_as(&full[k]) {
            ctx.checks.fail(format!(
                "resume of {run_id} after {k}: replayed `{:?} {}` where `{:?} {}` was logged",
                first.id, first.event, full[k].id, full[k].event
            ));
        }
    }
    let mut direct = Dist::default();
    for _ in 0..plan.resume_samples {
        let (sent_at, mut reader) = ctx.direct(MODEL_FAST, &tag("resume-direct")).await?;
        if let Some(first) = reader.next().await? {
            direct.push(ms(first.at.duration_since(sent_at)));
        }
    }
    let n = behest.len();
    Ok(vec![
        Row::new(
            "resume (Last-Event-ID) → first replayed event p50",
            "ms",
            Some(direct.p(50.0)),
            behest.p(50.0),
            Compare::Difference,
        )
        .target_absolute(Target::AtMost(5.0))
        .samples(n)
        .note("baseline: new request → first chunk from the fake provider"),
        Row::new(
            "resume (Last-Event-ID) → first replayed event p99",
            "ms",
            Some(direct.p(99.0)),
            behest.p(99.0),
            Compare::Difference,
        )
        .target_absolute(Target::AtMost(25.0))
        .samples(n),
    ])
}
