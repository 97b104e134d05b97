//! Several replicas on one PostgreSQL, at the store's level: a replica frozen inside a write
//! transaction (a process stopped mid-append, holding its row locks) neither blocks another's
//! takeover scan nor holds its locks for long, and no statement waits without bound.

use std::time::{Duration, Instant};

use behest::store::{ConnectOptions, LeaseStore, PostgresStore};
use sqlx::{Connection, Executor, PgConnection};

use crate::store::{lease, leased_run, now_ms};
use crate::support::db::{Backend, TestDb};

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
