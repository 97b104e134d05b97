//! The HTTP surface: routes, handlers, SSE, errors and the OpenAPI document. Every public
//! route goes through utoipa-axum's `OpenApiRouter`, so the spec cannot forget one.

mod actions;
mod agents;
mod compaction;
mod error;
mod extract;
mod page;
mod providers;
mod runs;
mod sessions;
mod snapshots;
mod system;
mod tools;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use tokio_util::sync::CancellationToken;
use tower_http::trace::TraceLayer;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::runtime::Runtime;

pub use error::{ApiError, Problem};

/// Shared state of every handler.
#[derive(Clone, Debug)]
pub struct AppState(Arc<AppInner>);

/// What [`AppState`] holds.
#[derive(Debug)]
pub struct AppInner {
    /// The runtime.
    pub runtime: Arc<Runtime>,
    /// Cancelled at shutdown: open event streams end.
    pub shutdown: CancellationToken,
    /// Interval of SSE keep-alive comments.
    pub keep_alive: Duration,
}

impl AppState {
    /// State over a runtime; `shutdown` ends open event streams when cancelled.
    #[must_use]
    pub fn new(runtime: Arc<Runtime>, shutdown: CancellationToken) -> Self {
        let keep_alive = Duration::from_millis(runtime.config().keep_alive_ms.max(1));
        Self(Arc::new(AppInner {
            runtime,
            shutdown,
            keep_alive,
        }))
    }
}

impl std::ops::Deref for AppState {
    type Target = AppInner;
    fn deref(&self) -> &AppInner {
        &self.0
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "behest",
        description = "Agent runtime server: runs over HTTP/JSON, one durable event log, \
                       Server-Sent Events with exact resume (`Last-Event-ID`).",
        license(name = "MIT OR Apache-2.0", identifier = "MIT OR Apache-2.0")
    ),
    tags(
        (name = "runs", description = "RunService: create, list, read, cancel and watch runs."),
        (name = "sessions", description = "Sessions and their message history."),
        (name = "compaction", description = "CompactionService: how sessions are kept inside the model's \
                                             context window, and the circuit breaker that stops a failing summariser."),
        (name = "snapshots", description = "SnapshotService: each run's state at its last iteration \
                                            boundary, kept after it ends until retention removes it."),
        (name = "agents", description = "Agent presets: provider, model, instructions, parameters, \
                                         tools and limits a run can start from."),
        (name = "tools", description = "The tools runs may call."),
        (name = "providers", description = "The model providers runs may use."),
        (name = "system", description = "Health and the API description.")
    )
)]
struct ApiDoc;

fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(runs::create_run, runs::list_runs))
        .routes(routes!(runs::create_run_stream))
        .routes(routes!(runs::get_run))
        .routes(routes!(runs::get_run_output))
        .routes(routes!(runs::cancel_run))
        .routes(routes!(runs::watch_run_events))
        .routes(routes!(actions::submit_tool_outputs))
        .routes(routes!(actions::submit_approvals))
        .routes(routes!(sessions::list_sessions, sessions::create_session))
        .routes(routes!(
            sessions::get_session,
            sessions::delete_session,
            sessions::update_session
        ))
        .routes(routes!(sessions::list_session_messages))
        .routes(routes!(sessions::compact_session))
        .routes(routes!(
            compaction::get_compaction_config,
            compaction::replace_compaction_config,
            compaction::update_compaction_config
        ))
        .routes(routes!(compaction::get_circuit_breaker))
        .routes(routes!(compaction::reset_circuit_breaker))
        .routes(routes!(snapshots::list_snapshots))
        .routes(routes!(snapshots::get_snapshot, snapshots::delete_snapshot))
        .routes(routes!(agents::list_agents))
        .routes(routes!(tools::list_tools))
        .routes(routes!(providers::list_providers))
        .routes(routes!(system::get_health))
        .routes(routes!(system::get_readiness))
}

/// The OpenAPI document of [`app`], as served at `/openapi.json`.
#[must_use]
pub fn openapi() -> utoipa::openapi::OpenApi {
    complete(router().split_for_parts().1)
}

/// What the route macros cannot say, added to every operation: any of them may answer
/// `500 internal_error` (a store failure), and each `text/event-stream` response carries
/// `x-itemSchema`, the OpenAPI 3.2 `itemSchema` of an SSE event (`id`, `event`, and `data`
/// whose JSON is an `AgentEvent`), next to the 3.1 `schema` that already names `AgentEvent`.
fn complete(mut spec: utoipa::openapi::OpenApi) -> utoipa::openapi::OpenApi {
    use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
    let internal = ResponseBuilder::new()
        .description("`internal_error`: the server failed (logged); retry later")
        .content(
            "application/problem+json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("Problem")))
                .build(),
        )
        .build();
    let item_schema = serde_json::json!({
        "type": "object",
        "required": ["id", "event", "data"],
        "properties": {
            "id": {"type": "string", "pattern": "^[0-9]+$", "description": "The event's `sequence`"},
            "event": {"type": "string", "description": "The event's `type`"},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"$ref": "#/components/schemas/AgentEvent"}
            }
        }
    });
    for item in spec.paths.paths.values_mut() {
        let operations = [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.patch,
        ];
        for operation in operations.into_iter().flatten() {
            let responses = &mut operation.responses.responses;
            responses
                .entry("500".to_owned())
                .or_insert_with(|| RefOr::T(internal.clone()));
            for response in responses.values_mut() {
                let RefOr::T(response) = response else {
                    continue;
                };
                if let Some(content) = response.content.get_mut("text/event-stream") {
                    content
                        .extensions
                        .get_or_insert_with(Default::default)
                        .insert("x-itemSchema".to_owned(), item_schema.clone());
                }
            }
        }
    }
    spec
}

/// The whole HTTP app over `state`.
pub fn app(state: AppState) -> Router {
    let max_body = state.runtime.config().max_body_bytes;
    let (router, spec) = router().split_for_parts();
    let spec = Arc::new(complete(spec));
    router
        .route(
            "/openapi.json",
            axum::routing::get(move || {
                let spec = spec.clone();
                async move { axum::Json(spec) }
            }),
        )
        .route("/", axum::routing::get(providers::console_index))
        .route("/console/app.js", axum::routing::get(providers::console_js))
        .route(
            "/console/style.css",
            axum::routing::get(providers::console_css),
        )
        .fallback(system::not_found)
        .method_not_allowed_fallback(system::method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}
