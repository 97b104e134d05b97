//! The system under test: a fresh database (a temp SQLite file, or a new PostgreSQL database
//! dropped afterwards), a generated configuration, and `behest serve` as a child process.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::str::FromStr;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::Connection;
use tokio::process::{Child, Command};

use crate::{BenchError, Result};

/// A storage backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// A SQLite file.
    Sqlite,
    /// A PostgreSQL database.
    Postgres,
}

impl Backend {
    /// `sqlite` or `postgres`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sqlite => "sqlite",
            Self::Postgres => "postgres",
        }
    }
}

/// A fresh database for one bench run.
pub struct Database {
    /// What behest connects to.
    pub url: String,
    /// Which backend.
    pub backend: Backend,
    sqlite_path: Option<PathBuf>,
    postgres: Option<(String, String)>,
}

impl Database {
    /// A new SQLite file in `dir`, or a new PostgreSQL database on the server at `admin_url`.
    pub async fn create(backend: Backend, dir: &Path, admin_url: &str) -> Result<Self> {
        match backend {
            Backend::Sqlite => {
                let path = dir.join("behest.db");
                Ok(Self {
                    url: format!("sqlite://{}", path.display()),
                    backend,
                    sqlite_path: Some(path),
                    postgres: None,
                })
            }
            Backend::Postgres => {
                let name = format!("behest_bench_{}", uuid::Uuid::new_v4().simple());
                let mut admin = sqlx::PgConnection::connect(admin_url).await.map_err(|e| {
                    BenchError(format!(
                        "cannot connect to PostgreSQL at BEHEST_BENCH_POSTGRES_URL ({admin_url}): {e}"
                    ))
                })?;
                sqlx::query(&format!("CREATE DATABASE {name}"))
                    .execute(&mut admin)
                    .await?;
                let _ = admin.close().await;
                Ok(Self {
                    url: with_database(admin_url, &name),
                    backend,
                    sqlite_path: None,
                    postgres: Some((admin_url.to_owned(), name)),
                })
            }
        }
    }

    /// Drops a PostgreSQL database (SQLite files go with the temp dir).
    pub async fn drop_database(&self) {
        if let Some((admin_url, name)) = &self.postgres
            && let Ok(mut admin) = sqlx::PgConnection::connect(admin_url).await
        {
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                .execute(&mut admin)
                .await;
            let _ = admin.close().await;
        }
    }

    /// Rows and bytes of each table (`sessions`, `runs`, `messages`, `events`, indexes
    /// included), and the whole database's bytes.
    pub async fn storage(&self) -> Result<Storage> {
        const TABLES: [&str; 4] = ["sessions", "runs", "messages", "events"];
        let mut tables = Vec::new();
        let total_bytes;
        match self.backend {
            Backend::Sqlite => {
                let path = self
                    .sqlite_path
                    .as_ref()
                    .ok_or_else(|| BenchError("no SQLite path".to_owned()))?;
                let options =
                    sqlx::sqlite::SqliteConnectOptions::from_str(&self.url)?.read_only(true);
                let mut connection = sqlx::SqliteConnection::connect_with(&options).await?;
                for table in TABLES {
                    let rows: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {table}"))
                        .fetch_one(&mut connection)
                        .await?;
                    // dbstat counts the pages of the table and its indexes, WAL included.
                    let bytes: Option<i64> = sqlx::query_scalar(
                        "SELECT SUM(d.pgsize) FROM dbstat d JOIN sqlite_master m ON m.name = d.name \
                         WHERE m.tbl_name = $1",
                    )
                    .bind(table)
                    .fetch_one(&mut connection)
                    .await
                    .unwrap_or(None);
                    tables.push(TableStorage {
                        table,
                        rows: rows.max(0) as u64,
                        bytes: bytes.unwrap_or(0).max(0) as u64,
                    });
                }
                let _ = connection.close().await;
                let file = |suffix: &str| {
                    let mut name = path.as_os_str().to_owned();
                    name.push(suffix);
                    std::fs::metadata(PathBuf::from(name)).map_or(0, |m| m.len())
                };
                total_bytes = file("") + file("-wal");
            }
            Backend::Postgres => {
                let mut connection = sqlx::PgConnection::connect(&self.url).await?;
                for table in TABLES {
                    let rows: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {table}"))
                        .fetch_one(&mut connection)
                        .await?;
                    let bytes: i64 =
                        sqlx::query_scalar("SELECT pg_total_relation_size($1::regclass)")
                            .bind(table)
                            .fetch_one(&mut connection)
                            .await?;
                    tables.push(TableStorage {
                        table,
                        rows: rows.max(0) as u64,
                        bytes: bytes.max(0) as u64,
                    });
                }
                let database: i64 =
                    sqlx::query_scalar("SELECT pg_database_size(current_database())")
                        .fetch_one(&mut connection)
                        .await?;
                total_bytes = database.max(0) as u64;
                let _ = connection.close().await;
            }
        }
        Ok(Storage {
            tables,
            total_bytes,
        })
    }
}

/// One table's rows and bytes.
#[derive(Debug, Clone)]
pub struct TableStorage {
    /// Its name.
    pub table: &'static str,
    /// Rows.
    pub rows: u64,
    /// Bytes on disk, indexes included.
    pub bytes: u64,
}

/// The database's size.
#[derive(Debug, Clone)]
pub struct Storage {
    /// Per table.
    pub tables: Vec<TableStorage>,
    /// The database file(s) (SQLite: main file + WAL) or `pg_database_size`.
    pub total_bytes: u64,
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

/// The configuration behest runs with: one provider `fake` with every bench model. Provider
/// timeouts are long because idle-watcher runs wait at a gate for minutes. `lease_ttl_ms` sets
/// `[runtime] lease_ttl_ms` (the restart figure shortens it so PostgreSQL takes runs over soon).
pub fn config_toml(fake_base_url: &str, models: &[&str], lease_ttl_ms: Option<u64>) -> String {
    let mut toml = String::new();
    if let Some(ttl) = lease_ttl_ms {
        toml.push_str(&format!("[runtime]\nlease_ttl_ms = {ttl}\n\n"));
    }
    toml.push_str(&format!(
        "[providers.fake]\nkind = \"openai\"\nbase_url = \"{fake_base_url}\"\n\n\
         [providers.fake.timeouts]\nconnect_ms = 5000\nfirst_byte_ms = 1800000\nidle_ms = 1800000\n\
         total_ms = 1800000\n"
    ));
    for model in models {
        let window = if *model == crate::figures::MODEL_COMPACT {
            crate::figures::COMPACT_WINDOW
        } else {
            128_000
        };
        toml.push_str(&format!(
            "\n[providers.fake.models.{model}]\ncontext_window = {window}\nmax_output_tokens = 1024\n"
        ));
    }
    // Settings every model's window fits; only the small one's sessions grow past them.
    toml.push_str("\n[compaction]\nbuffer_tokens = 1000\nkeep_tokens = 2000\ntail_turns = 2\n");
    toml
}

/// `behest serve` running as a child process.
pub struct BehestProcess {
    child: Child,
    /// Its pid.
    pub pid: u32,
    /// `127.0.0.1:PORT`.
    pub address: String,
    /// `http://127.0.0.1:PORT`.
    pub base_url: String,
    /// Just before the process was spawned (monotonic clock).
    pub spawned_at: Instant,
    /// Just before the process was spawned (wall clock, comparable with events' `timestamp`).
    pub spawned_wall: DateTime<Utc>,
    log: PathBuf,
}

/// How to launch `behest serve`: the binary, its configuration and database, where it logs.
#[derive(Debug, Clone)]
pub struct Launch {
    /// The behest binary.
    pub binary: PathBuf,
    /// The configuration file.
    pub config: PathBuf,
    /// The database URL.
    pub database_url: String,
    /// The directory its logs go to.
    pub dir: PathBuf,
}

impl BehestProcess {
    /// Starts `binary serve` on a free local port with `config` and `database_url`, logging
    /// to `dir/behest.log`, and waits until `/readyz` answers 200 (30 s at most).
    pub async fn start(
        binary: &Path,
        dir: &Path,
        config: &Path,
        database_url: &str,
        client: &reqwest::Client,
    ) -> Result<Self> {
        let launch = Launch {
            binary: binary.to_owned(),
            config: config.to_owned(),
            database_url: database_url.to_owned(),
            dir: dir.to_owned(),
        };
        let mut process = Self::spawn(&launch, None, "behest.log")?;
        process
            .wait_ready(client, Duration::from_millis(50))
            .await?;
        Ok(process)
    }

    /// Spawns `behest serve` on `address` (a free local port when `None`), logging to
    /// `launch.dir/log_name`, without waiting for it to be ready.
    pub fn spawn(launch: &Launch, address: Option<&str>, log_name: &str) -> Result<Self> {
        if !launch.binary.is_file() {
            bail!(
                "the behest binary is missing at {} — build it first with \
                 `cargo build --release --bins` (or pass --behest-bin PATH)",
                launch.binary.display()
            );
        }
        let address = match address {
            Some(address) => address.to_owned(),
            None => {
                let port = std::net::TcpListener::bind("127.0.0.1:0")?
                    .local_addr()?
                    .port();
                format!("127.0.0.1:{port}")
            }
        };
        let log = launch.dir.join(log_name);
        let log_file = std::fs::File::create(&log)?;
        let mut command = Command::new(&launch.binary);
        command
            .arg("serve")
            .arg("--bind")
            .arg(&address)
            .arg("--database-url")
            .arg(&launch.database_url)
            .arg("--config")
            .arg(&launch.config)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .kill_on_drop(true);
        // BEHEST_* variables would be read as behest configuration (and the bench's own
        // BEHEST_BENCH_* ones rejected as unknown keys).
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("BEHEST_") {
                command.env_remove(key);
            }
        }
        let spawned_wall = Utc::now();
        let spawned_at = Instant::now();
        let child = command.spawn()?;
        let pid = child
            .id()
            .ok_or_else(|| BenchError("behest exited at once".to_owned()))?;
        Ok(Self {
            child,
            pid,
            base_url: format!("http://{address}"),
            address,
            spawned_at,
            spawned_wall,
            log,
        })
    }

    /// Polls `/readyz` every `poll` until it answers 200 (30 s at most): when it did.
    pub async fn wait_ready(
        &mut self,
        client: &reqwest::Client,
        poll: Duration,
    ) -> Result<Instant> {
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "behest exited during startup ({status}); its log ({}):\n{}",
                    self.log.display(),
                    tail(&self.log)
                );
            }
            let ready = client
                .get(format!("{}/readyz", self.base_url))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ready {
                return Ok(Instant::now());
            }
            if self.spawned_at.elapsed() > Duration::from_secs(30) {
                bail!(
                    "behest was not ready within 30 s; its log ({}):\n{}",
                    self.log.display(),
                    tail(&self.log)
                );
            }
            tokio::time::sleep(poll).await;
        }
    }

    /// The last lines of its log.
    pub fn log_tail(&self) -> String {
        tail(&self.log)
    }

    /// SIGKILL (a crash: nothing is drained or released), and waits until it is gone.
    pub async fn kill(mut self) -> Result<()> {
        self.child.kill().await?;
        Ok(())
    }

    /// SIGTERM (graceful shutdown), then SIGKILL after 15 s.
    pub async fn stop(mut self) -> Result<()> {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.pid.to_string())
            .status()
            .await;
        if tokio::time::timeout(Duration::from_secs(15), self.child.wait())
            .await
            .is_err()
        {
            self.child.kill().await?;
        }
        Ok(())
    }
}

/// Resident memory of a process in KiB.
pub fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| BenchError(format!("no VmRSS in /proc/{pid}/status")))
}

/// CPU time (user + system) `pid` has used so far, in seconds (`/proc/<pid>/stat` fields 14
/// and 15, in clock ticks of 1/100 s: `USER_HZ`, 100 on Linux).
pub fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces: count the fields after its closing `)`.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |index: usize| fields.get(index).and_then(|f| f.parse::<u64>().ok());
    match (ticks(11), ticks(12)) {
        (Some(user), Some(system)) => Ok((user + system) as f64 / 100.0),
        _ => Err(BenchError(format!("no CPU times in /proc/{pid}/stat"))),
    }
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}
