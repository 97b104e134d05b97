//! What webhooks cost a run that has none: time to first token and the gap between token
//! events through a behest with `[webhooks]` on (a secret, its delivery worker running) whose
//! runs name no webhook, against a behest without `[webhooks]` — two processes of the same
//! binary, each over a fresh database, the runs alternating between them in the same bench
//! run. The "baseline" column is behest with webhooks off. Then the same behest's outbox is
//! checked empty: a run without a webhook wrote no delivery.

use super::latency::{Latency, wave};
use super::ops::start;
use super::{Ctx, MODEL_DEFAULT};
use crate::Result;
use crate::report::{Compare, Row, Target};

/// 32 key bytes, Standard Webhooks form (the bench's own; nothing is ever signed with it).
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSwMfKQ9r8GKYo=";

pub(super) async fn overhead(ctx: &Ctx) -> Result<Vec<Row>> {
    let plan = &ctx.plan;
    let (off_process, off_db) = start(ctx, "webhooks-off", "").await?;
    let on_extra = format!("[webhooks]\nsecret = \"{SECRET}\"\n");
    let (on_process, on_db) = start(ctx, "webhooks-on", &on_extra).await?;
    let off = ctx.aimed_at(&off_process.base_url, off_process.pid, None);
    let on = ctx.aimed_at(&on_process.base_url, on_process.pid, None);
    let tokens = plan.profile.tokens;
    let result = async {
        let (mut off_one, mut on_one) = (Latency::default(), Latency::default());
        // Alternate so that drift of the machine hits both alike.
        for _ in 0..plan.latency_runs {
            let trace = off.behest_run(MODEL_DEFAULT, tokens).await?;
            off_one.add(&trace, &ctx.sent(&trace.tag));
            let trace = on.behest_run(MODEL_DEFAULT, tokens).await?;
            on_one.add(&trace, &ctx.sent(&trace.tag));
        }
        let (mut off_many, mut on_many) = (Latency::default(), Latency::default());
        for _ in 0..plan.concurrent_waves {
            for (side, into) in [(&off, &mut off_many), (&on, &mut on_many)] {
                let from = wave(side, true, plan.concurrent_runs, MODEL_DEFAULT).await?;
                into.ttft.extend(&from.ttft);
                into.gaps.extend(&from.gaps);
            }
        }
        // Webhooks were really on, and a run without one wrote no delivery.
        let runs: serde_json::Value = ctx
            .client
            .get(format!("{}/runs?limit=1", on_process.base_url))
            .send()
            .await?
            .json()
            .await?;
        let Some(run_id) = runs["runs"][0]["id"].as_str() else {
            bail!("the behest with webhooks on lists no run: {runs}");
        };
        let deliveries: serde_json::Value = ctx
            .client
            .get(format!(
                "{}/runs/{run_id}/webhook-deliveries",
                on_process.base_url
            ))
            .send()
            .await?
            .json()
            .await?;
        if deliveries["deliveries"] != serde_json::json!([]) {
            bail!("a run without a webhook has deliveries: {deliveries}");
        }
        let metrics = ctx
            .client
            .get(format!("{}/metrics", on_process.base_url))
            .send()
            .await?
            .text()
            .await?;
        if !metrics.contains("behest_webhook_deliveries_pending 0") {
            bail!("the behest with webhooks on shows no empty outbox:\n{metrics}");
        }
        let many = format!("{} runs", plan.concurrent_runs);
        let row = |figure: String, off: f64, on: f64, samples: usize| {
            Row::new(&figure, "ms", Some(off), on, Compare::Difference).samples(samples)
        };
        Ok(vec![
            row(
                "webhooks on, run without one: time to first token p50 (1 run)".to_owned(),
                off_one.ttft.p(50.0),
                on_one.ttft.p(50.0),
                on_one.ttft.len(),
            )
            .target(Target::AtMost(0.2))
            .note("baseline = behest without [webhooks]"),
            row(
                "webhooks on, run without one: gap between token events p50 (1 run)".to_owned(),
                off_one.gaps.p(50.0),
                on_one.gaps.p(50.0),
                on_one.gaps.len(),
            )
            .target(Target::AtMost(0.2)),
            row(
                format!("webhooks on, run without one: time to first token p50 ({many})"),
                off_many.ttft.p(50.0),
                on_many.ttft.p(50.0),
                on_many.ttft.len(),
            ),
            row(
                format!("webhooks on, run without one: gap between token events p99 ({many})"),
                off_many.gaps.p(99.0),
                on_many.gaps.p(99.0),
                on_many.gaps.len(),
            ),
        ])
    }
    .await;
    drop((off, on));
    off_process.stop().await?;
    on_process.stop().await?;
    off_db.drop_database().await;
    on_db.drop_database().await;
    result
}
