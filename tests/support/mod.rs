//! Helpers shared by the integration tests.
#![allow(dead_code, reason = "each test crate uses a different subset")]

pub mod db;
pub mod fake_anthropic;
pub mod fake_openai;
pub mod schema;
pub mod server;
