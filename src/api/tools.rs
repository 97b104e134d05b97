//! The configured tools.

use axum::extract::State;
use serde::Serialize;
use utoipa::ToSchema;

use super::AppState;
use crate::tools::ToolInfo;

/// Every tool runs may call.
#[derive(Debug, Serialize, ToSchema)]
pub struct ToolList {
    /// The tools, sorted by name, with their JSON Schema and source.
    pub tools: Vec<ToolInfo>,
}

/// List the tools configured on this server.
///
/// Every tool runs may call, from MCP servers, HTTP tools and the built-in ones, with its
/// description, the JSON Schema of its arguments and where it comes from.
#[utoipa::path(get, path = "/tools", tag = "tools",
    responses((status = 200, description = "The tools", body = ToolList)))]
pub async fn list_tools(State(state): State<AppState>) -> axum::Json<ToolList> {
    axum::Json(ToolList {
        tools: state.runtime.tools().list(),
    })
}
