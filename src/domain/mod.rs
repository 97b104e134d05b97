//! Domain types of the contract: ids, runs, sessions, messages, usage, tool calls and
//! compaction.
//!
//! They come from the seeds (`agent.v1` proto and its `common.proto` as DESIGN.md restates it)
//! and depend on nothing but serde, chrono, uuid and utoipa.

mod agent;
mod compaction;
mod error_class;
mod ids;
mod input;
mod message;
mod run;
mod snapshot;
mod webhook;

pub use agent::{
    ActionAnswer, DoomLoopSettings, MAX_STOP_SEQUENCES, ModelParameters, PendingKind,
    PendingToolCall, RequiredAction, RunDefinition, RunTool, SessionDefaults, ToolDefinition,
    check_tools, is_tool_name,
};
pub use compaction::{
    CircuitBreaker, Compaction, CompactionConfig, CompactionTrigger, MAX_BREAKER_THRESHOLD,
    MAX_TAIL_TURNS, ModelWindow, SettingsProblem,
};
pub use error_class::ErrorClass;
pub use ids::{CompactionId, MessageId, RunId, SessionId};
pub use input::{
    IMAGE_MEDIA_TYPES, InputPart, MAX_IMAGE_BYTES, MAX_IMAGE_URL_BYTES, MAX_INPUT_PARTS, RunInput,
};
pub use message::{ContentPart, Message, MessageStatus, Reasoning, Role, ToolCall};
pub use run::{
    ACTION_TIMEOUT_MS, CreateRunRequest, CreateRunResponse, CreateSessionRequest,
    DEFAULT_MAX_ITERATIONS_CAP, EXTERNAL_ID_RULE, FinishReason, IDEMPOTENCY_KEY_RULE,
    METADATA_MAX_BYTES, RequestProblem, RunEnd, RunOutput, RunRecord, RunStatus, Session,
    TITLE_MAX_BYTES, TokenUsage, ToolChoice, ToolChoiceMode, ToolChoiceTool, UpdateSessionRequest,
    client_tools, is_external_id, is_idempotency_key, server_tools,
};
pub use snapshot::Snapshot;
pub use webhook::{
    ClaimedDelivery, WEBHOOK_URL_MAX_BYTES, Webhook, WebhookAttempt, WebhookAttemptOutcome,
    WebhookClaim, WebhookDelivery, WebhookDeliveryStatus, WebhookEventType,
};
