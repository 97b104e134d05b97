//! Fresh databases for tests: a SQLite file in a temp dir, or a new PostgreSQL database on the
//! server named by `BEHEST_TEST_POSTGRES_URL` (skipped, loudly, when unset; a failure when
//! `BEHEST_TEST_REQUIRE_POSTGRES=1`, as in CI).

use std::sync::Arc;

use behest::runtime::RunTrail;
use behest::store::{self, Store};
use sqlx::Connection;

/// The two backends every store and event-log test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// A fresh database; dropped with the temp dir (SQLite) or by [`TestDb::cleanup`] (PostgreSQL).
pub struct TestDb {
    pub url: String,
    _dir: Option<tempfile::TempDir>,
    postgres: Option<(String, String)>,
}

impl TestDb {
    /// A fresh database, or `None` when PostgreSQL is not configured (and not required).
    pub async fn new(backend: Backend) -> Option<Self> {
        match backend {
            Backend::Sqlite => {
                let dir = tempfile::tempdir().expect("temp dir");
                let url = format!("sqlite://{}", dir.path().join("behest.db").display());
                Some(Self {
                    url,
                    _dir: Some(dir),
                    postgres: None,
                })
            }
            Backend::Postgres => {
                let Ok(admin_url) = std::env::var("BEHEST_TEST_POSTGRES_URL") else {
                    assert!(
                        std::env::var("BEHEST_TEST_REQUIRE_POSTGRES").is_err(),
                        "BEHEST_TEST_REQUIRE_POSTGRES is set but BEHEST_TEST_POSTGRES_URL is not"
                    );
                    say_skipped();
                    return None;
                };
                let name = format!("behest_test_{}", uuid::Uuid::new_v4().simple());
                let mut admin = sqlx::PgConnection::connect(&admin_url)
                    .await
                    .expect("connect to BEHEST_TEST_POSTGRES_URL");
                sqlx::query(&format!("CREATE DATABASE {name}"))
                    .execute(&mut admin)
                    .await
                    .expect("create test database");
                let _ = admin.close().await;
                let url = with_database(&admin_url, &name);
                Some(Self {
                    url,
                    _dir: None,
                    postgres: Some((admin_url, name)),
                })
            }
        }
    }

    /// Opens the store (migrating it).
    pub async fn store(&self) -> Arc<dyn Store> {
        store::connect(&self.url).await.expect("open store")
    }

    /// Folds every run's stored log (see [`assert_logs_fold`]).
    pub async fn assert_logs_fold(&self) {
        assert_logs_fold(self.store().await.as_ref()).await;
    }

    /// Drops a PostgreSQL test database (best effort).
    pub async fn cleanup(self) {
        if let Some((admin_url, name)) = &self.postgres
            && let Ok(mut admin) = sqlx::PgConnection::connect(admin_url).await
        {
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                .execute(&mut admin)
                .await;
        }
    }
}

/// Folds every run's stored log into its trail, as recovery does, and fails on the first run
/// whose log does not fold (a `TrailError`: a log behest must never write). Every test that
/// produces runs ends with it (`TestServer::stop` calls it).
pub async fn assert_logs_fold(store: &dyn Store) {
    let mut filter = store::RunFilter {
        limit: 200,
        ..Default::default()
    };
    loop {
        let runs = store.list_runs(&filter).await.expect("list runs");
        for run in &runs {
            let trail = RunTrail::load(store, run.id)
                .await
                .expect("read the run's log");
            if let Some(error) = trail.broken() {
                let events = store
                    .read_events(run.id, 0, 10_000)
                    .await
                    .unwrap_or_default();
                let kinds: Vec<String> = events
                    .iter()
                    .map(|e| format!("{} {}", e.sequence, e.event_type))
                    .collect();
                panic!(
                    "run {} ({:?}): its log does not fold: {error}\n{}",
                    run.id,
                    run.status,
                    kinds.join("\n")
                );
            }
        }
        match runs.last() {
            Some(last) if runs.len() == 200 => filter.before = Some(last.id),
            _ => break,
        }
    }
}

fn say_skipped() {
    // Written to the process's stderr handle, not through `eprintln!`, which the test harness
    // captures (and shows only for failing tests): the skip shows in the default
    // `cargo test` output, once per test binary.
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "SKIPPED: the PostgreSQL half of these tests (set \
             BEHEST_TEST_POSTGRES_URL=postgres://… to run it)"
        );
    });
}

/// Replaces the database name (the URL path) of a PostgreSQL URL.
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let host_end = base[scheme_end..]
        .find('/')
        .map_or(base.len(), |i| scheme_end + i);
    let mut out = format!("{}/{name}", &base[..host_end]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}

/// Generates one `#[tokio::test]` per backend for each named `async fn(Backend)` of the
/// enclosing module.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),+ $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::db::Backend::Sqlite).await;
                }
            )+
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name($crate::support::db::Backend::Postgres).await;
                }
            )+
        }
    };
}
