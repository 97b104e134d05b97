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
/// `"required"`, or `{"name": "<tool>"}` to force one tool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
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

/// Body of `POST /runs` and `POST /runs/stream` (proto `CreateRunRequest`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateRunRequest {
    /// Session to continue; absent or empty creates a new session.
    #[serde(default, deserialize_with = "empty_as_none")]
    #[schema(value_type = Option<String>, format = Uuid)]
    pub session_id: Option<String>,
    /// Provider id (required), a key of the config's `[providers]`.
    #[serde(default)]
    pub provider: String,
    /// Model name (required), one of the provider's configured models.
    #[serde(default)]
    pub model: String,
    /// The user's input (required); stored once as one user message.
    #[serde(default)]
    pub input: String,
    /// Any JSON object; stored with the run and returned unchanged.
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
    /// Model calls the run may make at most; default the server's `max_iterations`, at most its
    /// `max_iterations_cap`.
    #[serde(default)]
    pub max_iterations: Option<u32>,
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
