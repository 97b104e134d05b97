//! Retries of model calls, for any provider: exponential backoff with jitter, honouring the
//! provider's `retry-after`, bounded by [`RetryConfig`], and only while the call has emitted
//! no output — text is never streamed twice.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;

use super::{ErrorClass, ModelEvent, ModelRequest, ModelStream, Provider, ProviderError};
use crate::config::RetryConfig;

/// A provider that retries the calls of `inner` that fail with a retryable
/// [`ErrorClass`] before their first [`ModelEvent`]: errors of [`Provider::stream`] itself and
/// errors that are the stream's first item. Once an event was yielded, later errors pass
/// through unchanged. Each attempt has its own timeouts.
///
/// When the first attempt fails and will be retried, [`Provider::stream`] returns a stream
/// that yields [`ModelEvent::Retrying`] (the failed attempt, its class, the pause and the
/// error's message) before each new attempt, then the events of the attempt that succeeded,
/// or the last attempt's error. When the first attempt succeeds, or fails in a way no retry
/// can help (a class that is not retryable, the last attempt, a `retry-after` beyond
/// `max_retry_after_ms`, a 2xx answer that is not an event stream), it is returned as the
/// inner provider returned it (an early error as `Err`).
#[derive(Debug)]
pub struct Retrying {
    id: String,
    inner: Arc<dyn Provider>,
    policy: RetryConfig,
}

impl Retrying {
    /// Wraps `inner` (the provider `id`, for logs) with the retry `policy`.
    #[must_use]
    pub fn new(id: &str, inner: Arc<dyn Provider>, policy: RetryConfig) -> Self {
        Self {
            id: id.to_owned(),
            inner,
            policy,
        }
    }
}

/// One attempt: the stream with its first event put back, or the error that came before any
/// event.
async fn attempt(
    inner: &dyn Provider,
    request: ModelRequest,
) -> Result<ModelStream, ProviderError> {
    let mut stream = inner.stream(request).await?;
    match stream.next().await {
        Some(Err(error)) => Err(error),
        Some(Ok(first)) => Ok(futures::stream::once(async move { Ok(first) })
            .chain(stream)
            .boxed()),
        None => Ok(futures::stream::empty().boxed()),
    }
}

/// The pause before the attempt after `attempt` failed with `error`, or `None` when it is not
/// retried.
fn plan(policy: &RetryConfig, id: &str, attempt: u32, error: &ProviderError) -> Option<Duration> {
    let wrong_answer = error.class == ErrorClass::Server
        && error
            .status
            .is_some_and(|status| (200..300).contains(&status));
    if !error.class.is_retryable() || wrong_answer || attempt >= policy.max_attempts {
        return None;
    }
    let Some(delay) = delay(policy, attempt, error.retry_after) else {
        tracing::warn!(
            provider = %id,
            class = error.class.as_str(),
            attempt,
            retry_after_ms = error.retry_after.map(|d| d.as_millis()),
            "retry-after longer than max_retry_after_ms; not retrying"
        );
        return None;
    };
    tracing::warn!(
        provider = %id,
        class = error.class.as_str(),
        status = error.status,
        attempt,
        max_attempts = policy.max_attempts,
        delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
        error = %error.message,
        "model call failed before any output; retrying"
    );
    crate::telemetry::metrics::model_retry(id, error.class.as_str());
    Some(delay)
}

fn retrying_event(attempt: u32, error: &ProviderError, delay: Duration) -> ModelEvent {
    ModelEvent::Retrying {
        attempt,
        error_class: error.class,
        delay,
        error: error.message.clone(),
    }
}

/// What the retrying stream does next.
enum Next {
    /// Wait, then make the attempt after `attempt`.
    Wait { attempt: u32, delay: Duration },
    /// Pass on the events of an attempt that began well.
    Stream(ModelStream),
    /// Nothing more.
    Done,
}

struct State {
    id: String,
    inner: Arc<dyn Provider>,
    policy: RetryConfig,
    request: ModelRequest,
    next: Next,
}

#[async_trait]
impl Provider for Retrying {
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ProviderError> {
        let error = match attempt(self.inner.as_ref(), request.clone()).await {
            Ok(stream) => return Ok(stream),
            Err(error) => error,
        };
        let Some(delay) = plan(&self.policy, &self.id, 1, &error) else {
            return Err(error);
        };
        let first = retrying_event(1, &error, delay);
        let state = State {
            id: self.id.clone(),
            inner: Arc::clone(&self.inner),
            policy: self.policy,
            request,
            next: Next::Wait { attempt: 1, delay },
        };
        let rest = futures::stream::unfold(state, |mut state| async move {
            loop {
                match std::mem::replace(&mut state.next, Next::Done) {
                    Next::Done => return None,
                    Next::Stream(mut stream) => {
                        let item = stream.next().await?;
                        state.next = Next::Stream(stream);
                        return Some((item, state));
                    }
                    Next::Wait {
                        attempt: failed,
                        delay,
                    } => {
                        tokio::time::sleep(delay).await;
                        let current = failed + 1;
                        match attempt(state.inner.as_ref(), state.request.clone()).await {
                            Ok(stream) => state.next = Next::Stream(stream),
                            Err(error) => {
                                return match plan(&state.policy, &state.id, current, &error) {
                                    Some(delay) => {
                                        state.next = Next::Wait {
                                            attempt: current,
                                            delay,
                                        };
                                        Some((Ok(retrying_event(current, &error, delay)), state))
                                    }
                                    None => Some((Err(error), state)),
                                };
                            }
                        }
                    }
                }
            }
        });
        Ok(futures::stream::once(async move { Ok(first) })
            .chain(rest)
            .boxed())
    }
}

/// The pause before retry number `retry` (1 for the first): the provider's `retry_after`
/// when given (`None` when it exceeds `max_retry_after_ms`), else
/// `initial_backoff_ms * 2^(retry - 1)` capped at `max_backoff_ms`, with equal jitter (a
/// uniform pick between half and all of it) when enabled.
#[must_use]
pub fn delay(policy: &RetryConfig, retry: u32, retry_after: Option<Duration>) -> Option<Duration> {
    if let Some(after) = retry_after {
        return (after <= Duration::from_millis(policy.max_retry_after_ms)).then_some(after);
    }
    let factor = 1u64
        .checked_shl(retry.saturating_sub(1))
        .unwrap_or(u64::MAX);
    let ms = policy
        .initial_backoff_ms
        .saturating_mul(factor)
        .min(policy.max_backoff_ms);
    let ms = if policy.jitter {
        let half = ms / 2;
        half + fastrand::u64(0..=ms - half)
    } else {
        ms
    };
    Some(Duration::from_millis(ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(jitter: bool) -> RetryConfig {
        RetryConfig {
            max_attempts: 10,
            initial_backoff_ms: 500,
            max_backoff_ms: 8_000,
            jitter,
            max_retry_after_ms: 60_000,
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let delays: Vec<_> = (1..=7)
            .map(|n| delay(&policy(false), n, None).map(|d| d.as_millis()))
            .collect();
        let expected = [500, 1000, 2000, 4000, 8000, 8000, 8000].map(Some);
        assert_eq!(delays, expected);
        assert_eq!(
            delay(&policy(false), 200, None),
            Some(Duration::from_millis(8_000))
        );
    }

    #[test]
    fn jitter_stays_in_the_upper_half() {
        for n in 1..=6 {
            let full = delay(&policy(false), n, None).unwrap_or_default();
            for _ in 0..50 {
                let jittered = delay(&policy(true), n, None).unwrap_or_default();
                assert!(
                    jittered >= full / 2 && jittered <= full,
                    "{jittered:?} vs {full:?}"
                );
            }
        }
    }

    #[test]
    fn retry_after_replaces_the_backoff_up_to_its_cap() {
        let p = policy(true);
        assert_eq!(
            delay(&p, 1, Some(Duration::from_secs(3))),
            Some(Duration::from_secs(3))
        );
        assert_eq!(delay(&p, 1, Some(Duration::ZERO)), Some(Duration::ZERO));
        assert_eq!(delay(&p, 1, Some(Duration::from_secs(61))), None);
    }
}
