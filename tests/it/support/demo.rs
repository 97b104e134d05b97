//! `behest serve` started as a new user starts it: no config (the demo provider `demo`, model
//! `demo` and tool `current_time`), no flags but a port, in a fresh working directory for its
//! SQLite database.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// `behest serve` started as a new user does (no config, no flags but a port and a database).
pub struct DemoServer {
    pub child: Child,
    pub url: String,
    /// Its log lines up to "listening".
    pub log: Vec<String>,
    _dir: tempfile::TempDir,
}

impl DemoServer {
    pub async fn start() -> Self {
        Self::start_with_env(&[]).await
    }

    /// [`DemoServer::start`] with extra environment variables (e.g. `BEHEST_AUTH__KEYS`).
    pub async fn start_with_env(env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut child = Command::new(env!("CARGO_BIN_EXE_behest"))
            .args(["serve", "--bind", "127.0.0.1:0"])
            .current_dir(dir.path())
            .env_remove("BEHEST_CONFIG")
            .env_remove("BEHEST_DATABASE_URL")
            .env_remove("BEHEST_BIND")
            .env_remove("RUST_LOG_FORMAT")
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start behest serve");
        let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let mut log = Vec::new();
        let url = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await.expect("read log") {
                log.push(line.clone());
                if let Some(at) = line.find("address=") {
                    let addr = line[at + "address=".len()..]
                        .split_whitespace()
                        .next()
                        .expect("address");
                    return format!("http://{addr}");
                }
            }
            panic!("behest serve exited before listening: {log:?}");
        })
        .await
        .expect("behest serve listens within 30 s");
        // Keep draining the log so the server never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Self {
            child,
            url,
            log,
            _dir: dir,
        }
    }
}
