//! behest: an agent runtime server. Runs over HTTP/JSON, one durable event log, SSE with exact
//! resume, on SQLite or PostgreSQL.

pub mod config;
pub mod domain;
pub mod events;
pub mod provider;
