//! What defines an agent beyond its provider and model: model parameters, per-run tools, the
//! settings stored with a run, a session's defaults, and what a run paused in `requires_action`
//! waits for (the client's tool outputs, a person's approvals).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::MessageId;
use super::run::RequestProblem;

/// Sampling and output parameters of a model call. Each is optional: absent, the provider's
/// own default applies (for `max_output_tokens`: the model's configured maximum).
///
/// Sent in each wire format's own fields: OpenAI Chat Completions `temperature`, `top_p`,
/// `max_completion_tokens`/`max_tokens`, `stop`, `seed`, `parallel_tool_calls`; Anthropic
/// Messages `temperature`, `top_p`, `max_tokens`, `stop_sequences`,
/// `tool_choice.disable_parallel_tool_use` (Anthropic has no seed).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelParameters {
    /// Sampling temperature, 0 to 2 (Anthropic: 0 to 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, maximum = 2)]
    pub temperature: Option<f64>,
    /// Nucleus sampling: the probability mass kept, 0 to 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, maximum = 1)]
    pub top_p: Option<f64>,
    /// Most tokens one model call may generate: 1 to the model's configured
    /// `max_output_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub max_output_tokens: Option<u32>,
    /// Up to 4 sequences that end the model's output when generated (not included in it); none
    /// empty; whitespace-only ones (`"\n"`) are refused for Anthropic providers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_items = 4)]
    pub stop: Option<Vec<String>>,
    /// Seed for deterministic sampling where the provider supports it (OpenAI-compatible; not
    /// Anthropic).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// Whether the model may call several tools in one turn; absent: the provider's default
    /// (yes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
}

/// Most stop sequences a run may give (OpenAI's limit).
pub const MAX_STOP_SEQUENCES: usize = 4;

impl ModelParameters {
    /// Each field of `self`, else `fallback`'s.
    #[must_use]
    pub fn or(self, fallback: &Self) -> Self {
        Self {
            temperature: self.temperature.or(fallback.temperature),
            top_p: self.top_p.or(fallback.top_p),
            max_output_tokens: self.max_output_tokens.or(fallback.max_output_tokens),
            stop: self.stop.or_else(|| fallback.stop.clone()),
            seed: self.seed.or(fallback.seed),
            parallel_tool_calls: self.parallel_tool_calls.or(fallback.parallel_tool_calls),
        }
    }

    /// Whether a stop sequence is made of whitespace only (`"\n"`): fine for OpenAI-compatible
    /// APIs, refused by Anthropic's.
    #[must_use]
    pub fn whitespace_stop(&self) -> bool {
        self.stop
            .iter()
            .flatten()
            .any(|s| !s.is_empty() && s.trim().is_empty())
    }

    /// True when no parameter is set.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Checks the ranges that hold whatever the model: `temperature` 0 to 2, `top_p` 0 to 1,
    /// `max_output_tokens` at least 1, `stop` at most 4 sequences, none empty, no U+0000
    /// (whether whitespace-only ones are accepted is the provider's rule: see
    /// [`ModelParameters::whitespace_stop`]).
    ///
    /// # Errors
    /// The first [`RequestProblem::Invalid`] found, naming the parameter.
    pub fn check(&self) -> Result<(), RequestProblem> {
        if let Some(t) = self.temperature
            && !(0.0..=2.0).contains(&t)
        {
            return Err(invalid("temperature", "must be between 0 and 2"));
        }
        if let Some(p) = self.top_p
            && !(0.0..=1.0).contains(&p)
        {
            return Err(invalid("top_p", "must be between 0 and 1"));
        }
        if self.max_output_tokens == Some(0) {
            return Err(invalid("max_output_tokens", "must be at least 1"));
        }
        if let Some(stop) = &self.stop {
            if stop.len() > MAX_STOP_SEQUENCES {
                return Err(invalid(
                    "stop",
                    format!("takes at most {MAX_STOP_SEQUENCES} sequences"),
                ));
            }
            if stop.iter().any(String::is_empty) {
                return Err(invalid("stop", "a stop sequence must not be empty"));
            }
            if stop.iter().any(|s| s.contains('\0')) {
                return Err(invalid("stop", NUL));
            }
        }
        Ok(())
    }
}

const NUL: &str = "must not contain the NUL character (U+0000)";

fn invalid(field: &'static str, reason: impl Into<String>) -> RequestProblem {
    RequestProblem::Invalid {
        field,
        reason: reason.into(),
    }
}

/// One of a run's tools: a configured server tool by name (`"current_time"`), or a function
/// tool defined by the run, which the client executes (`{"name", "description",
/// "parameters"}`; see `POST /runs/{run_id}/tool_outputs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum RunTool {
    /// A server tool (`GET /tools`), allow-listed by name.
    Server(String),
    /// A tool the client executes.
    Client(ToolDefinition),
}

impl RunTool {
    /// The tool's name.
    #[must_use]
    pub fn name(&self) -> &str {
        match self {
            Self::Server(name) => name,
            Self::Client(definition) => &definition.name,
        }
    }
}

/// A function tool a run defines and the client executes: when the model calls it the run
/// pauses in `requires_action` until the client posts the call's output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolDefinition {
    /// The name the model calls it by: 1 to 64 letters, digits, `_` or `-` (the rule OpenAI
    /// and Anthropic enforce), unique among the run's tools and distinct from every server
    /// tool's name.
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    pub name: String,
    /// What it does, for the model; default empty.
    #[serde(default)]
    pub description: String,
    /// JSON Schema of its arguments: an object schema (`"type": "object"`); default
    /// `{"type": "object", "properties": {}}`. The model's arguments are validated against it
    /// before the call reaches the client.
    #[serde(default = "empty_object_schema")]
    #[schema(value_type = Object)]
    pub parameters: serde_json::Value,
}

fn empty_object_schema() -> serde_json::Value {
    serde_json::json!({"type": "object", "properties": {}})
}

/// Whether `name` is a valid tool name: 1 to 64 ASCII letters, digits, `_` or `-`.
#[must_use]
pub fn is_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Most tools one run may define for the client to execute (its server tools are the
/// configured ones, so they need no cap).
pub const MAX_CLIENT_TOOLS: usize = 128;

/// Checks a run's `tools` by themselves: at most [`MAX_CLIENT_TOOLS`] definitions, server
/// names without U+0000, definitions with a valid name and an object schema whose `type` is
/// `"object"`, every name once.
///
/// # Errors
/// [`RequestProblem::Invalid`] naming `tools`, the reason saying which entry.
pub fn check_tools(tools: &[RunTool]) -> Result<(), RequestProblem> {
    let defined = tools
        .iter()
        .filter(|tool| matches!(tool, RunTool::Client(_)))
        .count();
    if defined > MAX_CLIENT_TOOLS {
        return Err(invalid(
            "tools",
            format!(
                "a run may define at most {MAX_CLIENT_TOOLS} tools for the client to execute; \
                 this one defines {defined}"
            ),
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for (index, tool) in tools.iter().enumerate() {
        match tool {
            RunTool::Server(name) if name.contains('\0') => {
                return Err(invalid("tools", format!("tools[{index}]: {NUL}")));
            }
            RunTool::Server(_) => {}
            RunTool::Client(definition) => {
                if !is_tool_name(&definition.name) {
                    return Err(invalid(
                        "tools",
                        format!(
                            "tools[{index}].name: a tool name is 1 to 64 letters, digits, `_` or `-`"
                        ),
                    ));
                }
                if definition.description.contains('\0') {
                    return Err(invalid(
                        "tools",
                        format!("tools[{index}].description: {NUL}"),
                    ));
                }
                if definition.parameters.get("type") != Some(&serde_json::json!("object")) {
                    return Err(invalid(
                        "tools",
                        format!(
                            "tools[{index}].parameters: must be a JSON Schema object with \
                             \"type\": \"object\""
                        ),
                    ));
                }
            }
        }
        if !seen.insert(tool.name()) {
            return Err(invalid(
                "tools",
                format!("tools[{index}]: `{}` is named twice", tool.name()),
            ));
        }
    }
    Ok(())
}

/// `[runtime.doom_loop]`, or a preset's: when repeated tool calls end a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct DoomLoopSettings {
    /// Whether detection is on; default true.
    pub enabled: bool,
    /// The same step (one model turn's calls, each name + canonical JSON arguments, or the raw
    /// text of invalid arguments; the order of parallel calls ignored) this many times in a
    /// row, or a cycle of 2 to 4 steps repeated this many times, is a doom loop; default 3 (at
    /// least 2).
    pub threshold: u32,
    /// Tools meant to be polled (e.g. `["check_status"]`): their calls never trip the
    /// detector; default none.
    pub allow: Vec<String>,
}

impl Default for DoomLoopSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            threshold: 3,
            allow: Vec::new(),
        }
    }
}

/// What a run is defined with beyond provider, model, tools and limits, as stored with it:
/// the values in force after the request, its session's defaults and its agent preset were
/// merged. Absent limits mean the server's `[runtime]` values at execution time.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunDefinition {
    /// The system prompt, sent in each provider's native place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// Model parameters.
    #[serde(default, skip_serializing_if = "ModelParameters::is_empty")]
    pub parameters: ModelParameters,
    /// Passed through into the provider request body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_options: Option<serde_json::Map<String, serde_json::Value>>,
    /// Server tools whose calls wait for a person's approval in this run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approval: Vec<String>,
    /// Time one tool call may take, in ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_timeout_ms: Option<u64>,
    /// How long the run may wait in `requires_action`, in ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action_timeout_ms: Option<u64>,
    /// Doom-loop detection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub doom_loop: Option<DoomLoopSettings>,
    /// The JSON Schema the final answer must match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<serde_json::Value>,
    /// Where the run's end (and each pause in `requires_action`) is posted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<super::Webhook>,
}

/// What a session's runs default to when they do not say (`POST /sessions`), and what a
/// session remembers of its first run: its agent, provider, model and instructions.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionDefaults {
    /// Agent preset (`GET /agents`) of runs that name none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// Provider id of runs that name none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Model of runs that name none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Instructions (system prompt) of runs that give none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// Model parameters of runs that set none (each parameter on its own).
    #[serde(default, skip_serializing_if = "ModelParameters::is_empty")]
    pub parameters: ModelParameters,
}

impl SessionDefaults {
    /// `self` with each field it lacks taken from `other` (a session's first run fills in
    /// what the session does not say yet).
    #[must_use]
    pub fn filled_from(self, other: &Self) -> Self {
        Self {
            agent: self.agent.or_else(|| other.agent.clone()),
            provider: self.provider.or_else(|| other.provider.clone()),
            model: self.model.or_else(|| other.model.clone()),
            instructions: self.instructions.or_else(|| other.instructions.clone()),
            parameters: self.parameters.or(&other.parameters),
        }
    }
}

/// How a pending tool call is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PendingKind {
    /// A tool the run defined: the client executes it and posts its output to
    /// `POST /runs/{run_id}/tool_outputs`.
    ClientTool,
    /// A server tool that needs approval: `POST /runs/{run_id}/approvals` lets it run or
    /// rejects it.
    Approval,
}

/// A tool call a paused run waits on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PendingToolCall {
    /// The model's call id: what an output or approval names as `call_id`.
    pub call_id: String,
    /// The tool called.
    pub tool_name: String,
    /// The model's arguments, a JSON object valid against the tool's JSON Schema.
    #[schema(value_type = Object)]
    pub arguments: serde_json::Value,
    /// How it is answered.
    pub kind: PendingKind,
}

/// What a run in `requires_action` waits for (the `tool_calls_required` event, and
/// `required_action` on the run record until it is answered): the calls of one model turn that
/// the client executes or a person approves. Answer every `client_tool` call at once with
/// `POST /runs/{run_id}/tool_outputs`, every `approval` call at once with
/// `POST /runs/{run_id}/approvals`; the run resumes when all are answered, and fails (or is
/// cancelled, `[runtime] action_expiry`) at `expires_at`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RequiredAction {
    /// The assistant message whose tool calls these are.
    pub message_id: MessageId,
    /// The calls waited on, in the model's order.
    pub tool_calls: Vec<PendingToolCall>,
    /// When the wait ends if they are not all answered (RFC 3339, UTC).
    pub expires_at: DateTime<Utc>,
}

/// The answer to one pending call, as stored until the run commits it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionAnswer {
    /// A client tool's output (any JSON value; a string is text for the model).
    Output(serde_json::Value),
    /// A client tool's failure, seen by the model as a `Failure`.
    Error(String),
    /// An approval decision.
    Approval {
        /// Whether the call may run.
        approve: bool,
        /// Why, for a rejection the model sees.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        /// Who decided, as the request named them (unchecked).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        decided_by: Option<String>,
        /// The position of the API key that authenticated the request, when the server has
        /// keys.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        api_key: Option<u32>,
    },
}

impl ActionAnswer {
    /// This answer in a few words for an error's detail: `output <JSON>` or `error "<text>"`
    /// (each cut to 200 characters), `approve: true|false`.
    pub fn in_short(&self) -> String {
        let cut = |text: String| {
            if text.chars().count() > 200 {
                format!("{}…", text.chars().take(200).collect::<String>())
            } else {
                text
            }
        };
        match self {
            Self::Output(value) => format!("output {}", cut(value.to_string())),
            Self::Error(error) => format!("error {:?}", cut(error.clone())),
            Self::Approval { approve, .. } => format!("approve: {approve}"),
        }
    }

    /// Whether `other` gives the same answer: equal but for how JSON numbers are spelled
    /// (`1`, `1.0` and `1e0` are one number), so that a client that re-serializes a retried
    /// output is not taken to answer otherwise.
    pub fn same_as(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Output(a), Self::Output(b)) => same_json(a, b),
            _ => self == other,
        }
    }
}

/// JSON equality with numbers compared by value (RFC 8259 §6 leaves their spelling free).
fn same_json(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value;
    match (a, b) {
        (Value::Number(a), Value::Number(b)) => match (a.as_i128(), b.as_i128()) {
            (Some(a), Some(b)) => a == b,
            _ => a.as_f64() == b.as_f64(),
        },
        (Value::Array(a), Value::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(a, b)| same_json(a, b))
        }
        (Value::Object(a), Value::Object(b)) => {
            a.len() == b.len()
                && a.iter()
                    .all(|(key, a)| b.get(key).is_some_and(|b| same_json(a, b)))
        }
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::panic, reason = "tests")]

    use super::*;

    #[test]
    fn an_answer_is_the_same_whatever_its_numbers_spelling() {
        let parse = |text: &str| ActionAnswer::Output(serde_json::from_str(text).unwrap());
        let same = [
            (
                r#"{"a":1,"b":[2,{"c":-3}]}"#,
                r#"{"b":[2.0,{"c":-3e0}],"a":1.0}"#,
            ),
            ("0.5", "5e-1"),
            (r#""x""#, r#""x""#),
        ];
        for (a, b) in same {
            assert!(parse(a).same_as(&parse(b)), "{a} ~ {b}");
        }
        let other = [
            (r#"{"a":1}"#, r#"{"a":1.5}"#),
            (r#"{"a":1}"#, r#"{"a":"1"}"#),
            (r#"{"a":1}"#, r#"{"a":1,"b":null}"#),
            ("[1,2]", "[2,1]"),
            ("[1]", "[1,1]"),
            ("9007199254740993", "9007199254740992"),
        ];
        for (a, b) in other {
            assert!(!parse(a).same_as(&parse(b)), "{a} !~ {b}");
        }
        assert!(!parse("1").same_as(&ActionAnswer::Error("1".into())));
    }

    #[test]
    fn parameters_are_checked_and_merged() {
        let bad = [
            ModelParameters {
                temperature: Some(2.01),
                ..ModelParameters::default()
            },
            ModelParameters {
                top_p: Some(-0.1),
                ..ModelParameters::default()
            },
            ModelParameters {
                max_output_tokens: Some(0),
                ..ModelParameters::default()
            },
            ModelParameters {
                stop: Some(vec![
                    "a".into(),
                    "b".into(),
                    "c".into(),
                    "d".into(),
                    "e".into(),
                ]),
                ..ModelParameters::default()
            },
            ModelParameters {
                stop: Some(vec!["END".into(), String::new()]),
                ..ModelParameters::default()
            },
        ];
        // Whitespace-only is each provider's rule (Anthropic refuses it), not a range.
        let newline = ModelParameters {
            stop: Some(vec![" \n".into()]),
            ..ModelParameters::default()
        };
        assert_eq!(newline.check(), Ok(()));
        assert!(newline.whitespace_stop());
        assert!(!ModelParameters::default().whitespace_stop());
        let fields: Vec<&str> = bad
            .iter()
            .map(|p| match p.check() {
                Err(RequestProblem::Invalid { field, .. }) => field,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            fields,
            ["temperature", "top_p", "max_output_tokens", "stop", "stop"]
        );
        let preset = ModelParameters {
            temperature: Some(0.2),
            seed: Some(7),
            ..ModelParameters::default()
        };
        let merged = ModelParameters {
            temperature: Some(1.0),
            ..ModelParameters::default()
        }
        .or(&preset);
        assert_eq!((merged.temperature, merged.seed), (Some(1.0), Some(7)));
    }

    #[test]
    fn tools_are_checked() {
        let definition = |name: &str, parameters: serde_json::Value| {
            RunTool::Client(ToolDefinition {
                name: name.to_owned(),
                description: String::new(),
                parameters,
            })
        };
        let object = serde_json::json!({"type": "object"});
        assert!(
            check_tools(&[RunTool::Server("a".into()), definition("b", object.clone())]).is_ok()
        );
        for tools in [
            vec![definition("a b", object.clone())],
            vec![definition("a", serde_json::json!({"type": "string"}))],
            vec![RunTool::Server("a".into()), definition("a", object.clone())],
        ] {
            assert!(check_tools(&tools).is_err(), "{tools:?}");
        }
        let parsed: Vec<RunTool> =
            serde_json::from_value(serde_json::json!(["x", {"name": "y"}])).unwrap_or_default();
        assert_eq!(parsed.len(), 2);
        assert!(matches!(&parsed[1], RunTool::Client(d) if d.parameters["type"] == "object"));
    }
}
