//! One compaction: the head selected, summarised, checked (not empty, the context shrinks), and
//! the compaction record with the conversation's messages after it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;

use super::call::Window;
use super::conversation::{Conversation, SUMMARY_HEADING, raw_tokens, summary_message};
use super::select::{self, Split};
use super::summarise;
use crate::config::ModelConfig;
use crate::domain::{
    Compaction, CompactionConfig, CompactionId, CompactionTrigger, Message, MessageId, Role, RunId,
    SessionId, TokenUsage,
};
use crate::provider::{Provider, ToolSpec};
use crate::runtime::Runtime;
use crate::store::StoreError;

/// A compaction to make: whose context, with which settings, why.
pub(super) struct Job<'a> {
    pub(super) runtime: &'a Runtime,
    pub(super) session_id: SessionId,
    pub(super) run_id: Option<RunId>,
    /// The run's provider and model (the summariser's, unless configured otherwise).
    pub(super) provider: &'a str,
    pub(super) model: &'a str,
    pub(super) window: Window,
    pub(super) tools: &'a [ToolSpec],
    pub(super) settings: &'a CompactionConfig,
    pub(super) trigger: CompactionTrigger,
}

/// The fewest tokens a summary is given room for beside its heading: a head that holds no more
/// than these and the heading cannot be shrunk by summarising it, so it is not attempted.
const MIN_SUMMARY_TOKENS: u64 = 64;

/// A compaction made, not yet applied to the conversation.
pub(super) struct Candidate {
    pub(super) compaction: Compaction,
    /// The conversation's messages after it.
    pub(super) messages: Vec<Message>,
    pub(super) duration: Duration,
}

/// How an attempt went.
pub(super) enum Attempt {
    Compacted(Candidate),
    /// Nothing was tried (the breaker is open, nothing to summarise): why.
    NotAttempted(String),
    /// The summariser failed, returned nothing, or did not shrink the context (a failure for
    /// the breaker); what it cost.
    Failed {
        message: String,
        usage: TokenUsage,
    },
}

/// A compaction about to call its summariser: what it summarises, with which model.
pub(super) struct Planned {
    split: Split,
    provider: Arc<dyn Provider>,
    /// The summariser's provider id and model.
    pub(super) provider_id: String,
    pub(super) model: String,
    limits: ModelConfig,
    /// The request's estimated size before, in tokens.
    pub(super) tokens_before: u64,
    /// The estimated tokens of the messages summarised (what the summariser is sent, besides
    /// its prompt and the previous summary).
    pub(super) head_tokens: u64,
    /// Original messages summarised.
    pub(super) messages_to_summarise: u32,
    budget: u32,
    started: Instant,
}

impl Job<'_> {
    /// Selects the head, summarises it and checks the result.
    ///
    /// # Errors
    /// The store's (reading the breaker).
    pub(super) async fn run(&self, conversation: &mut Conversation) -> Result<Attempt, StoreError> {
        match self.plan(conversation).await? {
            Ok(planned) => Ok(self.summarise(conversation, planned).await),
            Err(attempt) => Ok(attempt),
        }
    }

    /// Checks the breaker, selects the head and finds the summariser: what the summariser call
    /// will be, or the attempt's outcome when no call is made (`NotAttempted`, or `Failed` when
    /// the summariser is not configured).
    ///
    /// # Errors
    /// The store's (reading the breaker).
    pub(super) async fn plan(
        &self,
        conversation: &mut Conversation,
    ) -> Result<Result<Planned, Attempt>, StoreError> {
        let started = Instant::now();
        let breaker = self
            .runtime
            .store
            .circuit_breaker(self.settings.circuit_breaker_threshold)
            .await?;
        if breaker.is_open {
            return Ok(Err(Attempt::NotAttempted(format!(
                "the compaction circuit breaker is open ({} consecutive failures; reset it with \
                 POST /compaction/circuit-breaker/reset)",
                breaker.consecutive_failures
            ))));
        }
        let sizes = conversation.sizes();
        let split = select::split(
            &conversation.messages,
            &sizes,
            self.window.keep(self.settings),
            self.settings.tail_turns,
        );
        if !split.has_head(&conversation.messages) {
            return Ok(Err(Attempt::NotAttempted(
                "nothing is older than the turns compaction keeps verbatim".to_owned(),
            )));
        }
        let summarised: Vec<usize> = (0..split.tail_start)
            .filter(|&i| conversation.messages[i].role != Role::System && Some(i) != split.pinned)
            .collect();
        let head_tokens: u64 = summarised.iter().map(|&i| sizes[i]).sum();
        let floor = conversation.counter.text(SUMMARY_HEADING) + MIN_SUMMARY_TOKENS;
        if head_tokens <= floor {
            return Ok(Err(Attempt::NotAttempted(format!(
                "the turns older than those compaction keeps verbatim hold about {head_tokens} \
                 tokens: too few for a summary to shrink them (it needs more than {floor})"
            ))));
        }
        let (provider, provider_id, model, limits) = match self.summariser() {
            Ok(found) => found,
            Err(message) => {
                return Ok(Err(Attempt::Failed {
                    message,
                    usage: TokenUsage::default(),
                }));
            }
        };
        let tokens_before = conversation.measure(self.tools).estimated;
        let budget = self.summary_budget(conversation);
        Ok(Ok(Planned {
            split,
            provider,
            provider_id,
            model,
            limits,
            tokens_before,
            head_tokens,
            messages_to_summarise: u32::try_from(summarised.len()).unwrap_or(u32::MAX),
            budget,
            started,
        }))
    }

    /// Calls the summariser for `planned` and checks the result: the compaction, or why it
    /// failed.
    pub(super) async fn summarise(
        &self,
        conversation: &mut Conversation,
        planned: Planned,
    ) -> Attempt {
        let head: Vec<&Message> = conversation.messages[..planned.split.tail_start]
            .iter()
            .filter(|m| m.role != Role::System)
            .collect();
        let summariser = summarise::Summariser {
            provider: planned.provider.as_ref(),
            provider_id: &planned.provider_id,
            model: &planned.model,
            limits: planned.limits,
        };
        let previous = conversation.compaction.as_ref().map(|c| c.summary.as_str());
        let summary = match summariser.summarise(previous, &head, planned.budget).await {
            Ok(summary) => summary,
            Err(error) => {
                return Attempt::Failed {
                    message: error.message,
                    usage: error.usage,
                };
            }
        };
        let tokens_before = planned.tokens_before;
        let candidate = self.candidate(
            conversation,
            &planned.split,
            summary,
            tokens_before,
            planned.started,
        );
        let tokens_after = candidate.compaction.tokens_after;
        if tokens_after >= tokens_before {
            return Attempt::Failed {
                message: format!(
                    "the summary did not shrink the context (about {tokens_before} tokens before, \
                     {tokens_after} after)"
                ),
                usage: candidate.compaction.usage,
            };
        }
        Attempt::Compacted(candidate)
    }

    /// The summariser: the configured compaction model, else the run's.
    fn summariser(&self) -> Result<(Arc<dyn Provider>, String, String, ModelConfig), String> {
        let (provider, model) = if self.settings.provider.is_empty() {
            (self.provider, self.model)
        } else {
            (
                self.settings.provider.as_str(),
                self.settings.model.as_str(),
            )
        };
        let entry = self
            .runtime
            .providers
            .get(provider)
            .ok_or_else(|| format!("the compaction provider `{provider}` is not configured"))?;
        let limits = entry.config.models.get(model).copied().ok_or_else(|| {
            format!("the compaction provider `{provider}` has no model `{model}` configured")
        })?;
        Ok((
            entry.provider.clone(),
            provider.to_owned(),
            model.to_owned(),
            limits,
        ))
    }

    /// The summary's output budget: half of what the threshold leaves beside the kept turns
    /// and the fixed parts of the request (system content, tools), from 256 to 8192 tokens.
    fn summary_budget(&self, conversation: &mut Conversation) -> u32 {
        let fixed = conversation.counter.tools(self.tools)
            + conversation
                .messages
                .iter()
                .filter(|m| m.role == Role::System)
                .map(|m| conversation.counter.message(m))
                .sum::<u64>();
        let room = self
            .window
            .threshold(self.settings)
            .saturating_sub(self.window.keep(self.settings))
            .saturating_sub(fixed);
        u32::try_from((room / 2).clamp(256, 8192)).unwrap_or(8192)
    }

    /// The compaction of `split` with `summary`, and the conversation's messages after it: the
    /// head's system messages, the pinned user input, then the tail.
    fn candidate(
        &self,
        conversation: &mut Conversation,
        split: &Split,
        summary: summarise::Summary,
        tokens_before: u64,
        started: Instant,
    ) -> Candidate {
        let head = &conversation.messages[..split.tail_start];
        let mut messages: Vec<Message> = head
            .iter()
            .filter(|m| m.role == Role::System)
            .cloned()
            .collect();
        messages.extend(split.pinned.map(|i| conversation.messages[i].clone()));
        messages.extend(conversation.messages[split.tail_start..].iter().cloned());
        let summarised = head
            .iter()
            .enumerate()
            .filter(|(i, m)| m.role != Role::System && Some(*i) != split.pinned)
            .count();
        let through = head
            .last()
            .map_or_else(MessageId::new, |message| message.id);
        let mut compaction = Compaction {
            id: CompactionId::new(),
            session_id: self.session_id,
            run_id: self.run_id,
            trigger: self.trigger,
            through_message_id: through,
            messages_summarised: u32::try_from(summarised).unwrap_or(u32::MAX),
            tokens_before,
            tokens_after: 0,
            summary: summary.text,
            provider: summary.provider,
            model: summary.model,
            usage: summary.usage,
            created_at: Utc::now(),
        };
        let summary_message = summary_message(&compaction);
        let leading: Vec<&Message> = conversation
            .instructions
            .iter()
            .chain([&summary_message])
            .collect();
        let raw_after = raw_tokens(
            &mut conversation.counter,
            &leading,
            &messages,
            &conversation.pruned,
            self.tools,
        );
        compaction.tokens_after = conversation.corrected(raw_after);
        Candidate {
            compaction,
            messages,
            duration: started.elapsed(),
        }
    }
}
