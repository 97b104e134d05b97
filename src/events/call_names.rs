//! Tool call ids unique in a session, as web frontends receive them: `<run_id>:<model
//! call>:<call_id>`, where the model call is the sequence of the `model_started` whose call
//! the provider's `call_id` was made in. Provider call ids are unique only within one model
//! call (a call made again after `run_resumed` says what the abandoned one said; after a
//! compaction took the older call out of the requests, a provider may say `call_1` again), so
//! a frontend that keeps calls by id needs these. [`CallNames`] is the one fold that names a
//! run's calls: the renderings (`api/formats`) send its names, and the answers a client posts
//! under them are matched to the pause they answer with the same fold
//! (`runtime/client_sessions.rs`).

use std::collections::HashMap;

use super::{AgentEvent, EventPayload};
use crate::domain::RunId;

/// The namespaced id of the provider's call `call_id` made by the model call whose
/// `model_started` has sequence `model_call` in run `run_id`: `<run_id>:<model_call>:<call_id>`.
#[must_use]
pub fn tool_call_id(run_id: RunId, model_call: u64, call_id: &str) -> String {
    format!("{run_id}:{model_call}:{call_id}")
}

/// The run, model call (the sequence of its `model_started`) and provider call id of a
/// namespaced tool call id ([`tool_call_id`]); `None` when `id` is not one. The provider's id
/// may itself contain `:`.
#[must_use]
pub fn split_tool_call_id(id: &str) -> Option<(RunId, u64, &str)> {
    let mut parts = id.splitn(3, ':');
    let run_id = parts.next()?.parse().ok()?;
    let model_call = parts.next()?.parse().ok()?;
    Some((run_id, model_call, parts.next()?))
}

/// The fold that names each tool call of one run's log (fed every event in sequence order):
/// a call is named by the model call that started it (`tool_call_started`, or its
/// `tool_call_completed` when no start was logged), the latest such model call for an id a
/// provider reused; any other event names a call it does not know by the current model call.
#[derive(Debug, Clone)]
pub struct CallNames {
    run_id: RunId,
    /// The sequence of the latest `model_started` (0 before the first).
    model_call: u64,
    /// The (latest) model call that started each provider call id.
    started: HashMap<String, u64>,
}

impl CallNames {
    /// The names of run `run_id`'s calls, before its first event.
    #[must_use]
    pub fn new(run_id: RunId) -> Self {
        Self {
            run_id,
            model_call: 0,
            started: HashMap::new(),
        }
    }

    /// Folds the next event of the run's log.
    pub fn record(&mut self, event: &AgentEvent) {
        match &event.payload {
            EventPayload::ModelStarted(_) => self.model_call = event.sequence,
            EventPayload::ToolCallStarted(started) => {
                self.started
                    .insert(started.call_id.clone(), self.model_call);
            }
            EventPayload::ToolCallCompleted(completed) => {
                self.started
                    .entry(completed.call.id.clone())
                    .or_insert(self.model_call);
            }
            _ => {}
        }
    }

    /// The namespaced id of the provider's call `call_id` as of the events folded so far.
    #[must_use]
    pub fn name(&self, call_id: &str) -> String {
        let model_call = self
            .started
            .get(call_id)
            .copied()
            .unwrap_or(self.model_call);
        tool_call_id(self.run_id, model_call, call_id)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use chrono::Utc;

    use super::*;
    use crate::domain::ToolCall;
    use crate::events::{ModelStarted, ToolCallCompleted, ToolCallStarted};

    fn event(sequence: u64, run_id: RunId, payload: EventPayload) -> AgentEvent {
        AgentEvent {
            sequence,
            run_id,
            timestamp: Utc::now(),
            trace_id: String::new(),
            span_id: String::new(),
            payload,
        }
    }

    /// A provider that says `call_1` in two model calls: each call keeps the name of the model
    /// call that started it, and a pause names the latest one; ids round-trip.
    #[test]
    fn a_reused_call_id_is_named_by_the_model_call_that_made_it() {
        let run = RunId::new();
        let mut names = CallNames::new(run);
        let model = |iteration| {
            EventPayload::ModelStarted(ModelStarted {
                provider: "p".to_owned(),
                model: "m".to_owned(),
                iteration,
                message_id: None,
            })
        };
        let started = || {
            EventPayload::ToolCallStarted(ToolCallStarted {
                call_id: "call_1".to_owned(),
                tool_name: "t".to_owned(),
            })
        };
        names.record(&event(1, run, model(1)));
        names.record(&event(2, run, started()));
        assert_eq!(names.name("call_1"), tool_call_id(run, 1, "call_1"));
        names.record(&event(3, run, model(2)));
        assert_eq!(
            names.name("call_1"),
            tool_call_id(run, 1, "call_1"),
            "not yet made"
        );
        assert_eq!(
            names.name("call_9"),
            tool_call_id(run, 3, "call_9"),
            "unknown"
        );
        names.record(&event(4, run, started()));
        assert_eq!(names.name("call_1"), tool_call_id(run, 3, "call_1"));
        // A completion without a logged start names an unknown call only.
        names.record(&event(
            5,
            run,
            EventPayload::ToolCallCompleted(ToolCallCompleted {
                call: ToolCall {
                    id: "call_2".to_owned(),
                    name: "t".to_owned(),
                    arguments: serde_json::json!({}),
                    invalid_arguments: None,
                },
            }),
        ));
        names.record(&event(6, run, model(3)));
        assert_eq!(names.name("call_2"), tool_call_id(run, 3, "call_2"));
        assert_eq!(names.name("call_1"), tool_call_id(run, 3, "call_1"));
        let name = names.name("call_1");
        assert_eq!(split_tool_call_id(&name), Some((run, 3, "call_1")));
        assert_eq!(
            split_tool_call_id(&tool_call_id(run, 7, "a:b")),
            Some((run, 7, "a:b"))
        );
        assert_eq!(split_tool_call_id("call_1"), None);
    }
}
