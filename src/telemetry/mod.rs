//! Watching the server from outside: Prometheus metrics ([`metrics`]) and OpenTelemetry traces
//! ([`trace`], with the runtime's GenAI spans in [`spans`]). The runtime calls one function per
//! thing it records, at its entry points; nothing here reads the store or knows HTTP.

pub mod metrics;
pub mod spans;
pub mod trace;
