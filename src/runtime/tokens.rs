//! Token counting: a real tokenizer where one exists for the model's family (`tiktoken-rs`, the
//! OpenAI BPEs embedded in the crate: works offline), else a documented estimate; for request
//! sizes (compaction) and usage estimates when a provider reports none. Counts are per message
//! and cached by message id — per run, and process-wide across runs — so that counting the same
//! history again (the next model call, the next run of the session, compaction) pays only for
//! new messages.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use tiktoken_rs::CoreBPE;

use crate::domain::{ContentPart, Message, MessageId, TokenUsage, ToolCall};
use crate::provider::ToolSpec;

/// Tokens a chat format spends around each message (role, separators), as in OpenAI's
/// cookbook count for its chat models.
pub(crate) const PER_MESSAGE_OVERHEAD: u64 = 4;
/// Tokens that prime the reply (`<|start|>assistant<|message|>`).
pub(crate) const REPLY_PRIMING: u64 = 3;
/// What an image part is counted as: images are priced by size, which behest does not know;
/// about what a 1024×1024 image costs OpenAI and Anthropic models.
pub(crate) const IMAGE_TOKENS: u64 = 1_000;
/// Correction of an estimate before the provider reported any usage: for a model without a
/// public tokenizer (Claude, Llama, Qwen, Mistral, …) the `o200k_base` count is scaled by 1.2,
/// because those vocabularies produce up to about a fifth more tokens than `o200k_base` on
/// English and code, and over-counting only compacts a little early. Once a call of the session
/// reported its input tokens, their ratio to behest's count replaces it.
pub const ESTIMATE_MARGIN: f64 = 1.2;
/// Message counts kept process-wide at most; the cache starts over when full.
const SHARED_CACHE_ENTRIES: usize = 65_536;

/// How a model's tokens are counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tokenizer {
    /// `o200k_base` (GPT-4o, GPT-4.1, GPT-5, o1, o3, o4-mini).
    O200k,
    /// `o200k_harmony` (gpt-oss).
    O200kHarmony,
    /// `cl100k_base` (GPT-4, GPT-3.5 Turbo).
    Cl100k,
    /// `p50k_base` (older completion and code models).
    P50k,
    /// `r50k_base` (GPT-3 models).
    R50k,
    /// No public tokenizer for the family: `o200k_base`, corrected by [`ESTIMATE_MARGIN`] until
    /// the provider reports usage.
    Estimate,
}

impl Tokenizer {
    /// The tokenizer of a model by its name, as `tiktoken` maps OpenAI models (exact names and
    /// prefixes such as `gpt-4o-`; a router's `openai/` prefix is ignored); [`Tokenizer::Estimate`]
    /// for any other model.
    #[must_use]
    pub fn for_model(model: &str) -> Self {
        use tiktoken_rs::tokenizer::{Tokenizer as Bpe, get_tokenizer};
        let name = model.rsplit('/').next().unwrap_or(model);
        match get_tokenizer(name) {
            Some(Bpe::O200kBase) => Self::O200k,
            Some(Bpe::O200kHarmony) => Self::O200kHarmony,
            Some(Bpe::Cl100kBase) => Self::Cl100k,
            Some(Bpe::P50kBase | Bpe::P50kEdit) => Self::P50k,
            Some(Bpe::R50kBase | Bpe::Gpt2) => Self::R50k,
            None => Self::Estimate,
        }
    }

    /// The correction applied to this tokenizer's counts before any reported usage: 1 for a
    /// real tokenizer, [`ESTIMATE_MARGIN`] for an estimate.
    #[must_use]
    pub fn prior_ratio(self) -> f64 {
        if self == Self::Estimate {
            ESTIMATE_MARGIN
        } else {
            1.0
        }
    }

    /// Loads the tokenizer's tables (about 2 s in a debug build, a fraction of that in a
    /// release build); blocks. Until it has run, [`Tokenizer::is_ready`] is false.
    pub fn warm_up(self) {
        let _ = self.bpe().count_ordinary("warm up");
        READY[self.slot()].store(true, Ordering::Release);
    }

    /// Whether the tables are loaded (counting will not block on loading them).
    #[must_use]
    pub fn is_ready(self) -> bool {
        READY[self.slot()].load(Ordering::Acquire)
    }

    /// [`Tokenizer::is_ready`], and when the tables are not loaded, starts loading them on a
    /// thread of their own (once per family): a model's tables (`o200k_base` alone is tens of
    /// MiB) are loaded when a request of that model is first measured, not at startup, so an
    /// idle server stays small and no request waits for them.
    #[must_use]
    pub fn ready_or_load(self) -> bool {
        if self.is_ready() {
            return true;
        }
        if !LOADING[self.slot()].swap(true, Ordering::AcqRel) {
            let spawned = std::thread::Builder::new()
                .name("tokenizer-load".to_owned())
                .spawn(move || self.warm_up());
            if let Err(error) = spawned {
                tracing::warn!(%error, "no thread to load a tokenizer; counting roughly");
                LOADING[self.slot()].store(false, Ordering::Release);
            }
        }
        false
    }

    /// The slot of the tables the tokenizer uses.
    fn slot(self) -> usize {
        match self {
            Self::O200k | Self::Estimate => 0,
            Self::O200kHarmony => 1,
            Self::Cl100k => 2,
            Self::P50k => 3,
            Self::R50k => 4,
        }
    }

    fn bpe(self) -> &'static CoreBPE {
        match self {
            Self::O200k | Self::Estimate => tiktoken_rs::o200k_base_singleton(),
            Self::O200kHarmony => tiktoken_rs::o200k_harmony_singleton(),
            Self::Cl100k => tiktoken_rs::cl100k_base_singleton(),
            Self::P50k => tiktoken_rs::p50k_base_singleton(),
            Self::R50k => tiktoken_rs::r50k_base_singleton(),
        }
    }

    /// The tokens of a text (special tokens counted as ordinary text).
    #[must_use]
    pub fn count(self, text: &str) -> u64 {
        if text.is_empty() {
            return 0;
        }
        u64::try_from(self.bpe().count_ordinary(text)).unwrap_or(u64::MAX)
    }
}

/// Whether each family's tables are loaded (see [`Tokenizer::slot`]).
static READY: [AtomicBool; 5] = [const { AtomicBool::new(false) }; 5];
/// Whether each family's tables are loading or loaded ([`Tokenizer::ready_or_load`]).
static LOADING: [AtomicBool; 5] = [const { AtomicBool::new(false) }; 5];

/// Bytes per token assumed while a tokenizer's tables are still loading: fewer than any BPE
/// averages on English or code (about 4), so the rough count errs high.
const ROUGH_BYTES_PER_TOKEN: u64 = 3;

/// The tokens of a text (`o200k_base`, special tokens counted as ordinary text).
#[must_use]
pub fn count_text(text: &str) -> u64 {
    Tokenizer::O200k.count(text)
}

/// Message counts shared by every run of the process (a message never changes once stored).
fn shared_cache() -> &'static Mutex<HashMap<(MessageId, Tokenizer), u64>> {
    static CACHE: OnceLock<Mutex<HashMap<(MessageId, Tokenizer), u64>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Counts messages and requests with one tokenizer, caching each message's count by id (in the
/// counter, and process-wide).
#[derive(Debug)]
pub struct TokenCounter {
    tokenizer: Tokenizer,
    cache: HashMap<MessageId, u64>,
    /// The tools last counted: (their names joined, their tokens).
    tools: Option<(String, u64)>,
}

impl Default for TokenCounter {
    fn default() -> Self {
        Self::with(Tokenizer::O200k)
    }
}

impl TokenCounter {
    /// An empty cache, counting with `o200k_base`.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty cache counting with `tokenizer`.
    #[must_use]
    pub fn with(tokenizer: Tokenizer) -> Self {
        Self {
            tokenizer,
            cache: HashMap::new(),
            tools: None,
        }
    }

    /// A counter for a model: its family's tokenizer (see [`Tokenizer::for_model`]).
    #[must_use]
    pub fn for_model(model: &str) -> Self {
        Self::with(Tokenizer::for_model(model))
    }

    /// The tokenizer counted with.
    #[must_use]
    pub fn tokenizer(&self) -> Tokenizer {
        self.tokenizer
    }

    /// The tokens of a text.
    #[must_use]
    pub fn text(&self, text: &str) -> u64 {
        self.tokenizer.count(text)
    }

    /// The tokens of one message: its content (JSON parts serialized, an image as
    /// `IMAGE_TOKENS`), reasoning, tool calls (name and arguments JSON) and the per-message
    /// overhead. Cached by message id.
    pub fn message(&mut self, message: &Message) -> u64 {
        if let Some(count) = self.cache.get(&message.id) {
            return *count;
        }
        let key = (message.id, self.tokenizer);
        let shared = shared_cache()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .copied();
        let count = shared.unwrap_or_else(|| {
            let count = count_message(self.tokenizer, message);
            let mut cache = shared_cache()
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if cache.len() >= SHARED_CACHE_ENTRIES {
                cache.clear();
            }
            cache.insert(key, count);
            count
        });
        self.cache.insert(message.id, count);
        count
    }

    /// The tokens of the tools' JSON (name, description, parameters schema), counted again only
    /// when the tools change.
    pub fn tools(&mut self, tools: &[ToolSpec]) -> u64 {
        let names: String = tools
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>()
            .join("\n");
        if let Some((known, count)) = &self.tools
            && *known == names
        {
            return *count;
        }
        let count = tools
            .iter()
            .map(|tool| {
                let json = serde_json::json!({
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.parameters,
                });
                self.tokenizer.count(&json.to_string())
            })
            .sum();
        self.tools = Some((names, count));
        count
    }

    /// A rough count of a message without the tokenizer (its bytes over
    /// `ROUGH_BYTES_PER_TOKEN`), for a request measured while the tables still load; not cached.
    #[must_use]
    pub fn rough_message(message: &Message) -> u64 {
        let bytes: usize = message
            .content
            .iter()
            .map(|part| match part {
                ContentPart::Text { text } => text.len(),
                ContentPart::Json { value } => value.to_string().len(),
                ContentPart::Image { .. } => 0,
            })
            .sum::<usize>()
            + message
                .reasoning
                .iter()
                .map(|r| r.text.len())
                .sum::<usize>()
            + message
                .tool_calls
                .iter()
                .map(|c| c.name.len() + c.arguments.to_string().len())
                .sum::<usize>();
        let images = message
            .content
            .iter()
            .filter(|part| matches!(part, ContentPart::Image { .. }))
            .count() as u64;
        PER_MESSAGE_OVERHEAD
            + (bytes as u64).div_ceil(ROUGH_BYTES_PER_TOKEN)
            + images * IMAGE_TOKENS
    }

    /// The prompt tokens of a request: every message, the tools' JSON and the reply priming.
    pub fn request(&mut self, messages: &[Message], tools: &[ToolSpec]) -> u64 {
        let messages: u64 = messages.iter().map(|m| self.message(m)).sum();
        messages + self.tools(tools) + REPLY_PRIMING
    }

    /// An estimated usage (`estimated: true`) for a call with this prompt and this reply.
    pub fn estimate(
        &mut self,
        messages: &[Message],
        tools: &[ToolSpec],
        reply: &Reply<'_>,
    ) -> TokenUsage {
        let input_tokens = self.request(messages, tools);
        self.usage(input_tokens, reply)
    }

    /// An estimated usage (`estimated: true`) for a call whose prompt counted `input_tokens`.
    #[must_use]
    pub fn usage(&self, input_tokens: u64, reply: &Reply<'_>) -> TokenUsage {
        let tokenizer = self.tokenizer;
        let reasoning_tokens = tokenizer.count(reply.reasoning);
        let output_tokens = tokenizer.count(reply.text)
            + reasoning_tokens
            + reply
                .tool_calls
                .iter()
                .map(|call| count_call(tokenizer, call))
                .sum::<u64>();
        TokenUsage {
            input_tokens,
            output_tokens,
            total_tokens: input_tokens + output_tokens,
            reasoning_tokens,
            estimated: true,
        }
    }
}

/// What a model call produced, for an estimate.
#[derive(Debug, Clone, Copy)]
pub struct Reply<'a> {
    /// The answer text.
    pub text: &'a str,
    /// The reasoning text.
    pub reasoning: &'a str,
    /// The tool calls.
    pub tool_calls: &'a [ToolCall],
}

fn count_call(tokenizer: Tokenizer, call: &ToolCall) -> u64 {
    let arguments = match &call.invalid_arguments {
        Some(raw) => raw.clone(),
        None => call.arguments.to_string(),
    };
    tokenizer.count(&call.name) + tokenizer.count(&arguments)
}

fn count_message(tokenizer: Tokenizer, message: &Message) -> u64 {
    let content: u64 = message
        .content
        .iter()
        .map(|part| match part {
            ContentPart::Text { text } => tokenizer.count(text),
            ContentPart::Json { value } => tokenizer.count(&value.to_string()),
            ContentPart::Image { .. } => IMAGE_TOKENS,
        })
        .sum();
    let reasoning: u64 = message
        .reasoning
        .iter()
        .map(|r| tokenizer.count(&r.text))
        .sum();
    let calls: u64 = message
        .tool_calls
        .iter()
        .map(|call| count_call(tokenizer, call))
        .sum();
    PER_MESSAGE_OVERHEAD + content + reasoning + calls
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_real_tokens_not_bytes() {
        assert_eq!(count_text(""), 0);
        // "hello world" is two o200k tokens; a long repeated word is far fewer tokens than bytes.
        assert_eq!(count_text("hello world"), 2);
        let long = "tokenizer ".repeat(100);
        let tokens = count_text(&long);
        assert!((100..300).contains(&tokens), "{tokens}");
    }

    #[test]
    fn estimates_are_marked_and_cached() {
        let mut counter = TokenCounter::new();
        let message = Message {
            id: MessageId::new(),
            session_id: crate::domain::SessionId::new(),
            run_id: crate::domain::RunId::new(),
            role: crate::domain::Role::User,
            content: vec![ContentPart::Text {
                text: "What is the weather in Paris?".to_owned(),
            }],
            reasoning: Vec::new(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            tool_name: None,
            created_at: chrono::Utc::now(),
            status: Default::default(),
        };
        let reply = Reply {
            text: "Sunny.",
            reasoning: "",
            tool_calls: &[],
        };
        let usage = counter.estimate(std::slice::from_ref(&message), &[], &reply);
        assert!(usage.estimated);
        assert!(usage.input_tokens > PER_MESSAGE_OVERHEAD + REPLY_PRIMING);
        assert_eq!(usage.output_tokens, count_text("Sunny."));
        assert_eq!(usage.total_tokens, usage.input_tokens + usage.output_tokens);
        let cached = counter.cache.get(&message.id).copied();
        let counted = count_message(Tokenizer::O200k, &message);
        assert_eq!(cached, Some(counted));
        assert_eq!(counter.message(&message), counted);
        // Another run's counter finds it in the process-wide cache.
        let shared = shared_cache()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(message.id, Tokenizer::O200k))
            .copied();
        assert_eq!(shared, Some(counted));
    }

    #[test]
    fn models_get_their_family_tokenizer() {
        assert_eq!(Tokenizer::for_model("gpt-4o-mini"), Tokenizer::O200k);
        assert_eq!(Tokenizer::for_model("gpt-4.1"), Tokenizer::O200k);
        assert_eq!(Tokenizer::for_model("openai/gpt-5-mini"), Tokenizer::O200k);
        assert_eq!(Tokenizer::for_model("gpt-4-0613"), Tokenizer::Cl100k);
        assert_eq!(Tokenizer::for_model("gpt-3.5-turbo"), Tokenizer::Cl100k);
        assert_eq!(
            Tokenizer::for_model("gpt-oss-120b"),
            Tokenizer::O200kHarmony
        );
        for other in [
            "claude-sonnet-4-20250514",
            "llama3.1:8b",
            "Qwen/Qwen3-8B",
            "fake-model",
        ] {
            assert_eq!(Tokenizer::for_model(other), Tokenizer::Estimate, "{other}");
        }
        assert!((Tokenizer::Estimate.prior_ratio() - ESTIMATE_MARGIN).abs() < f64::EPSILON);
        assert!((Tokenizer::O200k.prior_ratio() - 1.0).abs() < f64::EPSILON);
        // The BPEs differ: cl100k spends more tokens than o200k on this text.
        let text = "Über den Wolken muss die Freiheit wohl grenzenlos sein.";
        assert!(Tokenizer::Cl100k.count(text) > Tokenizer::O200k.count(text));
    }

    #[test]
    fn tools_are_counted_once_until_they_change() {
        let mut counter = TokenCounter::new();
        let tool = |name: &str| ToolSpec {
            name: name.to_owned(),
            description: "Adds two numbers.".to_owned(),
            parameters: serde_json::json!({"type": "object", "properties": {"a": {"type": "number"}}}),
        };
        let one = counter.tools(&[tool("add")]);
        assert!(one > 10, "{one}");
        assert_eq!(counter.tools(&[tool("add")]), one);
        assert!(counter.tools(&[tool("add"), tool("sub")]) > one);
        assert_eq!(counter.tools(&[]), 0);
    }
}
