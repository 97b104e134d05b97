//! Storage per run: rows and bytes of each table after a number of 64-token runs, against the
//! bytes of the provider's SSE answers.

use super::{Ctx, MODEL_FAST};
use crate::Result;
use crate::report::{Compare, Dist, Row};
use crate::target::Database;

pub(super) async fn storage(ctx: &Ctx, db: &Database) -> Result<Vec<Row>> {
    let plan = &ctx.plan;
    let tokens = plan.profile.tokens;
    let mut provider_bytes = Dist::default();
    for _ in 0..plan.storage_runs {
        let trace = ctx.behest_run(MODEL_FAST, tokens).await?;
        if let Some(exchange) = ctx.fake.exchange(&trace.tag) {
            provider_bytes.push(exchange.snapshot().bytes as f64);
        }
    }
    let storage = db.storage().await?;
    let runs = storage
        .tables
        .iter()
        .find(|t| t.table == "runs")
        .map_or(0, |t| t.rows)
        .max(1) as f64;
    let per_run = |f: fn(&crate::target::TableStorage) -> u64| {
        storage.tables.iter().map(|t| f(t) as f64).sum::<f64>() / runs
    };
    let breakdown = storage
        .tables
        .iter()
        .map(|t| {
            format!(
                "{} {:.1} rows / {:.0} B",
                t.table,
                t.rows as f64 / runs,
                t.bytes as f64 / runs
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    let events = storage
        .tables
        .iter()
        .find(|t| t.table == "events")
        .map_or(0.0, |t| t.rows as f64 / runs);
    // The provider's answer: role+token 1, tokens 2..n, stop, usage, [DONE].
    let provider_frames = f64::from(tokens) + 3.0;
    Ok(vec![
        Row::new(
            &format!("events per {tokens}-token run (rows)"),
            "rows",
            Some(provider_frames),
            events,
            Compare::Ratio,
        )
        .samples(runs as usize)
        .note("baseline: SSE chunks the provider sent for the answer"),
        Row::new(
            &format!("rows per {tokens}-token run, all tables"),
            "rows",
            None,
            per_run(|t| t.rows),
            Compare::None,
        )
        .samples(runs as usize)
        .note(breakdown.clone()),
        Row::new(
            &format!("bytes per {tokens}-token run, tables + indexes"),
            "bytes",
            Some(provider_bytes.mean()),
            per_run(|t| t.bytes),
            Compare::Ratio,
        )
        .samples(runs as usize)
        .note(format!(
            "baseline: bytes of the provider's SSE answer; whole database {:.0} B/run; {breakdown}",
            storage.total_bytes as f64 / runs
        )),
    ])
}
