//! Startup and shutdown: open the store, build providers, recover runs left active by a
//! previous process, serve HTTP until SIGINT/SIGTERM, then drain the runs while the listener
//! stays open (a second signal exits at once).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::api::connections::{self, ConnectionLimits};
use crate::api::{AppState, app};
use crate::config::Config;
use crate::provider;
use crate::runtime::{ProviderEntry, Runtime};
use crate::store;
use crate::tools::{ToolRegistry, ToolSetupError};

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The store failed.
    #[error("database: {0}")]
    Store(#[from] store::StoreError),
    /// The database could not be opened or migrated: which one (the SQLite file's path, or the
    /// PostgreSQL URL without its password) and why.
    #[error("cannot open the database ({target}): {source}")]
    Open {
        /// `SQLite file <path>` or `PostgreSQL <url without password>`.
        target: String,
        /// Why.
        source: store::StoreError,
    },
    /// A provider could not be set up.
    #[error("provider: {0}")]
    Provider(#[from] provider::ProviderError),
    /// A tool source could not be set up.
    #[error("tools: {0}")]
    Tools(#[from] ToolSetupError),
    /// Binding or serving failed.
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
    /// An agent preset would not run (unknown provider, model or tool, a bad parameter).
    #[error("invalid configuration: {0}")]
    Agents(String),
    /// A non-loopback `bind` without API keys, and unauthenticated access not allowed.
    #[error(
        "`bind` = `{0}` is reachable from other machines, and no API key is configured: set \
         `[auth] keys` (or `BEHEST_AUTH__KEYS`, or `[auth] keys_env`), or start with \
         --allow-unauthenticated (`[auth] allow_unauthenticated = true`) to serve it open"
    )]
    Unprotected(String),
    /// OpenTelemetry export could not be set up.
    #[error(transparent)]
    Telemetry(#[from] crate::telemetry::trace::ExportError),
}

/// What a database URL names, for an error: `SQLite file <path>`, or `PostgreSQL <url>`
/// without its password.
fn database_target(url: &str) -> String {
    if let Some(rest) = url.strip_prefix("sqlite:") {
        let path = rest.trim_start_matches("//");
        let path = path.split('?').next().unwrap_or(path);
        return format!("SQLite file `{path}`");
    }
    match reqwest::Url::parse(url) {
        Ok(mut parsed) => {
            if parsed.password().is_some() {
                let _ = parsed.set_password(Some("***"));
            }
            if matches!(parsed.scheme(), "postgres" | "postgresql") {
                format!("PostgreSQL `{parsed}`")
            } else {
                format!("`{parsed}`")
            }
        }
        Err(_) => "the database URL".to_owned(),
    }
}

/// Opens (and migrates) the store at `url`; an error names the database.
async fn open_store(
    url: &str,
    options: &store::ConnectOptions,
) -> Result<Arc<dyn store::Store>, ServeError> {
    store::connect_with(url, options)
        .await
        .map_err(|source| ServeError::Open {
            target: database_target(url),
            source,
        })
}

/// Builds the runtime of a configuration over an opened store.
///
/// # Errors
/// When a provider's HTTP client cannot be built, or an agent preset would not run.
pub fn runtime(
    config: &Config,
    store: Arc<dyn store::Store>,
    tools: Arc<ToolRegistry>,
) -> Result<Arc<Runtime>, ServeError> {
    let mut providers = HashMap::new();
    for (id, provider_config) in &config.providers {
        let adapter = provider::build(id, provider_config)?;
        providers.insert(
            id.clone(),
            ProviderEntry {
                provider: adapter,
                config: provider_config.clone(),
            },
        );
    }
    let runtime = Runtime::with_agents(
        store,
        providers,
        tools,
        config.runtime.clone(),
        config.compaction.clone(),
        config.agents.clone(),
        &config.database.replica_id(),
    );
    runtime.check_agents().map_err(ServeError::Agents)?;
    if runtime
        .enable_webhooks(&config.webhooks)
        .map_err(ServeError::Agents)?
    {
        tracing::info!(
            allowed_hosts = ?config.webhooks.allowed_hosts,
            allow_private_addresses = config.webhooks.allow_private_addresses,
            "webhooks enabled"
        );
    }
    Ok(runtime)
}

/// `behest serve`: [`serve`] on a new multi-threaded Tokio runtime, until it returns.
///
/// The server's async code is polled here, in the library, so that it is compiled once: a
/// binary that awaited [`serve`] itself would compile every future under it again (release
/// builds share no generic code between crates).
///
/// # Errors
/// [`ServeError`] as for [`serve`], or `Io` when the Tokio runtime cannot start.
pub fn serve_blocking(config: Config) -> Result<(), ServeError> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(serve(config))
}

/// `behest healthcheck`: `GET http://{address}/healthz` within 5 s, on a Tokio runtime of its
/// own (see [`serve_blocking`]).
///
/// # Errors
/// What went wrong, as text: no answer in time, or a status other than 2xx.
pub fn healthcheck_blocking(address: &str) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let client = crate::net::client().map_err(|e| e.to_string())?;
        let response = client
            .get(format!("http://{address}/healthz"))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .map_err(|e| format!("{address}: {e}"))?;
        if response.status().is_success() {
            Ok(())
        } else {
            Err(format!("{address} answered {}", response.status()))
        }
    })
}

/// The one-server-per-SQLite-file lock of `database_url` (nothing for PostgreSQL), held until
/// dropped.
///
/// # Errors
/// [`ServeError::Open`] naming the SQLite file when another process holds it.
fn lock_database(database_url: &str) -> Result<Option<store::DatabaseLock>, ServeError> {
    store::lock_sqlite(database_url).map_err(|source| ServeError::Open {
        target: database_target(database_url),
        source,
    })
}

/// `behest migrate`: opens the store at `database_url`, which applies (and logs) its pending
/// migrations, on a Tokio runtime of its own (see [`serve_blocking`]).
///
/// # Errors
/// [`ServeError::Open`] when the database cannot be opened or migrated, `Io` when the Tokio
/// runtime cannot start.
pub fn migrate_blocking(database_url: &str) -> Result<(), ServeError> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async {
            // Not under a server that serves the same SQLite file: it would run on a schema
            // it does not know.
            let _database_lock = lock_database(database_url)?;
            open_store(database_url, &store::ConnectOptions::default()).await?;
            Ok(())
        })
}

/// Serves the configuration until SIGINT/SIGTERM, then drains: `runtime.shutdown` with
/// `[runtime] shutdown_grace_ms` while the listener stays open (`/readyz` and new runs answer
/// 503 `shutting_down`, open event streams end at once), then closes the listener.
///
/// # Errors
/// [`ServeError`] when the store, a provider or the listener fails.
pub async fn serve(config: Config) -> Result<(), ServeError> {
    refuse_unprotected(&config).await?;
    if let Some(endpoint) = crate::telemetry::trace::init(&config.telemetry)? {
        tracing::info!(%endpoint, "exporting OpenTelemetry spans (OTLP/HTTP)");
    }
    let served = serve_configured(config).await;
    // The last spans (the drained runs') are exported before the process ends.
    let _ = tokio::task::spawn_blocking(crate::telemetry::trace::shutdown).await;
    served
}

/// Refuses a `bind` that other machines can reach when no API key is configured, unless
/// `[auth] allow_unauthenticated` says so.
///
/// # Errors
/// [`ServeError::Unprotected`]; [`ServeError::Io`] when the address does not resolve.
pub async fn refuse_unprotected(config: &Config) -> Result<(), ServeError> {
    if !config.auth.keys.0.is_empty() {
        return Ok(());
    }
    let addresses: Vec<std::net::SocketAddr> = tokio::net::lookup_host(&config.bind)
        .await
        .map_err(|error| {
            std::io::Error::new(
                error.kind(),
                format!("cannot resolve `bind` = `{}`: {error}", config.bind),
            )
        })?
        .collect();
    let loopback = !addresses.is_empty() && addresses.iter().all(|a| a.ip().is_loopback());
    if loopback {
        return Ok(());
    }
    if config.auth.allow_unauthenticated {
        tracing::warn!(
            bind = %config.bind,
            "serving without API keys on an address other machines can reach \
             (allow_unauthenticated)"
        );
        return Ok(());
    }
    Err(ServeError::Unprotected(config.bind.clone()))
}

async fn serve_configured(config: Config) -> Result<(), ServeError> {
    // The address first: a second server started by mistake on a taken port stops here,
    // before it migrates the database or takes over the runs of the one serving.
    let listener = TcpListener::bind(&config.bind).await.map_err(|error| {
        std::io::Error::new(
            error.kind(),
            format!("cannot listen on `bind` = `{}`: {error}", config.bind),
        )
    })?;
    // Held until the process ends: a second server on the same SQLite file stops here.
    let _database_lock = lock_database(&config.database_url)?;
    let store = open_store(&config.database_url, &config.database.connect_options()).await?;
    let mut registry = ToolRegistry::connect(&config.mcp_servers, &config.http_tools).await?;
    if let Err(error) = registry.add_builtins(&config.builtin_tools) {
        registry.shutdown().await;
        return Err(error.into());
    }
    let tools = Arc::new(registry);
    // The recorder before recovery: a run resumed now counts in `behest_runs_active` (its
    // increment would otherwise go nowhere and its end drive the gauge below zero).
    if config.telemetry.metrics {
        crate::telemetry::metrics::install();
    }
    let runtime = runtime(&config, store, tools.clone())?;
    runtime.warn_unfit_models().await;
    runtime.listen().await?;
    runtime.recover().await?;
    tracing::info!(
        address = %listener.local_addr()?,
        providers = config.providers.len(),
        lease_owner = runtime.owner(),
        "behest listening"
    );
    // Cancelled at the first signal: open event streams end (no terminal event; clients
    // reconnect with `Last-Event-ID` to the next process).
    let streams_end = CancellationToken::new();
    // Cancelled once the runs are drained: the listener closes.
    let close_listener = CancellationToken::new();
    // Cancelled at the first signal too: idle connections, and those that never sent a whole
    // request, close at once.
    let signalled = CancellationToken::new();
    watch_signals(signalled.clone())?;
    let state = AppState::from_config(runtime.clone(), streams_end.clone(), &config);
    if state.auth.enabled() {
        tracing::info!(keys = state.auth.key_count(), "API keys required");
    }
    let limits = ConnectionLimits::new(&config.http);
    tracing::info!(
        max_connections = limits.max_connections,
        header_read_timeout_ms = config.http.header_read_timeout_ms,
        body_read_timeout_ms = config.http.body_read_timeout_ms,
        keep_alive_timeout_ms = config.http.keep_alive_timeout_ms,
        "client connections"
    );
    let mut serving = tokio::spawn(connections::serve(
        listener,
        app(state),
        limits,
        signalled.clone(),
        close_listener.clone(),
    ));
    tokio::select! {
        () = signalled.cancelled() => {}
        served = &mut serving => {
            // The accept loop's task failed: stop the runs too.
            runtime.shutdown(grace(&config)).await;
            tools.shutdown().await;
            return match served {
                Ok(()) => Ok(()),
                Err(error) => Err(std::io::Error::other(error).into()),
            };
        }
    }
    tracing::info!(
        grace_ms = config.runtime.shutdown_grace_ms,
        "draining: admitting no runs, the active ones stop at their next boundary (the \
         listener stays open; a second signal exits at once)"
    );
    drain(&runtime, &streams_end, grace(&config)).await;
    tracing::info!("runs drained (left resumable); closing the listener");
    close_listener.cancel();
    if let Err(error) = serving.await {
        tracing::warn!(%error, "the server task failed");
    }
    tools.shutdown().await;
    tracing::info!("behest stopped");
    Ok(())
}

/// The drain of a shutdown, while the listener stays open: stops admitting runs (`/readyz` and
/// `POST /runs` answer 503 `shutting_down` from here on), ends the open event streams of the
/// app whose `AppState` holds `streams_end` (no terminal event: clients reconnect with
/// `Last-Event-ID` to the next process), and waits until every run stopped at its next
/// boundary, or `grace` passed and the rest were stopped where they were (all resumable).
pub async fn drain(runtime: &Runtime, streams_end: &CancellationToken, grace: Duration) {
    // The drain's first step (no more runs admitted) happens at its first poll, before the
    // event streams end: a client that reconnects at once is told this process is stopping.
    let drain = runtime.shutdown(grace);
    tokio::pin!(drain);
    let drained = futures::poll!(drain.as_mut()).is_ready();
    streams_end.cancel();
    tracing::info!("event streams ended; clients reconnect with Last-Event-ID");
    if !drained {
        drain.await;
    }
}

/// The drain's grace period (`[runtime] shutdown_grace_ms`).
fn grace(config: &Config) -> Duration {
    Duration::from_millis(config.runtime.shutdown_grace_ms)
}

/// Watches SIGINT/SIGTERM: the first cancels `signalled` (the drain begins); a second exits the
/// process at once with status 130. Nothing is lost by that: every run is resumable from the
/// store, and the next process takes it over.
///
/// # Errors
/// When the signal handlers cannot be installed.
fn watch_signals(signalled: CancellationToken) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut terminate = signal(SignalKind::terminate())?;
        tokio::spawn(async move {
            loop {
                let name = tokio::select! {
                    _ = interrupt.recv() => "SIGINT",
                    _ = terminate.recv() => "SIGTERM",
                };
                if signalled.is_cancelled() {
                    exit_now(name);
                }
                tracing::info!(signal = name, "shutdown signal received");
                signalled.cancel();
            }
        });
    }
    #[cfg(not(unix))]
    tokio::spawn(async move {
        loop {
            if tokio::signal::ctrl_c().await.is_err() {
                return;
            }
            if signalled.is_cancelled() {
                exit_now("Ctrl-C");
            }
            signalled.cancel();
        }
    });
    Ok(())
}

/// A second shutdown signal: stop now, without waiting for the drain.
fn exit_now(signal: &str) -> ! {
    tracing::warn!(
        signal,
        "second shutdown signal: exiting at once; active runs stay resumable by the next start"
    );
    std::process::exit(130);
}
