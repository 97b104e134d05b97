//! One model call's stream as events of the run: text, reasoning, tool calls, retries, usage.
//! Every `tool_call_started` gets its `tool_call_completed`: a call the stream started and never
//! completed is completed here with its argument text as `invalid_arguments`.

use std::time::Instant;

use futures::StreamExt;

use super::tool_exec::new_message;
use super::trail::RunTrail;
use super::{ProviderEntry, RunEmitter};
use crate::domain::{
    ContentPart, FinishReason, MessageStatus, Reasoning, Role, RunRecord, TokenUsage, ToolCall,
};
use crate::events::{
    CacheMetrics, EventPayload, MessageCommitted, ModelRetrying, ReasoningDelta, TextDelta,
    ToolCallCompleted, ToolCallDelta, ToolCallStarted,
};
use crate::provider::{ModelEvent, ModelRequest, ModelStream, ProviderError};
use crate::store::RunChange;
use crate::telemetry;

use super::event_log::LogError;

/// One model call's result.
#[derive(Debug)]
pub(super) struct ModelTurn {
    /// The answer text.
    pub text: String,
    /// The streamed reasoning text (for estimates).
    pub reasoning_text: String,
    /// The complete reasoning blocks, to store with the message.
    pub reasoning: Vec<Reasoning>,
    /// The tool calls, in the model's order.
    pub tool_calls: Vec<ToolCall>,
    /// The provider's usage; `None` when it reported none.
    pub usage: Option<TokenUsage>,
    /// Prompt-cache figures.
    pub cache: Option<CacheMetrics>,
    /// Why the model stopped.
    pub finish_reason: FinishReason,
}

impl ModelTurn {
    /// True when the model produced nothing to store: no text and no tool call.
    pub fn is_empty(&self) -> bool {
        self.text.is_empty() && self.tool_calls.is_empty()
    }
}

/// Why reading a stream failed.
#[derive(Debug, thiserror::Error)]
pub(super) enum TurnError {
    /// The call failed before any of its output (text, reasoning, a tool call) was emitted:
    /// it may be made again without repeating anything.
    #[error(transparent)]
    Rejected(ProviderError),
    /// The call failed after some output.
    #[error(transparent)]
    Provider(#[from] ProviderError),
    #[error(transparent)]
    Log(#[from] LogError),
    /// The stream ended without `Finished` (an adapter bug or a cut stream).
    #[error("the model stream ended without a finish reason")]
    NoFinish,
}

/// One model call being made: its span (a child of the run's) and its timing, for the
/// metrics. [`ModelCall::finish`] records its usage; dropped unfinished (the run stopped), its
/// span ends without a result.
pub(super) struct ModelCall {
    span: Option<telemetry::trace::Span>,
    provider: String,
    model: String,
    started: Instant,
}

impl ModelCall {
    /// Records the call's usage (reported, or estimated) and ends it as `ok`.
    pub fn finish(mut self, turn: &ModelTurn, usage: &TokenUsage) {
        let cache = turn.cache.as_ref().map_or((0, 0), |c| {
            (
                c.cache_read_input_tokens + c.cached_input_tokens,
                c.cache_creation_input_tokens,
            )
        });
        telemetry::metrics::tokens(
            &self.provider,
            &self.model,
            [
                ("input", usage.input_tokens),
                ("output", usage.output_tokens),
                ("cache_read", cache.0),
                ("cache_write", cache.1),
            ],
        );
        if let Some(mut span) = self.span.take() {
            telemetry::spans::model_result(&mut span, turn.finish_reason, usage, cache);
            span.end();
        }
        self.end("ok");
    }

    fn end(&self, outcome: &'static str) {
        telemetry::metrics::model_call(
            &self.provider,
            &self.model,
            outcome,
            self.started.elapsed(),
        );
    }

    /// Ends the call as failed with `error`.
    fn fail(mut self, error: &TurnError) {
        let class = match error {
            TurnError::Provider(error) | TurnError::Rejected(error) => error.class.as_str(),
            TurnError::Log(_) => "internal",
            TurnError::NoFinish => "transport",
        };
        if let Some(mut span) = self.span.take() {
            span.fail(class, &error.to_string());
            span.end();
        }
        self.end(class);
    }
}

/// The model call a run's task is making, kept where the run's end can read it: a call cut off
/// by a cancel or a failure before its usage was recorded gets an estimated `usage_recorded`
/// (its request's estimated size plus what it streamed) from the close-out, since the task
/// that made it may be gone by then.
#[derive(Debug, Clone)]
pub(super) struct CallInFlight {
    /// The provider id.
    pub provider: String,
    /// The model.
    pub model: String,
    /// The request's estimated size, in tokens.
    pub input_tokens: u64,
    /// When the call was made.
    pub started: Instant,
    /// The call is a compaction's summariser call (`context_compaction_started`), not the
    /// run's model call.
    pub summariser: bool,
}

/// The run's model call in flight, shared by its task and its supervisor.
pub(super) type InFlight = std::sync::Arc<std::sync::Mutex<Option<CallInFlight>>>;

/// Sets (or clears) the run's call in flight.
pub(super) fn set_in_flight(in_flight: &InFlight, call: Option<CallInFlight>) {
    *in_flight
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = call;
}

/// Counts the run's model call in flight, if any, as `interrupted` in the call metrics: a
/// shutdown or a takeover by another process stopped the run's task in the middle of it (the
/// next owner makes the call again, counted on its own).
pub(super) fn count_interrupted(in_flight: &InFlight) {
    let call = in_flight
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    if let Some(call) = call {
        telemetry::metrics::model_call(
            &call.provider,
            &call.model,
            "interrupted",
            call.started.elapsed(),
        );
    }
}

/// Records the estimated usage of the model call the run ended in, when that call was cut off
/// while streaming (no `usage_recorded` yet) and this process made it (`in_flight`): the
/// request's estimated tokens plus the text, reasoning and tool-call arguments it streamed,
/// `estimated: true`, counted in the run's `total_usage` (the run row, its snapshot, its
/// output) and in the token metrics; the call is counted as `cancelled` in the call metrics
/// when a cancel cut it (a failure counted it already). A run ended by another process after a
/// crash has no call in flight: nothing is estimated for it.
pub(super) async fn record_cut_off_usage(
    emitter: &RunEmitter,
    store: &dyn crate::store::Store,
    record: &RunRecord,
    trail: &RunTrail,
    in_flight: Option<&CallInFlight>,
    cancelled: bool,
) -> Result<(), super::end::EndError> {
    let (Some(call), Some(in_flight)) = (trail.cut_off_call(), in_flight) else {
        return Ok(());
    };
    if in_flight.summariser || call.phase != super::trail::CallPhase::Streaming {
        return Ok(());
    }
    let counter = crate::runtime::tokens::TokenCounter::for_model(&in_flight.model);
    let mut usage = counter.usage(
        in_flight.input_tokens,
        &crate::runtime::tokens::Reply {
            text: &call.text,
            reasoning: &call.reasoning,
            tool_calls: &[],
        },
    );
    let arguments: u64 = call
        .tool_calls
        .iter()
        .map(|streamed| counter.text(&streamed.tool_name) + counter.text(&streamed.arguments))
        .sum();
    usage.output_tokens += arguments;
    usage.total_tokens += arguments;
    log_estimated_usage(emitter, store, record, trail, in_flight, usage, cancelled).await
}

/// Logs `usage`, the estimate of a call this process made and a stop cut off, as a
/// `usage_recorded` counted in the run's `total_usage` (the run row, its snapshot, its output)
/// and in the token metrics; counts the call as `cancelled` in the call metrics when a cancel
/// cut it (a failure counted it already). Shared by model calls and the summariser's.
///
/// # Errors
/// The event log's or the store's.
pub(in crate::runtime) async fn log_estimated_usage(
    emitter: &RunEmitter,
    store: &dyn crate::store::Store,
    record: &RunRecord,
    trail: &RunTrail,
    in_flight: &CallInFlight,
    usage: crate::domain::TokenUsage,
    cancelled: bool,
) -> Result<(), super::end::EndError> {
    let mut total = store
        .get_run(record.id)
        .await?
        .map_or(record.total_usage, |run| run.total_usage);
    total += usage;
    emitter
        .emit_with(
            EventPayload::UsageRecorded(crate::events::UsageRecorded { usage }),
            RunChange {
                progress: Some((trail.iterations(), total)),
                ..RunChange::default()
            },
        )
        .await?;
    telemetry::metrics::tokens(
        &in_flight.provider,
        &in_flight.model,
        [
            ("input", usage.input_tokens),
            ("output", usage.output_tokens),
            ("cache_read", 0),
            ("cache_write", 0),
        ],
    );
    if cancelled {
        telemetry::metrics::model_call(
            &in_flight.provider,
            &in_flight.model,
            "cancelled",
            in_flight.started.elapsed(),
        );
    }
    Ok(())
}

/// Makes one model call: sends `request` while `announce` (the events before the call, ending
/// with its `model_started`) is committed, then emits what the call streams, in the call's
/// span. The answer is only read once the events are durable, so nothing of the call precedes
/// them in the log. On success the caller [`ModelCall::finish`]es the call with its usage.
pub(super) async fn call_model(
    emitter: &RunEmitter,
    entry: &ProviderEntry,
    provider_id: &str,
    request: ModelRequest,
    announce: Vec<(EventPayload, RunChange)>,
    iteration: u32,
) -> Result<(ModelTurn, ModelCall), TurnError> {
    let info = telemetry::spans::ModelCallInfo {
        provider_id,
        provider_kind: entry.config.kind,
        model: &request.model,
        iteration,
        max_tokens: request.max_output_tokens,
    };
    let span = telemetry::spans::model_call(emitter.trace(), &info);
    let call = ModelCall {
        span: None,
        provider: provider_id.to_owned(),
        model: request.model.clone(),
        started: Instant::now(),
    };
    let result = async {
        // A call made again (after a compaction) has nothing new to announce.
        let (logged, stream) = if announce.is_empty() {
            (Ok(0), span.scope(entry.provider.stream(request)).await)
        } else {
            tokio::join!(emitter.emit_all(announce), async {
                // The log's writer, just woken, starts the commit before the request is built
                // (a long session's request is ≈ 200 KB of JSON, milliseconds of this worker).
                tokio::task::yield_now().await;
                span.scope(entry.provider.stream(request)).await
            })
        };
        logged?;
        let stream = stream.map_err(TurnError::Rejected)?;
        span.scope(read_model_stream(emitter, stream, &call)).await
    }
    .await;
    let call = ModelCall {
        span: Some(span),
        ..call
    };
    match result {
        Ok(turn) => Ok((turn, call)),
        Err(error) => {
            call.fail(&error);
            Err(error)
        }
    }
}

/// Emits what one model call streams and collects its result.
pub(super) async fn read_model_stream(
    emitter: &RunEmitter,
    mut stream: ModelStream,
    call: &ModelCall,
) -> Result<ModelTurn, TurnError> {
    let mut turn = ModelTurn {
        text: String::new(),
        reasoning_text: String::new(),
        reasoning: Vec::new(),
        tool_calls: Vec::new(),
        usage: None,
        cache: None,
        finish_reason: FinishReason::Unknown,
    };
    // Calls started and not yet completed: (call id, tool name, argument text so far).
    let mut open: Vec<(String, String, String)> = Vec::new();
    let mut finished = false;
    let mut output = false;
    let mut first_output = true;
    while let Some(event) = stream.next().await {
        let event = match event {
            Ok(event) => event,
            Err(error) if !output => return Err(TurnError::Rejected(error)),
            Err(error) => return Err(TurnError::Provider(error)),
        };
        output |= !matches!(
            event,
            ModelEvent::Retrying { .. } | ModelEvent::Usage { .. } | ModelEvent::Finished(_)
        );
        if first_output
            && matches!(
                event,
                ModelEvent::TextDelta(_)
                    | ModelEvent::ReasoningDelta(_)
                    | ModelEvent::ToolCallStarted { .. }
                    | ModelEvent::ToolCallCompleted(_)
            )
        {
            first_output = false;
            telemetry::metrics::time_to_first_token(
                &call.provider,
                &call.model,
                call.started.elapsed(),
            );
        }
        match event {
            ModelEvent::TextDelta(delta) => {
                turn.text.push_str(&delta);
                emitter
                    .emit(EventPayload::TextDelta(TextDelta { delta }))
                    .await?;
            }
            ModelEvent::ReasoningDelta(delta) => {
                turn.reasoning_text.push_str(&delta);
                emitter
                    .emit(EventPayload::ReasoningDelta(ReasoningDelta { delta }))
                    .await?;
            }
            ModelEvent::ReasoningCompleted(block) => turn.reasoning.push(block),
            ModelEvent::ToolCallStarted { call_id, tool_name } => {
                open.push((call_id.clone(), tool_name.clone(), String::new()));
                emitter
                    .emit(EventPayload::ToolCallStarted(ToolCallStarted {
                        call_id,
                        tool_name,
                    }))
                    .await?;
            }
            ModelEvent::ToolCallDelta { call_id, delta } => {
                if let Some((_, _, text)) = open.iter_mut().rev().find(|(id, _, _)| *id == call_id)
                {
                    text.push_str(&delta);
                }
                emitter
                    .emit(EventPayload::ToolCallDelta(ToolCallDelta {
                        call_id,
                        delta,
                    }))
                    .await?;
            }
            ModelEvent::ToolCallCompleted(call) => {
                if let Some(position) = open.iter().position(|(id, _, _)| *id == call.id) {
                    open.remove(position);
                }
                turn.tool_calls.push(call.clone());
                emitter
                    .emit(EventPayload::ToolCallCompleted(ToolCallCompleted { call }))
                    .await?;
            }
            ModelEvent::Retrying {
                attempt,
                error_class,
                delay,
                error,
            } => {
                emitter
                    .emit(EventPayload::ModelRetrying(ModelRetrying {
                        attempt,
                        error_class,
                        delay_ms: u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                        error,
                    }))
                    .await?;
            }
            ModelEvent::Usage { usage, cache } => {
                turn.usage = Some(usage);
                turn.cache = cache;
            }
            ModelEvent::Finished(reason) => {
                turn.finish_reason = reason;
                finished = true;
            }
        }
    }
    if !finished {
        return Err(TurnError::NoFinish);
    }
    // A call started and never completed (its arguments did not parse, or the stream cut it):
    // completed here as a call with invalid arguments, so it gets a result the model sees.
    for (n, (call_id, name, text)) in open.into_iter().enumerate() {
        let id = if call_id.is_empty() {
            format!("call_incomplete_{n}")
        } else {
            call_id
        };
        let call = ToolCall {
            id,
            name,
            arguments: serde_json::json!({}),
            invalid_arguments: Some(text),
        };
        turn.tool_calls.push(call.clone());
        emitter
            .emit(EventPayload::ToolCallCompleted(ToolCallCompleted { call }))
            .await?;
    }
    Ok(turn)
}

/// For a run whose model call was cut off (cancel, crash, shutdown): emits a
/// `tool_call_completed` for every call its trail shows started and not completed, with the
/// argument text streamed so far as `invalid_arguments` (`arguments` `{}`), so that every
/// started call is completed. Such a call belongs to no committed message: it is never executed
/// or replayed.
///
/// # Errors
/// The event log's.
pub(super) async fn complete_open_calls(
    emitter: &RunEmitter,
    trail: &RunTrail,
) -> Result<(), LogError> {
    for open in trail.open_calls() {
        let call = ToolCall {
            id: open.id.clone(),
            name: open.tool_name.clone(),
            arguments: serde_json::json!({}),
            invalid_arguments: Some(open.arguments.clone()),
        };
        emitter
            .emit(EventPayload::ToolCallCompleted(ToolCallCompleted { call }))
            .await?;
    }
    Ok(())
}

/// For a run that ends early (cancelled, failed, or failed at the next start after a crash):
/// when its last model call was cut off before its assistant message was committed, stores the
/// text it streamed (from the trail) as an assistant message with status `incomplete`, so the
/// session's history says what the user saw and the next turn has that context. Nothing is
/// kept of a call a resumed run abandoned (followed by `run_resumed`): that call was made
/// again. The message carries no tool calls (those of a cut-off stream are never executed) and
/// is only written when the text has a non-whitespace character (providers refuse blank text).
///
/// # Errors
/// The event log's.
pub(super) async fn keep_cut_off_text(
    emitter: &RunEmitter,
    record: &RunRecord,
    trail: &RunTrail,
) -> Result<(), LogError> {
    let Some(text) = trail.cut_off_text().filter(|text| !text.trim().is_empty()) else {
        return Ok(());
    };
    let mut message = new_message(
        record,
        Role::Assistant,
        vec![ContentPart::Text {
            text: text.to_owned(),
        }],
        Vec::new(),
    );
    message.status = MessageStatus::Incomplete;
    // The id the call announced in its `model_started`, when it did (older logs: a new one).
    if let Some(id) = trail.cut_off_call().and_then(|call| call.message_id) {
        message.id = id;
    }
    emitter
        .emit_with(
            EventPayload::AssistantMessageCommitted(MessageCommitted {
                message_id: message.id,
            }),
            RunChange {
                message: Some(message),
                ..RunChange::default()
            },
        )
        .await
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::domain::{ErrorClass, MessageId, RunId, SessionId};
    use crate::events::EventFeed;
    use crate::runtime::{EventLog, TraceContext};
    use crate::store::{NewRun, Store};

    /// A run's emitter over a fresh SQLite store.
    async fn emitter(dir: &tempfile::TempDir) -> (Arc<dyn Store>, RunEmitter, RunId) {
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        let store = crate::store::connect(&url).await.unwrap();
        let run_id = RunId::new();
        store
            .create_run(&NewRun {
                id: run_id,
                session_id: SessionId::new(),
                create_session: true,
                provider: "p".to_owned(),
                model: "m".to_owned(),
                tool_choice: crate::domain::ToolChoice::default(),
                metadata: serde_json::json!({}),
                input: crate::domain::RunInput::from("hi").content(),
                user_message_id: MessageId::new(),
                tools: None,
                agent: None,
                definition: Default::default(),
                session_defaults: None,
                max_iterations: 5,
                client_request_id: None,
                request_hash: None,
                created_at: chrono::Utc::now(),
                lease: None,
            })
            .await
            .unwrap();
        let log = EventLog::start(
            store.clone(),
            Arc::new(EventFeed::new(64)),
            16,
            Arc::from("test"),
        );
        let emitter = log.emitter(run_id, RunTrail::new(), TraceContext::default());
        (store, emitter, run_id)
    }

    fn test_call() -> ModelCall {
        ModelCall {
            span: None,
            provider: "p".to_owned(),
            model: "m".to_owned(),
            started: Instant::now(),
        }
    }

    fn stream(events: Vec<ModelEvent>) -> ModelStream {
        Box::pin(futures::stream::iter(events.into_iter().map(Ok)))
    }

    #[tokio::test]
    async fn retries_reasoning_and_open_calls_become_events() {
        let dir = tempfile::tempdir().unwrap();
        let (store, emitter, run_id) = emitter(&dir).await;
        let block = Reasoning {
            text: "think".to_owned(),
            signature: Some("sig".to_owned()),
            redacted_data: None,
        };
        let events = vec![
            ModelEvent::Retrying {
                attempt: 1,
                error_class: ErrorClass::RateLimited,
                delay: Duration::from_millis(1500),
                error: "429".to_owned(),
            },
            ModelEvent::ReasoningDelta("think".to_owned()),
            ModelEvent::ReasoningCompleted(block.clone()),
            ModelEvent::TextDelta("Hi".to_owned()),
            ModelEvent::ToolCallStarted {
                call_id: "c1".to_owned(),
                tool_name: "add".to_owned(),
            },
            ModelEvent::ToolCallDelta {
                call_id: "c1".to_owned(),
                delta: "{\"a\":".to_owned(),
            },
            ModelEvent::ToolCallCompleted(ToolCall {
                id: "c2".to_owned(),
                name: "add".to_owned(),
                arguments: serde_json::json!({}),
                invalid_arguments: Some("{{".to_owned()),
            }),
            ModelEvent::Finished(FinishReason::ToolCalls),
        ];
        let turn = read_model_stream(&emitter, stream(events), &test_call())
            .await
            .unwrap();
        assert_eq!(turn.reasoning, vec![block]);
        assert_eq!(turn.reasoning_text, "think");
        assert_eq!(turn.text, "Hi");
        assert_eq!(turn.usage, None, "no usage reported");
        // The adapter's invalid call, then the call it started and never completed.
        let ids: Vec<(&str, Option<&str>)> = turn
            .tool_calls
            .iter()
            .map(|c| (c.id.as_str(), c.invalid_arguments.as_deref()))
            .collect();
        assert_eq!(ids, vec![("c2", Some("{{")), ("c1", Some("{\"a\":"))]);
        let logged = store.read_events(run_id, 0, 100).await.unwrap();
        let payloads: Vec<EventPayload> = logged
            .iter()
            .map(|e| {
                serde_json::from_str::<crate::events::AgentEvent>(&e.data)
                    .unwrap()
                    .payload
            })
            .collect();
        assert!(
            matches!(
                payloads.as_slice(),
                [
                    EventPayload::ModelRetrying(_),
                    EventPayload::ReasoningDelta(_),
                    EventPayload::TextDelta(_),
                    EventPayload::ToolCallStarted(_),
                    EventPayload::ToolCallDelta(_),
                    EventPayload::ToolCallCompleted(_),
                    EventPayload::ToolCallCompleted(_),
                ]
            ),
            "{payloads:?}"
        );
        let retry: serde_json::Value = serde_json::from_str(&logged[0].data).unwrap();
        assert_eq!(
            (&retry["attempt"], &retry["error_class"], &retry["delay_ms"]),
            (
                &serde_json::json!(1),
                &serde_json::json!("rate_limited"),
                &serde_json::json!(1500)
            )
        );
    }

    #[tokio::test]
    async fn a_stream_without_finish_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let (_store, emitter, _) = emitter(&dir).await;
        let result = read_model_stream(
            &emitter,
            stream(vec![ModelEvent::TextDelta("Hi".to_owned())]),
            &test_call(),
        )
        .await;
        assert!(matches!(result, Err(TurnError::NoFinish)));
    }
}
