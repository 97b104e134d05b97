//! Runs: the record, its status, the output, and the create request (proto `RunService`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{Message, RunId, SessionId};

/// Where a run is in its life (`common.proto` `RunStatus`). The last three are terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// Created, not yet started.
    Pending,
    /// The session's history is loaded.
    SessionLoaded,
    /// The model's context is being assembled.
    BuildingContext,
    /// A model call is streaming.
    CallingModel,
    /// Tool calls are executing.
    WaitingForTools,
    /// The model's reply is being stored.
    Persisting,
    /// Finished: the model stopped.
    Completed,
    /// Finished: an error ended the run (see `error`).
    Failed,
    /// Finished: a client cancelled the run.
    Cancelled,
}

impl RunStatus {
    /// Every status, in life order.
    pub const ALL: [Self; 9] = [
        Self::Pending,
        Self::SessionLoaded,
        Self::BuildingContext,
        Self::CallingModel,
        Self::WaitingForTools,
        Self::Persisting,
        Self::Completed,
        Self::Failed,
        Self::Cancelled,
    ];

    /// `completed`, `failed` and `cancelled` end a run; nothing follows them.
    #[must_use]
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Completed | Self::Failed | Self::Cancelled)
    }

    /// The snake_case name, as stored and sent.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::SessionLoaded => "session_loaded",
            Self::BuildingContext => "building_context",
            Self::CallingModel => "calling_model",
            Self::WaitingForTools => "waiting_for_tools",
            Self::Persisting => "persisting",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    /// Parses the stored name; `None` for anything else.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|status| status.as_str() == s)
    }
}

/// Why the model stopped (`common.proto` `FinishReason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model ended its turn.
    Stop,
    /// The model asked for tool calls.
    ToolCalls,
    /// The output hit the max-token limit.
    Length,
    /// The provider's content filter stopped the output.
    ContentFilter,
    /// The call ended in an error.
    Error,
    /// The provider gave a reason behest does not know, or none.
    Unknown,
}

impl FinishReason {
    const ALL: [Self; 6] = [
        Self::Stop,
        Self::ToolCalls,
        Self::Length,
        Self::ContentFilter,
        Self::Error,
        Self::Unknown,
    ];

    /// The snake_case name, as stored and sent.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::ToolCalls => "tool_calls",
            Self::Length => "length",
            Self::ContentFilter => "content_filter",
            Self::Error => "error",
            Self::Unknown => "unknown",
        }
    }

    /// Parses the stored name; `None` for anything else.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|reason| reason.as_str() == s)
    }
}

/// Token counts of one model call or a whole run (`common.proto` `TokenUsage`), in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TokenUsage {
    /// Prompt tokens sent to the model.
    pub input_tokens: u64,
    /// Tokens the model generated.
    pub output_tokens: u64,
    /// `input_tokens + output_tokens`, or the provider's own total.
    pub total_tokens: u64,
    /// Of `output_tokens`, those spent on reasoning ("thinking"), where the provider reports
    /// them (OpenAI `completion_tokens_details.reasoning_tokens`); 0 otherwise.
    #[serde(default)]
    pub reasoning_tokens: u64,
    /// True when some of these counts are behest's own estimate (a tokenizer count of the
    /// request and the reply) because the provider reported no usage; false when every count
    /// is the provider's.
    #[serde(default)]
    pub estimated: bool,
}

impl std::ops::AddAssign for TokenUsage {
    fn add_assign(&mut self, other: Self) {
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.total_tokens += other.total_tokens;
        self.reasoning_tokens += other.reasoning_tokens;
        self.estimated |= other.estimated;
    }
}

/// How the model may use tools (proto `CreateRunRequest.tool_choice`): `"auto"`, `"none"`,
/// `"required"`, or `{"name": "<tool>"}` to force one tool. In the OpenAPI document the object
/// form is the named component `ToolChoiceTool`, so generated clients get a named type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ToolChoice {
    /// `auto` (the model decides), `none` (no tool calls) or `required` (at least one).
    Mode(ToolChoiceMode),
    /// Forces a call of the named tool.
    Tool {
        /// The tool's name.
        name: String,
    },
}

/// The object form of `ToolChoice`, named so generated clients get a type for it:
/// `{"name": "<tool>"}` forces a call of that tool. (In Rust the value is `ToolChoice::Tool`;
/// this struct exists for the schema.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolChoiceTool {
    /// The tool's name, one of the run's tools.
    #[schema(min_length = 1)]
    pub name: String,
}

impl utoipa::PartialSchema for ToolChoice {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::{OneOfBuilder, Ref, RefOr};
        OneOfBuilder::new()
            .description(Some(
                "How the model may use tools: `\"auto\"`, `\"none\"`, `\"required\"`, or \
                 `{\"name\": \"<tool>\"}` to force one tool.",
            ))
            .item(RefOr::Ref(Ref::from_schema_name("ToolChoiceMode")))
            .item(RefOr::Ref(Ref::from_schema_name("ToolChoiceTool")))
            .into()
    }
}

impl ToSchema for ToolChoice {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        use utoipa::PartialSchema;
        schemas.push(("ToolChoiceMode".to_owned(), ToolChoiceMode::schema()));
        schemas.push(("ToolChoiceTool".to_owned(), ToolChoiceTool::schema()));
    }
}

impl Default for ToolChoice {
    fn default() -> Self {
        Self::Mode(ToolChoiceMode::Auto)
    }
}

/// The named tool-choice modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoiceMode {
    /// The model decides whether to call tools.
    Auto,
    /// The model must not call tools.
    None,
    /// The model must call at least one tool.
    Required,
}

/// A run as stored (proto `RunRecord`, plus its outcome so far).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RunRecord {
    /// Run id (UUID v7).
    pub id: RunId,
    /// The session the run belongs to.
    pub session_id: SessionId,
    /// Where the run is in its life.
    pub status: RunStatus,
    /// Provider id, a key of the config's `[providers]`.
    pub provider: String,
    /// Model name as the provider knows it.
    pub model: String,
    /// How the model may use tools.
    pub tool_choice: ToolChoice,
    /// The client's JSON object, stored and returned unchanged.
    #[schema(value_type = Object)]
    pub metadata: serde_json::Value,
    /// Model calls made so far (one per iteration).
    pub iterations: u32,
    /// Why the model stopped; set when the run ended (`error` for a failed run, `unknown` for a
    /// cancelled one, as in its output); absent while it is active.
    pub finish_reason: Option<FinishReason>,
    /// Tokens used by every model call of the run so far.
    pub total_usage: TokenUsage,
    /// What ended the run, when it failed.
    pub error: Option<String>,
    /// The tools the run may call; absent: every configured tool.
    pub tools: Option<Vec<String>>,
    /// Model calls this run may make at most.
    pub max_iterations: u32,
    /// The client's idempotency key, when it gave one.
    pub client_request_id: Option<String>,
    /// Created (RFC 3339, UTC).
    pub created_at: DateTime<Utc>,
    /// Last status change (RFC 3339, UTC).
    pub updated_at: DateTime<Utc>,
    /// When retention removed the run's events and snapshot (RFC 3339, UTC); its event stream
    /// then answers 410 `run_events_expired`. Absent while they are kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events_removed_at: Option<DateTime<Utc>>,
}

/// What a finished run produced (proto `RunOutput`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RunOutput {
    /// Run id.
    pub run_id: RunId,
    /// Its session.
    pub session_id: SessionId,
    /// How the run ended: `completed`, `failed` or `cancelled`.
    pub status: RunStatus,
    /// Model calls made.
    pub iterations: u32,
    /// Why the model stopped (`error` for a failed run, `unknown` for a cancelled one).
    pub finish_reason: FinishReason,
    /// Tokens used by all model calls of the run.
    pub total_usage: TokenUsage,
    /// The assistant messages the run produced, in order.
    pub messages: Vec<Message>,
    /// What ended the run, when it failed.
    pub error: Option<String>,
}

/// Most bytes `metadata` may take, serialized as compact JSON (16 KiB); more is 422
/// `invalid_field` naming `metadata`.
pub const METADATA_MAX_BYTES: usize = 16 * 1024;

/// Default of the server's `runtime.max_iterations_cap`: the `maximum` of `max_iterations` in
/// the OpenAPI document (a server configured otherwise enforces its own cap).
pub const DEFAULT_MAX_ITERATIONS_CAP: u32 = 100;

/// Body of `POST /runs` and `POST /runs/stream` (proto `CreateRunRequest`): a JSON object.
///
/// Enforced (and stated in the OpenAPI document): `provider`, `model` and `input` are required
/// non-empty strings (`input` must contain a non-whitespace character); `max_iterations` is
/// 1 to the server's cap; `metadata` is an object of at most 16384 bytes serialized; no string
/// may contain U+0000. An absent required field is 422 `missing_field`, a present but bad one
/// 422 `invalid_field`, both naming the field.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateRunRequest {
    /// Session to continue; absent or empty creates a new session.
    #[serde(default, deserialize_with = "empty_as_none")]
    #[schema(value_type = Option<String>, format = Uuid)]
    pub session_id: Option<String>,
    /// Provider id (required), a key of the config's `[providers]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = String, required = true, min_length = 1)]
    pub provider: Option<String>,
    /// Model name (required), one of the provider's configured models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = String, required = true, min_length = 1)]
    pub model: Option<String>,
    /// The user's input (required, with at least one non-whitespace character); stored once as
    /// one user message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = String, required = true, min_length = 1, pattern = r"\S")]
    pub input: Option<String>,
    /// Any JSON object of at most 16384 bytes serialized (compact JSON); stored with the run
    /// and returned unchanged.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Value>,
    /// How the model may use tools; default `auto`.
    #[serde(default)]
    pub tool_choice: Option<ToolChoice>,
    /// Idempotency key chosen by the client (or the `Idempotency-Key` header): the same key
    /// with the same body returns the same run; with another body, 409.
    #[serde(default, deserialize_with = "empty_as_none")]
    pub client_request_id: Option<String>,
    /// Allow-list of tool names the run may call; absent: every configured tool.
    #[serde(default)]
    pub tools: Option<Vec<String>>,
    /// Model calls the run may make at most: 1 to the server's `runtime.max_iterations_cap`
    /// (default 100, the `maximum` stated here); default the server's `runtime.max_iterations`.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 100)]
    pub max_iterations: Option<u32>,
}

/// What is wrong with a [`CreateRunRequest`] on its own (before the server's configuration is
/// consulted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestProblem {
    /// A required field is absent.
    Missing(&'static str),
    /// A field is present with a bad value.
    Invalid {
        /// The field.
        field: &'static str,
        /// What it must be.
        reason: String,
    },
}

impl CreateRunRequest {
    /// Checks what the request must satisfy by itself: required fields present and non-empty,
    /// `input` not blank, no U+0000 in any string (PostgreSQL cannot store it), `metadata` an
    /// object of at most [`METADATA_MAX_BYTES`], `max_iterations` within `1..=cap`.
    ///
    /// # Errors
    /// The first [`RequestProblem`] found, in field order.
    pub fn check(&self, max_iterations_cap: u32) -> Result<(), RequestProblem> {
        fn invalid(field: &'static str, reason: impl Into<String>) -> RequestProblem {
            RequestProblem::Invalid {
                field,
                reason: reason.into(),
            }
        }
        const NUL: &str = "must not contain the NUL character (U+0000)";
        let required = [
            ("provider", &self.provider),
            ("model", &self.model),
            ("input", &self.input),
        ];
        for (field, value) in required {
            let Some(value) = value else {
                return Err(RequestProblem::Missing(field));
            };
            if value.is_empty() {
                return Err(invalid(field, "must not be empty"));
            }
            if value.contains('\0') {
                return Err(invalid(field, NUL));
            }
        }
        if self.input.as_deref().is_some_and(|s| s.trim().is_empty()) {
            return Err(invalid("input", "must contain a non-whitespace character"));
        }
        let optional = [
            ("session_id", self.session_id.as_deref()),
            ("client_request_id", self.client_request_id.as_deref()),
        ];
        for (field, value) in optional {
            if value.is_some_and(|s| s.contains('\0')) {
                return Err(invalid(field, NUL));
            }
        }
        if let Some(ToolChoice::Tool { name }) = &self.tool_choice
            && name.contains('\0')
        {
            return Err(invalid("tool_choice", NUL));
        }
        if self.tools.iter().flatten().any(|name| name.contains('\0')) {
            return Err(invalid("tools", NUL));
        }
        if let Some(metadata) = &self.metadata {
            if !metadata.is_object() {
                return Err(invalid("metadata", "must be a JSON object"));
            }
            if has_nul(metadata) {
                return Err(invalid(
                    "metadata",
                    "keys and strings must not contain the NUL character (U+0000)",
                ));
            }
            let size = serde_json::to_vec(metadata).map_or(usize::MAX, |bytes| bytes.len());
            if size > METADATA_MAX_BYTES {
                return Err(invalid(
                    "metadata",
                    format!(
                        "is {size} bytes serialized; at most {METADATA_MAX_BYTES} are accepted"
                    ),
                ));
            }
        }
        if let Some(max) = self.max_iterations
            && !(1..=max_iterations_cap).contains(&max)
        {
            return Err(invalid(
                "max_iterations",
                format!("must be between 1 and {max_iterations_cap}"),
            ));
        }
        Ok(())
    }

    /// The body's fields, in order.
    pub const FIELDS: [&'static str; 9] = [
        "session_id",
        "provider",
        "model",
        "input",
        "metadata",
        "tool_choice",
        "client_request_id",
        "tools",
        "max_iterations",
    ];

    /// What a top-level field of the body must be, in words, for an error that replaces
    /// serde's message (which would name Rust types).
    #[must_use]
    pub fn expectation(field: &str) -> Option<&'static str> {
        Some(match field {
            "session_id" => "must be a session id (a UUID string)",
            "provider" | "model" | "input" | "client_request_id" => "must be a string",
            "metadata" => "must be a JSON object",
            "tool_choice" => {
                "must be \"auto\", \"none\", \"required\" or an object {\"name\": \"<tool>\"}"
            }
            "tools" => "must be an array of tool names (strings)",
            "max_iterations" => "must be a positive integer",
            _ => return None,
        })
    }
}

/// Whether any key or string in `value` contains U+0000.
fn has_nul(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::String(s) => s.contains('\0'),
        serde_json::Value::Array(items) => items.iter().any(has_nul),
        serde_json::Value::Object(map) => map
            .iter()
            .any(|(key, value)| key.contains('\0') || has_nul(value)),
        _ => false,
    }
}

fn empty_as_none<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let value = Option::<String>::deserialize(d)?;
    Ok(value.filter(|s| !s.is_empty()))
}

/// Answer of `POST /runs` (proto `CreateRunResponse`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CreateRunResponse {
    /// The new run's id.
    pub run_id: RunId,
    /// Its session (new when the request named none).
    pub session_id: SessionId,
}

/// A session: the conversation its runs share.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Session {
    /// Session id (UUID v7).
    pub id: SessionId,
    /// Created (RFC 3339, UTC).
    pub created_at: DateTime<Utc>,
    /// Last run started in it (RFC 3339, UTC).
    pub updated_at: DateTime<Utc>,
}
