//! What the operations features cost on the hot path: time to first token and the gap between
//! token events through a behest with API keys, Prometheus metrics and OTLP trace export on
//! (spans sent to a collector in this process), against a behest with all three off — two
//! processes of the same binary, each over a fresh database, the runs alternating between them
//! in the same bench run. The "baseline" column is behest with them off.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::latency::{Latency, wave};
use super::{Ctx, MODEL_DEFAULT, MODELS};
use crate::Result;
use crate::report::{Compare, Row, Target};
use crate::target::{BehestProcess, Database};

/// The key of the behest with auth on.
const KEY: &str = "behest-bench-ops-key";

/// An OTLP/HTTP collector that accepts every export and counts them.
struct Sink {
    url: String,
    exports: Arc<AtomicUsize>,
    server: tokio::task::JoinHandle<()>,
}

impl Sink {
    async fn start() -> Result<Self> {
        let exports = Arc::new(AtomicUsize::new(0));
        let counted = exports.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let counted = counted.clone();
                async move {
                    if !body.is_empty() {
                        counted.fetch_add(1, Ordering::AcqRel);
                    }
                    (
                        [("content-type", "application/x-protobuf")],
                        Vec::<u8>::new(),
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self {
            url,
            exports,
            server,
        })
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A behest of its own: a fresh database, the bench's configuration plus `extra`.
pub(super) async fn start(ctx: &Ctx, name: &str, extra: &str) -> Result<(BehestProcess, Database)> {
    let dir = ctx.dir.join(name);
    std::fs::create_dir_all(&dir)?;
    let db = Database::create(ctx.backend, &dir, &ctx.postgres_url).await?;
    let config = dir.join("behest.toml");
    let mut toml = crate::target::config_toml(&ctx.fake.base_url(), &MODELS, None);
    toml.push('\n');
    toml.push_str(extra);
    std::fs::write(&config, toml)?;
    let process =
        BehestProcess::start(&ctx.behest_bin, &dir, &config, &db.url, &ctx.client).await?;
    Ok((process, db))
}

/// A latency statistic of [`OnOff`].
#[derive(Debug, Clone, Copy)]
pub(super) enum Stat {
    /// Time to first token.
    Ttft,
    /// Gap between token events.
    Gap,
    /// Token delivery delay (provider writes token k → client reads it).
    Delay,
}

/// The same runs through two behests of their own, `off` (the baseline) and `on`, alternating
/// so that drift of the machine hits both alike: one run at a time, then waves of concurrent
/// runs.
pub(super) struct OnOff {
    one: [Latency; 2],
    many: [Latency; 2],
    concurrent_runs: usize,
}

impl OnOff {
    pub(super) async fn measure(ctx: &Ctx, off: &Ctx, on: &Ctx) -> Result<Self> {
        let plan = &ctx.plan;
        let tokens = plan.profile.tokens;
        let mut one = [Latency::default(), Latency::default()];
        for _ in 0..plan.latency_runs {
            for (side, into) in [off, on].into_iter().zip(&mut one) {
                let trace = side.behest_run(MODEL_DEFAULT, tokens).await?;
                into.add(&trace, &ctx.sent(&trace.tag));
            }
        }
        let mut many = [Latency::default(), Latency::default()];
        for _ in 0..plan.concurrent_waves {
            for (side, into) in [off, on].into_iter().zip(&mut many) {
                let from = wave(side, true, plan.concurrent_runs, MODEL_DEFAULT).await?;
                into.ttft.extend(&from.ttft);
                into.gaps.extend(&from.gaps);
            }
        }
        Ok(Self {
            one,
            many,
            concurrent_runs: plan.concurrent_runs,
        })
    }

    /// The row of `stat`'s `p`th percentile, on against off, at one run at a time or (`many`)
    /// in the waves; the figure's name begins with `prefix`.
    pub(super) fn row(&self, prefix: &str, stat: Stat, p: f64, many: bool) -> Row {
        let (sides, runs) = if many {
            (&self.many, format!("{} runs", self.concurrent_runs))
        } else {
            (&self.one, "1 run".to_owned())
        };
        let (name, [off, on]) = match stat {
            Stat::Ttft => ("time to first token", sides.each_ref().map(|l| &l.ttft)),
            Stat::Gap => (
                "gap between token events",
                sides.each_ref().map(|l| &l.gaps),
            ),
            Stat::Delay => ("token delivery delay", sides.each_ref().map(|l| &l.delay)),
        };
        Row::new(
            &format!("{prefix}: {name} p{p:.0} ({runs})"),
            "ms",
            Some(off.p(p)),
            on.p(p),
            Compare::Difference,
        )
        .samples(on.len())
    }
}

pub(super) async fn overhead(ctx: &Ctx) -> Result<Vec<Row>> {
    let sink = Sink::start().await?;
    let (off_process, off_db) = start(ctx, "ops-off", "[telemetry]\nmetrics = false\n").await?;
    let on_extra = format!(
        "[auth]\nkeys = [\"{KEY}\"]\n\n[telemetry]\nmetrics = true\notlp_endpoint = \"{}\"\n",
        sink.url
    );
    let (on_process, on_db) = start(ctx, "ops-on", &on_extra).await?;
    let off = ctx.aimed_at(&off_process.base_url, off_process.pid, None);
    let on = ctx.aimed_at(&on_process.base_url, on_process.pid, Some(KEY));
    let result = async {
        let latency = OnOff::measure(ctx, &off, &on).await?;
        // The features were really on: the runs are counted at /metrics and spans arrived.
        let metrics = ctx
            .client
            .get(format!("{}/metrics", on_process.base_url))
            .bearer_auth(KEY)
            .send()
            .await?
            .text()
            .await?;
        if !metrics.contains("behest_runs_finished_total{status=\"completed\"}") {
            bail!("the behest with metrics on does not count its runs:\n{metrics}");
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        while sink.exports.load(Ordering::Acquire) == 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let exports = sink.exports.load(Ordering::Acquire);
        if exports == 0 {
            bail!("the behest with tracing on exported no spans");
        }
        let row = |stat: Stat, p: f64, many: bool| latency.row("ops on vs off", stat, p, many);
        Ok(vec![
            row(Stat::Ttft, 50.0, false)
                .target(Target::AtMost(0.2))
                .note("baseline = behest with auth, metrics and tracing off"),
            row(Stat::Ttft, 99.0, false),
            row(Stat::Gap, 50.0, false).target(Target::AtMost(0.2)),
            row(Stat::Delay, 50.0, false).note("provider writes token k → client reads token k"),
            row(Stat::Ttft, 50.0, true),
            row(Stat::Gap, 50.0, true).target(Target::AtMost(0.2)),
            row(Stat::Gap, 99.0, true),
            Row::new(
                "ops on: OTLP exports received",
                "requests",
                None,
                exports as f64,
                Compare::None,
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
