//! behest: an agent runtime server. Runs over HTTP/JSON, one durable event log, SSE with exact
//! resume, on SQLite or PostgreSQL.
//!
//! Layers: `api → runtime → {provider, store, events}`; `domain` holds the contract's types.

pub mod api;
pub mod config;
pub mod domain;
pub mod events;
pub mod net;
pub mod provider;
pub mod runtime;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod tools;
