//! Startup and shutdown: open the store, build providers, recover runs left active by a
//! previous process, serve HTTP until SIGINT/SIGTERM, then drain.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::api::{AppState, app};
use crate::config::Config;
use crate::provider;
use crate::runtime::{ProviderEntry, Runtime};
use crate::store;
use crate::tools::{ToolRegistry, ToolSetupError};

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The store could not be opened or migrated.
    #[error("database: {0}")]
    Store(#[from] store::StoreError),
    /// A provider could not be set up.
    #[error("provider: {0}")]
    Provider(#[from] provider::ProviderError),
    /// A tool source could not be set up.
    #[error("tools: {0}")]
    Tools(#[from] ToolSetupError),
    /// Binding or serving failed.
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
}

/// How long active runs may go on after a shutdown signal before they are failed.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Builds the runtime of a configuration over an opened store.
///
/// # Errors
/// When a provider's HTTP client cannot be built.
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
    Ok(Runtime::new(
        store,
        providers,
        tools,
        config.runtime.clone(),
    ))
}

/// Serves the configuration until SIGINT/SIGTERM.
///
/// # Errors
/// [`ServeError`] when the store, a provider or the listener fails.
pub async fn serve(config: Config) -> Result<(), ServeError> {
    let store = store::connect(&config.database_url).await?;
    let mut registry = ToolRegistry::connect(&config.mcp_servers, &config.http_tools).await?;
    if let Err(error) = registry.add_builtins(&config.builtin_tools) {
        registry.shutdown().await;
        return Err(error.into());
    }
    let tools = Arc::new(registry);
    let runtime = runtime(&config, store, tools.clone())?;
    runtime.recover().await?;
    let listener = TcpListener::bind(&config.bind).await.map_err(|error| {
        std::io::Error::new(
            error.kind(),
            format!("cannot listen on `bind` = `{}`: {error}", config.bind),
        )
    })?;
    tracing::info!(
        address = %listener.local_addr()?,
        providers = config.providers.len(),
        "behest listening"
    );
    // SSE frames are small writes: without TCP_NODELAY, Nagle holds a frame back until the
    // previous one is acknowledged (up to the peer's delayed-ACK timeout, ~40 ms).
    let listener = listener.tap_io(|tcp| {
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY");
        }
    });
    let shutdown = CancellationToken::new();
    let state = AppState::new(runtime.clone(), shutdown.clone());
    let signal = shutdown.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutdown signal received; draining");
        signal.cancel();
    });
    axum::serve(listener, app(state))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await?;
    runtime.shutdown(SHUTDOWN_GRACE).await;
    tools.shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = terminate.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
