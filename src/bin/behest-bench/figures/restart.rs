//! Restart after a crash: behest is killed (SIGKILL) while its runs stream, and the next process
//! on the same database resumes them. Measured from the restart (the spawn) to `/readyz` 200, to
//! each run's `run_resumed` (the event's `timestamp` against the spawn's, same machine clock) and
//! to every run completed. Baseline: the same kill and restart over a database without runs
//! (spawn → ready). The figure has its own behest and database, with a short lease
//! ([`LEASE_TTL_MS`]) so that PostgreSQL — which takes a run over only once the dead process's
//! lease has expired — is quick. Each run is watched across the restart by a client that
//! reconnects with `Last-Event-ID`: it must see the whole log, without gap or duplicate.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio::sync::Semaphore;

use super::{CONNECT_CONCURRENCY, Ctx, MODEL_RESTART, MODELS, tag, wait_count};
use crate::check::{StreamCheck, StreamSummary, TERMINAL};
use crate::fake::token_text;
use crate::report::{Compare, Dist, Row, ms, say};
use crate::sse::{Frame, SseReader};
use crate::target::{Backend, BehestProcess, Database, Launch, config_toml};
use crate::{BenchError, Result};

/// `[runtime] lease_ttl_ms` of the figure's behest (the default is 15 s).
pub const LEASE_TTL_MS: u64 = 1000;
/// Text deltas every run has streamed when behest is killed.
const TOKENS_BEFORE_CRASH: u32 = 3;
/// `/readyz` poll interval while a restart is timed.
const READY_POLL: Duration = Duration::from_millis(2);
/// How long a watcher keeps trying to reconnect.
const RECONNECT_FOR: Duration = Duration::from_secs(60);

pub(super) async fn restart(ctx: &Ctx) -> Result<Vec<Row>> {
    let dir = ctx.dir.join("restart");
    std::fs::create_dir_all(&dir)?;
    let db = Database::create(ctx.backend, &dir, &ctx.postgres_url).await?;
    let config = dir.join("behest.toml");
    std::fs::write(
        &config,
        config_toml(&ctx.fake.base_url(), &MODELS, Some(LEASE_TTL_MS)),
    )?;
    let launch = Launch {
        binary: ctx.behest_bin.clone(),
        config,
        database_url: db.url.clone(),
        dir,
    };
    let result = crash_and_restart(ctx, &launch).await;
    db.drop_database().await;
    result
}

/// What one watcher saw across the restart.
struct Followed {
    run_id: String,
    summary: StreamSummary,
    /// The `timestamp` of its `run_resumed`.
    resumed_at: Option<DateTime<Utc>>,
    /// The `timestamp` of its terminal event.
    ended_at: Option<DateTime<Utc>>,
    reconnects: u32,
}

async fn crash_and_restart(ctx: &Ctx, launch: &Launch) -> Result<Vec<Row>> {
    let plan = &ctx.plan;
    let client = &ctx.client;
    let runs = plan.restart_runs.max(1);
    let tokens = plan.restart_profile.tokens;

    // The first start creates the schema; it is not measured.
    let mut behest = BehestProcess::spawn(launch, None, "behest-first.log")?;
    behest.wait_ready(client, READY_POLL).await?;
    let address = behest.address.clone();
    let base_url = behest.base_url.clone();

    // Baseline: the same crash and restart with no run in the database.
    let mut empty = Dist::default();
    for i in 0..plan.restart_baselines.max(1) {
        behest.kill().await?;
        behest = BehestProcess::spawn(launch, Some(&address), &format!("behest-empty-{i}.log"))?;
        let ready = behest.wait_ready(client, READY_POLL).await?;
        empty.push(ms(ready.duration_since(behest.spawned_at)));
    }

    // `runs` runs, each followed by a watcher; all of them streaming when behest is killed.
    let streaming = Arc::new(AtomicUsize::new(0));
    let permits = Arc::new(Semaphore::new(CONNECT_CONCURRENCY));
    let tasks: Vec<_> = (0..runs)
        .map(|_| {
            let ctx = ctx.clone();
            let base_url = base_url.clone();
            let streaming = streaming.clone();
            let permits = permits.clone();
            tokio::spawn(async move {
                let permit = permits.acquire_owned().await;
                let run_id = ctx
                    .create_run_at(&format!("{base_url}/runs"), MODEL_RESTART, &tag("restart"))
                    .await?;
                follow(&ctx, &base_url, run_id, permit.ok(), &streaming).await
            })
        })
        .collect();
    if let Err(error) = wait_count(
        &streaming,
        runs,
        Duration::from_secs(120),
        "runs streaming before the crash",
    )
    .await
    {
        say(&format!("behest log (tail):\n{}", behest.log_tail()));
        return Err(error);
    }

    behest.kill().await?;
    let mut behest = BehestProcess::spawn(launch, Some(&address), "behest-restarted.log")?;
    // The baseline of "every run completed": the same answer straight from the provider,
    // under the same load.
    let direct = {
        let ctx = ctx.clone();
        tokio::spawn(async move { ctx.direct_answer(MODEL_RESTART, tokens).await })
    };
    let ready = behest.wait_ready(client, READY_POLL).await?;
    let ready_ms = ms(ready.duration_since(behest.spawned_at));

    let mut followed = Vec::with_capacity(runs);
    for task in tasks {
        match task.await? {
            Ok(one) => followed.push(one),
            Err(error) => {
                say(&format!("behest log (tail):\n{}", behest.log_tail()));
                return Err(error);
            }
        }
    }
    let direct = direct.await??;
    let answer_ms = ms(direct.end.duration_since(direct.sent_at));

    let since_spawn = |at: DateTime<Utc>| {
        (at - behest.spawned_wall)
            .num_microseconds()
            .map_or(f64::MAX, |us| us as f64 / 1000.0)
    };
    let mut resumed = Dist::default();
    let mut ended = Dist::default();
    let mut reconnects = 0;
    for one in &followed {
        let label = format!("watcher of {} across the restart", one.run_id);
        ctx.checks.stream(&label, &one.summary);
        if one.summary.resumed != 1 {
            ctx.checks.fail(format!(
                "{label}: {} `run_resumed` events where exactly one was due",
                one.summary.resumed
            ));
        }
        match one.resumed_at {
            Some(at) => resumed.push(since_spawn(at)),
            None => ctx
                .checks
                .fail(format!("run {}: never resumed", one.run_id)),
        }
        if let Some(at) = one.ended_at {
            ended.push(since_spawn(at));
        }
        reconnects += one.reconnects;
        check_stored(ctx, &behest.base_url, one, tokens).await?;
    }
    behest.stop().await?;

    let label = format!("{runs} runs");
    let lease = match ctx.backend {
        Backend::Sqlite => {
            "SQLite: one process by design, every run is taken over at startup".to_owned()
        }
        Backend::Postgres => format!(
            "PostgreSQL: a run is taken over only once the dead process's lease expired \
             (lease_ttl_ms = {LEASE_TTL_MS}, renewed every ttl/3: 0.67–1 s after the kill), by \
             the recovery scan every ttl/3"
        ),
    };
    Ok(vec![
        Row::new(
            &format!("restart → /readyz 200 ({label} interrupted)"),
            "ms",
            Some(empty.p(50.0)),
            ready_ms,
            Compare::Difference,
        )
        .samples(1)
        .note(format!(
            "SIGKILL while {runs} runs stream, spawn on the same database; baseline: the same \
             restart with no run in the database (p50 of {}: {})",
            empty.len(),
            samples_text(&empty)
        )),
        Row::new(
            &format!("restart → first run_resumed ({label})"),
            "ms",
            None,
            resumed.p(0.0),
            Compare::None,
        )
        .samples(resumed.len())
        .note(format!(
            "the event's timestamp − the spawn's (same clock); {lease}"
        )),
        Row::new(
            &format!("restart → run_resumed p50 ({label})"),
            "ms",
            None,
            resumed.p(50.0),
            Compare::None,
        )
        .samples(resumed.len()),
        Row::new(
            &format!("restart → run_resumed p99 ({label})"),
            "ms",
            None,
            resumed.p(99.0),
            Compare::None,
        )
        .samples(resumed.len()),
        Row::new(
            &format!("restart → run_resumed max ({label})"),
            "ms",
            None,
            resumed.p(100.0),
            Compare::None,
        )
        .samples(resumed.len()),
        Row::new(
            &format!("restart → all {label} completed"),
            "ms",
            Some(answer_ms),
            ended.p(100.0),
            Compare::Difference,
        )
        .samples(ended.len())
        .note(format!(
            "each interrupted model call is made again from its first token: {tokens} tokens {} ms \
             apart; baseline: that answer straight from the provider; the {runs} watchers \
             reconnected {reconnects} times with Last-Event-ID",
            plan.restart_profile.interval.as_millis()
        )),
    ])
}

fn samples_text(dist: &Dist) -> String {
    let mut parts = Vec::new();
    for p in [0.0, 50.0, 100.0] {
        parts.push(format!("{:.1}", dist.p(p)));
    }
    format!("min/p50/max {} ms", parts.join("/"))
}

/// `GET /runs/{id}/events` (after `after` with `Last-Event-ID`), retried while behest is down.
async fn connect(ctx: &Ctx, base_url: &str, run_id: &str, after: Option<u64>) -> Result<SseReader> {
    let deadline = Instant::now() + RECONNECT_FOR;
    loop {
        let mut request = ctx.client.get(format!("{base_url}/runs/{run_id}/events"));
        if let Some(after) = after {
            request = request.header("Last-Event-ID", after.to_string());
        }
        let failure = match request.send().await {
            Ok(response) if response.status() == reqwest::StatusCode::OK => {
                return Ok(SseReader::new(response));
            }
            Ok(response) => format!("answered {}", response.status()),
            Err(error) => BenchError::from(error).0,
        };
        if Instant::now() > deadline {
            bail!(
                "GET /runs/{run_id}/events (Last-Event-ID {after:?}) failed for {} s: {failure}",
                RECONNECT_FOR.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Watches the run to its terminal event, reconnecting with `Last-Event-ID` whenever the
/// stream breaks (behest killed); counts the run as streaming once it has a few text deltas.
async fn follow(
    ctx: &Ctx,
    base_url: &str,
    run_id: String,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    streaming: &AtomicUsize,
) -> Result<Followed> {
    let mut permit = permit;
    let mut check = StreamCheck::new(0);
    let mut last = None;
    let mut terminal = false;
    let mut tokens = 0;
    let mut resumed_at = None;
    let mut ended_at = None;
    let mut reconnects = 0;
    loop {
        let mut reader = connect(ctx, base_url, &run_id, last).await?;
        permit.take();
        // A broken stream (an error or an early end) is what a crash looks like.
        while let Ok(Some(frame)) = reader.next().await {
            check.push(&frame);
            last = frame.id.or(last);
            match frame.event.as_str() {
                "text_delta" => {
                    tokens += 1;
                    if tokens == TOKENS_BEFORE_CRASH {
                        streaming.fetch_add(1, Ordering::AcqRel);
                    }
                }
                "run_resumed" => resumed_at = Some(timestamp(&frame)?),
                event if TERMINAL.contains(&event) => {
                    terminal = true;
                    ended_at = Some(timestamp(&frame)?);
                }
                _ => {}
            }
        }
        if terminal {
            break;
        }
        reconnects += 1;
    }
    let summary = check.finish(Some("run_completed"), Some(ctx.plan.restart_profile.tokens));
    Ok(Followed {
        run_id,
        summary,
        resumed_at,
        ended_at,
        reconnects,
    })
}

/// The envelope's `timestamp`.
fn timestamp(frame: &Frame) -> Result<DateTime<Utc>> {
    let data: serde_json::Value = serde_json::from_str(&frame.data)?;
    data["timestamp"]
        .as_str()
        .and_then(|text| text.parse().ok())
        .ok_or_else(|| BenchError(format!("a `{}` event without a timestamp", frame.event)))
}

/// The stored log read from the start equals what the watcher saw across the restart (one
/// `run_resumed`), and the run's output holds the answer once, without the abandoned text.
async fn check_stored(ctx: &Ctx, base_url: &str, one: &Followed, tokens: u32) -> Result<()> {
    let run_id = &one.run_id;
    let mut reader = connect(ctx, base_url, run_id, None).await?;
    let mut check = StreamCheck::new(0);
    while let Some(frame) = reader.next().await? {
        check.push(&frame);
    }
    let replay = check.finish(Some("run_completed"), Some(tokens));
    if replay.hash != one.summary.hash {
        ctx.checks.fail(format!(
            "run {run_id}: the stored log differs from what its watcher saw across the restart"
        ));
    }
    if replay.resumed != 1 {
        ctx.checks.fail(format!(
            "run {run_id}: {} `run_resumed` in the stored log where exactly one was due",
            replay.resumed
        ));
    }
    ctx.checks
        .stream(&format!("replay of resumed run {run_id}"), &replay);

    let response = ctx
        .client
        .get(format!("{base_url}/runs/{run_id}/output"))
        .send()
        .await?;
    if !response.status().is_success() {
        bail!("GET /runs/{run_id}/output answered {}", response.status());
    }
    let output: serde_json::Value = response.json().await?;
    let texts: Vec<&str> = output["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|message| message["content"].as_array().into_iter().flatten())
        .filter_map(|part| part["text"].as_str())
        .collect();
    let expected: String = (1..=tokens).map(token_text).collect();
    if output["status"] != "completed" || texts != [expected.as_str()] {
        ctx.checks.fail(format!(
            "run {run_id}: its output is not the one answer of {tokens} tokens (status {}, {} \
             text parts of {} chars)",
            output["status"],
            texts.len(),
            texts.iter().map(|t| t.len()).sum::<usize>()
        ));
    }
    Ok(())
}
