//! Cancel request → provider connection closed, against the client dropping the connection.

use std::time::{Duration, Instant};

use super::{Ctx, MODEL_CANCEL, tag};
use crate::check::{DirectCheck, StreamCheck};
use crate::report::{Compare, Dist, Row, Target, ms};
use crate::{BenchError, Result};

pub(super) async fn cancel(ctx: &Ctx) -> Result<Vec<Row>> {
    let plan = &ctx.plan;
    let wait = Duration::from_secs(5);
    let mut behest = Dist::default();
    let mut to_event = Dist::default();
    for _ in 0..plan.cancel_samples {
        let run_tag = tag("cancel");
        let run_id = ctx.create_run(MODEL_CANCEL, &run_tag).await?;
        let mut reader = ctx.watch(&run_id, None).await?;
        let mut check = StreamCheck::new(0);
        let mut seen = 0;
        // Cancel once the provider stream is live (a few tokens arrived).
        while seen < 3 {
            let Some(frame) = reader.next().await? else {
                bail!("run {run_id} ended before it was cancelled");
            };
            check.push(&frame);
            if frame.event == "text_delta" {
                seen += 1;
            }
        }
        let exchange = ctx
            .fake
            .exchange(&run_tag)
            .ok_or_else(|| BenchError(format!("no provider request for run {run_id}")))?;
        let sent_at = Instant::now();
        ctx.cancel(&run_id).await?;
        match exchange.wait_ended(wait).await {
            Some(ended) => behest.push(ms(ended.saturating_duration_since(sent_at))),
            None => ctx.checks.fail(format!(
                "run {run_id}: the provider connection was still open 5 s after cancel"
            )),
        }
        while let Some(frame) = reader.next().await? {
            check.push(&frame);
            if frame.event == "run_cancelled" {
                to_event.push(ms(frame.at.duration_since(sent_at)));
            }
        }
        ctx.checks.stream(
            &format!("cancelled run {run_id}"),
            &check.finish(Some("run_cancelled"), None),
        );
    }
    let mut direct = Dist::default();
    for _ in 0..plan.cancel_samples {
        let direct_tag = tag("cancel-direct");
        let (_, mut reader) = ctx.direct(MODEL_CANCEL, &direct_tag).await?;
        let mut check = DirectCheck::default();
        let mut seen = 0;
        while seen < 3 {
            let Some(frame) = reader.next().await? else {
                bail!("the direct answer ended early");
            };
            if check.push(&frame) {
                seen += 1;
            }
        }
        let exchange = ctx
            .fake
            .exchange(&direct_tag)
            .ok_or_else(|| BenchError("no provider request for a direct answer".to_owned()))?;
        let sent_at = Instant::now();
        drop(reader);
        if let Some(ended) = exchange.wait_ended(wait).await {
            direct.push(ms(ended.saturating_duration_since(sent_at)));
        }
    }
    let n = behest.len();
    Ok(vec![
        Row::new(
            "cancel → provider connection closed p50",
            "ms",
            Some(direct.p(50.0)),
            behest.p(50.0),
            Compare::Difference,
        )
        .samples(n)
        .note("baseline: the client drops the connection itself"),
        Row::new(
            "cancel → provider connection closed max",
            "ms",
            Some(direct.p(100.0)),
            behest.p(100.0),
            Compare::Difference,
        )
        .target_absolute(Target::AtMost(50.0))
        .samples(n),
        Row::new(
            "cancel → run_cancelled at a watcher p50",
            "ms",
            None,
            to_event.p(50.0),
            Compare::None,
        )
        .samples(to_event.len()),
    ])
}
