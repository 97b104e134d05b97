//! Webhooks: where a run's end (or its pause in `requires_action`) is posted, and the record of
//! each delivery and its attempts (`GET /runs/{run_id}/webhook-deliveries`). Signing follows the
//! Standard Webhooks specification (<https://www.standardwebhooks.com/>).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::RunId;

/// Most bytes of a webhook's `url`.
pub const WEBHOOK_URL_MAX_BYTES: usize = 2048;

/// A run's webhook: behest POSTs the run record there, signed, when the run ends or starts
/// waiting in `requires_action`. An object so that fields can be added later.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Webhook {
    /// An `http` or `https` URL of at most 2048 bytes, without control characters or surrounding
    /// spaces (else 422 `invalid_field`, `field: webhook.url`). Its host must be in the server's
    /// `[webhooks] allowed_hosts` (when that list is not empty) and resolve to public
    /// addresses only (none that IANA's special-purpose registries do not mark globally
    /// reachable: loopback, private, link-local, unique-local, documentation, …) unless
    /// `[webhooks] allow_private_addresses` is set; checked when the run is created (422
    /// `invalid_webhook`) and again at each delivery.
    #[schema(max_length = 2048, example = "https://example.com/hooks/behest")]
    pub url: String,
}

/// What a delivery tells the webhook: the Standard Webhooks `type` of its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
pub enum WebhookEventType {
    /// The run completed (`run_completed`).
    #[serde(rename = "run.completed")]
    RunCompleted,
    /// The run failed (`run_failed`).
    #[serde(rename = "run.failed")]
    RunFailed,
    /// The run was cancelled (`run_cancelled`).
    #[serde(rename = "run.cancelled")]
    RunCancelled,
    /// The run waits in `requires_action` for tool outputs or approvals
    /// (`tool_calls_required`).
    #[serde(rename = "run.requires_action")]
    RunRequiresAction,
}

impl WebhookEventType {
    /// As written in the payload's `type` (`run.completed`, …).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RunCompleted => "run.completed",
            Self::RunFailed => "run.failed",
            Self::RunCancelled => "run.cancelled",
            Self::RunRequiresAction => "run.requires_action",
        }
    }

    /// Parses [`WebhookEventType::as_str`]'s text.
    #[must_use]
    pub fn parse(text: &str) -> Option<Self> {
        [
            Self::RunCompleted,
            Self::RunFailed,
            Self::RunCancelled,
            Self::RunRequiresAction,
        ]
        .into_iter()
        .find(|t| t.as_str() == text)
    }
}

/// Where a delivery is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WebhookDeliveryStatus {
    /// Not delivered yet: its next attempt is due at `next_attempt_at`.
    Pending,
    /// An attempt was answered with a 2xx status.
    Delivered,
    /// Every attempt of the retry schedule failed; no more are made.
    Failed,
}

impl WebhookDeliveryStatus {
    /// As stored and written in JSON.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Delivered => "delivered",
            Self::Failed => "failed",
        }
    }

    /// Parses [`WebhookDeliveryStatus::as_str`]'s text.
    #[must_use]
    pub fn parse(text: &str) -> Option<Self> {
        [Self::Pending, Self::Delivered, Self::Failed]
            .into_iter()
            .find(|s| s.as_str() == text)
    }
}

/// How one attempt went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WebhookAttemptOutcome {
    /// Answered with a 2xx status: the delivery is done.
    Delivered,
    /// Failed (a non-2xx status, a timeout, a refused connection, a refused address); another
    /// attempt follows.
    Retry,
    /// Failed, and it was the schedule's last attempt: the delivery failed.
    Failed,
    /// Being made: a process claimed the delivery for it and its claim is live.
    InProgress,
    /// Never ended: the process making it stopped first (killed, crashed, or shut down, which
    /// stops attempts in flight). The receiver may have got it; the next attempt follows once
    /// the claim expires (the attempt's timeout plus 5 s), at once after a shutdown.
    Interrupted,
}

impl WebhookAttemptOutcome {
    /// As stored, written in JSON and used as the metrics label.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Delivered => "delivered",
            Self::Retry => "retry",
            Self::Failed => "failed",
            Self::InProgress => "in_progress",
            Self::Interrupted => "interrupted",
        }
    }

    /// Parses [`WebhookAttemptOutcome::as_str`]'s text.
    #[must_use]
    pub fn parse(text: &str) -> Option<Self> {
        [
            Self::Delivered,
            Self::Retry,
            Self::Failed,
            Self::InProgress,
            Self::Interrupted,
        ]
        .into_iter()
        .find(|s| s.as_str() == text)
    }
}

/// One attempt to deliver a webhook.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct WebhookAttempt {
    /// 1 for the first attempt, then 2, 3, …
    pub attempt: u32,
    /// When the attempt began (RFC 3339, UTC).
    pub started_at: DateTime<Utc>,
    /// Time from sending the request to its answer (or failure), in ms; null while it is
    /// `in_progress` and when it was `interrupted`.
    pub duration_ms: Option<u64>,
    /// The HTTP status the receiver answered; absent when none came (timeout, connection or
    /// address refused).
    pub status_code: Option<u16>,
    /// What went wrong, when it failed.
    pub error: Option<String>,
    /// How the attempt went (`in_progress` while it is made).
    pub outcome: WebhookAttemptOutcome,
}

/// A delivery a run's webhook is owed, with its attempts so far.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct WebhookDelivery {
    /// Delivery id (UUID v7): the `webhook-id` header of each of its attempts (the same on
    /// every retry, so a receiver can drop duplicates).
    pub id: uuid::Uuid,
    /// The run.
    pub run_id: RunId,
    /// What it tells: `run.completed`, `run.failed`, `run.cancelled`, `run.requires_action`.
    pub event_type: WebhookEventType,
    /// Where it is posted.
    pub url: String,
    /// Where it is.
    pub status: WebhookDeliveryStatus,
    /// When the event that caused it was written (RFC 3339, UTC).
    pub created_at: DateTime<Utc>,
    /// While pending: when its next attempt is due (RFC 3339, UTC).
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// When it was delivered or failed (RFC 3339, UTC).
    pub finished_at: Option<DateTime<Utc>>,
    /// Its attempts, oldest first.
    pub attempts: Vec<WebhookAttempt>,
}

/// What one claim of a delivery worker took: the deliveries to attempt now, and how many
/// attempts it found cut short (a process that died or froze past its claim in the middle of
/// an attempt; each is counted once, by the claim that finds it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WebhookClaim {
    /// The deliveries claimed, each for its next attempt.
    pub deliveries: Vec<ClaimedDelivery>,
    /// Earlier attempts found `interrupted`: of the deliveries claimed, and of those failed
    /// because that attempt was the schedule's last.
    pub interrupted: u64,
}

/// A delivery claimed for an attempt by a process's delivery worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedDelivery {
    /// Delivery id: the `webhook-id`.
    pub id: uuid::Uuid,
    /// The run.
    pub run_id: RunId,
    /// Where it is posted.
    pub url: String,
    /// The body posted, as stored: `{"type", "timestamp", "data": <run record>}`.
    pub payload: String,
    /// This attempt's number (1, 2, …): its row is written at the claim, as `interrupted`
    /// until the attempt's end is recorded.
    pub attempt: u32,
}
