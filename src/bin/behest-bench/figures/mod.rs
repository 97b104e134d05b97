//! The figures: each drives the same load directly against the fake provider (the baseline)
//! and through behest, in the same process run, and reports the difference or the ratio.
//! Every stream read on the way goes through the hard check. One file per figure family; this
//! one holds the plan, the load driver's requests and the order figures run in.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::check::{Checks, DirectCheck, StreamCheck};
use crate::fake::{FakeProvider, Profile};
use crate::report::Row;
use crate::sse::SseReader;
use crate::target::{Backend, Database};
use crate::{BenchError, Result};

mod cancel;
mod compaction;
mod fanout;
mod formats;
mod idle_memory;
mod latency;
mod long_session;
mod ops;
mod replicas;
mod restart;
mod resume;
mod storage;
mod throughput;
mod tool_progress;
mod watchers_per_core;
mod webhooks;

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
/// Gated, one token per second for an hour: watchers per core at 1 event/s.
pub const MODEL_PER_CORE: &str = "bench-per-core";
/// A long answer, cancelled mid-stream.
pub const MODEL_CANCEL: &str = "bench-cancel";
/// A slow answer, interrupted by a crash mid-stream and resumed by the next process.
pub const MODEL_RESTART: &str = "bench-restart";
/// Long sessions against a small window (8,000 tokens), no pacing: compaction.
pub const MODEL_COMPACT: &str = "bench-compact";
/// One long session, no pacing, 40-token answers: the start of a run against its session's
/// length.
pub const MODEL_LONG: &str = "bench-long";
/// The context window of [`MODEL_COMPACT`], in tokens (the other models have 128,000).
pub const COMPACT_WINDOW: u32 = 8_000;
/// Every model behest is configured with.
pub const MODELS: [&str; 10] = [
    MODEL_DEFAULT,
    MODEL_SHORT,
    MODEL_FAST,
    MODEL_FANOUT,
    MODEL_IDLE,
    MODEL_PER_CORE,
    MODEL_CANCEL,
    MODEL_RESTART,
    MODEL_COMPACT,
    MODEL_LONG,
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
    /// Slow runs the watchers-per-core figure watches.
    pub per_core_runs: usize,
    /// Watchers of the slow runs, one event per second each.
    pub per_core_watchers: usize,
    /// How long their CPU time is measured.
    pub per_core_window: Duration,
    /// Resume samples.
    pub resume_samples: usize,
    /// Cancel samples.
    pub cancel_samples: usize,
    /// Runs written before measuring storage.
    pub storage_runs: usize,
    /// Runs interrupted by the crash in the restart figure.
    pub restart_runs: usize,
    /// Restarts over an empty database (the restart figure's baseline).
    pub restart_baselines: usize,
    /// The slow answer the restart figure interrupts.
    pub restart_profile: Profile,
    /// Runs watched on two replicas at once (live latency across replicas).
    pub replica_latency_runs: usize,
    /// Kills of a replica in the failover figure.
    pub replica_kills: usize,
    /// Idle watchers on one replica of a run waiting on the other (database load).
    pub replica_idle_watchers: usize,
    /// Short runs timed over the delayed and the loopback database link.
    pub replica_link_runs: usize,
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
                MODEL_PER_CORE.to_owned(),
                Profile {
                    ttft: Duration::ZERO,
                    interval: watchers_per_core::PER_CORE_INTERVAL,
                    tokens: 3600,
                    gated: true,
                },
            ),
            (
                MODEL_CANCEL.to_owned(),
                Profile::ms(0, cancel_interval, 100_000),
            ),
            (MODEL_RESTART.to_owned(), self.restart_profile),
            (
                MODEL_COMPACT.to_owned(),
                Profile::ms(0, 0, self.profile.tokens),
            ),
            (
                MODEL_LONG.to_owned(),
                Profile::ms(0, 0, long_session::LONG_TOKENS),
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
    /// Watchers one core keeps fed at one event per second each.
    WatchersPerCore,
    /// Reconnect with `Last-Event-ID` → first replayed event.
    Resume,
    /// Cancel request → provider connection closed.
    Cancel,
    /// SIGKILL with runs mid-stream, restart → ready, runs resumed, runs completed.
    Restart,
    /// The compaction check per model call at 10, 100 and 1,000 messages; the summariser's
    /// cost for a 200-turn session.
    Compaction,
    /// Time to first token and gaps with API keys, metrics and OTLP tracing on vs off.
    Ops,
    /// Time to first token and gaps of runs without a webhook, `[webhooks]` on vs off.
    Webhooks,
    /// Request → `model_started` at a session's 1,000th turn against its first.
    LongSession,
    /// Server CPU per event in each `?format=` rendering against behest's own format.
    Formats,
    /// Server CPU per `tool_progress` event against a `text_delta` (a behest of its own with
    /// the built-in model and `wait` tool).
    ToolProgress,
    /// Two replicas on one PostgreSQL: live latency across replicas, cancel on another
    /// replica, failover after a kill, database load of idle watchers, a slower database link.
    Replicas,
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
    /// The behest binary (the restart figure starts its own processes).
    pub behest_bin: PathBuf,
    /// The bench's temp directory for this backend.
    pub dir: PathBuf,
    /// The PostgreSQL server fresh databases are created on.
    pub postgres_url: String,
    /// The API key sent as `Authorization: Bearer` (the ops figure's behest with keys).
    pub api_key: Option<String>,
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

    /// The same context aimed at another behest (`url`, `pid`), sending `api_key`.
    fn aimed_at(&self, url: &str, pid: u32, api_key: Option<&str>) -> Self {
        Self::new(Inner {
            fake: self.fake.clone(),
            behest_url: url.to_owned(),
            behest_pid: pid,
            client: self.client.clone(),
            checks: self.checks.clone(),
            plan: self.plan.clone(),
            backend: self.backend,
            behest_bin: self.behest_bin.clone(),
            dir: self.dir.clone(),
            postgres_url: self.postgres_url.clone(),
            api_key: api_key.map(str::to_owned),
        })
    }

    /// `request` with the API key, when there is one.
    fn keyed(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(key) => request.bearer_auth(key),
            None => request,
        }
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

    /// `POST /runs/stream` of `body`: when the request was sent, and the 200 response.
    async fn post_stream(&self, body: &serde_json::Value) -> Result<(Instant, reqwest::Response)> {
        let sent_at = Instant::now();
        let response = self
            .keyed(self.client.post(self.url("/runs/stream")))
            .json(body)
            .send()
            .await?;
        if response.status() != reqwest::StatusCode::OK {
            let status = response.status();
            let text = response.text().await.unwrap_or_default();
            bail!("POST /runs/stream answered {status}: {text}");
        }
        Ok((sent_at, response))
    }

    /// `POST /runs/stream`: the run's id and its event stream.
    async fn stream_run(&self, model: &str, tag: &str) -> Result<(Instant, String, SseReader)> {
        let (sent_at, response) = self
            .post_stream(&json!({"provider": "fake", "model": model, "input": tag}))
            .await?;
        let run_id = response
            .headers()
            .get("x-run-id")
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| BenchError("POST /runs/stream without X-Run-Id".to_owned()))?
            .to_owned();
        Ok((sent_at, run_id, SseReader::new(response)))
    }

    /// `POST /runs/stream` of `input` in `session` (a new session when `None`): when the
    /// request was sent, and the run's event stream.
    async fn stream_turn(
        &self,
        model: &str,
        input: &str,
        session: Option<&str>,
    ) -> Result<(Instant, SseReader)> {
        let mut body = json!({"provider": "fake", "model": model, "input": input});
        if let Some(session) = session {
            body["session_id"] = json!(session);
        }
        let (sent_at, response) = self.post_stream(&body).await?;
        Ok((sent_at, SseReader::new(response)))
    }

    /// `POST /runs`: the new run's id.
    async fn create_run(&self, model: &str, tag: &str) -> Result<String> {
        self.create_run_at(&self.url("/runs"), model, tag).await
    }

    /// `POST /runs` of gated `model`, its gate closed: the run's tag (from `phase`) and id, once
    /// its model call waits at the provider's gate.
    async fn create_held_run(&self, model: &str, phase: &str) -> Result<(String, String)> {
        self.fake.close_gate(model);
        let run_tag = tag(phase);
        let run_id = self.create_run(model, &run_tag).await?;
        if self
            .fake
            .wait_exchange(&run_tag, Duration::from_secs(10))
            .await
            .is_none()
        {
            bail!("run {run_id} of {model}: no model call");
        }
        Ok((run_tag, run_id))
    }

    /// `POST` of a run to `runs_url` (a `…/runs` URL, e.g. of a restarted behest): its id.
    async fn create_run_at(&self, runs_url: &str, model: &str, tag: &str) -> Result<String> {
        let response = self
            .keyed(self.client.post(runs_url))
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
        let mut request = self.keyed(self.client.get(self.url(&format!("/runs/{run_id}/events"))));
        if let Some(after) = after {
            request = request.header("Last-Event-ID", after.to_string());
        }
        Self::events(request).await
    }

    /// `GET /runs/{id}/events?format={format}` from the start.
    async fn watch_as(&self, run_id: &str, format: &str) -> Result<SseReader> {
        let path = format!("/runs/{run_id}/events?format={format}");
        Self::events(self.keyed(self.client.get(self.url(&path)))).await
    }

    /// The event stream `request` (a `GET` of a run's events) answers.
    async fn events(request: reqwest::RequestBuilder) -> Result<SseReader> {
        let response = request.send().await?;
        if response.status() != reqwest::StatusCode::OK {
            let url = response.url().path().to_owned();
            bail!("GET {url} answered {}", response.status());
        }
        Ok(SseReader::new(response))
    }

    async fn cancel(&self, run_id: &str) -> Result<()> {
        let response = self
            .keyed(
                self.client
                    .post(self.url(&format!("/runs/{run_id}/cancel"))),
            )
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
        rows.extend(storage::storage(ctx, db).await?);
    }
    if wants(Figure::Ttft) || wants(Figure::Gap1) {
        step("time to first token and gaps at 1 concurrent run");
        rows.extend(latency::latency_one(ctx, wants(Figure::Ttft), wants(Figure::Gap1)).await?);
    }
    if wants(Figure::Gap100) {
        step("gaps at 100 concurrent runs");
        rows.extend(latency::latency_concurrent(ctx).await?);
    }
    if wants(Figure::Formats) {
        step("formats");
        rows.extend(formats::formats(ctx).await?);
    }
    if wants(Figure::ToolProgress) {
        step("tool progress");
        rows.extend(tool_progress::tool_progress(ctx).await?);
    }
    if wants(Figure::Resume) {
        step("resume");
        rows.extend(resume::resume(ctx).await?);
    }
    if wants(Figure::Cancel) {
        step("cancel");
        rows.extend(cancel::cancel(ctx).await?);
    }
    if wants(Figure::Restart) {
        step("restart after a crash");
        rows.extend(restart::restart(ctx).await?);
    }
    if wants(Figure::Compaction) {
        step("compaction check and a 200-turn session");
        rows.extend(compaction::check(ctx));
        rows.extend(compaction::session_cost(ctx).await?);
    }
    if wants(Figure::LongSession) {
        step("a 1,000-turn session");
        rows.extend(long_session::long_session(ctx).await?);
    }
    if wants(Figure::Ops) {
        step("auth, metrics and tracing on vs off");
        rows.extend(ops::overhead(ctx).await?);
    }
    if wants(Figure::Webhooks) {
        step("webhooks on vs off, runs without one");
        rows.extend(webhooks::overhead(ctx).await?);
    }
    if wants(Figure::Replicas) && ctx.backend == Backend::Postgres {
        step("two replicas on one PostgreSQL");
        rows.extend(replicas::replicas(ctx).await?);
    }
    if wants(Figure::Throughput) {
        step("sustained short runs");
        rows.extend(throughput::throughput(ctx).await?);
    }
    if wants(Figure::Fanout) {
        step("fan-out to many watchers");
        rows.extend(fanout::fanout(ctx).await?);
    }
    if wants(Figure::IdleMemory) {
        step("memory per idle watcher");
        rows.extend(idle_memory::idle_memory(ctx).await?);
    }
    if wants(Figure::WatchersPerCore) {
        step("watchers per core at 1 event/s");
        rows.extend(watchers_per_core::watchers_per_core(ctx).await?);
    }
    for row in &mut rows {
        row.backend = ctx.backend.name().to_owned();
    }
    Ok(rows)
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
