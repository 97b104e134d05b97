//! Three replicas, one service (issue 23, item 6): three `behest serve` processes on one fresh
//! PostgreSQL database behind a round-robin TCP balancer written here, 50 concurrent tool runs,
//! watchers attached to replicas that do not own the run, cancels sent to random replicas; in
//! the middle one replica is killed (`kill -9`) and another frozen (`SIGSTOP`) past its lease,
//! then resumed (`SIGCONT`).
//!
//! What must hold: every run ends; every watcher's stream is the run's full replay byte for
//! byte (reconnecting with `Last-Event-ID` through the balancer when its replica died); no
//! event was written by a replica that did not hold the run's lease at that moment (a trigger
//! records, for every inserted event, the writing replica — its connections'
//! `application_name` — and the run's lease owner the insert saw); every accepted cancel ended
//! the run `cancelled`; the tool server saw no call executed twice without the same
//! `Idempotency-Key`; every session accepts its next run, which completes.
//!
//! It caught a failover bug (a replica's event batch hit `duplicate key … events_pkey` after a
//! takeover, and every run of that group-commit batch failed `internal`); the store now refuses
//! events that do not continue a run's log, run by run, and a takeover stops an old task of the
//! same run first (`store/sql/events.rs`, `runtime/recovery.rs`).
//!
//! PostgreSQL only: skipped without `BEHEST_TEST_POSTGRES_URL`, a failure without it when
//! `BEHEST_TEST_REQUIRE_POSTGRES=1`. The random choices (cancel times and targets) print their
//! seed; `BEHEST_HARNESS_SEED=N` replays one.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection};
use tokio::net::{TcpListener, TcpStream};

use crate::support::db::{Backend, TestDb};
use crate::support::fake_openai::{
    FakeOpenAi, RecordedRequest, Reply, text_stream, tool_calls_stream,
};
use crate::support::process::{ServerProcess, ToolServer, config_toml};

/// Concurrent runs.
const RUNS: usize = 50;
/// Replicas.
const REPLICAS: usize = 3;
/// The replica killed with `kill -9`, and the one frozen past its lease.
const KILLED: usize = 0;
const FROZEN: usize = 1;
/// The runs' lease; the frozen replica stays stopped for [`FREEZE`], well past it. Shorter
/// than the default (6 s) to keep the test short, long enough that a replica on a loaded CI
/// machine (a renewal's timeout is a third of it) does not fail-stop its runs before the kill.
const LEASE_TTL_MS: u64 = 3_000;
const FREEZE: Duration = Duration::from_millis(7_000);
/// Every this-many-th run gets a cancel, at a random moment, sent to a random replica.
const CANCEL_EVERY: usize = 4;

const TERMINAL: [&str; 3] = ["run_completed", "run_failed", "run_cancelled"];

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// xorshift64*: the test's random choices, reproducible from the printed seed.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

// ---------------------------------------------------------------------------------------------
// The balancer

/// A round-robin TCP balancer on `127.0.0.1:0`: each accepted connection goes to the next
/// healthy replica (`GET /readyz` answered 200 within 400 ms, checked every 150 ms, as a load
/// balancer's health check would), whose bytes it copies both ways until either side closes.
struct Balancer {
    addr: SocketAddr,
    healthy: Arc<Vec<AtomicBool>>,
    /// Connections forwarded to each replica.
    forwarded: Arc<Vec<AtomicUsize>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Balancer {
    async fn start(backends: Vec<SocketAddr>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind balancer");
        let addr = listener.local_addr().expect("balancer address");
        let healthy: Arc<Vec<AtomicBool>> =
            Arc::new(backends.iter().map(|_| AtomicBool::new(true)).collect());
        let forwarded: Arc<Vec<AtomicUsize>> =
            Arc::new(backends.iter().map(|_| AtomicUsize::new(0)).collect());
        let mut tasks = Vec::new();
        for (index, backend) in backends.iter().copied().enumerate() {
            let healthy = Arc::clone(&healthy);
            tasks.push(tokio::spawn(async move {
                let client = behest::net::client().expect("client");
                loop {
                    let ready = client
                        .get(format!("http://{backend}/readyz"))
                        .timeout(Duration::from_millis(400))
                        .send()
                        .await
                        .is_ok_and(|r| r.status() == 200);
                    healthy[index].store(ready, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(150)).await;
                }
            }));
        }
        let (accept_healthy, accept_forwarded) = (Arc::clone(&healthy), Arc::clone(&forwarded));
        tasks.push(tokio::spawn(async move {
            let mut next = 0usize;
            while let Ok((mut inbound, _)) = listener.accept().await {
                let start = next;
                next = next.wrapping_add(1);
                let (healthy, forwarded, backends) = (
                    Arc::clone(&accept_healthy),
                    Arc::clone(&accept_forwarded),
                    backends.clone(),
                );
                tokio::spawn(async move {
                    for attempt in 0..backends.len() {
                        let index = (start + attempt) % backends.len();
                        if !healthy[index].load(Ordering::SeqCst) {
                            continue;
                        }
                        let connect = TcpStream::connect(backends[index]);
                        if let Ok(Ok(mut outbound)) =
                            tokio::time::timeout(Duration::from_secs(1), connect).await
                        {
                            forwarded[index].fetch_add(1, Ordering::SeqCst);
                            let _ =
                                tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                            return;
                        }
                    }
                    // No replica is healthy: the client sees its connection closed.
                });
            }
        }));
        Self {
            addr,
            healthy,
            forwarded,
            tasks,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// A client that opens a new connection for every request: the balancer spreads requests,
/// not only connections, over the replicas.
fn balanced_client() -> reqwest::Client {
    behest::net::client_builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client")
}

// ---------------------------------------------------------------------------------------------
// The model's script and the SSE streams

fn input_of(run: usize) -> String {
    format!("job {run}: use the tools, then answer")
}

fn follow_up_of(run: usize) -> String {
    format!("follow-up {run}")
}

/// The text of a request message's content (a string or text parts).
fn content_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// The model of run `n`: first two tool calls at once — `idem` (idempotent, sleeps) and, on
/// even runs, `slow` (not idempotent, sleeps) else `quick` — streamed slowly; then a slow
/// final text. A follow-up gets a short answer.
fn reply_to(request: &RecordedRequest) -> Option<Reply> {
    let messages = request.body["messages"].as_array()?;
    let last_user = messages
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .map(|m| content_text(&m["content"]))?;
    if let Some(run) = last_user.strip_prefix("follow-up ") {
        return Some(Reply::sse(&text_stream(&["Again ", run])));
    }
    let run: usize = last_user
        .strip_prefix("job ")?
        .split(':')
        .next()?
        .parse()
        .ok()?;
    let step = messages.iter().filter(|m| m["role"] == "assistant").count();
    if step == 0 {
        let sleep = 500 + (run as u64 % 5) * 150;
        let second = if run.is_multiple_of(2) {
            "slow"
        } else {
            "quick"
        };
        let calls = [
            (
                format!("call_{run}_a"),
                "idem",
                json!({"marker": format!("{run}/a"), "sleep_ms": sleep}),
            ),
            (
                format!("call_{run}_b"),
                second,
                json!({"marker": format!("{run}/b"), "sleep_ms": sleep / 2}),
            ),
        ];
        let calls: Vec<(&str, &str, Value)> = calls
            .iter()
            .map(|(id, tool, arguments)| (id.as_str(), *tool, arguments.clone()))
            .collect();
        return Some(
            Reply::sse(&tool_calls_stream(&calls))
                .chunks_every(96)
                .delay(Duration::from_millis(40)),
        );
    }
    let words: Vec<String> = (1..=16).map(|w| format!("w{w}/{run} ")).collect();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    Some(
        Reply::sse(&text_stream(&words))
            .chunks_every(128)
            .delay(Duration::from_millis(60)),
    )
}

/// One SSE frame's text without comment lines (keep-alives), or `None` for a comment-only
/// frame; and its `id` and `event`.
struct Frame {
    text: String,
    id: Option<u64>,
    event: Option<String>,
}

/// The complete frames at the start of `bytes` (each ends with a blank line) and how many
/// bytes they take; an incomplete tail is left.
fn frames(bytes: &[u8]) -> (Vec<Frame>, usize) {
    let text = String::from_utf8_lossy(bytes);
    let mut out = Vec::new();
    let mut used = 0;
    while let Some(end) = text[used..].find("\n\n") {
        let block = &text[used..used + end];
        used += end + 2;
        let lines: Vec<&str> = block.lines().filter(|l| !l.starts_with(':')).collect();
        if lines.is_empty() {
            continue;
        }
        let field = |name: &str| {
            lines
                .iter()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim_start().to_owned())
        };
        out.push(Frame {
            text: format!("{}\n\n", lines.join("\n")),
            id: field("id:").and_then(|v| v.parse().ok()),
            event: field("event:"),
        });
    }
    (out, used)
}

/// A watcher's outcome: the frames' text as received (over every connection it needed), and
/// how many times it reconnected.
struct Watched {
    text: String,
    reconnects: usize,
    comments: bool,
}

/// Watches `run_id` from sequence 1 on `first` (a replica that does not own the run); when the
/// stream breaks before the terminal event (its replica was killed), reconnects through the
/// balancer with `Last-Event-ID`, as an SSE client does.
fn watch(
    first: String,
    balancer: String,
    run_id: String,
    progress: Arc<Mutex<String>>,
) -> tokio::task::JoinHandle<Watched> {
    tokio::spawn(async move {
        let client = balanced_client();
        let mut text = String::new();
        let mut last: Option<u64> = None;
        let mut reconnects = 0;
        let mut comments = false;
        let mut base = first;
        loop {
            let mut request = client.get(format!("{base}/runs/{run_id}/events"));
            if let Some(id) = last {
                request = request.header("Last-Event-ID", id.to_string());
            }
            let mut ended = false;
            *lock(&progress) = format!("connecting to {base} after {last:?}");
            if let Ok(response) = request.send().await {
                assert_eq!(response.status(), 200, "watch {run_id}");
                let mut bytes = response.bytes_stream();
                let mut buffer = Vec::new();
                while let Some(Ok(piece)) = bytes.next().await {
                    buffer.extend_from_slice(&piece);
                    let (complete, used) = frames(&buffer);
                    comments |= String::from_utf8_lossy(&buffer[..used]).contains("\n:")
                        || buffer.starts_with(b":");
                    buffer.drain(..used);
                    for frame in complete {
                        if let Some(id) = frame.id {
                            last = Some(id);
                        }
                        *lock(&progress) = format!("on {base}, last id {last:?}");
                        ended |= frame
                            .event
                            .as_deref()
                            .is_some_and(|e| TERMINAL.contains(&e));
                        text.push_str(&frame.text);
                    }
                }
            }
            if ended {
                return Watched {
                    text,
                    reconnects,
                    comments,
                };
            }
            reconnects += 1;
            assert!(reconnects < 20, "watch {run_id}: 20 reconnections");
            tokio::time::sleep(Duration::from_millis(200)).await;
            base = balancer.clone();
        }
    })
}

// ---------------------------------------------------------------------------------------------
// The database's record of who wrote each event

/// For every inserted event: the writing connection's `application_name` (`replica-N`, set in
/// each replica's database URL), the run's lease owner and expiry as the inserting transaction
/// saw them (its fencing check holds the run's row), and the database's clock.
const RECORD_WRITERS: &str = "
CREATE TABLE harness_writes (
    run_id UUID NOT NULL, sequence BIGINT NOT NULL, app TEXT NOT NULL,
    lease_owner TEXT, lease_expires_ms BIGINT, db_ms BIGINT NOT NULL
);
CREATE FUNCTION harness_record() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO harness_writes
    SELECT NEW.run_id, NEW.sequence, current_setting('application_name'), r.lease_owner,
           r.lease_expires_ms, (extract(epoch FROM clock_timestamp()) * 1000)::bigint
    FROM runs r WHERE r.id = NEW.run_id;
    RETURN NULL;
END $$;
CREATE TRIGGER harness_record AFTER INSERT ON events FOR EACH ROW EXECUTE FUNCTION harness_record();
";

/// `(run_id, sequence, app, lease_owner, lease_expires_ms, db_ms)`.
type Write = (uuid::Uuid, i64, String, Option<String>, Option<i64>, i64);

async fn writes(db: &mut PgConnection) -> Vec<Write> {
    sqlx::query_as(
        "SELECT run_id, sequence, app, lease_owner, lease_expires_ms, db_ms \
         FROM harness_writes ORDER BY db_ms, run_id, sequence",
    )
    .fetch_all(db)
    .await
    .expect("read harness_writes")
}

async fn db_now_ms(db: &mut PgConnection) -> i64 {
    sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")
        .fetch_one(db)
        .await
        .expect("database clock")
}

fn with_application_name(url: &str, name: &str) -> String {
    let joiner = if url.contains('?') { '&' } else { '?' };
    format!("{url}{joiner}application_name={name}")
}

// ---------------------------------------------------------------------------------------------
// The test

/// A cancel sent: the run, the replica it went to, the answer's status and body.
type Cancel = (usize, usize, u16, Value);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_survive_a_kill_and_a_freeze() {
    let Some(db) = TestDb::new(Backend::Postgres).await else {
        return;
    };
    let began = Instant::now();
    let seed = std::env::var("BEHEST_HARNESS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
                | 1
        });
    println!("replica harness: seed {seed} (BEHEST_HARNESS_SEED={seed} replays it)");
    let random = Arc::new(Mutex::new(Random(seed)));

    let fake = FakeOpenAi::start().await;
    fake.respond_with(reply_to);
    let tools = ToolServer::start().await;
    let config = config_toml(&fake.base_url(), &tools, "shutdown_grace_ms = 300").replace(
        "lease_ttl_ms = 1000",
        &format!("lease_ttl_ms = {LEASE_TTL_MS}"),
    ) + "\n[database]\nidle_in_transaction_timeout_ms = 1000\nlock_timeout_ms = 1000\n";

    let mut replicas = Vec::new();
    for index in 0..REPLICAS {
        let name = format!("replica-{index}");
        let url = with_application_name(&db.url, &name);
        replicas.push(ServerProcess::start(&name, &config, &url).await);
        if index == 0 {
            // Migrated by the first replica: record who writes each event from now on.
            let mut connection = PgConnection::connect(&db.url).await.unwrap();
            sqlx::raw_sql(RECORD_WRITERS)
                .execute(&mut connection)
                .await
                .unwrap();
        }
    }
    let direct: Vec<String> = replicas.iter().map(|r| r.url("")).collect();
    let balancer = Balancer::start(replicas.iter().map(|r| r.addr).collect()).await;
    let client = balanced_client();
    let mut db_connection = PgConnection::connect(&db.url).await.unwrap();

    // 50 runs, each in its own session, created through the balancer.
    let created = futures::future::join_all((0..RUNS).map(|run| {
        let request = client
            .post(balancer.url("/runs"))
            .json(&json!({"provider": "fake", "model": "fake-model", "input": input_of(run)}))
            .timeout(Duration::from_secs(30));
        async move {
            let response = request.send().await.expect("POST /runs");
            let status = response.status();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            assert_eq!(status, 202, "POST /runs: {body}");
            (
                body["run_id"].as_str().unwrap().to_owned(),
                body["session_id"].as_str().unwrap().to_owned(),
            )
        }
    }))
    .await;
    let run_index: HashMap<uuid::Uuid, usize> = created
        .iter()
        .enumerate()
        .map(|(n, (id, _))| (id.parse().unwrap(), n))
        .collect();

    // Each run's owner: the replica that wrote its first event.
    let mut owner_of: HashMap<usize, usize> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while owner_of.len() < RUNS {
        assert!(Instant::now() < deadline, "not every run wrote an event");
        for (run_id, _, app, ..) in writes(&mut db_connection).await {
            if let (Some(run), Some(replica)) = (
                run_index.get(&run_id),
                app.strip_prefix("replica-").and_then(|n| n.parse().ok()),
            ) {
                owner_of.entry(*run).or_insert(replica);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Two watchers per run, on the two replicas that do not own it.
    let mut watchers = Vec::new();
    for (run, (run_id, _)) in created.iter().enumerate() {
        for other in (0..REPLICAS).filter(|r| *r != owner_of[&run]) {
            let progress = Arc::new(Mutex::new(String::new()));
            watchers.push((
                run,
                watch(
                    direct[other].clone(),
                    balancer.url(""),
                    run_id.clone(),
                    Arc::clone(&progress),
                ),
                progress,
            ));
        }
    }

    // Cancels at random moments to random replicas (not the killed one once it is dead: a
    // client whose connection is refused would retry elsewhere).
    let killed = Arc::new(AtomicBool::new(false));
    let cancels: Vec<tokio::task::JoinHandle<Cancel>> = (0..RUNS)
        .filter(|run| run % CANCEL_EVERY == 1)
        .map(|run| {
            let (after, mut target) = {
                let mut random = lock(&random);
                (random.below(5_000), random.below(REPLICAS as u64) as usize)
            };
            let (run_id, direct, killed) =
                (created[run].0.clone(), direct.clone(), Arc::clone(&killed));
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(200 + after)).await;
                // A cancel that could not reach its replica (killed meanwhile) is sent again
                // to another one, as a client would: cancel is idempotent.
                for _ in 0..REPLICAS {
                    if target == KILLED && killed.load(Ordering::SeqCst) {
                        target = (KILLED + 1 + run % (REPLICAS - 1)) % REPLICAS;
                    }
                    let response = behest::net::client()
                        .expect("client")
                        .post(format!("{}/runs/{run_id}/cancel", direct[target]))
                        .timeout(Duration::from_secs(30))
                        .send()
                        .await;
                    if let Ok(response) = response {
                        let status = response.status().as_u16();
                        return (
                            run,
                            target,
                            status,
                            response.json().await.unwrap_or(Value::Null),
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    target = (target + 1) % REPLICAS;
                }
                (run, target, 0, json!("no replica answered the cancel"))
            })
        })
        .collect();

    // Mid-flight: once a third of the runs are inside their tools, kill one replica and freeze
    // another past its lease.
    let deadline = Instant::now() + Duration::from_secs(30);
    while tools.executions().len() < RUNS * 2 / 3 {
        assert!(
            Instant::now() < deadline,
            "the runs never reached their tools"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let running_at_kill = tools.executions().iter().filter(|e| !e.finished).count();
    replicas[KILLED].kill().await;
    killed.store(true, Ordering::SeqCst);
    let killed_at = Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    replicas[FROZEN].signal("STOP").await;
    tokio::time::sleep(FREEZE).await;
    let thawed_db_ms = db_now_ms(&mut db_connection).await;
    replicas[FROZEN].signal("CONT").await;

    // Every run ends.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut status: BTreeMap<usize, String> = BTreeMap::new();
    while status.len() < RUNS {
        assert!(
            Instant::now() < deadline,
            "runs still not terminal 60 s after the thaw: {:?}",
            (0..RUNS)
                .filter(|r| !status.contains_key(r))
                .collect::<Vec<_>>()
        );
        for (run, (run_id, _)) in created.iter().enumerate() {
            if status.contains_key(&run) {
                continue;
            }
            let Ok(response) = client
                .get(balancer.url(&format!("/runs/{run_id}")))
                .timeout(Duration::from_secs(10))
                .send()
                .await
            else {
                continue;
            };
            let body: Value = response.json().await.unwrap_or(Value::Null);
            let now = body["status"].as_str().unwrap_or_default().to_owned();
            if ["completed", "failed", "cancelled"].contains(&now.as_str()) {
                status.insert(run, now);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ended_after = killed_at.elapsed();

    // Every watcher's stream is the full replay, byte for byte.
    let mut replays = HashMap::new();
    for (run, (run_id, _)) in created.iter().enumerate() {
        let response = client
            .get(balancer.url(&format!("/runs/{run_id}/events")))
            .timeout(Duration::from_secs(20))
            .send()
            .await
            .expect("replay");
        assert_eq!(response.status(), 200);
        let bytes = response.bytes().await.expect("replay body");
        let (frames, used) = frames(&bytes);
        assert_eq!(used, bytes.len(), "run {run}: the replay ends mid-frame");
        let ids: Vec<Option<u64>> = frames.iter().map(|f| f.id).collect();
        let contiguous: Vec<Option<u64>> = (1..=frames.len() as u64).map(Some).collect();
        assert_eq!(ids, contiguous, "run {run}: the log is not contiguous");
        let terminal: Vec<&str> = frames
            .iter()
            .filter_map(|f| f.event.as_deref())
            .filter(|e| TERMINAL.contains(e))
            .collect();
        assert_eq!(terminal.len(), 1, "run {run}: terminal events {terminal:?}");
        assert!(
            frames
                .last()
                .and_then(|f| f.event.as_deref())
                .is_some_and(|e| TERMINAL.contains(&e)),
            "run {run}: the log does not end with its terminal event"
        );
        let text: String = frames.iter().map(|f| f.text.as_str()).collect();
        replays.insert(run, text);
    }
    let (mut reconnected, mut with_comments) = (0, 0);
    for (run, watcher, progress) in watchers {
        let watched = tokio::time::timeout(Duration::from_secs(30), watcher)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "run {run} (owner replica-{}): a watcher never saw the end: {}",
                    owner_of[&run],
                    lock(&progress)
                )
            })
            .unwrap();
        reconnected += usize::from(watched.reconnects > 0);
        with_comments += usize::from(watched.comments);
        assert!(
            watched.text == replays[&run],
            "run {run}: a watcher's stream differs from the replay\nwatched:\n{}\nreplay:\n{}",
            watched.text,
            replays[&run]
        );
    }

    // Fencing: every event was written by the replica holding the run's lease at that moment.
    // Each replica's writes name one lease owner (its own id), and no owner two replicas.
    let recorded = writes(&mut db_connection).await;
    let mut owners_of_app: BTreeMap<String, HashSet<String>> = BTreeMap::new();
    let mut apps_of_owner: HashMap<String, HashSet<String>> = HashMap::new();
    let (mut unowned, mut expired, mut frozen_after_thaw) = (0, 0, 0);
    for (_, _, app, owner, expires, at) in &recorded {
        match owner {
            Some(owner) => {
                owners_of_app
                    .entry(app.clone())
                    .or_default()
                    .insert(owner.clone());
                apps_of_owner
                    .entry(owner.clone())
                    .or_default()
                    .insert(app.clone());
            }
            None => unowned += 1,
        }
        expired += usize::from(expires.is_some_and(|e| e < *at));
        frozen_after_thaw +=
            usize::from(*app == format!("replica-{FROZEN}") && *at >= thawed_db_ms);
    }
    for (app, owners) in &owners_of_app {
        assert_eq!(
            owners.len(),
            1,
            "{app} wrote events of runs leased to {owners:?}: a write after a lost lease"
        );
    }
    for (owner, apps) in &apps_of_owner {
        assert_eq!(apps.len(), 1, "lease owner {owner} written by {apps:?}");
    }
    // The faults did move runs: some run of the killed and of the frozen replica was
    // continued by another.
    let mut writers: HashMap<uuid::Uuid, Vec<String>> = HashMap::new();
    for (run_id, _, app, ..) in &recorded {
        let apps = writers.entry(*run_id).or_default();
        if apps.last() != Some(app) {
            apps.push(app.clone());
        }
    }
    let moved_from = |replica: usize| {
        let app = format!("replica-{replica}");
        writers
            .values()
            .filter(|apps| {
                apps.iter()
                    .position(|a| *a == app)
                    .is_some_and(|i| i + 1 < apps.len())
            })
            .count()
    };
    let (moved_from_killed, moved_from_frozen) = (moved_from(KILLED), moved_from(FROZEN));
    assert!(
        moved_from_killed > 0 && moved_from_frozen > 0,
        "no run moved: {moved_from_killed} from the killed replica, {moved_from_frozen} from \
         the frozen one"
    );
    assert_eq!(
        recorded.len(),
        replays
            .values()
            .map(|text| frames(text.as_bytes()).0.len())
            .sum::<usize>(),
        "events inserted and events in the logs differ"
    );

    // Every accepted cancel ended its run cancelled; a refused one found the run finished.
    let mut cancelled_by_request = HashSet::new();
    let mut cancel_answers: BTreeMap<u16, usize> = BTreeMap::new();
    for cancel in cancels {
        let (run, target, code, body) = cancel.await.unwrap();
        *cancel_answers.entry(code).or_default() += 1;
        match code {
            202 | 200 => {
                assert_eq!(
                    status[&run], "cancelled",
                    "run {run}: a cancel sent to replica-{target} was accepted ({body}) but the \
                     run ended {}",
                    status[&run]
                );
                cancelled_by_request.insert(run);
            }
            409 => {
                assert_eq!(body["code"], "run_finished", "run {run}: {body}");
                assert_ne!(status[&run], "cancelled", "run {run}: {body}");
            }
            _ => panic!("run {run}: a cancel sent to replica-{target} answered {code}: {body}"),
        }
    }
    for (run, ended) in &status {
        let expected = if cancelled_by_request.contains(run) {
            "cancelled"
        } else {
            "completed"
        };
        assert_eq!(ended, expected, "run {run} ended {ended}");
    }

    // No tool call executed twice without carrying the same idempotency key both times.
    let executions = tools.executions();
    let mut by_marker: BTreeMap<String, Vec<Option<String>>> = BTreeMap::new();
    for execution in &executions {
        by_marker
            .entry(execution.marker.clone())
            .or_default()
            .push(execution.idempotency_key.clone());
    }
    let mut repeated = 0;
    for (marker, keys) in &by_marker {
        if keys.len() > 1 {
            repeated += 1;
            assert!(
                keys[0].is_some() && keys.iter().all(|k| *k == keys[0]),
                "{marker} executed {} times with keys {keys:?}",
                keys.len()
            );
        }
    }

    // Every session takes its next run, through the balancer, and it completes.
    let follow_ups =
        futures::future::join_all(created.iter().enumerate().map(|(run, (_, session))| {
            let request = client
                .post(balancer.url("/runs"))
                .json(
                    &json!({"provider": "fake", "model": "fake-model", "session_id": session,
                          "input": follow_up_of(run)}),
                )
                .timeout(Duration::from_secs(30));
            async move {
                let response = request.send().await.expect("follow-up");
                let status = response.status().as_u16();
                (
                    run,
                    status,
                    response.json::<Value>().await.unwrap_or(Value::Null),
                )
            }
        }))
        .await;
    let mut pending = Vec::new();
    for (run, code, body) in follow_ups {
        assert!(
            code == 202 || code == 200,
            "run {run}: follow-up answered {code}: {body}"
        );
        pending.push((run, body["run_id"].as_str().unwrap().to_owned()));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Some((run, run_id)) = pending.last().cloned() {
        assert!(
            Instant::now() < deadline,
            "follow-up of run {run} not completed"
        );
        let response = client
            .get(balancer.url(&format!("/runs/{run_id}")))
            .timeout(Duration::from_secs(10))
            .send()
            .await;
        let body: Value = match response {
            Ok(response) => response.json().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        };
        match body["status"].as_str() {
            Some("completed") => {
                pending.pop();
            }
            Some("failed" | "cancelled") => panic!("follow-up of run {run}: {body}"),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }

    // The frozen replica came back as a healthy member.
    let (ready, body) = replicas[FROZEN].get("/readyz").await;
    assert_eq!(ready, 200, "replica-{FROZEN} after the thaw: {body}");

    let forwarded: Vec<usize> = balancer
        .forwarded
        .iter()
        .map(|f| f.load(Ordering::SeqCst))
        .collect();
    let healthy: Vec<bool> = balancer
        .healthy
        .iter()
        .map(|h| h.load(Ordering::SeqCst))
        .collect();
    println!(
        "replica harness: {RUNS} runs ({} cancelled, {} completed) on {REPLICAS} replicas; {} tool \
         executions ({running_at_kill} running at the kill, {repeated} calls executed more than \
         once, all with their idempotency key); every run ended {} ms after the kill \
         (replica-{KILLED} killed, replica-{FROZEN} frozen {} ms, lease {LEASE_TTL_MS} ms; \
         {moved_from_killed} runs continued from the killed one, {moved_from_frozen} from the \
         frozen one); {} \
         watchers byte-identical to the replay ({reconnected} reconnected, {with_comments} saw \
         keep-alives); {} events, {unowned} written without a lease owner, {expired} after \
         their lease's expiry, {frozen_after_thaw} by the frozen replica after its thaw, each \
         by its lease holder; cancel answers {cancel_answers:?}; balancer connections per \
         replica {forwarded:?}, healthy at the end {healthy:?}; {} s in all",
        status.values().filter(|s| *s == "cancelled").count(),
        status.values().filter(|s| *s == "completed").count(),
        executions.len(),
        ended_after.as_millis(),
        FREEZE.as_millis(),
        RUNS * (REPLICAS - 1),
        recorded.len(),
        began.elapsed().as_secs(),
    );

    drop(balancer);
    drop(replicas);
    db.assert_logs_fold().await;
    db.cleanup().await;
}
