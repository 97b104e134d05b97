//! The configured model providers and their models (no secrets), and the web console.

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use serde::Serialize;
use utoipa::ToSchema;

use super::AppState;
use crate::config::ProviderKind;

/// One model of a provider, in tokens.
#[derive(Debug, Serialize, ToSchema)]
pub struct ModelInfo {
    /// The model's name, as runs name it in `model`.
    pub name: String,
    /// Its context window, in tokens.
    pub context_window: u32,
    /// Most tokens one model call may generate.
    pub max_output_tokens: u32,
}

/// One configured provider.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProviderInfo {
    /// The provider's id, as runs name it in `provider`.
    pub id: String,
    /// Its wire format: `openai`, `anthropic` or `scripted` (the built-in model).
    #[schema(value_type = String, example = "openai")]
    pub kind: ProviderKind,
    /// Its models, sorted by name.
    pub models: Vec<ModelInfo>,
}

/// Every provider runs may use.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProviderList {
    /// The providers, sorted by id.
    pub providers: Vec<ProviderInfo>,
}

/// List the model providers and their models.
///
/// Each configured provider's id and wire format, and its models with their context windows
/// and output limits, in tokens. No URLs and no keys are shown.
#[utoipa::path(get, path = "/providers", tag = "providers",
    responses((status = 200, description = "The providers", body = ProviderList)))]
pub async fn list_providers(State(state): State<AppState>) -> axum::Json<ProviderList> {
    let mut providers: Vec<ProviderInfo> = state
        .runtime
        .providers()
        .iter()
        .map(|(id, entry)| ProviderInfo {
            id: id.clone(),
            kind: entry.config.kind,
            models: entry
                .config
                .models
                .iter()
                .map(|(name, model)| ModelInfo {
                    name: name.clone(),
                    context_window: model.context_window,
                    max_output_tokens: model.max_output_tokens,
                })
                .collect(),
        })
        .collect();
    providers.sort_by(|a, b| a.id.cmp(&b.id));
    axum::Json(ProviderList { providers })
}

/// The console's page, script and style, embedded in the binary.
const INDEX_HTML: &str = include_str!("console/index.html");
const APP_JS: &str = include_str!("console/app.js");
const STYLE_CSS: &str = include_str!("console/style.css");

/// `GET /`: the web console (not part of the API document).
pub async fn console_index() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        INDEX_HTML,
    )
}

/// `GET /console/app.js`.
pub async fn console_js() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        APP_JS,
    )
}

/// `GET /console/style.css`.
pub async fn console_css() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        STYLE_CSS,
    )
}
