//! `[webhooks]`: the secret webhooks are signed with (Standard Webhooks `whsec_<base64>`), the
//! hosts they may go to, whether private addresses are allowed, the server's default URL, the
//! request timeout and the retry schedule (see `runtime::webhooks`).

use base64::Engine;
use std::sync::Arc;

use secrecy::{ExposeSecret, SecretSlice};
use serde::{Deserialize, Serialize};

/// `[webhooks]`. Without a `secret` webhooks are off: a run naming one gets 422
/// `webhooks_disabled`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WebhooksConfig {
    /// The signing secret, Standard Webhooks form `whsec_<base64 of 24 to 64 random bytes>`
    /// (`BEHEST_WEBHOOKS__SECRET`); never printed. Required to enable webhooks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<WebhookSecret>,
    /// Hosts a webhook URL may name (exact names, case-insensitive); empty: any host with
    /// public addresses.
    pub allowed_hosts: Vec<String>,
    /// Allow webhook hosts that resolve to loopback, private (RFC 1918), link-local,
    /// unique-local, carrier-grade NAT or unspecified addresses. Default false: such a URL is
    /// refused at the run's create (422 `invalid_webhook`) and at each delivery (the
    /// connection goes only to the addresses checked, so a DNS answer that changes between
    /// the check and the request cannot reach a private address).
    pub allow_private_addresses: bool,
    /// The webhook of runs whose request and preset name none; absent: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Time one delivery attempt may take, in ms (1 to 300000). Default 10000.
    pub timeout_ms: u64,
    /// The delay before each attempt, in ms: the first counts from the event that caused the
    /// delivery, each next one from the previous attempt's failure; after the last attempt
    /// fails the delivery is `failed`. Default as Standard Webhooks recommends: immediately,
    /// 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h. 1 to 50 entries.
    pub schedule_ms: Vec<u64>,
}

impl Default for WebhooksConfig {
    fn default() -> Self {
        Self {
            secret: None,
            allowed_hosts: Vec::new(),
            allow_private_addresses: false,
            url: None,
            timeout_ms: 10_000,
            schedule_ms: vec![
                0, 5_000, 300_000, 1_800_000, 7_200_000, 18_000_000, 36_000_000, 36_000_000,
            ],
        }
    }
}

/// Shows whether webhooks are enabled, never the key (nor the word a log search for leaked
/// secrets looks for).
impl std::fmt::Debug for WebhooksConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhooksConfig")
            .field("enabled", &self.secret.is_some())
            .field("allowed_hosts", &self.allowed_hosts)
            .field("allow_private_addresses", &self.allow_private_addresses)
            .field("url", &self.url)
            .field("timeout_ms", &self.timeout_ms)
            .field("schedule_ms", &self.schedule_ms)
            .finish()
    }
}

impl WebhooksConfig {
    /// The problem with these settings, as a message naming the key, if any.
    pub(super) fn check(&self) -> Result<(), String> {
        if !(1..=300_000).contains(&self.timeout_ms) {
            return Err("webhooks.timeout_ms must be from 1 to 300000 (5 minutes)".to_owned());
        }
        if !(1..=50).contains(&self.schedule_ms.len()) {
            return Err("webhooks.schedule_ms must list 1 to 50 delays (ms)".to_owned());
        }
        if self.schedule_ms.iter().any(|&ms| ms > 604_800_000) {
            return Err(
                "webhooks.schedule_ms: each delay is at most 604800000 (7 days)".to_owned(),
            );
        }
        if let Some(url) = &self.url {
            let parsed = reqwest::Url::parse(url).ok();
            if !parsed.is_some_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some())
            {
                return Err("webhooks.url must be an http(s) URL".to_owned());
            }
            if self.secret.is_none() {
                return Err("webhooks.url needs webhooks.secret (deliveries are signed)".to_owned());
            }
        }
        Ok(())
    }
}

/// A webhook signing secret: the key bytes of `whsec_<base64>`, printed as `[redacted]`.
#[derive(Clone)]
pub struct WebhookSecret(Arc<SecretSlice<u8>>);

impl WebhookSecret {
    /// Parses `whsec_<base64>` (standard alphabet, padded or not); at least 24 key bytes (the
    /// specification asks for 24 to 64).
    ///
    /// # Errors
    /// What is wrong with the text, without repeating it.
    pub fn parse(text: &str) -> Result<Self, String> {
        let encoded = text
            .strip_prefix("whsec_")
            .ok_or("webhooks.secret must start with `whsec_` (Standard Webhooks form)")?;
        let key = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .or_else(|_| {
                base64::engine::general_purpose::STANDARD_NO_PAD
                    .decode(encoded.trim_end_matches('='))
            })
            .map_err(|_| "webhooks.secret: the part after `whsec_` must be base64".to_owned())?;
        if !(24..=64).contains(&key.len()) {
            return Err(format!(
                "webhooks.secret must hold 24 to 64 key bytes (it holds {})",
                key.len()
            ));
        }
        Ok(Self(Arc::new(SecretSlice::from(key))))
    }

    /// The key bytes (for HMAC-SHA256).
    #[must_use]
    pub fn key(&self) -> &[u8] {
        self.0.expose_secret()
    }
}

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}

impl PartialEq for WebhookSecret {
    fn eq(&self, _: &Self) -> bool {
        // Secrets are never compared; configs are equal when their visible parts are.
        true
    }
}

impl Eq for WebhookSecret {}

impl Serialize for WebhookSecret {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str("[redacted]")
    }
}

impl<'de> Deserialize<'de> for WebhookSecret {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}
