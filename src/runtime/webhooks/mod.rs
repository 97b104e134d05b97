//! Webhooks: a run's end (`run.completed`, `run.failed`, `run.cancelled`) and each pause in
//! `requires_action` (`run.requires_action`) POSTed to the run's webhook URL, signed the
//! Standard Webhooks way, at least once.
//!
//! The delivery is written to the store's outbox in the transaction of the event that causes
//! it (the emitter marks that event, `RunChange::webhook`; `store/sql/webhooks.rs` writes the
//! row with the run record as the payload), so a crash can neither lose it nor half-write it,
//! and a run without a webhook writes nothing more. One worker per process ([`delivery_loop`])
//! claims due deliveries with a short claim (several replicas never attempt one delivery at
//! once; a dead replica's claim expires; the claim writes its attempt as `interrupted`, so one
//! cut by a crash stays listed), posts each with a timeout, records the attempt's end and
//! schedules the next from `[webhooks] schedule_ms`. It is woken by the event log when a
//! delivery is written here, and polls the outbox otherwise. It never blocks a run.

mod address;
mod sign;

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use chrono::Utc;
use tokio::sync::Notify;
use tokio::task::JoinSet;

pub use address::is_private;

use super::Runtime;
use crate::config::WebhooksConfig;
use crate::domain::{ClaimedDelivery, Webhook, WebhookAttempt, WebhookAttemptOutcome};
use crate::events::EventPayload;
use crate::store::{AttemptRecord, Store, WebhookDue};

/// Deliveries one process attempts at once at most.
const MAX_IN_FLIGHT: usize = 16;
/// How long the worker waits between looks at the outbox when nothing is due sooner (another
/// replica may have written a delivery).
const IDLE_POLL: Duration = Duration::from_secs(5);
/// How long the worker waits when a due delivery is claimed by someone else.
const BUSY_POLL: Duration = Duration::from_secs(1);
/// How long a claim outlives an attempt's timeout: the time to record it.
const CLAIM_MARGIN_MS: i64 = 5_000;
/// Most bytes of a receiver's error text kept with an attempt.
const MAX_ERROR_BYTES: usize = 512;

/// The process's webhook settings and delivery client.
#[derive(Debug)]
pub struct Webhooks {
    config: WebhooksConfig,
    signer: sign::Signer,
    client: reqwest::Client,
    /// Notified by the event log when it wrote a delivery.
    wake: Arc<Notify>,
}

/// Why a run's webhook was refused at its create.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WebhookProblem {
    /// The server has no `[webhooks] secret`.
    #[error("webhooks are not enabled on this server (no [webhooks] secret is configured)")]
    Disabled,
    /// The URL is not allowed (scheme, host, addresses).
    #[error("webhook.url {0}")]
    Invalid(String),
}

impl Webhooks {
    /// The webhooks of `config`, `None` when no secret is configured (webhooks are off).
    ///
    /// # Errors
    /// When the delivery client cannot be built.
    pub fn new(config: &WebhooksConfig, wake: Arc<Notify>) -> Result<Option<Self>, String> {
        let Some(secret) = &config.secret else {
            return Ok(None);
        };
        let signer = sign::Signer::new(secret.key()).ok_or("invalid webhook secret")?;
        let client = crate::net::client_builder()
            // No proxy: the addresses checked are the ones connected to.
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .dns_resolver(Arc::new(address::CheckedResolver {
                allow_private: config.allow_private_addresses,
            }))
            .timeout(Duration::from_millis(config.timeout_ms))
            .build()
            .map_err(|error| error.to_string())?;
        let webhooks = Self {
            config: config.clone(),
            signer,
            client,
            wake,
        };
        // A default URL every run would be refused for is the operator's mistake: said at
        // startup, not as a 422 to each client (its host is resolved only at each run's create).
        if let Some(url) = &config.url {
            webhooks
                .check_form(url)
                .map_err(|problem| format!("[webhooks] url: {problem}"))?;
        }
        Ok(Some(webhooks))
    }

    /// Checks a webhook URL as at a run's create: an `http(s)` URL whose host is allowed and
    /// resolves to allowed addresses.
    ///
    /// # Errors
    /// [`WebhookProblem::Invalid`] saying what is wrong.
    pub async fn check(&self, url: &str) -> Result<(), WebhookProblem> {
        let host = self.check_form(url)?;
        address::resolve(&host, self.config.allow_private_addresses)
            .await
            .map_err(WebhookProblem::Invalid)?;
        Ok(())
    }

    /// What can be checked of a URL without resolving its host: an `http(s)` URL without
    /// credentials, whose host is allowed (and, for an address, not a private one unless those
    /// are allowed). Returns the host.
    fn check_form(&self, url: &str) -> Result<String, WebhookProblem> {
        let parsed = reqwest::Url::parse(url)
            .map_err(|error| WebhookProblem::Invalid(format!("is not a URL ({error})")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(WebhookProblem::Invalid(
                "must be an http or https URL".to_owned(),
            ));
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(WebhookProblem::Invalid(
                "must not carry credentials".to_owned(),
            ));
        }
        let Some(host) = parsed.host_str() else {
            return Err(WebhookProblem::Invalid("has no host".to_owned()));
        };
        if parsed.port() == Some(0) {
            return Err(WebhookProblem::Invalid("names port 0".to_owned()));
        }
        let allowed = &self.config.allowed_hosts;
        if !allowed.is_empty() && !allowed.iter().any(|h| h.eq_ignore_ascii_case(host)) {
            return Err(WebhookProblem::Invalid(format!(
                "names host `{host}`, which is not in the server's [webhooks] allowed_hosts"
            )));
        }
        let address = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .ok();
        if let Some(ip) = address
            && !self.config.allow_private_addresses
            && address::is_private(ip)
        {
            return Err(WebhookProblem::Invalid(format!(
                "names an address that is not publicly reachable ({ip}); set [webhooks] \
                 allow_private_addresses to allow it"
            )));
        }
        Ok(host.to_owned())
    }

    /// The server's default webhook (`[webhooks] url`).
    #[must_use]
    pub fn default_webhook(&self) -> Option<Webhook> {
        self.config.url.clone().map(|url| Webhook { url })
    }

    /// One attempt of a claimed delivery: checked, signed, posted; returns how it went and
    /// when the next one is due.
    async fn attempt(&self, delivery: &ClaimedDelivery) -> AttemptRecord {
        let number = delivery.attempt;
        let started_at = Utc::now();
        let started = Instant::now();
        let result = match self.check(&delivery.url).await {
            Err(problem) => Err(problem.to_string()),
            Ok(()) => self.post(delivery).await,
        };
        let duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let (status_code, error) = match result {
            Ok(status) if (200..300).contains(&status) => (Some(status), None),
            Ok(status) => (
                Some(status),
                Some(format!("the receiver answered {status}")),
            ),
            Err(error) => (None, Some(error)),
        };
        let schedule = &self.config.schedule_ms;
        let (outcome, next_attempt_ms) = if error.is_none() {
            (WebhookAttemptOutcome::Delivered, None)
        } else if let Some(&delay) = usize::try_from(number).ok().and_then(|n| schedule.get(n)) {
            let delay = i64::try_from(delay).unwrap_or(i64::MAX);
            (
                WebhookAttemptOutcome::Retry,
                Some(Utc::now().timestamp_millis().saturating_add(delay)),
            )
        } else {
            (WebhookAttemptOutcome::Failed, None)
        };
        AttemptRecord {
            attempt: WebhookAttempt {
                attempt: number,
                started_at,
                duration_ms: Some(duration_ms),
                status_code,
                error,
                outcome,
            },
            next_attempt_ms,
        }
    }

    /// Posts the delivery's payload, signed; returns the receiver's status.
    async fn post(&self, delivery: &ClaimedDelivery) -> Result<u16, String> {
        let id = delivery.id.to_string();
        let timestamp = Utc::now().timestamp();
        let signature = self
            .signer
            .sign(&id, timestamp, delivery.payload.as_bytes());
        let response = self
            .client
            .post(&delivery.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header("webhook-id", &id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .body(delivery.payload.clone())
            .send()
            .await
            .map_err(|error| describe(&error))?;
        Ok(response.status().as_u16())
    }
}

/// A request error with its causes, at most [`MAX_ERROR_BYTES`].
fn describe(error: &reqwest::Error) -> String {
    let mut text = if error.is_timeout() {
        "timed out".to_owned()
    } else {
        error.to_string()
    };
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    if text.len() > MAX_ERROR_BYTES {
        let mut end = MAX_ERROR_BYTES;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// The delivery an event owes a run whose webhook is `url`: for a terminal event or
/// `tool_calls_required` ([`EventPayload::webhook_event`]), else `None`.
#[must_use]
pub fn due(url: Option<&Arc<str>>, payload: &EventPayload) -> Option<WebhookDue> {
    let url = url?;
    let event_type = payload.webhook_event()?;
    Some(WebhookDue {
        id: uuid::Uuid::now_v7(),
        url: url.clone(),
        event_type,
        due_ms: Utc::now().timestamp_millis(),
    })
}

/// The process's delivery worker: claims due deliveries, attempts each in a task of its own
/// (at most [`MAX_IN_FLIGHT`] at once), records them, and waits for the next due one, a
/// wake-up or an attempt's end. Ends when the runtime begins its shutdown: attempts still in
/// flight are stopped and their claims released ([`release`]); a process that dies holds its
/// claims until they expire (an attempt's timeout plus 5 s). Either way the attempt, written
/// at its claim, stays `interrupted`.
pub(super) async fn delivery_loop(runtime: Weak<Runtime>, webhooks: Arc<Webhooks>) {
    let claim_ms = i64::try_from(webhooks.config.timeout_ms)
        .unwrap_or(i64::MAX)
        .saturating_add(CLAIM_MARGIN_MS);
    let max_attempts = u32::try_from(webhooks.config.schedule_ms.len()).unwrap_or(u32::MAX);
    let mut in_flight: JoinSet<()> = JoinSet::new();
    loop {
        let Some(strong) = runtime.upgrade() else {
            return;
        };
        let store = strong.store.clone();
        let owner = strong.owner.clone();
        let draining = strong.draining.clone();
        let now_ms = strong.store_now_ms();
        drop(strong);
        if draining.is_cancelled() {
            release(&mut in_flight, store.as_ref(), &owner).await;
            return;
        }
        while in_flight.try_join_next().is_some() {}
        let free = MAX_IN_FLIGHT.saturating_sub(in_flight.len());
        let mut claimed = 0;
        if free > 0 {
            let limit = u32::try_from(free).unwrap_or(u32::MAX);
            match store
                .claim_webhook_deliveries(
                    &owner,
                    now_ms,
                    now_ms.saturating_add(claim_ms),
                    limit,
                    max_attempts,
                )
                .await
            {
                Ok(claim) => {
                    crate::telemetry::metrics::webhook_attempts_interrupted(claim.interrupted);
                    claimed = claim.deliveries.len();
                    for delivery in claim.deliveries {
                        in_flight.spawn(deliver(webhooks.clone(), store.clone(), delivery));
                    }
                }
                Err(error) => tracing::warn!(%error, "claiming webhook deliveries failed"),
            }
        }
        let wait = if claimed > 0 && claimed == free {
            // There may be more due: look again once an attempt ends.
            IDLE_POLL
        } else {
            match store.webhook_outbox().await {
                Ok(outbox) => {
                    crate::telemetry::metrics::webhooks_pending(outbox.pending);
                    match outbox.next_due_ms {
                        None => IDLE_POLL,
                        Some(due) if due > now_ms => {
                            Duration::from_millis(u64::try_from(due - now_ms).unwrap_or(0))
                                .clamp(Duration::from_millis(20), IDLE_POLL)
                        }
                        Some(_) => BUSY_POLL,
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "reading the webhook outbox failed");
                    IDLE_POLL
                }
            }
        };
        tokio::select! {
            () = draining.cancelled() => {
                release(&mut in_flight, store.as_ref(), &owner).await;
                return;
            }
            () = webhooks.wake.notified() => {}
            () = tokio::time::sleep(wait) => {}
            Some(_) = in_flight.join_next(), if !in_flight.is_empty() => {}
        }
    }
}

/// At shutdown: stops the attempts in flight and releases this process's claims, so that the
/// next process (or another replica) attempts them again at once (at least once: an attempt
/// stopped after the receiver got it is delivered again).
async fn release(in_flight: &mut JoinSet<()>, store: &dyn Store, owner: &str) {
    in_flight.shutdown().await;
    match store.release_webhook_claims(owner).await {
        Ok(released) => crate::telemetry::metrics::webhook_attempts_interrupted(released),
        Err(error) => tracing::warn!(%error, "releasing webhook claims failed (they expire)"),
    }
}

/// One attempt of `delivery`, recorded (with a few retries of the store), counted in metrics.
async fn deliver(webhooks: Arc<Webhooks>, store: Arc<dyn Store>, delivery: ClaimedDelivery) {
    let record = webhooks.attempt(&delivery).await;
    let outcome = record.attempt.outcome;
    crate::telemetry::metrics::webhook_attempt(outcome.as_str());
    match outcome {
        WebhookAttemptOutcome::Delivered => {
            tracing::info!(run_id = %delivery.run_id, delivery_id = %delivery.id, attempt = record.attempt.attempt, "webhook delivered");
        }
        _ => tracing::warn!(
            run_id = %delivery.run_id,
            delivery_id = %delivery.id,
            attempt = record.attempt.attempt,
            error = record.attempt.error.as_deref().unwrap_or_default(),
            outcome = outcome.as_str(),
            "webhook attempt failed"
        ),
    }
    let mut delay = Duration::from_millis(50);
    for _ in 0..5 {
        match store.record_webhook_attempt(delivery.id, &record).await {
            Ok(()) => return,
            Err(error) => {
                tracing::warn!(%error, delivery_id = %delivery.id, "recording a webhook attempt failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 4;
            }
        }
    }
    // The claim expires and the delivery is attempted again: at least once still holds.
}

#[cfg(test)]
mod tests {
    use super::*;

    fn webhooks(extra: &str) -> Result<Option<Webhooks>, String> {
        let config = crate::config::Config::from_toml(&format!(
            "[webhooks]\nsecret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSwMfKQ9r8GKYo=\"\n{extra}"
        ))
        .map_err(|error| error.to_string())?;
        Webhooks::new(&config.webhooks, Arc::new(Notify::new()))
    }

    /// A default URL that every run would be refused for stops the server at startup.
    #[tokio::test]
    async fn a_default_url_every_run_would_be_refused_for_is_a_startup_error() {
        let outside =
            webhooks("allowed_hosts = [\"example.com\"]\nurl = \"https://hooks.example.org/in\"\n")
                .err()
                .unwrap_or_default();
        assert!(outside.contains("allowed_hosts"), "{outside}");
        let private = webhooks("url = \"http://127.0.0.1:9111/in\"\n")
            .err()
            .unwrap_or_default();
        assert!(private.contains("allow_private_addresses"), "{private}");
        let private6 = webhooks("url = \"http://[::1]:9111/in\"\n").err();
        assert!(private6.is_some(), "[::1] was accepted");
        assert!(
            webhooks("url = \"http://127.0.0.1:9111/in\"\nallow_private_addresses = true\n")
                .is_ok_and(|w| w.is_some())
        );
        assert!(webhooks("url = \"https://hooks.example.com/in\"\n").is_ok_and(|w| w.is_some()));
    }
}
