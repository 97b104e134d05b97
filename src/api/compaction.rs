//! CompactionService over REST: the compaction settings (`GET`, `PUT` replace, `PATCH` JSON
//! merge patch) and the circuit breaker (read, reset).

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::ToSchema;

use super::extract::{Json, NoBody};
use super::{ApiError, AppState, Problem};
use crate::domain::{CircuitBreaker, CompactionConfig, SettingsProblem};
use crate::runtime::SettingsError;

/// Body of `PATCH /compaction`: a JSON merge patch (RFC 7396) of the settings. Only the fields
/// given change; a field set to `null` goes back to its initial value (the config file's
/// `[compaction]`, else the seed's default). The result is checked like a `PUT` body.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompactionConfigPatch {
    /// See `CompactionConfig.auto`.
    #[serde(default)]
    pub auto: Option<bool>,
    /// See `CompactionConfig.prune`.
    #[serde(default)]
    pub prune: Option<bool>,
    /// See `CompactionConfig.buffer_tokens`.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub buffer_tokens: Option<u64>,
    /// See `CompactionConfig.keep_tokens`.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub keep_tokens: Option<u64>,
    /// See `CompactionConfig.tail_turns`.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 1000)]
    pub tail_turns: Option<u32>,
    /// See `CompactionConfig.model`.
    #[serde(default)]
    pub model: Option<String>,
    /// See `CompactionConfig.provider`.
    #[serde(default)]
    pub provider: Option<String>,
    /// See `CompactionConfig.circuit_breaker_threshold`.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 1000)]
    pub circuit_breaker_threshold: Option<u32>,
}

/// What `field` must be, in words.
fn expectation(field: &str) -> &'static str {
    match field {
        "auto" | "prune" => "must be true or false",
        "buffer_tokens" | "keep_tokens" => {
            "must be a non-negative integer (tokens), or null (relative to each model's window)"
        }
        "tail_turns" => "must be an integer from 0 to 1000",
        "circuit_breaker_threshold" => "must be an integer from 1 to 1000",
        _ => "must be a string",
    }
}

fn invalid(field: &str, detail: String) -> ApiError {
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", detail).field(field)
}

/// Sets `field` of `config` from a JSON value (`null`: from `initial`, which leaves
/// `buffer_tokens` and `keep_tokens` unset unless the config file sets them).
fn set(
    config: &mut CompactionConfig,
    initial: &CompactionConfig,
    field: &str,
    value: &Value,
) -> Result<(), ApiError> {
    let wrong = || invalid(field, format!("`{field}` {}", expectation(field)));
    let small = |value: &Value| {
        value
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(wrong)
    };
    if value.is_null() {
        let initial = initial.clone();
        match field {
            "auto" => config.auto = initial.auto,
            "prune" => config.prune = initial.prune,
            "buffer_tokens" => config.buffer_tokens = initial.buffer_tokens,
            "keep_tokens" => config.keep_tokens = initial.keep_tokens,
            "tail_turns" => config.tail_turns = initial.tail_turns,
            "model" => config.model = initial.model,
            "provider" => config.provider = initial.provider,
            _ => config.circuit_breaker_threshold = initial.circuit_breaker_threshold,
        }
        return Ok(());
    }
    match field {
        "auto" => config.auto = value.as_bool().ok_or_else(wrong)?,
        "prune" => config.prune = value.as_bool().ok_or_else(wrong)?,
        "buffer_tokens" => config.buffer_tokens = Some(value.as_u64().ok_or_else(wrong)?),
        "keep_tokens" => config.keep_tokens = Some(value.as_u64().ok_or_else(wrong)?),
        "tail_turns" => config.tail_turns = small(value)?,
        "circuit_breaker_threshold" => config.circuit_breaker_threshold = small(value)?,
        "model" => config.model = value.as_str().ok_or_else(wrong)?.to_owned(),
        _ => config.provider = value.as_str().ok_or_else(wrong)?.to_owned(),
    }
    Ok(())
}

/// The settings `body` makes of `current`: every field replaced (`replace`, where each is
/// required and none may be null) or the given ones merged (RFC 7396).
fn merged(
    current: CompactionConfig,
    initial: &CompactionConfig,
    body: &Map<String, Value>,
    replace: bool,
) -> Result<CompactionConfig, ApiError> {
    if let Some(unknown) = body
        .keys()
        .find(|key| !CompactionConfig::FIELDS.contains(&key.as_str()))
    {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
            format!(
                "unknown field `{unknown}`; the body accepts {}",
                CompactionConfig::FIELDS.join(", ")
            ),
        )
        .field(unknown));
    }
    let mut config = current;
    for field in CompactionConfig::FIELDS {
        match body.get(field) {
            None if replace => {
                return Err(ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "missing_field",
                    format!(
                        "`{field}` is required: PUT replaces every setting (PATCH changes some)"
                    ),
                )
                .field(field));
            }
            None => {}
            // Null in a replacement: unset, relative to each model's window.
            Some(Value::Null) if replace && field == "buffer_tokens" => {
                config.buffer_tokens = None;
            }
            Some(Value::Null) if replace && field == "keep_tokens" => config.keep_tokens = None,
            Some(Value::Null) if replace => {
                return Err(invalid(field, format!("`{field}` {}", expectation(field))));
            }
            Some(value) => set(&mut config, initial, field, value)?,
        }
    }
    Ok(config)
}

impl From<SettingsError> for ApiError {
    fn from(error: SettingsError) -> Self {
        match error {
            SettingsError::Invalid(SettingsProblem {
                field,
                code,
                reason,
            }) => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                code,
                format!("`{field}` {reason}"),
            )
            .field(field),
            SettingsError::Store(error) => error.into(),
        }
    }
}

async fn update(
    state: &AppState,
    body: Value,
    replace: bool,
) -> Result<CompactionConfig, ApiError> {
    let Value::Object(body) = body else {
        return Err(ApiError::body_mismatch::<Value>(
            "invalid type: not an object",
        ));
    };
    let initial = state.runtime.initial_compaction_config().clone();
    state
        .runtime
        .update_compaction_config(|current| merged(current, &initial, &body, replace))
        .await
}

/// Read the compaction settings (proto `CompactionService.GetCompactionConfig`).
///
/// The settings in force: the ones stored through `PUT`/`PATCH /compaction` once there are any,
/// else the config file's `[compaction]`, else the defaults (`auto` true, `prune` false,
/// `buffer_tokens` and `keep_tokens` null: relative to each model's window, at most 20000 and
/// 8000, `tail_turns` 2, `model` and `provider` empty: the run's own,
/// `circuit_breaker_threshold` 3).
#[utoipa::path(get, path = "/compaction", tag = "compaction",
    responses((status = 200, description = "The settings in force", body = CompactionConfig)))]
pub async fn get_compaction_config(
    State(state): State<AppState>,
) -> Result<axum::Json<CompactionConfig>, ApiError> {
    Ok(axum::Json(state.runtime.compaction_config().await?))
}

/// Replace the compaction settings (proto `CompactionService.UpdateCompactionConfig`).
///
/// Every field is required (`buffer_tokens` and `keep_tokens` may be null: relative to each
/// model's window). The settings are stored (they survive a restart and win over the
/// config file's `[compaction]`) and apply from the next model call of any run. A rejected
/// request changes nothing.
#[utoipa::path(put, path = "/compaction", tag = "compaction",
    request_body(content = CompactionConfig, description = "Every setting (all eight fields required, no others)"),
    responses(
        (status = 200, description = "The settings now in force", body = CompactionConfig),
        (status = 400, description = "`malformed_json`", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "`payload_too_large`", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "`unsupported_media_type`", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`missing_field`; `invalid_field` (a wrong type, `tail_turns` over 1000, `circuit_breaker_threshold` not 1–1000, `model` without `provider` or the reverse, `buffer_tokens` or `keep_tokens` that leave no room below a configured model's `context_window − max_output_tokens − buffer_tokens`, U+0000); `unknown_provider`; `unknown_model`; `invalid_body` (not an object, an unknown field); `field` names the field", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn replace_compaction_config(
    State(state): State<AppState>,
    Json(body): Json<Value>,
) -> Result<axum::Json<CompactionConfig>, ApiError> {
    Ok(axum::Json(update(&state, body, true).await?))
}

/// Change some compaction settings (JSON merge patch, RFC 7396).
///
/// Only the fields given change; `null` restores a field's initial value. Checked, stored and
/// applied like `PUT /compaction`. `Content-Type: application/merge-patch+json` or
/// `application/json`.
#[utoipa::path(patch, path = "/compaction", tag = "compaction",
    request_body(description = "The settings to change (any of the eight; `null` restores a field's initial value)", content(
        (CompactionConfigPatch = "application/merge-patch+json"),
        (CompactionConfigPatch = "application/json"),
    )),
    responses(
        (status = 200, description = "The settings now in force", body = CompactionConfig),
        (status = 400, description = "`malformed_json`", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "`payload_too_large`", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "`unsupported_media_type`", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "As `PUT /compaction` (but no field is required): `invalid_field`, `unknown_provider`, `unknown_model`, `invalid_body`; `field` names the field", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn update_compaction_config(
    State(state): State<AppState>,
    Json(body): Json<Value>,
) -> Result<axum::Json<CompactionConfig>, ApiError> {
    Ok(axum::Json(update(&state, body, false).await?))
}

/// Read the compaction circuit breaker (proto `CompactionService.GetCircuitBreaker`).
///
/// It counts compactions that failed in a row (an error, an empty summary, a summary that does
/// not shrink the context), across runs; at `threshold` it opens and no compaction is
/// attempted until it is reset or a compaction succeeds.
#[utoipa::path(get, path = "/compaction/circuit-breaker", tag = "compaction",
    responses((status = 200, description = "The breaker's state", body = CircuitBreaker)))]
pub async fn get_circuit_breaker(
    State(state): State<AppState>,
) -> Result<axum::Json<CircuitBreaker>, ApiError> {
    Ok(axum::Json(state.runtime.circuit_breaker().await?))
}

/// Reset the compaction circuit breaker.
///
/// Closes it and clears its failure count and last error: compaction is attempted again from
/// the next model call of any run.
#[utoipa::path(post, path = "/compaction/circuit-breaker/reset", tag = "compaction",
    responses(
        (status = 200, description = "The breaker after the reset", body = CircuitBreaker),
        (status = 400, description = "`unexpected_body`: the request has a body; this route takes none", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn reset_circuit_breaker(
    State(state): State<AppState>,
    _: NoBody,
) -> Result<axum::Json<CircuitBreaker>, ApiError> {
    Ok(axum::Json(state.runtime.reset_circuit_breaker().await?))
}
