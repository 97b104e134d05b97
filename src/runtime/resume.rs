//! Where a resumed run picks up: decided from its trail (its log, folded once when the run was
//! taken over) and its committed messages, without another read of the log.

use std::collections::{HashMap, HashSet};

use super::trail::{CallPhase, RunTrail};
use crate::domain::{FinishReason, Message, RunRecord, ToolCall};
use crate::events::ToolExecutionResult;

/// What a resumed run does first.
#[derive(Debug)]
pub(super) struct ResumePlan {
    /// The sequence of the `model_started` whose call was cut off.
    pub abandoned_after: Option<u64>,
    /// The iteration of the last `model_started` (0 when none).
    pub iteration: u32,
    pub next: Next,
    /// Every assistant message of the run, in order (for the doom-loop detector and the tool
    /// call count).
    pub assistant_messages: Vec<Message>,
}

/// Where a resumed run picks up.
#[derive(Debug)]
pub(super) enum Next {
    /// Make model call `iteration` (again).
    ModelCall(u32),
    /// Finish the tool calls of the last assistant message, then model call `iteration + 1`.
    Tools(PendingCalls),
    /// The last turn was the answer: the run completes.
    Complete(FinishReason),
}

/// The unanswered calls of the last assistant message and what the log says about each.
#[derive(Debug)]
pub(super) struct PendingCalls {
    /// Unanswered calls, in the model's order.
    pub calls: Vec<ToolCall>,
    /// Calls whose execution was logged as started.
    pub started: Vec<String>,
    /// Logged results of calls whose tool message is missing.
    pub finished: HashMap<String, ToolExecutionResult>,
    /// The description of a doom loop detected for this turn, when one was logged.
    pub doom_loop: Option<String>,
}

/// Decides where the run resumes: `assistant_messages` are the run's (from the store: a
/// compaction may have taken its earlier turns out of `history`, the session's context).
pub(super) fn plan(
    trail: &RunTrail,
    record: &RunRecord,
    assistant_messages: Vec<Message>,
    history: &[Message],
) -> ResumePlan {
    let Some(call) = trail.last_call() else {
        return ResumePlan {
            abandoned_after: None,
            iteration: 0,
            next: Next::ModelCall(record.iterations.max(1)),
            assistant_messages,
        };
    };
    let iteration = call.iteration;
    if call.phase != CallPhase::Committed {
        // The call was cut off before its message was committed: it is made again.
        return ResumePlan {
            abandoned_after: Some(call.sequence),
            iteration,
            next: Next::ModelCall(iteration),
            assistant_messages,
        };
    }
    let next = match assistant_messages.last() {
        // The answer was rejected and the corrective message stored: the model answers again.
        _ if call.turn.output_rejected => Next::ModelCall(iteration.saturating_add(1)),
        None => Next::ModelCall(iteration),
        Some(turn) if turn.tool_calls.is_empty() => {
            Next::Complete(record.finish_reason.unwrap_or(FinishReason::Stop))
        }
        Some(turn) => {
            // The results after the turn answer its calls (an older call may have had the same
            // id before a compaction took it out of the requests).
            let after_turn = history
                .iter()
                .rposition(|m| m.id == turn.id)
                .map_or(history.len(), |i| i + 1);
            let answered: HashSet<&str> = history[after_turn..]
                .iter()
                .filter_map(|m| m.tool_call_id.as_deref())
                .collect();
            let calls: Vec<ToolCall> = turn
                .tool_calls
                .iter()
                .filter(|call| !answered.contains(call.id.as_str()))
                .cloned()
                .collect();
            if calls.is_empty() {
                Next::ModelCall(iteration.saturating_add(1))
            } else {
                let executions = &call.turn.executions;
                Next::Tools(PendingCalls {
                    calls,
                    started: executions
                        .iter()
                        .filter(|e| e.started.is_some())
                        .map(|e| e.call_id.clone())
                        .collect(),
                    finished: executions
                        .iter()
                        .filter_map(|e| Some((e.call_id.clone(), e.result.clone()?)))
                        .collect(),
                    doom_loop: call.turn.doom_loop.clone(),
                })
            }
        }
    };
    ResumePlan {
        abandoned_after: None,
        iteration,
        next,
        assistant_messages,
    }
}
