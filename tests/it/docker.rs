//! The Dockerfile, checked without a container engine (CI has none): its build stage runs the
//! build command the README gives, and its runtime stage — non-root, a `HEALTHCHECK`, the
//! `ENTRYPOINT`/`CMD`/`ENV` it declares — starts the binary: refused on its all-interfaces
//! address without API keys, serving with one, and its health check passing. With an engine,
//! `docker build .` builds it from the repository alone (`.dockerignore` keeps the rest out).

use std::collections::HashMap;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

fn read(name: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(name)).unwrap()
}

/// The Dockerfile's instructions per stage, continuation lines joined.
fn stages() -> Vec<Vec<(String, String)>> {
    let text = read("Dockerfile").replace("\\\n", " ");
    let mut stages: Vec<Vec<(String, String)>> = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (instruction, rest) = line.split_once(' ').unwrap_or((line, ""));
        let instruction = instruction.to_ascii_uppercase();
        if instruction == "FROM" {
            stages.push(Vec::new());
        }
        stages
            .last_mut()
            .expect("FROM first")
            .push((instruction, rest.trim().to_owned()));
    }
    stages
}

fn all<'a>(stage: &'a [(String, String)], instruction: &str) -> Vec<&'a str> {
    stage
        .iter()
        .filter(|(i, _)| i == instruction)
        .map(|(_, rest)| rest.as_str())
        .collect()
}

/// A JSON-array (exec form) instruction's words.
fn exec_form(text: &str) -> Vec<String> {
    serde_json::from_str(text).unwrap_or_else(|_| panic!("exec form expected: {text}"))
}

#[test]
fn the_build_stage_runs_the_readme_build_command() {
    let stages = stages();
    assert_eq!(stages.len(), 2, "a build stage and a runtime stage");
    let build = &stages[0];
    let runs = all(build, "RUN");
    let cargo: Vec<&&str> = runs.iter().filter(|r| r.starts_with("cargo ")).collect();
    assert_eq!(cargo.len(), 1, "{runs:?}");
    let readme = read("README.md");
    assert!(
        readme.contains(&format!("`{}`", cargo[0])),
        "the README gives the image's build command `{}`",
        cargo[0]
    );
    // What it builds is what the build stage copies in: the crate alone.
    let copied: Vec<&str> = all(build, "COPY");
    for needed in ["Cargo.toml Cargo.lock", "src", "migrations"] {
        assert!(
            copied.iter().any(|c| c.starts_with(needed)),
            "COPY {needed}"
        );
    }
}

#[tokio::test]
async fn the_runtime_stage_starts_the_binary_as_declared() {
    let stages = stages();
    let runtime = &stages[1];
    let user = all(runtime, "USER");
    assert_eq!(user.len(), 1);
    assert_ne!(user[0], "root", "runs as non-root");
    let entrypoint = exec_form(all(runtime, "ENTRYPOINT")[0]);
    let cmd = exec_form(all(runtime, "CMD")[0]);
    assert_eq!(entrypoint, ["behest"]);
    assert!(
        all(runtime, "COPY")
            .iter()
            .any(|c| c.ends_with("/usr/local/bin/behest")),
        "the binary is on PATH as `behest`"
    );
    let healthcheck = all(runtime, "HEALTHCHECK");
    assert_eq!(healthcheck.len(), 1, "a HEALTHCHECK");
    let probe = exec_form(
        healthcheck[0]
            .split_once("CMD ")
            .expect("HEALTHCHECK … CMD [...]")
            .1,
    );
    assert_eq!(probe[0], "behest");
    let mut env: HashMap<String, String> = HashMap::new();
    for line in all(runtime, "ENV") {
        for pair in line.split_whitespace() {
            let (key, value) = pair.split_once('=').expect("ENV KEY=VALUE");
            env.insert(key.to_owned(), value.to_owned());
        }
    }
    let bind = env["BEHEST_BIND"].clone();
    assert!(bind.starts_with("0.0.0.0:"), "{bind}");

    // The image's command with its environment: the port made free, the volume a temp dir.
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    env.insert("BEHEST_BIND".to_owned(), format!("0.0.0.0:{port}"));
    env.insert(
        "BEHEST_DATABASE_URL".to_owned(),
        format!("sqlite://{}", dir.path().join("behest.db").display()),
    );
    let binary = env!("CARGO_BIN_EXE_behest");
    let image = |args: &[String]| {
        let mut command = Command::new(binary);
        command
            .args(args)
            .env_clear()
            .envs(&env)
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .kill_on_drop(true);
        command
    };

    // All interfaces and no key: refused, saying how to proceed.
    let refused = tokio::time::timeout(Duration::from_secs(30), image(&cmd).output())
        .await
        .unwrap()
        .unwrap();
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("BEHEST_AUTH__KEYS"), "{said}");
    assert!(said.contains("--allow-unauthenticated"), "{said}");

    // With a key it serves, and its health check passes.
    let mut server = image(&cmd)
        .env("BEHEST_AUTH__KEYS", "docker-test-key")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(server.stderr.take().unwrap()).lines();
    tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("behest listening") {
                return;
            }
        }
        panic!("behest exited before listening");
    })
    .await
    .expect("listening within 30 s");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let probed = image(&probe[1..]).output().await.unwrap();
    assert!(
        probed.status.success(),
        "HEALTHCHECK fails: {}",
        String::from_utf8_lossy(&probed.stderr)
    );
    let client = behest::net::client().unwrap();
    let providers = client
        .get(format!("http://127.0.0.1:{port}/providers"))
        .send()
        .await
        .unwrap();
    assert_eq!(providers.status(), 401, "the API needs the key");
    server.kill().await.unwrap();
    // And the probe fails once nothing answers.
    let failed = image(&probe[1..]).output().await.unwrap();
    assert!(!failed.status.success());
}
