//! Agents: what a run is defined with and how it takes part in the loop with its client.
//!
//! - **Resolution**: a run's request is merged with its agent preset (`[agents.<name>]`) and
//!   its session's defaults (request → session → preset → server), then validated against
//!   the configured providers, models and tools; presets are checked the same way at startup.
//! - **Per-run tools**: tools a run defines are offered to the model next to the server tools;
//!   a call to one is not executed here, it is handed to the client.
//! - **The `requires_action` wait**: a turn whose calls include client tools or server tools
//!   that need approval pauses the run (`tool_calls_required`, status `requires_action`) until
//!   the client answers (`POST /runs/{id}/tool_outputs`, `/approvals`), the deadline passes, the
//!   run is cancelled, or the server stops (the wait resumes in the next process: the pending
//!   calls are on the run record and the answers in the store).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{CreateRunError, RunEmitter, Runtime};
use crate::config::{AgentPreset, ModelConfig, ProviderKind};
use crate::domain::{
    ActionAnswer, CreateRunRequest, CreateSessionRequest, MessageId, ModelParameters, PendingKind,
    PendingToolCall, RequestProblem, RequiredAction, RunDefinition, RunId, RunRecord, RunStatus,
    RunTool, Session, SessionDefaults, SessionId, ToolCall, ToolChoice, ToolChoiceMode,
};
use crate::events::{
    EventPayload, ToolApprovalDecided, ToolExecutionResult, ToolFailure, ToolSuccess,
};
use crate::provider::{ModelRequest, ToolSpec};
use crate::store::{RunChange, Signal, StoreError, SubmitOutcome};
use crate::telemetry;

use super::event_log::LogError;

/// A request merged with its preset and session: what the run is created with.
#[derive(Debug)]
pub(super) struct Resolved {
    /// The request with every field the preset or the session supplies filled in.
    pub request: CreateRunRequest,
    /// What is stored as the run's definition.
    pub definition: RunDefinition,
    /// The run's model.
    pub model: ModelConfig,
    /// What the session records of its first run (its explicit agent, provider, model,
    /// instructions), on top of what it already says.
    pub remember: SessionDefaults,
}

fn problem(problem: RequestProblem) -> CreateRunError {
    match problem {
        RequestProblem::Missing(field) => CreateRunError::MissingField(field),
        RequestProblem::Invalid { field, reason } => CreateRunError::InvalidField { field, reason },
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> CreateRunError {
    CreateRunError::InvalidField {
        field,
        reason: reason.into(),
    }
}

impl Runtime {
    /// The agent presets, by name.
    #[must_use]
    pub fn agents(&self) -> &BTreeMap<String, AgentPreset> {
        &self.agents
    }

    /// Merges the request with its agent preset and its session's defaults and validates the
    /// result. The agent is the request's, else the session's; the session's remembered
    /// values apply unless the request names another agent than the session's.
    pub(super) fn resolve(
        &self,
        request: &CreateRunRequest,
        session: Option<&Session>,
    ) -> Result<Resolved, CreateRunError> {
        let defaults = session.map(|s| &s.defaults);
        let agent = request
            .agent
            .clone()
            .or_else(|| defaults.and_then(|d| d.agent.clone()));
        let preset = match &agent {
            Some(name) => Some(
                self.agents
                    .get(name)
                    .ok_or_else(|| CreateRunError::UnknownAgent(name.clone()))?,
            ),
            None => None,
        };
        let empty = SessionDefaults::default();
        let layer = defaults
            .filter(|d| request.agent.is_none() || request.agent == d.agent)
            .unwrap_or(&empty);
        let preset_or_default = preset.cloned().unwrap_or_default();
        let mut effective = request.clone();
        effective.agent.clone_from(&agent);
        effective.provider = request
            .provider
            .clone()
            .or_else(|| layer.provider.clone())
            .or(preset_or_default.provider);
        effective.model = request
            .model
            .clone()
            .or_else(|| layer.model.clone())
            .or(preset_or_default.model);
        effective.instructions = request
            .instructions
            .clone()
            .or_else(|| layer.instructions.clone())
            .or(preset_or_default.instructions);
        effective.set_parameters(
            request
                .parameters()
                .or(&layer.parameters)
                .or(&preset_or_default.parameters),
        );
        if effective.tools.is_none() {
            effective.tools = preset_or_default.tools;
        }
        if effective.approval.is_none() && !preset_or_default.approval.is_empty() {
            effective.approval = Some(preset_or_default.approval);
        }
        effective.max_iterations = request.max_iterations.or(preset_or_default.max_iterations);
        effective.action_timeout_ms = request
            .action_timeout_ms
            .or(preset_or_default.action_timeout_ms);
        if effective.output_schema.is_none() {
            effective.output_schema = preset_or_default.output_schema;
        }
        // The request's webhook (`null`: none), else the preset's, else the server's.
        let webhook = match &request.webhook {
            Some(own) => own.clone(),
            None => preset_or_default.webhook.or_else(|| {
                self.webhooks
                    .get()
                    .and_then(|hooks| hooks.default_webhook())
            }),
        };
        effective.webhook = Some(webhook.clone());
        // The request's options go over the preset's, key by key.
        if let Some(mut options) = preset_or_default.provider_options {
            if let Some(serde_json::Value::Object(own)) = &request.provider_options {
                options.extend(own.clone());
            }
            effective.provider_options = Some(serde_json::Value::Object(options));
        }
        let model = self.validate(&effective)?;
        let instructions = effective.instructions.clone().filter(|i| !i.is_empty());
        let definition = RunDefinition {
            instructions,
            parameters: effective.parameters(),
            provider_options: match &effective.provider_options {
                Some(serde_json::Value::Object(options)) => Some(options.clone()),
                _ => None,
            },
            approval: effective.approval.clone().unwrap_or_default(),
            tool_timeout_ms: preset.and_then(|p| p.tool_timeout_ms),
            action_timeout_ms: effective.action_timeout_ms,
            doom_loop: preset
                .and_then(|p| p.doom_loop.as_ref())
                .map(|o| o.over(&self.config.doom_loop)),
            output_schema: effective.output_schema.clone(),
            webhook,
        };
        let remember = SessionDefaults {
            agent: request.agent.clone(),
            provider: request.provider.clone(),
            model: request.model.clone(),
            instructions: request.instructions.clone(),
            parameters: ModelParameters::default(),
        };
        Ok(Resolved {
            request: effective,
            definition,
            model,
            remember,
        })
    }

    /// Checks a run's request (merged with its preset and session) against the server: a
    /// provider and model that exist, parameters the model and wire format accept, server
    /// tools that exist, defined tools with compiling schemas and names of their own, an
    /// approval list of the run's server tools, a tool choice among the run's tools, provider
    /// options that set no key the adapter owns.
    pub(super) fn validate(
        &self,
        request: &CreateRunRequest,
    ) -> Result<ModelConfig, CreateRunError> {
        request
            .check(self.config.max_iterations_cap)
            .map_err(problem)?;
        let tools = request.tools.as_deref();
        let all_server: Vec<String> = match tools {
            None => self.tools.list().into_iter().map(|t| t.name).collect(),
            Some(_) => Vec::new(),
        };
        let mut offered: Vec<&str> = all_server.iter().map(String::as_str).collect();
        for (index, tool) in tools.into_iter().flatten().enumerate() {
            match tool {
                RunTool::Server(name) if !self.tools.contains(name) => {
                    return Err(CreateRunError::UnknownTool(name.clone()));
                }
                RunTool::Server(name) => offered.push(name),
                RunTool::Client(definition) => {
                    if self.tools.contains(&definition.name) {
                        return Err(invalid(
                            "tools",
                            format!(
                                "tools[{index}]: `{}` is the name of a server tool; a defined \
                                 tool needs a name of its own",
                                definition.name
                            ),
                        ));
                    }
                    if let Err(error) = crate::tools::schema::compile(&definition.parameters) {
                        return Err(invalid(
                            "tools",
                            format!("tools[{index}].parameters {error}"),
                        ));
                    }
                    offered.push(&definition.name);
                }
            }
        }
        for name in request.approval.iter().flatten() {
            let server = self.tools.contains(name);
            if !server || !offered.contains(&name.as_str()) {
                return Err(invalid(
                    "approval",
                    format!("`{name}` is not one of the run's server tools"),
                ));
            }
        }
        let forces_a_call = matches!(
            &request.tool_choice,
            Some(ToolChoice::Mode(ToolChoiceMode::Required) | ToolChoice::Tool { .. })
        );
        if forces_a_call && offered.is_empty() {
            return Err(invalid(
                "tool_choice",
                "requires a tool call, but the run has no tools",
            ));
        }
        if let Some(ToolChoice::Tool { name }) = &request.tool_choice
            && !offered.contains(&name.as_str())
        {
            return Err(invalid(
                "tool_choice",
                format!("names `{name}`, which is not among the run's tools"),
            ));
        }
        let provider = request
            .provider
            .as_deref()
            .ok_or(CreateRunError::MissingField("provider"))?;
        let model_name = request
            .model
            .as_deref()
            .ok_or(CreateRunError::MissingField("model"))?;
        let entry = self
            .providers
            .get(provider)
            .ok_or_else(|| CreateRunError::UnknownProvider(provider.to_owned()))?;
        let model = entry
            .config
            .models
            .get(model_name)
            .copied()
            .ok_or_else(|| CreateRunError::UnknownModel {
                provider: provider.to_owned(),
                model: model_name.to_owned(),
            })?;
        if let Some(input) = &request.input {
            super::images::check(input, &model, provider, model_name)?;
        }
        if let Some(max) = request.max_output_tokens
            && max > model.max_output_tokens
        {
            return Err(invalid(
                "max_output_tokens",
                format!(
                    "must be at most {}, the max_output_tokens of model `{model_name}`",
                    model.max_output_tokens
                ),
            ));
        }
        let kind = entry.config.kind;
        if kind == ProviderKind::Anthropic {
            if request.temperature.is_some_and(|t| t > 1.0) {
                return Err(invalid(
                    "temperature",
                    format!("provider `{provider}` (Anthropic) accepts 0 to 1"),
                ));
            }
            if request.seed.is_some() {
                return Err(invalid(
                    "seed",
                    format!("provider `{provider}` (Anthropic) has no seed parameter"),
                ));
            }
            if request.parameters().whitespace_stop() {
                return Err(invalid(
                    "stop",
                    format!(
                        "provider `{provider}` (Anthropic) refuses stop sequences made only of \
                         whitespace, such as \"\\n\"; its API requires a non-whitespace character"
                    ),
                ));
            }
            // Extended thinking takes no sampling changes (the API refuses them).
            if entry.config.thinking_budget_tokens.is_some()
                && (request.temperature.is_some_and(|t| t != 1.0)
                    || request.top_p.is_some_and(|p| p < 0.95))
            {
                let field = if request.temperature.is_some_and(|t| t != 1.0) {
                    "temperature"
                } else {
                    "top_p"
                };
                return Err(invalid(
                    field,
                    format!(
                        "provider `{provider}` has extended thinking on, which allows only \
                         temperature 1 and top_p from 0.95"
                    ),
                ));
            }
        }
        if let Some(schema) = &request.output_schema {
            super::structured::check_schema(schema, request.provider_options.as_ref(), kind)?;
        }
        if let Some(serde_json::Value::Object(options)) = &request.provider_options {
            let owned = crate::provider::owned_keys(kind);
            if let Some(key) = options.keys().find(|key| owned.contains(&key.as_str())) {
                return Err(invalid(
                    "provider_options",
                    format!(
                        "`{key}` is set by behest itself for provider `{provider}` (use the \
                         request's own field where there is one)"
                    ),
                ));
            }
        }
        Ok(model)
    }

    /// Checks every agent preset as a run's request naming it would be checked (without a
    /// session); a preset without provider or model leaves them to its runs.
    ///
    /// # Errors
    /// `agents.<name>: <problem>` for the first preset that would not run.
    pub fn check_agents(&self) -> Result<(), String> {
        for (name, preset) in &self.agents {
            let request = CreateRunRequest {
                agent: Some(name.clone()),
                input: Some("check".into()),
                ..CreateRunRequest::default()
            };
            match self.resolve(&request, None) {
                Ok(_) | Err(CreateRunError::MissingField("provider" | "model")) => {}
                Err(error) => return Err(format!("agents.{name}: {error}")),
            }
            let limits = [
                (
                    preset.tool_timeout_ms == Some(0),
                    "tool_timeout_ms must be at least 1",
                ),
                (
                    preset
                        .doom_loop
                        .as_ref()
                        .and_then(|d| d.threshold)
                        .is_some_and(|t| t < 2),
                    "doom_loop.threshold must be at least 2",
                ),
            ];
            if let Some((_, message)) = limits.iter().find(|(bad, _)| *bad) {
                return Err(format!("agents.{name}.{message}"));
            }
        }
        Ok(())
    }

    /// Creates a session with metadata, a title and the defaults its runs take (checked as a
    /// run's fields would be: the agent, provider and model exist, the parameters are in
    /// range).
    ///
    /// # Errors
    /// [`CreateRunError`] naming the field at fault, or the store's.
    pub async fn create_session(
        &self,
        request: CreateSessionRequest,
    ) -> Result<Session, CreateRunError> {
        request.check().map_err(problem)?;
        let defaults = request.defaults.unwrap_or_default();
        if let Some(agent) = &defaults.agent
            && !self.agents.contains_key(agent)
        {
            return Err(CreateRunError::UnknownAgent(agent.clone()));
        }
        if defaults.model.is_some() && defaults.provider.is_none() {
            return Err(invalid(
                "defaults",
                "a `model` needs its `provider`: give `defaults.provider` too",
            ));
        }
        if let Some(provider) = &defaults.provider {
            let entry = self
                .providers
                .get(provider)
                .ok_or_else(|| CreateRunError::UnknownProvider(provider.clone()))?;
            if let Some(model) = &defaults.model
                && !entry.config.models.contains_key(model)
            {
                return Err(CreateRunError::UnknownModel {
                    provider: provider.clone(),
                    model: model.clone(),
                });
            }
        }
        let now = Utc::now();
        let session = Session {
            id: SessionId::new(),
            created_at: now,
            updated_at: now,
            title: request.title,
            metadata: request.metadata.unwrap_or_else(|| serde_json::json!({})),
            defaults,
            external_id: request.external_id,
        };
        self.check_default_instructions(&session).await?;
        self.store
            .create_session(&session)
            .await
            .map_err(CreateRunError::Store)
    }

    /// Refuses session defaults that no run taking them could send: a run of the session with
    /// a one-word input, resolved as `POST /runs` resolves it (its model, `max_output_tokens`
    /// and tools from the defaults or their agent), must pass the run's own checks: its
    /// parameters against the model's, and its instructions with the tool definitions every
    /// request carries through the run's input check ([`super::compaction::check_input`]).
    /// Defaults that name no model leave the check to each run.
    ///
    /// # Errors
    /// [`CreateRunError::InvalidField`] (`defaults`, naming the parameter),
    /// [`CreateRunError::InstructionsTooLarge`].
    async fn check_default_instructions(&self, session: &Session) -> Result<(), CreateRunError> {
        let probe = CreateRunRequest {
            input: Some("x".into()),
            ..CreateRunRequest::default()
        };
        let resolved = match self.resolve(&probe, Some(session)) {
            Ok(resolved) => resolved,
            // A parameter out of the model's range (`max_output_tokens` above its own) would
            // refuse every run of the session.
            Err(CreateRunError::InvalidField { field, reason }) => {
                return Err(CreateRunError::InvalidField {
                    field: "defaults",
                    reason: format!("`{field}` {reason}"),
                });
            }
            // Defaults that do not resolve to a model are checked by each run instead.
            Err(_) => return Ok(()),
        };
        let Some(instructions) = session
            .defaults
            .instructions
            .clone()
            .filter(|i| !i.is_empty())
        else {
            return Ok(());
        };
        let max_output = resolved
            .definition
            .parameters
            .max_output_tokens
            .unwrap_or(resolved.model.max_output_tokens);
        let model = resolved.request.model.unwrap_or_default();
        let input = crate::domain::Message {
            id: MessageId::new(),
            session_id: session.id,
            run_id: RunId::new(),
            role: crate::domain::Role::User,
            content: vec![crate::domain::ContentPart::Text {
                text: "x".to_owned(),
            }],
            reasoning: Vec::new(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            tool_name: None,
            created_at: session.created_at,
            status: crate::domain::MessageStatus::default(),
        };
        super::compaction::check_input(
            input,
            Some(instructions),
            tool_specs_of(self, resolved.request.tools.as_deref()),
            &model,
            super::compaction::Window::of(resolved.model, max_output),
        )
        .await
        .map_err(|too_large| CreateRunError::InstructionsTooLarge {
            model,
            estimated: too_large.estimated,
            limit: too_large.limit,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// A run's tools and model request

/// The tools offered to the model: the run's server tools (all configured ones when it lists
/// none), then the tools it defined, in its order.
pub(super) fn tool_specs(runtime: &Runtime, record: &RunRecord) -> Vec<ToolSpec> {
    tool_specs_of(runtime, record.tools.as_deref())
}

/// [`tool_specs`] of a run with `tools` (its record's or, before it exists, its request's).
pub(super) fn tool_specs_of(runtime: &Runtime, tools: Option<&[RunTool]>) -> Vec<ToolSpec> {
    let server = crate::domain::server_tools(tools);
    let mut specs = runtime.tools().specs(server.as_deref());
    specs.extend(
        crate::domain::client_tools(tools)
            .into_iter()
            .map(|tool| ToolSpec {
                name: tool.name.clone(),
                description: tool.description.clone(),
                parameters: tool.parameters.clone(),
            }),
    );
    specs
}

/// The most tokens the run's model calls may generate: its `max_output_tokens` parameter, else
/// the model's configured maximum.
pub(super) fn max_output_tokens(record: &RunRecord, model: &ModelConfig) -> u32 {
    record
        .parameters
        .max_output_tokens
        .unwrap_or(model.max_output_tokens)
}

/// The model call of one iteration: the context and tools, with the run's instructions,
/// parameters and provider options; the output limit is the run's, else the model's. A
/// `text_only` model gets the history's images as text placeholders (`images::without_images`).
pub(super) fn model_request(
    record: &RunRecord,
    model: &ModelConfig,
    messages: Vec<crate::domain::Message>,
    tools: Vec<ToolSpec>,
    tool_choice: ToolChoice,
    structured_output: crate::config::StructuredOutputMode,
) -> ModelRequest {
    let parameters = &record.parameters;
    let messages = super::images::without_images(messages, model.text_only, &record.model);
    ModelRequest {
        model: record.model.clone(),
        messages: messages.into(),
        tools,
        tool_choice,
        max_output_tokens: Some(max_output_tokens(record, model)),
        instructions: super::structured::instructions(record, structured_output),
        temperature: parameters.temperature,
        top_p: parameters.top_p,
        stop: parameters.stop.clone().unwrap_or_default(),
        seed: parameters.seed,
        parallel_tool_calls: parameters.parallel_tool_calls,
        provider_options: record.provider_options.clone().unwrap_or_default(),
        output: super::structured::native(record, structured_output),
    }
}

/// What a run needs of its agent definition while it executes: the defined tools' compiled
/// argument schemas and which server tools wait for approval.
pub(super) struct RunAgent {
    client: HashMap<String, crate::tools::schema::ToolSchema>,
    approval: HashSet<String>,
    /// How long a wait lasts.
    timeout: Duration,
}

impl std::fmt::Debug for RunAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunAgent")
            .field("client", &self.client.keys().collect::<Vec<_>>())
            .field("approval", &self.approval)
            .finish_non_exhaustive()
    }
}

impl RunAgent {
    /// The run's defined tools (their schemas checked and compiled; a stored one that no
    /// longer passes — a run created before the checks — refuses every call's arguments with
    /// the reason) and its approval list.
    pub(super) fn of(runtime: &Runtime, record: &RunRecord) -> Self {
        let client = record
            .client_tools()
            .into_iter()
            .map(|tool| {
                let schema = crate::tools::schema::ToolSchema::new(&tool.parameters);
                (tool.name.clone(), schema)
            })
            .collect();
        let timeout_ms = record
            .action_timeout_ms
            .unwrap_or(runtime.config().action_timeout_ms);
        Self {
            client,
            approval: record.approval.iter().cloned().collect(),
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    /// How the call is answered when it is not simply executed: a client tool's call with
    /// valid arguments is handed to the client; one whose arguments fail its schema is answered
    /// with that failure; a server tool that needs approval (and whose arguments are valid)
    /// waits for it. `None`: executed now.
    fn classify(&self, runtime: &Runtime, record: &RunRecord, call: &ToolCall) -> Option<Pending> {
        if call.invalid_arguments.is_some() {
            return None;
        }
        if let Some(validator) = self.client.get(&call.name) {
            return Some(
                match crate::tools::check_arguments(&call.name, validator, &call.arguments) {
                    Ok(()) => Pending::Wait(PendingKind::ClientTool),
                    Err(error) => Pending::Answered(ToolExecutionResult::Failure(ToolFailure {
                        error: error.to_string(),
                    })),
                },
            );
        }
        let allowed = record
            .server_tools()
            .is_none_or(|tools| tools.contains(&call.name));
        let needs_approval =
            self.approval.contains(&call.name) || runtime.tools().requires_approval(&call.name);
        (allowed
            && needs_approval
            && runtime
                .tools()
                .check_arguments(&call.name, &call.arguments)
                .is_ok())
        .then_some(Pending::Wait(PendingKind::Approval))
    }
}

enum Pending {
    Wait(PendingKind),
    Answered(ToolExecutionResult),
}

/// How a call of a paused turn goes on.
#[derive(Debug, Clone)]
pub(super) enum Decision {
    /// Execute it (approved).
    Execute,
    /// Its result is known (the client's output or error, a rejection, a schema failure);
    /// `waited_ms` is how long the run waited for it in this process.
    Answered {
        result: ToolExecutionResult,
        waited_ms: u64,
    },
}

/// Why a wait ended without answers.
#[derive(Debug, thiserror::Error)]
pub(super) enum WaitError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A shutdown began: the run stays waiting, resumable.
    #[error("suspended for a shutdown")]
    Suspended,
    /// The deadline passed.
    #[error("{0}")]
    Expired(String),
}

/// What a run waiting for its client needs from the loop.
pub(super) struct Wait<'a> {
    pub runtime: &'a Arc<Runtime>,
    pub record: &'a RunRecord,
    pub emitter: &'a RunEmitter,
    pub agent: &'a RunAgent,
    /// Signalled when answers for this run are stored by this process.
    pub answered: &'a Notify,
    /// The run's cancel (a cancel stops the run's task mid-wait; the metrics tell it apart
    /// from a shutdown by it).
    pub cancel: &'a CancellationToken,
}

/// A wait in `requires_action` as the metrics see it: counted in `behest_runs_waiting` while
/// it lasts, its time recorded by outcome when it ends — `answered` or `expired` as
/// [`settle`] says, `cancelled` when a cancel stopped the run's task mid-wait. A wait a
/// shutdown or a takeover interrupts records no time: the next owner goes on waiting.
struct WaitGauge<'a> {
    started: Instant,
    cancel: &'a CancellationToken,
    outcome: Option<&'static str>,
}

impl<'a> WaitGauge<'a> {
    fn start(cancel: &'a CancellationToken) -> Self {
        telemetry::metrics::runs_waiting(1.0);
        Self {
            started: Instant::now(),
            cancel,
            outcome: None,
        }
    }
}

impl Drop for WaitGauge<'_> {
    fn drop(&mut self) {
        telemetry::metrics::runs_waiting(-1.0);
        let outcome = self
            .outcome
            .or_else(|| self.cancel.is_cancelled().then_some("cancelled"));
        if let Some(outcome) = outcome {
            telemetry::metrics::run_wait(outcome, self.started.elapsed());
        }
    }
}

/// Decides the calls of one turn that are not simply executed and, when some wait on the
/// client, pauses the run until they are answered: announces `tool_calls_required` with
/// status `requires_action` (unless the run record shows this turn's wait already, after a
/// restart), then waits for the answers in the store — woken by this process's submissions,
/// and every third of the lease time for those made through another process — until all are
/// there, the deadline (then [`WaitError::Expired`]) or a shutdown ([`WaitError::Suspended`]).
/// Returns the decision for each such call by call id.
pub(super) async fn settle(
    wait: &Wait<'_>,
    message_id: MessageId,
    calls: &[ToolCall],
) -> Result<HashMap<String, Decision>, WaitError> {
    let Wait {
        runtime,
        record,
        emitter,
        agent,
        answered,
        cancel,
    } = wait;
    let mut decisions = HashMap::new();
    let mut pending = Vec::new();
    for call in calls {
        match agent.classify(runtime, record, call) {
            None => {}
            Some(Pending::Answered(result)) => {
                decisions.insert(
                    call.id.clone(),
                    Decision::Answered {
                        result,
                        waited_ms: 0,
                    },
                );
            }
            Some(Pending::Wait(kind)) => pending.push(PendingToolCall {
                call_id: call.id.clone(),
                tool_name: call.name.clone(),
                arguments: call.arguments.clone(),
                kind,
            }),
        }
    }
    if pending.is_empty() {
        return Ok(decisions);
    }
    let started = Instant::now();
    let store = runtime.store();
    let known = store.action_answers(record.id, message_id).await?;
    let answered_before = pending
        .iter()
        .all(|call| known.iter().any(|(id, _)| *id == call.call_id));
    let action = match record
        .required_action
        .clone()
        .filter(|action| action.message_id == message_id)
    {
        Some(action) => action,
        // Answered before a restart (the run had moved on): nothing to wait for.
        None if answered_before => RequiredAction {
            message_id,
            tool_calls: pending,
            expires_at: Utc::now(),
        },
        None => {
            let expires_at = Utc::now()
                + chrono::Duration::from_std(agent.timeout).unwrap_or(chrono::Duration::MAX);
            let action = RequiredAction {
                message_id,
                tool_calls: pending,
                expires_at,
            };
            emitter
                .emit_with(
                    EventPayload::ToolCallsRequired(action.clone()),
                    RunChange {
                        status: Some(RunStatus::RequiresAction),
                        required_action: Some(action.clone()),
                        ..RunChange::default()
                    },
                )
                .await?;
            action
        }
    };
    let mut gauge = (!answered_before).then(|| WaitGauge::start(cancel));
    let tick =
        (Duration::from_millis(runtime.config().lease_ttl_ms) / 3).max(Duration::from_millis(100));
    let deadline = tokio::time::Instant::now()
        + (action.expires_at - Utc::now())
            .to_std()
            .unwrap_or(Duration::ZERO);
    let answers = loop {
        let notified = answered.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let answers = store.action_answers(record.id, message_id).await?;
        if complete(&action, &answers) {
            break answers;
        }
        tokio::select! {
            () = &mut notified => {}
            () = tokio::time::sleep(tick) => {}
            () = runtime.draining.cancelled() => return Err(WaitError::Suspended),
            () = tokio::time::sleep_until(deadline) => {
                let answers = store.close_action(record.id, message_id).await?;
                if complete(&action, &answers) {
                    break answers;
                }
                if let Some(gauge) = &mut gauge {
                    gauge.outcome = Some("expired");
                }
                let open: Vec<&str> = action
                    .tool_calls
                    .iter()
                    .filter(|call| !answers.iter().any(|(id, _)| *id == call.call_id))
                    .map(|call| call.call_id.as_str())
                    .collect();
                return Err(WaitError::Expired(format!(
                    "the run waited {} ms in requires_action and no answer came for {}",
                    agent.timeout.as_millis(),
                    open.join(", ")
                )));
            }
        }
    };
    if let Some(gauge) = &mut gauge {
        gauge.outcome = Some("answered");
    }
    drop(gauge);
    log_decisions(emitter, &action, &answers).await?;
    let waited_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    let budget = runtime.config().max_tool_output_bytes;
    for call in &action.tool_calls {
        let Some((_, answer)) = answers.iter().find(|(id, _)| *id == call.call_id) else {
            continue;
        };
        let decision = match answer {
            ActionAnswer::Approval { approve: true, .. } => Decision::Execute,
            other => Decision::Answered {
                result: answer_result(other, budget),
                waited_ms,
            },
        };
        decisions.insert(call.call_id.clone(), decision);
    }
    Ok(decisions)
}

/// Logs the approval decisions among `answers` (`tool_approval_decided`, in the action's call
/// order, one transaction) that the run's log does not hold yet (a run resumed after logging
/// them does not log them again). They move the run out of `requires_action`: every answer is
/// in.
async fn log_decisions(
    emitter: &RunEmitter,
    action: &RequiredAction,
    answers: &[(String, ActionAnswer)],
) -> Result<(), LogError> {
    let logged = emitter
        .trail()
        .turn()
        .map(|turn| turn.decisions.clone())
        .unwrap_or_default();
    let events: Vec<(EventPayload, RunChange)> = action
        .tool_calls
        .iter()
        .filter(|call| call.kind == PendingKind::Approval)
        .filter(|call| !logged.iter().any(|(id, _)| *id == call.call_id))
        .filter_map(|call| {
            let (_, answer) = answers.iter().find(|(id, _)| *id == call.call_id)?;
            let ActionAnswer::Approval {
                approve,
                reason,
                decided_by,
                api_key,
            } = answer
            else {
                return None;
            };
            Some((
                EventPayload::ToolApprovalDecided(ToolApprovalDecided {
                    call_id: call.call_id.clone(),
                    tool_name: call.tool_name.clone(),
                    approved: *approve,
                    reason: reason.clone(),
                    decided_by: decided_by.clone(),
                    api_key: *api_key,
                }),
                RunChange {
                    status: Some(RunStatus::WaitingForTools),
                    ..RunChange::default()
                },
            ))
        })
        .collect();
    if !events.is_empty() {
        emitter.emit_all(events).await?;
    }
    Ok(())
}

/// Whether every call of the action has an answer.
fn complete(action: &RequiredAction, answers: &[(String, ActionAnswer)]) -> bool {
    action
        .tool_calls
        .iter()
        .all(|call| answers.iter().any(|(id, _)| *id == call.call_id))
}

/// The tool result an answer gives the model (outputs within the tool output budget).
fn answer_result(answer: &ActionAnswer, budget: usize) -> ToolExecutionResult {
    match answer {
        ActionAnswer::Output(output) => ToolExecutionResult::Success(ToolSuccess {
            output: super::tool_exec::truncate_output(output.clone(), budget),
        }),
        ActionAnswer::Error(error) => ToolExecutionResult::Failure(ToolFailure {
            error: super::tool_exec::truncate_output(serde_json::json!(error), budget)
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        }),
        ActionAnswer::Approval { reason, .. } => ToolExecutionResult::Failure(ToolFailure {
            error: match reason.as_deref().map(str::trim) {
                Some(reason) if !reason.is_empty() => format!("rejected by the user: {reason}"),
                _ => "rejected by the user".to_owned(),
            },
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// Answers from the client

/// One answer a client posts: a tool output or an approval decision for one pending call.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The call it answers.
    pub call_id: String,
    /// The answer.
    pub answer: ActionAnswer,
}

/// What an earlier pause recorded for a re-posted answer ([`Runtime::answer`]).
enum Earlier {
    /// The same answers: a retry.
    Same,
    /// A call answered otherwise ([`AnswerError::AnsweredBefore`]).
    Otherwise(AnswerError),
}

/// Why answers were refused.
#[derive(Debug, thiserror::Error)]
pub enum AnswerError {
    /// No such run.
    #[error("no run with id {0}")]
    RunNotFound(RunId),
    /// The run does not wait for answers of this kind (any more): it runs, ended, expired,
    /// or waits for the other kind only.
    #[error("{detail}")]
    NotWaiting {
        /// The run's status.
        status: RunStatus,
        /// What it waits for instead, or why not.
        detail: String,
    },
    /// A call id the run does not wait for (with this kind of answer).
    #[error("{0}")]
    UnknownCall(String),
    /// The same call id twice in one request.
    #[error("call `{0}` is answered twice in this request")]
    DuplicateCall(String),
    /// Some calls of this kind were not answered (all must be answered at once).
    #[error("every pending call must be answered at once; missing: {}", .0.join(", "))]
    Missing(Vec<String>),
    /// The call was answered by an earlier request, with another answer (an identical
    /// re-post is accepted again: it changes nothing).
    #[error("call `{0}` was answered already, with another answer; the first answer stands")]
    Conflict(String),
    /// The run paused for this call before, was answered, and moved on; this request answers
    /// it otherwise (the same answers again are accepted again: a retry).
    #[error(
        "the run's pause at event {sequence} (tool_calls_required) was already answered and the \
         run has moved on: call `{call_id}` was answered with {answer}{}; the first answer \
         stands",
        if *.left_out { ", and this request leaves it out" } else { "" }
    )]
    AnsweredBefore {
        /// The call answered otherwise.
        call_id: String,
        /// The call was answered then and this request does not answer it (a retry must
        /// answer every call as the first request did).
        left_out: bool,
        /// The sequence of that pause's `tool_calls_required` event.
        sequence: u64,
        /// What the earlier request answered, in short (`output …`, `error "…"`,
        /// `approve: true`, or `no answer` for a call it did not answer).
        answer: String,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl Runtime {
    /// Records the client's answers to the calls a paused run waits for — tool outputs for its
    /// `client_tool` calls, or approvals for its `approval` calls (`kind`), every one of that
    /// kind at once — and wakes the run. Returns the run record as it is now.
    ///
    /// The same answers posted again (a retry after a lost response) change nothing and are
    /// accepted again, whether the run still waits or has moved on from that pause: the run
    /// record as it is now.
    ///
    /// # Errors
    /// [`AnswerError`]: the run is missing, not waiting (any more) or not for answers of this
    /// kind; a call id is unknown, repeated, or one is missing; a call already answered with
    /// another answer ([`AnswerError::Conflict`] while the run waits,
    /// [`AnswerError::AnsweredBefore`] once it has moved on).
    pub async fn answer(
        &self,
        run_id: RunId,
        kind: PendingKind,
        answers: Vec<Answer>,
    ) -> Result<RunRecord, AnswerError> {
        let posted = answers.clone();
        match self.answer_waiting(run_id, kind, answers).await {
            Err(error @ (AnswerError::NotWaiting { .. } | AnswerError::UnknownCall(_))) => {
                match self.answered_before(run_id, kind, &posted).await? {
                    Some(Earlier::Same) => Ok(self
                        .store
                        .get_run(run_id)
                        .await?
                        .ok_or(AnswerError::RunNotFound(run_id))?),
                    Some(Earlier::Otherwise(conflict)) => Err(conflict),
                    None => Err(error),
                }
            }
            other => other,
        }
    }

    /// Whether `posted` answers an earlier pause of the run, one it is no longer waiting at:
    /// the latest pause with answers of `kind` recorded for any posted call id. The same
    /// answers, call for call → [`Earlier::Same`]; else the first call answered otherwise.
    async fn answered_before(
        &self,
        run_id: RunId,
        kind: PendingKind,
        posted: &[Answer],
    ) -> Result<Option<Earlier>, StoreError> {
        let of_kind = |answer: &ActionAnswer| {
            matches!(answer, ActionAnswer::Approval { .. }) == (kind == PendingKind::Approval)
        };
        let waiting_at = self
            .store
            .get_run(run_id)
            .await?
            .filter(|run| run.status == RunStatus::RequiresAction)
            .and_then(|run| run.required_action)
            .map(|action| action.message_id);
        for pause in self.pauses(run_id).await?.iter().rev() {
            if Some(pause.message_id) == waiting_at {
                continue;
            }
            let recorded: Vec<(String, ActionAnswer)> = self
                .store
                .action_answers(run_id, pause.message_id)
                .await?
                .into_iter()
                .filter(|(_, answer)| of_kind(answer))
                .collect();
            let before = |call_id: &str| {
                recorded
                    .iter()
                    .find(|(id, _)| id == call_id)
                    .map(|(_, answer)| answer)
            };
            if !posted.iter().any(|a| before(&a.call_id).is_some()) {
                continue;
            }
            let otherwise = posted
                .iter()
                .find(|a| !before(&a.call_id).is_some_and(|before| before.same_as(&a.answer)))
                .map(|a| a.call_id.clone())
                .or_else(|| {
                    recorded
                        .iter()
                        .find(|(id, _)| !posted.iter().any(|a| a.call_id == *id))
                        .map(|(id, _)| id.clone())
                });
            return Ok(Some(match otherwise {
                None => Earlier::Same,
                Some(call_id) => Earlier::Otherwise(AnswerError::AnsweredBefore {
                    left_out: !posted.iter().any(|a| a.call_id == call_id),
                    answer: before(&call_id)
                        .map_or_else(|| "no answer".to_owned(), ActionAnswer::in_short),
                    call_id,
                    sequence: pause.sequence,
                }),
            }));
        }
        Ok(None)
    }

    /// [`Runtime::answer`] for the pause the run waits at.
    async fn answer_waiting(
        &self,
        run_id: RunId,
        kind: PendingKind,
        answers: Vec<Answer>,
    ) -> Result<RunRecord, AnswerError> {
        let record = self
            .store
            .get_run(run_id)
            .await?
            .ok_or(AnswerError::RunNotFound(run_id))?;
        let route = match kind {
            PendingKind::ClientTool => "tool outputs",
            PendingKind::Approval => "approvals",
        };
        let action = match (&record.required_action, record.status) {
            (Some(action), RunStatus::RequiresAction) => action.clone(),
            (_, status) => {
                return Err(AnswerError::NotWaiting {
                    status,
                    detail: format!("the run is {} and waits for no {route}", status.as_str()),
                });
            }
        };
        let wanted: Vec<&PendingToolCall> = action
            .tool_calls
            .iter()
            .filter(|call| call.kind == kind)
            .collect();
        if wanted.is_empty() {
            return Err(AnswerError::NotWaiting {
                status: record.status,
                detail: format!(
                    "the run waits for no {route}, only for {}",
                    match kind {
                        PendingKind::ClientTool => "approvals",
                        PendingKind::Approval => "tool outputs",
                    }
                ),
            });
        }
        let mut seen = HashSet::new();
        for answer in &answers {
            if !seen.insert(answer.call_id.as_str()) {
                return Err(AnswerError::DuplicateCall(answer.call_id.clone()));
            }
            if !wanted.iter().any(|call| call.call_id == answer.call_id) {
                let other = action
                    .tool_calls
                    .iter()
                    .any(|call| call.call_id == answer.call_id);
                return Err(AnswerError::UnknownCall(if other {
                    format!(
                        "call `{}` waits for another kind of answer, not {route}",
                        answer.call_id
                    )
                } else {
                    format!(
                        "the run waits for no call `{}` (it waits for {})",
                        answer.call_id,
                        wanted
                            .iter()
                            .map(|call| call.call_id.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                }));
            }
        }
        let missing: Vec<String> = wanted
            .iter()
            .filter(|call| !seen.contains(call.call_id.as_str()))
            .map(|call| call.call_id.clone())
            .collect();
        if !missing.is_empty() {
            return Err(AnswerError::Missing(missing));
        }
        let rows: Vec<(String, ActionAnswer)> = answers
            .into_iter()
            .map(|answer| (answer.call_id, answer.answer))
            .collect();
        let now_ms = crate::store::unix_ms(Utc::now());
        match self
            .store
            .submit_answers(run_id, action.message_id, &rows, now_ms)
            .await?
        {
            SubmitOutcome::Accepted => {}
            SubmitOutcome::NotFound => return Err(AnswerError::RunNotFound(run_id)),
            SubmitOutcome::NotWaiting(status) => {
                return Err(AnswerError::NotWaiting {
                    status,
                    detail: format!("the run is {} and waits for no {route}", status.as_str()),
                });
            }
            SubmitOutcome::Expired => {
                return Err(AnswerError::NotWaiting {
                    status: record.status,
                    detail: format!(
                        "the run's wait expired at {}; the answers came too late",
                        action.expires_at.to_rfc3339()
                    ),
                });
            }
            SubmitOutcome::AlreadyAnswered(_) => {
                // A re-post (a retry, or a concurrent identical post): idempotent when it
                // answers every call as before, else the first call answered otherwise.
                let recorded = self.store.action_answers(run_id, action.message_id).await?;
                if let Some(call_id) = rows.iter().find_map(|(call_id, answer)| {
                    let before = recorded.iter().find(|(id, _)| id == call_id);
                    (!before.is_some_and(|(_, before)| before.same_as(answer)))
                        .then(|| call_id.clone())
                }) {
                    return Err(AnswerError::Conflict(call_id));
                }
                return Ok(self.store.get_run(run_id).await?.unwrap_or(record));
            }
        }
        let local = self.active().get(&run_id).map(|run| run.answered.clone());
        match local {
            Some(answered) => answered.notify_waiters(),
            None => self.send_signal(Signal::Answers(run_id)).await,
        }
        Ok(self.store.get_run(run_id).await?.unwrap_or(record))
    }
}
