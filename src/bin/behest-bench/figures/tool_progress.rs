//! What a `tool_progress` event costs the server, against a `text_delta`, in the same run: a
//! behest of its own with the built-in model and the built-in `wait` tool (every report logged:
//! `tool_progress_interval_ms = 0`). Three runs, one after the other, behest's CPU time over
//! each (from `/proc/<pid>/stat`):
//! - a text run (`count to N`): N `text_delta`s — the cost of an event from its source to the
//!   log and a watcher — less a `count to 1` run (the run's own work);
//! - `wait` for N steps reporting each (`tool_progress` events, as many as the log keeps up
//!   with: a report waiting for the log is replaced by the next);
//! - the same `wait` reporting nothing: the tool's own work, subtracted from the one before.

use serde_json::json;

use super::{Ctx, MODELS};
use crate::Result;
use crate::report::{Compare, Row};
use crate::sse::SseReader;
use crate::target::{BehestProcess, Database, cpu_seconds};

/// The events of one run by type (`text_delta`, `tool_progress`, all), and behest's CPU over it.
struct Measured {
    cpu: f64,
    events: u64,
    text: u64,
    progress: u64,
}

async fn measure(ctx: &Ctx, pid: u32, input: &str) -> Result<Measured> {
    let before = cpu_seconds(pid)?;
    let response = ctx
        .keyed(ctx.client.post(ctx.url("/runs/stream")))
        .json(&json!({"provider": "demo", "model": "demo", "input": input}))
        .send()
        .await?;
    if !response.status().is_success() {
        bail!("POST /runs/stream answered {}", response.status());
    }
    let mut reader = SseReader::new(response);
    let (mut events, mut text, mut progress, mut last) = (0, 0, 0, String::new());
    while let Some(frame) = reader.next().await? {
        if frame.id.is_none() {
            continue;
        }
        events += 1;
        match frame.event.as_str() {
            "text_delta" => text += 1,
            "tool_progress" => progress += 1,
            _ => {}
        }
        last = frame.event;
    }
    if last != "run_completed" {
        bail!("the run `{input}` ended with {last}, not run_completed");
    }
    Ok(Measured {
        cpu: cpu_seconds(pid)? - before,
        events,
        text,
        progress,
    })
}

pub(super) async fn tool_progress(ctx: &Ctx) -> Result<Vec<Row>> {
    let dir = ctx.dir.join("tool-progress");
    std::fs::create_dir_all(&dir)?;
    let db = Database::create(ctx.backend, &dir, &ctx.postgres_url).await?;
    let config = dir.join("behest.toml");
    // Top-level keys and `[runtime]` first: the bench's configuration ends inside a section.
    let toml = format!(
        "builtin_tools = [\"wait\"]\n[runtime]\ntool_progress_interval_ms = 0\n\n{}\n\
         [providers.demo]\nkind = \"scripted\"\ntoken_delay_ms = 0\n\
         [providers.demo.models.demo]\ncontext_window = 128000\nmax_output_tokens = 20000\n",
        crate::target::config_toml(&ctx.fake.base_url(), &MODELS, None)
    );
    std::fs::write(&config, toml)?;
    let process =
        BehestProcess::start(&ctx.behest_bin, &dir, &config, &db.url, &ctx.client).await?;
    let own = ctx.aimed_at(&process.base_url, process.pid, None);
    let steps = if ctx.plan.smoke { 100 } else { 2000 };
    let rounds = if ctx.plan.smoke { 1 } else { 3 };
    let result = async {
        let (mut text_cpu, mut text_events) = (0.0, 0);
        let (mut progress_cpu, mut progress_events, mut quiet_cpu) = (0.0, 0, 0.0);
        for _ in 0..rounds {
            let text = measure(&own, process.pid, &format!("count to {steps}")).await?;
            if text.text < steps {
                bail!("count to {steps} streamed {} text_deltas", text.text);
            }
            // Less a one-token run: the run's own work, as the silent wait is below.
            let short = measure(&own, process.pid, "count to 1").await?;
            text_cpu += text.cpu - short.cpu;
            text_events += text.events - short.events;
            let wait = format!("call wait {{\"ms\": {steps}, \"steps\": {steps}}}");
            let reporting = measure(&own, process.pid, &wait).await?;
            let quiet =
                format!("call wait {{\"ms\": {steps}, \"steps\": {steps}, \"report\": false}}");
            let silent = measure(&own, process.pid, &quiet).await?;
            if reporting.progress == 0 || silent.progress != 0 {
                bail!(
                    "wait logged {} tool_progress events reporting, {} silent",
                    reporting.progress,
                    silent.progress
                );
            }
            progress_cpu += reporting.cpu - silent.cpu;
            progress_events += reporting.progress;
            quiet_cpu += silent.cpu;
        }
        #[expect(clippy::cast_precision_loss, reason = "event counts")]
        let (per_text, per_progress) = (
            text_cpu * 1e6 / text_events as f64,
            progress_cpu * 1e6 / progress_events as f64,
        );
        Ok::<_, crate::BenchError>(vec![
            Row::new(
                "CPU per tool_progress event ÷ per text_delta event",
                "µs",
                Some(per_text),
                per_progress,
                Compare::Ratio,
            )
            .samples(usize::try_from(progress_events).unwrap_or(usize::MAX))
            .note(format!(
                "{rounds}× (count to {steps} less count to 1: {text_events} events; wait {steps} ms in {steps} \
                 reported steps minus the same wait silent: {progress_events} tool_progress \
                 events logged, interval 0)"
            )),
            Row::new(
                "CPU of a wait that reports nothing, per run",
                "ms",
                None,
                quiet_cpu * 1e3 / f64::from(rounds),
                Compare::Ratio,
            )
            .samples(rounds as usize)
            .note(
                "the tool path without reports: one watch channel and an idle select branch \
                 per execution; a run without tool calls runs none of it",
            ),
        ])
    }
    .await;
    process.stop().await?;
    db.drop_database().await;
    result
}
