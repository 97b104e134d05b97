//! `GET /metrics` (the Prometheus text exposition of the runtime's metrics, see
//! `telemetry::metrics`) and the middleware that counts every HTTP request by route template.

use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::{ApiError, AppState, Problem};
use crate::telemetry;

/// Prometheus metrics.
///
/// The server's counters, gauges and histograms in the Prometheus text exposition format
/// (0.0.4): HTTP requests by route and status, runs created, active and finished by status
/// (and error class), run duration by status, runs waiting in `requires_action` with their
/// wait time by outcome and the waits that expired, open event streams, events persisted with the event log's batch size and commit time,
/// model calls with their duration and time to first token, tokens by kind, retries by error
/// class, tool executions by tool and result, doom loops, compactions by trigger and outcome,
/// the compaction circuit breaker's state, the process's resident memory, open file
/// descriptors, CPU time and threads (`process_*`) and `behest_build_info`. Like any route it needs an API key
/// when keys are configured, unless `[auth] metrics_public = true`.
#[utoipa::path(get, path = "/metrics", tag = "system",
    responses(
        (status = 200, description = "The metrics, Prometheus text format 0.0.4", body = String,
            content_type = "text/plain; version=0.0.4; charset=utf-8"),
        (status = 404, description = "`metrics_disabled`: the server runs with `[telemetry] metrics = false`", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_metrics(State(state): State<AppState>) -> Result<Response, ApiError> {
    let Some(handle) = &state.metrics else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "metrics_disabled",
            "metrics are off on this server (`[telemetry] metrics = false`)",
        ));
    };
    // The breaker lives in the store (shared by every process on it): read at each scrape.
    let breaker = state.runtime.circuit_breaker().await?;
    telemetry::metrics::circuit_breaker(breaker.is_open, breaker.consecutive_failures);
    telemetry::metrics::collect_process();
    let mut response = handle.render().into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    Ok(response)
}

/// The route template of the request a response answers (put there by [`tag_route`]).
#[derive(Debug, Clone)]
struct Route(MatchedPath);

/// Route-layer middleware: remembers the route template on the response, for
/// [`count_requests`] (which runs outside the router, where the template is not known).
pub async fn tag_route(matched: MatchedPath, request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    tag(&mut response, matched);
    response
}

/// Puts the route template on a response made where [`tag_route`] does not run (the `405`
/// of a known path: axum's route layers wrap the routes' handlers, not their method fallback).
pub fn tag(response: &mut Response, matched: MatchedPath) {
    response.extensions_mut().insert(Route(matched));
}

/// The `method` label of a request: one of the nine methods of RFC 9110 §9 and RFC 5789
/// (`PATCH`), or `other` — a client's made-up method names must not each become a series.
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::OPTIONS => "OPTIONS",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "other",
    }
}

/// Counts every request by method (`other` for a method outside RFC 9110's), route template
/// and status, and times it to the response's head. The route is `unmatched` for a path no
/// route has (`404 not_found`), and for answers made before routing: `400 duplicate_header`,
/// and a `408 request_timeout` of a body sent to an unknown path (one sent to a route keeps
/// its template). A `405` keeps its route's template.
pub async fn count_requests(request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let response = next.run(request).await;
    let route = response
        .extensions()
        .get::<Route>()
        .map_or("unmatched", |route| route.0.as_str());
    telemetry::metrics::http_request(
        method_label(&method),
        route,
        response.status().as_u16(),
        started.elapsed(),
    );
    response
}
