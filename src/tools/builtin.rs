//! Built-in tools, offered when the config lists them in `builtin_tools` (and by the no-config
//! demo). They run inside the server and touch nothing outside it.

use serde_json::{Value, json};

use super::{ToolError, ToolInfo, ToolSetupError, ToolSource};

/// Names of every built-in tool.
pub const NAMES: &[&str] = &["current_time"];

/// A built-in tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Builtin {
    /// `current_time`: no arguments; answers `{"utc": RFC 3339 time, "unix": seconds}`.
    CurrentTime,
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
            _ => Err(ToolSetupError::Invalid(format!(
                "builtin_tools: no built-in tool is named `{name}` (there is: {})",
                NAMES.join(", ")
            ))),
        }
    }

    /// Calls the tool (its arguments were validated by the registry).
    pub(super) fn call(self, _arguments: &Value) -> Result<Value, ToolError> {
        match self {
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
