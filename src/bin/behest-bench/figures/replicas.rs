//! Replicas on one PostgreSQL (issue 23, item 7): two `behest serve` processes, A and B, on
//! one fresh database (PostgreSQL only; nothing on SQLite, one process by design), each
//! connecting with its own `application_name` so the database's statistics tell them apart.
//!
//! - **Live latency across replicas**: each token's provider send → its `text_delta` at a
//!   watcher on B (the run executes on A), against the same at a watcher on A (the baseline,
//!   same run, same moment): the difference is what crossing replicas adds (A's commit →
//!   `NOTIFY` → B's read of the store → B's frame).
//! - **Cancel on another replica**: `POST /runs/{id}/cancel` sent to B for a run streaming on
//!   A → A closed the provider connection, against the same cancel sent to A.
//! - **Failover**: A is killed (SIGKILL) while its run streams; kill → `run_resumed` at a
//!   watcher on B (B took the run over once the lease expired, [`LEASE_TTL_MS`]); A is started
//!   again for the next kill.
//! - **Database load of idle watchers**: transactions per second (`pg_stat_database`
//!   `xact_commit + xact_rollback` over a window) and each replica's connections
//!   (`pg_stat_activity`) with many idle watchers on B of a run waiting on A, against none.
//! - **Fan-out across replicas**: `text_delta` frames per second delivered to many watchers of
//!   one run executing on A, spread evenly over three replicas A, B and C, against all of them
//!   on A.
//! - **A short run over a slower link**: the time of a short run through A when PostgreSQL is
//!   behind a TCP proxy that delays every chunk by [`LINK_DELAY`] each way, against the same
//!   run on loopback; the difference divided by the round-trip delay estimates the run's
//!   database round trips (on its critical path).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use sqlx::Connection;

use super::{Ctx, MODEL_CANCEL, MODEL_FANOUT, MODEL_IDLE, MODEL_SHORT, MODELS, tag};
use crate::check::StreamCheck;
use crate::report::{Compare, Dist, Row, Target, ms, say};
use crate::sse::SseReader;
use crate::target::{Backend, BehestProcess, Database, Launch, config_toml};
use crate::{BenchError, Result};

/// `[runtime] lease_ttl_ms` of the figure's replicas (the restart figure's).
pub const LEASE_TTL_MS: u64 = super::restart::LEASE_TTL_MS;
/// The delay the proxy adds to each direction of the database link.
const LINK_DELAY: Duration = Duration::from_micros(500);
/// `/readyz` poll interval while a replica starts.
const READY_POLL: Duration = Duration::from_millis(5);

pub(super) async fn replicas(ctx: &Ctx) -> Result<Vec<Row>> {
    if ctx.backend != Backend::Postgres {
        return Ok(Vec::new());
    }
    let dir = ctx.dir.join("replicas");
    std::fs::create_dir_all(&dir)?;
    let db = Database::create(ctx.backend, &dir, &ctx.postgres_url).await?;
    let config = dir.join("behest.toml");
    std::fs::write(
        &config,
        config_toml(&ctx.fake.base_url(), &MODELS, Some(LEASE_TTL_MS)),
    )?;
    let launch = |name: &str, url: &str| Launch {
        binary: ctx.behest_bin.clone(),
        config: config.clone(),
        database_url: with_application_name(url, name),
        dir: dir.clone(),
    };
    let (launch_a, launch_b) = (launch("replica-a", &db.url), launch("replica-b", &db.url));
    let launch_c = launch("replica-c", &db.url);
    let result = async {
        let mut rows = two_replicas(ctx, &db, &launch_a, &launch_b).await?;
        rows.extend(spread(ctx, [&launch_a, &launch_b, &launch_c]).await?);
        rows.extend(slow_link(ctx, &db, &dir, &config).await?);
        Ok(rows)
    }
    .await;
    db.drop_database().await;
    result
}

fn with_application_name(url: &str, name: &str) -> String {
    let joiner = if url.contains('?') { '&' } else { '?' };
    format!("{url}{joiner}application_name={name}")
}

async fn start(launch: &Launch, log: &str, client: &reqwest::Client) -> Result<BehestProcess> {
    let mut process = BehestProcess::spawn(launch, None, log)?;
    process.wait_ready(client, READY_POLL).await?;
    Ok(process)
}

/// Reads `reader` (behest's format, a completed run) to its end through the hard check: when
/// each `text_delta` arrived.
async fn follow(ctx: &Ctx, label: String, reader: SseReader) -> Result<Vec<Instant>> {
    let (deltas, summary) = super::formats::read_checked(reader, "behest", None).await?;
    ctx.checks.stream(&label, &summary);
    Ok(deltas)
}

async fn two_replicas(
    ctx: &Ctx,
    db: &Database,
    launch_a: &Launch,
    launch_b: &Launch,
) -> Result<Vec<Row>> {
    let plan = &ctx.plan;
    let client = &ctx.client;
    let mut a = start(launch_a, "replica-a.log", client).await?;
    let b = start(launch_b, "replica-b.log", client).await?;
    let on_b = ctx.aimed_at(&b.base_url, b.pid, None);
    let mut rows = Vec::new();

    // Live latency: provider send → frame, at a watcher on B and one on A.
    let (mut same, mut cross) = (Dist::default(), Dist::default());
    for _ in 0..plan.replica_latency_runs {
        let on_a = ctx.aimed_at(&a.base_url, a.pid, None);
        // The model waits at its gate until both watchers are attached: every token is live.
        let (run_tag, run_id) = on_a
            .create_held_run(MODEL_FANOUT, "replicas-latency")
            .await?;
        let (reader_a, reader_b) = (
            on_a.watch(&run_id, None).await?,
            on_b.watch(&run_id, None).await?,
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        ctx.fake.open_gate(MODEL_FANOUT);
        let (ctx_a, ctx_b) = (ctx.clone(), ctx.clone());
        let (label_a, label_b) = (format!("run {run_id} on A"), format!("run {run_id} on B"));
        let watch_a = tokio::spawn(async move { follow(&ctx_a, label_a, reader_a).await });
        let watch_b = tokio::spawn(async move { follow(&ctx_b, label_b, reader_b).await });
        let on_a_deltas = watch_a.await??;
        let on_b_deltas = watch_b.await??;
        ctx.fake.close_gate(MODEL_FANOUT);
        let sent = ctx.sent(&run_tag);
        for ((sent, at_a), at_b) in sent.iter().zip(&on_a_deltas).zip(&on_b_deltas) {
            same.push(ms(at_a.saturating_duration_since(*sent)));
            cross.push(ms(at_b.saturating_duration_since(*sent)));
        }
    }
    for (p, label) in [(50.0, "p50"), (99.0, "p99")] {
        let mut row = Row::new(
            &format!("live event on another replica (provider → watcher on B) {label}"),
            "ms",
            Some(same.p(p)),
            cross.p(p),
            Compare::Difference,
        )
        .samples(cross.len())
        .note("baseline: a watcher on the replica executing the run");
        if p > 50.0 {
            row = row.target(Target::AtMost(20.0));
        }
        rows.push(row);
    }

    // Cancel sent to B (the run on A) → A closed the provider connection; baseline: sent to A.
    let (mut cancel_same, mut cancel_cross) = (Dist::default(), Dist::default());
    for (i, to_b) in (0..plan.cancel_samples * 2).map(|i| (i, i % 2 == 1)) {
        let on_a = ctx.aimed_at(&a.base_url, a.pid, None);
        let run_tag = tag("replicas-cancel");
        let run_id = on_a.create_run(MODEL_CANCEL, &run_tag).await?;
        let mut reader = on_b.watch(&run_id, None).await?;
        let mut check = StreamCheck::new(0);
        let mut seen = 0;
        while seen < 3 {
            let Some(frame) = reader.next().await? else {
                bail!("run {run_id} ended before it was cancelled");
            };
            check.push(&frame);
            seen += usize::from(frame.event == "text_delta");
        }
        let exchange = ctx
            .fake
            .exchange(&run_tag)
            .ok_or_else(|| BenchError(format!("no provider request for run {run_id}")))?;
        let sent_at = Instant::now();
        if to_b {
            on_b.cancel(&run_id).await?;
        } else {
            on_a.cancel(&run_id).await?;
        }
        match exchange.wait_ended(Duration::from_secs(5)).await {
            Some(ended) => {
                let took = ms(ended.saturating_duration_since(sent_at));
                if to_b {
                    cancel_cross.push(took);
                } else {
                    cancel_same.push(took);
                }
            }
            None => ctx.checks.fail(format!(
                "run {run_id}: the provider connection was open 5 s after a cancel (sample {i})"
            )),
        }
        while let Some(frame) = reader.next().await? {
            check.push(&frame);
        }
        ctx.checks.stream(
            &format!("run {run_id} cancelled"),
            &check.finish(Some("run_cancelled"), None),
        );
    }
    for (p, label) in [(50.0, "p50"), (99.0, "p99")] {
        rows.push(
            Row::new(
                &format!("cancel sent to another replica → provider connection closed {label}"),
                "ms",
                Some(cancel_same.p(p)),
                cancel_cross.p(p),
                Compare::Difference,
            )
            .samples(cancel_cross.len())
            .note("baseline: the cancel sent to the replica executing the run"),
        );
    }

    // Database load of idle watchers on B of a run waiting on A.
    let window = if plan.smoke {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(5)
    };
    // A backend reports its transactions to `pg_stat_database` when it goes idle, at most once
    // a second, and an idle one at the latest after 10 s (PostgreSQL's `PGSTAT_IDLE_INTERVAL`,
    // `pgstat.c`): the work before a window is only out of it 10 s later.
    let settle = if plan.smoke {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(11)
    };
    let on_a = ctx.aimed_at(&a.base_url, a.pid, None);
    let idle_run = on_a.create_run(MODEL_IDLE, &tag("replicas-idle")).await?;
    // The cancelled runs before have settled.
    tokio::time::sleep(settle).await;
    let (none_rate, none_connections) = load(&db.url, window).await?;
    let mut readers = Vec::with_capacity(plan.replica_idle_watchers);
    for _ in 0..plan.replica_idle_watchers {
        readers.push(on_b.watch(&idle_run, None).await?);
    }
    // Each watcher has read the log so far (its replay is over) before the wait.
    let logged = last_sequence(&db.url, &idle_run).await?;
    for reader in &mut readers {
        while let Some(frame) = reader.next().await? {
            if frame.id >= Some(logged) {
                break;
            }
        }
    }
    tokio::time::sleep(settle).await;
    let (many_rate, many_connections) = load(&db.url, window).await?;
    on_b.cancel(&idle_run).await?;
    for mut reader in readers {
        while reader.next().await?.is_some() {}
    }
    let watchers = plan.replica_idle_watchers;
    rows.push(
        Row::new(
            &format!("database transactions/s, {watchers} idle watchers on another replica"),
            "tx/s",
            Some(none_rate),
            many_rate,
            Compare::Ratio,
        )
        .samples(2)
        .note(format!(
            "baseline: no watcher; {} s windows, both replicas and this measurement included",
            window.as_secs()
        )),
    );
    for replica in ["replica-a", "replica-b"] {
        let count = |map: &BTreeMap<String, i64>| map.get(replica).copied().unwrap_or(0) as f64;
        rows.push(
            Row::new(
                &format!("database connections of {replica}, {watchers} idle watchers on B"),
                "connections",
                Some(count(&none_connections)),
                count(&many_connections),
                Compare::Ratio,
            )
            .samples(1)
            .note("baseline: no watcher (pg_stat_activity)"),
        );
    }

    // Failover: A killed while its run streams; kill → run_resumed at a watcher on B.
    let mut failover = Dist::default();
    for i in 0..plan.replica_kills {
        let on_a = ctx.aimed_at(&a.base_url, a.pid, None);
        let run_id = on_a
            .create_run(MODEL_CANCEL, &tag("replicas-failover"))
            .await?;
        let mut reader = on_b.watch(&run_id, None).await?;
        let mut check = StreamCheck::new(0);
        let mut seen = 0;
        while seen < 3 {
            let Some(frame) = reader.next().await? else {
                bail!("run {run_id} ended before the kill");
            };
            check.push(&frame);
            seen += usize::from(frame.event == "text_delta");
        }
        a.kill().await?;
        let killed_at = Instant::now();
        let mut resumed = None;
        while resumed.is_none() {
            let Some(frame) = reader.next().await? else {
                bail!("run {run_id} ended without being resumed on B");
            };
            check.push(&frame);
            if frame.event == "run_resumed" {
                resumed = Some(frame.at);
            }
            if killed_at.elapsed() > Duration::from_secs(60) {
                bail!("run {run_id} not resumed on B 60 s after the kill");
            }
        }
        if let Some(at) = resumed {
            failover.push(ms(at.saturating_duration_since(killed_at)));
        }
        on_b.cancel(&run_id).await?;
        while let Some(frame) = reader.next().await? {
            check.push(&frame);
        }
        ctx.checks.stream(
            &format!("run {run_id} failed over"),
            &check.finish(Some("run_cancelled"), None),
        );
        a = start(launch_a, &format!("replica-a-{i}.log"), client).await?;
    }
    for (p, label) in [(50.0, "p50"), (99.0, "p99")] {
        rows.push(
            Row::new(
                &format!("failover: kill -9 → run_resumed on another replica {label}"),
                "ms",
                None,
                failover.p(p),
                Compare::None,
            )
            .samples(failover.len())
            .note(format!("lease_ttl_ms = {LEASE_TTL_MS}")),
        );
    }
    a.stop().await?;
    b.stop().await?;
    Ok(rows)
}

/// Transactions per second over `window` and connections per `application_name`.
/// The last sequence stored for the run.
async fn last_sequence(db_url: &str, run_id: &str) -> Result<u64> {
    let mut connection = sqlx::PgConnection::connect(db_url).await?;
    let last: Option<i64> =
        sqlx::query_scalar("SELECT MAX(sequence) FROM events WHERE run_id = $1::uuid")
            .bind(run_id)
            .fetch_one(&mut connection)
            .await?;
    let _ = connection.close().await;
    Ok(last.map_or(0, |last| u64::try_from(last).unwrap_or(0)))
}

async fn load(db_url: &str, window: Duration) -> Result<(f64, BTreeMap<String, i64>)> {
    let mut connection = sqlx::PgConnection::connect(db_url).await?;
    let count = "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database \
                 WHERE datname = current_database()";
    // The statistics are flushed by each backend at most once a second, and on its
    // transaction's end: a snapshot is read anew in each transaction.
    let before: i64 = sqlx::query_scalar(count).fetch_one(&mut connection).await?;
    let started = Instant::now();
    tokio::time::sleep(window).await;
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut connection)
        .await?;
    let after: i64 = sqlx::query_scalar(count).fetch_one(&mut connection).await?;
    let rate = (after - before) as f64 / started.elapsed().as_secs_f64();
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT application_name, count(*)::bigint FROM pg_stat_activity \
         WHERE datname = current_database() GROUP BY application_name",
    )
    .fetch_all(&mut connection)
    .await?;
    let _ = connection.close().await;
    Ok((rate, rows.into_iter().collect()))
}

/// Events per second to many watchers of one run executing on A: all of them on A (the
/// baseline), then spread evenly over A, B and C (B's and C's read the store when A's signal
/// wakes them). Counted: `text_delta` frames delivered from the gate's opening to the last.
async fn spread(ctx: &Ctx, launches: [&Launch; 3]) -> Result<Vec<Row>> {
    let client = &ctx.client;
    let mut processes = Vec::with_capacity(launches.len());
    for (launch, log) in launches.into_iter().zip([
        "replica-a-spread.log",
        "replica-b-spread.log",
        "replica-c-spread.log",
    ]) {
        processes.push(start(launch, log, client).await?);
    }
    let aimed: Vec<_> = processes
        .iter()
        .map(|p| ctx.aimed_at(&p.base_url, p.pid, None))
        .collect();
    let watchers = ctx.plan.replica_idle_watchers;
    let mut rates = Vec::with_capacity(2);
    for spread in [false, true] {
        let run = super::fanout::gated_run(
            &aimed[0],
            "replicas-spread",
            watchers,
            |i, run_id| {
                let on = if spread {
                    &aimed[i % aimed.len()]
                } else {
                    &aimed[0]
                };
                let run_id = run_id.to_owned();
                async move { on.watch(&run_id, None).await }
            },
            |i, run_id, reader| {
                let ctx = ctx.clone();
                let label = format!("run {run_id} watcher {i} (spread: {spread})");
                async move { follow(&ctx, label, reader).await }
            },
        )
        .await?;
        rates.push(super::fanout::delivery(run.open, &run.watched).0);
    }
    drop(processes);
    Ok(vec![
        Row::new(
            &format!(
                "text_delta frames/s to {watchers} watchers of a run on A, spread over A, B and C"
            ),
            "frames/s",
            Some(rates[0]),
            rates[1],
            Compare::Ratio,
        )
        .samples(1)
        .note("baseline: every watcher on A, the replica executing the run"),
    ])
}

/// A short run's time through a replica whose database link is delayed, against loopback.
async fn slow_link(ctx: &Ctx, db: &Database, dir: &Path, config: &Path) -> Result<Vec<Row>> {
    let plan = &ctx.plan;
    let postgres: SocketAddr = postgres_address(&db.url)?;
    let through = |proxy: &DelayProxy| {
        db.url
            .replacen(&postgres.to_string(), &proxy.addr.to_string(), 1)
            .replacen(
                &format!("localhost:{}", postgres.port()),
                &proxy.addr.to_string(),
                1,
            )
    };
    // The proxy without delay isolates its own hop (threads, copies) from the link's delay.
    let plain = DelayProxy::start(postgres, Duration::ZERO)?;
    let delayed = DelayProxy::start(postgres, LINK_DELAY)?;
    let mut times = Vec::new();
    for (url, name) in [
        (db.url.clone(), "loopback"),
        (through(&plain), "proxied"),
        (through(&delayed), "delayed"),
    ] {
        let launch = Launch {
            binary: ctx.behest_bin.clone(),
            config: config.to_owned(),
            database_url: url,
            dir: dir.to_owned(),
        };
        let behest = start(&launch, &format!("replica-{name}.log"), &ctx.client).await?;
        let on = ctx.aimed_at(&behest.base_url, behest.pid, None);
        // Warm the pool, then time short runs one after another.
        on.answer(true, MODEL_SHORT, plan.short_tokens).await?;
        let mut took = Dist::default();
        for _ in 0..plan.replica_link_runs {
            let trace = on.answer(true, MODEL_SHORT, plan.short_tokens).await?;
            took.push(ms(trace.end.duration_since(trace.sent_at)));
        }
        behest.stop().await?;
        times.push(took);
    }
    let (loopback, proxied, delayed) = (times[0].p(50.0), times[1].p(50.0), times[2].p(50.0));
    let round_trip = ms(LINK_DELAY * 2);
    let round_trips = ((delayed - proxied) / round_trip).max(0.0);
    say(&format!(
        "  [postgres] slow link: a short run {loopback:.1} ms on loopback, {proxied:.1} ms \
         through the proxy, {delayed:.1} ms with +{round_trip} ms per round trip: \
         ≈{round_trips:.0} round trips on its path"
    ));
    Ok(vec![
        Row::new(
            &format!("short run, database +{round_trip} ms per round trip (p50)"),
            "ms",
            Some(loopback),
            delayed,
            Compare::Difference,
        )
        .samples(times[2].len())
        .note("baseline: the database on loopback; a TCP proxy delays each direction by 0.5 ms"),
        Row::new(
            "short run: database round trips on its path",
            "round trips",
            None,
            round_trips,
            Compare::None,
        )
        .samples(times[2].len())
        .note(format!(
            "(delayed − proxied without delay) ÷ {round_trip} ms; proxied without delay: \
             {proxied:.1} ms"
        )),
    ])
}

/// The host:port of a `postgres://` URL, resolved.
fn postgres_address(url: &str) -> Result<SocketAddr> {
    let rest = url
        .split_once("://")
        .map(|(_, rest)| rest)
        .ok_or_else(|| BenchError(format!("not a URL: {url}")))?;
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let host_port = authority.rsplit('@').next().unwrap_or(authority);
    let host_port = if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:5432")
    };
    std::net::ToSocketAddrs::to_socket_addrs(&host_port)?
        .next()
        .ok_or_else(|| BenchError(format!("cannot resolve {host_port}")))
}

/// A TCP proxy on `127.0.0.1:0` to `target` that delivers every chunk `delay` after it was
/// read, in each direction (pipelined: the delay adds latency, not a throughput limit). Plain
/// threads and blocking sockets: `std::thread::sleep` keeps a sub-millisecond delay, where
/// Tokio's timer rounds up to the next millisecond.
struct DelayProxy {
    addr: SocketAddr,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl DelayProxy {
    fn start(target: SocketAddr, delay: Duration) -> Result<Self> {
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopping = stop.clone();
        std::thread::spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((inbound, _)) => {
                        let Ok(outbound) = std::net::TcpStream::connect(target) else {
                            continue;
                        };
                        let _ = inbound.set_nonblocking(false);
                        let _ = inbound.set_nodelay(true);
                        let _ = outbound.set_nodelay(true);
                        let (Ok(in_read), Ok(out_read)) =
                            (inbound.try_clone(), outbound.try_clone())
                        else {
                            continue;
                        };
                        delayed_copy(in_read, outbound, delay);
                        delayed_copy(out_read, inbound, delay);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok(Self { addr, stop })
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Copies `from` to `to` on two threads, each chunk written `delay` after it was read.
fn delayed_copy(mut from: std::net::TcpStream, mut to: std::net::TcpStream, delay: Duration) {
    use std::io::{Read, Write};
    let (sender, receiver) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        let mut buffer = vec![0u8; 64 * 1024];
        while let Ok(n) = from.read(&mut buffer) {
            if n == 0 || sender.send((Instant::now(), buffer[..n].to_vec())).is_err() {
                break;
            }
        }
    });
    std::thread::spawn(move || {
        while let Ok((read_at, chunk)) = receiver.recv() {
            let due = read_at + delay;
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
}
