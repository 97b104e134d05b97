//! Helpers shared by the integration tests.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers: each test crate uses a different subset, and a failure is a broken test"
)]

pub mod db;
pub mod demo;
pub mod fake_anthropic;
pub mod fake_openai;
pub mod process;
pub mod schema;
pub mod server;
pub mod validate;
