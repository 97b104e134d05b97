//! Health, readiness and the fallback for unknown routes.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use super::{ApiError, AppState};
use crate::domain::RunId;

/// Health or readiness.
#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// `ok`, or what is wrong.
    pub status: String,
}

/// Liveness: the process answers.
///
/// Always `200 {"status": "ok"}` while the process serves HTTP; it checks nothing else (see
/// `/readyz`). Never needs an API key.
#[utoipa::path(get, path = "/healthz", tag = "system",
    responses((status = 200, description = "The process is alive", body = Health)))]
pub async fn get_health() -> Json<Health> {
    Json(Health {
        status: "ok".to_owned(),
    })
}

/// Readiness: the store answers, the server is not shutting down and, on PostgreSQL, the
/// replica hears the others and holds its leases.
///
/// From the first moment of
/// a shutdown (SIGTERM/SIGINT) this answers 503 `shutting_down`, so a load balancer stops
/// sending traffic while the process drains its runs (its listener stays open meanwhile).
/// Never needs an API key.
#[utoipa::path(get, path = "/readyz", tag = "system",
    responses(
        (status = 200, description = "Ready to take runs", body = Health),
        (status = 503, description = "Not ready: `shutting_down` (with `Retry-After`: the process drains its runs and admits none), `store_unavailable` (the database does not answer), `signals_unavailable` (PostgreSQL: the connection listening for other replicas' signals failed), `leases_unconfirmed` (PostgreSQL: the replica cannot renew its runs' leases; its runs are stopped until it can)", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = Option<String>, description = "With `shutting_down`: seconds to wait before retrying")))
    ))]
pub async fn get_readiness(State(state): State<AppState>) -> Result<Json<Health>, ApiError> {
    if state.runtime.is_stopping() {
        return Err(ApiError::shutting_down());
    }
    // A cheap read proves the store answers.
    state
        .runtime
        .store()
        .get_run(RunId(uuid::Uuid::nil()))
        .await
        .map_err(|e| {
            tracing::warn!(error = %e, "readiness check failed");
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
                "the database does not answer",
            )
        })?;
    if let Some((code, detail)) = state.runtime.replica_trouble() {
        return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, code, detail));
    }
    Ok(Json(Health {
        status: "ok".to_owned(),
    }))
}

use super::Problem;

/// 405 `method_not_allowed` for a known route called with another method (counted in the
/// metrics under that route's template).
pub async fn method_not_allowed(matched: Option<axum::extract::MatchedPath>) -> Response {
    let mut response = ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route does not take that method",
    )
    .into_response();
    if let Some(matched) = matched {
        super::metrics::tag(&mut response, matched);
    }
    response
}

/// 404 `not_found` for any unknown route.
pub async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
}
