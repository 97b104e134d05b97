//! A run's webhook deliveries: each delivery its webhook is owed, with every attempt.

use axum::extract::State;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::extract::Path;
use super::runs::load_run;
use super::{ApiError, AppState, Problem};
use crate::domain::WebhookDelivery;

/// A run's webhook deliveries, oldest first.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ListWebhookDeliveriesResponse {
    /// The deliveries (empty for a run without a webhook, or before its first one).
    pub deliveries: Vec<WebhookDelivery>,
}

/// List a run's webhook deliveries and their attempts.
///
/// A run with a webhook is owed one delivery when it ends (`run.completed`, `run.failed`,
/// `run.cancelled`) and one each time it starts waiting in `requires_action`
/// (`run.requires_action`). Each is written in the transaction of the event that causes it
/// and attempted until a 2xx answer or the end of the server's `[webhooks] schedule_ms`;
/// every attempt is listed with its status code, error and duration.
#[utoipa::path(get, path = "/runs/{run_id}/webhook-deliveries", tag = "runs",
    params(("run_id" = String, Path, format = Uuid, description = "Run id")),
    responses(
        (status = 200, description = "The run's deliveries, oldest first", body = ListWebhookDeliveriesResponse),
        (status = 404, description = "`run_not_found`: no such run (or the id is not a UUID)", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn list_webhook_deliveries(
    State(state): State<AppState>,
    Path(raw_id): Path<String>,
) -> Result<axum::Json<ListWebhookDeliveriesResponse>, ApiError> {
    let run = load_run(&state, &raw_id).await?;
    let deliveries = state.runtime.store().webhook_deliveries(run.id).await?;
    Ok(axum::Json(ListWebhookDeliveriesResponse { deliveries }))
}
