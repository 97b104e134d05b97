//! The check of a run's input at its create: an input message that alone does not fit the
//! model's window (less the answer's `max_output_tokens`), estimated as compaction estimates a
//! session's first request, could never be sent — compaction keeps the latest input verbatim —
//! so the run is refused (`422 input_too_large`) instead of created to fail.

use super::call::Window;
use super::conversation::Conversation;
use crate::domain::{ContentPart, Message};
use crate::provider::ToolSpec;
use crate::runtime::tokens::{IMAGE_TOKENS, PER_MESSAGE_OVERHEAD, REPLY_PRIMING, Tokenizer};
use crate::store::SessionContext;

/// An input that does not fit: its estimate and the most a request may hold, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::runtime) struct TooLarge {
    /// The request's estimated tokens (the tokenizer's count, corrected by its prior ratio).
    pub estimated: u64,
    /// The model's context window less the run's `max_output_tokens`.
    pub limit: u64,
    /// The request field to shorten: `input` when the input alone does not fit, else the
    /// larger of `instructions` and `tools`.
    pub field: &'static str,
}

/// Whether `input` (the run's user message) fits `window` for `model` in a request of it
/// alone with the run's `instructions` and `tools` (every request carries both), estimated
/// without a calibration ([`Conversation::measure`]: the model's tokenizer
/// or the `o200k_base` estimate ×1.2, an image as 1,000 tokens, the reply priming). A bound
/// from the input's bytes (a token is at least one byte) answers most inputs without the
/// tokenizer; a larger one is counted on a blocking thread (which loads the tables once).
///
/// # Errors
/// [`TooLarge`] when the estimate is over the window less the answer.
pub(in crate::runtime) async fn check_input(
    input: Message,
    instructions: Option<String>,
    tools: Vec<ToolSpec>,
    model: &str,
    window: Window,
) -> Result<(), TooLarge> {
    let limit = window.hard();
    let tokenizer = Tokenizer::for_model(model);
    let instructions_bytes = instructions.as_ref().map_or(0, String::len);
    let tools_bytes: usize = tools
        .iter()
        .map(|tool| tool.name.len() + tool.description.len() + tool.parameters.to_string().len())
        .sum();
    let bytes: usize = input
        .content
        .iter()
        .map(|part| match part {
            ContentPart::Text { text } => text.len(),
            ContentPart::Json { value } => value.to_string().len(),
            ContentPart::Image { .. } => 0,
        })
        .sum::<usize>()
        + instructions_bytes
        + tools_bytes;
    let images = input
        .content
        .iter()
        .filter(|part| matches!(part, ContentPart::Image { .. }))
        .count() as u64;
    let bound = 2 * PER_MESSAGE_OVERHEAD + REPLY_PRIMING + bytes as u64 + images * IMAGE_TOKENS;
    if (bound as f64 * tokenizer.prior_ratio()).ceil() as u64 <= limit {
        return Ok(());
    }
    let model = model.to_owned();
    let counted = tokio::task::spawn_blocking(move || {
        if !tokenizer.is_ready() {
            tokenizer.warm_up();
        }
        let context = SessionContext {
            messages: vec![input],
            ..SessionContext::default()
        };
        let mut alone = Conversation::new(context, &model);
        let input_alone = alone.measure(&[]).estimated;
        let whole = alone
            .with_instructions(instructions.as_deref())
            .measure(&tools)
            .estimated;
        (whole, input_alone)
    })
    .await;
    // A counting thread that failed cannot say the input is too large: the run's own checks
    // before its model call still stand.
    let Ok((estimated, input_alone)) = counted else {
        return Ok(());
    };
    if estimated > limit {
        let field = if input_alone > limit {
            "input"
        } else if instructions_bytes >= tools_bytes {
            "instructions"
        } else {
            "tools"
        };
        return Err(TooLarge {
            estimated,
            limit,
            field,
        });
    }
    Ok(())
}
