//! Server-Sent Events responses: frames rendered once upstream (the live feed's shared
//! bytes) written as they are, and keep-alive comments from one ticker shared by every open
//! stream instead of a timer per stream.

use std::convert::Infallible;
use std::future::ready;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use tokio::sync::Notify;
use tokio::time::{Instant, MissedTickBehavior};

/// An SSE comment line: ignored by clients, it keeps proxies and load balancers from closing
/// an idle stream.
const COMMENT: &[u8] = b":\n\n";

/// The keep-alive clock of every event stream of an app: one task ticks every `interval` and
/// each open stream sends a comment at each tick. A stream that has been open for `interval`
/// has sent a comment, and a client never waits longer than `interval` for a byte.
#[derive(Debug)]
pub struct KeepAlive {
    interval: Duration,
    tick: Arc<Notify>,
    ticker: OnceLock<()>,
}

impl KeepAlive {
    /// A clock ticking every `interval`; its task starts with the first stream and ends once
    /// the clock is dropped.
    #[must_use]
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            tick: Arc::new(Notify::new()),
            ticker: OnceLock::new(),
        }
    }

    /// One comment at each tick from now on, forever.
    fn comments(&self) -> impl Stream<Item = Bytes> + Send + 'static {
        self.ticker.get_or_init(|| {
            tokio::spawn(tick(Arc::downgrade(&self.tick), self.interval));
        });
        futures::stream::unfold(self.tick.clone(), |tick| async move {
            tick.notified().await;
            Some((Bytes::from_static(COMMENT), tick))
        })
    }
}

async fn tick(notify: std::sync::Weak<Notify>, interval: Duration) {
    let mut ticks = tokio::time::interval_at(Instant::now() + interval, interval);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(notify) = notify.upgrade() else {
            return;
        };
        notify.notify_waiters();
    }
}

/// A `text/event-stream` response of `frames` (each a whole SSE frame) with keep-alive
/// comments in between; it ends when `frames` does. No caching, no proxy buffering.
pub fn response<S>(frames: S, keep_alive: &KeepAlive) -> Response
where
    S: Stream<Item = Bytes> + Send + 'static,
{
    try_response(frames.map(Ok::<_, Infallible>), keep_alive)
}

/// As [`response`], for frames that may end in an error: the error aborts the response (the
/// connection is closed without the chunked terminator, so the client sees a cut, not an end).
/// The projected formats (`api/formats`) end this way at shutdown, because their readers take
/// a clean end for a finished message.
pub fn try_response<S, E>(frames: S, keep_alive: &KeepAlive) -> Response
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    // `None` marks the end of the frames: the comments alone never end the stream.
    let frames = frames.map(Some).chain(futures::stream::once(ready(None)));
    let body = futures::stream::select(frames, keep_alive.comments().map(|c| Some(Ok(c))))
        .take_while(|chunk| ready(chunk.is_some()))
        .filter_map(ready);
    let mut response = Body::from_stream(body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}
