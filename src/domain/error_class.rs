//! Why a model provider call or a run failed, as reported in `run_failed` and used for retries.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// How a provider call or a run failed, for retries and for callers (e.g. compaction on
/// `context_length_exceeded`). Every `run_failed` carries one: the first eight classify a
/// model provider failure; `doom_loop`, `limit_exceeded`, `interrupted`, `internal`,
/// `action_expired`, `crash_loop` and `output_invalid` a run that failed for another reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// 401/403: bad or missing credentials.
    Auth,
    /// 429: too many requests.
    RateLimited,
    /// 503/529 or an "overloaded" error.
    Overloaded,
    /// The prompt does not fit the model's context window.
    ContextLengthExceeded,
    /// 400/404/422 and other request errors.
    InvalidRequest,
    /// 5xx and malformed responses.
    Server,
    /// A connect, first-byte, idle or total timeout.
    Timeout,
    /// The connection failed or closed early.
    Transport,
    /// The run repeated the same tool calls (see `doom_loop_detected`).
    DoomLoop,
    /// The run reached `max_iterations` or the server's `max_tool_calls`.
    LimitExceeded,
    /// The server stopped (shutdown, or a crash found at the next start) while the run was
    /// active.
    Interrupted,
    /// behest itself failed (storage, a panicked run task, a provider no longer configured).
    Internal,
    /// The run waited in `requires_action` past its deadline without the client's answers
    /// (`action_timeout_ms`).
    ActionExpired,
    /// The run was taken over `[runtime] max_takeovers` times in a row from a process that
    /// died while executing it, without committing a message: it is failed rather than
    /// resumed again, so that a run that kills its process cannot crash-loop the server.
    CrashLoop,
    /// The run's final answer did not match its `output_schema`, also after the corrective
    /// turns (`[runtime] output_corrections`, see `output_rejected`).
    OutputInvalid,
}

impl ErrorClass {
    /// The snake_case name, as logged.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auth => "auth",
            Self::RateLimited => "rate_limited",
            Self::Overloaded => "overloaded",
            Self::ContextLengthExceeded => "context_length_exceeded",
            Self::InvalidRequest => "invalid_request",
            Self::Server => "server",
            Self::Timeout => "timeout",
            Self::Transport => "transport",
            Self::DoomLoop => "doom_loop",
            Self::LimitExceeded => "limit_exceeded",
            Self::Interrupted => "interrupted",
            Self::Internal => "internal",
            Self::ActionExpired => "action_expired",
            Self::CrashLoop => "crash_loop",
            Self::OutputInvalid => "output_invalid",
        }
    }

    /// Whether a call failing this way may be retried (only before any output was emitted).
    #[must_use]
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            Self::RateLimited | Self::Overloaded | Self::Server | Self::Timeout | Self::Transport
        )
    }
}
