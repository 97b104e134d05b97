//! Tools runs may call: MCP servers (stdio and streamable HTTP) and HTTP tools, behind one
//! registry that lists them, validates arguments against their JSON Schema, and calls them.

use std::collections::BTreeMap;

use serde::Serialize;
use utoipa::ToSchema;

use crate::config::{HttpToolConfig, McpServerConfig};
use crate::provider::ToolSpec;

/// Where a tool comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ToolSource {
    /// An MCP server (`[mcp_servers.<server>]`).
    Mcp {
        /// The server's id in the config.
        server: String,
        /// `stdio` or `http`.
        transport: String,
    },
    /// An HTTP tool (`[http_tools.<name>]`).
    Http {
        /// The URL its arguments are POSTed to.
        url: String,
    },
}

/// A tool as `GET /tools` lists it.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ToolInfo {
    /// The name the model calls it by (unique across sources).
    pub name: String,
    /// What it does, for the model.
    pub description: String,
    /// JSON Schema of its arguments.
    #[schema(value_type = Object)]
    pub parameters: serde_json::Value,
    /// Where it comes from.
    pub source: ToolSource,
}

/// Why a tool call failed; the model sees the message as a `Failure` result.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    /// No tool has this name.
    #[error("no tool named `{0}` is available")]
    UnknownTool(String),
    /// The arguments do not match the tool's JSON Schema.
    #[error("invalid arguments for `{tool}`: {reason}")]
    InvalidArguments {
        /// The tool.
        tool: String,
        /// Every violation, readable.
        reason: String,
    },
    /// The tool ran and reported an error (MCP `isError`, an HTTP error status, …).
    #[error("{0}")]
    Failed(String),
}

/// Why the registry could not be built at startup.
#[derive(Debug, thiserror::Error)]
pub enum ToolSetupError {
    /// An MCP server could not be started or listed.
    #[error("MCP server `{server}`: {reason}")]
    Mcp {
        /// The server id.
        server: String,
        /// What went wrong.
        reason: String,
    },
    /// Two sources offer the same tool name, or a schema is not a valid JSON Schema.
    #[error("{0}")]
    Invalid(String),
}

/// Every configured tool. Cheap to share (`Arc`).
#[derive(Debug, Default)]
pub struct ToolRegistry {
    _private: (),
}

impl ToolRegistry {
    /// Connects to every MCP server, lists its tools, and adds the HTTP tools.
    ///
    /// # Errors
    /// [`ToolSetupError`] naming the server or tool at fault.
    pub async fn connect(
        _mcp_servers: &BTreeMap<String, McpServerConfig>,
        _http_tools: &BTreeMap<String, HttpToolConfig>,
    ) -> Result<Self, ToolSetupError> {
        Ok(Self::default())
    }

    /// Every tool, sorted by name.
    #[must_use]
    pub fn list(&self) -> Vec<ToolInfo> {
        Vec::new()
    }

    /// Whether a tool of this name exists.
    #[must_use]
    pub fn contains(&self, _name: &str) -> bool {
        false
    }

    /// The tools to offer the model: all of them, or those named in `allow` (in that order).
    #[must_use]
    pub fn specs(&self, _allow: Option<&[String]>) -> Vec<ToolSpec> {
        Vec::new()
    }

    /// Validates `arguments` against the tool's schema and calls it. Dropping the future stops
    /// the call (MCP: a cancellation notification; HTTP: the request is dropped).
    ///
    /// # Errors
    /// [`ToolError`]; the caller turns it into a `Failure` result.
    pub async fn call(
        &self,
        name: &str,
        _arguments: &serde_json::Value,
    ) -> Result<serde_json::Value, ToolError> {
        Err(ToolError::UnknownTool(name.to_owned()))
    }

    /// Stops MCP child processes and closes sessions.
    pub async fn shutdown(&self) {}
}
