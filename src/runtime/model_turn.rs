//! One model call's stream as events of the run: text, reasoning, tool calls, retries, usage.
//! Every `tool_call_started` gets its `tool_call_completed`: a call the stream started and never
//! completed is completed here with its argument text as `invalid_arguments`.

use futures::StreamExt;

use super::RunEmitter;
use crate::domain::{FinishReason, Reasoning, TokenUsage, ToolCall};
use crate::events::{
    CacheMetrics, EventPayload, ModelRetrying, ReasoningDelta, TextDelta, ToolCallCompleted,
    ToolCallDelta, ToolCallStarted,
};
use crate::provider::{ModelEvent, ModelStream, ProviderError};

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
    #[error(transparent)]
    Provider(#[from] ProviderError),
    #[error(transparent)]
    Log(#[from] LogError),
    /// The stream ended without `Finished` (an adapter bug or a cut stream).
    #[error("the model stream ended without a finish reason")]
    NoFinish,
}

/// Emits what one model call streams and collects its result.
pub(super) async fn read_model_stream(
    emitter: &RunEmitter,
    mut stream: ModelStream,
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
    while let Some(event) = stream.next().await {
        match event? {
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
