//! Outgoing HTTP: every `reqwest` client of the process (providers, HTTP tools, MCP over
//! HTTP, the test and bench drivers) is built here, after the one rustls crypto provider
//! (ring) is installed. reqwest 0.13 is built without a provider of its own (no aws-lc C
//! build) and panics when a client is built before one is installed, so nothing else calls
//! `reqwest::Client::new()` (clippy's `disallowed-methods` enforces it).

use std::sync::Once;

/// Installs ring as the process-wide rustls crypto provider, once. A provider installed
/// earlier by someone else is kept.
pub fn install_crypto_provider() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // An error only means a provider is installed already.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// A `reqwest` client builder with TLS ready (ring, the system's root certificates) and
/// behest's user agent (`behest/<version>`).
#[expect(
    clippy::disallowed_methods,
    reason = "the one place that builds clients, after installing the TLS provider"
)]
pub fn client_builder() -> reqwest::ClientBuilder {
    install_crypto_provider();
    reqwest::Client::builder().user_agent(concat!("behest/", env!("CARGO_PKG_VERSION")))
}

/// A client with [`client_builder`]'s defaults.
///
/// # Errors
/// When the TLS configuration cannot be built (no usable root certificates).
pub fn client() -> reqwest::Result<reqwest::Client> {
    client_builder().build()
}
