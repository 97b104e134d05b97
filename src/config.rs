//! Configuration: defaults, then an optional TOML file, then `BEHEST_*` environment variables
//! (nested keys with `__`), then command-line flags. Unknown keys and bad values stop startup
//! with a message naming them; secrets are read from the environment and never printed.

use std::collections::BTreeMap;
use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use secrecy::SecretString;
use serde::{Deserialize, Serialize};

use crate::domain::{CompactionConfig, ModelWindow};
mod database;
mod http;
mod ops;
mod webhooks;
pub use database::DatabaseConfig;
pub use http::HttpConfig;
pub use ops::{ApiKeys, AuthConfig, KeyHash, LimitsConfig, TelemetryConfig};
pub use webhooks::{WebhookSecret, WebhooksConfig};

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address to listen on (`--bind`, `BEHEST_BIND`); default `127.0.0.1:8080`.
    pub bind: String,
    /// `sqlite://PATH` (default `sqlite://behest.db`, created when missing) or `postgres://…`
    /// (`--database-url`, `BEHEST_DATABASE_URL`).
    pub database_url: String,
    /// `[database]`: the pool's size and PostgreSQL's per-connection time limits.
    pub database: DatabaseConfig,
    /// Limits and buffers of the run loop and the event log.
    pub runtime: RuntimeConfig,
    /// Model providers by id (`[providers.<id>]`).
    pub providers: BTreeMap<String, ProviderConfig>,
    /// MCP servers whose tools runs may call, by id (`[mcp_servers.<id>]`).
    pub mcp_servers: BTreeMap<String, McpServerConfig>,
    /// HTTP tools by tool name (`[http_tools.<name>]`).
    pub http_tools: BTreeMap<String, HttpToolConfig>,
    /// Built-in tools to offer, by name (`builtin_tools = ["current_time"]`); see
    /// `tools::builtin`. Default none (the no-config demo adds `current_time`).
    pub builtin_tools: Vec<String>,
    /// Agent presets by name (`[agents.<name>]`): what `POST /runs {"agent": "<name>"}` runs.
    pub agents: BTreeMap<String, AgentPreset>,
    /// `[compaction]`: the initial compaction settings (the seed's defaults when absent). Once
    /// changed through `/compaction`, the stored settings win over these.
    pub compaction: CompactionConfig,
    /// Bearer API keys (`[auth]`).
    pub auth: AuthConfig,
    /// CORS and per-client limits (`[limits]`).
    pub limits: LimitsConfig,
    /// Metrics and trace export (`[telemetry]`).
    pub telemetry: TelemetryConfig,
    /// Client connections: header, body and keep-alive timeouts and their cap (`[http]`).
    pub http: HttpConfig,
    /// Webhooks: the signing secret, allowed hosts, the default URL, the retry schedule
    /// (`[webhooks]`).
    pub webhooks: WebhooksConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            bind: "127.0.0.1:8080".to_owned(),
            database_url: "sqlite://behest.db".to_owned(),
            database: DatabaseConfig::default(),
            runtime: RuntimeConfig::default(),
            providers: BTreeMap::new(),
            mcp_servers: BTreeMap::new(),
            http_tools: BTreeMap::new(),
            builtin_tools: Vec::new(),
            agents: BTreeMap::new(),
            compaction: CompactionConfig::default(),
            auth: AuthConfig::default(),
            limits: LimitsConfig::default(),
            telemetry: TelemetryConfig::default(),
            http: HttpConfig::default(),
            webhooks: WebhooksConfig::default(),
        }
    }
}

/// `[agents.<name>]`: a named agent a run can start from (`"agent": "<name>"`); every field a
/// run's request gives overrides the preset's. Checked at startup against the providers,
/// models and tools (the same checks as a run's request).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentPreset {
    /// What the agent is for, for people (`GET /agents`).
    #[serde(default)]
    pub description: String,
    /// Provider id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Model name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The system prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// Model parameters (`[agents.<name>.parameters]`: `temperature`, `top_p`,
    /// `max_output_tokens`, `stop`, `seed`, `parallel_tool_calls`).
    #[serde(default)]
    pub parameters: crate::domain::ModelParameters,
    /// Passed through into the provider request body (as a run's `provider_options`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_options: Option<serde_json::Map<String, serde_json::Value>>,
    /// The tools: server tool names and tool definitions the client executes; absent: every
    /// server tool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<crate::domain::RunTool>>,
    /// Server tools whose calls wait for approval.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approval: Vec<String>,
    /// Model calls per run at most (up to `runtime.max_iterations_cap`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_iterations: Option<u32>,
    /// Time one tool call may take, in ms (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_timeout_ms: Option<u64>,
    /// How long a run may wait in `requires_action`, in ms (1000 to 604800000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action_timeout_ms: Option<u64>,
    /// Doom-loop settings; each one given replaces the server's `[runtime.doom_loop]` one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub doom_loop: Option<DoomLoopOverride>,
    /// The JSON Schema the final answer of the preset's runs must match (a run's
    /// `output_schema`, which replaces it); checked at startup like a run's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<serde_json::Value>,
    /// The webhook of the preset's runs (`[agents.<name>.webhook] url = "https://…"`): a run's
    /// own `webhook` replaces it; it replaces the server's `[webhooks] url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<crate::domain::Webhook>,
}

/// `[agents.<name>.doom_loop]`: the settings a preset changes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DoomLoopOverride {
    /// Whether detection is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Repetitions that are a doom loop (at least 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold: Option<u32>,
    /// Tools meant to be polled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow: Option<Vec<String>>,
}

impl DoomLoopOverride {
    /// `base` with the settings given here.
    #[must_use]
    pub fn over(&self, base: &DoomLoopConfig) -> DoomLoopConfig {
        DoomLoopConfig {
            enabled: self.enabled.unwrap_or(base.enabled),
            threshold: self.threshold.unwrap_or(base.threshold),
            allow: self.allow.clone().unwrap_or_else(|| base.allow.clone()),
        }
    }
}

/// `[runtime]`: limits of the run loop and buffers of the event log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// Model calls per run at most; default 25.
    pub max_iterations: u32,
    /// Events buffered per run for live watchers before a slow one falls back to the store;
    /// default 1024.
    pub feed_capacity: usize,
    /// Events written to the store in one transaction at most (group commit); default 256.
    pub max_batch_events: usize,
    /// Interval of SSE keep-alive comments in ms; default 15000.
    pub keep_alive_ms: u64,
    /// Request body limit in bytes; default 1 MiB.
    pub max_body_bytes: usize,
    /// Byte budget of one list page (`GET /runs`, `GET /sessions`): records are added until
    /// their serialized size passes it, then `next_cursor` continues; default 1 MiB.
    pub max_page_bytes: usize,
    /// Highest `max_iterations` a run may ask for; default 100.
    pub max_iterations_cap: u32,
    /// Tool calls per run at most; default 100.
    pub max_tool_calls: u32,
    /// Tool calls of one model turn executed at once at most; default 8.
    pub tool_concurrency: usize,
    /// Time one tool call may take, in ms; default 60000.
    pub tool_timeout_ms: u64,
    /// Largest tool result kept for the model, in bytes (serialized JSON); larger results are
    /// cut on a UTF-8 boundary with a marker; default 65536.
    pub max_tool_output_bytes: usize,
    /// Least time between two `tool_progress` events of one tool call, in ms: a tool that
    /// reports progress faster has its updates coalesced (the latest wins); 0 logs every update
    /// the log keeps up with; default 250.
    pub tool_progress_interval_ms: u64,
    /// Doom-loop detection.
    pub doom_loop: DoomLoopConfig,
    /// What happens to a run left non-terminal by a process that died (crash, `kill -9`,
    /// a shutdown's drain that ended): `resume` it from its last snapshot (default) or `fail` it
    /// with `run_failed` (error class `interrupted`).
    pub recovery: Recovery,
    /// How long a run's lease lasts, in ms: the owning process renews it every third of this;
    /// another process (a restarted one, later a replica) takes a run over only once its lease
    /// has expired; default 6000 (300 to 86400000).
    pub lease_ttl_ms: u64,
    /// A run taken over this many times in a row from processes that died while executing it,
    /// without committing a message in between, is failed (`run_failed`, error class
    /// `crash_loop`) instead of resumed again; default 3 (1 to 100).
    pub max_takeovers: u32,
    /// How long a shutdown (SIGTERM/SIGINT) waits for active runs to reach their next boundary,
    /// in ms; runs still going are then stopped where they are. Either way they stay resumable;
    /// default 10000 (at most 86400000).
    pub shutdown_grace_ms: u64,
    /// Finished runs' events and snapshots are removed this many seconds after the run ended;
    /// unset (default): kept forever; 1 to 3153600000 (100 years). Runs, sessions and messages
    /// are kept.
    pub event_retention_secs: Option<u64>,
    /// Runs whose events one retention transaction removes at most; default 100.
    pub retention_batch_runs: u32,
    /// How long a run may wait in `requires_action` for tool outputs or approvals, in ms
    /// (a run or preset may set its own); default 600000 (10 minutes), 1000 to 604800000.
    pub action_timeout_ms: u64,
    /// What ends a run whose wait passed its deadline: `fail` (`run_failed`, error class
    /// `action_expired`; the default) or `cancel` (`run_cancelled`).
    pub action_expiry: ActionExpiry,
    /// Runs active in this process at once at most (new and resumed ones count); a create
    /// beyond it is refused with `429 too_many_active_runs` and `Retry-After` (not queued).
    /// Default: unlimited.
    pub max_active_runs: Option<usize>,
    /// Corrective turns a run with an `output_schema` gets when its final answer does not
    /// match: each is a user message with the validation errors (`output_rejected`) and one
    /// more model call; after the last the run fails with error class `output_invalid`.
    /// Default 1 (0 to 5).
    pub output_corrections: u32,
}

/// `[runtime] action_expiry`: how a run whose `requires_action` wait expired ends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionExpiry {
    /// `run_failed` with error class `action_expired` (the default).
    #[default]
    Fail,
    /// `run_cancelled`.
    Cancel,
}

/// `[runtime] recovery`: what becomes of a run whose process died.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Recovery {
    /// Continue it from its last snapshot (the default).
    #[default]
    Resume,
    /// End it with `run_failed` (error class `interrupted`).
    Fail,
}

/// `[runtime.doom_loop]`: when repeated tool calls end a run (also the shape a run record
/// shows).
pub use crate::domain::DoomLoopSettings as DoomLoopConfig;

/// `[mcp_servers.<id>]`: an MCP server, over stdio (a child process) or streamable HTTP.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "transport", rename_all = "snake_case", deny_unknown_fields)]
pub enum McpServerConfig {
    /// A child process speaking MCP on stdin/stdout.
    Stdio {
        /// The program.
        command: String,
        /// Its arguments.
        #[serde(default)]
        args: Vec<String>,
        /// Environment variables set for it. The child does not inherit the server's
        /// environment (which holds provider API keys): it gets `PATH`, `HOME` and the locale
        /// (`LANG`, `LANGUAGE`, `LC_*`), then the variables `inherit_env` names, then these.
        #[serde(default)]
        env: BTreeMap<String, String>,
        /// Variables of the server's environment passed on to the child by name (e.g.
        /// `["GITHUB_TOKEN"]`); default none.
        #[serde(default)]
        inherit_env: Vec<String>,
        /// Its tools that are safe to execute twice (re-executed when a crash cut a call off).
        #[serde(default)]
        idempotent_tools: Vec<String>,
        /// Its tools whose calls wait for a person's approval before they run.
        #[serde(default)]
        requires_approval_tools: Vec<String>,
    },
    /// A streamable-HTTP MCP endpoint.
    Http {
        /// The endpoint URL.
        url: String,
        /// Extra request headers (e.g. `Authorization`).
        #[serde(default)]
        headers: BTreeMap<String, String>,
        /// Its tools that are safe to execute twice (re-executed when a crash cut a call off).
        #[serde(default)]
        idempotent_tools: Vec<String>,
        /// Its tools whose calls wait for a person's approval before they run.
        #[serde(default)]
        requires_approval_tools: Vec<String>,
    },
}

/// `[http_tools.<name>]`: a tool whose arguments are POSTed as JSON to `url`; the JSON response
/// is the result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpToolConfig {
    /// What the tool does, for the model.
    pub description: String,
    /// Where the arguments are POSTed.
    pub url: String,
    /// JSON Schema of the arguments (an object schema).
    #[serde(default = "empty_object_schema")]
    pub parameters: serde_json::Value,
    /// Extra request headers.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Safe to execute twice: a call cut off by a crash is executed again when the run resumes
    /// (otherwise it gets an "interrupted, outcome unknown" result); default false.
    #[serde(default)]
    pub idempotent: bool,
    /// Each call waits for a person's approval (`POST /runs/{run_id}/approvals`) before it
    /// runs; default false.
    #[serde(default)]
    pub requires_approval: bool,
}

fn empty_object_schema() -> serde_json::Value {
    serde_json::json!({"type": "object", "properties": {}})
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            max_iterations: 25,
            feed_capacity: 1024,
            max_batch_events: 256,
            keep_alive_ms: 15_000,
            max_body_bytes: 1 << 20,
            max_page_bytes: 1 << 20,
            max_iterations_cap: crate::domain::DEFAULT_MAX_ITERATIONS_CAP,
            max_tool_calls: 100,
            tool_concurrency: 8,
            tool_timeout_ms: 60_000,
            max_tool_output_bytes: 65_536,
            tool_progress_interval_ms: 250,
            doom_loop: DoomLoopConfig::default(),
            recovery: Recovery::Resume,
            lease_ttl_ms: 6_000,
            max_takeovers: 3,
            shutdown_grace_ms: 10_000,
            event_retention_secs: None,
            retention_batch_runs: 100,
            action_timeout_ms: 600_000,
            action_expiry: ActionExpiry::Fail,
            max_active_runs: None,
            output_corrections: 1,
        }
    }
}

/// The wire format a provider speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderKind {
    /// OpenAI Chat Completions (and compatible servers: vLLM, Ollama, llama.cpp, …).
    Openai,
    /// Anthropic Messages API (`base_url` e.g. `https://api.anthropic.com/v1`).
    Anthropic,
    /// behest's built-in model: no network, a deterministic paced reply (see
    /// `provider::scripted`); no `base_url`.
    Scripted,
}

/// `[providers.<id>]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    /// Wire format.
    pub kind: ProviderKind,
    /// API base URL, e.g. `https://api.openai.com/v1` (none for `kind = "scripted"`).
    #[serde(default)]
    pub base_url: String,
    /// Name of the environment variable holding the API key; none for servers without auth.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Timeouts of each model call (each attempt when retried).
    #[serde(default)]
    pub timeouts: TimeoutConfig,
    /// Retries of failed model calls.
    #[serde(default)]
    pub retry: RetryConfig,
    /// Models runs may use, by name.
    pub models: BTreeMap<String, ModelConfig>,
    /// `kind = "openai"`: the request field carrying `max_output_tokens`. Default (absent):
    /// `max_completion_tokens` when the base URL's host is `api.openai.com` (OpenAI requires it
    /// for reasoning models), else `max_tokens` (llama.cpp's server ignores
    /// `max_completion_tokens`; vLLM, Ollama and LM Studio read `max_tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens_field: Option<MaxTokensField>,
    /// `kind = "openai"`: the `content` of an assistant message that has tool calls and no
    /// text. Default (absent): `null` (OpenAI's own format) when the base URL's host is
    /// `api.openai.com`, else `""`, which every compatible server accepts (`llama-cpp-python`'s
    /// server answers `500` to `null`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assistant_tool_call_content: Option<AssistantToolCallContent>,
    /// `kind = "openai"`: which assistant messages carry their reasoning back as
    /// `reasoning_content`; default `none`.
    #[serde(default)]
    pub reasoning_replay: ReasoningReplay,
    /// `kind = "openai"`: the role of the message carrying a run's instructions: `system`
    /// (default; what every compatible server reads) or `developer` (OpenAI's name for it with
    /// its reasoning models).
    #[serde(default)]
    pub instructions_role: InstructionsRole,
    /// `kind = "openai"`: how a run's `tool_choice` naming one tool is sent: `required`
    /// (default: `"tool_choice": "required"` when that tool is the only one the request
    /// offers, which means the same to OpenAI and is the only forcing form llama.cpp's
    /// `llama-server` reads; the named object otherwise) or `named` (always the named object,
    /// for `llama-cpp-python`'s server, which forces a call only for it and ignores
    /// `"required"`).
    #[serde(default)]
    pub forced_tool_choice: ForcedToolChoice,
    /// `kind = "openai"`: `reasoning_effort` sent with every request (`low`, `medium`, `high`);
    /// absent: not sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_effort: Option<ReasoningEffort>,
    /// `kind = "anthropic"`: turns extended thinking on with this budget in tokens
    /// (`"thinking": {"type": "enabled", "budget_tokens": N}`); at least 1024 and below every
    /// model's `max_output_tokens` (checked at startup); absent: thinking off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking_budget_tokens: Option<u32>,
    /// How a run's `output_schema` reaches the model: `native` (default: OpenAI-compatible
    /// `response_format` `json_schema`, Anthropic `output_config.format`, the built-in model
    /// answers with a minimal valid instance) or `prompt` (for servers with neither: the
    /// schema is appended to the run's instructions). Either way the answer is validated.
    #[serde(default)]
    pub structured_output: StructuredOutputMode,
    /// `kind = "scripted"` only: pause before each streamed token, in ms; default 30.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_delay_ms: Option<u64>,
    /// `kind = "scripted"` only: a JSON or TOML file of turns to replay instead of the
    /// built-in replies (format in `provider::scripted`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub script: Option<std::path::PathBuf>,
    /// The API key, read from `api_key_env` at load time; never serialized or printed.
    #[serde(skip)]
    pub api_key: Option<Secret>,
}

/// `max_tokens_field`: the Chat Completions field that carries the output limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MaxTokensField {
    /// `max_tokens` (llama.cpp, vLLM, Ollama, LM Studio; deprecated by OpenAI).
    MaxTokens,
    /// `max_completion_tokens` (OpenAI; required for its reasoning models).
    MaxCompletionTokens,
}

/// `assistant_tool_call_content`: how an assistant message with tool calls and no text
/// carries its `content` (some compatible servers reject `null`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AssistantToolCallContent {
    /// `"content": null` (OpenAI's documented format).
    Null,
    /// `"content": ""`.
    Empty,
    /// No `content` key.
    Omit,
}

/// `reasoning_replay`: which assistant messages send their reasoning back as
/// `reasoning_content` (DeepSeek thinking mode requires it for the assistant messages of a
/// user turn that made tool calls, in every later request, and answers 400 otherwise; its
/// older `deepseek-reasoner` rejected it anywhere, and OpenAI does not know the field).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningReplay {
    /// Never sent.
    #[default]
    None,
    /// Sent on the assistant messages between two user messages when one of them has tool
    /// calls (what DeepSeek requires).
    ToolTurns,
    /// Sent on every assistant message that has reasoning.
    All,
}

/// `structured_output`: how a provider is asked for an answer in a run's `output_schema`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StructuredOutputMode {
    /// The wire format's own field (OpenAI-compatible `response_format`, Anthropic
    /// `output_config.format`).
    #[default]
    Native,
    /// The schema, in words, appended to the run's instructions; nothing else is sent.
    Prompt,
}

/// `forced_tool_choice`: the Chat Completions form of a `tool_choice` that names one tool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ForcedToolChoice {
    /// `"required"` when the named tool is the only one offered, else
    /// `{"type": "function", "function": {"name": …}}`.
    #[default]
    Required,
    /// Always `{"type": "function", "function": {"name": …}}`.
    Named,
}

/// `instructions_role`: the Chat Completions role that carries the instructions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InstructionsRole {
    /// `{"role": "system"}`.
    #[default]
    System,
    /// `{"role": "developer"}`.
    Developer,
}

impl InstructionsRole {
    /// The wire value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::Developer => "developer",
        }
    }
}

/// `reasoning_effort` of OpenAI-compatible reasoning models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningEffort {
    /// `"low"`.
    Low,
    /// `"medium"`.
    Medium,
    /// `"high"`.
    High,
}

impl ReasoningEffort {
    /// The wire value.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Low => "low",
            Self::Medium => "medium",
            Self::High => "high",
        }
    }
}

/// A secret that prints as `[redacted]`.
#[derive(Clone)]
pub struct Secret(pub SecretString);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}

impl PartialEq for Secret {
    fn eq(&self, _: &Self) -> bool {
        // Secrets are never compared; configs are equal when their visible parts are.
        true
    }
}

/// `[providers.<id>.models.<name>]`, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The model's context window in tokens.
    pub context_window: u32,
    /// Most tokens one call may generate.
    pub max_output_tokens: u32,
    /// The model takes no images: a run whose `input` has an image part is refused (422
    /// naming `input`) instead of failing at the provider; default false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub text_only: bool,
}

/// `[providers.<id>.timeouts]`, in ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutConfig {
    /// TCP/TLS connect; default 10000.
    pub connect_ms: u64,
    /// From request sent to the response's first byte; default 60000.
    pub first_byte_ms: u64,
    /// Between two chunks of a stream; default 60000.
    pub idle_ms: u64,
    /// Whole call; default 600000.
    pub total_ms: u64,
}

impl Default for TimeoutConfig {
    fn default() -> Self {
        Self {
            connect_ms: 10_000,
            first_byte_ms: 60_000,
            idle_ms: 60_000,
            total_ms: 600_000,
        }
    }
}

/// `[providers.<id>.retry]`: retries of a model call that failed with a retryable class
/// (`rate_limited`, `overloaded`, `server`, `timeout`, `transport`) before it emitted any
/// output. Delays are exponential: `initial_backoff_ms * 2^(retry - 1)`, at most
/// `max_backoff_ms`, with "equal jitter" (a uniform pick in the upper half) when `jitter` is
/// on. A provider's `retry-after` replaces the computed delay when it is at most
/// `max_retry_after_ms`; a longer one ends the retries (the error is returned at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Attempts per model call, the first included (1: no retries); default 3.
    pub max_attempts: u32,
    /// Delay before the first retry in ms; default 500.
    pub initial_backoff_ms: u64,
    /// Upper bound of a computed delay in ms; default 8000.
    pub max_backoff_ms: u64,
    /// Randomize computed delays (equal jitter); default true.
    pub jitter: bool,
    /// Longest `retry-after` honoured, in ms; default 60000.
    pub max_retry_after_ms: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            initial_backoff_ms: 500,
            max_backoff_ms: 8_000,
            jitter: true,
            max_retry_after_ms: 60_000,
        }
    }
}

/// Flags from the command line, applied last.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Overrides {
    /// `--bind`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bind: Option<String>,
    /// `--database-url`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub database_url: Option<String>,
}

/// Why the configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Unknown key, bad value, unreadable file (figment names the key and its source).
    #[error("invalid configuration: {0}")]
    Invalid(String),
    /// A semantic check failed.
    #[error("invalid configuration: {0}")]
    Check(String),
}

impl ConfigError {
    /// [`ConfigError::from_figment`], naming the configuration file when figment's message
    /// does not (a TOML syntax error says its line, not its file).
    fn from_figment_file(error: figment::Error, file: Option<&Path>) -> Self {
        let (Self::Invalid(message) | Self::Check(message)) = Self::from_figment(error);
        match file {
            Some(path)
                if !message.contains(&path.display().to_string())
                    && !message.contains("environment variable") =>
            {
                Self::Invalid(format!(
                    "{message} (configuration file `{}`)",
                    path.display()
                ))
            }
            _ => Self::Invalid(message),
        }
    }

    /// figment's message, without its profile prefix (`default.`) on key paths, and without
    /// the backticks figment nests around a list of expected keys or values (``expected `one
    /// of `a`, `b``` reads `expected one of `a`, `b``).
    fn from_figment(error: figment::Error) -> Self {
        let mut message = error
            .to_string()
            .replace("key \"default.", "key \"")
            .replace("`default.", "`");
        for error in error {
            if let figment::error::Kind::UnknownField(_, expected)
            | figment::error::Kind::UnknownVariant(_, expected) = error.kind
            {
                let one_of = figment::error::OneOf(expected);
                message = message.replace(
                    &format!("expected `{one_of}`"),
                    &format!("expected {one_of}"),
                );
            }
        }
        Self::Invalid(message)
    }
}

impl Config {
    /// Loads defaults → `file` (must exist when given) → `BEHEST_*` env → `overrides`, then
    /// reads each provider's API key from its `api_key_env`.
    ///
    /// # Errors
    /// [`ConfigError`] naming the bad key, value or missing environment variable.
    pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Self, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(path) = file {
            // A file that cannot be read is named (figment's own message would only say the
            // OS error).
            std::fs::File::open(path).map_err(|error| {
                ConfigError::Invalid(format!(
                    "cannot read the configuration file `{}`: {error}",
                    path.display()
                ))
            })?;
            figment = figment.merge(Toml::file_exact(path));
        }
        let env = Env::prefixed("BEHEST_")
            // BEHEST_CONFIG names the file itself; BEHEST_TEST_* belong to the test suite; a
            // name that is no key of the configuration (a script's own `BEHEST_BIN`) is not
            // ours: `ignored_env_vars` lists those for a warning. The filter sees the name
            // before `split` turns `__` into `.` (figment applies them in order).
            .filter(|key| env_key_is_ours(key.as_str()))
            .split("__");
        let mut config: Config = figment
            .merge(env)
            .merge(Serialized::defaults(overrides))
            .extract()
            .map_err(|error| ConfigError::from_figment_file(error, file))?;
        // figment reads an environment value that looks like a number as one (a key of digits
        // would lose its leading zeros): the keys are read again as the text they are.
        if let Ok(text) = std::env::var("BEHEST_AUTH__KEYS") {
            config.auth.keys = ApiKeys::default();
            config
                .auth
                .keys
                .extend_from(&text)
                .map_err(|message| ConfigError::Check(format!("BEHEST_AUTH__KEYS: {message}")))?;
        }
        config.resolved()
    }

    /// The `BEHEST_*` environment variables [`Config::load`] ignored because their first
    /// key is no key of the configuration (e.g. a user's own `BEHEST_BIN`), by name: worth a
    /// warning, not a failure.
    #[must_use]
    pub fn ignored_env_vars() -> Vec<String> {
        let mut names: Vec<String> = std::env::vars_os()
            .filter_map(|(name, _)| name.into_string().ok())
            .filter(|name| {
                name.get(..7)
                    .is_some_and(|p| p.eq_ignore_ascii_case("BEHEST_"))
                    && !env_key_is_ours(&name[7..])
                    && !name[7..].eq_ignore_ascii_case("config")
                    && !name[7..].to_ascii_lowercase().starts_with("test_")
            })
            .collect();
        names.sort();
        names
    }

    /// Parses a TOML document alone (no env, no flags); for tests and tools.
    ///
    /// ```
    /// let config = behest::config::Config::from_toml("[runtime]\nmax_iterations = 5\n").unwrap();
    /// assert_eq!(config.runtime.max_iterations, 5);
    /// assert_eq!(config.bind, "127.0.0.1:8080");
    /// let error = behest::config::Config::from_toml("bnd = \"0.0.0.0:1\"").unwrap_err();
    /// assert!(error.to_string().contains("bnd"));
    /// ```
    ///
    /// # Errors
    /// As [`Config::load`].
    pub fn from_toml(toml: &str) -> Result<Self, ConfigError> {
        let config: Config = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::string(toml))
            .extract()
            .map_err(ConfigError::from_figment)?;
        config.resolved()
    }

    fn resolved(mut self) -> Result<Self, ConfigError> {
        let runtime = &self.runtime;
        let checks = [
            (
                runtime.max_iterations >= 1,
                "runtime.max_iterations must be at least 1",
            ),
            (
                runtime.max_iterations <= runtime.max_iterations_cap,
                "runtime.max_iterations must not exceed runtime.max_iterations_cap",
            ),
            (
                runtime.keep_alive_ms >= 100,
                "runtime.keep_alive_ms must be at least 100",
            ),
            (
                runtime.max_batch_events >= 1,
                "runtime.max_batch_events must be at least 1",
            ),
            (
                runtime.feed_capacity >= 1,
                "runtime.feed_capacity must be at least 1",
            ),
            (
                runtime.tool_concurrency >= 1,
                "runtime.tool_concurrency must be at least 1",
            ),
            (
                runtime.max_page_bytes >= 1,
                "runtime.max_page_bytes must be at least 1",
            ),
            (
                runtime.tool_timeout_ms >= 1,
                "runtime.tool_timeout_ms must be at least 1",
            ),
            (
                runtime.max_tool_calls >= 1,
                "runtime.max_tool_calls must be at least 1",
            ),
            (
                runtime.max_body_bytes >= 1024,
                "runtime.max_body_bytes must be at least 1024",
            ),
            (
                runtime.doom_loop.threshold >= 2,
                "runtime.doom_loop.threshold must be at least 2",
            ),
            (
                (300..=86_400_000).contains(&runtime.lease_ttl_ms),
                "runtime.lease_ttl_ms must be from 300 to 86400000 (one day)",
            ),
            (
                runtime.output_corrections <= 5,
                "runtime.output_corrections must be from 0 to 5",
            ),
            (
                (1..=100).contains(&runtime.max_takeovers),
                "runtime.max_takeovers must be from 1 to 100",
            ),
            (
                runtime.shutdown_grace_ms <= 86_400_000,
                "runtime.shutdown_grace_ms must be at most 86400000 (one day)",
            ),
            (
                runtime
                    .event_retention_secs
                    .is_none_or(|secs| (1..=3_153_600_000).contains(&secs)),
                "runtime.event_retention_secs must be from 1 to 3153600000 (100 years; leave it \
                 unset to keep events forever)",
            ),
            (
                runtime.retention_batch_runs >= 1,
                "runtime.retention_batch_runs must be at least 1",
            ),
            (
                crate::domain::ACTION_TIMEOUT_MS.contains(&runtime.action_timeout_ms),
                "runtime.action_timeout_ms must be from 1000 to 604800000 (7 days)",
            ),
        ];
        if let Some((_, message)) = checks
            .iter()
            .chain(&self.database.checks())
            .find(|(ok, _)| !ok)
        {
            return Err(ConfigError::Check((*message).to_owned()));
        }
        self.http.check().map_err(ConfigError::Check)?;
        self.webhooks.check().map_err(ConfigError::Check)?;
        if let Some(name) = self
            .agents
            .keys()
            .find(|name| !crate::domain::is_tool_name(name))
        {
            return Err(ConfigError::Check(format!(
                "agents.\"{name}\": an agent name is 1 to 64 letters, digits, `_` or `-`"
            )));
        }
        self.resolve_operations()?;
        for (id, provider) in &mut self.providers {
            if provider.kind != ProviderKind::Scripted
                && !provider.base_url.starts_with("http://")
                && !provider.base_url.starts_with("https://")
            {
                let problem = if provider.base_url.is_empty() {
                    "is required (e.g. \"https://api.openai.com/v1\")"
                } else {
                    "must start with http:// or https://"
                };
                return Err(ConfigError::Check(format!(
                    "providers.{id}.base_url {problem}"
                )));
            }
            if provider.kind != ProviderKind::Scripted
                && (provider.token_delay_ms.is_some() || provider.script.is_some())
            {
                return Err(ConfigError::Check(format!(
                    "providers.{id}: token_delay_ms and script are for kind = \"scripted\" only"
                )));
            }
            let timeouts = provider.timeouts;
            if [
                timeouts.connect_ms,
                timeouts.first_byte_ms,
                timeouts.idle_ms,
                timeouts.total_ms,
            ]
            .contains(&0)
            {
                return Err(ConfigError::Check(format!(
                    "providers.{id}.timeouts must all be at least 1 ms"
                )));
            }
            if provider.retry.max_attempts == 0 {
                return Err(ConfigError::Check(format!(
                    "providers.{id}.retry.max_attempts must be at least 1"
                )));
            }
            if provider.models.is_empty() {
                return Err(ConfigError::Check(format!(
                    "providers.{id}.models must list at least one model"
                )));
            }
            provider_options_check(id, provider)?;
            for (name, model) in &provider.models {
                if model.max_output_tokens >= model.context_window {
                    return Err(ConfigError::Check(format!(
                        "providers.{id}.models.{name}.max_output_tokens ({}) must be below its \
                         context_window ({}): the reply would leave no room for the prompt",
                        model.max_output_tokens, model.context_window
                    )));
                }
            }
            if let Some(var) = &provider.api_key_env {
                let key = std::env::var(var)
                    .ok()
                    .filter(|key| !key.trim().is_empty())
                    .ok_or_else(|| {
                        ConfigError::Check(format!(
                            "providers.{id}.api_key_env names `{var}`, which is not set or empty"
                        ))
                    })?;
                provider.api_key = Some(Secret(SecretString::from(key)));
            }
        }
        // Settings that cannot fit a configured model would never compact its requests
        // before the provider refuses one: refused here, naming the model and the arithmetic.
        self.compaction
            .check_values(&self.model_windows())
            .and_then(|()| self.compaction.check_fit(&self.model_windows()))
            .map_err(|problem| {
                ConfigError::Check(format!("compaction.{} {}", problem.field, problem.reason))
            })?;
        Ok(self)
    }

    /// Every configured model with its window, for checking compaction settings.
    #[must_use]
    pub fn model_windows(&self) -> Vec<ModelWindow<'_>> {
        model_windows(&self.providers)
    }
}

/// The configuration's top-level keys, as `BEHEST_<KEY>` or `BEHEST_<KEY>__…` spell them.
const TOP_LEVEL_KEYS: [&str; 16] = [
    "bind",
    "database_url",
    "database",
    "http",
    "runtime",
    "providers",
    "mcp_servers",
    "http_tools",
    "builtin_tools",
    "agents",
    "compaction",
    "auth",
    "limits",
    "telemetry",
    "webhooks",
    // `BEHEST_CONFIG` names the file; read by the CLI, not a key.
    "config",
];

/// Whether the environment key after `BEHEST_` (`RUNTIME__MAX_ITERATIONS`, `bin`, …) is one
/// the configuration reads: its first key is a top-level key (not `config`, the file's name)
/// and it is not a test suite's `TEST_*`.
fn env_key_is_ours(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    let first = key.split("__").next().unwrap_or_default();
    first != "config" && !key.starts_with("test_") && TOP_LEVEL_KEYS.contains(&first)
}

/// Every model of `providers` with its window, in tokens.
#[must_use]
pub fn model_windows(providers: &BTreeMap<String, ProviderConfig>) -> Vec<ModelWindow<'_>> {
    providers
        .iter()
        .flat_map(|(id, provider)| {
            provider
                .models
                .iter()
                .map(move |(name, model)| ModelWindow {
                    provider: id,
                    model: name,
                    context_window: u64::from(model.context_window),
                    max_output_tokens: u64::from(model.max_output_tokens),
                })
        })
        .collect()
}

impl Config {
    /// Checks `[auth]`, `[limits]`, `[telemetry]` and `max_active_runs`, and adds the keys of
    /// `[auth] keys_env`.
    fn resolve_operations(&mut self) -> Result<(), ConfigError> {
        let check = |ok: bool, message: &str| {
            if ok {
                Ok(())
            } else {
                Err(ConfigError::Check(message.to_owned()))
            }
        };
        let limits = &self.limits;
        check(
            limits.runs_per_minute.is_none_or(|n| n >= 1),
            "limits.runs_per_minute must be at least 1 (leave it unset for no limit)",
        )?;
        check(
            limits.runs_burst.is_none_or(|n| n >= 1),
            "limits.runs_burst must be at least 1",
        )?;
        check(
            limits.runs_burst.is_none() || limits.runs_per_minute.is_some(),
            "limits.runs_burst needs limits.runs_per_minute",
        )?;
        check(
            limits.max_watchers.is_none_or(|n| n >= 1)
                && limits.max_watchers_per_key.is_none_or(|n| n >= 1),
            "limits.max_watchers and limits.max_watchers_per_key must be at least 1",
        )?;
        check(
            self.runtime.max_active_runs.is_none_or(|n| n >= 1),
            "runtime.max_active_runs must be at least 1",
        )?;
        for origin in &limits.cors_allowed_origins {
            let plain = origin == "*"
                || ((origin.starts_with("http://") || origin.starts_with("https://"))
                    && !origin.trim_end_matches('/').contains(['?', '#', ' '])
                    && origin.bytes().all(|b| b.is_ascii_graphic()));
            if !plain {
                return Err(ConfigError::Check(format!(
                    "limits.cors_allowed_origins: `{origin}` is not an origin (e.g. \
                     \"https://app.example.com\", or \"*\")"
                )));
            }
        }
        if let Some(endpoint) = &self.telemetry.otlp_endpoint {
            check(
                endpoint.starts_with("http://") || endpoint.starts_with("https://"),
                "telemetry.otlp_endpoint must start with http:// or https://",
            )?;
        }
        if let Some(var) = &self.auth.keys_env {
            let text = std::env::var(var)
                .ok()
                .filter(|text| !text.trim().is_empty())
                .ok_or_else(|| {
                    ConfigError::Check(format!(
                        "auth.keys_env names `{var}`, which is not set or empty"
                    ))
                })?;
            self.auth.keys.extend_from(&text).map_err(|message| {
                ConfigError::Check(format!("auth.keys_env `{var}`: {message}"))
            })?;
        }
        Ok(())
    }
}

/// The wire-specific provider options: each only for its `kind`, and a thinking budget of at
/// least 1024 tokens (Anthropic's minimum) below every model's `max_output_tokens`.
fn provider_options_check(id: &str, provider: &ProviderConfig) -> Result<(), ConfigError> {
    // (option set?, key, the kind it belongs to)
    let options = [
        (
            provider.thinking_budget_tokens.is_some(),
            "thinking_budget_tokens",
            ProviderKind::Anthropic,
        ),
        (
            provider.max_tokens_field.is_some(),
            "max_tokens_field",
            ProviderKind::Openai,
        ),
        (
            provider.reasoning_effort.is_some(),
            "reasoning_effort",
            ProviderKind::Openai,
        ),
        (
            provider.reasoning_replay != ReasoningReplay::None,
            "reasoning_replay",
            ProviderKind::Openai,
        ),
        (
            provider.assistant_tool_call_content.is_some(),
            "assistant_tool_call_content",
            ProviderKind::Openai,
        ),
        (
            provider.instructions_role != InstructionsRole::System,
            "instructions_role",
            ProviderKind::Openai,
        ),
        (
            provider.forced_tool_choice != ForcedToolChoice::Required,
            "forced_tool_choice",
            ProviderKind::Openai,
        ),
    ];
    if let Some((_, key, kind)) = options
        .iter()
        .find(|(set, _, kind)| *set && *kind != provider.kind)
    {
        let kind = match kind {
            ProviderKind::Openai => "openai",
            ProviderKind::Anthropic => "anthropic",
            ProviderKind::Scripted => "scripted",
        };
        return Err(ConfigError::Check(format!(
            "providers.{id}.{key} applies only to kind = \"{kind}\""
        )));
    }
    if let Some(budget) = provider.thinking_budget_tokens {
        if budget < 1024 {
            return Err(ConfigError::Check(format!(
                "providers.{id}.thinking_budget_tokens must be at least 1024"
            )));
        }
        if let Some((name, _)) = provider
            .models
            .iter()
            .find(|(_, model)| budget >= model.max_output_tokens)
        {
            return Err(ConfigError::Check(format!(
                "providers.{id}.thinking_budget_tokens must be below the max_output_tokens of model `{name}`"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_env_keys_are_the_configs_keys() {
        let value = serde_json::to_value(Config::default()).unwrap();
        let mut keys: Vec<&str> = value
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        keys.push("config");
        keys.sort_unstable();
        let mut known = TOP_LEVEL_KEYS.to_vec();
        known.sort_unstable();
        assert_eq!(keys, known);
        assert!(env_key_is_ours("RUNTIME__MAX_ITERATIONS"));
        assert!(env_key_is_ours("bind"));
        assert!(!env_key_is_ours("BIN"));
        assert!(!env_key_is_ours("BINDING__X"));
        assert!(!env_key_is_ours("CONFIG"));
        assert!(!env_key_is_ours("TEST_POSTGRES_URL"));
    }

    #[test]
    fn restart_settings_are_bounded() -> Result<(), ConfigError> {
        let runtime = Config::from_toml(
            "[runtime]\nrecovery = \"fail\"\nlease_ttl_ms = 300\nevent_retention_secs = 60\n",
        )?
        .runtime;
        assert_eq!(runtime.recovery, Recovery::Fail);
        assert_eq!(runtime.event_retention_secs, Some(60));
        for (setting, named) in [
            ("lease_ttl_ms = 299", "lease_ttl_ms"),
            ("lease_ttl_ms = 86400001", "lease_ttl_ms"),
            ("shutdown_grace_ms = 86400001", "shutdown_grace_ms"),
            ("event_retention_secs = 0", "event_retention_secs"),
            (
                "event_retention_secs = 9223372036854775807",
                "event_retention_secs",
            ),
            ("retention_batch_runs = 0", "retention_batch_runs"),
            ("recovery = \"Resume\"", "recovery"),
        ] {
            let error = Config::from_toml(&format!("[runtime]\n{setting}\n"))
                .map(|_| ())
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(error.contains(named), "{setting}: {error}");
        }
        Ok(())
    }

    #[test]
    fn provider_options_parse_and_are_checked() -> Result<(), ConfigError> {
        let openai = "[providers.x]\nkind = \"openai\"\nbase_url = \"http://h\"\nmax_tokens_field = \"max_completion_tokens\"\nassistant_tool_call_content = \"omit\"\nreasoning_replay = \"tool_turns\"\nforced_tool_choice = \"named\"\nreasoning_effort = \"high\"\n[providers.x.models.m]\ncontext_window = 10000\nmax_output_tokens = 2000\n";
        let provider = &Config::from_toml(openai)?.providers["x"];
        assert_eq!(
            provider.max_tokens_field,
            Some(MaxTokensField::MaxCompletionTokens)
        );
        assert_eq!(
            provider.assistant_tool_call_content,
            Some(AssistantToolCallContent::Omit)
        );
        assert_eq!(provider.reasoning_replay, ReasoningReplay::ToolTurns);
        assert_eq!(provider.reasoning_effort, Some(ReasoningEffort::High));
        assert_eq!(provider.forced_tool_choice, ForcedToolChoice::Named);
        let anthropic = |budget: u32| {
            format!(
                "[providers.c]\nkind = \"anthropic\"\nbase_url = \"http://h\"\nthinking_budget_tokens = {budget}\n[providers.c.models.m]\ncontext_window = 10000\nmax_output_tokens = 2000\n"
            )
        };
        assert_eq!(
            Config::from_toml(&anthropic(1999))?.providers["c"].thinking_budget_tokens,
            Some(1999)
        );
        for (toml, named) in [
            (anthropic(2000), "thinking_budget_tokens"),
            (anthropic(1000), "thinking_budget_tokens"),
            (
                openai.replace("reasoning_effort = \"high\"", "reasoning_effort = \"max\""),
                "max",
            ),
            (
                openai.replace(
                    "reasoning_effort",
                    "thinking_budget_tokens = 2048\nreasoning_effort",
                ),
                "thinking_budget_tokens",
            ),
            (
                anthropic(1024).replace(
                    "thinking_budget_tokens = 1024",
                    "reasoning_replay = \"all\"",
                ),
                "reasoning_replay",
            ),
            (
                anthropic(1024).replace(
                    "thinking_budget_tokens = 1024",
                    "forced_tool_choice = \"named\"",
                ),
                "forced_tool_choice",
            ),
        ] {
            let error = Config::from_toml(&toml)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(error.contains(named), "{toml}: {error}");
        }
        Ok(())
    }

    #[test]
    fn compaction_section_gives_the_initial_settings() -> Result<(), ConfigError> {
        let provider = "[providers.x]\nkind = \"openai\"\nbase_url = \"http://h\"\n[providers.x.models.m]\ncontext_window = 10000\nmax_output_tokens = 2000\n";
        assert_eq!(
            Config::from_toml("")?.compaction,
            CompactionConfig::default()
        );
        let config = Config::from_toml(&format!(
            "[compaction]\nkeep_tokens = 3000\nprune = true\nprovider = \"x\"\nmodel = \"m\"\n{provider}"
        ))?;
        assert_eq!(
            config.compaction,
            CompactionConfig {
                keep_tokens: Some(3000),
                prune: true,
                provider: "x".to_owned(),
                model: "m".to_owned(),
                ..CompactionConfig::default()
            }
        );
        for (section, named) in [
            (
                "circuit_breaker_threshold = 0",
                "compaction.circuit_breaker_threshold",
            ),
            ("provider = \"nope\"\nmodel = \"m\"", "compaction.provider"),
            ("provider = \"x\"\nmodel = \"other\"", "compaction.model"),
            ("model = \"m\"", "compaction.provider"),
            ("tail_turns = 5000", "compaction.tail_turns"),
            ("keep_tokenz = 1", "keep_tokenz"),
            ("keep_tokens = -1", "keep_tokens"),
            // 10,000 − 2,000 − 1,000 (an eighth of 8,000) leaves 7,000: a tail of 7,000 cannot
            // fit below it; startup names the model and the arithmetic.
            (
                "keep_tokens = 7000",
                "compaction.keep_tokens does not fit model `m` of provider `x`",
            ),
            (
                "buffer_tokens = 8000",
                "compaction.buffer_tokens does not fit model `m`",
            ),
        ] {
            let error = Config::from_toml(&format!("[compaction]\n{section}\n{provider}"))
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(error.contains(named), "{section}: {error}");
        }
        Ok(())
    }

    #[test]
    fn unknown_key_is_named() {
        let error = Config::from_toml("[runtime]\nmax_iteration = 3\n")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(error.contains("max_iteration"), "{error}");
    }

    #[test]
    fn bad_kind_is_named() {
        let error = Config::from_toml(
            "[providers.x]\nkind = \"bogus\"\nbase_url = \"http://h\"\n[providers.x.models.m]\ncontext_window = 2\nmax_output_tokens = 1\n",
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(error.contains("bogus"), "{error}");
    }

    #[test]
    fn missing_key_variable_is_named_without_value() {
        let error = Config::from_toml(
            "[providers.x]\nkind = \"openai\"\nbase_url = \"http://h\"\napi_key_env = \"BEHEST_SURELY_UNSET_VAR\"\n[providers.x.models.m]\ncontext_window = 2\nmax_output_tokens = 1\n",
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(error.contains("BEHEST_SURELY_UNSET_VAR"), "{error}");
    }

    #[test]
    fn shipped_examples_load() -> Result<(), ConfigError> {
        let local = include_str!("../examples/behest.toml");
        assert_eq!(Config::from_toml(local)?.providers.len(), 1);
        let agents = Config::from_toml(include_str!("../examples/agents.toml"))?;
        let concierge = &agents.agents["concierge"];
        assert_eq!(concierge.parameters.temperature, Some(0.3));
        assert_eq!(concierge.tools.as_ref().map(Vec::len), Some(2));
        Ok(())
    }

    #[test]
    fn agent_presets_are_read_strictly() {
        for (toml, named) in [
            ("[agents.a]\ntemprature = 1\n", "temprature"),
            (
                "[agents.a.parameters]\ntemperature = \"hot\"\n",
                "temperature",
            ),
            ("[agents.\"a b\"]\n", "agents.\"a b\""),
            ("[runtime]\naction_timeout_ms = 10\n", "action_timeout_ms"),
            ("[runtime]\naction_expiry = \"later\"\n", "later"),
        ] {
            let error = Config::from_toml(toml)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(error.contains(named), "{toml}: {error}");
        }
    }

    #[test]
    fn inconsistent_limits_are_named() {
        for (toml, named) in [
            ("[runtime]\nmax_iterations = 200\n", "max_iterations_cap"),
            ("[runtime]\nkeep_alive_ms = 0\n", "keep_alive_ms"),
            ("[runtime]\nmax_batch_events = 0\n", "max_batch_events"),
            ("[runtime]\nmax_body_bytes = 0\n", "max_body_bytes"),
            (
                "[runtime.doom_loop]\nthreshold = 0\n",
                "doom_loop.threshold",
            ),
            (
                "[providers.x]\nkind = \"openai\"\n[providers.x.models.m]\ncontext_window = 2\nmax_output_tokens = 1\n",
                "providers.x.base_url is required",
            ),
            (
                "[providers.x]\nkind = \"openai\"\nbase_url = \"http://h\"\ntoken_delay_ms = 5\n[providers.x.models.m]\ncontext_window = 2\nmax_output_tokens = 1\n",
                "scripted",
            ),
            (
                "[providers.x]\nkind = \"openai\"\nbase_url = \"http://h\"\n[providers.x.timeouts]\ntotal_ms = 0\n[providers.x.models.m]\ncontext_window = 2\nmax_output_tokens = 1\n",
                "providers.x.timeouts",
            ),
            (
                "[providers.x]\nkind = \"openai\"\nbase_url = \"http://h\"\n[providers.x.models.m]\ncontext_window = 8192\nmax_output_tokens = 8192\n",
                "providers.x.models.m.max_output_tokens",
            ),
        ] {
            let error = Config::from_toml(toml)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(error.contains(named), "{toml}: {error}");
        }
    }

    #[test]
    fn provider_parses() -> Result<(), ConfigError> {
        let config = Config::from_toml(
            "[providers.local]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:1/v1\"\n[providers.local.models.\"gpt-4o-mini\"]\ncontext_window = 128000\nmax_output_tokens = 16384\n",
        )?;
        let provider = &config.providers["local"];
        assert_eq!(provider.kind, ProviderKind::Openai);
        assert_eq!(provider.models["gpt-4o-mini"].context_window, 128_000);
        assert_eq!(provider.timeouts, TimeoutConfig::default());
        assert_eq!(provider.retry, RetryConfig::default());
        Ok(())
    }

    #[test]
    fn anthropic_provider_with_retry_parses() -> Result<(), ConfigError> {
        let config = Config::from_toml(
            "[providers.claude]\nkind = \"anthropic\"\nbase_url = \"https://api.anthropic.com/v1\"\n[providers.claude.retry]\nmax_attempts = 5\ninitial_backoff_ms = 100\njitter = false\n[providers.claude.models.m]\ncontext_window = 200000\nmax_output_tokens = 8192\n",
        )?;
        let provider = &config.providers["claude"];
        assert_eq!(provider.kind, ProviderKind::Anthropic);
        assert_eq!(
            provider.retry,
            RetryConfig {
                max_attempts: 5,
                initial_backoff_ms: 100,
                jitter: false,
                ..RetryConfig::default()
            }
        );
        Ok(())
    }

    #[test]
    fn zero_attempts_are_rejected() {
        let error = Config::from_toml(
            "[providers.x]\nkind = \"openai\"\nbase_url = \"http://h\"\n[providers.x.retry]\nmax_attempts = 0\n[providers.x.models.m]\ncontext_window = 2\nmax_output_tokens = 1\n",
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(error.contains("max_attempts"), "{error}");
    }
}
