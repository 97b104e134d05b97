//! The HTTP surface: routes, handlers, SSE, errors and the OpenAPI document. Every public
//! route goes through utoipa-axum's `OpenApiRouter`, so the spec cannot forget one.

mod actions;
mod ag_ui;
mod agents;
pub mod auth;
mod chat;
mod compaction;
pub mod connections;
mod docs;
mod error;
mod extract;
pub mod formats;
mod heads;
pub mod limits;
mod metrics;
mod page;
mod providers;
mod runs;
mod sessions;
mod snapshots;
pub mod sse;
mod system;
mod tools;
mod webhooks;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;
use tower_http::trace::TraceLayer;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::Config;
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
    /// The keep-alive comments of the event streams (`[runtime] keep_alive_ms`).
    pub keep_alive: sse::KeepAlive,
    /// The API keys (`[auth]`); none: every route is open.
    pub auth: auth::Auth,
    /// Rate and watcher limits and the CORS allow-list (`[limits]`).
    pub limits: limits::Limits,
    /// Renders `/metrics`; `None` when metrics are off.
    pub metrics: Option<PrometheusHandle>,
    /// Time a request body may take to arrive whole (`[http] body_read_timeout_ms`).
    pub body_read_timeout: Duration,
    /// The projected renderings (`?format=`) shared by the watchers of a run.
    pub renderings: formats::Renderings,
}

impl AppState {
    /// State over a runtime with no keys, no limits and no metrics; `shutdown` ends open
    /// event streams when cancelled.
    #[must_use]
    pub fn new(runtime: Arc<Runtime>, shutdown: CancellationToken) -> Self {
        Self::with(
            runtime,
            shutdown,
            auth::Auth::default(),
            limits::Limits::new(&Default::default(), 0),
            None,
            crate::config::HttpConfig::default().body_read_timeout(),
        )
    }

    /// State over a runtime with the `[auth]`, `[limits]` and `[telemetry]` of `config`
    /// (metrics on installs the process's Prometheus recorder).
    #[must_use]
    pub fn from_config(
        runtime: Arc<Runtime>,
        shutdown: CancellationToken,
        config: &Config,
    ) -> Self {
        let auth = auth::Auth::new(&config.auth);
        let limits = limits::Limits::new(&config.limits, auth.key_count());
        let metrics = if config.telemetry.metrics {
            crate::telemetry::metrics::install()
        } else {
            None
        };
        Self::with(
            runtime,
            shutdown,
            auth,
            limits,
            metrics,
            config.http.body_read_timeout(),
        )
    }

    fn with(
        runtime: Arc<Runtime>,
        shutdown: CancellationToken,
        auth: auth::Auth,
        limits: limits::Limits,
        metrics: Option<PrometheusHandle>,
        body_read_timeout: Duration,
    ) -> Self {
        let keep_alive =
            sse::KeepAlive::new(Duration::from_millis(runtime.config().keep_alive_ms.max(1)));
        Self(Arc::new(AppInner {
            runtime,
            shutdown,
            keep_alive,
            auth,
            limits,
            metrics,
            body_read_timeout,
            renderings: formats::Renderings::default(),
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
        (name = "frontends", description = "Web frontends without an adapter: the AI SDK's `useChat` \
                                            (`/chat`) and AG-UI's `HttpAgent` (`/ag-ui`)."),
        (name = "system", description = "Health, readiness and metrics.")
    )
)]
struct ApiDoc;

/// The routes that need an API key when keys are configured: all but [`public_routes`].
fn protected_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(runs::create_run, runs::list_runs))
        .routes(routes!(runs::create_run_stream))
        .routes(routes!(runs::get_run))
        .routes(routes!(runs::get_run_output))
        .routes(routes!(runs::cancel_run))
        .routes(routes!(runs::watch_run_events))
        .routes(routes!(webhooks::list_webhook_deliveries))
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
        .routes(routes!(metrics::get_metrics))
        .routes(routes!(chat::send_chat_message))
        .routes(routes!(chat::resume_chat_stream))
        .routes(routes!(chat::stop_chat))
        .routes(routes!(ag_ui::run_ag_ui_agent))
}

/// The routes a load balancer probes: never behind a key ([`auth::PUBLIC_ROUTES`]).
fn public_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(system::get_health))
        .routes(routes!(system::get_readiness))
}

/// The OpenAPI document of [`app`], as served at `/openapi.json`.
#[must_use]
pub fn openapi() -> utoipa::openapi::OpenApi {
    let mut spec = protected_routes().split_for_parts().1;
    spec.merge(public_routes().split_for_parts().1);
    complete(spec)
}

/// What the route macros cannot say, added to every operation: any of them may answer
/// `500 internal_error` (a store failure), and each `text/event-stream` response carries
/// `x-itemSchema`, the OpenAPI 3.2 `itemSchema` of an SSE event (`id`, `event`, and `data`
/// whose JSON is an `AgentEvent`), next to the 3.1 `schema` that already names `AgentEvent`
/// (for `/chat` and `/ag-ui`: `id` and `data`, a frame of the AI SDK's or AG-UI's stream).
/// Every operation but the public probes states the bearer key and its `401`.
fn complete(mut spec: utoipa::openapi::OpenApi) -> utoipa::openapi::OpenApi {
    use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
    secure(&mut spec);
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
    // The web-frontend routes speak the AI SDK's and AG-UI's frames: no `event:` line, an id
    // `N` or `N.j`, and a chunk or event of that protocol (or `[DONE]`) as data.
    let frontend_item_schema = serde_json::json!({
        "type": "object",
        "required": ["data"],
        "properties": {
            "id": {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?$",
                   "description": "The frame's cursor: `N`, or `N.j` for frame `j` of event `N`"},
            "data": {"type": "string",
                     "description": "One AI SDK UI message chunk or AG-UI event as JSON, or `[DONE]`"}
        }
    });
    for (path, item) in &mut spec.paths.paths {
        let frontend = path == "/chat" || path.starts_with("/chat/") || path == "/ag-ui";
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
                        .insert(
                            "x-itemSchema".to_owned(),
                            if frontend {
                                frontend_item_schema.clone()
                            } else {
                                item_schema.clone()
                            },
                        );
                }
            }
        }
    }
    spec
}

/// Adds the security schemes (`bearer_auth`; `access_token` in the query, for the event
/// stream only) and, on every operation that needs a key, its requirement and its `401`.
fn secure(spec: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::security::{
        ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
    };
    use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
    let components = spec.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "bearer_auth",
        SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .description(Some(
                    "An API key of `[auth] keys` (or `keys_env`) as `Authorization: Bearer \
                     <key>`; required by every route but `/healthz` and `/readyz` when keys \
                     are configured",
                ))
                .build(),
        ),
    );
    components.add_security_scheme(
        "access_token",
        SecurityScheme::ApiKey(ApiKey::Query(ApiKeyValue::with_description(
            auth::ACCESS_TOKEN,
            "The API key as `?access_token=<key>`, for `GET /runs/{run_id}/events` only (a \
             browser `EventSource` cannot set headers); never logged",
        ))),
    );
    let unauthorized = ResponseBuilder::new()
        .description(
            "`unauthorized`: no API key, or not a configured one (with `WWW-Authenticate: \
             Bearer`)",
        )
        .header(
            "WWW-Authenticate",
            utoipa::openapi::HeaderBuilder::new()
                .schema(
                    utoipa::openapi::ObjectBuilder::new()
                        .schema_type(utoipa::openapi::Type::String),
                )
                .description(Some(
                    "`Bearer realm=\"behest\"`, with `error=\"invalid_token\"` when a key was sent",
                ))
                .build(),
        )
        .content(
            "application/problem+json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("Problem")))
                .build(),
        )
        .build();
    for (path, item) in &mut spec.paths.paths {
        if auth::PUBLIC_ROUTES.contains(&path.as_str()) {
            continue;
        }
        let bearer = SecurityRequirement::new("bearer_auth", Vec::<String>::new());
        let requirements = if path == auth::EVENTS_ROUTE {
            vec![
                bearer,
                SecurityRequirement::new("access_token", Vec::<String>::new()),
            ]
        } else {
            vec![bearer]
        };
        let operations = [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.patch,
        ];
        for operation in operations.into_iter().flatten() {
            operation.security = Some(requirements.clone());
            operation
                .responses
                .responses
                .entry("401".to_owned())
                .or_insert_with(|| RefOr::T(unauthorized.clone()));
        }
    }
}

/// The whole HTTP app over `state`: the API (behind the API keys), the probes, the console and
/// `/docs` (public, static), `/openapi.json`; every request counted in the metrics, traced
/// with its secrets redacted ([`auth::redacted_uri`]), answered by the CORS allow-list, and
/// given `[http] body_read_timeout_ms` to send its body.
pub fn app(state: AppState) -> Router {
    let max_body = state.runtime.config().max_body_bytes;
    let (protected, mut spec) = protected_routes().split_for_parts();
    let (public, public_spec) = public_routes().split_for_parts();
    spec.merge(public_spec);
    let spec = Arc::new(complete(spec));
    let cors = state.limits.cors();
    let router = protected
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_key,
        ))
        .merge(public)
        .merge(docs::router())
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
        .route_layer(axum::middleware::from_fn(metrics::tag_route))
        .fallback(system::not_found)
        .method_not_allowed_fallback(system::method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(axum::Extension(extract::BodyLimit(max_body)));
    let router = match cors {
        Some(cors) => router.layer(cors),
        None => router,
    };
    router
        .layer(axum::middleware::from_fn(heads::refuse_repeated_headers))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            connections::limit_body_time,
        ))
        .layer(axum::middleware::from_fn(metrics::count_requests))
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(|request: &axum::http::Request<axum::body::Body>| {
                    tracing::debug_span!(
                        "request",
                        method = %request.method(),
                        uri = %auth::redacted_uri(request.uri()),
                        version = ?request.version(),
                    )
                })
                .on_failure(log_failure),
        )
        .with_state(state)
}

/// How a 5xx answer is logged (tower-http logs every one at ERROR by default): a `503`
/// (`shutting_down` during a drain, `too_many_watchers`, a `/readyz` probe that is not ready)
/// is the server saying "not now", logged at INFO; any other failure (a `500`, a `502`, a
/// response body's error) at ERROR, as before.
fn log_failure(
    failure: tower_http::classify::ServerErrorsFailureClass,
    latency: Duration,
    _span: &tracing::Span,
) {
    use tower_http::classify::ServerErrorsFailureClass;
    let latency_ms = latency.as_millis();
    match failure {
        ServerErrorsFailureClass::StatusCode(status)
            if status == axum::http::StatusCode::SERVICE_UNAVAILABLE =>
        {
            tracing::info!(%status, latency_ms, "answered 503: not now");
        }
        ServerErrorsFailureClass::StatusCode(status) => {
            tracing::error!(%status, latency_ms, "response failed");
        }
        ServerErrorsFailureClass::Error(error) => {
            tracing::error!(%error, latency_ms, "response failed");
        }
    }
}
