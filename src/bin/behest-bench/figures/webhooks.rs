//! What webhooks cost a run that has none: time to first token and the gap between token
//! events through a behest with `[webhooks]` on (a secret, its delivery worker running) whose
//! runs name no webhook, against a behest without `[webhooks]` — two processes of the same
//! binary, each over a fresh database, the runs alternating between them in the same bench
//! run. The "baseline" column is behest with webhooks off. Then the same behest's outbox is
//! checked empty: a run without a webhook wrote no delivery.

use super::Ctx;
use super::ops::{OnOff, Stat, start};
use crate::Result;
use crate::report::{Row, Target};

/// 32 key bytes, Standard Webhooks form (the bench's own; nothing is ever signed with it).
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSwMfKQ9r8GKYo=";

pub(super) async fn overhead(ctx: &Ctx) -> Result<Vec<Row>> {
    let (off_process, off_db) = start(ctx, "webhooks-off", "").await?;
    let on_extra = format!("[webhooks]\nsecret = \"{SECRET}\"\n");
    let (on_process, on_db) = start(ctx, "webhooks-on", &on_extra).await?;
    let off = ctx.aimed_at(&off_process.base_url, off_process.pid, None);
    let on = ctx.aimed_at(&on_process.base_url, on_process.pid, None);
    let result = async {
        let latency = OnOff::measure(ctx, &off, &on).await?;
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
        let row = |stat: Stat, p: f64, many: bool| {
            latency.row("webhooks on, run without one", stat, p, many)
        };
        Ok(vec![
            row(Stat::Ttft, 50.0, false)
                .target(Target::AtMost(0.2))
                .note("baseline = behest without [webhooks]"),
            row(Stat::Gap, 50.0, false).target(Target::AtMost(0.2)),
            row(Stat::Ttft, 50.0, true),
            row(Stat::Gap, 99.0, true),
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
