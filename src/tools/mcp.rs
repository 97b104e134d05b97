//! MCP client side of the registry (rmcp): one session per configured server, over a child
//! process's stdio or streamable HTTP; lists the server's tools and calls them.

use std::collections::HashMap;
use std::ffi::OsString;
use std::time::Duration;

use futures::StreamExt as _;

use reqwest::header::{HeaderName, HeaderValue};
use rmcp::handler::client::progress::ProgressDispatcher;
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CallToolResult, CancelledNotificationParam,
    ClientCapabilities, ClientConfig, ClientRequest, ContentBlock, Implementation, JsonObject,
    ProgressNotificationParam, RequestId, ServerResult, Tool,
};
use rmcp::service::{NotificationContext, Peer, PeerRequestOptions, RoleClient, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{ClientHandler, ServiceExt as _};
use serde_json::Value;
use tokio::sync::Mutex;

use super::{ProgressSink, ToolError, ToolSetupError};
use crate::config::McpServerConfig;

/// How long a server may take to start, initialize and list its tools.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long closing a session may take (stdio: close stdin, wait, SIGTERM, wait, kill).
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

/// A live session with one MCP server.
pub(super) struct McpServer {
    id: String,
    peer: Peer<RoleClient>,
    /// Routes the server's `notifications/progress` to the call that sent their token.
    progress: ProgressDispatcher,
    /// `None` once closed. Dropping it cancels the session, which kills a child process.
    service: Mutex<Option<RunningService<RoleClient, McpClient>>>,
}

/// Our side of a session: who we are, and where progress notifications go.
struct McpClient {
    info: ClientConfig,
    progress: ProgressDispatcher,
}

impl ClientHandler for McpClient {
    fn get_info(&self) -> ClientConfig {
        self.info.clone()
    }

    async fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        // A token no call is waiting for (a late or made-up one) is dropped by the dispatcher.
        self.progress.handle_notification(params).await;
    }
}

/// Sends `notifications/cancelled` for a request when dropped armed: a call abandoned before its
/// response (a timeout, a cancelled run), as rmcp's own `call_tool` does.
struct CancelOnDrop(Option<(Peer<RoleClient>, RequestId)>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some((peer, id)) = self.0.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let reason = "request abandoned by the caller".to_owned();
            runtime.spawn(async move {
                let _ = peer
                    .notify_cancelled(CancelledNotificationParam::new(Some(id), Some(reason)))
                    .await;
            });
        }
    }
}

impl std::fmt::Debug for McpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpServer").field("id", &self.id).finish()
    }
}

/// The transport name shown in [`super::ToolSource::Mcp`].
pub(super) fn transport_name(config: &McpServerConfig) -> &'static str {
    match config {
        McpServerConfig::Stdio { .. } => "stdio",
        McpServerConfig::Http { .. } => "http",
    }
}

fn client_info() -> ClientConfig {
    ClientConfig::new(
        ClientCapabilities::default(),
        Implementation::new("behest", env!("CARGO_PKG_VERSION")),
    )
}

/// Starts (stdio) or reaches (HTTP) server `id`, initializes the session and lists every page
/// of its tools.
///
/// # Errors
/// [`ToolSetupError::Mcp`] naming the server.
pub(super) async fn connect(
    id: &str,
    config: &McpServerConfig,
) -> Result<(McpServer, Vec<Tool>), ToolSetupError> {
    let setup_error = |reason: String| ToolSetupError::Mcp {
        server: id.to_owned(),
        reason,
    };
    let progress = ProgressDispatcher::new();
    let client = || McpClient {
        info: client_info(),
        progress: progress.clone(),
    };
    let started = async {
        let service = match config {
            McpServerConfig::Stdio {
                command,
                args,
                env,
                inherit_env,
                ..
            } => {
                let mut child = tokio::process::Command::new(command);
                // Belt and braces: rmcp kills the child when the session ends; this also covers
                // a runtime shut down before that cleanup task runs.
                child
                    .args(args)
                    .env_clear()
                    .envs(child_env(std::env::vars_os(), inherit_env))
                    .envs(env)
                    .kill_on_drop(true);
                let transport = TokioChildProcess::new(child)
                    .map_err(|e| setup_error(format!("cannot start `{command}`: {e}")))?;
                client()
                    .serve(transport)
                    .await
                    .map_err(|e| setup_error(format!("initialize failed: {e}")))?
            }
            McpServerConfig::Http { url, headers, .. } => {
                // rmcp's HTTP client needs the process-wide rustls provider.
                crate::net::install_crypto_provider();
                let mut custom = HashMap::new();
                for (key, value) in headers {
                    let name = HeaderName::from_bytes(key.as_bytes())
                        .map_err(|_| setup_error(format!("bad header name `{key}`")))?;
                    let mut value = HeaderValue::from_str(value)
                        .map_err(|_| setup_error(format!("bad value for header `{key}`")))?;
                    value.set_sensitive(true);
                    custom.insert(name, value);
                }
                let transport = StreamableHttpClientTransport::from_config(
                    StreamableHttpClientTransportConfig::with_uri(url.as_str())
                        .custom_headers(custom),
                );
                client()
                    .serve(transport)
                    .await
                    .map_err(|e| setup_error(format!("initialize failed at {url}: {e}")))?
            }
        };
        let tools = service
            .peer()
            .list_all_tools()
            .await
            .map_err(|e| setup_error(format!("tools/list failed: {e}")))?;
        Ok((service, tools))
    };
    let (service, tools) = tokio::time::timeout(STARTUP_TIMEOUT, started)
        .await
        .map_err(|_| setup_error(format!("no answer within {} s", STARTUP_TIMEOUT.as_secs())))??;
    let server = McpServer {
        id: id.to_owned(),
        peer: service.peer().clone(),
        progress,
        service: Mutex::new(Some(service)),
    };
    Ok((server, tools))
}

/// What a stdio MCP server inherits of the server's environment `vars`: `PATH`, `HOME`, the
/// locale (`LANG`, `LANGUAGE`, `LC_*`) and the variables `inherit` names; nothing else (the
/// server's environment holds provider API keys).
fn child_env(
    vars: impl Iterator<Item = (OsString, OsString)>,
    inherit: &[String],
) -> Vec<(OsString, OsString)> {
    vars.filter(|(name, _)| {
        let name = name.to_string_lossy();
        matches!(name.as_ref(), "PATH" | "HOME" | "LANG" | "LANGUAGE")
            || name.starts_with("LC_")
            || inherit.iter().any(|wanted| *wanted == name)
    })
    .collect()
}

impl McpServer {
    /// Sends `tools/call`. rmcp's `Peer::call_tool` holds a drop guard on the request: dropping
    /// this future before the response sends `notifications/cancelled` with the request id.
    /// The idempotency key, when given, is sent in the request's `_meta` as
    /// `behest/idempotencyKey`. With a progress sink, the server's `notifications/progress`
    /// for the request's `progressToken` (rmcp gives every request one) are reported to the
    /// sink until the response.
    pub(super) async fn call(
        &self,
        tool: &str,
        arguments: JsonObject,
        idempotency_key: Option<&str>,
        progress: Option<&ProgressSink>,
    ) -> Result<Value, ToolError> {
        let mut params = CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments);
        if let Some(key) = idempotency_key {
            let mut meta = JsonObject::new();
            meta.insert(
                "behest/idempotencyKey".to_owned(),
                Value::String(key.to_owned()),
            );
            params.meta = Some(meta.into());
        }
        let failed =
            |e: rmcp::ServiceError| ToolError::Failed(format!("MCP server `{}`: {e}", self.id));
        let Some(sink) = progress else {
            return tool_result(self.peer.call_tool(params).await.map_err(failed)?);
        };
        // `call_tool` sets a progress token of its own that it does not tell: send the request
        // as it does, with a handle that names the token, and subscribe to it before the server
        // can have answered (the request is only queued when the handle returns).
        let handle = self
            .peer
            .send_request_with_option(
                ClientRequest::CallToolRequest(CallToolRequest::new(params)),
                PeerRequestOptions::no_options(),
            )
            .await
            .map_err(failed)?;
        let mut updates = self.progress.subscribe(handle.progress_token.clone()).await;
        let mut guard = CancelOnDrop(Some((self.peer.clone(), handle.id.clone())));
        let response = handle.await_response();
        tokio::pin!(response);
        let result = loop {
            tokio::select! {
                result = &mut response => break result,
                Some(update) = updates.next() => {
                    sink.report(update.progress, update.total, update.message);
                }
            }
        };
        guard.0 = None;
        match result.map_err(failed)? {
            ServerResult::CallToolResult(result) => tool_result(result),
            // A result without `content` (rmcp decodes it as another variant).
            ServerResult::EmptyResult(_) => tool_result(CallToolResult::success(Vec::new())),
            other => Err(ToolError::Failed(format!(
                "MCP server `{}`: unexpected answer to tools/call: {}",
                self.id,
                serde_json::to_string(&other).unwrap_or_default()
            ))),
        }
    }

    /// Closes the session; for stdio, the MCP shutdown sequence (close stdin, SIGTERM, kill).
    pub(super) async fn close(&self) {
        let service = self.service.lock().await.take();
        if let Some(mut service) = service
            && let Ok(None) = service.close_with_timeout(CLOSE_TIMEOUT).await
        {
            tracing::warn!(server = %self.id, "MCP session did not close in time");
        }
    }
}

/// `isError` → [`ToolError::Failed`] with the text; else `structuredContent`, else a single
/// text block as a JSON string, else the content array.
fn tool_result(result: CallToolResult) -> Result<Value, ToolError> {
    if result.is_error == Some(true) {
        return Err(ToolError::Failed(content_text(&result.content)));
    }
    if let Some(structured) = result.structured_content {
        return Ok(structured);
    }
    if let [ContentBlock::Text(text)] = result.content.as_slice() {
        return Ok(Value::String(text.text.clone()));
    }
    serde_json::to_value(&result.content)
        .map_err(|e| ToolError::Failed(format!("unreadable tool result: {e}")))
}

/// The text blocks joined by newlines; the content as JSON when there is no text.
fn content_text(content: &[ContentBlock]) -> String {
    let texts: Vec<&str> = content
        .iter()
        .filter_map(|block| block.as_text().map(|t| t.text.as_str()))
        .collect();
    if texts.is_empty() {
        serde_json::to_string(content).unwrap_or_default()
    } else {
        texts.join("\n")
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_child_gets_a_minimal_environment() {
        let server: Vec<(OsString, OsString)> = [
            ("PATH", "/bin"),
            ("HOME", "/home/b"),
            ("LC_ALL", "C.UTF-8"),
            ("OPENAI_API_KEY", "sk-secret"),
            ("GITHUB_TOKEN", "gh"),
        ]
        .iter()
        .map(|(k, v)| (OsString::from(k), OsString::from(v)))
        .collect();
        let names = |inherit: &[String]| -> Vec<String> {
            child_env(server.clone().into_iter(), inherit)
                .into_iter()
                .map(|(k, _)| k.to_string_lossy().into_owned())
                .collect()
        };
        assert_eq!(names(&[]), ["PATH", "HOME", "LC_ALL"]);
        assert_eq!(
            names(&["GITHUB_TOKEN".to_owned()]),
            ["PATH", "HOME", "LC_ALL", "GITHUB_TOKEN"]
        );
    }

    #[test]
    fn results_map_to_values() {
        let text = CallToolResult::success(vec![ContentBlock::text("hi")]);
        assert_eq!(tool_result(text), Ok(json!("hi")));
        let structured = CallToolResult::structured(json!({"sum": 3}));
        assert_eq!(tool_result(structured), Ok(json!({"sum": 3})));
        let two = CallToolResult::success(vec![ContentBlock::text("a"), ContentBlock::text("b")]);
        let value = tool_result(two).unwrap_or_default();
        assert_eq!(value[1]["text"], json!("b"));
        let error = CallToolResult::error(vec![ContentBlock::text("x"), ContentBlock::text("y")]);
        assert_eq!(
            tool_result(error),
            Err(ToolError::Failed("x\ny".to_owned()))
        );
    }
}
