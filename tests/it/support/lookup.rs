//! An HTTP tool server for the `lookup` tool of the compaction and local-model tests:
//! `POST /lookup {key, size?}` answers `{key, record}`, a record of `size` words
//! (`<key>-fact-<n>`), so each tool result grows the context by a known amount.

use std::net::SocketAddr;

use axum::Json;
use axum::routing::post;
use serde_json::{Value, json};

/// The running server; stopped when dropped.
pub struct LookupServer {
    pub addr: SocketAddr,
    server: tokio::task::JoinHandle<()>,
}

impl LookupServer {
    /// Starts it on `127.0.0.1:0`; a call without `size` answers `default_size` words.
    pub async fn start(default_size: u64) -> Self {
        let app = axum::Router::new().route(
            "/lookup",
            post(move |Json(arguments): Json<Value>| async move {
                let key = arguments["key"].as_str().unwrap_or("?").to_owned();
                let size = arguments["size"].as_u64().unwrap_or(default_size);
                let words: Vec<String> = (0..size).map(|n| format!("{key}-fact-{n}")).collect();
                Json(json!({"key": key, "record": words.join(" ")}))
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { addr, server }
    }

    /// The tool's URL, for `[http_tools.lookup] url`.
    pub fn url(&self) -> String {
        format!("http://{}/lookup", self.addr)
    }
}

impl Drop for LookupServer {
    fn drop(&mut self) {
        self.server.abort();
    }
}
