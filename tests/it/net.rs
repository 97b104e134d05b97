//! Connections cannot hold the server (issue 27, items 2, 6 and 8), against the real
//! `behest serve` binary with short `[http]` timeouts: an idle socket, headers sent one line at
//! a time and an idle kept-alive connection are closed, a slow body is answered `408
//! request_timeout` and closed, connections beyond `max_connections` are closed at once while
//! `/healthz` still answers, an event stream quiet for longer than every timeout still
//! delivers, and SIGTERM does not wait for idle or half-sent connections. A second server on
//! one SQLite file refuses to start; secrets in query strings never reach the debug log. A
//! request head hyper would refuse is answered problem+json by the accept loop.

use crate::support;

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::json;
use support::db::{Backend, TestDb};
use support::process::ServerProcess;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The built-in model, one token every `token_delay_ms`.
fn scripted(token_delay_ms: u64) -> String {
    format!(
        "[providers.demo]\nkind = \"scripted\"\ntoken_delay_ms = {token_delay_ms}\n\
         [providers.demo.models.demo]\ncontext_window = 32768\nmax_output_tokens = 4096\n"
    )
}

/// `[http]` with these timeouts (ms) and cap, and the built-in model.
fn config(header_ms: u64, body_ms: u64, keep_alive_ms: u64, max_connections: usize) -> String {
    format!(
        "[http]\nheader_read_timeout_ms = {header_ms}\nbody_read_timeout_ms = {body_ms}\n\
         keep_alive_timeout_ms = {keep_alive_ms}\nmax_connections = {max_connections}\n\n{}",
        scripted(30)
    )
}

/// What a socket showed before it closed: the bytes it received, and how long it took to
/// close (`None`: still open after `limit`).
async fn until_closed(stream: &mut TcpStream, limit: Duration) -> (String, Option<Duration>) {
    let start = Instant::now();
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        let left = limit.saturating_sub(start.elapsed());
        match tokio::time::timeout(left, stream.read(&mut buffer)).await {
            Err(_) => return (String::from_utf8_lossy(&received).into_owned(), None),
            Ok(Ok(0) | Err(_)) => {
                return (
                    String::from_utf8_lossy(&received).into_owned(),
                    Some(start.elapsed()),
                );
            }
            Ok(Ok(n)) => received.extend_from_slice(&buffer[..n]),
        }
    }
}

/// Reads one whole response (head and `Content-Length` body) from a kept-alive connection.
async fn read_response(stream: &mut TcpStream) -> String {
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&received).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|line| {
                    let (name, value) = line.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if received.len() >= end + 4 + length {
                return text;
            }
        }
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buffer))
            .await
            .expect("a response within 10 s")
            .expect("read a response");
        assert!(n > 0, "closed before the response ended: {text}");
        received.extend_from_slice(&buffer[..n]);
    }
}

async fn connect(server: &ServerProcess) -> TcpStream {
    TcpStream::connect(server.addr).await.expect("connect")
}

async fn slow_and_idle_connections_are_closed(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let server = ServerProcess::start("net", &config(500, 700, 2000, 64), &db.url).await;
    let header = Duration::from_millis(500);

    // A socket that sends nothing is closed after the header timeout.
    let mut idle = connect(&server).await;
    let (received, closed) = until_closed(&mut idle, Duration::from_secs(10)).await;
    let closed = closed.expect("an idle socket is closed");
    assert!(received.is_empty(), "{received}");
    assert!(closed >= header - Duration::from_millis(50), "{closed:?}");
    assert!(closed < Duration::from_secs(4), "{closed:?}");

    // Headers sent one line every 150 ms: closed once the header timeout passed, unanswered.
    let mut trickle = connect(&server).await;
    let start = Instant::now();
    trickle
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: behest\r\n")
        .await
        .unwrap();
    let mut closed = None;
    for line in 0..60 {
        let _ = trickle
            .write_all(format!("X-Line-{line}: 1\r\n").as_bytes())
            .await;
        let mut buffer = [0u8; 1024];
        match tokio::time::timeout(Duration::from_millis(150), trickle.read(&mut buffer)).await {
            Err(_) => {}
            Ok(Ok(0) | Err(_)) => {
                closed = Some(start.elapsed());
                break;
            }
            Ok(Ok(n)) => panic!(
                "a trickled head was answered: {}",
                String::from_utf8_lossy(&buffer[..n])
            ),
        }
    }
    let closed = closed.expect("a trickled head is closed within 9 s");
    assert!(closed >= header - Duration::from_millis(50), "{closed:?}");
    assert!(closed < Duration::from_secs(4), "{closed:?}");

    // A body sent one byte every 150 ms: 408 request_timeout, then closed.
    let mut slow = connect(&server).await;
    slow.write_all(
        b"POST /runs HTTP/1.1\r\nHost: behest\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{",
    )
    .await
    .unwrap();
    let start = Instant::now();
    let mut received = Vec::new();
    let mut closed = None;
    for _ in 0..60 {
        let _ = slow.write_all(b" ").await;
        let mut buffer = [0u8; 4096];
        match tokio::time::timeout(Duration::from_millis(150), slow.read(&mut buffer)).await {
            Err(_) => {}
            Ok(Ok(0) | Err(_)) => {
                closed = Some(start.elapsed());
                break;
            }
            Ok(Ok(n)) => received.extend_from_slice(&buffer[..n]),
        }
    }
    let received = String::from_utf8_lossy(&received);
    assert!(received.starts_with("HTTP/1.1 408"), "{received}");
    assert!(received.contains("application/problem+json"), "{received}");
    assert!(
        received.contains("\"code\":\"request_timeout\""),
        "{received}"
    );
    let closed = closed.expect("a slow body's connection is closed");
    assert!(closed < Duration::from_secs(4), "{closed:?}");

    // A kept-alive connection: a second request after more than the header timeout is
    // answered (keep-alive is 2 s), then the idle connection is closed after 2 s.
    let mut kept = connect(&server).await;
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: behest\r\n\r\n")
        .await
        .unwrap();
    let first = read_response(&mut kept).await;
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: behest\r\n\r\n")
        .await
        .unwrap();
    let second = read_response(&mut kept).await;
    assert!(second.starts_with("HTTP/1.1 200"), "{second}");
    let (received, closed) = until_closed(&mut kept, Duration::from_secs(10)).await;
    assert!(received.is_empty(), "{received}");
    let closed = closed.expect("an idle kept-alive connection is closed");
    assert!(closed >= Duration::from_millis(1900), "{closed:?}");
    assert!(closed < Duration::from_secs(6), "{closed:?}");

    // Well-behaved clients are served as before.
    assert_eq!(server.get("/healthz").await.0, 200);
    db.cleanup().await;
}

/// An event stream whose run is quiet for longer than the header and keep-alive timeouts
/// stays open (its keep-alive comments and events are the server's writes) and delivers the
/// run to its end.
async fn event_streams_outlive_the_timeouts(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let toml = config(300, 300, 500, 64).replace("token_delay_ms = 30", "token_delay_ms = 1200");
    let server = ServerProcess::start(
        "net",
        &format!("[runtime]\nkeep_alive_ms = 5000\n{toml}"),
        &db.url,
    )
    .await;
    let start = Instant::now();
    let response = server
        .client
        .post(server.url("/runs/stream"))
        .json(&json!({"provider": "demo", "model": "demo", "input": "count to 3"}))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let stream = response.text().await.expect("the whole stream");
    let took = start.elapsed();
    assert!(stream.contains("event: run_completed"), "{stream}");
    assert_eq!(stream.matches("event: text_delta").count(), 3, "{stream}");
    // Three tokens 1.2 s apart: the stream was quiet > 1 s, twice the keep-alive timeout.
    assert!(took >= Duration::from_millis(3000), "{took:?}");
    db.cleanup().await;
}

/// With `max_connections = 8`: 8 idle sockets do not keep `/healthz` out (the oldest is closed
/// for it, long before the header timeout); 8 event streams in progress fill the cap, and a
/// connection beyond it is closed at once until one of them ends.
async fn connections_beyond_the_cap_are_closed_and_healthz_answers(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let toml = config(5000, 5000, 5000, 8).replace("token_delay_ms = 30", "token_delay_ms = 50");
    let server = ServerProcess::start("net", &toml, &db.url).await;
    let mut idle = Vec::new();
    for _ in 0..8 {
        idle.push(connect(&server).await);
        // In order: the first is the oldest.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let start = Instant::now();
    assert_eq!(server.get("/healthz").await.0, 200);
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    let (_, closed) = until_closed(&mut idle[0], Duration::from_secs(2)).await;
    assert!(
        closed.is_some(),
        "the oldest idle socket was closed for /healthz"
    );
    let (_, closed) = until_closed(&mut idle[7], Duration::from_millis(300)).await;
    assert!(closed.is_none(), "the newest idle socket stays open");

    // A long run, and 8 event streams of it: every connection has a request in progress.
    let (status, _, created) = server
        .post(
            "/runs",
            &json!({"provider": "demo", "model": "demo", "input": "count to 2000"}),
        )
        .await;
    assert_eq!(status, 202, "{created}");
    let run_id = created["run_id"].as_str().unwrap().to_owned();
    let mut streams = Vec::new();
    for _ in 0..8 {
        let mut stream = connect(&server).await;
        stream
            .write_all(
                format!("GET /runs/{run_id}/events HTTP/1.1\r\nHost: behest\r\n\r\n").as_bytes(),
            )
            .await
            .unwrap();
        let mut buffer = [0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buffer))
            .await
            .expect("the stream answers")
            .unwrap();
        let head = String::from_utf8_lossy(&buffer[..n]).into_owned();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        streams.push(stream);
    }
    for extra in 0..3 {
        let mut over = connect(&server).await;
        let _ = over
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: behest\r\n\r\n")
            .await;
        let (received, closed) = until_closed(&mut over, Duration::from_secs(3)).await;
        assert!(
            received.is_empty(),
            "connection {extra} over the cap: {received}"
        );
        let closed = closed.unwrap_or_else(|| panic!("connection {extra} over the cap is open"));
        assert!(closed < Duration::from_secs(1), "{closed:?}");
    }
    // One stream ends: /healthz answers again.
    drop(streams.pop());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match server.try_get("/healthz").await {
            Ok((200, _)) => break,
            other => {
                assert!(
                    Instant::now() < deadline,
                    "/healthz never answered: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    assert!(server.log().contains("max_connections"), "{}", server.log());
    db.cleanup().await;
}

/// SIGTERM with an idle socket, a half-sent request head and an idle kept-alive connection
/// open (timeouts of a minute): the server exits in seconds, not after the timeouts.
async fn a_drain_does_not_wait_for_idle_or_half_sent_connections(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let mut server =
        ServerProcess::start("net", &config(60_000, 60_000, 60_000, 64), &db.url).await;
    let mut idle = connect(&server).await;
    let mut half = connect(&server).await;
    half.write_all(b"GET /healthz HTTP/1.1\r\nHost: behest\r\n")
        .await
        .unwrap();
    let mut kept = connect(&server).await;
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: behest\r\n\r\n")
        .await
        .unwrap();
    assert!(read_response(&mut kept).await.starts_with("HTTP/1.1 200"));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let start = Instant::now();
    server.terminate().await;
    let status = server.wait_exit(Duration::from_secs(20)).await;
    let took = start.elapsed();
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    // Held by those sockets it would take the minute of their timeouts; a loaded machine (the
    // whole suite on 2 cores) was seen to take ~6 s from the signal to the process's exit.
    assert!(took < Duration::from_secs(15), "SIGTERM took {took:?}");
    for socket in [&mut idle, &mut half, &mut kept] {
        let (_, closed) = until_closed(socket, Duration::from_secs(2)).await;
        assert!(closed.is_some(), "a socket stayed open");
    }
    db.cleanup().await;
}

/// Secrets in query strings, in any case or percent-encoding, never reach the log at debug
/// level; `access%5Ftoken` authenticates the event stream like `access_token`.
async fn query_secrets_never_reach_the_log(backend: Backend) {
    let Some(db) = TestDb::new(backend).await else {
        return;
    };
    let key = "KEY-7f3a9c-the-api-key";
    let toml = format!("[auth]\nkeys = [\"{key}\"]\n\n{}", scripted(1));
    let server =
        ServerProcess::start_with_env("net", &toml, &db.url, &[("RUST_LOG", "debug")]).await;
    let created = server
        .client
        .post(server.url("/runs"))
        .bearer_auth(key)
        .json(&json!({"provider": "demo", "model": "demo", "input": "Hi"}))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 202);
    let run_id = created.json::<serde_json::Value>().await.unwrap()["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let get = |path: String| {
        let request = server
            .client
            .get(server.url(&path))
            .timeout(Duration::from_secs(10));
        async move { request.send().await.unwrap().status().as_u16() }
    };
    let events = format!("/runs/{run_id}/events");
    // The key authenticates through its percent-encoded name too.
    assert_eq!(get(format!("{events}?access%5Ftoken={key}")).await, 200);
    assert_eq!(
        // Cursor 0: a cursor beyond the stored log of a run still going is 400 invalid_cursor,
        // and the run's first event may not be stored yet.
        get(format!("{events}?last_event_id=0&access_token={key}")).await,
        200
    );
    assert_eq!(get(format!("{events}?access_token=wrong")).await, 401);
    let secrets = [
        "SECRET-upper-case",
        "SECRET-api-key",
        "SECRET-client",
        "SECRET-password",
        "SECRET-auth",
    ];
    assert_eq!(
        get(format!("{events}?ACCESS_TOKEN={}", secrets[0])).await,
        401
    );
    assert_eq!(get(format!("/runs?Api%2DKey={}", secrets[1])).await, 401);
    assert_eq!(
        get(format!("/runs?client%5fsecret={}&limit=1", secrets[2])).await,
        401
    );
    assert_eq!(get(format!("/healthz?PassWord={}", secrets[3])).await, 200);
    assert_eq!(
        get(format!("/nowhere?Authorization={}", secrets[4])).await,
        404
    );
    // The log is written as requests end: give the last lines a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let log = server.log();
    assert!(
        log.contains("[redacted]"),
        "request URIs are logged at debug:\n{log}"
    );
    assert!(!log.contains(key), "the API key is in the log:\n{log}");
    for secret in secrets {
        assert!(!log.contains(secret), "{secret} is in the log:\n{log}");
    }
    db.cleanup().await;
}

/// A second `behest serve` on the SQLite file of a running one exits at once with a message
/// naming the file; the first keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_server_on_one_sqlite_file_refuses_to_start() {
    let db = TestDb::new(Backend::Sqlite).await.unwrap();
    let first = ServerProcess::start("first", &scripted(1), &db.url).await;
    let created = first
        .post(
            "/runs",
            &json!({"provider": "demo", "model": "demo", "input": "Hi"}),
        )
        .await;
    assert_eq!(created.0, 202, "{}", created.2);
    let path = db.url.trim_start_matches("sqlite://");
    // Neither a second server nor `behest migrate` (which would change the schema under the
    // first) opens the file.
    for args in [
        &["serve", "--bind", "127.0.0.1:0", "--database-url", &db.url][..],
        &["migrate", "--database-url", &db.url][..],
    ] {
        let second = tokio::process::Command::new(env!("CARGO_BIN_EXE_behest"))
            .args(args)
            .env_remove("BEHEST_CONFIG")
            .env_remove("BEHEST_DATABASE_URL")
            .env_remove("BEHEST_BIND")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let output = tokio::time::timeout(Duration::from_secs(30), second.wait_with_output())
            .await
            .expect("the second process exits")
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?}: {stderr}");
        assert!(
            stderr.contains("another behest process is using"),
            "{args:?}: {stderr}"
        );
        assert!(stderr.contains(path), "{args:?}: {stderr}");
    }
    // The first one still serves, and its run was not taken over.
    assert_eq!(first.get("/healthz").await.0, 200);
    let run_id = created.2["run_id"].as_str().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let run = first.get_json(&format!("/runs/{run_id}")).await;
        if run["status"] == "completed" {
            break;
        }
        assert!(Instant::now() < deadline, "{run}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The status line and the JSON body of a problem+json response whose connection then closed.
async fn refused(stream: &mut TcpStream, request: &[u8]) -> (String, serde_json::Value) {
    stream.write_all(request).await.expect("send");
    let (answer, closed) = until_closed(stream, Duration::from_secs(10)).await;
    assert!(closed.is_some(), "the connection stays open: {answer}");
    let (head, body) = answer.split_once("\r\n\r\n").expect("a whole response");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/problem+json"),
        "{answer}"
    );
    let status = head.lines().next().unwrap_or_default().to_owned();
    (status, serde_json::from_str(body).expect("a JSON body"))
}

/// A request head hyper's parser refuses (issue 27: a control character in `Idempotency-Key`)
/// gets problem+json from the binary's accept loop, on a new connection and on a kept-alive
/// one, with any body the client sent dropped; no run is created. A header that may come once
/// (`Idempotency-Key`, `Last-Event-ID`, `Authorization`) given twice is `400 duplicate_header`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_heads_and_repeated_headers_are_problem_json() {
    let db = TestDb::new(Backend::Sqlite).await.unwrap();
    let server = ServerProcess::start("net", &scripted(1), &db.url).await;
    let body = r#"{"provider": "demo", "model": "demo", "input": "Hi"}"#;
    for key in ["a\u{1}b", "a\u{7f}", "\u{0}"] {
        let request = format!(
            "POST /runs HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             Idempotency-Key: {key}\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let (status, problem) = refused(&mut connect(&server).await, request.as_bytes()).await;
        assert_eq!(status, "HTTP/1.1 400 Bad Request", "{problem}");
        assert_eq!(problem["code"], "invalid_header", "{problem}");
        assert_eq!(problem["field"], "Idempotency-Key", "{problem}");
        assert_eq!(problem["status"], 400, "{problem}");
    }
    // On a kept-alive connection, after a request answered.
    let mut stream = connect(&server).await;
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    assert!(read_response(&mut stream).await.starts_with("HTTP/1.1 200"));
    let (_, problem) = refused(
        &mut stream,
        b"GET /runs HTTP/1.1\r\nhost: x\r\nLast-Event-ID: 1\x02\r\n\r\n",
    )
    .await;
    assert_eq!(
        (&problem["code"], &problem["field"]),
        (&json!("invalid_header"), &json!("Last-Event-ID")),
        "{problem}"
    );
    // A malformed request line, and a header line without a colon.
    let (_, problem) = refused(
        &mut connect(&server).await,
        b"GET /a\x01b HTTP/1.1\r\nhost: x\r\n\r\n",
    )
    .await;
    assert_eq!(problem["code"], "malformed_request", "{problem}");
    let (_, problem) = refused(
        &mut connect(&server).await,
        b"GET / HTTP/1.1\r\nhost: x\r\nno colon here\r\n\r\n",
    )
    .await;
    assert_eq!(problem["code"], "invalid_header", "{problem}");
    assert_eq!(server.get_json("/runs").await["runs"], json!([]));
    // Headers that may come once.
    for (request, field) in [
        (
            format!(
                "POST /runs HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                 Idempotency-Key: a\r\nIdempotency-Key: b\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            ),
            "Idempotency-Key",
        ),
        (
            "GET /runs/x/events HTTP/1.1\r\nhost: x\r\nLast-Event-ID: 1\r\n\
             Last-Event-ID: 1\r\n\r\n"
                .to_owned(),
            "Last-Event-ID",
        ),
        (
            "GET /runs HTTP/1.1\r\nhost: x\r\nAuthorization: Bearer a\r\n\
             authorization: Bearer b\r\n\r\n"
                .to_owned(),
            "Authorization",
        ),
        (
            "GET /runs HTTP/1.1\r\nhost: x\r\nHost: y\r\n\r\n".to_owned(),
            "Host",
        ),
        (
            format!(
                "POST /runs HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                 Content-Type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            ),
            "Content-Type",
        ),
    ] {
        let mut stream = connect(&server).await;
        stream.write_all(request.as_bytes()).await.unwrap();
        let answer = read_response(&mut stream).await;
        let (head, problem) = answer.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 400"), "{answer}");
        let problem: serde_json::Value = serde_json::from_str(problem).unwrap();
        assert_eq!(problem["code"], "duplicate_header", "{problem}");
        assert_eq!(problem["field"], field, "{problem}");
    }
    assert_eq!(server.get_json("/runs").await["runs"], json!([]));
}

on_both_backends!(
    slow_and_idle_connections_are_closed,
    event_streams_outlive_the_timeouts,
    connections_beyond_the_cap_are_closed_and_healthz_answers,
    a_drain_does_not_wait_for_idle_or_half_sent_connections,
    query_secrets_never_reach_the_log,
);
