//! What one client, or all of them, may do: the CORS allow-list (tower-http), the per-key rate
//! of run creation (governor, GCRA: `429 rate_limited` with `Retry-After`) and the caps on open
//! event streams, per key and in total (`503 too_many_watchers`). The cap on active runs is
//! the runtime's (`[runtime] max_active_runs`).

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::http::{HeaderName, HeaderValue, Method, header};
use governor::clock::{Clock, DefaultClock};
use governor::state::keyed::HashMapStateStore;
use governor::{Quota, RateLimiter};
use tower_http::cors::{AllowOrigin, CorsLayer};

use super::ApiError;
use super::auth::Caller;
use crate::config::LimitsConfig;
use crate::telemetry;

type RunLimiter = RateLimiter<Caller, HashMapStateStore<Caller>, DefaultClock>;

/// The limits of `[limits]`; cheap to clone.
#[derive(Debug, Clone)]
pub struct Limits(Arc<Inner>);

struct Inner {
    runs: Option<RunLimiter>,
    clock: DefaultClock,
    watchers: Watchers,
    cors_allowed_origins: Vec<String>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limits")
            .field("runs_limited", &self.runs.is_some())
            .field("watchers", &self.watchers)
            .field("cors_allowed_origins", &self.cors_allowed_origins)
            .finish()
    }
}

#[derive(Debug)]
struct Watchers {
    max: Option<usize>,
    max_per_key: Option<usize>,
    open: AtomicUsize,
    /// Open streams per caller: slot 0 for requests without a key, then one per key.
    per_key: Vec<AtomicUsize>,
}

impl Limits {
    /// The limits of `config` for a server with `keys` API keys.
    #[must_use]
    pub fn new(config: &LimitsConfig, keys: usize) -> Self {
        let runs = config
            .runs_per_minute
            .and_then(NonZeroU32::new)
            .map(|rate| {
                let burst = config.runs_burst.and_then(NonZeroU32::new).unwrap_or(rate);
                RateLimiter::hashmap(Quota::per_minute(rate).allow_burst(burst))
            });
        Self(Arc::new(Inner {
            runs,
            clock: DefaultClock::default(),
            watchers: Watchers {
                max: config.max_watchers,
                max_per_key: config.max_watchers_per_key,
                open: AtomicUsize::new(0),
                per_key: (0..=keys).map(|_| AtomicUsize::new(0)).collect(),
            },
            cors_allowed_origins: config.cors_allowed_origins.clone(),
        }))
    }

    /// Takes one run from `caller`'s budget.
    ///
    /// # Errors
    /// `429 rate_limited` with the seconds until the next run is allowed.
    pub fn admit_run(&self, caller: Caller) -> Result<(), ApiError> {
        let Some(limiter) = &self.0.runs else {
            return Ok(());
        };
        limiter.check_key(&caller).map_err(|not_until| {
            let wait = not_until.wait_time_from(self.0.clock.now());
            let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            ApiError::rate_limited(u32::try_from(seconds).unwrap_or(u32::MAX))
        })
    }

    /// Opens one event stream for `caller`; the permit closes it when dropped.
    ///
    /// # Errors
    /// `503 too_many_watchers` when the server's or the caller's cap is reached.
    pub fn open_watcher(&self, caller: Caller) -> Result<WatcherPermit, ApiError> {
        let watchers = &self.0.watchers;
        let slot = caller.0.map_or(0, |index| index + 1);
        let total = watchers.open.fetch_add(1, Ordering::AcqRel) + 1;
        let mine = watchers
            .per_key
            .get(slot)
            .map_or(0, |count| count.fetch_add(1, Ordering::AcqRel) + 1);
        let permit = WatcherPermit {
            limits: self.clone(),
            slot,
        };
        telemetry::metrics::sse_watchers(1.0);
        if watchers.max.is_some_and(|max| total > max) {
            return Err(ApiError::too_many_watchers(false));
        }
        if watchers.max_per_key.is_some_and(|max| mine > max) {
            return Err(ApiError::too_many_watchers(true));
        }
        Ok(permit)
    }

    /// The CORS layer of `[limits] cors_allowed_origins`; `None` when no origin is allowed.
    #[must_use]
    pub fn cors(&self) -> Option<CorsLayer> {
        let origins = &self.0.cors_allowed_origins;
        if origins.is_empty() {
            return None;
        }
        let allow = if origins.iter().any(|origin| origin == "*") {
            AllowOrigin::any()
        } else {
            AllowOrigin::list(
                origins
                    .iter()
                    .filter_map(|origin| HeaderValue::from_str(origin.trim_end_matches('/')).ok()),
            )
        };
        Some(
            CorsLayer::new()
                .allow_origin(allow)
                .allow_methods([
                    Method::GET,
                    Method::POST,
                    Method::PUT,
                    Method::PATCH,
                    Method::DELETE,
                ])
                .allow_headers([
                    header::AUTHORIZATION,
                    header::CONTENT_TYPE,
                    HeaderName::from_static("last-event-id"),
                    HeaderName::from_static("idempotency-key"),
                    HeaderName::from_static("traceparent"),
                    HeaderName::from_static("tracestate"),
                ])
                .expose_headers([
                    header::LOCATION,
                    HeaderName::from_static("x-run-id"),
                    HeaderName::from_static("idempotent-replayed"),
                    header::RETRY_AFTER,
                    header::WWW_AUTHENTICATE,
                ])
                .max_age(Duration::from_secs(600)),
        )
    }
}

/// One open event stream, counted against the caps until dropped.
#[derive(Debug)]
pub struct WatcherPermit {
    limits: Limits,
    slot: usize,
}

impl Drop for WatcherPermit {
    fn drop(&mut self) {
        let watchers = &self.limits.0.watchers;
        watchers.open.fetch_sub(1, Ordering::AcqRel);
        if let Some(count) = watchers.per_key.get(self.slot) {
            count.fetch_sub(1, Ordering::AcqRel);
        }
        telemetry::metrics::sse_watchers(-1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watcher_caps_count_open_streams() {
        let limits = Limits::new(
            &LimitsConfig {
                max_watchers: Some(3),
                max_watchers_per_key: Some(2),
                ..LimitsConfig::default()
            },
            2,
        );
        let a = Caller(Some(0));
        let b = Caller(Some(1));
        let first = limits.open_watcher(a).ok();
        let second = limits.open_watcher(a).ok();
        assert!(first.is_some() && second.is_some());
        assert!(limits.open_watcher(a).is_err(), "a third for one key");
        let third = limits.open_watcher(b).ok();
        assert!(third.is_some());
        assert!(limits.open_watcher(b).is_err(), "a fourth in total");
        drop(first);
        assert!(
            limits.open_watcher(a).is_ok(),
            "a closed stream frees its place"
        );
    }

    #[test]
    fn run_creation_is_rate_limited_per_key() {
        let limits = Limits::new(
            &LimitsConfig {
                runs_per_minute: Some(2),
                ..LimitsConfig::default()
            },
            2,
        );
        let a = Caller(Some(0));
        assert!(limits.admit_run(a).is_ok());
        assert!(limits.admit_run(a).is_ok());
        let refused = limits
            .admit_run(a)
            .err()
            .map(axum::response::IntoResponse::into_response);
        let retry_after = refused
            .as_ref()
            .and_then(|r| r.headers().get(header::RETRY_AFTER))
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        assert!(
            retry_after.is_some_and(|s| (1..=30).contains(&s)),
            "{retry_after:?}"
        );
        assert!(
            limits.admit_run(Caller(Some(1))).is_ok(),
            "another key's budget"
        );
    }
}
