//! The runtime's spans with the OpenTelemetry GenAI semantic conventions
//! (<https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/>): a run is
//! `invoke_agent` (INTERNAL), a model call `chat {model}` (CLIENT), a tool execution
//! `execute_tool {tool}` (INTERNAL). behest's own attributes are under `behest.*`.

use opentelemetry::trace::SpanKind;
use opentelemetry::{KeyValue, Value};

use super::trace::{Span, TraceContext};
use crate::config::ProviderKind;
use crate::domain::{FinishReason, TokenUsage};

/// `gen_ai.provider.name` of a wire format (the conventions' well-known values).
#[must_use]
pub fn provider_name(kind: ProviderKind) -> &'static str {
    match kind {
        ProviderKind::Openai => "openai",
        ProviderKind::Anthropic => "anthropic",
        ProviderKind::Scripted => "behest.scripted",
    }
}

/// What a run span says about its run.
#[derive(Debug, Clone, Copy)]
pub struct RunInfo<'a> {
    /// The run's id.
    pub run_id: &'a str,
    /// Its session (`gen_ai.conversation.id`).
    pub session_id: &'a str,
    /// The provider id in the configuration.
    pub provider_id: &'a str,
    /// Its wire format.
    pub provider_kind: Option<ProviderKind>,
    /// The model.
    pub model: &'a str,
    /// Continued by this process after another one stopped (its parent is the first
    /// process's run span).
    pub resumed: bool,
}

/// The span of a run executing in this process: `invoke_agent`, a child of the caller's
/// `traceparent` span (or of the run span of the process it was resumed from).
#[must_use]
pub fn run(ids: TraceContext, info: &RunInfo<'_>) -> Span {
    Span::start(
        ids,
        || "invoke_agent".to_owned(),
        SpanKind::Internal,
        true,
        || {
            let mut attributes = vec![
                KeyValue::new("gen_ai.operation.name", "invoke_agent"),
                KeyValue::new("gen_ai.request.model", info.model.to_owned()),
                KeyValue::new("gen_ai.conversation.id", info.session_id.to_owned()),
                KeyValue::new("behest.run.id", info.run_id.to_owned()),
                KeyValue::new("behest.provider.id", info.provider_id.to_owned()),
                KeyValue::new("behest.run.resumed", info.resumed),
            ];
            if let Some(kind) = info.provider_kind {
                attributes.push(KeyValue::new("gen_ai.provider.name", provider_name(kind)));
            }
            attributes
        },
    )
}

/// A run span's end: its terminal status, finish reason and, when it failed, `error.type`.
pub fn end_run(
    mut span: Span,
    status: &str,
    finish_reason: Option<FinishReason>,
    error: Option<(&str, &str)>,
) {
    span.set(|| {
        let mut attributes = vec![KeyValue::new("behest.run.status", status.to_owned())];
        if let Some(reason) = finish_reason {
            attributes.push(finish_reasons(reason));
        }
        attributes
    });
    if let Some((error_type, message)) = error {
        span.fail(error_type, message);
    }
    span.end();
}

fn finish_reasons(reason: FinishReason) -> KeyValue {
    KeyValue::new(
        "gen_ai.response.finish_reasons",
        Value::Array(vec![opentelemetry::StringValue::from(reason.as_str())].into()),
    )
}

/// What a model-call span says about its call.
#[derive(Debug, Clone, Copy)]
pub struct ModelCallInfo<'a> {
    /// The provider id in the configuration.
    pub provider_id: &'a str,
    /// Its wire format.
    pub provider_kind: ProviderKind,
    /// The model.
    pub model: &'a str,
    /// The run's iteration (from 1).
    pub iteration: u32,
    /// `max_output_tokens` of the request.
    pub max_tokens: Option<u32>,
}

/// The span of one model call, a child of the run span `run`.
#[must_use]
pub fn model_call(run: &TraceContext, info: &ModelCallInfo<'_>) -> Span {
    Span::start(
        run.child(),
        || format!("chat {}", info.model),
        SpanKind::Client,
        false,
        || {
            let mut attributes = vec![
                KeyValue::new("gen_ai.operation.name", "chat"),
                KeyValue::new("gen_ai.provider.name", provider_name(info.provider_kind)),
                KeyValue::new("gen_ai.request.model", info.model.to_owned()),
                KeyValue::new("behest.provider.id", info.provider_id.to_owned()),
                KeyValue::new("behest.iteration", i64::from(info.iteration)),
            ];
            if let Some(max) = info.max_tokens {
                attributes.push(KeyValue::new("gen_ai.request.max_tokens", i64::from(max)));
            }
            attributes
        },
    )
}

/// A model-call span's result: finish reason and usage (`gen_ai.usage.*`).
pub fn model_result(
    span: &mut Span,
    finish_reason: FinishReason,
    usage: &TokenUsage,
    cache: (u64, u64),
) {
    span.set(|| {
        let int = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        vec![
            finish_reasons(finish_reason),
            KeyValue::new("gen_ai.usage.input_tokens", int(usage.input_tokens)),
            KeyValue::new("gen_ai.usage.output_tokens", int(usage.output_tokens)),
            KeyValue::new("gen_ai.usage.cache_read.input_tokens", int(cache.0)),
            KeyValue::new("gen_ai.usage.cache_creation.input_tokens", int(cache.1)),
        ]
    });
}

/// The span of one tool execution, a child of the run span `run`.
#[must_use]
pub fn tool_execution(run: &TraceContext, tool: &str, call_id: &str) -> Span {
    Span::start(
        run.child(),
        || format!("execute_tool {tool}"),
        SpanKind::Internal,
        false,
        || {
            vec![
                KeyValue::new("gen_ai.operation.name", "execute_tool"),
                KeyValue::new("gen_ai.tool.name", tool.to_owned()),
                KeyValue::new("gen_ai.tool.call.id", call_id.to_owned()),
                KeyValue::new("gen_ai.tool.type", "function"),
            ]
        },
    )
}
