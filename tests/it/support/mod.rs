//! Helpers shared by the integration tests.

#[macro_use]
pub mod db;
pub mod demo;
pub mod fake_anthropic;
pub mod fake_openai;
pub mod lookup;
pub mod process;
pub mod schema;
pub mod server;
pub mod validate;
