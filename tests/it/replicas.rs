//! Several replicas on one PostgreSQL. At the store's level: a replica frozen inside a write
//! transaction (a process stopped mid-append, holding its row locks) neither blocks another's
//! takeover scan nor holds its locks for long, and no statement waits without bound. With real
//! processes: watchers and cancels on one replica of runs executing on another.

use std::time::{Duration, Instant};

use behest::store::{ConnectOptions, LeaseStore, PostgresStore};
use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::json;
use sqlx::{Connection, Executor, PgConnection};

use crate::store::{lease, leased_run, now_ms};
use crate::support::db::{Backend, TestDb};
use crate::support::fake_openai::{FakeOpenAi, Reply, text_stream, tool_calls_stream};
use crate::support::process::ServerProcess;

async fn postgres() -> Option<TestDb> {
    TestDb::new(Backend::Postgres).await
}

/// A frozen replica's open transaction share-locks a run (as the fencing check of an append
/// does): another replica's scan takes over the other expired run at once and skips that one
/// (it used to wait for the lock, with no bound), then takes it once the lock is gone.
#[tokio::test]
async fn a_takeover_scan_skips_a_run_another_transaction_holds() {
    let Some(db) = postgres().await else {
        return;
    };
    let store = db.store().await;
    let held = leased_run(store.as_ref(), "frozen", now_ms() - 1).await;
    let free = leased_run(store.as_ref(), "frozen", now_ms() - 1).await;
    let mut frozen = PgConnection::connect(&db.url).await.unwrap();
    frozen.execute("BEGIN").await.unwrap();
    sqlx::query("SELECT id FROM runs WHERE id = $1 FOR SHARE")
        .bind(held.0)
        .execute(&mut frozen)
        .await
        .unwrap();

    let by_b = lease("b", now_ms() + 60_000);
    let scan = store.claim_runs(&by_b, now_ms(), false, 100);
    let claimed = tokio::time::timeout(Duration::from_secs(3), scan)
        .await
        .expect("the scan waited on the frozen transaction's lock")
        .unwrap();
    let ids: Vec<_> = claimed.iter().map(|c| c.record.id).collect();
    assert_eq!(ids, vec![free]);

    frozen.execute("ROLLBACK").await.unwrap();
    let claimed = store
        .claim_runs(&lease("b", now_ms() + 60_000), now_ms(), false, 100)
        .await
        .unwrap();
    let ids: Vec<_> = claimed.iter().map(|c| c.record.id).collect();
    assert_eq!(ids, vec![held]);
    drop(store);
    db.cleanup().await;
}

/// Every pooled connection carries `[database]`'s limits: a statement running too long is
/// cancelled, a lock waited for too long fails, and a session left idle inside a transaction
/// (its process frozen) is ended by the server, releasing its locks to a takeover.
#[tokio::test]
async fn pooled_connections_carry_the_time_limits() {
    let Some(db) = postgres().await else {
        return;
    };
    let options = ConnectOptions {
        statement_timeout: Duration::from_millis(1_000),
        lock_timeout: Duration::from_millis(500),
        idle_in_transaction_timeout: Duration::from_millis(400),
        tcp_keepalive_idle: Duration::from_secs(7),
        ..ConnectOptions::default()
    };
    let replica = PostgresStore::connect_with(&db.url, &options)
        .await
        .unwrap();
    let pool = replica.pool();
    for (name, value) in [
        ("statement_timeout", "1s"),
        ("lock_timeout", "500ms"),
        ("idle_in_transaction_session_timeout", "400ms"),
        ("tcp_keepalives_idle", "7"),
    ] {
        let shown: String = sqlx::query_scalar(&format!("SHOW {name}"))
            .fetch_one(pool)
            .await
            .unwrap();
        assert_eq!(shown, value, "{name}");
    }

    let started = Instant::now();
    let slow = sqlx::query("SELECT pg_sleep(10)").execute(pool).await;
    assert!(slow.is_err(), "a 10 s statement was not cancelled");
    assert!(started.elapsed() < Duration::from_secs(5));

    let other = db.store().await;
    let run = leased_run(other.as_ref(), "someone", now_ms() - 1).await;
    let mut holder = PgConnection::connect(&db.url).await.unwrap();
    holder.execute("BEGIN").await.unwrap();
    sqlx::query("SELECT id FROM runs WHERE id = $1 FOR UPDATE")
        .bind(run.0)
        .execute(&mut holder)
        .await
        .unwrap();
    let started = Instant::now();
    let waited = replica
        .claim_run(run, &lease("replica", now_ms() + 60_000), now_ms())
        .await;
    assert!(waited.is_err(), "a claim waiting on a lock did not fail");
    assert!(started.elapsed() < Duration::from_secs(3));
    holder.execute("ROLLBACK").await.unwrap();

    // The replica freezes inside a transaction holding the run's row lock.
    let mut frozen = pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM runs WHERE id = $1 FOR SHARE")
        .bind(run.0)
        .execute(&mut *frozen)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(900)).await;
    let claimed = tokio::time::timeout(
        Duration::from_secs(3),
        other.claim_run(run, &lease("b", now_ms() + 60_000), now_ms()),
    )
    .await
    .expect("the frozen transaction still held its lock")
    .unwrap();
    assert_eq!(claimed.map(|c| c.record.id), Some(run));
    assert!(
        sqlx::query("SELECT 1").execute(&mut *frozen).await.is_err(),
        "the frozen session was not ended"
    );
    drop(frozen);
    drop(other);
    drop(replica);
    db.cleanup().await;
}

// ---------------------------------------------------------------------------------------------
// Real processes: two replicas of `behest serve` on one PostgreSQL

/// One SSE frame: `(id, event, data)`.
type Frame = (String, String, String);

/// Collects a run's frames from `server` until the stream ends.
fn watch(server: &ServerProcess, run_id: &str) -> tokio::task::JoinHandle<Vec<Frame>> {
    let request = server
        .client
        .get(server.url(&format!("/runs/{run_id}/events")));
    tokio::spawn(async move {
        let response = request.send().await.expect("watch");
        assert_eq!(response.status(), 200);
        let mut stream = response.bytes_stream().eventsource();
        let mut frames = Vec::new();
        while let Some(Ok(event)) = stream.next().await {
            frames.push((event.id, event.event, event.data));
        }
        frames
    })
}

async fn transactions(db_url: &str) -> i64 {
    let mut connection = PgConnection::connect(db_url).await.unwrap();
    sqlx::query_scalar(
        "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database \
         WHERE datname = current_database()",
    )
    .fetch_one(&mut connection)
    .await
    .unwrap()
}

/// A replica's configuration: the fake provider without retries and with long timeouts (a
/// stalled reply stays open), this lease.
fn fake_config(fake: &FakeOpenAi, lease_ttl_ms: u64) -> String {
    format!(
        "[runtime]\nlease_ttl_ms = {lease_ttl_ms}\nshutdown_grace_ms = 300\n\n\
         [providers.fake]\nkind = \"openai\"\nbase_url = \"{}\"\n\
         [providers.fake.timeouts]\nconnect_ms = 2000\nfirst_byte_ms = 60000\nidle_ms = 60000\ntotal_ms = 120000\n\
         [providers.fake.retry]\nmax_attempts = 1\n\
         [providers.fake.models.fake-model]\ncontext_window = 128000\nmax_output_tokens = 1024\n",
        fake.base_url()
    )
}

async fn status_of(server: &ServerProcess, run_id: &str) -> String {
    server.get_json(&format!("/runs/{run_id}")).await["status"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// Two replicas on one PostgreSQL are one service (issue 23, items 1 and 2): watchers on B of
/// a run executing on A get every event live, exactly what a replay gives; 20 idle watchers on
/// B cost the database next to nothing (they used to poll it every 250 ms: ~8 transactions a
/// second each); a cancel sent to B stops the run on A at once, with a 30 s lease whose tick
/// alone would take up to 10 s.
#[tokio::test]
async fn two_replicas_are_one_service() {
    let Some(db) = postgres().await else {
        return;
    };
    let fake = FakeOpenAi::start().await;
    let words: Vec<String> = (1..=30).map(|n| format!("{n} ")).collect();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    fake.push(
        Reply::sse(&text_stream(&words))
            .chunks_every(64)
            .delay(Duration::from_millis(25)),
    );
    let stalled = text_stream(&["Thinking", " hard"]);
    fake.push(Reply::stall_after(&stalled[..stalled.len() / 2]));
    let config = fake_config(&fake, 30_000);
    let a = ServerProcess::start("replica-a", &config, &db.url).await;
    let b = ServerProcess::start("replica-b", &config, &db.url).await;
    let start = json!({"provider": "fake", "model": "fake-model", "input": "count"});

    // Live on another replica, exactly the log.
    let (status, _, created) = a.post("/runs", &start).await;
    assert_eq!(status, 202, "{created}");
    let streamed = created["run_id"].as_str().unwrap().to_owned();
    let watchers: Vec<_> = (0..3).map(|_| watch(&b, &streamed)).collect();
    let mut seen = Vec::new();
    for watcher in watchers {
        seen.push(
            tokio::time::timeout(Duration::from_secs(30), watcher)
                .await
                .expect("a watcher on the other replica never saw the end")
                .unwrap(),
        );
    }
    let replay = tokio::time::timeout(Duration::from_secs(10), watch(&a, &streamed))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(replay.last().map(|f| f.1.as_str()), Some("run_completed"));
    let ids: Vec<String> = (1..=replay.len()).map(|n| n.to_string()).collect();
    assert_eq!(
        replay.iter().map(|f| f.0.clone()).collect::<Vec<_>>(),
        ids,
        "contiguous ids"
    );
    for frames in &seen {
        assert_eq!(frames, &replay, "a watcher on B saw exactly the log");
    }

    // Idle watchers on B of a run stalled on A.
    let (status, _, created) = a.post("/runs", &start).await;
    assert_eq!(status, 202, "{created}");
    let stalled_run = created["run_id"].as_str().unwrap().to_owned();
    let deadline = Instant::now() + Duration::from_secs(20);
    while fake.requests().len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the second model call never came"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let idle: Vec<_> = (0..20).map(|_| watch(&b, &stalled_run)).collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = transactions(&db.url).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let spent = transactions(&db.url).await - before;
    assert!(
        spent < 100,
        "20 idle watchers on another replica cost {spent} transactions in 3 s"
    );

    // A cancel sent to B stops the run on A at once; `?wait=true` answers once it ended.
    let asked = Instant::now();
    let (status, body) = b
        .post_empty(&format!("/runs/{stalled_run}/cancel?wait=true"))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "cancelled", "{body}");
    while status_of(&a, &stalled_run).await != "cancelled" {
        assert!(
            asked.elapsed() < Duration::from_secs(3),
            "the run on A was not cancelled 3 s after a cancel sent to B:\n{}",
            a.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "two replicas: 20 idle watchers on B cost {spent} transactions in 3 s; a cancel sent to \
         B ended the run on A after {} ms",
        asked.elapsed().as_millis()
    );
    for watcher in idle {
        let frames = tokio::time::timeout(Duration::from_secs(10), watcher)
            .await
            .expect("an idle watcher did not see the cancel")
            .unwrap();
        assert_eq!(frames.last().map(|f| f.1.as_str()), Some("run_cancelled"));
    }
    let (status, ready) = b.get("/readyz").await;
    assert_eq!(status, 200, "{ready}");

    // A shutdown hands A's runs over at once: B takes the run over when A signals it released
    // its leases, not when the 30 s lease expires.
    fake.push(Reply::stall_after(&stalled[..stalled.len() / 2]));
    fake.push(Reply::sse(&text_stream(&["Resumed ", "on B"])));
    let (status, _, created) = a.post("/runs", &start).await;
    assert_eq!(status, 202, "{created}");
    let handed = created["run_id"].as_str().unwrap().to_owned();
    let deadline = Instant::now() + Duration::from_secs(20);
    while fake.requests().len() < 3 {
        assert!(Instant::now() < deadline, "the third model call never came");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut a = a;
    a.terminate().await;
    assert!(
        a.wait_exit(Duration::from_secs(10)).await.is_some(),
        "A did not stop"
    );
    let stopped = Instant::now();
    while status_of(&b, &handed).await != "completed" {
        assert!(
            stopped.elapsed() < Duration::from_secs(8),
            "B had not finished A's run 8 s after A shut down (lease 30 s):\n{}",
            b.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "two replicas: B finished the run A handed over {} ms after A exited",
        stopped.elapsed().as_millis()
    );
    drop((a, b));
    db.cleanup().await;
}

/// `[database] replica_id` names the replica: its runs' lease owner is `{replica_id}/{uuid}`
/// (a new owner at each start), its PostgreSQL connections carry it as `application_name`, and
/// its startup line logs the owner; an id outside `A-Z a-z 0-9 . _ -` is refused at load.
#[tokio::test]
async fn the_replica_id_names_leases_and_connections() {
    assert!(
        behest::config::Config::from_toml("[database]\nreplica_id = \"web 1\"\n").is_err(),
        "a replica id with a space was accepted"
    );
    let Some(db) = postgres().await else {
        return;
    };
    let fake = FakeOpenAi::start().await;
    let stalled = text_stream(&["Thinking", " hard"]);
    fake.push(Reply::stall_after(&stalled[..stalled.len() / 2]));
    let config = format!(
        "[database]\nreplica_id = \"web-7.eu\"\n\n[runtime]\nshutdown_grace_ms = 300\n\n\
         [providers.fake]\nkind = \"openai\"\nbase_url = \"{}\"\n\
         [providers.fake.retry]\nmax_attempts = 1\n\
         [providers.fake.models.fake-model]\ncontext_window = 128000\nmax_output_tokens = 1024\n",
        fake.base_url()
    );
    let server = ServerProcess::start("web-7", &config, &db.url).await;
    let (status, _, created) = server
        .post(
            "/runs",
            &json!({"provider": "fake", "model": "fake-model", "input": "hold"}),
        )
        .await;
    assert_eq!(status, 202, "{created}");
    let run_id: uuid::Uuid = created["run_id"].as_str().unwrap().parse().unwrap();
    let mut connection = PgConnection::connect(&db.url).await.unwrap();
    let owner: Option<String> = sqlx::query_scalar("SELECT lease_owner FROM runs WHERE id = $1")
        .bind(run_id)
        .fetch_one(&mut connection)
        .await
        .unwrap();
    let owner = owner.expect("a leased run");
    assert!(owner.starts_with("web-7.eu/"), "lease owner {owner}");
    let named: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND application_name = 'web-7.eu'",
    )
    .fetch_one(&mut connection)
    .await
    .unwrap();
    assert!(
        named >= 2,
        "{named} connections named web-7.eu (pool and listener)"
    );
    assert!(server.log().contains(&owner), "{}", server.log());
    let (status, body) = server.post_empty(&format!("/runs/{run_id}/cancel")).await;
    assert_eq!(status, 202, "{body}");
    drop(server);
    db.cleanup().await;
}

/// libfaketime (Debian's `libfaketime`), which shifts a process's wall clock.
const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// A replica whose clock runs 20 s ahead takes no healthy run from another: lease times come
/// from the database's clock, not the process's (libfaketime shifts the replica's clock; the
/// test checks that it did, from the `Date` header the replica sends).
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_whose_clock_runs_ahead_takes_no_healthy_run() {
    if !std::path::Path::new(FAKETIME).exists() {
        assert!(
            std::env::var_os("BEHEST_TEST_REQUIRE_POSTGRES").is_none(),
            "{FAKETIME} is missing (apt-get install libfaketime); .ci/run installs it"
        );
        eprintln!("skipped: {FAKETIME} is missing");
        return;
    }
    let Some(db) = postgres().await else {
        return;
    };
    let fake = FakeOpenAi::start().await;
    let stalled = text_stream(&["Thinking", " hard"]);
    fake.push(Reply::stall_after(&stalled[..stalled.len() / 2]));
    let config = fake_config(&fake, 3_000);
    let a = ServerProcess::start_with_env(
        "replica-a",
        &config,
        &db.url,
        &[("BEHEST_DATABASE__REPLICA_ID", "replica-a")],
    )
    .await;
    let ahead = ServerProcess::start_with_env(
        "replica-ahead",
        &config,
        &db.url,
        &[
            ("BEHEST_DATABASE__REPLICA_ID", "replica-ahead"),
            ("LD_PRELOAD", FAKETIME),
            ("FAKETIME", "+20s"),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
            ("FAKETIME_DONT_RESET", "1"),
        ],
    )
    .await;
    // The shifted clock is real: the replica's `Date` header is about 20 s ahead.
    let response = behest::net::client()
        .expect("client")
        .get(ahead.url("/healthz"))
        .send()
        .await
        .unwrap();
    let date = response.headers()["date"].to_str().unwrap().to_owned();
    let sent = chrono::DateTime::parse_from_rfc2822(&date).unwrap();
    let ahead_by = sent.signed_duration_since(chrono::Utc::now()).num_seconds();
    assert!(
        (15..=25).contains(&ahead_by),
        "Date {date}: {ahead_by} s ahead"
    );

    let (status, _, created) = a
        .post(
            "/runs",
            &json!({"provider": "fake", "model": "fake-model", "input": "hold"}),
        )
        .await;
    assert_eq!(status, 202, "{created}");
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    // Several lease periods: every scan of the replica ahead sees A's lease live.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let mut connection = PgConnection::connect(&db.url).await.unwrap();
    let owner: Option<String> = sqlx::query_scalar("SELECT lease_owner FROM runs WHERE id = $1")
        .bind(run_id.parse::<uuid::Uuid>().unwrap())
        .fetch_one(&mut connection)
        .await
        .unwrap();
    assert!(
        owner
            .as_deref()
            .is_some_and(|o| o.starts_with("replica-a/")),
        "the run's lease went to {owner:?}\n{}",
        ahead.log()
    );
    assert_eq!(status_of(&a, &run_id).await, "calling_model");
    assert!(
        !ahead.log().contains("took over runs"),
        "the replica ahead took over a run:\n{}",
        ahead.log()
    );
    let (status, body) = a.post_empty(&format!("/runs/{run_id}/cancel")).await;
    assert_eq!(status, 202, "{body}");
    drop(ahead);
    drop(a);
    db.cleanup().await;
}

/// A TCP proxy to PostgreSQL that can be cut: while cut, it forwards nothing either way and
/// keeps every connection open (a partition: the database neither answers nor refuses).
struct Partition {
    addr: std::net::SocketAddr,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Partition {
    async fn start(upstream: std::net::SocketAddr) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = std::sync::Arc::new(AtomicBool::new(false));
        let flag = cut.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                for (mut from, mut to) in [
                    (
                        Box::new(client_read) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                        Box::new(server_write) as Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
                    ),
                    (Box::new(server_read), Box::new(client_write)),
                ] {
                    let flag = flag.clone();
                    tokio::spawn(async move {
                        use tokio::io::{AsyncReadExt, AsyncWriteExt};
                        let mut buffer = vec![0; 16 * 1024];
                        loop {
                            let Ok(read) = from.read(&mut buffer).await else {
                                return;
                            };
                            if read == 0 {
                                return;
                            }
                            while flag.load(Ordering::SeqCst) {
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                            if to.write_all(&buffer[..read]).await.is_err() {
                                return;
                            }
                        }
                    });
                }
            }
        });
        Self { addr, cut }
    }

    fn set_cut(&self, cut: bool) {
        self.cut.store(cut, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Fail-stop: a replica cut off from the database stops its run's model call before the run's
/// lease expires (a peer may take it over from then on), not only its writes; once the
/// database answers again and the lease is still its own, it resumes the run, which completes.
#[tokio::test(flavor = "multi_thread")]
async fn a_replica_cut_off_from_the_database_stops_its_calls_before_its_lease_expires() {
    let Some(db) = postgres().await else {
        return;
    };
    let fake = FakeOpenAi::start().await;
    let stalled = text_stream(&["Thinking", " hard"]);
    fake.push(Reply::stall_after(&stalled[..stalled.len() / 2]));
    fake.push(Reply::sse(&text_stream(&["Done", "."])));
    let config = fake_config(&fake, 3_000);
    let direct = reqwest::Url::parse(&db.url).unwrap();
    let upstream = tokio::net::lookup_host(format!(
        "{}:{}",
        direct.host_str().unwrap(),
        direct.port().unwrap_or(5432)
    ))
    .await
    .unwrap()
    .next()
    .unwrap();
    let partition = Partition::start(upstream).await;
    let mut through = direct.clone();
    through.set_host(Some("127.0.0.1")).unwrap();
    through.set_port(Some(partition.addr.port())).unwrap();
    let server = ServerProcess::start("cut-off", &config, through.as_str()).await;
    let (status, _, created) = server
        .post(
            "/runs",
            &json!({"provider": "fake", "model": "fake-model", "input": "hold"}),
        )
        .await;
    assert_eq!(status, 202, "{created}");
    let run_id: uuid::Uuid = created["run_id"].as_str().unwrap().parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while status_of(&server, &run_id.to_string()).await != "calling_model" {
        assert!(Instant::now() < deadline, "the run never called its model");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A renewal or two after the call started, then the cut.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let mut connection = PgConnection::connect(&db.url).await.unwrap();
    partition.set_cut(true);
    let lease_expires_ms: i64 =
        sqlx::query_scalar("SELECT lease_expires_ms FROM runs WHERE id = $1")
            .bind(run_id)
            .fetch_one(&mut connection)
            .await
            .unwrap();
    let database_now = || async {
        let mut connection = PgConnection::connect(&db.url).await.unwrap();
        let now: i64 = sqlx::query_scalar(
            "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
        )
        .fetch_one(&mut connection)
        .await
        .unwrap();
        now
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while fake.abandoned() == 0 {
        assert!(
            Instant::now() < deadline,
            "the model call is still open 10 s after the cut:\n{}",
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stopped_at = database_now().await;
    assert!(
        stopped_at < lease_expires_ms,
        "the model call was stopped {} ms after the lease expired:\n{}",
        stopped_at - lease_expires_ms,
        server.log()
    );
    assert!(server.log().contains("fail-stop"), "{}", server.log());

    // The database answers again: the run is resumed here and completes.
    partition.set_cut(false);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status: String = sqlx::query_scalar("SELECT status FROM runs WHERE id = $1")
            .bind(run_id)
            .fetch_one(&mut connection)
            .await
            .unwrap();
        if status == "completed" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "run {status} 30 s after the database came back:\n{}",
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let frames = tokio::time::timeout(Duration::from_secs(10), watch(&server, &run_id.to_string()))
        .await
        .unwrap()
        .unwrap();
    let types: Vec<&str> = frames.iter().map(|f| f.1.as_str()).collect();
    assert!(types.contains(&"run_resumed"), "{types:?}");
    assert_eq!(types.last(), Some(&"run_completed"), "{types:?}");
    drop(server);
    db.assert_logs_fold().await;
    db.cleanup().await;
}

/// A cancel sent to one replica at the moment a client tool's output reaches the other never
/// tears a session: whichever wins, the log and the stored messages say the same thing (a
/// committed tool message holds the result its `tool_execution_finished` logged, never the
/// cancel's text), each call is answered once, the cancel's `?wait=true` answers as soon as
/// the run ended on either replica, and the session's next request is one OpenAI accepts.
#[tokio::test(flavor = "multi_thread")]
async fn a_cancel_racing_a_client_tools_output_on_another_replica_keeps_log_and_session_agreed() {
    let Some(db) = postgres().await else {
        return;
    };
    let fake = FakeOpenAi::start().await;
    // A user turn gets a call of the client tool (a new id each turn); a tool result gets text.
    fake.respond_with(|request| {
        let messages = request.body["messages"].as_array()?;
        let users = messages.iter().filter(|m| m["role"] == "user").count();
        Some(match messages.last()?["role"].as_str()? {
            "tool" => Reply::sse(&text_stream(&["Noted."])),
            _ => Reply::sse(&tool_calls_stream(&[(
                &format!("call_{users}"),
                "get_location",
                json!({}),
            )])),
        })
    });
    let config = fake_config(&fake, 30_000);
    let a = ServerProcess::start("replica-a", &config, &db.url).await;
    let b = ServerProcess::start("replica-b", &config, &db.url).await;
    let tools = json!([{"name": "get_location", "description": "Where the user is."}]);
    let mut session: Option<String> = None;
    let mut outcomes = Vec::new();
    for round in 0..8 {
        let mut body = json!({"provider": "fake", "model": "fake-model",
                              "input": format!("where am I? ({round})"), "tools": tools});
        if let Some(session) = &session {
            body["session_id"] = json!(session);
        }
        let (status, _, created) = a.post("/runs", &body).await;
        assert_eq!(status, 202, "{created}");
        let run_id = created["run_id"].as_str().unwrap().to_owned();
        session.get_or_insert_with(|| created["session_id"].as_str().unwrap().to_owned());
        let deadline = Instant::now() + Duration::from_secs(20);
        let call_id = loop {
            let run = a.get_json(&format!("/runs/{run_id}")).await;
            if run["status"] == "requires_action" {
                break run["required_action"]["tool_calls"][0]["call_id"]
                    .as_str()
                    .unwrap()
                    .to_owned();
            }
            assert!(Instant::now() < deadline, "never waited: {run}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let output = json!({"tool_outputs": [{"call_id": call_id, "output": {"city": "Lyon"}}]});
        // Alternate which replica gets which request, so both sides of the race run on each.
        let (answering, cancelling) = if round % 2 == 0 { (&b, &a) } else { (&a, &b) };
        let (answer_path, cancel_path) = (
            format!("/runs/{run_id}/tool_outputs"),
            format!("/runs/{run_id}/cancel?wait=true"),
        );
        let cancel_request = cancelling
            .client
            .post(cancelling.url(&cancel_path))
            .timeout(Duration::from_secs(45))
            .send();
        let asked = Instant::now();
        let ((answered, _, _), cancel_response) =
            tokio::join!(answering.post(&answer_path, &output), cancel_request);
        let cancel_response = cancel_response.expect("cancel");
        let cancelled = cancel_response.status().as_u16();
        let cancel_body: serde_json::Value = cancel_response.json().await.unwrap_or_default();
        // `?wait=true` answers once the watch of the run sees its end: a watch on the
        // replica the run does not execute on used to miss it (its relay started reading
        // after the watch's replay) and waited out its 30 s.
        assert!(
            asked.elapsed() < Duration::from_secs(15),
            "round {round}: cancel?wait=true took {} ms ({cancel_body})",
            asked.elapsed().as_millis()
        );
        assert!(
            matches!(answered, 200 | 202 | 409),
            "tool_outputs: {answered}"
        );
        assert!(matches!(cancelled, 200 | 202 | 409), "cancel: {cancelled}");
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            let status = status_of(&a, &run_id).await;
            if matches!(status.as_str(), "completed" | "cancelled" | "failed") {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "run {run_id} never ended: {status}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        outcomes.push(format!("{answered}/{cancelled}→{status}"));

        // The log's tool results, by committed message.
        let frames = tokio::time::timeout(Duration::from_secs(10), watch(&b, &run_id))
            .await
            .unwrap()
            .unwrap();
        let events: Vec<serde_json::Value> = frames
            .iter()
            .map(|(_, _, data)| serde_json::from_str(data).unwrap())
            .collect();
        let finished: Vec<&serde_json::Value> = events
            .iter()
            .filter(|e| e["type"] == "tool_execution_finished")
            .collect();
        let committed: Vec<String> = events
            .iter()
            .filter(|e| e["type"] == "tool_message_committed")
            .map(|e| e["message_id"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(committed.len(), 1, "one answer to the call: {frames:#?}");
        assert_eq!(
            finished.len(),
            1,
            "the call's end is logged, the cancel's too: {frames:#?}"
        );
        let messages = a
            .get_json(&format!(
                "/sessions/{}/messages?limit=200",
                session.as_ref().unwrap()
            ))
            .await;
        let stored: Vec<&serde_json::Value> = messages["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["run_id"] == run_id.as_str() && m["role"] == "tool")
            .collect();
        assert_eq!(stored.len(), 1, "one tool message stored: {messages:#}");
        assert_eq!(stored[0]["id"], committed[0].as_str());
        let text = stored[0]["content"].to_string();
        match finished.last().map(|e| &e["result"]) {
            Some(result) if result.get("Success").is_some() => {
                assert!(
                    text.contains("Lyon"),
                    "round {round} ({status}): the log says the tool succeeded, the stored \
                     message says {text}\n{frames:#?}"
                );
            }
            _ => assert!(
                !text.contains("Lyon"),
                "round {round} ({status}): the stored message holds the output the log never \
                 logged: {text}\n{frames:#?}"
            ),
        }
    }
    // The session's next run sends a history OpenAI accepts.
    fake.respond_with(|_| Some(Reply::sse(&text_stream(&["Fine."]))));
    let (status, _, created) = b
        .post(
            "/runs",
            &json!({"session_id": session, "input": "and now?", "provider": "fake",
                    "model": "fake-model"}),
        )
        .await;
    assert_eq!(status, 202, "{created}");
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    let deadline = Instant::now() + Duration::from_secs(20);
    while status_of(&b, &run_id).await != "completed" {
        assert!(Instant::now() < deadline, "the next run never completed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for request in fake.requests() {
        let violations = crate::support::validate::validate_openai_request(&request.body);
        assert!(violations.is_empty(), "{violations:?}\n{}", request.body);
    }
    println!("cancel racing a client tool's output: {outcomes:?}");
    drop((a, b));
    db.cleanup().await;
}
