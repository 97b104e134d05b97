//! The benchmark's smoke mode, as CI runs it: tiny sizes, fast pacing, both backends when
//! PostgreSQL is configured. It checks that the bench works and that no event is lost,
//! duplicated or reordered; timings are printed, never asserted.

use std::process::Command;

fn smoke(backend: &str, postgres_url: Option<&str>) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_behest-bench"));
    command
        .args(["run", "--smoke", "--backend", backend, "--behest-bin"])
        .arg(env!("CARGO_BIN_EXE_behest"));
    if let Some(url) = postgres_url {
        command.env("BEHEST_BENCH_POSTGRES_URL", url);
    }
    let output = command.output();
    assert!(output.is_ok(), "behest-bench did not start: {output:?}");
    if let Ok(output) = output {
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "behest-bench run --smoke --backend {backend} failed ({}):\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(stdout.contains("hard check"), "{stdout}");
    }
}

#[test]
fn smoke_on_sqlite_loses_no_event() {
    smoke("sqlite", None);
}

#[test]
fn smoke_on_postgres_loses_no_event() {
    match std::env::var("BEHEST_TEST_POSTGRES_URL") {
        Ok(url) => smoke("postgres", Some(&url)),
        Err(_) => {
            assert!(
                std::env::var("BEHEST_TEST_REQUIRE_POSTGRES").is_err(),
                "BEHEST_TEST_REQUIRE_POSTGRES is set but BEHEST_TEST_POSTGRES_URL is not"
            );
            {
                eprintln!(
                    "SKIPPED: PostgreSQL bench smoke (set BEHEST_TEST_POSTGRES_URL=postgres://… to run it)"
                );
            }
        }
    }
}
