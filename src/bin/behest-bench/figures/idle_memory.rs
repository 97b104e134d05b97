//! Memory per idle SSE watcher, against a bare axum/hyper SSE stream of the fake provider.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::json;
use tokio::sync::Semaphore;

use super::{CONNECT_CONCURRENCY, Ctx, MODEL_IDLE, tag, wait_count};
use crate::check::StreamCheck;
use crate::report::{Compare, Row, Target};
use crate::target::rss_kib;
use crate::{BenchError, Result};

pub(super) async fn idle_memory(ctx: &Ctx) -> Result<Vec<Row>> {
    let plan = &ctx.plan;
    let watchers = plan.idle_watchers;
    let base = idle_direct(ctx, watchers).await?;

    let mut run_ids = Vec::new();
    for _ in 0..plan.idle_runs.max(1) {
        run_ids.push(ctx.create_held_run(MODEL_IDLE, "idle").await?.1);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = rss_kib(ctx.behest_pid)?;
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
                let run_id = &run_ids[w % run_ids.len()];
                let permit = permits.acquire_owned().await;
                let mut reader = ctx.watch(run_id, None).await?;
                let mut permit = Some(permit);
                let mut check = StreamCheck::new(0);
                while let Some(frame) = reader.next().await? {
                    check.push(&frame);
                    if frame.event == "model_started" && permit.take().is_some() {
                        ready.fetch_add(1, Ordering::AcqRel);
                    }
                }
                ctx.checks.stream(
                    &format!("idle watcher of {run_id}"),
                    &check.finish(Some("run_cancelled"), None),
                );
                Ok::<_, BenchError>(())
            })
        })
        .collect();
    let connected = wait_count(&ready, watchers, Duration::from_secs(300), "idle watchers").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = rss_kib(ctx.behest_pid)?;
    for run_id in run_ids.iter() {
        ctx.cancel(run_id).await?;
    }
    for task in tasks {
        task.await??;
    }
    connected?;
    let per_watcher = (after.saturating_sub(before)) as f64 / watchers.max(1) as f64;
    Ok(vec![
        Row::new(
            &format!("memory per idle SSE watcher ({watchers} watchers)"),
            "KiB",
            Some(base),
            per_watcher,
            Compare::Difference,
        )
        .target_absolute(Target::AtMost(8.0))
        .samples(watchers)
        .note(format!(
            "behest RSS {before} → {after} KiB; baseline: RSS per idle stream of the fake provider \
             as its own process"
        )),
    ])
}

/// RSS per idle streaming request of the fake provider run as its own process (KiB).
async fn idle_direct(ctx: &Ctx, streams: usize) -> Result<f64> {
    let FakeProcess {
        mut child,
        pid,
        base_url,
        ..
    } = fake_provider_process(&["--ttft-ms", "3600000", "--tokens", "1"]).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = rss_kib(pid)?;
    let permits = Arc::new(Semaphore::new(CONNECT_CONCURRENCY));
    let tasks: Vec<_> = (0..streams)
        .map(|_| {
            let client = ctx.client.clone();
            let permits = permits.clone();
            let url = format!("{base_url}/chat/completions");
            tokio::spawn(async move {
                let _permit = permits.acquire_owned().await;
                let body = json!({
                    "model": "fake-model",
                    "messages": [{"role": "user", "content": tag("idle-direct")}],
                    "stream": true,
                    "stream_options": {"include_usage": true},
                });
                client.post(url).json(&body).send().await
            })
        })
        .collect();
    let mut held = Vec::with_capacity(streams);
    for task in tasks {
        held.push(task.await??);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = rss_kib(pid)?;
    drop(held);
    let _ = child.kill().await;
    Ok(after.saturating_sub(before) as f64 / streams.max(1) as f64)
}

/// The fake provider as its own process.
pub(super) struct FakeProcess {
    /// The child, killed when dropped.
    pub child: tokio::process::Child,
    pub pid: u32,
    pub base_url: String,
    /// Its stdout, kept open while it runs.
    _stdout: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

/// `behest-bench fake-provider` with `args` as its own process on a free local port.
pub(super) async fn fake_provider_process(args: &[&str]) -> Result<FakeProcess> {
    use tokio::io::AsyncBufReadExt;
    let exe = std::env::current_exe()?;
    let mut child = tokio::process::Command::new(exe)
        .args(["fake-provider", "--bind", "127.0.0.1:0"])
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let pid = child
        .id()
        .ok_or_else(|| BenchError("the fake provider exited at once".to_owned()))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| BenchError("no stdout from the fake provider".to_owned()))?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .map_err(|_| BenchError("the fake provider did not start".to_owned()))??
        .unwrap_or_default();
    let base_url = line
        .split_whitespace()
        .find(|word| word.starts_with("http://"))
        .ok_or_else(|| BenchError(format!("unexpected fake provider output: {line}")))?
        .to_owned();
    Ok(FakeProcess {
        child,
        pid,
        base_url,
        _stdout: lines,
    })
}
