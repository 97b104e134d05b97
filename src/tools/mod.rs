//! Tools runs may call: MCP servers (stdio and streamable HTTP) and HTTP tools, behind one
//! registry that lists them, validates arguments against their JSON Schema, and calls them.

pub mod builtin;
mod http;
mod mcp;
pub mod schema;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::Serialize;
use tokio::sync::watch;
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
    /// A tool built into the server (`builtin_tools = [...]`).
    Builtin,
}

impl fmt::Display for ToolSource {
    /// `MCP server `id` (stdio)` or `HTTP tool at <url>`, for error messages.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Mcp { server, transport } => write!(f, "MCP server `{server}` ({transport})"),
            Self::Http { url } => write!(f, "HTTP tool at {url}"),
            Self::Builtin => f.write_str("the built-in tools"),
        }
    }
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
    /// Safe to execute twice: a call cut off by a crash is executed again when its run resumes;
    /// any other such call gets an "interrupted, outcome unknown" result (config `idempotent`,
    /// `idempotent_tools`; built-in tools are).
    pub idempotent: bool,
    /// Each call waits for a person's approval (`POST /runs/{run_id}/approvals`) before it
    /// runs (config `requires_approval`, `requires_approval_tools`; a run can ask for more with
    /// its `approval` list).
    pub requires_approval: bool,
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

/// One progress report of an executing tool (MCP `notifications/progress`, an HTTP tool's
/// streamed `progress` event or line): `progress` and `total` in the tool's own unit.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolProgressUpdate {
    /// Progress so far; always finite.
    pub progress: f64,
    /// The total, when known; always finite.
    pub total: Option<f64>,
    /// What the tool is doing, at most [`MAX_PROGRESS_MESSAGE_BYTES`] bytes.
    pub message: Option<String>,
}

/// Bytes of a progress message kept (cut on a UTF-8 boundary).
pub const MAX_PROGRESS_MESSAGE_BYTES: usize = 1024;

/// Where an executing tool reports progress: a `watch` channel, so the latest report replaces
/// one the reader has not taken yet (the reader rate-limits; the tool never waits on it).
#[derive(Debug)]
pub struct ProgressSink(watch::Sender<Option<ToolProgressUpdate>>);

impl ProgressSink {
    /// A sink and the receiver the runtime reads the latest report from (`None` before the
    /// first).
    #[must_use]
    pub fn channel() -> (Self, watch::Receiver<Option<ToolProgressUpdate>>) {
        let (sender, receiver) = watch::channel(None);
        (Self(sender), receiver)
    }

    /// Reports progress. A non-finite `progress` (NaN, ±∞: not JSON) is ignored, a non-finite
    /// `total` dropped, a longer message cut to [`MAX_PROGRESS_MESSAGE_BYTES`].
    pub fn report(&self, progress: f64, total: Option<f64>, message: Option<String>) {
        if !progress.is_finite() {
            return;
        }
        let message = message.map(|mut text| {
            if text.len() > MAX_PROGRESS_MESSAGE_BYTES {
                let mut cut = MAX_PROGRESS_MESSAGE_BYTES;
                while !text.is_char_boundary(cut) {
                    cut -= 1;
                }
                text.truncate(cut);
            }
            text
        });
        self.0.send_replace(Some(ToolProgressUpdate {
            progress,
            total: total.filter(|total| total.is_finite()),
            message,
        }));
    }
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
///
/// Built once at startup by [`ToolRegistry::connect`]: every tool's argument schema is compiled
/// then, so [`ToolRegistry::call`] only validates. MCP sessions live as long as the registry (or
/// until [`ToolRegistry::shutdown`]); dropping the registry ends them and kills stdio children.
#[derive(Debug, Default)]
pub struct ToolRegistry {
    tools: BTreeMap<String, RegisteredTool>,
    mcp_servers: Vec<Arc<mcp::McpServer>>,
}

/// A tool with its compiled schema and how to reach it.
struct RegisteredTool {
    info: ToolInfo,
    validator: schema::ToolSchema,
    backend: Backend,
}

impl fmt::Debug for RegisteredTool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredTool")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
enum Backend {
    Mcp(Arc<mcp::McpServer>),
    Http(http::HttpTool),
    Builtin(builtin::Builtin),
}

impl ToolRegistry {
    /// Connects to every MCP server, lists its tools, and adds the HTTP tools.
    ///
    /// MCP servers are started (stdio: `command args` with `env` added to ours) or reached
    /// (streamable HTTP: `url` with `headers`) concurrently; each must initialize and list its
    /// tools (every page) within 30 s. A tool without a description gets an empty one.
    ///
    /// # Errors
    /// [`ToolSetupError`] naming the server or tool at fault: [`ToolSetupError::Mcp`] when a
    /// server cannot be started, initialized or listed; [`ToolSetupError::Invalid`] when two
    /// sources offer the same name (both named), a schema does not compile, or an HTTP tool's
    /// URL or header is malformed. Servers already started are shut down again.
    pub async fn connect(
        mcp_servers: &BTreeMap<String, McpServerConfig>,
        http_tools: &BTreeMap<String, HttpToolConfig>,
    ) -> Result<Self, ToolSetupError> {
        let connected = futures::future::join_all(
            mcp_servers
                .iter()
                .map(|(id, config)| async move { (id, config, mcp::connect(id, config).await) }),
        )
        .await;
        let mut registry = Self::default();
        let mut first_error = None;
        let mut listed = Vec::new();
        for (id, config, result) in connected {
            match result {
                Ok((server, tools)) => {
                    let server = Arc::new(server);
                    registry.mcp_servers.push(Arc::clone(&server));
                    listed.push((id, config, server, tools));
                }
                Err(error) => {
                    first_error.get_or_insert(error);
                }
            }
        }
        let registered = match first_error {
            Some(error) => Err(error),
            None => registry.register_all(listed, http_tools),
        };
        match registered {
            Ok(()) => Ok(registry),
            Err(error) => {
                registry.shutdown().await;
                Err(error)
            }
        }
    }

    fn register_all(
        &mut self,
        listed: Vec<(
            &String,
            &McpServerConfig,
            Arc<mcp::McpServer>,
            Vec<rmcp::model::Tool>,
        )>,
        http_tools: &BTreeMap<String, HttpToolConfig>,
    ) -> Result<(), ToolSetupError> {
        for (id, config, server, tools) in listed {
            let source = ToolSource::Mcp {
                server: id.clone(),
                transport: mcp::transport_name(config).to_owned(),
            };
            let (idempotent_tools, approval_tools) = match config {
                McpServerConfig::Stdio {
                    idempotent_tools,
                    requires_approval_tools,
                    ..
                }
                | McpServerConfig::Http {
                    idempotent_tools,
                    requires_approval_tools,
                    ..
                } => (idempotent_tools, requires_approval_tools),
            };
            for (key, names) in [
                ("idempotent_tools", idempotent_tools),
                ("requires_approval_tools", approval_tools),
            ] {
                if let Some(unknown) = names
                    .iter()
                    .find(|name| !tools.iter().any(|tool| *tool.name == ***name))
                {
                    let offered: Vec<&str> = tools.iter().map(|tool| &*tool.name).collect();
                    return Err(ToolSetupError::Invalid(format!(
                        "mcp_servers.{id}.{key}: `{unknown}` is not a tool of this server \
                         (it offers: {})",
                        offered.join(", ")
                    )));
                }
            }
            for tool in tools {
                let info = ToolInfo {
                    requires_approval: approval_tools.iter().any(|name| **name == *tool.name),
                    idempotent: idempotent_tools.iter().any(|name| **name == *tool.name),
                    name: tool.name.to_string(),
                    description: tool.description.as_deref().unwrap_or_default().to_owned(),
                    parameters: serde_json::Value::Object((*tool.input_schema).clone()),
                    source: source.clone(),
                };
                self.register(info, Backend::Mcp(Arc::clone(&server)))?;
            }
        }
        let client = crate::net::client().map_err(|e| {
            ToolSetupError::Invalid(format!("cannot build the HTTP tools' client: {e}"))
        })?;
        for (name, config) in http_tools {
            // The name rule both OpenAI and Anthropic enforce on function names.
            let valid = !name.is_empty()
                && name.len() <= 64
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !valid {
                return Err(ToolSetupError::Invalid(format!(
                    "http_tools.\"{name}\": a tool name is 1 to 64 letters, digits, `_` or `-`"
                )));
            }
            let tool = http::HttpTool::new(name, config, client.clone())?;
            let info = ToolInfo {
                name: name.clone(),
                description: config.description.clone(),
                parameters: config.parameters.clone(),
                source: ToolSource::Http {
                    url: config.url.clone(),
                },
                idempotent: config.idempotent,
                requires_approval: config.requires_approval,
            };
            self.register(info, Backend::Http(tool))?;
        }
        Ok(())
    }

    fn register(&mut self, info: ToolInfo, backend: Backend) -> Result<(), ToolSetupError> {
        if let Some(existing) = self.tools.get(&info.name) {
            return Err(ToolSetupError::Invalid(format!(
                "tool `{}` is offered by both {} and {}",
                info.name, existing.info.source, info.source
            )));
        }
        // A schema that does not compile is the operator's to fix: startup fails. One that
        // compiles but is unbounded (a `$ref` cycle, too large; an MCP server's list is not
        // ours to fix) keeps the tool listed, and each call fails with the reason.
        if let Backend::Builtin(_) = backend {
            // Our own schema: compiled at the first call, not at startup (see
            // `ToolSchema::deferred`; `builtin`'s tests compile each).
            let validator = schema::ToolSchema::deferred(info.parameters.clone());
            self.tools.insert(
                info.name.clone(),
                RegisteredTool {
                    info,
                    validator,
                    backend,
                },
            );
            return Ok(());
        }
        let validator = schema::ToolSchema::new(&info.parameters);
        match validator.error() {
            Some(error @ schema::SchemaError::Invalid(_)) => {
                return Err(ToolSetupError::Invalid(format!(
                    "tool `{}` ({}): its parameters {error}",
                    info.name, info.source
                )));
            }
            Some(error) => tracing::warn!(
                tool = %info.name,
                source = %info.source,
                %error,
                "every call of this tool will be refused: its parameters schema cannot be \
                 checked safely"
            ),
            None => {}
        }
        self.tools.insert(
            info.name.clone(),
            RegisteredTool {
                info,
                validator,
                backend,
            },
        );
        Ok(())
    }

    /// Adds the built-in tools named in `names` (see [`builtin::NAMES`]).
    ///
    /// # Errors
    /// [`ToolSetupError::Invalid`] for an unknown name or a name another source already offers.
    pub fn add_builtins(&mut self, names: &[String]) -> Result<(), ToolSetupError> {
        for name in names {
            let (tool, info) = builtin::Builtin::named(name)?;
            self.register(info, Backend::Builtin(tool))?;
        }
        Ok(())
    }

    /// Every tool, sorted by name.
    #[must_use]
    pub fn list(&self) -> Vec<ToolInfo> {
        self.tools.values().map(|tool| tool.info.clone()).collect()
    }

    /// Whether a tool of this name exists.
    #[must_use]
    pub fn contains(&self, name: &str) -> bool {
        self.tools.contains_key(name)
    }

    /// Whether the tool is safe to execute twice (false for unknown names).
    #[must_use]
    pub fn is_idempotent(&self, name: &str) -> bool {
        self.tools
            .get(name)
            .is_some_and(|tool| tool.info.idempotent)
    }

    /// Whether the tool's calls wait for approval by configuration (false for unknown names).
    #[must_use]
    pub fn requires_approval(&self, name: &str) -> bool {
        self.tools
            .get(name)
            .is_some_and(|tool| tool.info.requires_approval)
    }

    /// The tools to offer the model: all of them (sorted by name), or those named in `allow`
    /// (in that order; names that are not tools are skipped).
    #[must_use]
    pub fn specs(&self, allow: Option<&[String]>) -> Vec<ToolSpec> {
        let spec = |tool: &RegisteredTool| ToolSpec {
            name: tool.info.name.clone(),
            description: tool.info.description.clone(),
            parameters: tool.info.parameters.clone(),
        };
        match allow {
            None => self.tools.values().map(spec).collect(),
            Some(names) => names
                .iter()
                .filter_map(|name| self.tools.get(name))
                .map(spec)
                .collect(),
        }
    }

    /// Validates `arguments` against the tool's schema and calls it. Dropping the future stops
    /// the call (MCP: a cancellation notification; HTTP: the request is dropped).
    ///
    /// The result: MCP `structuredContent` when present, else a single text block as a JSON
    /// string, else the content blocks as a JSON array; HTTP: the JSON body, or the body text
    /// as a JSON string. No timeout is applied here (the runtime applies one).
    ///
    /// # Errors
    /// [`ToolError`]; the caller turns it into a `Failure` result. [`ToolError::UnknownTool`];
    /// [`ToolError::InvalidArguments`] listing every schema violation (MCP arguments must also
    /// be a JSON object); [`ToolError::Failed`] for MCP `isError` results (their text), MCP
    /// protocol or transport errors, HTTP non-2xx statuses (status and a body excerpt) and
    /// HTTP transport errors.
    pub async fn call(
        &self,
        name: &str,
        arguments: &serde_json::Value,
    ) -> Result<serde_json::Value, ToolError> {
        self.call_keyed(name, arguments, None).await
    }

    /// [`Self::call`] with the execution's idempotency key (see [`idempotency_key`]), sent as
    /// an HTTP tool's `Idempotency-Key` header and in an MCP call's `_meta` as
    /// `behest/idempotencyKey`: the same for every execution of one call, a re-run after a
    /// takeover included, so the tool can return its first result instead of acting twice.
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn call_keyed(
        &self,
        name: &str,
        arguments: &serde_json::Value,
        idempotency_key: Option<&str>,
    ) -> Result<serde_json::Value, ToolError> {
        self.call_reporting(name, arguments, idempotency_key, None)
            .await
    }

    /// [`Self::call_keyed`] with a sink for the tool's progress reports: an MCP call carries a
    /// `progressToken` in its `_meta` and the server's `notifications/progress` for it go to
    /// `progress`; an HTTP tool that answers `text/event-stream` or `application/x-ndjson`
    /// reports through its `progress` events or lines (see `tools/http.rs`). The result is the
    /// same as without a sink.
    ///
    /// # Errors
    /// As [`Self::call`].
    pub async fn call_reporting(
        &self,
        name: &str,
        arguments: &serde_json::Value,
        idempotency_key: Option<&str>,
        progress: Option<&ProgressSink>,
    ) -> Result<serde_json::Value, ToolError> {
        let tool = self
            .tools
            .get(name)
            .ok_or_else(|| ToolError::UnknownTool(name.to_owned()))?;
        check_arguments(name, &tool.validator, arguments)?;
        match &tool.backend {
            Backend::Mcp(server) => {
                let serde_json::Value::Object(arguments) = arguments else {
                    return Err(ToolError::InvalidArguments {
                        tool: name.to_owned(),
                        reason: "arguments must be a JSON object".to_owned(),
                    });
                };
                server
                    .call(name, arguments.clone(), idempotency_key, progress)
                    .await
            }
            Backend::Http(http) => http.call(arguments, idempotency_key, progress).await,
            Backend::Builtin(tool) => tool.call(arguments, progress).await,
        }
    }

    /// Validates `arguments` against the tool's schema without calling it.
    ///
    /// # Errors
    /// [`ToolError::UnknownTool`]; [`ToolError::InvalidArguments`] listing every violation.
    pub fn check_arguments(
        &self,
        name: &str,
        arguments: &serde_json::Value,
    ) -> Result<(), ToolError> {
        let tool = self
            .tools
            .get(name)
            .ok_or_else(|| ToolError::UnknownTool(name.to_owned()))?;
        check_arguments(name, &tool.validator, arguments)
    }

    /// Stops MCP child processes and closes sessions (concurrently, each bounded to 10 s).
    /// Calls made afterwards to MCP tools fail with [`ToolError::Failed`].
    pub async fn shutdown(&self) {
        futures::future::join_all(self.mcp_servers.iter().map(|server| server.close())).await;
    }
}

/// Validates `arguments` against a tool's compiled schema.
///
/// # Errors
/// [`ToolError::InvalidArguments`] listing the violations (at most
/// [`schema::MAX_VIOLATIONS`]), each with its JSON path, or saying why the schema cannot be
/// used.
pub fn check_arguments(
    name: &str,
    schema: &schema::ToolSchema,
    arguments: &serde_json::Value,
) -> Result<(), ToolError> {
    schema
        .validate(arguments)
        .map_err(|reason| ToolError::InvalidArguments {
            tool: name.to_owned(),
            reason,
        })
}

/// The idempotency key of one tool call's executions: `<run id>:<call id>` (the call id as the
/// model gave it, percent-encoded where it holds characters a header cannot carry: control
/// characters, space, `%`, non-ASCII). Stable across a takeover, so a tool re-run after a
/// failover sees the key of its first execution.
#[must_use]
pub fn idempotency_key(run_id: crate::domain::RunId, call_id: &str) -> String {
    const UNSAFE: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b' ').add(b'%');
    format!(
        "{run_id}:{}",
        percent_encoding::utf8_percent_encode(call_id, UNSAFE)
    )
}
