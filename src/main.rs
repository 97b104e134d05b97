//! The `behest` command: parses the CLI and calls into the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use behest::config::{Config, Overrides};

/// behest: an agent runtime server.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the HTTP API (default 127.0.0.1:8080, SQLite file `behest.db`).
    Serve {
        /// Address to listen on [env: BEHEST_BIND].
        #[arg(long)]
        bind: Option<String>,
        /// `sqlite://PATH` or `postgres://…` [env: BEHEST_DATABASE_URL].
        #[arg(long)]
        database_url: Option<String>,
        /// TOML configuration file.
        // `hide_env_values`: `--help` says `[env: BEHEST_CONFIG]`, never `BEHEST_CONFIG=` with
        // an empty or private value.
        #[arg(long, env = "BEHEST_CONFIG", hide_env_values = true)]
        config: Option<PathBuf>,
        /// Serve an address other machines can reach without API keys (otherwise refused)
        /// [config: `[auth] allow_unauthenticated`].
        #[arg(long)]
        allow_unauthenticated: bool,
    },
    /// Exit 0 when the server at `BEHEST_BIND` (or `--bind`) answers `/healthz` (a container's
    /// `HEALTHCHECK`).
    Healthcheck {
        /// Address of the server [env: BEHEST_BIND; default 127.0.0.1:8080]; `0.0.0.0` and
        /// `[::]` are probed on the loopback address.
        #[arg(long)]
        bind: Option<String>,
    },
    /// Apply database migrations and exit.
    Migrate {
        /// `sqlite://PATH` or `postgres://…` [env: BEHEST_DATABASE_URL].
        #[arg(long)]
        database_url: Option<String>,
        /// TOML configuration file.
        // `hide_env_values`: `--help` says `[env: BEHEST_CONFIG]`, never `BEHEST_CONFIG=` with
        // an empty or private value.
        #[arg(long, env = "BEHEST_CONFIG", hide_env_values = true)]
        config: Option<PathBuf>,
    },
    /// Print the OpenAPI document (JSON) and exit.
    Openapi,
}

fn load(config: Option<&std::path::Path>, overrides: &Overrides) -> Result<Config, ExitCode> {
    Config::load(config, overrides).map_err(|error| {
        report(&error);
        ExitCode::from(2)
    })
}

#[expect(
    clippy::print_stderr,
    reason = "errors before logging is set up go to stderr"
)]
fn report(error: &dyn std::fmt::Display) {
    eprintln!("behest: {error}");
}

fn print_openapi() -> ExitCode {
    use std::io::Write;
    match behest::api::openapi().to_pretty_json() {
        Ok(json) => {
            // A closed pipe (`behest openapi | head`) is not an error worth a panic.
            let _ = writeln!(std::io::stdout().lock(), "{json}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            report(&error);
            ExitCode::FAILURE
        }
    }
}

/// Whether the log is JSON lines (`RUST_LOG_FORMAT=json`).
fn json_log() -> bool {
    std::env::var("RUST_LOG_FORMAT").is_ok_and(|f| f == "json")
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn"));
    let json = json_log();
    // Colours only on a terminal: a log file or pipe gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// A warning for each `BEHEST_*` variable that is no configuration key (e.g. a script's own
/// `BEHEST_BIN`): ignored, not fatal.
fn warn_ignored_env() {
    for name in Config::ignored_env_vars() {
        tracing::warn!(
            variable = %name,
            "ignoring environment variable {name}: behest has no such setting"
        );
    }
}

/// `GET http://<bind>/healthz` within 5 s: success when it answers 200.
fn healthcheck(bind: Option<String>) -> ExitCode {
    let bind = bind
        .or_else(|| std::env::var("BEHEST_BIND").ok())
        .unwrap_or_else(|| "127.0.0.1:8080".to_owned());
    let address = match bind.rsplit_once(':') {
        Some(("0.0.0.0", port)) => format!("127.0.0.1:{port}"),
        Some(("[::]", port)) => format!("[::1]:{port}"),
        _ => bind,
    };
    match behest::server::healthcheck_blocking(&address) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            report(&format!("healthcheck: {error}"));
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Openapi => print_openapi(),
        Command::Healthcheck { bind } => healthcheck(bind),
        Command::Serve {
            bind,
            database_url,
            config,
            allow_unauthenticated,
        } => {
            let overrides = Overrides { bind, database_url };
            let mut loaded = match load(config.as_deref(), &overrides) {
                Ok(config) => config,
                Err(code) => return code,
            };
            loaded.auth.allow_unauthenticated |= allow_unauthenticated;
            init_tracing();
            warn_ignored_env();
            // No configuration at all: offer the built-in model so the first run works.
            match &config {
                None if loaded.providers.is_empty() => {
                    loaded = behest::provider::scripted::with_demo(loaded);
                    tracing::info!(
                        "no configuration: offering the built-in demo model (provider `demo`, \
                         model `demo`) and the built-in tool `current_time`; --config FILE \
                         declares real providers"
                    );
                }
                Some(path) if loaded.providers.is_empty() => tracing::warn!(
                    config = %path.display(),
                    "the configuration file declares no [providers]: no run can start. \
                     Declare one ([providers.<id>] with kind, base_url and models), or get the \
                     built-in demo model back with `[providers.demo]` `kind = \"scripted\"` and \
                     `[providers.demo.models.demo]` `context_window = 32768` \
                     `max_output_tokens = 4096` (or start without --config)"
                ),
                _ => {}
            }
            let config = loaded;
            match behest::server::serve_blocking(config) {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    // Once: the plain line for a person, the JSON log line for a collector.
                    if json_log() {
                        tracing::error!(%error, "behest stopped");
                    } else {
                        report(&error);
                    }
                    ExitCode::FAILURE
                }
            }
        }
        Command::Migrate {
            database_url,
            config,
        } => {
            let overrides = Overrides {
                bind: None,
                database_url,
            };
            let config = match load(config.as_deref(), &overrides) {
                Ok(config) => config,
                Err(code) => return code,
            };
            init_tracing();
            warn_ignored_env();
            // The store logs each migration it applies, or that the schema is up to date.
            match behest::server::migrate_blocking(&config.database_url) {
                Ok(_) => ExitCode::SUCCESS,
                Err(error) => {
                    report(&error);
                    ExitCode::FAILURE
                }
            }
        }
    }
}
