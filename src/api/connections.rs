//! Client connections: the accept loop that serves the app over HTTP/1.1 (hyper), so that no
//! connection can hold the server. A connection must send a request's whole head within
//! `[http] header_read_timeout_ms` of its accept (or of the first byte of a following
//! request), may stay idle between requests for `keep_alive_timeout_ms`, and must send a
//! body within `body_read_timeout_ms` (else `408 request_timeout`). At `max_connections`, a
//! new connection takes the place of the oldest one without a request in progress, or is
//! closed at once when every one has a request in progress. A response in progress (an event
//! stream included) is never timed out: its keep-alive comments are the server's writes.
//! At a drain, idle connections and those that never sent a whole request are closed at once;
//! the others close after their response. A request head hyper would refuse with a bare
//! status is answered with problem+json before hyper reads it (`heads.rs`).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

use super::heads::HeadCheck;
use super::{ApiError, AppState};
use crate::config::HttpConfig;

/// How long the accept loop pauses after an accept error that is not about one connection
/// (e.g. no file descriptor left), before it tries again.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);
/// How often, at most, the log says that connections beyond the cap were closed.
const CAP_WARNING_INTERVAL: Duration = Duration::from_secs(60);

/// The timeouts and the cap of [`serve`], from `[http]`.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Time to send a request's whole head.
    pub header_read_timeout: Duration,
    /// Time a connection may stay idle between two requests.
    pub keep_alive_timeout: Duration,
    /// Connections open at once at most.
    pub max_connections: usize,
}

impl ConnectionLimits {
    /// The limits of `[http]` (the cap's default computed from the open-file limit).
    #[must_use]
    pub fn new(config: &HttpConfig) -> Self {
        Self {
            header_read_timeout: config.header_read_timeout(),
            keep_alive_timeout: config.keep_alive_timeout(),
            max_connections: config.max_connections(),
        }
    }
}

/// Serves `app` on `listener` until `close` is cancelled, then waits for the open connections
/// to end: idle ones and those that never sent a whole request end at once, the others after
/// their response. From the moment `drain` is cancelled (the first shutdown signal), the same
/// happens to the connections already open, and new ones get one request each (no
/// keep-alive). Each connection gets `TCP_NODELAY` (SSE frames are small writes that Nagle
/// would hold back until the previous one is acknowledged).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    drain: CancellationToken,
    close: CancellationToken,
) {
    let mut open = OpenConnections::new(limits.max_connections);
    let connections = TaskTracker::new();
    let mut warned: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            () = close.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) if is_connection_error(&error) => continue,
            Err(error) => {
                tracing::warn!(%error, "cannot accept a connection; retrying shortly");
                tokio::select! {
                    () = close.cancelled() => break,
                    () = tokio::time::sleep(ACCEPT_ERROR_PAUSE) => continue,
                }
            }
        };
        let admitted = open.admit();
        if open.over_cap() && warned.is_none_or(|at| at.elapsed() >= CAP_WARNING_INTERVAL) {
            tracing::warn!(
                max_connections = limits.max_connections,
                evicted = open.evicted,
                refused = open.refused,
                "client connections at [http] max_connections: the oldest ones without a \
                 request in progress are closed for new ones; with none, new ones are closed"
            );
            warned = Some(Instant::now());
            open.evicted = 0;
            open.refused = 0;
        }
        let Some((activity, evict)) = admitted else {
            // Every connection is answering a request: the new one is closed at once, so its
            // descriptor is free again.
            drop(stream);
            continue;
        };
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY");
        }
        connections.spawn(serve_connection(
            stream,
            app.clone(),
            limits,
            Stops {
                drain: drain.clone(),
                close: close.clone(),
                evict,
            },
            activity,
        ));
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// The open connections in the order they were accepted, for the cap: at the cap, the oldest
/// one without a request in progress (idle, or still sending its head) is closed for the new
/// one, so that sockets that send nothing cannot keep `/healthz` out; when every one is
/// answering a request, the new one is refused.
struct OpenConnections {
    open: std::collections::VecDeque<(std::sync::Weak<Activity>, CancellationToken)>,
    max: usize,
    /// Connections closed for newer ones since the last warning.
    evicted: u64,
    /// Connections refused since the last warning.
    refused: u64,
}

impl OpenConnections {
    fn new(max: usize) -> Self {
        Self {
            open: std::collections::VecDeque::new(),
            max,
            evicted: 0,
            refused: 0,
        }
    }

    fn over_cap(&self) -> bool {
        self.evicted + self.refused > 0
    }

    /// A place for a new connection: its activity and the token that evicts it; `None` when
    /// it is refused.
    fn admit(&mut self) -> Option<(Arc<Activity>, CancellationToken)> {
        if self.open.len() >= self.max {
            // A connection's activity lives as long as its task: the ended ones are gone.
            self.open
                .retain(|(activity, _)| activity.strong_count() > 0);
        }
        if self.open.len() >= self.max {
            let oldest_waiting = self.open.iter().position(|(activity, _)| {
                activity
                    .upgrade()
                    .is_some_and(|activity| !activity.phase().is_busy())
            });
            let Some(index) = oldest_waiting else {
                self.refused += 1;
                return None;
            };
            if let Some((_, evict)) = self.open.remove(index) {
                evict.cancel();
                self.evicted += 1;
            }
        }
        let activity = Arc::new(Activity::new());
        let evict = CancellationToken::new();
        self.open
            .push_back((Arc::downgrade(&activity), evict.clone()));
        Some((activity, evict))
    }
}

/// What ends a connection besides its client and its timeouts.
struct Stops {
    /// The drain began (the first shutdown signal).
    drain: CancellationToken,
    /// The listener closes.
    close: CancellationToken,
    /// A newer connection needs its place (see [`OpenConnections`]).
    evict: CancellationToken,
}

/// An accept error about one connection (it went away before it was accepted): the next
/// accept may succeed at once.
fn is_connection_error(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// Serves one connection until it ends, times out, or a drain or close finds it without a
/// request in progress. Dropping the connection closes the socket.
async fn serve_connection(
    stream: TcpStream,
    app: Router,
    limits: ConnectionLimits,
    stops: Stops,
    activity: Arc<Activity>,
) {
    let Stops {
        drain,
        close,
        evict,
    } = stops;
    let io = TokioIo::new(Watched::new(stream, Arc::clone(&activity)));
    let requests = Arc::clone(&activity);
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let in_flight = requests.begin();
        let app = app.clone();
        async move {
            let response = app
                .oneshot(request.map(Body::new))
                .await
                .unwrap_or_else(|never| match never {});
            Ok::<_, Infallible>(response.map(|body| InFlightBody {
                body,
                _in_flight: in_flight,
            }))
        }
    });
    let draining = drain.is_cancelled();
    let connection = http1::Builder::new()
        // The timeouts are the loop's below: hyper's own header timeout would also close a
        // kept-alive connection after the (shorter) header timeout.
        .header_read_timeout(None)
        .keep_alive(!draining)
        .serve_connection(io, service);
    tokio::pin!(connection);
    let mut stopping = draining;
    let mut closing = false;
    loop {
        let deadline = activity.phase().deadline(&limits);
        let timed_out = async {
            match deadline {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            served = connection.as_mut() => {
                if let Err(error) = served {
                    tracing::debug!(%error, "client connection ended with an error");
                }
                return;
            }
            () = timed_out => {
                let phase = activity.phase();
                if phase.deadline(&limits).is_some_and(|at| at <= Instant::now()) {
                    tracing::debug!(
                        waiting_for = phase.waiting_for(),
                        "closing a client connection: timed out"
                    );
                    return;
                }
            }
            () = activity.changed.notified() => {}
            () = evict.cancelled() => {
                tracing::debug!(
                    "closing a client connection without a request in progress: \
                     [http] max_connections reached"
                );
                return;
            }
            () = drain.cancelled(), if !stopping => {
                stopping = true;
                if !activity.phase().is_busy() {
                    return;
                }
                connection.as_mut().graceful_shutdown();
            }
            () = close.cancelled(), if !closing => {
                closing = true;
                if !activity.phase().is_busy() {
                    return;
                }
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Where a connection is between requests, as its socket and its requests tell.
#[derive(Debug, Clone, Copy)]
enum Phase {
    /// A request's head is awaited since the accept, or since the first byte after an idle
    /// time.
    Head(Instant),
    /// Kept alive after a response, no byte since.
    Idle(Instant),
    /// This many requests are being answered (their responses not yet fully written).
    Busy(usize),
}

impl Phase {
    /// When the connection is closed if nothing changes; never while a request is answered.
    fn deadline(self, limits: &ConnectionLimits) -> Option<Instant> {
        match self {
            Self::Head(since) => Some(since + limits.header_read_timeout),
            Self::Idle(since) => Some(since + limits.keep_alive_timeout),
            Self::Busy(_) => None,
        }
    }

    fn is_busy(self) -> bool {
        matches!(self, Self::Busy(_))
    }

    /// For the log.
    fn waiting_for(self) -> &'static str {
        match self {
            Self::Head(_) => "a request head",
            Self::Idle(_) => "a next request (keep-alive)",
            Self::Busy(_) => "nothing",
        }
    }
}

/// A connection's [`Phase`], changed by its socket's reads and its requests, and a wake-up
/// for its loop when a change brings the deadline nearer.
struct Activity {
    phase: Mutex<Phase>,
    changed: Notify,
}

impl Activity {
    fn new() -> Self {
        Self {
            phase: Mutex::new(Phase::Head(Instant::now())),
            changed: Notify::new(),
        }
    }

    fn phase(&self) -> Phase {
        *self.phase.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn set(&self, change: impl FnOnce(Phase) -> Phase) {
        let mut phase = self.phase.lock().unwrap_or_else(PoisonError::into_inner);
        *phase = change(*phase);
        drop(phase);
        self.changed.notify_one();
    }

    /// Bytes arrived: an idle connection starts a request head.
    fn read(&self) {
        if matches!(self.phase(), Phase::Idle(_)) {
            self.set(|phase| match phase {
                Phase::Idle(_) => Phase::Head(Instant::now()),
                other => other,
            });
        }
    }

    /// A request's head was read: busy until the returned guard (held by its response's
    /// body) is dropped.
    fn begin(self: &Arc<Self>) -> InFlight {
        self.set(|phase| match phase {
            Phase::Busy(requests) => Phase::Busy(requests + 1),
            Phase::Head(_) | Phase::Idle(_) => Phase::Busy(1),
        });
        InFlight(Arc::clone(self))
    }

    fn end(&self) {
        self.set(|phase| match phase {
            Phase::Busy(requests) if requests > 1 => Phase::Busy(requests - 1),
            _ => Phase::Idle(Instant::now()),
        });
    }
}

/// A request being answered, until its response is written (or abandoned).
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// A response body that keeps its request [`InFlight`] until hyper has written it all.
struct InFlightBody {
    body: Body,
    _in_flight: InFlight,
}

impl http_body::Body for InFlightBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A client socket that tells its [`Activity`] when bytes arrive, and shows each request head
/// to a [`HeadCheck`] before hyper reads it: a head hyper would refuse with a bare status is
/// answered with problem+json here instead (see `api/heads.rs`).
struct Watched {
    stream: TcpStream,
    activity: Arc<Activity>,
    head: HeadCheck,
    /// The answer to a refused head, being sent; hyper then reads the end of the stream.
    refusal: Option<Refusal>,
}

impl Watched {
    fn new(stream: TcpStream, activity: Arc<Activity>) -> Self {
        Self {
            stream,
            activity,
            head: HeadCheck::default(),
            refusal: None,
        }
    }
}

/// How long, at most, a refused connection's remaining bytes (a body sent with the head) are
/// read and dropped after the answer, so that closing the socket with unread bytes does not
/// reset it before the client has read the answer.
const REFUSAL_DRAIN: Duration = Duration::from_secs(1);
/// How many bytes, at most, are read and dropped that way.
const REFUSAL_DRAIN_BYTES: usize = 64 * 1024;

/// A refused head's answer: written, the write side shut, what the client still sends read and
/// dropped for a while (bounded), then the end of the stream for hyper.
struct Refusal {
    answer: Bytes,
    written: usize,
    shut: bool,
    drained: usize,
    drain_until: Pin<Box<Sleep>>,
}

impl Refusal {
    fn new(answer: Bytes) -> Self {
        Self {
            answer,
            written: 0,
            shut: false,
            drained: 0,
            drain_until: Box::pin(tokio::time::sleep(REFUSAL_DRAIN)),
        }
    }

    /// Sends the answer and drains; ready once hyper may see the end of the stream (any I/O
    /// error ends it too: the client is gone).
    fn poll(&mut self, stream: &mut TcpStream, cx: &mut Context<'_>) -> Poll<()> {
        while self.written < self.answer.len() {
            match Pin::new(&mut *stream).poll_write(cx, &self.answer[self.written..]) {
                Poll::Ready(Ok(0) | Err(_)) => return Poll::Ready(()),
                Poll::Ready(Ok(written)) => self.written += written,
                Poll::Pending => return Poll::Pending,
            }
        }
        if !self.shut {
            match Pin::new(&mut *stream).poll_shutdown(cx) {
                Poll::Ready(Ok(())) => self.shut = true,
                Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Pending => return Poll::Pending,
            }
        }
        let mut scratch = [0_u8; 4096];
        while self.drained < REFUSAL_DRAIN_BYTES {
            let mut sink = ReadBuf::new(&mut scratch);
            match Pin::new(&mut *stream).poll_read(cx, &mut sink) {
                Poll::Ready(Ok(())) if !sink.filled().is_empty() => {
                    self.drained += sink.filled().len();
                }
                Poll::Ready(_) => return Poll::Ready(()),
                Poll::Pending => {
                    return if self.drain_until.as_mut().poll(cx).is_ready() {
                        Poll::Ready(())
                    } else {
                        Poll::Pending
                    };
                }
            }
        }
        Poll::Ready(())
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if let Some(refusal) = &mut this.refusal {
            // Nothing more for hyper: the end of the stream once the answer is out.
            return refusal.poll(&mut this.stream, cx).map(Ok);
        }
        let before = buf.filled().len();
        let phase = this.activity.phase();
        let read = Pin::new(&mut this.stream).poll_read(cx, buf);
        if matches!(read, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            match phase {
                Phase::Idle(_) => this.head.restart(),
                Phase::Busy(_) => this.head.stop(),
                Phase::Head(_) => {}
            }
            this.activity.read();
            if let Some(answer) = this.head.check(&buf.filled()[before..]) {
                tracing::debug!("refused a request head hyper would refuse; answered problem+json");
                buf.set_filled(before);
                let refusal = this.refusal.insert(Refusal::new(answer));
                return refusal.poll(&mut this.stream, cx).map(Ok);
            }
        }
        read
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.refusal.is_some() {
            // The client has its answer: nothing of hyper's follows it.
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if self.refusal.is_some() {
            return Poll::Ready(Ok(bufs.iter().map(|buf| buf.len()).sum()));
        }
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.refusal.as_ref().is_some_and(|refusal| refusal.shut) {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Middleware of every route: a request body not received whole within
/// `[http] body_read_timeout_ms` of the request's head is answered `408 request_timeout`
/// (problem+json, `Connection: close`), whatever the handler made of the cut body.
pub async fn limit_body_time(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    use http_body::Body as _;
    if request.body().is_end_stream() {
        return next.run(request).await;
    }
    let timeout = state.body_read_timeout;
    let expired = Arc::new(AtomicBool::new(false));
    let timed = Arc::clone(&expired);
    let request = request.map(|body| {
        Body::new(TimedBody {
            body,
            deadline: Box::pin(tokio::time::sleep(timeout)),
            expired: timed,
        })
    });
    let response = next.run(request).await;
    if !expired.load(Ordering::Acquire) {
        return response;
    }
    let mut timed_out = ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        "request_timeout",
        format!(
            "the request body was not received within {} ms ([http] body_read_timeout_ms)",
            timeout.as_millis()
        ),
    )
    .into_response();
    timed_out
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    // What the router put on its answer (the route template, for the metrics) stays.
    let mut response = response;
    *timed_out.extensions_mut() = std::mem::take(response.extensions_mut());
    timed_out
}

/// A request body that fails once its deadline passes before its end.
struct TimedBody {
    body: Body,
    deadline: Pin<Box<Sleep>>,
    expired: Arc<AtomicBool>,
}

/// The error a [`TimedBody`] ends with.
#[derive(Debug, thiserror::Error)]
#[error("the request body was not received in time")]
struct BodyTimedOut;

impl http_body::Body for TimedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Pending => {
                if this.deadline.as_mut().poll(cx).is_ready() {
                    this.expired.store(true, Ordering::Release);
                    return Poll::Ready(Some(Err(axum::Error::new(BodyTimedOut))));
                }
                Poll::Pending
            }
            ready => ready,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
