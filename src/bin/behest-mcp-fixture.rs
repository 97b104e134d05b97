//! A tiny MCP server over stdio for the tool-registry tests. Tools: `add` {a, b} → structured
//! `{"sum": a + b}`, `echo` {text} → the text, `fail` {} → an `isError` result, `sleep` {ms} →
//! "slept" after `ms` milliseconds, and, only when `BEHEST_MCP_FIXTURE_ENV_TOOL` is set in its
//! environment, `env` {} → structured `{"vars": {NAME: value, …}}`, its whole environment (the
//! isolation test reads it), and, only when `BEHEST_MCP_FIXTURE_PROGRESS_TOOL` is set,
//! `progress` {steps, interval_ms} → sends `steps`
//! `notifications/progress` (progress 1…steps of total steps, message `step <i>`) to the call's
//! `progressToken`, `interval_ms` apart, then — when `BEHEST_MCP_FIXTURE_GATE` names a file —
//! waits until that file exists, and returns `"done after <steps> steps"`. `tools/list`
//! answers in two pages (exercises pagination).
//! When `BEHEST_MCP_FIXTURE_LOG` names a file, it appends `called <tool>` for every call and
//! `key <tool> <key>` for a call whose `_meta` carries `behest/idempotencyKey`, and
//! `cancelled <request id>` when a `sleep` is stopped by `notifications/cancelled`; the binary
//! also logs `started <pid>` so tests can check that the process is gone after shutdown.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, JsonObject,
    ListToolsResult, PaginatedRequestParams, ProgressNotificationParam, ServerCapabilities,
    ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData, ServerHandler, ServiceExt as _};
use serde_json::{Value, json};

/// The fixture server; `log` is where `called …` / `cancelled …` lines go.
#[derive(Debug, Clone, Default)]
pub struct Fixture {
    /// File the call and cancellation lines are appended to.
    pub log: Option<PathBuf>,
}

impl Fixture {
    fn record(&self, line: &str) {
        let Some(path) = &self.log else { return };
        if let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            // Best effort: a test that cares reads the file and fails on a missing line.
            let _ = writeln!(file, "{line}");
        }
    }
}

fn schema(value: Value) -> Arc<JsonObject> {
    match value {
        Value::Object(object) => Arc::new(object),
        _ => Arc::new(JsonObject::new()),
    }
}

fn page(cursor: Option<&str>) -> ListToolsResult {
    if cursor.is_none() {
        let mut result = ListToolsResult::with_all_items(vec![
            Tool::new(
                "add",
                "Adds two numbers.",
                schema(json!({
                    "type": "object",
                    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                    "required": ["a", "b"]
                })),
            ),
            Tool::new(
                "echo",
                "Returns its text.",
                schema(json!({
                    "type": "object",
                    "properties": {"text": {"type": "string"}},
                    "required": ["text"]
                })),
            ),
        ]);
        result.next_cursor = Some("2".to_owned());
        return result;
    }
    let mut tools = vec![
        Tool::new(
            "fail",
            "Always fails.",
            schema(json!({"type": "object", "properties": {}})),
        ),
        Tool::new(
            "sleep",
            "Sleeps for `ms` milliseconds, then returns \"slept\".",
            schema(json!({
                "type": "object",
                "properties": {"ms": {"type": "integer", "minimum": 0}},
                "required": ["ms"]
            })),
        ),
    ];
    if std::env::var_os("BEHEST_MCP_FIXTURE_PROGRESS_TOOL").is_some() {
        tools.push(Tool::new(
            "progress",
            "Reports `steps` progress notifications `interval_ms` apart, then returns.",
            schema(json!({
                "type": "object",
                "properties": {
                    "steps": {"type": "integer", "minimum": 0},
                    "interval_ms": {"type": "integer", "minimum": 0}
                },
                "required": ["steps"]
            })),
        ));
    }
    if std::env::var_os("BEHEST_MCP_FIXTURE_ENV_TOOL").is_some() {
        tools.push(Tool::new(
            "env",
            "Returns this server's environment variables.",
            schema(json!({"type": "object", "properties": {}})),
        ));
    }
    ListToolsResult::with_all_items(tools)
}

fn number(arguments: Option<&JsonObject>, key: &str) -> Result<f64, ErrorData> {
    arguments
        .and_then(|a| a.get(key))
        .and_then(Value::as_f64)
        .ok_or_else(|| ErrorData::invalid_params(format!("`{key}` must be a number"), None))
}

impl ServerHandler for Fixture {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(page(request.as_ref().and_then(|r| r.cursor.as_deref())))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        self.record(&format!("called {}", request.name));
        // rmcp moves the request's `_meta` into the context.
        if let Some(key) = context
            .meta
            .get("behest/idempotencyKey")
            .and_then(Value::as_str)
        {
            self.record(&format!("key {} {key}", request.name));
        }
        let arguments = request.arguments.as_ref();
        let result = match request.name.as_ref() {
            "add" => {
                let sum = number(arguments, "a")? + number(arguments, "b")?;
                CallToolResult::structured(json!({"sum": sum}))
            }
            "echo" => {
                let text = arguments
                    .and_then(|a| a.get("text"))
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                CallToolResult::success(vec![ContentBlock::text(text)])
            }
            "env" => {
                let vars: serde_json::Map<String, Value> = std::env::vars()
                    .map(|(name, value)| (name, Value::String(value)))
                    .collect();
                CallToolResult::structured(json!({"vars": vars}))
            }
            "fail" => CallToolResult::error(vec![ContentBlock::text("this tool always fails")]),
            "sleep" => {
                let ms = number(arguments, "ms")?;
                #[expect(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    reason = "a test fixture; the schema says a non-negative integer"
                )]
                let duration = Duration::from_millis(ms as u64);
                tokio::select! {
                    () = tokio::time::sleep(duration) => {}
                    () = context.ct.cancelled() => {
                        self.record(&format!("cancelled {}", context.id));
                        return Err(ErrorData::internal_error("cancelled", None));
                    }
                }
                CallToolResult::success(vec![ContentBlock::text("slept")])
            }
            "progress" => {
                #[expect(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    reason = "a test fixture; the schema says non-negative integers"
                )]
                let (steps, interval) = (
                    number(arguments, "steps")? as u64,
                    Duration::from_millis(number(arguments, "interval_ms").unwrap_or(0.0) as u64),
                );
                if let Some(token) = context.meta.get_progress_token() {
                    for step in 1..=steps {
                        #[expect(clippy::cast_precision_loss, reason = "small counts")]
                        let param = ProgressNotificationParam::new(token.clone(), step as f64)
                            .with_total(steps as f64)
                            .with_message(format!("step {step}"));
                        let _ = context.peer.notify_progress(param).await;
                        if !interval.is_zero() {
                            tokio::time::sleep(interval).await;
                        }
                    }
                }
                if let Some(gate) = std::env::var_os("BEHEST_MCP_FIXTURE_GATE") {
                    while !std::path::Path::new(&gate).exists() {
                        tokio::select! {
                            () = tokio::time::sleep(Duration::from_millis(10)) => {}
                            () = context.ct.cancelled() => {
                                return Err(ErrorData::internal_error("cancelled", None));
                            }
                        }
                    }
                }
                CallToolResult::success(vec![ContentBlock::text(format!(
                    "done after {steps} steps"
                ))])
            }
            other => {
                return Err(ErrorData::invalid_params(
                    format!("no tool named `{other}`"),
                    None,
                ));
            }
        };
        Ok(result.into())
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let fixture = Fixture {
        log: std::env::var_os("BEHEST_MCP_FIXTURE_LOG").map(PathBuf::from),
    };
    fixture.record(&format!("started {}", std::process::id()));
    let service = fixture.serve(rmcp::transport::stdio()).await?;
    service.waiting().await?;
    Ok(())
}
