//! Built-in tools, offered when the config lists them in `builtin_tools` (and by the no-config
//! demo). They run inside the server and touch nothing outside it.

use std::time::Duration;

use serde_json::{Value, json};

use super::{ProgressSink, ToolError, ToolInfo, ToolSetupError, ToolSource};

/// Names of every built-in tool.
pub const NAMES: &[&str] = &["current_time", "wait"];

/// The longest `wait`, in ms (10 minutes).
const MAX_WAIT_MS: u64 = 600_000;

/// A built-in tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Builtin {
    /// `current_time`: no arguments; answers `{"utc": RFC 3339 time, "unix": seconds}`.
    CurrentTime,
    /// `wait`: `{"ms": 0…600000, "steps"?: 1…10000 (default 10), "report"?: bool (default
    /// true)}`; waits `ms` in `steps` equal parts, reporting progress `i` of `steps` (message
    /// `waited <n> ms`) after each when `report`; answers `{"waited_ms": ms}`. A slow tool to
    /// watch progress with, without an MCP server.
    Wait,
}

impl Builtin {
    /// The tool called `name`, with how `GET /tools` lists it.
    pub(super) fn named(name: &str) -> Result<(Self, ToolInfo), ToolSetupError> {
        match name {
            "current_time" => Ok((
                Self::CurrentTime,
                ToolInfo {
                    name: name.to_owned(),
                    description: "The current date and time (UTC) of the server.".to_owned(),
                    parameters: json!({
                        "type": "object",
                        "properties": {},
                        "additionalProperties": false
                    }),
                    source: ToolSource::Builtin,
                    idempotent: true,
                    requires_approval: false,
                },
            )),
            "wait" => Ok((
                Self::Wait,
                ToolInfo {
                    name: name.to_owned(),
                    description: "Waits `ms` milliseconds, reporting its progress in `steps` \
                                  steps."
                        .to_owned(),
                    parameters: json!({
                        "type": "object",
                        "properties": {
                            "ms": {"type": "integer", "minimum": 0, "maximum": MAX_WAIT_MS},
                            "steps": {"type": "integer", "minimum": 1, "maximum": 10_000},
                            "report": {"type": "boolean"}
                        },
                        "required": ["ms"],
                        "additionalProperties": false
                    }),
                    source: ToolSource::Builtin,
                    idempotent: true,
                    requires_approval: false,
                },
            )),
            _ => Err(ToolSetupError::Invalid(format!(
                "builtin_tools: no built-in tool is named `{name}` (there is: {})",
                NAMES.join(", ")
            ))),
        }
    }

    /// Calls the tool (its arguments were validated by the registry); progress goes to
    /// `progress` when given.
    pub(super) async fn call(
        self,
        arguments: &Value,
        progress: Option<&ProgressSink>,
    ) -> Result<Value, ToolError> {
        match self {
            Self::Wait => {
                let ms = arguments["ms"].as_u64().unwrap_or(0).min(MAX_WAIT_MS);
                let steps = arguments["steps"].as_u64().unwrap_or(10).clamp(1, 10_000);
                let report = arguments["report"].as_bool().unwrap_or(true);
                let start = tokio::time::Instant::now();
                for step in 1..=steps {
                    // Each step ends at its share of the whole, so rounding does not add up.
                    let due = start + Duration::from_millis(ms * step / steps);
                    tokio::time::sleep_until(due).await;
                    if report && let Some(sink) = progress {
                        #[expect(clippy::cast_precision_loss, reason = "at most 10000")]
                        sink.report(
                            step as f64,
                            Some(steps as f64),
                            Some(format!("waited {} ms", ms * step / steps)),
                        );
                    }
                }
                Ok(json!({"waited_ms": ms}))
            }
            Self::CurrentTime => {
                let now = chrono::Utc::now();
                Ok(json!({
                    "utc": now.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    "unix": now.timestamp(),
                }))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The registry compiles a built-in tool's schema only at its first call
    /// (`ToolSchema::deferred`): each must compile, meta-schema checked.
    #[test]
    fn every_builtin_schema_compiles() {
        for name in NAMES {
            let (_, info) = Builtin::named(name).unwrap();
            assert!(
                super::super::schema::compile(&info.parameters).is_ok(),
                "{name}"
            );
        }
    }
}
