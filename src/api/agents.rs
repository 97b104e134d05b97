//! The configured agent presets (`[agents.<name>]`), which runs name in `agent`.

use axum::extract::State;
use serde::Serialize;
use utoipa::ToSchema;

use super::AppState;
use crate::domain::{DoomLoopSettings, ModelParameters, RunTool};

/// One agent preset as runs get it: every field a run's request leaves out is taken from
/// here. A preset holds no secrets (API keys are the providers', read from the environment).
#[derive(Debug, Serialize, ToSchema)]
pub struct AgentInfo {
    /// Its name, as runs give it in `agent`.
    pub name: String,
    /// What it is for.
    pub description: String,
    /// Provider id, when the preset sets one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Model, when the preset sets one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The system prompt.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// Model parameters.
    pub parameters: ModelParameters,
    /// Passed through into the provider request body.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub provider_options: Option<serde_json::Map<String, serde_json::Value>>,
    /// Its tools (server tool names and tool definitions the client executes); absent: every
    /// server tool.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<RunTool>>,
    /// Server tools whose calls wait for approval.
    pub approval: Vec<String>,
    /// Model calls per run at most; absent: the server's `runtime.max_iterations`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_iterations: Option<u32>,
    /// Time one tool call may take, in ms; absent: the server's `runtime.tool_timeout_ms`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_timeout_ms: Option<u64>,
    /// How long a run may wait in `requires_action`, in ms; absent: the server's
    /// `runtime.action_timeout_ms`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub action_timeout_ms: Option<u64>,
    /// Doom-loop detection of its runs.
    pub doom_loop: DoomLoopSettings,
}

/// Every agent preset.
#[derive(Debug, Serialize, ToSchema)]
pub struct AgentList {
    /// The presets, sorted by name.
    pub agents: Vec<AgentInfo>,
}

/// List the agent presets.
///
/// The presets runs may name in `agent` (config `[agents.<name>]`), sorted by name, with what
/// each sets: provider, model, instructions, parameters, tools, approvals, limits. No secrets:
/// a preset holds none.
#[utoipa::path(get, path = "/agents", tag = "agents",
    responses((status = 200, description = "The agent presets", body = AgentList)))]
pub async fn list_agents(State(state): State<AppState>) -> axum::Json<AgentList> {
    let base = &state.runtime.config().doom_loop;
    let agents = state
        .runtime
        .agents()
        .iter()
        .map(|(name, preset)| AgentInfo {
            name: name.clone(),
            description: preset.description.clone(),
            provider: preset.provider.clone(),
            model: preset.model.clone(),
            instructions: preset.instructions.clone(),
            parameters: preset.parameters.clone(),
            provider_options: preset.provider_options.clone(),
            tools: preset.tools.clone(),
            approval: preset.approval.clone(),
            max_iterations: preset.max_iterations,
            tool_timeout_ms: preset.tool_timeout_ms,
            action_timeout_ms: preset.action_timeout_ms,
            doom_loop: preset
                .doom_loop
                .as_ref()
                .map_or_else(|| base.clone(), |o| o.over(base)),
        })
        .collect();
    axum::Json(AgentList { agents })
}
