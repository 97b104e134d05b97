//! Helpers shared by the integration tests.
#![allow(dead_code, reason = "each test crate uses a different subset")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stderr,
    reason = "test helpers: a failed setup is a failed test"
)]

pub mod db;
pub mod fake_anthropic;
pub mod fake_openai;
pub mod schema;
pub mod server;
