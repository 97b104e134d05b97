//! Compaction: the settings of `/compaction` (the seed's `CompactionService` config), the state
//! of its circuit breaker, and the record of one compaction of a session's context.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{CompactionId, MessageId, RunId, SessionId, TokenUsage};

/// How a session's context is kept inside the model's window (proto
/// `GetCompactionConfigResponse`, with its defaults). `GET /compaction` returns it, `PUT`
/// replaces it, `PATCH` merges into it; the config file's `[compaction]` section gives the
/// initial values, and a change through the API is stored and applies from the next model call
/// of any run.
///
/// Before a model call, when the request's estimated size passes `context_window −
/// max_output_tokens − buffer_tokens` of the run's model, the older turns are summarised and the
/// request becomes: system content, the summary, then the newest turns (at most `tail_turns`,
/// within `keep_tokens`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompactionConfig {
    /// Compact before a model call whose request would pass the threshold; default true. Off,
    /// compaction still happens when the provider rejects a request as too long, and on
    /// `POST /sessions/{session_id}/compact`.
    pub auto: bool,
    /// Before summarising, replace old tool outputs (outside the newest turns that compaction
    /// would keep) in the request by a short marker; the stored messages are untouched; default
    /// false.
    pub prune: bool,
    /// Tokens kept free below `context_window − max_output_tokens`: compaction starts when the
    /// request would pass `context_window − max_output_tokens − buffer_tokens`. Null (the
    /// default): relative to each model's window, 20000 or an eighth of `context_window −
    /// max_output_tokens`, whichever is less.
    #[schema(minimum = 0, required = true)]
    pub buffer_tokens: Option<u64>,
    /// Most tokens of the newest turns kept verbatim after a compaction. Null (the default):
    /// relative to each model's window, 8000 or a quarter of `context_window −
    /// max_output_tokens`, whichever is less. Set, it must be below `context_window −
    /// max_output_tokens − buffer_tokens` of every configured model.
    #[schema(minimum = 0, required = true)]
    pub keep_tokens: Option<u64>,
    /// Most turns (a user input and everything after it) kept verbatim after a compaction, the
    /// current one included; 0 keeps only the latest user input; default 2.
    #[schema(minimum = 0, maximum = 1000)]
    pub tail_turns: u32,
    /// The summariser's model, one `provider` lists; empty: the run's own model (then
    /// `provider` is empty too).
    pub model: String,
    /// The summariser's provider, a configured provider id; empty: the run's own provider (then
    /// `model` is empty too).
    pub provider: String,
    /// Consecutive failed compactions (an error, an empty summary, a summary that does not
    /// shrink the context), counted across runs, that open the circuit breaker; 1 to 1000;
    /// default 3.
    #[schema(minimum = 1, maximum = 1000)]
    pub circuit_breaker_threshold: u32,
}

impl Default for CompactionConfig {
    fn default() -> Self {
        Self {
            auto: true,
            prune: false,
            buffer_tokens: None,
            keep_tokens: None,
            tail_turns: 2,
            model: String::new(),
            provider: String::new(),
            circuit_breaker_threshold: 3,
        }
    }
}

impl CompactionConfig {
    /// The fields, in order (the body of `PUT /compaction` has every one).
    pub const FIELDS: [&'static str; 8] = [
        "auto",
        "prune",
        "buffer_tokens",
        "keep_tokens",
        "tail_turns",
        "model",
        "provider",
        "circuit_breaker_threshold",
    ];
}

/// `buffer_tokens` when unset, at most (tokens).
pub const DEFAULT_BUFFER_TOKENS: u64 = 20_000;
/// `keep_tokens` when unset, at most (tokens).
pub const DEFAULT_KEEP_TOKENS: u64 = 8_000;

impl CompactionConfig {
    /// `buffer_tokens` for a model whose `context_window − max_output_tokens` is `room`
    /// tokens: the set value, else [`DEFAULT_BUFFER_TOKENS`] or `room / 8`, whichever is less.
    #[must_use]
    pub fn buffer_for(&self, room: u64) -> u64 {
        self.buffer_tokens
            .unwrap_or_else(|| DEFAULT_BUFFER_TOKENS.min(room / 8))
    }

    /// `keep_tokens` for a model whose `context_window − max_output_tokens` is `room` tokens:
    /// the set value, else [`DEFAULT_KEEP_TOKENS`] or `room / 4`, whichever is less.
    #[must_use]
    pub fn keep_for(&self, room: u64) -> u64 {
        self.keep_tokens
            .unwrap_or_else(|| DEFAULT_KEEP_TOKENS.min(room / 4))
    }
}

/// Most `tail_turns`.
pub const MAX_TAIL_TURNS: u32 = 1000;
/// Most `circuit_breaker_threshold`.
pub const MAX_BREAKER_THRESHOLD: u32 = 1000;

/// A configured model as compaction settings are checked against it, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelWindow<'a> {
    /// The provider id.
    pub provider: &'a str,
    /// The model name.
    pub model: &'a str,
    /// Its context window.
    pub context_window: u64,
    /// Its output limit.
    pub max_output_tokens: u64,
}

impl ModelWindow<'_> {
    /// `context_window − max_output_tokens` (0 when the output takes it all).
    #[must_use]
    pub fn room(&self) -> u64 {
        self.context_window.saturating_sub(self.max_output_tokens)
    }

    /// The size a request may reach before compaction: `context_window − max_output_tokens −
    /// buffer_tokens` (0 when the buffer takes it all).
    #[must_use]
    pub fn threshold(&self, buffer_tokens: u64) -> u64 {
        self.room().saturating_sub(buffer_tokens)
    }
}

/// What is wrong with compaction settings: the field to blame, a stable code
/// (`invalid_field`, `unknown_provider`, `unknown_model`) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingsProblem {
    /// The field.
    pub field: &'static str,
    /// `invalid_field`, `unknown_provider` or `unknown_model`.
    pub code: &'static str,
    /// What is wrong, readable by a person.
    pub reason: String,
}

impl CompactionConfig {
    /// Checks the values on their own and against the configured models: `tail_turns` at most
    /// [`MAX_TAIL_TURNS`], `circuit_breaker_threshold` from 1 to [`MAX_BREAKER_THRESHOLD`],
    /// `provider` and `model` both empty or a model that provider lists, no U+0000.
    ///
    /// # Errors
    /// The first [`SettingsProblem`] found.
    pub fn check_values(&self, models: &[ModelWindow<'_>]) -> Result<(), SettingsProblem> {
        let invalid = |field, reason: String| SettingsProblem {
            field,
            code: "invalid_field",
            reason,
        };
        if self.tail_turns > MAX_TAIL_TURNS {
            return Err(invalid(
                "tail_turns",
                format!("must be at most {MAX_TAIL_TURNS}"),
            ));
        }
        if !(1..=MAX_BREAKER_THRESHOLD).contains(&self.circuit_breaker_threshold) {
            return Err(invalid(
                "circuit_breaker_threshold",
                format!("must be from 1 to {MAX_BREAKER_THRESHOLD}"),
            ));
        }
        for (field, value) in [("provider", &self.provider), ("model", &self.model)] {
            if value.contains('\0') {
                return Err(invalid(
                    field,
                    "must not contain the NUL character (U+0000)".to_owned(),
                ));
            }
        }
        match (self.provider.is_empty(), self.model.is_empty()) {
            (true, true) => Ok(()),
            (false, true) => Err(invalid(
                "model",
                "is required with `provider` (both empty: the run's own model)".to_owned(),
            )),
            (true, false) => Err(invalid(
                "provider",
                "is required with `model` (both empty: the run's own model)".to_owned(),
            )),
            (false, false) => {
                if !models.iter().any(|m| m.provider == self.provider) {
                    return Err(SettingsProblem {
                        field: "provider",
                        code: "unknown_provider",
                        reason: format!("names no configured provider (`{}`)", self.provider),
                    });
                }
                if !models
                    .iter()
                    .any(|m| m.provider == self.provider && m.model == self.model)
                {
                    return Err(SettingsProblem {
                        field: "model",
                        code: "unknown_model",
                        reason: format!(
                            "names no model of provider `{}` (`{}`)",
                            self.provider, self.model
                        ),
                    });
                }
                Ok(())
            }
        }
    }

    /// Checks that `buffer_tokens` and `keep_tokens` (each as it applies to the model: set, or
    /// relative to its window) fit every configured model: a tail of `keep_tokens` must stay
    /// below the model's threshold (`context_window − max_output_tokens − buffer_tokens`), or
    /// compaction could never bring a request under it. Unset values always fit.
    ///
    /// # Errors
    /// A [`SettingsProblem`] naming `buffer_tokens` (it leaves no room at all) or `keep_tokens`,
    /// and the model with the tightest window.
    pub fn check_fit(&self, models: &[ModelWindow<'_>]) -> Result<(), SettingsProblem> {
        let threshold = |m: &ModelWindow<'_>| m.threshold(self.buffer_for(m.room()));
        let tightest = models
            .iter()
            .filter(|m| threshold(m) <= self.keep_for(m.room()))
            .min_by_key(|m| threshold(m));
        let Some(model) = tightest else {
            return Ok(());
        };
        let room = threshold(model);
        let field = if room == 0 || self.keep_tokens.is_none() {
            "buffer_tokens"
        } else {
            "keep_tokens"
        };
        Err(SettingsProblem {
            field,
            code: "invalid_field",
            reason: format!(
                "does not fit model `{}` of provider `{}`: its context_window ({}) minus \
                 max_output_tokens ({}) minus buffer_tokens ({}) leaves {room} tokens, and \
                 keep_tokens ({}) must be below that",
                model.model,
                model.provider,
                model.context_window,
                model.max_output_tokens,
                self.buffer_for(model.room()),
                self.keep_for(model.room())
            ),
        })
    }
}

/// The compaction circuit breaker (proto `GetCircuitBreakerResponse`, plus its threshold, when
/// it opened and the last failure). Consecutive failed compactions are counted across runs;
/// at `threshold` it opens and no compaction is attempted until a reset
/// (`POST /compaction/circuit-breaker/reset`); a successful compaction closes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct CircuitBreaker {
    /// True while open: no compaction is attempted, and a run whose request does not fit its
    /// model's window fails with `context_length_exceeded`.
    pub is_open: bool,
    /// Compactions that failed in a row since the last success or reset.
    pub consecutive_failures: u32,
    /// The `circuit_breaker_threshold` in force.
    pub threshold: u32,
    /// When it opened (RFC 3339, UTC); null while closed.
    pub opened_at: Option<DateTime<Utc>>,
    /// Why the last compaction failed; null when none failed since the last success or reset.
    pub last_error: Option<String>,
}

/// What made a compaction happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CompactionTrigger {
    /// Before a model call whose request would pass the threshold (`auto` on).
    Auto,
    /// The provider rejected a model call as too long (`context_length_exceeded`); the call was
    /// made again after the compaction.
    Reactive,
    /// `POST /sessions/{session_id}/compact`.
    Manual,
}

impl CompactionTrigger {
    /// The snake_case name, as stored.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Reactive => "reactive",
            Self::Manual => "manual",
        }
    }

    /// Parses the stored name.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        [Self::Auto, Self::Reactive, Self::Manual]
            .into_iter()
            .find(|t| t.as_str() == s)
    }
}

/// One compaction of a session's context, as stored: its summary stands for every message of
/// the session up to `through_message_id` (the previous compaction's summary included) in the
/// requests that follow. Every original message stays stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Compaction {
    /// Compaction id (UUID v7).
    pub id: CompactionId,
    /// The session.
    pub session_id: SessionId,
    /// The run that compacted; null for `POST /sessions/{session_id}/compact`.
    pub run_id: Option<RunId>,
    /// What made it happen.
    pub trigger: CompactionTrigger,
    /// The last message the summary covers: later requests hold the summary, then the messages
    /// after this one (and the latest user input, which is always kept verbatim).
    pub through_message_id: MessageId,
    /// Original messages this compaction summarised (those after the previous compaction, up to
    /// `through_message_id`; the latest user input kept verbatim is not counted).
    pub messages_summarised: u32,
    /// The request's estimated size before, in tokens.
    pub tokens_before: u64,
    /// The request's estimated size after (summary and kept messages), in tokens.
    pub tokens_after: u64,
    /// The summary (plain text), written by `model` of `provider`.
    pub summary: String,
    /// The summariser's provider id.
    pub provider: String,
    /// The summariser's model.
    pub model: String,
    /// The summariser's token usage (counted in the run's `total_usage` when a run compacted).
    pub usage: TokenUsage,
    /// When it was stored (RFC 3339, UTC).
    pub created_at: DateTime<Utc>,
}
