//! `behest-bench`: what behest costs on top of the model, measured against the model itself.
//!
//! `behest-bench fake-provider` serves a paced fake OpenAI Chat Completions provider (also handy
//! to try behest without an API key). `behest-bench run` starts that provider in-process,
//! `behest serve` as a child process over a fresh SQLite or PostgreSQL database, and measures
//! each figure twice in the same run — directly against the provider (the baseline) and through
//! behest — reporting the difference or the ratio. Every stream read is checked for lost,
//! duplicated or reordered events; any violation makes the command fail. See `BENCHMARKS.md`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};

/// Why the bench stopped.
#[derive(Debug)]
pub struct BenchError(pub String);

impl std::fmt::Display for BenchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl<E: std::error::Error> From<E> for BenchError {
    fn from(error: E) -> Self {
        let mut message = error.to_string();
        let mut source = error.source();
        while let Some(cause) = source {
            message.push_str(": ");
            message.push_str(&cause.to_string());
            source = cause.source();
        }
        Self(message)
    }
}

/// Bench results.
pub type Result<T> = std::result::Result<T, BenchError>;

/// Returns a [`BenchError`] built like `format!`.
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::BenchError(format!($($arg)*)))
    };
}

mod check;
mod fake;
mod figures;
mod report;
mod sse;
mod target;

use check::Checks;
use fake::{FakeProvider, Profile};
use figures::{Ctx, Figure, Inner, MODELS, Plan};
use report::{Compare, Row, Target, say};
use target::{Backend, BehestProcess, Database};

/// behest-bench: behest's latency, throughput and memory on top of a paced fake model.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve a paced fake OpenAI Chat Completions provider (`POST /v1/chat/completions`) until
    /// Ctrl-C. Configure behest with `base_url = "http://ADDR/v1"` and any model name.
    FakeProvider {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:8090")]
        bind: String,
        /// Time to first token, ms.
        #[arg(long, default_value_t = 200)]
        ttft_ms: u64,
        /// Interval between tokens, ms.
        #[arg(long, default_value_t = 20)]
        interval_ms: u64,
        /// Tokens per answer.
        #[arg(long, default_value_t = 64)]
        tokens: u32,
    },
    /// Measure every figure (or `--only` some) against behest on SQLite and/or PostgreSQL.
    Run(Box<RunArgs>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    Sqlite,
    Postgres,
    Both,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Storage backend(s) behest runs on.
    #[arg(long, value_enum, default_value = "both")]
    backend: BackendArg,
    /// Tiny sizes and fast pacing: checks that the bench works and loses no events (CI).
    /// Timings are printed but mean nothing.
    #[arg(long)]
    smoke: bool,
    /// Only these figures (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Figure>,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// The behest binary [default: `behest` next to this executable].
    #[arg(long, env = "BEHEST_BENCH_BEHEST_BIN")]
    behest_bin: Option<PathBuf>,
    /// PostgreSQL server where a fresh database is created (and dropped afterwards).
    #[arg(
        long,
        env = "BEHEST_BENCH_POSTGRES_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    postgres_url: String,
    /// Time to first token of the default profile, ms [default: 200; smoke 1].
    #[arg(long)]
    ttft_ms: Option<u64>,
    /// Interval between tokens of the default profile, ms [default: 20; smoke 1].
    #[arg(long)]
    interval_ms: Option<u64>,
    /// Tokens per answer of the default profile [default: 64; smoke 5].
    #[arg(long)]
    tokens: Option<u32>,
    /// Sequential runs for time to first token at 1 concurrent run [default: 30; smoke 2].
    #[arg(long)]
    latency_runs: Option<usize>,
    /// Clients running short runs back to back [default: 32; smoke 2].
    #[arg(long)]
    short_concurrency: Option<usize>,
    /// Seconds of sustained short runs [default: 10; smoke 1].
    #[arg(long)]
    short_seconds: Option<u64>,
    /// Interval between tokens of the fan-out runs, ms [default: 8, ≈125,000 events/s to 1,000 watchers; smoke 1].
    #[arg(long)]
    fanout_interval_ms: Option<u64>,
    /// Idle watchers [default: 10000; smoke 50].
    #[arg(long)]
    idle_watchers: Option<usize>,
    /// Watchers of slow runs (one event per second each) in the watchers-per-core figure
    /// [default: 10000; smoke 20].
    #[arg(long)]
    per_core_watchers: Option<usize>,
    /// Runs interrupted by the crash in the restart figure [default: 100; smoke 5].
    #[arg(long)]
    restart_runs: Option<usize>,
    /// Kills of a replica in the replicas figure's failover [default: 20; smoke 2].
    #[arg(long)]
    replica_kills: Option<usize>,
    /// Runs of the storage figure [default: 50; smoke 2]. Every table and index has a
    /// few pages whatever it holds (PostgreSQL: an index metapage, a free space map): more runs
    /// spread them thinner, closer to what a run adds.
    #[arg(long)]
    storage_runs: Option<usize>,
}

impl RunArgs {
    fn plan(&self) -> Plan {
        let smoke = self.smoke;
        let pick = |full: usize, tiny: usize| if smoke { tiny } else { full };
        let profile = Profile::ms(
            self.ttft_ms.unwrap_or(if smoke { 1 } else { 200 }),
            self.interval_ms.unwrap_or(if smoke { 1 } else { 20 }),
            self.tokens.unwrap_or(if smoke { 5 } else { 64 }),
        );
        Plan {
            smoke,
            profile,
            latency_runs: self.latency_runs.unwrap_or(pick(30, 2)),
            concurrent_runs: pick(100, 4),
            concurrent_waves: pick(2, 1),
            short_tokens: 5,
            short_concurrency: self.short_concurrency.unwrap_or(pick(32, 2)),
            short_duration: Duration::from_secs(self.short_seconds.unwrap_or(if smoke {
                1
            } else {
                10
            })),
            fanout_runs: pick(10, 2),
            fanout_watchers: pick(1000, 20),
            fanout_tokens: if smoke { 5 } else { 300 },
            fanout_interval: Duration::from_millis(self.fanout_interval_ms.unwrap_or(if smoke {
                1
            } else {
                8
            })),
            idle_runs: pick(100, 2),
            idle_watchers: self.idle_watchers.unwrap_or(pick(10_000, 50)),
            per_core_runs: pick(100, 2),
            per_core_watchers: self.per_core_watchers.unwrap_or(pick(10_000, 20)),
            per_core_window: Duration::from_secs(if smoke { 1 } else { 5 }),
            resume_samples: pick(300, 10),
            cancel_samples: pick(20, 2),
            storage_runs: self.storage_runs.unwrap_or(pick(50, 2)),
            restart_runs: self.restart_runs.unwrap_or(pick(100, 5)),
            restart_baselines: pick(5, 1),
            // Long enough to be mid-stream when every run has streamed a few tokens.
            restart_profile: if smoke {
                Profile::ms(0, 10, 100)
            } else {
                Profile::ms(0, 20, 400)
            },
            replica_latency_runs: pick(5, 1),
            replica_kills: self.replica_kills.unwrap_or(pick(20, 2)),
            replica_idle_watchers: pick(1000, 20),
            replica_link_runs: pick(30, 2),
        }
    }

    fn figures(&self) -> Vec<Figure> {
        if self.only.is_empty() {
            Figure::value_variants().to_vec()
        } else {
            self.only.clone()
        }
    }

    fn backends(&self) -> Vec<Backend> {
        match self.backend {
            BackendArg::Sqlite => vec![Backend::Sqlite],
            BackendArg::Postgres => vec![Backend::Postgres],
            BackendArg::Both => vec![Backend::Sqlite, Backend::Postgres],
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::FakeProvider {
            bind,
            ttft_ms,
            interval_ms,
            tokens,
        } => serve_fake(&bind, Profile::ms(ttft_ms, interval_ms, tokens)).await,
        Command::Run(args) => run(&args).await,
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            say(&format!("behest-bench: {error}"));
            ExitCode::from(2)
        }
    }
}

async fn serve_fake(bind: &str, profile: Profile) -> Result<bool> {
    let fake = FakeProvider::start(bind, profile, Default::default()).await?;
    say(&format!(
        "behest-bench fake provider: {} (time to first token {} ms, {} tokens {} ms apart)",
        fake.base_url(),
        profile.ttft.as_millis(),
        profile.tokens,
        profile.interval.as_millis()
    ));
    tokio::signal::ctrl_c().await?;
    Ok(true)
}

/// Raises the soft open-file limit to the hard one: thousands of watchers are thousands of
/// sockets, in this process and in the behest child (which inherits the limit).
fn raise_open_files(needed: u64) {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) if limit < needed => say(&format!(
            "warning: the open-file limit is {limit}, below the {needed} this plan needs; \
             raise the hard limit (`ulimit -Hn`) or pass --idle-watchers"
        )),
        Ok(_) => {}
        Err(error) => say(&format!(
            "warning: cannot raise the open-file limit: {error}"
        )),
    }
}

fn behest_binary(args: &RunArgs) -> Result<PathBuf> {
    match &args.behest_bin {
        Some(path) => Ok(path.clone()),
        None => Ok(std::env::current_exe()?.with_file_name("behest")),
    }
}

fn git_commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".to_owned())
}

async fn run(args: &RunArgs) -> Result<bool> {
    let plan = args.plan();
    raise_open_files(plan.idle_watchers.max(plan.per_core_watchers) as u64 + 2_000);
    let binary = behest_binary(args)?;
    if !binary.is_file() {
        bail!(
            "the behest binary is missing at {} — build it first with `cargo build --release --bins` \
             (or pass --behest-bin PATH)",
            binary.display()
        );
    }
    let started = chrono::Utc::now();
    let commit = git_commit();
    say(&format!(
        "behest-bench {}: {} UTC, commit {commit}, {} CPUs; default profile: first token after {} ms, \
         then {} tokens {} ms apart",
        if plan.smoke { "smoke" } else { "run" },
        started.format("%Y-%m-%d %H:%M"),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        plan.profile.ttft.as_millis(),
        plan.profile.tokens,
        plan.profile.interval.as_millis()
    ));
    let fake = Arc::new(FakeProvider::start("127.0.0.1:0", plan.profile, plan.profiles()).await?);
    let checks = Arc::new(Checks::default());
    let figures = args.figures();
    let mut rows = Vec::new();
    let mut errors = Vec::new();
    for backend in args.backends() {
        match run_backend(args, &plan, backend, &binary, &fake, &checks, &figures).await {
            Ok(backend_rows) => rows.extend(backend_rows),
            Err(error) => {
                say(&format!("[{}] failed: {error}", backend.name()));
                errors.push(format!("{}: {error}", backend.name()));
            }
        }
        fake.clear();
    }
    let violations = checks.violations();
    let (streams, events) = checks.counts();
    rows.push(
        Row::new(
            "hard check: lost, duplicated or reordered events",
            "violations",
            None,
            violations.len() as f64,
            Compare::None,
        )
        .target(Target::AtMost(0.0))
        .samples(streams as usize)
        .note(format!("{streams} streams, {events} events checked")),
    );
    if let Some(hard) = rows.last_mut() {
        hard.backend = "all".to_owned();
    }
    if plan.smoke {
        // Smoke sizes say nothing about speed: only the hard check counts.
        let last = rows.len().saturating_sub(1);
        for row in &mut rows[..last] {
            row.met = None;
        }
    }
    say("");
    say(&report::table(&rows));
    for row in rows.iter().filter(|row| !row.note.is_empty()) {
        say(&format!("- {} [{}]: {}", row.figure, row.backend, row.note));
    }
    if !violations.is_empty() {
        say(&format!("\n{} VIOLATIONS:", violations.len()));
        for violation in violations.iter().take(50) {
            say(&format!("  {violation}"));
        }
    }
    if let Some(path) = &args.json {
        let document = serde_json::json!({
            "date": started.to_rfc3339(),
            "commit": commit,
            "smoke": plan.smoke,
            "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "profile": {
                "ttft_ms": plan.profile.ttft.as_millis() as u64,
                "interval_ms": plan.profile.interval.as_millis() as u64,
                "tokens": plan.profile.tokens,
            },
            "rows": rows,
            "violations": violations,
            "errors": errors,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&document)?)?;
    }
    Ok(violations.is_empty() && errors.is_empty())
}

async fn run_backend(
    args: &RunArgs,
    plan: &Plan,
    backend: Backend,
    binary: &std::path::Path,
    fake: &Arc<FakeProvider>,
    checks: &Arc<Checks>,
    figures: &[Figure],
) -> Result<Vec<Row>> {
    let dir = std::env::temp_dir().join(format!("behest-bench-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir)?;
    let result = async {
        let db = Database::create(backend, &dir, &args.postgres_url).await?;
        let outcome = on_database(args, plan, binary, fake, checks, figures, &dir, &db).await;
        db.drop_database().await;
        outcome
    }
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

#[expect(clippy::too_many_arguments, reason = "one call site, all plain inputs")]
async fn on_database(
    args: &RunArgs,
    plan: &Plan,
    binary: &std::path::Path,
    fake: &Arc<FakeProvider>,
    checks: &Arc<Checks>,
    figures: &[Figure],
    dir: &std::path::Path,
    db: &Database,
) -> Result<Vec<Row>> {
    let backend = db.backend;
    let config = dir.join("behest.toml");
    std::fs::write(
        &config,
        target::config_toml(&fake.base_url(), &MODELS, None),
    )?;
    // Few idle connections kept: the 10,000 streams of one figure must not hold 10,000
    // descriptors into the next one (the hard limit is often 20,000).
    let client = behest::net::client_builder()
        .connect_timeout(Duration::from_secs(10))
        .tcp_nodelay(true)
        .pool_max_idle_per_host(64)
        .build()?;
    let behest = BehestProcess::start(binary, dir, &config, &db.url, &client).await?;
    say(&format!(
        "[{}] behest pid {} at {} over {}",
        backend.name(),
        behest.pid,
        behest.base_url,
        match backend {
            Backend::Sqlite => "a temp SQLite file",
            Backend::Postgres => "a fresh PostgreSQL database",
        }
    ));
    let ctx = Ctx::new(Inner {
        fake: fake.clone(),
        behest_url: behest.base_url.clone(),
        behest_pid: behest.pid,
        client,
        checks: checks.clone(),
        plan: plan.clone(),
        backend,
        behest_bin: binary.to_owned(),
        dir: dir.to_owned(),
        postgres_url: args.postgres_url.clone(),
        api_key: None,
    });
    let result = figures::measure(&ctx, db, figures).await;
    if result.is_err() {
        say(&format!("behest log (tail):\n{}", behest.log_tail()));
    }
    drop(ctx);
    behest.stop().await?;
    result
}
