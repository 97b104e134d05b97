//! behest's integration tests, one binary: a module per area, `support` (servers, fake
//! providers, databases) once. Run one area with `cargo test --test it <module>::`.
//!
//! Every module is `#[cfg(test)]` so that `clippy.toml`'s test allowances (`unwrap`,
//! `expect`, `panic`, printing) cover the helpers too, not only the `#[test]` functions.

#[cfg(test)]
#[macro_use]
mod support;
#[cfg(test)]
mod agent_loop;
#[cfg(test)]
mod agents;
#[cfg(test)]
mod agents_readme;
#[cfg(test)]
mod agents_restart;
#[cfg(test)]
mod anthropic_adapter;
#[cfg(test)]
mod api;
#[cfg(test)]
mod bench_smoke;
#[cfg(test)]
mod chat;
#[cfg(test)]
mod clients;
#[cfg(test)]
mod compaction;
#[cfg(test)]
mod console;
#[cfg(test)]
mod contract;
#[cfg(test)]
mod crash_loop;
#[cfg(test)]
mod docker;
#[cfg(test)]
mod events;
#[cfg(test)]
mod first_hour;
#[cfg(test)]
mod frontends;
#[cfg(test)]
mod images;
#[cfg(test)]
mod input;
#[cfg(test)]
mod llama_server;
#[cfg(test)]
mod local_models;
#[cfg(test)]
mod migration;
#[cfg(test)]
mod net;
#[cfg(test)]
mod observe;
#[cfg(test)]
mod openai_adapter;
#[cfg(test)]
mod openapi;
#[cfg(test)]
mod operators;
#[cfg(test)]
mod ops;
#[cfg(test)]
mod provider_runtime;
#[cfg(test)]
mod replica_harness;
#[cfg(test)]
mod replicas;
#[cfg(test)]
mod restart;
#[cfg(test)]
mod retry;
#[cfg(test)]
mod run_loop;
#[cfg(test)]
mod scripted;
#[cfg(test)]
mod session_validity;
#[cfg(test)]
mod snapshots;
#[cfg(test)]
mod store;
#[cfg(test)]
mod structured_output;
#[cfg(test)]
mod tool_loop;
#[cfg(test)]
mod tool_progress;
#[cfg(test)]
mod tools;
#[cfg(test)]
mod trial_fixes;
#[cfg(test)]
mod webhooks;
