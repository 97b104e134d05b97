//! A run's context as its model calls see it: the session's system messages, the latest
//! compaction's summary, the messages after it, pruned outputs replaced by markers; and its size
//! before each call, corrected by what the provider reported for the session's last call.

use std::collections::HashMap;

use super::job::Candidate;
use super::prune::{self, Pruned};
use super::select;
use crate::domain::{Compaction, ContentPart, Message, MessageId, Role, RunId, TokenUsage};
use crate::provider::ToolSpec;
use crate::runtime::tokens::{REPLY_PRIMING, Reply, TokenCounter};
use crate::store::{Calibration, SessionContext};

/// The ratio of reported to counted tokens is trusted within these bounds (a provider reporting
/// far off, e.g. a fake, must not make behest wildly over- or under-count).
const RATIO_BOUNDS: (f64, f64) = (0.5, 4.0);

/// The heading of the summary in requests.
pub(super) const SUMMARY_HEADING: &str = "Summary of the earlier conversation, written by behest's \
compaction to keep the context within the model's window (the original messages are stored; \
the messages after this one follow verbatim):";

/// A request's size, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size {
    /// behest's own count (its tokenizer, or the `o200k_base` estimate).
    pub raw: u64,
    /// The count corrected by the session's calibration: what the limits are checked against.
    pub estimated: u64,
}

/// What a run's model calls are made with: the session's system messages, the latest
/// compaction's summary, and the messages after it (the latest user input first when the
/// compaction covers it); old tool outputs may be pruned in requests.
#[derive(Debug)]
pub struct Conversation {
    /// The run's instructions (its system prompt), which every request carries in the
    /// provider's own place (`ModelRequest::instructions`); counted, never stored here.
    pub(super) instructions: Option<Message>,
    pub(super) compaction: Option<Compaction>,
    /// The summary as requests carry it (a system message).
    pub(super) summary: Option<Message>,
    pub(super) messages: Vec<Message>,
    pub(super) pruned: HashMap<MessageId, Pruned>,
    pub(super) counter: TokenCounter,
    pub(super) calibration: Option<Calibration>,
    /// Raised after the provider rejected a request as too long: the ratio is at least this.
    pub(super) ratio_floor: f64,
    /// The raw size of the last request measured.
    pub(super) last_raw: u64,
}

impl Conversation {
    /// The context a run of `model` starts from.
    pub fn new(context: SessionContext, model: &str) -> Self {
        let summary = context.compaction.as_ref().map(summary_message);
        Self {
            instructions: None,
            compaction: context.compaction,
            summary,
            messages: context.messages,
            pruned: HashMap::new(),
            counter: TokenCounter::for_model(model),
            calibration: context.calibration,
            ratio_floor: 0.0,
            last_raw: 0,
        }
    }

    /// The same, for a run whose requests carry `instructions` (its system prompt): they count
    /// in every request's size.
    #[must_use]
    pub fn with_instructions(mut self, instructions: Option<&str>) -> Self {
        self.instructions = instructions.map(|text| Message {
            id: MessageId::new(),
            session_id: crate::domain::SessionId(uuid::Uuid::nil()),
            run_id: RunId(uuid::Uuid::nil()),
            role: Role::System,
            content: vec![ContentPart::Text {
                text: text.to_owned(),
            }],
            status: Default::default(),
            reasoning: Vec::new(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            tool_name: None,
            created_at: chrono::Utc::now(),
        });
        self
    }

    /// The messages after the latest compaction (all of the session's without one).
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Counts with `counter` (the session's last run's, which knows its messages) when it
    /// counts with this context's tokenizer.
    #[must_use]
    pub fn with_counter(mut self, counter: Option<TokenCounter>) -> Self {
        if let Some(counter) = counter.filter(|c| c.tokenizer() == self.counter.tokenizer()) {
            self.counter = counter;
        }
        self
    }

    /// The first `loaded` messages, which the context was built with, and the counter, when
    /// no compaction applies to it (`None` otherwise): what a run gives back to its session's
    /// cache.
    pub fn into_loaded(self, loaded: usize) -> Option<(Vec<Message>, TokenCounter)> {
        if self.compaction.is_some() || self.messages.len() < loaded {
            return None;
        }
        let mut messages = self.messages;
        messages.truncate(loaded);
        Some((messages, self.counter))
    }

    /// Adds a committed message.
    pub fn push(&mut self, message: Message) {
        self.messages.push(message);
    }

    /// The messages of the next request: system content first, then the summary, then the
    /// rest, pruned outputs replaced by their marker.
    pub fn request_messages(&self) -> Vec<Message> {
        let leading = self
            .messages
            .iter()
            .take_while(|m| m.role == Role::System)
            .count();
        let mut out = Vec::with_capacity(self.messages.len() + 1);
        out.extend(self.messages[..leading].iter().cloned());
        out.extend(self.summary.iter().cloned());
        for message in &self.messages[leading..] {
            let mut message = message.clone();
            if let Some(pruned) = self.pruned.get(&message.id) {
                message.content = vec![ContentPart::Text {
                    text: pruned.marker.clone(),
                }];
            }
            out.push(message);
        }
        out
    }

    /// Messages the next request holds.
    pub fn request_len(&self) -> usize {
        self.messages.len() + usize::from(self.summary.is_some())
    }

    /// The size of the next request with `tools`; remembered for [`Conversation::calibrate`]
    /// and [`Conversation::usage`].
    pub fn measure(&mut self, tools: &[ToolSpec]) -> Size {
        // What a request carries before the messages: the instructions, then the summary.
        let leading: Vec<&Message> = self.instructions.iter().chain(&self.summary).collect();
        let raw = raw_tokens(
            &mut self.counter,
            &leading,
            &self.messages,
            &self.pruned,
            tools,
        );
        self.last_raw = raw;
        Size {
            raw,
            estimated: self.corrected(raw),
        }
    }

    fn ratio(&self) -> f64 {
        let ratio = self.calibration.map_or_else(
            || self.counter.tokenizer().prior_ratio(),
            |c| c.reported_tokens as f64 / c.counted_tokens.max(1) as f64,
        );
        ratio
            .clamp(RATIO_BOUNDS.0, RATIO_BOUNDS.1)
            .max(self.ratio_floor)
    }

    pub(super) fn corrected(&self, raw: u64) -> u64 {
        (raw as f64 * self.ratio()).ceil() as u64
    }

    /// After a call that reported `input_tokens`: the session's new calibration (stored with
    /// the call's `usage_recorded`).
    pub fn calibrate(&mut self, input_tokens: u64) -> Option<Calibration> {
        if input_tokens == 0 || self.last_raw == 0 {
            return None;
        }
        let calibration = Calibration {
            reported_tokens: input_tokens,
            counted_tokens: self.last_raw,
        };
        self.calibration = Some(calibration);
        self.ratio_floor = 0.0;
        Some(calibration)
    }

    /// An estimated usage for the last measured request and this reply (a provider that
    /// reported none).
    pub fn usage(&self, reply: &Reply<'_>) -> TokenUsage {
        self.counter.usage(self.last_raw, reply)
    }

    /// Prunes the outputs of old tool calls (outside the turns a compaction keeping
    /// `keep_tokens` and `tail_turns` would keep) in requests; returns how many were newly
    /// pruned.
    pub(super) fn prune(&mut self, keep_tokens: u64, tail_turns: u32) -> usize {
        let sizes = self.sizes();
        let split = select::split(&self.messages, &sizes, keep_tokens, tail_turns);
        prune::prune(
            &self.messages,
            &sizes,
            &split,
            &mut self.pruned,
            &self.counter,
        )
    }

    /// The sizes of the messages, for selection and pruning.
    pub(super) fn sizes(&mut self) -> Vec<u64> {
        let counter = &mut self.counter;
        self.messages.iter().map(|m| counter.message(m)).collect()
    }

    pub(super) fn apply(&mut self, candidate: Candidate) {
        self.summary = Some(summary_message(&candidate.compaction));
        self.compaction = Some(candidate.compaction);
        self.messages = candidate.messages;
        let kept: std::collections::HashSet<MessageId> =
            self.messages.iter().map(|m| m.id).collect();
        self.pruned.retain(|id, _| kept.contains(id));
    }
}

/// The raw tokens of a request made of `leading` (instructions, summary) and `messages` (pruned
/// ones as their marker) with `tools`.
pub(super) fn raw_tokens(
    counter: &mut TokenCounter,
    leading: &[&Message],
    messages: &[Message],
    pruned: &HashMap<MessageId, Pruned>,
    tools: &[ToolSpec],
) -> u64 {
    if !counter.tokenizer().ready_or_load() {
        // The tables are loading (the model's first request): a model call does not wait for
        // them; a rough count that errs high stands in.
        let tools_bytes: usize = tools
            .iter()
            .map(|t| t.name.len() + t.description.len() + t.parameters.to_string().len())
            .sum();
        return (tools_bytes as u64).div_ceil(3)
            + REPLY_PRIMING
            + leading
                .iter()
                .copied()
                .chain(messages)
                .map(TokenCounter::rough_message)
                .sum::<u64>();
    }
    let mut total = counter.tools(tools) + REPLY_PRIMING;
    for message in leading {
        total += counter.message(message);
    }
    for message in messages {
        total += match pruned.get(&message.id) {
            Some(pruned) => pruned.tokens,
            None => counter.message(message),
        };
    }
    total
}

/// The summary of a compaction as requests carry it: a system message after the session's own
/// system content (the Messages API joins it into `system`; Chat Completions takes it as a
/// `system` message), identified by the compaction's id.
pub(super) fn summary_message(compaction: &Compaction) -> Message {
    Message {
        id: MessageId(compaction.id.0),
        session_id: compaction.session_id,
        run_id: compaction.run_id.unwrap_or(RunId(uuid::Uuid::nil())),
        role: Role::System,
        content: vec![ContentPart::Text {
            text: format!("{SUMMARY_HEADING}\n\n{}", compaction.summary),
        }],
        reasoning: Vec::new(),
        tool_calls: Vec::new(),
        tool_call_id: None,
        tool_name: None,
        status: Default::default(),
        created_at: compaction.created_at,
    }
}
