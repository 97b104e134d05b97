//! The summariser: the head of a conversation rendered as a plain-text transcript (no tool
//! blocks: it is text in, text out), summarised by the compaction model through the same
//! provider adapter as any model call (timeouts, retries, error classes). Incremental: the
//! previous summary is given with the turns after it. A head too large for the compaction
//! model's window is summarised in parts, each part folded into the summary so far.

use std::time::Duration;

use futures::StreamExt;

use crate::config::ModelConfig;
use crate::domain::{ContentPart, ErrorClass, Message, Role, TokenUsage, ToolChoice};
use crate::provider::{ModelEvent, ModelRequest, Provider, ProviderError};
use crate::runtime::tokens::{Reply, TokenCounter};
use crate::telemetry;

/// What the summariser is told to do.
pub const PROMPT: &str = "You compact the history of a conversation between a user and an AI \
assistant that calls tools, so that the assistant can continue the work with your summary in \
place of the messages it covers. Keep everything needed to continue: the user's goals, requests \
and constraints (in their own words where they matter); decisions and conclusions; facts \
established, including the important results of tool calls (exact values, names, identifiers, \
paths, numbers, errors); what has been done and what remains open. Do not invent anything, do \
not address the user, no preamble: write the summary itself, as plain text.";

/// Tokens of the prompt, the framing of the transcript and the chat format, kept free in the
/// compaction model's window besides the transcript and the summary.
const FRAMING_TOKENS: u64 = 400;

/// The model that writes summaries.
pub(super) struct Summariser<'a> {
    /// The adapter (with its retries).
    pub provider: &'a dyn Provider,
    /// The provider id.
    pub provider_id: &'a str,
    /// The model name.
    pub model: &'a str,
    /// Its window and output limit.
    pub limits: ModelConfig,
}

/// A summary and what writing it cost.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Summary {
    /// The text (trimmed).
    pub text: String,
    /// Who wrote it: the provider id and the model.
    pub provider: String,
    /// The model.
    pub model: String,
    /// The summariser's usage over every part (estimated where a call reported none).
    pub usage: TokenUsage,
}

/// Why no summary was written.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct SummaryError {
    /// What went wrong.
    pub message: String,
    /// What the calls made before the failure cost.
    pub usage: TokenUsage,
    /// The provider refused a call as too long for its window (`context_length_exceeded`).
    pub too_long: bool,
}

/// The fewest tokens of transcript a part is made of; below, a refusal as too long is final.
const MIN_PART_TOKENS: u64 = 256;

impl Summariser<'_> {
    /// Summarises `previous` (the last summary, if any) and `head` in at most `budget` output
    /// tokens per call, in as many calls as the compaction model's window needs.
    ///
    /// # Errors
    /// [`SummaryError`] when a call fails (its provider error), returns no text, or the window
    /// cannot hold even the prompt.
    pub async fn summarise(
        &self,
        previous: Option<&str>,
        head: &[&Message],
        budget: u32,
    ) -> Result<Summary, SummaryError> {
        let mut counter = TokenCounter::for_model(self.model);
        let window = u64::from(self.limits.context_window);
        let budget = budget.min(self.limits.max_output_tokens).max(1);
        // A tenth of the window is left for the difference between behest's count and the
        // provider's.
        let mut available = window
            .saturating_sub(u64::from(budget))
            .saturating_sub(FRAMING_TOKENS)
            .saturating_sub(window / 10);
        let mut usage = TokenUsage::default();
        // The provider refusing a part as too long (its window is smaller than configured, or
        // counts differently): the transcript is split into parts half as large, and again.
        loop {
            match self
                .parts(previous, head, budget, available, &mut counter, &mut usage)
                .await
            {
                Err(error) if error.too_long && available / 2 >= MIN_PART_TOKENS => {
                    available /= 2;
                    tracing::info!(
                        model = self.model,
                        part_tokens = available,
                        error = %error.message,
                        "the summariser refused a part as too long; summarising in smaller parts"
                    );
                }
                outcome => return outcome,
            }
        }
    }

    /// [`Summariser::summarise`] with parts of the transcript of at most `available` tokens
    /// (the summary so far included); the calls' usage is added to `usage`.
    async fn parts(
        &self,
        previous: Option<&str>,
        head: &[&Message],
        budget: u32,
        available: u64,
        counter: &mut TokenCounter,
        usage: &mut TokenUsage,
    ) -> Result<Summary, SummaryError> {
        let window = u64::from(self.limits.context_window);
        if available < MIN_PART_TOKENS {
            return Err(SummaryError {
                message: format!(
                    "the compaction model `{}` has no room for a transcript: its context window \
                     ({window}) minus the summary's {budget} tokens leaves {available}",
                    self.model
                ),
                usage: *usage,
                too_long: false,
            });
        }
        let entries: Vec<String> = head
            .iter()
            .map(|message| bounded(counter, &render(message), available / 4))
            .filter(|entry| !entry.is_empty())
            .collect();
        let mut summary = previous.map(str::to_owned);
        let mut part: Vec<&str> = Vec::new();
        let mut part_tokens = 0;
        let mut parts = entries.iter().peekable();
        while let Some(entry) = parts.next() {
            let tokens = counter.text(entry) + 2;
            part.push(entry);
            part_tokens += tokens;
            let next = parts.peek().map_or(0, |next| counter.text(next) + 2);
            let summary_tokens = summary.as_deref().map_or(0, |s| counter.text(s));
            let full = parts.peek().is_none() || summary_tokens + part_tokens + next > available;
            if !full {
                continue;
            }
            let text = self
                .call(
                    summary.as_deref(),
                    &part.join("\n\n"),
                    budget,
                    counter,
                    usage,
                )
                .await?;
            // The summary so far goes into the next part's request: it must leave room there.
            let tokens = counter.text(&text);
            if parts.peek().is_some() && tokens > available / 2 {
                return Err(SummaryError {
                    message: format!(
                        "the summary grew to {tokens} tokens, more than half of what the \
                         compaction model's window leaves for the transcript ({available})"
                    ),
                    usage: *usage,
                    too_long: false,
                });
            }
            summary = Some(text);
            part.clear();
            part_tokens = 0;
        }
        match summary {
            Some(text) if !text.trim().is_empty() && !entries.is_empty() => Ok(Summary {
                text: text.trim().to_owned(),
                provider: self.provider_id.to_owned(),
                model: self.model.to_owned(),
                usage: *usage,
            }),
            _ => Err(SummaryError {
                message: "the summariser returned an empty summary".to_owned(),
                usage: *usage,
                too_long: false,
            }),
        }
    }

    /// One summariser call: the summary so far and a part of the transcript in, the new
    /// summary out.
    async fn call(
        &self,
        previous: Option<&str>,
        transcript: &str,
        budget: u32,
        counter: &mut TokenCounter,
        usage: &mut TokenUsage,
    ) -> Result<String, SummaryError> {
        let words = u64::from(budget) * 3 / 5;
        let mut prompt = String::new();
        if let Some(previous) = previous {
            prompt.push_str("Summary of the conversation before this part:\n<summary>\n");
            prompt.push_str(previous);
            prompt.push_str("\n</summary>\n\n");
        }
        prompt.push_str("Conversation to summarise:\n<conversation>\n");
        prompt.push_str(transcript);
        prompt.push_str("\n</conversation>\n\n");
        prompt.push_str(&format!(
            "Write the summary of the whole conversation{}, in at most about {words} words.",
            if previous.is_some() {
                " (the summary above and this part)"
            } else {
                ""
            }
        ));
        let messages = vec![
            text_message(Role::System, PROMPT),
            text_message(Role::User, &prompt),
        ];
        let request = ModelRequest {
            model: self.model.to_owned(),
            messages: messages.into(),
            tools: Vec::new(),
            tool_choice: ToolChoice::default(),
            max_output_tokens: Some(budget),
            ..ModelRequest::default()
        };
        let input_tokens = counter.request(&request.messages, &[]);
        let started = std::time::Instant::now();
        let (outcome, call_usage) = match read(self.provider, request).await {
            Ok((text, reported)) => {
                let call_usage = reported.unwrap_or_else(|| {
                    counter.usage(
                        input_tokens,
                        &Reply {
                            text: &text,
                            reasoning: "",
                            tool_calls: &[],
                        },
                    )
                });
                (Ok(text), call_usage)
            }
            // A call the provider refused before its stream began costs nothing; one that
            // failed after costs what it reported, or the request's estimated size plus the
            // text it streamed (`estimated: true`).
            Err(Failed {
                error,
                reported,
                streamed,
            }) => {
                let call_usage = reported.unwrap_or_else(|| {
                    streamed.map_or_else(TokenUsage::default, |text| {
                        counter.usage(
                            input_tokens,
                            &Reply {
                                text: &text,
                                reasoning: "",
                                tool_calls: &[],
                            },
                        )
                    })
                });
                (Err(error), call_usage)
            }
        };
        *usage += call_usage;
        telemetry::metrics::tokens(
            self.provider_id,
            self.model,
            [
                ("input", call_usage.input_tokens),
                ("output", call_usage.output_tokens),
                ("cache_read", 0),
                ("cache_write", 0),
            ],
        );
        let class = outcome.as_ref().err().map_or("ok", |e| e.class.as_str());
        telemetry::metrics::model_call(self.provider_id, self.model, class, started.elapsed());
        match outcome {
            Ok(text) if text.trim().is_empty() => Err(SummaryError {
                message: "the summariser returned an empty summary".to_owned(),
                usage: *usage,
                too_long: false,
            }),
            Ok(text) => Ok(text),
            Err(error) => Err(SummaryError {
                message: format!(
                    "the summariser (model `{}` of `{}`) failed: {error}",
                    self.model, self.provider_id
                ),
                usage: *usage,
                too_long: error.class == ErrorClass::ContextLengthExceeded,
            }),
        }
    }
}

/// A summariser call that failed: its error, the usage the provider reported before it, and
/// the text streamed when the stream had begun (`None`: refused before it).
struct Failed {
    error: ProviderError,
    reported: Option<TokenUsage>,
    streamed: Option<String>,
}

/// The text a summariser call streamed and its reported usage, or why it failed.
async fn read(
    provider: &dyn Provider,
    request: ModelRequest,
) -> Result<(String, Option<TokenUsage>), Failed> {
    let mut stream = provider.stream(request).await.map_err(|error| Failed {
        error,
        reported: None,
        streamed: None,
    })?;
    let mut text = String::new();
    let mut usage = None;
    let mut finished = false;
    while let Some(event) = stream.next().await {
        match event {
            Ok(ModelEvent::TextDelta(delta)) => text.push_str(&delta),
            Ok(ModelEvent::Usage {
                usage: reported, ..
            }) => usage = Some(reported),
            Ok(ModelEvent::Finished(_)) => finished = true,
            Ok(ModelEvent::Retrying {
                attempt,
                error,
                delay,
                ..
            }) => {
                tracing::info!(attempt, %error, delay_ms = duration_ms(delay), "summariser call retried");
            }
            Ok(_) => {}
            Err(error) => {
                return Err(Failed {
                    error,
                    reported: usage,
                    streamed: Some(text),
                });
            }
        }
    }
    if !finished {
        let error = ProviderError::new(
            "summariser",
            ErrorClass::Transport,
            "the stream ended without a finish reason",
        );
        return Err(Failed {
            error,
            reported: usage,
            streamed: Some(text),
        });
    }
    Ok((text, usage))
}

fn duration_ms(delay: Duration) -> u64 {
    u64::try_from(delay.as_millis()).unwrap_or(u64::MAX)
}

fn text_message(role: Role, text: &str) -> Message {
    Message {
        id: crate::domain::MessageId::new(),
        session_id: crate::domain::SessionId(uuid::Uuid::nil()),
        run_id: crate::domain::RunId(uuid::Uuid::nil()),
        role,
        content: vec![ContentPart::Text {
            text: text.to_owned(),
        }],
        reasoning: Vec::new(),
        tool_calls: Vec::new(),
        tool_call_id: None,
        tool_name: None,
        status: Default::default(),
        created_at: chrono::Utc::now(),
    }
}

/// One message of the transcript: who spoke, then what (text and JSON parts, images by their
/// type); an assistant's tool calls and a tool's result in words, never as tool blocks.
pub(super) fn render(message: &Message) -> String {
    let mut parts: Vec<String> = Vec::new();
    for part in &message.content {
        match part {
            ContentPart::Text { text } if !text.trim().is_empty() => parts.push(text.clone()),
            ContentPart::Text { .. } => {}
            ContentPart::Json { value } => parts.push(value.to_string()),
            ContentPart::Image { media_type, .. } => {
                parts.push(format!("[an image ({media_type})]"))
            }
        }
    }
    let body = parts.join("\n");
    match message.role {
        Role::System => format!("[system]\n{body}"),
        Role::User => format!("[user]\n{body}"),
        Role::Assistant => {
            let mut text = String::from("[assistant]");
            if !body.is_empty() {
                text.push('\n');
                text.push_str(&body);
            }
            for call in &message.tool_calls {
                let arguments = call
                    .invalid_arguments
                    .clone()
                    .unwrap_or_else(|| call.arguments.to_string());
                text.push_str(&format!(
                    "\n(called the tool `{}` with {arguments})",
                    call.name
                ));
            }
            text
        }
        Role::Tool => format!(
            "[result of the tool `{}`]\n{body}",
            message.tool_name.as_deref().unwrap_or("unknown")
        ),
    }
}

/// `text` cut to about `max_tokens` tokens (its start and end kept, the middle replaced by a
/// marker), on character boundaries.
fn bounded(counter: &TokenCounter, text: &str, max_tokens: u64) -> String {
    let tokens = counter.text(text);
    if tokens <= max_tokens {
        return text.to_owned();
    }
    let chars: Vec<char> = text.chars().collect();
    // Characters per token of this text, so the cut lands near the budget.
    let keep = usize::try_from(max_tokens * chars.len() as u64 / tokens.max(1)).unwrap_or(0) / 2;
    let head: String = chars[..keep.min(chars.len())].iter().collect();
    let tail: String = chars[chars.len().saturating_sub(keep)..].iter().collect();
    format!(
        "{head}\n[… about {} tokens left out …]\n{tail}",
        tokens.saturating_sub(max_tokens)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{MessageId, RunId, SessionId, ToolCall};

    #[test]
    fn the_transcript_is_plain_text() {
        let mut call = text_message(Role::Assistant, "Let me look.");
        call.tool_calls.push(ToolCall {
            id: "call_1".to_owned(),
            name: "weather".to_owned(),
            arguments: serde_json::json!({"city": "Paris"}),
            invalid_arguments: None,
        });
        let mut result = text_message(Role::Tool, "{\"temp\": 21}");
        result.tool_call_id = Some("call_1".to_owned());
        result.tool_name = Some("weather".to_owned());
        assert_eq!(
            render(&call),
            "[assistant]\nLet me look.\n(called the tool `weather` with {\"city\":\"Paris\"})"
        );
        assert_eq!(
            render(&result),
            "[result of the tool `weather`]\n{\"temp\": 21}"
        );
        let message = Message {
            id: MessageId::new(),
            session_id: SessionId::new(),
            run_id: RunId::new(),
            ..text_message(Role::User, "hi")
        };
        assert_eq!(render(&message), "[user]\nhi");
    }

    #[test]
    fn a_long_entry_keeps_its_ends() {
        let counter = TokenCounter::new();
        let text = format!("START {} END", "word ".repeat(5000));
        let cut = bounded(&counter, &text, 200);
        assert!(cut.starts_with("START"), "{}", &cut[..20]);
        assert!(cut.ends_with("END"));
        assert!(counter.text(&cut) < 260, "{}", counter.text(&cut));
        assert_eq!(bounded(&counter, "short", 200), "short");
    }
}
