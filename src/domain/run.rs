//! Runs: the record, its status, the output, and the create request (proto `RunService`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::agent::{
    DoomLoopSettings, ModelParameters, RequiredAction, RunDefinition, RunTool, SessionDefaults,
    check_tools,
};
use super::{
    ErrorClass, IMAGE_MEDIA_TYPES, InputPart, MAX_IMAGE_URL_BYTES, MAX_INPUT_PARTS, Message, RunId,
    RunInput, SessionId,
};

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
    /// The context is being compacted: the summariser call of a compaction is in flight
    /// (`context_compaction_started`); the run goes on with `building_context` or
    /// `calling_model`.
    Compacting,
    /// A model call is streaming.
    CallingModel,
    /// Tool calls are executing.
    WaitingForTools,
    /// Paused until the client answers tool calls it executes (`POST /runs/{run_id}/tool_outputs`)
    /// or approves (`POST /runs/{run_id}/approvals`); see `required_action`.
    RequiresAction,
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
    pub const ALL: [Self; 11] = [
        Self::Pending,
        Self::SessionLoaded,
        Self::BuildingContext,
        Self::Compacting,
        Self::CallingModel,
        Self::WaitingForTools,
        Self::RequiresAction,
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
            Self::Compacting => "compacting",
            Self::CallingModel => "calling_model",
            Self::WaitingForTools => "waiting_for_tools",
            Self::RequiresAction => "requires_action",
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
    /// Why the run failed, when it failed: the `error_class` of its `run_failed` event (the
    /// class of the model provider failure, or `doom_loop`, `limit_exceeded`, `interrupted`,
    /// `internal`, `action_expired`, `crash_loop`, `output_invalid`); null otherwise.
    pub error_class: Option<ErrorClass>,
    /// The run's tools: server tools by name and the tools it defined for the client to
    /// execute; absent: every configured server tool.
    pub tools: Option<Vec<RunTool>>,
    /// Model calls this run may make at most.
    pub max_iterations: u32,
    /// The agent preset the run was defined from (`GET /agents`), when it used one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// The system prompt in force (from the request, the session or the preset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// The model parameters in force (unset ones are the provider's defaults).
    #[serde(default)]
    pub parameters: ModelParameters,
    /// Fields passed through into the provider request body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub provider_options: Option<serde_json::Map<String, serde_json::Value>>,
    /// Server tools whose calls wait for approval in this run (besides those configured with
    /// `requires_approval`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approval: Vec<String>,
    /// Time one tool call may take, in ms; absent: the server's `runtime.tool_timeout_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_timeout_ms: Option<u64>,
    /// How long the run may wait in `requires_action`, in ms; absent: the server's
    /// `runtime.action_timeout_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action_timeout_ms: Option<u64>,
    /// Doom-loop detection of this run; absent: the server's `[runtime.doom_loop]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub doom_loop: Option<DoomLoopSettings>,
    /// The JSON Schema the run's final answer must match (from the request or the preset);
    /// absent: free text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub output_schema: Option<serde_json::Value>,
    /// While the run is in `requires_action`: the tool calls it waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub required_action: Option<RequiredAction>,
    /// Where the run's end and each pause in `requires_action` are posted (from the request,
    /// the preset or the server's `[webhooks] url`); absent: nowhere. Deliveries:
    /// `GET /runs/{run_id}/webhook-deliveries`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<super::Webhook>,
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
    /// Why the run failed, when it failed: the `error_class` of its `run_failed` event; null
    /// otherwise.
    pub error_class: Option<ErrorClass>,
    /// For a completed run with an `output_schema`: its final answer, parsed (the JSON value
    /// the last assistant message's text holds, validated against the schema); absent
    /// otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub parsed: Option<serde_json::Value>,
}

/// How a run ended: what its terminal event says and its record keeps (`status`,
/// `finish_reason`, `error`, `error_class`), written in one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunEnd {
    /// The model stopped (`run_completed`).
    Completed {
        /// Why it stopped.
        finish_reason: FinishReason,
        /// The final answer parsed, for a run with an `output_schema`.
        parsed: Option<serde_json::Value>,
    },
    /// An error ended the run (`run_failed`).
    Failed {
        /// Its class.
        class: ErrorClass,
        /// What went wrong, readable by a person.
        error: String,
    },
    /// A client cancelled the run, or its `requires_action` wait expired with
    /// `action_expiry = "cancel"` (`run_cancelled`).
    Cancelled,
}

impl RunEnd {
    /// A failure of `class` with the `error` text.
    #[must_use]
    pub fn failed(class: ErrorClass, error: impl Into<String>) -> Self {
        Self::Failed {
            class,
            error: error.into(),
        }
    }

    /// `completed`, `failed` or `cancelled`.
    #[must_use]
    pub fn status(&self) -> RunStatus {
        match self {
            Self::Completed { .. } => RunStatus::Completed,
            Self::Failed { .. } => RunStatus::Failed,
            Self::Cancelled => RunStatus::Cancelled,
        }
    }

    /// The run's finish reason: the model's for a completed run, `error` for a failed one,
    /// `unknown` for a cancelled one.
    #[must_use]
    pub fn finish_reason(&self) -> FinishReason {
        match self {
            Self::Completed { finish_reason, .. } => *finish_reason,
            Self::Failed { .. } => FinishReason::Error,
            Self::Cancelled => FinishReason::Unknown,
        }
    }

    /// The error of a failed run.
    #[must_use]
    pub fn error(&self) -> Option<&str> {
        match self {
            Self::Failed { error, .. } => Some(error),
            _ => None,
        }
    }

    /// The class of a failed run's error.
    #[must_use]
    pub fn error_class(&self) -> Option<ErrorClass> {
        match self {
            Self::Failed { class, .. } => Some(*class),
            _ => None,
        }
    }
}

/// Most bytes `metadata` may take, serialized as compact JSON (16 KiB); more is 422
/// `invalid_field` naming `metadata`.
pub const METADATA_MAX_BYTES: usize = 16 * 1024;

/// Default of the server's `runtime.max_iterations_cap`: the `maximum` of `max_iterations` in
/// the OpenAPI document (a server configured otherwise enforces its own cap).
pub const DEFAULT_MAX_ITERATIONS_CAP: u32 = 100;

/// Body of `POST /runs` and `POST /runs/stream` (proto `CreateRunRequest`): a JSON object.
///
/// Enforced (and stated in the OpenAPI document): `input` is a required string with a
/// non-whitespace character; `provider` and `model` are non-empty strings, required unless the
/// run's agent preset or its session provides them; `max_iterations` is 1 to the server's cap;
/// `metadata` and `provider_options` are objects of at most 16384 bytes serialized; the model
/// parameters are within their ranges (`max_output_tokens` at most the model's configured
/// maximum); no string may contain U+0000. An absent required field is 422 `missing_field`, a
/// present but bad one 422 `invalid_field`, both naming the field.
///
/// Each field left out is taken from the agent preset (`agent`, or the session's agent), then
/// from the session's defaults, then the server's; a field given here overrides both.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateRunRequest {
    /// Session to continue; absent or empty creates a new session.
    #[serde(default, deserialize_with = "empty_as_none")]
    #[schema(value_type = Option<String>, format = Uuid)]
    pub session_id: Option<String>,
    /// Provider id, a key of the config's `[providers]`; required unless the agent preset or
    /// the session gives one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, min_length = 1)]
    pub provider: Option<String>,
    /// Model name, one of the provider's configured models; required unless the agent preset
    /// or the session gives one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, min_length = 1)]
    pub model: Option<String>,
    /// The user's input (required), stored once as one user message: a string with at least
    /// one non-whitespace character, or a list of at most 64 content parts —
    /// `{"type": "text", "text"}`, `{"type": "image", "media_type", "data"}` (base64, at most
    /// 3932160 bytes decoded; `image/png`, `image/jpeg`, `image/gif`, `image/webp`) or
    /// `{"type": "image", "url"}` (http(s), at most 2048 bytes). A model configured
    /// `text_only` refuses images (422 naming `input`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(required = true)]
    pub input: Option<RunInput>,
    /// Any JSON object of at most 16384 bytes serialized (compact JSON); stored with the run
    /// and returned unchanged.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Value>,
    /// How the model may use tools; default `auto`.
    #[serde(default)]
    pub tool_choice: Option<ToolChoice>,
    /// Idempotency key chosen by the client (or the `Idempotency-Key` header): the same key
    /// with the same body returns the same run; with another body, 409. 1 to 255 visible
    /// ASCII characters (`!` to `~`); empty means none.
    #[serde(default, deserialize_with = "empty_as_none")]
    #[schema(max_length = 255, pattern = r"^[!-~]*$")]
    pub client_request_id: Option<String>,
    /// The run's tools: names of server tools (`GET /tools`) it may call, and function tools
    /// it defines, `{"name", "description", "parameters"}`, which the client executes (a call
    /// pauses the run in `requires_action` until `POST /runs/{run_id}/tool_outputs`). Names are
    /// unique; a defined tool's name is no server tool's; its `parameters` is a JSON Schema
    /// with `"type": "object"`, at most 10000 subschemas, no `$ref` cycle that consumes no
    /// input, at most 1000 subschemas applied to one value. At most 128 defined tools. Absent:
    /// every server tool and none of the client's; present, exactly these.
    #[serde(default)]
    pub tools: Option<Vec<RunTool>>,
    /// Model calls the run may make at most: 1 to the server's `runtime.max_iterations_cap`
    /// (default 100, the `maximum` stated here); default the preset's, else the server's
    /// `runtime.max_iterations`.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 100)]
    pub max_iterations: Option<u32>,
    /// Agent preset to run (`GET /agents`, config `[agents.<name>]`): provider, model,
    /// instructions, parameters, tools and limits that this request's own fields override;
    /// default the session's agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(min_length = 1)]
    pub agent: Option<String>,
    /// The system prompt, sent in each provider's native place (OpenAI-compatible: a first
    /// `system` or `developer` message; Anthropic: top-level `system`). An empty string means
    /// none (overriding a preset's or the session's); a blank one (only whitespace) is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// Sampling temperature, 0 to 2 (Anthropic providers: 0 to 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, maximum = 2)]
    pub temperature: Option<f64>,
    /// Nucleus sampling (`top_p`), 0 to 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, maximum = 1)]
    pub top_p: Option<f64>,
    /// Most tokens one model call may generate: 1 to the model's configured
    /// `max_output_tokens` (`GET /providers`), which is the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub max_output_tokens: Option<u32>,
    /// Up to 4 stop sequences, none empty (OpenAI `stop`, Anthropic `stop_sequences`); a
    /// whitespace-only one such as `"\n"` is refused for Anthropic providers, whose API refuses
    /// it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_items = 4)]
    pub stop: Option<Vec<String>>,
    /// Sampling seed (OpenAI-compatible providers; Anthropic has none: 422 there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// Whether the model may call several tools in one turn (OpenAI `parallel_tool_calls`,
    /// Anthropic `disable_parallel_tool_use`); default the provider's (yes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// A JSON object of at most 16384 bytes merged into the provider's request body, for what
    /// behest does not model (e.g. `{"top_k": 40}`, `{"user": "u-1"}`,
    /// `{"response_format": {…}}`). It may not set the keys behest writes itself: OpenAI-compatible
    /// `model`, `messages`, `stream`, `stream_options`, `tools`, `tool_choice`, `n`,
    /// `temperature`, `top_p`, `max_tokens`, `max_completion_tokens`, `stop`, `seed`,
    /// `parallel_tool_calls`; Anthropic `model`, `messages`, `system`, `stream`, `tools`,
    /// `tool_choice`, `max_tokens`, `thinking`, `temperature`, `top_p`, `stop_sequences`
    /// (use the fields above).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub provider_options: Option<serde_json::Value>,
    /// Server tools (of the run's) whose calls pause the run for a person's approval
    /// (`POST /runs/{run_id}/approvals`), besides those configured `requires_approval`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<Vec<String>>,
    /// How long the run may wait in `requires_action` for tool outputs or approvals, in ms:
    /// 1000 to 604800000 (7 days); default the preset's, else the server's
    /// `runtime.action_timeout_ms` (600000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1000, maximum = 604_800_000)]
    pub action_timeout_ms: Option<u64>,
    /// A JSON Schema (an object) the run's final answer must match: the model is asked for
    /// JSON in that shape in its provider's native form, the answer is validated, an invalid
    /// one gets the server's `runtime.output_corrections` corrective turns (default 1), then
    /// the run fails with `error_class` `output_invalid`. The parsed answer is the output's
    /// `parsed` and `run_completed`'s. Checked like a tool's `parameters` (at most 10000
    /// subschemas, every `$ref` resolving inside it, no `$ref` cycle): 422 `invalid_field`
    /// naming `output_schema`. Default: the preset's; absent: free text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub output_schema: Option<serde_json::Value>,
    /// Where to POST the run record, signed (Standard Webhooks: `webhook-id`,
    /// `webhook-timestamp`, `webhook-signature`), when the run ends (`run.completed`,
    /// `run.failed`, `run.cancelled`) or starts waiting in `requires_action`
    /// (`run.requires_action`); delivered at least once, retried with backoff. Absent: the
    /// preset's, else the server's `[webhooks] url`; `null`: none at all, not even those (a
    /// health probe, a test run), and the run shows no `webhook`. Needs `[webhooks] secret` on
    /// the server (else 422 `webhooks_disabled`); a URL not allowed is 422 `invalid_webhook`.
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = Option<super::Webhook>)]
    pub webhook: Option<Option<super::Webhook>>,
}

/// Bounds of `action_timeout_ms`, in ms: one second to seven days.
pub const ACTION_TIMEOUT_MS: std::ops::RangeInclusive<u64> = 1_000..=604_800_000;

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

fn invalid(field: &'static str, reason: impl Into<String>) -> RequestProblem {
    RequestProblem::Invalid {
        field,
        reason: reason.into(),
    }
}

const NUL: &str = "must not contain the NUL character (U+0000)";

/// Checks a JSON object field: an object, no U+0000 in keys or strings, at most
/// [`METADATA_MAX_BYTES`] serialized.
fn check_object(field: &'static str, value: &serde_json::Value) -> Result<(), RequestProblem> {
    if !value.is_object() {
        return Err(invalid(field, "must be a JSON object"));
    }
    if has_nul(value) {
        return Err(invalid(
            field,
            "keys and strings must not contain the NUL character (U+0000)",
        ));
    }
    let size = serde_json::to_vec(value).map_or(usize::MAX, |bytes| bytes.len());
    if size > METADATA_MAX_BYTES {
        return Err(invalid(
            field,
            format!("is {size} bytes serialized; at most {METADATA_MAX_BYTES} are accepted"),
        ));
    }
    Ok(())
}

/// The rule of an idempotency key (`client_request_id`, `Idempotency-Key`), in words.
pub const IDEMPOTENCY_KEY_RULE: &str = "must be 1 to 255 visible ASCII characters (`!` to `~`: \
                                        no spaces, tabs, control or non-ASCII characters)";

/// Whether `key` is a valid idempotency key: 1 to 255 bytes, each visible ASCII (`!` to `~`).
/// A key is stored with its run and echoed on every list page: it stays short and printable.
#[must_use]
pub fn is_idempotency_key(key: &str) -> bool {
    (1..=255).contains(&key.len()) && key.bytes().all(|b| (b'!'..=b'~').contains(&b))
}

/// Whether `text` is not empty but holds only whitespace (an empty `instructions` means none;
/// a blank one is a mistake).
fn is_blank(text: &str) -> bool {
    !text.is_empty() && text.trim().is_empty()
}

impl CreateRunRequest {
    /// Checks what the request must satisfy by itself: `input` present and not blank, the
    /// strings given non-empty where required and without U+0000 (PostgreSQL cannot store it),
    /// `metadata` and `provider_options` objects of at most [`METADATA_MAX_BYTES`],
    /// `max_iterations` within `1..=cap`, the model parameters in range, the tools well formed,
    /// `action_timeout_ms` within [`ACTION_TIMEOUT_MS`]. Whether `provider` and `model` are
    /// present is checked once the preset and the session are merged in.
    ///
    /// # Errors
    /// The first [`RequestProblem`] found, in field order.
    pub fn check(&self, max_iterations_cap: u32) -> Result<(), RequestProblem> {
        let Some(input) = &self.input else {
            return Err(RequestProblem::Missing("input"));
        };
        let named = [
            ("provider", self.provider.as_deref()),
            ("model", self.model.as_deref()),
            ("agent", self.agent.as_deref()),
        ];
        for (field, value) in named {
            let Some(value) = value else { continue };
            if value.is_empty() {
                return Err(invalid(field, "must not be empty"));
            }
            if value.contains('\0') {
                return Err(invalid(field, NUL));
            }
        }
        check_input(input)?;
        let optional = [
            ("session_id", self.session_id.as_deref()),
            ("client_request_id", self.client_request_id.as_deref()),
            ("instructions", self.instructions.as_deref()),
        ];
        for (field, value) in optional {
            if value.is_some_and(|s| s.contains('\0')) {
                return Err(invalid(field, NUL));
            }
        }
        if let Some(key) = &self.client_request_id
            && !is_idempotency_key(key)
        {
            return Err(invalid("client_request_id", IDEMPOTENCY_KEY_RULE));
        }
        if self.instructions.as_deref().is_some_and(is_blank) {
            return Err(invalid(
                "instructions",
                "must contain a non-whitespace character (or be empty for none)",
            ));
        }
        if let Some(ToolChoice::Tool { name }) = &self.tool_choice
            && name.contains('\0')
        {
            return Err(invalid("tool_choice", NUL));
        }
        if let Some(tools) = &self.tools {
            check_tools(tools)?;
        }
        if self
            .approval
            .iter()
            .flatten()
            .any(|name| name.contains('\0'))
        {
            return Err(invalid("approval", NUL));
        }
        if let Some(metadata) = &self.metadata {
            check_object("metadata", metadata)?;
        }
        if let Some(options) = &self.provider_options {
            check_object("provider_options", options)?;
        }
        if let Some(schema) = &self.output_schema {
            if !schema.is_object() {
                return Err(invalid("output_schema", "must be a JSON Schema object"));
            }
            if has_nul(schema) {
                return Err(invalid(
                    "output_schema",
                    "keys and strings must not contain the NUL character (U+0000)",
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
        self.parameters().check()?;
        if let Some(Some(webhook)) = &self.webhook {
            let url = &webhook.url;
            // The shape is checked here like every field's (`invalid_field`); whether the
            // server may post to it, at admission (`invalid_webhook`). A URL parser would
            // quietly strip surrounding spaces and control characters: refused instead.
            if url.len() > super::WEBHOOK_URL_MAX_BYTES
                || url.chars().any(char::is_control)
                || url.trim() != url
                || url.is_empty()
            {
                return Err(invalid(
                    "webhook.url",
                    "must be an http(s) URL of at most 2048 bytes, without control characters \
                     or surrounding spaces",
                ));
            }
        }
        if let Some(timeout) = self.action_timeout_ms
            && !ACTION_TIMEOUT_MS.contains(&timeout)
        {
            return Err(invalid(
                "action_timeout_ms",
                "must be between 1000 (one second) and 604800000 (seven days)",
            ));
        }
        Ok(())
    }

    /// The model parameters this request sets.
    #[must_use]
    pub fn parameters(&self) -> ModelParameters {
        ModelParameters {
            temperature: self.temperature,
            top_p: self.top_p,
            max_output_tokens: self.max_output_tokens,
            stop: self.stop.clone(),
            seed: self.seed,
            parallel_tool_calls: self.parallel_tool_calls,
        }
    }

    /// Sets the model parameters (each field of `parameters`).
    pub fn set_parameters(&mut self, parameters: ModelParameters) {
        self.temperature = parameters.temperature;
        self.top_p = parameters.top_p;
        self.max_output_tokens = parameters.max_output_tokens;
        self.stop = parameters.stop;
        self.seed = parameters.seed;
        self.parallel_tool_calls = parameters.parallel_tool_calls;
    }

    /// The body's fields, in order.
    pub const FIELDS: [&'static str; 22] = [
        "session_id",
        "provider",
        "model",
        "input",
        "metadata",
        "tool_choice",
        "client_request_id",
        "tools",
        "max_iterations",
        "agent",
        "instructions",
        "temperature",
        "top_p",
        "max_output_tokens",
        "stop",
        "seed",
        "parallel_tool_calls",
        "provider_options",
        "approval",
        "action_timeout_ms",
        "output_schema",
        "webhook",
    ];

    /// What a top-level field of the body must be, in words, for an error that replaces
    /// serde's message (which would name Rust types).
    #[must_use]
    pub fn expectation(field: &str) -> Option<&'static str> {
        Some(match field {
            "session_id" => "must be a session id (a UUID string)",
            "provider" | "model" | "client_request_id" | "agent" | "instructions" => {
                "must be a string"
            }
            "input" => {
                "must be a string or an array of content parts ({\"type\": \"text\", \"text\"}, \
                 {\"type\": \"image\", \"media_type\", \"data\"} or {\"type\": \"image\", \"url\"})"
            }
            "metadata" | "provider_options" | "output_schema" => "must be a JSON object",
            "tool_choice" => {
                "must be \"auto\", \"none\", \"required\" or an object {\"name\": \"<tool>\"}"
            }
            "tools" => {
                "must be an array of server tool names (strings) and tool definitions \
                 ({\"name\", \"description\", \"parameters\"}, no other keys)"
            }
            "max_iterations" | "max_output_tokens" => "must be a positive integer",
            "temperature" | "top_p" => "must be a number",
            "stop" | "approval" => "must be an array of strings",
            "seed" => "must be an integer (64-bit)",
            "parallel_tool_calls" => "must be true or false",
            "action_timeout_ms" => "must be a positive integer (ms)",
            "webhook" => "must be an object {\"url\": \"https://…\"} or null (no webhook)",
            _ => return None,
        })
    }
}

/// Checks a run's `input` by itself (an image's base64 is decoded by the runtime, which
/// also knows whether the model takes images).
fn check_input(input: &RunInput) -> Result<(), RequestProblem> {
    let parts = match input {
        RunInput::Text(text) => {
            if text.is_empty() {
                return Err(invalid("input", "must not be empty"));
            }
            if text.contains('\0') {
                return Err(invalid("input", NUL));
            }
            if text.trim().is_empty() {
                return Err(invalid("input", "must contain a non-whitespace character"));
            }
            return Ok(());
        }
        RunInput::Parts(parts) => parts,
    };
    if parts.is_empty() {
        return Err(invalid("input", "must have at least one content part"));
    }
    if parts.len() > MAX_INPUT_PARTS {
        return Err(invalid(
            "input",
            format!(
                "has {} parts; at most {MAX_INPUT_PARTS} are accepted",
                parts.len()
            ),
        ));
    }
    for (index, part) in parts.iter().enumerate() {
        match part {
            InputPart::Text { text } => {
                if text.trim().is_empty() {
                    return Err(invalid(
                        "input",
                        format!("input[{index}].text must contain a non-whitespace character"),
                    ));
                }
                if text.contains('\0') {
                    return Err(invalid("input", format!("input[{index}].text {NUL}")));
                }
            }
            InputPart::Image {
                media_type,
                data,
                url,
            } => match (data, url) {
                (Some(_), None) => {
                    let known = media_type
                        .as_deref()
                        .is_some_and(|media_type| IMAGE_MEDIA_TYPES.contains(&media_type));
                    if !known {
                        return Err(invalid(
                            "input",
                            format!(
                                "input[{index}].media_type must be one of {} with `data`",
                                IMAGE_MEDIA_TYPES.join(", ")
                            ),
                        ));
                    }
                }
                (None, Some(url)) => {
                    let scheme = url.starts_with("https://") || url.starts_with("http://");
                    if !scheme || url.len() > MAX_IMAGE_URL_BYTES || url.contains('\0') {
                        return Err(invalid(
                            "input",
                            format!(
                                "input[{index}].url must be an http(s) URL of at most \
                                 {MAX_IMAGE_URL_BYTES} bytes"
                            ),
                        ));
                    }
                    if media_type
                        .as_deref()
                        .is_some_and(|media_type| !IMAGE_MEDIA_TYPES.contains(&media_type))
                    {
                        return Err(invalid(
                            "input",
                            format!(
                                "input[{index}].media_type must be one of {}",
                                IMAGE_MEDIA_TYPES.join(", ")
                            ),
                        ));
                    }
                }
                _ => {
                    return Err(invalid(
                        "input",
                        format!(
                            "input[{index}]: an image has either `data` (with `media_type`) or \
                             `url`, not both"
                        ),
                    ));
                }
            },
        }
    }
    Ok(())
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
    /// Last run started in it, or last change (RFC 3339, UTC).
    pub updated_at: DateTime<Utc>,
    /// A title for people; absent until set (`PATCH /sessions/{session_id}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// The client's JSON object (at most 16384 bytes serialized), stored and returned
    /// unchanged; `{}` when none was given.
    #[schema(value_type = Object)]
    pub metadata: serde_json::Value,
    /// What its runs default to when they do not say: as created (`POST /sessions`), filled in
    /// by its first run with that run's agent, provider, model and instructions.
    pub defaults: SessionDefaults,
    /// The id a client chose for this conversation (a `useChat` chat id, an AG-UI
    /// `threadId`): 1 to 255 characters of `A-Z a-z 0-9 - _ . : ~` (not `.` or `..`), unique
    /// among sessions; absent when none was given. `POST /chat` and `POST /ag-ui` find the
    /// session by it and create one with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_length = 255, pattern = r"^[A-Za-z0-9_.:~-]{1,255}$")]
    pub external_id: Option<String>,
}

/// Most characters of a session's `external_id`.
pub const EXTERNAL_ID_MAX_LEN: usize = 255;

/// What a session's `external_id` must be, in words (for problem details).
pub const EXTERNAL_ID_RULE: &str =
    "must be 1 to 255 characters of A-Z a-z 0-9 - _ . : ~ (not `.` or `..`)";

/// Whether `id` may be a session's `external_id`: 1 to [`EXTERNAL_ID_MAX_LEN`] characters of
/// `A-Z a-z 0-9 - _ . : ~`, not `.` or `..` (which the AI SDK refuses as chat ids and a URL
/// path would resolve). A `useChat` id (16-character nanoid) and a uuid pass.
#[must_use]
pub fn is_external_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= EXTERNAL_ID_MAX_LEN
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':' | b'~'))
}

impl RunRecord {
    /// The definition stored with the run (what [`RunDefinition`] holds of the record).
    #[must_use]
    pub fn definition(&self) -> RunDefinition {
        RunDefinition {
            instructions: self.instructions.clone(),
            parameters: self.parameters.clone(),
            provider_options: self.provider_options.clone(),
            approval: self.approval.clone(),
            tool_timeout_ms: self.tool_timeout_ms,
            action_timeout_ms: self.action_timeout_ms,
            doom_loop: self.doom_loop.clone(),
            output_schema: self.output_schema.clone(),
            webhook: self.webhook.clone(),
        }
    }

    /// The server tools the run may call by name; `None`: every configured one.
    #[must_use]
    pub fn server_tools(&self) -> Option<Vec<String>> {
        server_tools(self.tools.as_deref())
    }

    /// The tools the run defined for the client to execute.
    #[must_use]
    pub fn client_tools(&self) -> Vec<&super::agent::ToolDefinition> {
        client_tools(self.tools.as_deref())
    }
}

/// The server tools a run with `tools` may call by name; `None`: every configured one.
#[must_use]
pub fn server_tools(tools: Option<&[RunTool]>) -> Option<Vec<String>> {
    tools.map(|tools| {
        tools
            .iter()
            .filter_map(|tool| match tool {
                RunTool::Server(name) => Some(name.clone()),
                RunTool::Client(_) => None,
            })
            .collect()
    })
}

/// The tools among `tools` that the client executes.
#[must_use]
pub fn client_tools(tools: Option<&[RunTool]>) -> Vec<&super::agent::ToolDefinition> {
    tools
        .into_iter()
        .flatten()
        .filter_map(|tool| match tool {
            RunTool::Client(definition) => Some(definition),
            RunTool::Server(_) => None,
        })
        .collect()
}

/// Body of `POST /sessions`: a JSON object, every field optional.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSessionRequest {
    /// A title for people (at most 1000 bytes, no U+0000).
    #[serde(default)]
    #[schema(max_length = 1000, pattern = r"^[^\u0000]*$")]
    pub title: Option<String>,
    /// Any JSON object of at most 16384 bytes serialized; default `{}`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Value>,
    /// What the session's runs default to: agent, provider, model, instructions, parameters
    /// (checked as a run's would be).
    #[serde(default)]
    pub defaults: Option<SessionDefaults>,
    /// The id the client chose for this conversation (see [`Session::external_id`]): 1 to
    /// 255 characters of `A-Z a-z 0-9 - _ . : ~`, not `.` or `..`; one no other session has
    /// (else 409 `external_id_taken`).
    #[serde(default)]
    #[schema(max_length = 255, pattern = r"^[A-Za-z0-9_.:~-]{1,255}$")]
    pub external_id: Option<String>,
}

/// Body of `PATCH /sessions/{session_id}`: the fields given replace the session's; absent
/// ones stay. `"title": null` clears the title.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateSessionRequest {
    /// A new title (at most 1000 bytes, no U+0000); `null` removes it.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<String>, max_length = 1000, pattern = r"^[^\u0000]*$")]
    pub title: Option<Option<String>>,
    /// A new metadata object (replaces the old one whole; at most 16384 bytes serialized).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Value>,
}

/// Most bytes of a session's title.
pub const TITLE_MAX_BYTES: usize = 1000;

impl CreateSessionRequest {
    /// Checks `title` and `metadata` (see [`check_session_fields`]) and the defaults'
    /// parameters and strings.
    ///
    /// # Errors
    /// The first [`RequestProblem`] found.
    pub fn check(&self) -> Result<(), RequestProblem> {
        check_session_fields(self.title.as_deref(), self.metadata.as_ref())?;
        if let Some(id) = &self.external_id
            && !is_external_id(id)
        {
            return Err(invalid("external_id", EXTERNAL_ID_RULE));
        }
        if let Some(defaults) = &self.defaults {
            let named = [
                ("defaults", defaults.agent.as_deref()),
                ("defaults", defaults.provider.as_deref()),
                ("defaults", defaults.model.as_deref()),
                ("defaults", defaults.instructions.as_deref()),
            ];
            for (field, value) in named {
                if value.is_some_and(|s| s.contains('\0')) {
                    return Err(invalid(field, NUL));
                }
            }
            if defaults.instructions.as_deref().is_some_and(is_blank) {
                return Err(invalid(
                    "defaults",
                    "instructions: must contain a non-whitespace character (or be empty for none)",
                ));
            }
            defaults
                .parameters
                .check()
                .map_err(|problem| match problem {
                    RequestProblem::Invalid { reason, field } => {
                        invalid("defaults", format!("parameters.{field}: {reason}"))
                    }
                    missing @ RequestProblem::Missing(_) => missing,
                })?;
        }
        Ok(())
    }
}

impl UpdateSessionRequest {
    /// Checks `title` and `metadata` (see [`check_session_fields`]).
    ///
    /// # Errors
    /// The first [`RequestProblem`] found.
    pub fn check(&self) -> Result<(), RequestProblem> {
        check_session_fields(
            self.title.clone().flatten().as_deref(),
            self.metadata.as_ref(),
        )
    }
}

/// A session's `title` has at most [`TITLE_MAX_BYTES`] and no U+0000; its `metadata` is an
/// object as a run's.
fn check_session_fields(
    title: Option<&str>,
    metadata: Option<&serde_json::Value>,
) -> Result<(), RequestProblem> {
    if let Some(title) = title {
        if title.len() > TITLE_MAX_BYTES {
            return Err(invalid(
                "title",
                format!("is at most {TITLE_MAX_BYTES} bytes"),
            ));
        }
        if title.contains('\0') {
            return Err(invalid("title", NUL));
        }
    }
    if let Some(metadata) = metadata {
        check_object("metadata", metadata)?;
    }
    Ok(())
}

/// Distinguishes a field given as `null` (`Some(None)`) from an absent one (`None`, with
/// `#[serde(default)]`).
fn present<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}
