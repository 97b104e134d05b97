//! The operator's sections of the configuration: `[auth]` (API keys), `[limits]` (CORS, rate
//! and watcher limits) and `[telemetry]` (Prometheus metrics, OpenTelemetry export). API keys
//! are hashed (SHA-256) as they are read; the plain key is never kept, printed or serialized.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest, Sha256};

/// `[auth]`: bearer API keys. With at least one key, every route but `/healthz` and `/readyz`
/// (and the static console and docs pages) requires `Authorization: Bearer <key>`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// The accepted keys: each a key itself or its hash as `sha256:<64 hex>` (so the file need
    /// not hold the key); a list, or one string of comma-separated keys (as
    /// `BEHEST_AUTH__KEYS` gives it).
    pub keys: ApiKeys,
    /// Name of an environment variable holding more keys, comma-separated (e.g. from a
    /// secret store); it must be set and non-empty when named.
    pub keys_env: Option<String>,
    /// Serve `/metrics` without a key; default false.
    pub metrics_public: bool,
    /// Start on a non-loopback address without any key (`--allow-unauthenticated`); default
    /// false: such a start is refused.
    pub allow_unauthenticated: bool,
}

/// The SHA-256 digest of one API key.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KeyHash(pub [u8; 32]);

impl KeyHash {
    /// The digest of `key` as presented by a client (SHA-256 of its UTF-8 bytes).
    #[must_use]
    pub fn of(key: &str) -> Self {
        Self(Sha256::digest(key.as_bytes()).into())
    }

    /// `key`'s digest: parsed from `sha256:<64 hex>`, else computed from the key itself.
    /// An error for an empty key or a malformed `sha256:` value (the message never holds it).
    fn parse(key: &str) -> Result<Self, &'static str> {
        let key = key.trim();
        if key.is_empty() {
            return Err("an API key is empty");
        }
        let Some(hex) = key.strip_prefix("sha256:") else {
            return Ok(Self::of(key));
        };
        let bytes = hex.as_bytes();
        if bytes.len() != 64 || !bytes.iter().all(u8::is_ascii_hexdigit) {
            return Err("a `sha256:` API key must be followed by 64 hex digits");
        }
        let mut digest = [0u8; 32];
        for (byte, pair) in digest.iter_mut().zip(bytes.chunks(2)) {
            let text = std::str::from_utf8(pair).map_err(|_| "not hex")?;
            *byte = u8::from_str_radix(text, 16).map_err(|_| "not hex")?;
        }
        Ok(Self(digest))
    }

    /// `sha256:<hex>`.
    fn to_config(self) -> String {
        let hex: String = self.0.iter().map(|b| format!("{b:02x}")).collect();
        format!("sha256:{hex}")
    }
}

impl std::fmt::Debug for KeyHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("sha256:[redacted]")
    }
}

/// The configured API keys, as digests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApiKeys(pub Vec<KeyHash>);

impl ApiKeys {
    /// Adds the comma-separated keys of `text`.
    ///
    /// # Errors
    /// A message that never holds a key.
    pub fn extend_from(&mut self, text: &str) -> Result<(), &'static str> {
        for key in text.split(',').filter(|key| !key.trim().is_empty()) {
            self.0.push(KeyHash::parse(key)?);
        }
        Ok(())
    }
}

impl Serialize for ApiKeys {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.iter().map(|hash| hash.to_config()))
    }
}

impl<'de> Deserialize<'de> for ApiKeys {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = ApiKeys;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of API keys or a string of comma-separated keys")
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<ApiKeys, E> {
                let mut keys = ApiKeys::default();
                keys.extend_from(text).map_err(E::custom)?;
                Ok(keys)
            }
            // An environment variable's text is parsed into a number or a boolean when it
            // looks like one; `Config::load` reads `BEHEST_AUTH__KEYS` again as text.
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<ApiKeys, E> {
                self.visit_str(&n.to_string())
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<ApiKeys, E> {
                self.visit_str(&n.to_string())
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<ApiKeys, E> {
                self.visit_str(&n.to_string())
            }
            fn visit_bool<E: serde::de::Error>(self, b: bool) -> Result<ApiKeys, E> {
                self.visit_str(&b.to_string())
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<ApiKeys, A::Error> {
                let mut keys = ApiKeys::default();
                // Read as strings: a wrong type's error would quote the value.
                while let Some(key) = seq.next_element::<KeyText>()? {
                    keys.0
                        .push(KeyHash::parse(&key.0).map_err(serde::de::Error::custom)?);
                }
                Ok(keys)
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// One key as a string, refusing other types without quoting them.
struct KeyText(String);

impl<'de> Deserialize<'de> for KeyText {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = KeyText;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an API key (a string)")
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<KeyText, E> {
                Ok(KeyText(text.to_owned()))
            }
        }
        deserializer.deserialize_str(Visitor)
    }
}

/// `[limits]`: what one client, or all of them, may do at once. Every limit is off unless set.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Origins a browser may call the API from (CORS), e.g. `["https://app.example.com"]`;
    /// `["*"]` allows any origin; default none (same origin only).
    pub cors_allowed_origins: Vec<String>,
    /// Runs one API key may create per minute (`POST /runs`, `POST /runs/stream`), refilled
    /// evenly; beyond it `429 rate_limited` with `Retry-After`. Without keys every client
    /// shares one budget. Default: unlimited.
    pub runs_per_minute: Option<u32>,
    /// Runs a key may create at once before the per-minute rate applies; default
    /// `runs_per_minute`.
    pub runs_burst: Option<u32>,
    /// Event streams (`GET /runs/{id}/events`, `POST /runs/stream`) open at once, in total;
    /// beyond it `503 too_many_watchers`. Default: unlimited.
    pub max_watchers: Option<usize>,
    /// Event streams one API key may hold open at once; beyond it `503 too_many_watchers`.
    /// Default: unlimited.
    pub max_watchers_per_key: Option<usize>,
}

/// `[telemetry]`: Prometheus metrics and OpenTelemetry trace export.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// Record metrics and serve them at `/metrics` (Prometheus text format); default true.
    pub metrics: bool,
    /// OTLP/HTTP (protobuf) collector base URL, e.g. `http://127.0.0.1:4318`; spans go to
    /// `<it>/v1/traces`. Unset: the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (the whole
    /// URL) or `OTEL_EXPORTER_OTLP_ENDPOINT` (a base URL) turn export on; neither: no export.
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported spans; default `OTEL_SERVICE_NAME`, else `behest`.
    pub service_name: Option<String>,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            metrics: true,
            otlp_endpoint: None,
            service_name: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_hashed_and_hashes_parse() -> Result<(), &'static str> {
        let mut keys = ApiKeys::default();
        keys.extend_from("alpha, beta,,")?;
        assert_eq!(keys.0, vec![KeyHash::of("alpha"), KeyHash::of("beta")]);
        let hash = KeyHash::of("alpha").to_config();
        assert_eq!(KeyHash::parse(&hash), Ok(KeyHash::of("alpha")));
        assert!(KeyHash::parse("sha256:xyz").is_err());
        assert!(!format!("{keys:?}").contains("alpha"));
        Ok(())
    }
}
