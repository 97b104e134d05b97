//! OpenTelemetry traces: one span per run (`invoke_agent`), a child span per model call
//! (`chat {model}`) and per tool execution (`execute_tool {tool}`), named and attributed by
//! the OpenTelemetry GenAI semantic conventions (`gen_ai.operation.name`,
//! `gen_ai.provider.name`, `gen_ai.request.model`, `gen_ai.usage.*`, `gen_ai.tool.*`,
//! `error.type`), exported over OTLP/HTTP (protobuf) when configured.
//!
//! Span ids are chosen here, whether or not spans are exported, because every event carries
//! the `span_id` of the span it was emitted in: a span's id is set as the current one for
//! the futures it [`Span::scope`]s (a task-local, so concurrent tool executions each see
//! their own), and the SDK is handed that same id through [`SeededIds`]. Without export a
//! span is only its ids: nothing is recorded on the hot path.

use std::cell::Cell;
use std::future::Future;
use std::sync::{Arc, OnceLock};

use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SdkTracer, SdkTracerProvider};

use crate::config::TelemetryConfig;

/// W3C trace context of a span: what events carry in `trace_id`/`span_id`, and its parent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    /// 32 lowercase hex chars, or empty.
    pub trace_id: String,
    /// 16 lowercase hex chars, or empty.
    pub span_id: String,
    /// The parent span's id (16 hex chars: a caller's `traceparent`, or the run span a resumed
    /// run continues), or empty for a root span.
    pub parent_span_id: String,
    /// The `traceparent`'s sampled flag: an unsampled trace is not exported.
    pub sampled: bool,
}

impl Default for TraceContext {
    fn default() -> Self {
        Self {
            trace_id: String::new(),
            span_id: String::new(),
            parent_span_id: String::new(),
            sampled: true,
        }
    }
}

impl TraceContext {
    /// A child span of this one: same trace, a new span id, this span as parent.
    #[must_use]
    pub fn child(&self) -> Self {
        Self {
            trace_id: self.trace_id.clone(),
            span_id: new_span_id(),
            parent_span_id: self.span_id.clone(),
            sampled: self.sampled,
        }
    }
}

/// A new random span id: 16 lowercase hex chars.
#[must_use]
pub fn new_span_id() -> String {
    format!("{:016x}", fastrand::u64(1..))
}

static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();
static TRACER: OnceLock<SdkTracer> = OnceLock::new();

thread_local! {
    /// The ids of the span being started on this thread, handed to the SDK by [`SeededIds`].
    static SEED: Cell<Option<(TraceId, SpanId)>> = const { Cell::new(None) };
}

tokio::task_local! {
    /// The span events are emitted in (a model call's, a tool execution's).
    static CURRENT: Arc<str>;
}

/// The SDK's id generator, giving the ids this module chose for the span being started (random
/// ones for any other span).
#[derive(Debug, Default)]
struct SeededIds(RandomIdGenerator);

impl IdGenerator for SeededIds {
    fn new_trace_id(&self) -> TraceId {
        SEED.with(Cell::get)
            .map_or_else(|| self.0.new_trace_id(), |(trace_id, _)| trace_id)
    }

    fn new_span_id(&self) -> SpanId {
        SEED.with(Cell::get)
            .map_or_else(|| self.0.new_span_id(), |(_, span_id)| span_id)
    }
}

/// Why trace export could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("OpenTelemetry export: {0}")]
pub struct ExportError(String);

/// Starts exporting spans over OTLP/HTTP when `[telemetry] otlp_endpoint` or the standard
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT` is set; the batch
/// processor's standard `OTEL_BSP_*` variables apply. Returns the endpoint, or `None` when
/// export is off. Once per process.
///
/// # Errors
/// When the exporter cannot be built (a malformed endpoint).
pub fn init(config: &TelemetryConfig) -> Result<Option<String>, ExportError> {
    let from_env = [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .iter()
    .find_map(|var| std::env::var(var).ok().filter(|v| !v.trim().is_empty()));
    let endpoint = match (&config.otlp_endpoint, from_env) {
        (Some(base), _) => format!("{}/v1/traces", base.trim_end_matches('/')),
        (None, Some(from_env)) => from_env,
        (None, None) => return Ok(None),
    };
    // The exporter's HTTP client needs the process-wide rustls provider.
    crate::net::install_crypto_provider();
    let mut exporter = opentelemetry_otlp::SpanExporter::builder().with_http();
    if config.otlp_endpoint.is_some() {
        exporter = exporter.with_endpoint(endpoint.clone());
    }
    let exporter = exporter
        .build()
        .map_err(|error| ExportError(error.to_string()))?;
    let service_name = config
        .service_name
        .clone()
        .or_else(|| std::env::var("OTEL_SERVICE_NAME").ok())
        .unwrap_or_else(|| "behest".to_owned());
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service_name)
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build();
    let provider = SdkTracerProvider::builder()
        .with_id_generator(SeededIds::default())
        .with_resource(resource)
        .with_batch_exporter(exporter)
        .build();
    let tracer = opentelemetry::trace::TracerProvider::tracer(&provider, "behest");
    if PROVIDER.set(provider).is_err() || TRACER.set(tracer).is_err() {
        return Err(ExportError("already initialized".to_owned()));
    }
    Ok(Some(endpoint))
}

/// Exports the spans still queued and stops the exporter (blocks; call off the async
/// threads).
pub fn shutdown() {
    if let Some(provider) = PROVIDER.get()
        && let Err(error) = provider.shutdown()
    {
        tracing::warn!(%error, "OpenTelemetry export did not shut down cleanly");
    }
}

/// Whether spans are exported.
#[must_use]
pub fn exporting() -> bool {
    TRACER.get().is_some()
}

/// The span id events are emitted in now, when a [`Span::scope`] set one.
#[must_use]
pub fn current_span_id() -> Option<Arc<str>> {
    CURRENT.try_with(Arc::clone).ok()
}

/// One span: its ids and, when exporting, the SDK span (ended on [`Span::end`] or drop).
#[derive(Debug)]
pub struct Span {
    ids: TraceContext,
    id: Arc<str>,
    otel: Option<opentelemetry_sdk::trace::Span>,
}

impl Span {
    /// Starts a span with `ids` (its parent `remote` when it lives in another process).
    /// `attributes` is only called when spans are exported.
    pub fn start(
        ids: TraceContext,
        name: impl FnOnce() -> String,
        kind: SpanKind,
        remote_parent: bool,
        attributes: impl FnOnce() -> Vec<KeyValue>,
    ) -> Self {
        let id: Arc<str> = Arc::from(ids.span_id.as_str());
        let otel = TRACER
            .get()
            .and_then(|tracer| start_otel(tracer, &ids, name(), kind, remote_parent, attributes()));
        Self { ids, id, otel }
    }

    /// Its ids.
    #[must_use]
    pub fn ids(&self) -> &TraceContext {
        &self.ids
    }

    /// Runs `future` with this span as the one its events are emitted in.
    pub async fn scope<F: Future>(&self, future: F) -> F::Output {
        CURRENT.scope(self.id.clone(), future).await
    }

    /// Whether attributes set now are recorded (the span is exported).
    #[must_use]
    pub fn is_recording(&self) -> bool {
        self.otel.is_some()
    }

    /// Sets attributes (only called when exported).
    pub fn set(&mut self, attributes: impl FnOnce() -> Vec<KeyValue>) {
        if let Some(span) = self.otel.as_mut() {
            opentelemetry::trace::Span::set_attributes(span, attributes());
        }
    }

    /// Marks the span failed: `error.type` and an error status with `message`.
    pub fn fail(&mut self, error_type: &str, message: &str) {
        if let Some(span) = self.otel.as_mut() {
            opentelemetry::trace::Span::set_attribute(
                span,
                KeyValue::new("error.type", error_type.to_owned()),
            );
            opentelemetry::trace::Span::set_status(span, Status::error(message.to_owned()));
        }
    }

    /// Ends the span now.
    pub fn end(mut self) {
        if let Some(mut span) = self.otel.take() {
            opentelemetry::trace::Span::end(&mut span);
        }
    }
}

fn start_otel(
    tracer: &SdkTracer,
    ids: &TraceContext,
    name: String,
    kind: SpanKind,
    remote_parent: bool,
    attributes: Vec<KeyValue>,
) -> Option<opentelemetry_sdk::trace::Span> {
    let trace_id = TraceId::from_hex(&ids.trace_id).ok()?;
    let span_id = SpanId::from_hex(&ids.span_id).ok()?;
    let flags = if ids.sampled {
        TraceFlags::SAMPLED
    } else {
        TraceFlags::default()
    };
    let parent = match SpanId::from_hex(&ids.parent_span_id) {
        Ok(parent) if parent != SpanId::INVALID => {
            Context::new().with_remote_span_context(SpanContext::new(
                trace_id,
                parent,
                flags,
                remote_parent,
                TraceState::default(),
            ))
        }
        _ => Context::new(),
    };
    if !ids.sampled {
        return None;
    }
    SEED.with(|seed| seed.set(Some((trace_id, span_id))));
    let span = tracer
        .span_builder(name)
        .with_kind(kind)
        .with_attributes(attributes)
        .start_with_context(tracer, &parent);
    SEED.with(|seed| seed.set(None));
    Some(span)
}
