//! Server CPU per event served in each rendering of the log (`?format=ai-sdk`, `ai-sdk-v7`,
//! `ag-ui`) against behest's own format, in the same run: watchers replay one finished run in
//! each format in turn, and behest's CPU time over the replay is divided by the events served.

use futures::future::try_join_all;

use super::{Ctx, MODEL_FAST, tag};
use crate::Result;
use crate::report::{Compare, Row};
use crate::target::cpu_seconds;

/// The formats measured, behest's own first (the baseline).
const FORMATS: [&str; 4] = ["behest", "ai-sdk", "ai-sdk-v7", "ag-ui"];

pub(super) async fn formats(ctx: &Ctx) -> Result<Vec<Row>> {
    let (_, run_id, mut reader) = ctx.stream_run(MODEL_FAST, &tag("formats")).await?;
    let mut events = 0_u64;
    while reader.next().await?.is_some() {
        events += 1;
    }
    let watchers = if ctx.plan.smoke { 4 } else { 200 };
    let mut per_event = Vec::new();
    for format in FORMATS {
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
        let cpu = cpu_seconds(ctx.behest_pid)? - before;
        // µs of behest CPU per event per watcher.
        per_event.push(cpu * 1e6 / (events as f64 * f64::from(watchers)));
    }
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
            .samples(usize::try_from(events).unwrap_or(usize::MAX) * watchers as usize)
            .note(format!(
                "{watchers} watchers replay a {events}-event run in each format in turn; the \
                 issue's target is a ratio of at most 1.10"
            ))
        })
        .collect())
}
