//! The figures: each drives the same load directly against the fake provider (the baseline)
//! and through behest, in the same process run, and reports the difference or the ratio.
//! Every stream read on the way goes through the hard check.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::sync::Semaphore;

use crate::check::{Checks, DirectCheck, StreamCheck, StreamSummary};
use crate::fake::{FakeProvider, Profile};
use crate::report::{Compare, Dist, Row, Target, ms};
use crate::sse::{Frame, SseReader};
use crate::target::{Backend, Database, rss_kib};
use crate::{BenchError, Result};

/// The model with the default profile (or the one given on the command line).
pub const MODEL_DEFAULT: &str = "fake-model";
/// Short runs for throughput.
pub const MODEL_SHORT: &str = "bench-short";
/// The default token count with no pacing (storage, resume).
pub const MODEL_FAST: &str = "bench-fast";
/// Gated, paced runs for fan-out.
pub const MODEL_FANOUT: &str = "bench-fanout";
/// Gated forever: runs that idle while watchers hold their streams.
pub const MODEL_IDLE: &str = "bench-idle";
/// A long answer, cancelled mid-stream.
pub const MODEL_CANCEL: &str = "bench-cancel";
/// Every model behest is configured with.
pub const MODELS: [&str; 6] = [
    MODEL_DEFAULT,
    MODEL_SHORT,
    MODEL_FAST,
    MODEL_FANOUT,
    MODEL_IDLE,
    MODEL_CANCEL,
];

/// Connections opened at once when many watchers connect.
const CONNECT_CONCURRENCY: usize = 128;

/// Sizes and durations of one bench run.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Smoke mode: tiny sizes, no targets.
    pub smoke: bool,
    /// The default model's profile.
    pub profile: Profile,
    /// Sequential runs for time to first token and gaps at 1 concurrent run.
    pub latency_runs: usize,
    /// Concurrent runs for gaps at 100 concurrent runs.
    pub concurrent_runs: usize,
    /// Waves of concurrent runs.
    pub concurrent_waves: usize,
    /// Tokens of a short run.
    pub short_tokens: u32,
    /// Clients running short runs back to back.
    pub short_concurrency: usize,
    /// How long the throughput load lasts.
    pub short_duration: Duration,
    /// Runs watched in the fan-out figure.
    pub fanout_runs: usize,
    /// Watchers in the fan-out figure (spread evenly over the runs).
    pub fanout_watchers: usize,
    /// Tokens per fan-out run.
    pub fanout_tokens: u32,
    /// Interval between fan-out tokens.
    pub fanout_interval: Duration,
    /// Runs the idle watchers watch.
    pub idle_runs: usize,
    /// Idle watchers.
    pub idle_watchers: usize,
    /// Resume samples.
    pub resume_samples: usize,
    /// Cancel samples.
    pub cancel_samples: usize,
    /// Runs written before measuring storage.
    pub storage_runs: usize,
}

impl Plan {
    /// The fake provider's profile of each bench model.
    pub fn profiles(&self) -> HashMap<String, Profile> {
        let cancel_interval = if self.smoke { 2 } else { 20 };
        HashMap::from([
            (MODEL_DEFAULT.to_owned(), self.profile),
            (MODEL_SHORT.to_owned(), Profile::ms(0, 0, self.short_tokens)),
            (
                MODEL_FAST.to_owned(),
                Profile::ms(0, 0, self.profile.tokens),
            ),
            (
                MODEL_FANOUT.to_owned(),
                Profile {
                    ttft: Duration::ZERO,
                    interval: self.fanout_interval,
                    tokens: self.fanout_tokens,
                    gated: true,
                },
            ),
            (MODEL_IDLE.to_owned(), Profile::ms(0, 1, 1).gated()),
            (
                MODEL_CANCEL.to_owned(),
                Profile::ms(0, cancel_interval, 100_000),
            ),
        ])
    }
}

/// Which figures to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Figure {
    /// Rows and bytes per run.
    Storage,
    /// Added time to first token at 1 concurrent run.
    Ttft,
    /// Added gap between events at 1 concurrent run.
    Gap1,
    /// Added gap between events at 100 concurrent runs.
    Gap100,
    /// Sustained short runs per second.
    Throughput,
    /// Events per second to many watchers of a few runs.
    Fanout,
    /// Memory per idle SSE watcher.
    IdleMemory,
    /// Reconnect with `Last-Event-ID` → first replayed event.
    Resume,
    /// Cancel request → provider connection closed.
    Cancel,
}

/// Everything a figure needs; cheap to clone into tasks.
#[derive(Clone)]
pub struct Ctx(Arc<Inner>);

/// What [`Ctx`] holds.
pub struct Inner {
    /// The fake provider (in this process).
    pub fake: Arc<FakeProvider>,
    /// behest's base URL.
    pub behest_url: String,
    /// behest's pid.
    pub behest_pid: u32,
    /// The HTTP client of the load driver.
    pub client: reqwest::Client,
    /// The hard check.
    pub checks: Arc<Checks>,
    /// Sizes.
    pub plan: Plan,
    /// The backend under test.
    pub backend: Backend,
}

impl std::ops::Deref for Ctx {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

/// When each token of one answer arrived.
#[derive(Debug, Clone)]
struct Trace {
    tag: String,
    sent_at: Instant,
    tokens: Vec<Instant>,
    end: Instant,
}

/// Time to first token, gaps between tokens and per-token delivery delay (provider write →
/// client read), in ms.
#[derive(Debug, Default, Clone)]
struct Latency {
    ttft: Dist,
    gaps: Dist,
    delay: Dist,
    total: Dist,
}

impl Latency {
    fn add(&mut self, trace: &Trace, sent: &[Instant]) {
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

fn tag(phase: &str) -> String {
    format!("behest-bench {phase} {}", uuid::Uuid::now_v7())
}

impl Ctx {
    /// A context over a running behest.
    pub fn new(inner: Inner) -> Self {
        Self(Arc::new(inner))
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.behest_url)
    }

    /// `POST /v1/chat/completions` on the fake provider, as behest would send it.
    async fn direct(&self, model: &str, tag: &str) -> Result<(Instant, SseReader)> {
        let body = json!({
            "model": model,
            "messages": [{"role": "user", "content": tag}],
            "stream": true,
            "stream_options": {"include_usage": true},
            "max_completion_tokens": 1024,
        });
        let sent_at = Instant::now();
        let response = self
            .client
            .post(format!("{}/chat/completions", self.fake.base_url()))
            .json(&body)
            .send()
            .await?;
        if !response.status().is_success() {
            bail!("the fake provider answered {}", response.status());
        }
        Ok((sent_at, SseReader::new(response)))
    }

    /// `POST /runs/stream`: the run's id and its event stream.
    async fn stream_run(&self, model: &str, tag: &str) -> Result<(Instant, String, SseReader)> {
        let sent_at = Instant::now();
        let response = self
            .client
            .post(self.url("/runs/stream"))
            .json(&json!({"provider": "fake", "model": model, "input": tag}))
            .send()
            .await?;
        if response.status() != reqwest::StatusCode::OK {
            let status = response.status();
            let body = response.text().await.unwrap_or_default();
            bail!("POST /runs/stream answered {status}: {body}");
        }
        let run_id = response
            .headers()
            .get("x-run-id")
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| BenchError("POST /runs/stream without X-Run-Id".to_owned()))?
            .to_owned();
        Ok((sent_at, run_id, SseReader::new(response)))
    }

    /// `POST /runs`: the new run's id.
    async fn create_run(&self, model: &str, tag: &str) -> Result<String> {
        let response = self
            .client
            .post(self.url("/runs"))
            .json(&json!({"provider": "fake", "model": model, "input": tag}))
            .send()
            .await?;
        if response.status() != reqwest::StatusCode::ACCEPTED {
            let status = response.status();
            let body = response.text().await.unwrap_or_default();
            bail!("POST /runs answered {status}: {body}");
        }
        let body: serde_json::Value = response.json().await?;
        body["run_id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| BenchError("POST /runs without run_id".to_owned()))
    }

    /// `GET /runs/{id}/events`, resuming after `after` with `Last-Event-ID`.
    async fn watch(&self, run_id: &str, after: Option<u64>) -> Result<SseReader> {
        let mut request = self.client.get(self.url(&format!("/runs/{run_id}/events")));
        if let Some(after) = after {
            request = request.header("Last-Event-ID", after.to_string());
        }
        let response = request.send().await?;
        if response.status() != reqwest::StatusCode::OK {
            bail!("GET /runs/{run_id}/events answered {}", response.status());
        }
        Ok(SseReader::new(response))
    }

    async fn cancel(&self, run_id: &str) -> Result<()> {
        let response = self
            .client
            .post(self.url(&format!("/runs/{run_id}/cancel")))
            .send()
            .await?;
        if !response.status().is_success() {
            bail!("POST /runs/{run_id}/cancel answered {}", response.status());
        }
        Ok(())
    }

    fn sent(&self, tag: &str) -> Vec<Instant> {
        self.fake
            .exchange(tag)
            .map(|e| e.snapshot().token_sent)
            .unwrap_or_default()
    }

    /// One whole answer read directly from the fake provider.
    async fn direct_answer(&self, model: &str, tokens: u32) -> Result<Trace> {
        let tag = tag("direct");
        let (sent_at, mut reader) = self.direct(model, &tag).await?;
        let mut check = DirectCheck::default();
        let mut arrivals = Vec::with_capacity(tokens as usize);
        while let Some(frame) = reader.next().await? {
            if check.push(&frame) {
                arrivals.push(frame.at);
            }
        }
        let end = Instant::now();
        self.checks
            .stream(&format!("direct answer {tag}"), &check.finish(tokens));
        Ok(Trace {
            tag,
            sent_at,
            tokens: arrivals,
            end,
        })
    }

    /// One whole run through `POST /runs/stream`.
    async fn behest_run(&self, model: &str, tokens: u32) -> Result<Trace> {
        let tag = tag("run");
        let (sent_at, run_id, mut reader) = self.stream_run(model, &tag).await?;
        let mut check = StreamCheck::new(0);
        let mut arrivals = Vec::with_capacity(tokens as usize);
        let mut end = sent_at;
        while let Some(frame) = reader.next().await? {
            check.push(&frame);
            if frame.event == "text_delta" {
                arrivals.push(frame.at);
            }
            end = frame.at;
        }
        self.checks.stream(
            &format!("run {run_id}"),
            &check.finish(Some("run_completed"), Some(tokens)),
        );
        Ok(Trace {
            tag,
            sent_at,
            tokens: arrivals,
            end,
        })
    }

    async fn answer(&self, via_behest: bool, model: &str, tokens: u32) -> Result<Trace> {
        if via_behest {
            self.behest_run(model, tokens).await
        } else {
            self.direct_answer(model, tokens).await
        }
    }
}

/// Measures the selected figures on one backend; storage first, while the database holds only
/// its runs.
pub async fn measure(ctx: &Ctx, db: &Database, figures: &[Figure]) -> Result<Vec<Row>> {
    let wants = |figure: Figure| figures.contains(&figure);
    let mut rows = Vec::new();
    let step = |name: &str| crate::report::say(&format!("  [{}] {name}…", ctx.backend.name()));
    if wants(Figure::Storage) {
        step("storage per run");
        rows.extend(storage(ctx, db).await?);
    }
    if wants(Figure::Ttft) || wants(Figure::Gap1) {
        step("time to first token and gaps at 1 concurrent run");
        rows.extend(latency_one(ctx, wants(Figure::Ttft), wants(Figure::Gap1)).await?);
    }
    if wants(Figure::Gap100) {
        step("gaps at 100 concurrent runs");
        rows.extend(latency_concurrent(ctx).await?);
    }
    if wants(Figure::Resume) {
        step("resume");
        rows.extend(resume(ctx).await?);
    }
    if wants(Figure::Cancel) {
        step("cancel");
        rows.extend(cancel(ctx).await?);
    }
    if wants(Figure::Throughput) {
        step("sustained short runs");
        rows.extend(throughput(ctx).await?);
    }
    if wants(Figure::Fanout) {
        step("fan-out to many watchers");
        rows.extend(fanout(ctx).await?);
    }
    if wants(Figure::IdleMemory) {
        step("memory per idle watcher");
        rows.extend(idle_memory(ctx).await?);
    }
    for row in &mut rows {
        row.backend = ctx.backend.name().to_owned();
    }
    Ok(rows)
}

async fn storage(ctx: &Ctx, db: &Database) -> Result<Vec<Row>> {
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

async fn latency_one(ctx: &Ctx, ttft: bool, gaps: bool) -> Result<Vec<Row>> {
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
            .target(Target::AtMost(2.0))
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

async fn wave(ctx: &Ctx, via_behest: bool, runs: usize, model: &'static str) -> Result<Latency> {
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

async fn latency_concurrent(ctx: &Ctx) -> Result<Vec<Row>> {
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
    rows.push(
        Row::new(
            &format!("time to first token p99 ({label})"),
            "ms",
            Some(base.ttft.p(99.0)),
            behest.ttft.p(99.0),
            Compare::Difference,
        )
        .samples(behest.ttft.len()),
    );
    Ok(rows)
}

async fn resume(ctx: &Ctx) -> Result<Vec<Row>> {
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

async fn cancel(ctx: &Ctx) -> Result<Vec<Row>> {
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

async fn throughput(ctx: &Ctx) -> Result<Vec<Row>> {
    let plan = &ctx.plan;
    let (base_rate, base_latency) = closed_loop(ctx, false).await?;
    let (rate, latency) = closed_loop(ctx, true).await?;
    let label = format!(
        "{} tokens, {} clients",
        plan.short_tokens, plan.short_concurrency
    );
    let mut row = Row::new(
        &format!("sustained short runs per second ({label})"),
        "runs/s",
        Some(base_rate),
        rate,
        Compare::Ratio,
    )
    .samples(latency.len())
    .note("baseline: the same answers straight from the fake provider");
    if ctx.backend == Backend::Sqlite {
        row = row.target_absolute(Target::AtLeast(150.0));
    }
    Ok(vec![
        row,
        Row::new(
            &format!("short run duration p50 ({label})"),
            "ms",
            Some(base_latency.p(50.0)),
            latency.p(50.0),
            Compare::Difference,
        )
        .samples(latency.len()),
        Row::new(
            &format!("short run duration p99 ({label})"),
            "ms",
            Some(base_latency.p(99.0)),
            latency.p(99.0),
            Compare::Difference,
        )
        .samples(latency.len()),
    ])
}

/// Clients run short answers back to back for the plan's duration: answers per second and
/// their durations.
async fn closed_loop(ctx: &Ctx, via_behest: bool) -> Result<(f64, Dist)> {
    let plan = &ctx.plan;
    let started = Instant::now();
    let deadline = started + plan.short_duration;
    let tasks: Vec<_> = (0..plan.short_concurrency)
        .map(|_| {
            let ctx = ctx.clone();
            tokio::spawn(async move {
                let mut durations = Dist::default();
                while Instant::now() < deadline {
                    let trace = ctx
                        .answer(via_behest, MODEL_SHORT, ctx.plan.short_tokens)
                        .await?;
                    durations.push(ms(trace.end.duration_since(trace.sent_at)));
                }
                Ok::<_, BenchError>(durations)
            })
        })
        .collect();
    let mut durations = Dist::default();
    for task in tasks {
        durations.extend(&task.await??);
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok((durations.len() as f64 / elapsed, durations))
}

/// What one fan-out watcher saw.
struct Watched {
    run: usize,
    frames: Vec<Instant>,
    tokens: Vec<Instant>,
    summary: StreamSummary,
}

async fn wait_count(
    counter: &AtomicUsize,
    target: usize,
    timeout: Duration,
    what: &str,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while counter.load(Ordering::Acquire) < target {
        if Instant::now() > deadline {
            bail!(
                "{what}: only {} of {target} ready after {} s",
                counter.load(Ordering::Acquire),
                timeout.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Frames delivered per second after `open`, and how many.
fn delivery(open: Instant, frames: &[Vec<Instant>]) -> (f64, usize) {
    let mut count = 0;
    let mut last = open;
    for watcher in frames {
        for &at in watcher {
            if at >= open {
                count += 1;
                last = last.max(at);
            }
        }
    }
    let seconds = last.duration_since(open).as_secs_f64().max(1e-3);
    (count as f64 / seconds, count)
}

async fn fanout(ctx: &Ctx) -> Result<Vec<Row>> {
    let plan = &ctx.plan;
    let watchers = plan.fanout_watchers;
    let runs = plan.fanout_runs.max(1);
    let tokens = plan.fanout_tokens;

    // Baseline: every watcher is its own request to the fake provider.
    let ready = Arc::new(AtomicUsize::new(0));
    let permits = Arc::new(Semaphore::new(CONNECT_CONCURRENCY));
    let tasks: Vec<_> = (0..watchers)
        .map(|_| {
            let ctx = ctx.clone();
            let ready = ready.clone();
            let permits = permits.clone();
            tokio::spawn(async move {
                let tag = tag("fanout-direct");
                let permit = permits.acquire_owned().await;
                let (_, mut reader) = ctx.direct(MODEL_FANOUT, &tag).await?;
                drop(permit);
                ready.fetch_add(1, Ordering::AcqRel);
                let mut check = DirectCheck::default();
                let mut frames = Vec::with_capacity(tokens as usize + 4);
                let mut arrivals = Vec::with_capacity(tokens as usize);
                while let Some(frame) = reader.next().await? {
                    frames.push(frame.at);
                    if check.push(&frame) {
                        arrivals.push(frame.at);
                    }
                }
                ctx.checks
                    .stream(&format!("direct fan-out {tag}"), &check.finish(tokens));
                Ok::<_, BenchError>((tag, frames, arrivals))
            })
        })
        .collect();
    wait_count(&ready, watchers, Duration::from_secs(120), "direct fan-out").await?;
    let open = Instant::now();
    ctx.fake.open_gate(MODEL_FANOUT);
    let mut base_frames = Vec::new();
    let mut base_lag = Dist::default();
    for task in tasks {
        let (tag, frames, arrivals) = task.await??;
        for (arrived, written) in arrivals.iter().zip(ctx.sent(&tag)) {
            base_lag.push(ms(arrived.saturating_duration_since(written)));
        }
        base_frames.push(frames);
    }
    ctx.fake.close_gate(MODEL_FANOUT);
    let (base_rate, _) = delivery(open, &base_frames);
    drop(base_frames);

    // behest: `runs` runs, each watched by watchers / runs clients.
    let mut run_ids = Vec::new();
    let mut tags = Vec::new();
    for _ in 0..runs {
        let run_tag = tag("fanout");
        run_ids.push(ctx.create_run(MODEL_FANOUT, &run_tag).await?);
        tags.push(run_tag);
    }
    let run_ids = Arc::new(run_ids);
    let ready = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..watchers)
        .map(|w| {
            let ctx = ctx.clone();
            let ready = ready.clone();
            let permits = permits.clone();
            let run_ids = run_ids.clone();
            tokio::spawn(async move {
                let run = w % run_ids.len();
                let permit = permits.acquire_owned().await;
                let mut reader = ctx.watch(&run_ids[run], None).await?;
                let mut permit = Some(permit);
                let mut check = StreamCheck::new(0);
                let mut frames = Vec::with_capacity(tokens as usize + 8);
                let mut arrivals = Vec::with_capacity(tokens as usize);
                while let Some(frame) = reader.next().await? {
                    check.push(&frame);
                    frames.push(frame.at);
                    if frame.event == "text_delta" {
                        arrivals.push(frame.at);
                    }
                    if frame.event == "model_started" && permit.take().is_some() {
                        ready.fetch_add(1, Ordering::AcqRel);
                    }
                }
                let summary = check.finish(Some("run_completed"), Some(tokens));
                Ok::<_, BenchError>(Watched {
                    run,
                    frames,
                    tokens: arrivals,
                    summary,
                })
            })
        })
        .collect();
    wait_count(
        &ready,
        watchers,
        Duration::from_secs(300),
        "behest fan-out watchers",
    )
    .await?;
    let open = Instant::now();
    ctx.fake.open_gate(MODEL_FANOUT);
    let mut watched = Vec::new();
    for task in tasks {
        watched.push(task.await??);
    }
    ctx.fake.close_gate(MODEL_FANOUT);
    let sent: Vec<Vec<Instant>> = tags.iter().map(|t| ctx.sent(t)).collect();
    let mut lag = Dist::default();
    let mut hashes: Vec<Option<u64>> = vec![None; runs];
    for watcher in &watched {
        ctx.checks.stream(
            &format!("fan-out watcher of {}", run_ids[watcher.run]),
            &watcher.summary,
        );
        for (arrived, written) in watcher.tokens.iter().zip(&sent[watcher.run]) {
            lag.push(ms(arrived.saturating_duration_since(*written)));
        }
        match hashes[watcher.run] {
            None => hashes[watcher.run] = Some(watcher.summary.hash),
            Some(hash) if hash != watcher.summary.hash => ctx.checks.fail(format!(
                "watchers of run {} received different events",
                run_ids[watcher.run]
            )),
            Some(_) => {}
        }
    }
    // What the store replays must be what the watchers saw live.
    for (run, run_id) in run_ids.iter().enumerate() {
        let mut reader = ctx.watch(run_id, None).await?;
        let mut check = StreamCheck::new(0);
        while let Some(frame) = reader.next().await? {
            check.push(&frame);
        }
        let summary = check.finish(Some("run_completed"), Some(tokens));
        if hashes[run].is_some_and(|hash| hash != summary.hash) {
            ctx.checks.fail(format!(
                "run {run_id}: the replay differs from the live stream"
            ));
        }
        ctx.checks.stream(&format!("replay of {run_id}"), &summary);
    }
    let frames: Vec<Vec<Instant>> = watched.into_iter().map(|w| w.frames).collect();
    let (rate, count) = delivery(open, &frames);
    // Every watcher gets one token event per interval.
    let offered = watchers as f64 / plan.fanout_interval.as_secs_f64().max(1e-3);
    let label = format!("{watchers} watchers of {runs} runs");
    Ok(vec![
        Row::new(
            &format!("events/s delivered ({label})"),
            "events/s",
            Some(base_rate),
            rate,
            Compare::Ratio,
        )
        .target_absolute(Target::AtLeast(50_000.0))
        .samples(count)
        .note(format!(
            "tokens every {} ms per run: ≈{offered:.0} token events/s offered; baseline: {watchers} \
             direct streams from the fake provider",
            plan.fanout_interval.as_millis()
        )),
        Row::new(
            &format!("delivery lag p50 ({label})"),
            "ms",
            Some(base_lag.p(50.0)),
            lag.p(50.0),
            Compare::Difference,
        )
        .samples(lag.len())
        .note("provider writes token k → watcher reads it"),
        Row::new(
            &format!("delivery lag p99 ({label})"),
            "ms",
            Some(base_lag.p(99.0)),
            lag.p(99.0),
            Compare::Difference,
        )
        .target_absolute(Target::AtMost(100.0))
        .samples(lag.len()),
    ])
}

async fn idle_memory(ctx: &Ctx) -> Result<Vec<Row>> {
    let plan = &ctx.plan;
    let watchers = plan.idle_watchers;
    let base = idle_direct(ctx, watchers).await?;

    let mut run_ids = Vec::new();
    for _ in 0..plan.idle_runs.max(1) {
        let run_tag = tag("idle");
        run_ids.push(ctx.create_run(MODEL_IDLE, &run_tag).await?);
        if ctx
            .fake
            .wait_exchange(&run_tag, Duration::from_secs(10))
            .await
            .is_none()
        {
            bail!("an idle run never called the provider");
        }
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
        .target_absolute(Target::AtMost(16.0))
        .samples(watchers)
        .note(format!(
            "behest RSS {before} → {after} KiB; baseline: RSS per idle stream of the fake provider \
             as its own process"
        )),
    ])
}

/// RSS per idle streaming request of the fake provider run as its own process (KiB).
async fn idle_direct(ctx: &Ctx, streams: usize) -> Result<f64> {
    use tokio::io::AsyncBufReadExt;
    let exe = std::env::current_exe()?;
    let mut child = tokio::process::Command::new(exe)
        .args([
            "fake-provider",
            "--bind",
            "127.0.0.1:0",
            "--ttft-ms",
            "3600000",
            "--tokens",
            "1",
        ])
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
