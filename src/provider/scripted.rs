//! behest's built-in model (`kind = "scripted"`): no network, no API key. It streams a
//! deterministic reply token by token at a configurable pace, reports usage, calls tools when
//! the input asks for it, and answers from their results — through the same [`Provider`]
//! contract as the HTTP adapters, so runs against it go through the same run loop and event log.
//!
//! **Built-in replies** (no `script`), from the request's last message:
//! - after tool results (the last messages are tool messages): one sentence per result,
//!   "`<tool>` answered <result JSON>.", then `Finished(Stop)`;
//! - `call <tool> {json}` anywhere in the input, for a tool offered to the run: that call,
//!   with the JSON object as its arguments (`{}` when none follows; a `{…}` after the name
//!   that is not valid JSON becomes the call's `invalid_arguments`, other text after it is
//!   ignored). Several `call …` make parallel
//!   calls. Ends with `Finished(ToolCalls)`;
//! - otherwise, an input mentioning `time` while the tool `current_time` is offered calls it;
//!   `tool_choice` `none` suppresses calls, `required` without a request calls the first tool
//!   offered, `{"name": …}` calls that tool (arguments `{}`);
//! - `count to N` (N up to 10000): the reply `1 2 3 … N.`, one token per number — at the
//!   default pace, 100 numbers take 3 s: time to cancel;
//! - a request to summarise (no tools offered, and the last user message holds a transcript
//!   between `<conversation>` and `</conversation>`, as behest's compaction sends): a short
//!   summary, "Summary of N earlier messages. The user last asked: “…”." with the first 8
//!   words of the transcript's last user input, after the first 8 words of the previous
//!   summary when the request carries one — at most about 30 words, so that a compaction
//!   against the demo model shrinks the context;
//! - anything else: a fixed greeting that quotes the input (and the run's instructions, when
//!   it has some, so a demo shows they arrive).
//!
//! A request with an output schema (a run's `output_schema`) is answered, where it would be
//! answered with text, with the schema's minimal instance as JSON text
//! ([`super::structured::minimal_instance`]: required properties only, `""`, `0`, `false`, the
//! first `enum` value, …) — deterministic, so a demo shows the shape arriving parsed.
//!
//! Of the model parameters it honours `max_output_tokens`, `stop` (the reply ends before the
//! first stop sequence, `Finished(Stop)`) and `parallel_tool_calls = false` (only the first
//! requested call is made); `temperature`, `top_p`, `seed` and `provider_options` are accepted
//! and ignored. Tools the run defines for the client are called like any other offered tool.
//!
//! **Pace**: each text token (a word with its following space) and each tool-call argument
//! piece is sent `token_delay_ms` (default 30) after the previous one. The reply is cut at the
//! model's `max_output_tokens` tokens (`Finished(Length)`).
//!
//! **Usage** (one `Usage` before `Finished`): `input_tokens` = whitespace-separated words of the
//! request's messages (text, JSON results and call arguments); `output_tokens` = text tokens
//! streamed plus one per tool call; `total_tokens` their sum; not estimated.
//!
//! **Script** (`script = "turns.json"` or `.toml`): a list of turns replayed in order, one per
//! model call across the whole server (a retried call takes the next turn; after the last turn
//! it starts over). JSON `{"turns": [...]}`, TOML `[[turns]]`. Each turn:
//! `delay_ms` (pause before the first token, default 0), `text` (streamed at the pace),
//! `tool_calls` (`[{name, arguments}]`), `error` (`{class, message}`: the call fails with that
//! [`ErrorClass`] — before any output when `text` is empty, else after the text).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use figment::providers::Format;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::Value;

use super::{ErrorClass, ModelEvent, ModelRequest, ModelStream, Provider, ProviderError, text_of};
use crate::config::{Config, ProviderConfig};
use crate::domain::{FinishReason, Role, TokenUsage, ToolCall, ToolChoice, ToolChoiceMode};

/// Default pause between two streamed tokens, in ms.
pub const DEFAULT_TOKEN_DELAY_MS: u64 = 30;

/// Largest `count to N` the built-in replies honour.
const MAX_COUNT: u64 = 10_000;

/// Characters of tool-call arguments per `ToolCallDelta`.
const ARGUMENT_PIECE_CHARS: usize = 16;

/// The provider and model the server offers when started without any configuration.
pub const DEMO_PROVIDER: &str = "demo";

/// The configuration of the no-config demo: provider `demo` (`kind = "scripted"`, model
/// `demo`, context window 32768, 4096 output tokens) and the built-in tool `current_time`.
const DEMO_TOML: &str = "builtin_tools = [\"current_time\"]\n\
    [providers.demo]\nkind = \"scripted\"\n\
    [providers.demo.models.demo]\ncontext_window = 32768\nmax_output_tokens = 4096\n";

/// Adds the demo provider `demo` (model `demo`) and the built-in tool `current_time` to
/// `config`; `behest serve` does this when it runs without a configuration file and no
/// provider is configured.
#[must_use]
pub fn with_demo(mut config: Config) -> Config {
    if let Ok(demo) = Config::from_toml(DEMO_TOML) {
        config.providers.extend(demo.providers);
        for tool in demo.builtin_tools {
            if !config.builtin_tools.contains(&tool) {
                config.builtin_tools.push(tool);
            }
        }
    }
    config
}

/// A script: the turns to replay.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    /// The turns, in order; at least one.
    pub turns: Vec<Turn>,
}

/// One scripted model call.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Turn {
    /// Pause before the first token, in ms.
    pub delay_ms: u64,
    /// Text to stream, token by token.
    pub text: String,
    /// Tool calls to make after the text.
    pub tool_calls: Vec<ScriptedCall>,
    /// Fail the call this way (after the text, if any).
    pub error: Option<ScriptedError>,
}

/// A scripted tool call. `arguments` given as a JSON string is sent as the call's raw argument
/// text, as a model producing invalid JSON would (the call gets `invalid_arguments`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptedCall {
    /// The tool's name.
    pub name: String,
    /// Its arguments; default `{}`.
    #[serde(default = "empty_object")]
    pub arguments: Value,
}

/// A scripted failure.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptedError {
    /// The failure class (`server`, `rate_limited`, …).
    pub class: ErrorClass,
    /// Its message.
    pub message: String,
}

fn empty_object() -> Value {
    Value::Object(serde_json::Map::new())
}

/// The built-in model.
#[derive(Debug)]
pub struct Scripted {
    id: String,
    token_delay: Duration,
    script: Option<Arc<Script>>,
    next_turn: AtomicUsize,
}

impl Scripted {
    /// The provider `id` of `config`, with its script read and parsed now.
    ///
    /// # Errors
    /// An `invalid_request` [`ProviderError`] when the script cannot be read or parsed, or has
    /// no turns.
    pub fn new(id: &str, config: &ProviderConfig) -> Result<Self, ProviderError> {
        let script = match &config.script {
            Some(path) => Some(Arc::new(read_script(path).map_err(|reason| {
                ProviderError::new(
                    id,
                    ErrorClass::InvalidRequest,
                    format!("script `{}`: {reason}", path.display()),
                )
            })?)),
            None => None,
        };
        Ok(Self {
            id: id.to_owned(),
            token_delay: Duration::from_millis(
                config.token_delay_ms.unwrap_or(DEFAULT_TOKEN_DELAY_MS),
            ),
            script,
            next_turn: AtomicUsize::new(0),
        })
    }

    fn turn(&self, request: &ModelRequest) -> Turn {
        match &self.script {
            Some(script) => {
                let index = self.next_turn.fetch_add(1, Ordering::Relaxed) % script.turns.len();
                script.turns[index].clone()
            }
            None => {
                let mut turn = built_in_turn(request);
                if let Some(output) = &request.output
                    && turn.tool_calls.is_empty()
                {
                    turn.text = super::structured::minimal_instance(&output.schema).to_string();
                }
                turn
            }
        }
    }
}

/// Reads a script file: TOML when its name ends in `.toml`, JSON otherwise.
fn read_script(path: &Path) -> Result<Script, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let script: Script = if path.extension().is_some_and(|ext| ext == "toml") {
        figment::Figment::from(figment::providers::Toml::string(&text))
            .extract()
            .map_err(|e| e.to_string())?
    } else {
        serde_json::from_str(&text).map_err(|e| e.to_string())?
    };
    if script.turns.is_empty() {
        return Err("a script needs at least one turn".to_owned());
    }
    Ok(script)
}

#[async_trait]
impl Provider for Scripted {
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ProviderError> {
        let turn = self.turn(&request);
        let limit = request
            .max_output_tokens
            .map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX));
        let mut steps: Vec<(Duration, Result<ModelEvent, ProviderError>)> = Vec::new();
        let pace = self.token_delay;
        let mut first_delay = Duration::from_millis(turn.delay_ms);
        let mut next_delay = || std::mem::take(&mut first_delay) + pace;

        // A stop sequence ends the text where it first appears (it is not sent).
        let (text, stopped) = cut_at_stop(&turn.text, &request.stop);
        let tokens: Vec<&str> = text.split_inclusive(' ').collect();
        let cut = tokens.len() > limit;
        for token in tokens.iter().take(limit) {
            steps.push((next_delay(), Ok(ModelEvent::TextDelta((*token).to_owned()))));
        }
        let mut output_tokens = tokens.len().min(limit);
        if let Some(error) = &turn.error {
            let error = ProviderError::new(&self.id, error.class, error.message.clone());
            steps.push((next_delay(), Err(error)));
        } else {
            let mut finish = if cut {
                FinishReason::Length
            } else {
                FinishReason::Stop
            };
            if !cut && !stopped && !turn.tool_calls.is_empty() {
                finish = FinishReason::ToolCalls;
                let first_id = request
                    .messages
                    .iter()
                    .map(|m| m.tool_calls.len())
                    .sum::<usize>()
                    + 1;
                for (index, call) in turn.tool_calls.iter().enumerate() {
                    let call_id = format!("call_{}", first_id + index);
                    let invalid = call.arguments.as_str().map(str::to_owned);
                    let text = invalid
                        .clone()
                        .unwrap_or_else(|| call.arguments.to_string());
                    steps.push((
                        next_delay(),
                        Ok(ModelEvent::ToolCallStarted {
                            call_id: call_id.clone(),
                            tool_name: call.name.clone(),
                        }),
                    ));
                    for piece in pieces(&text) {
                        steps.push((
                            next_delay(),
                            Ok(ModelEvent::ToolCallDelta {
                                call_id: call_id.clone(),
                                delta: piece,
                            }),
                        ));
                    }
                    let arguments = if invalid.is_some() {
                        empty_object()
                    } else {
                        call.arguments.clone()
                    };
                    steps.push((
                        Duration::ZERO,
                        Ok(ModelEvent::ToolCallCompleted(ToolCall {
                            id: call_id,
                            name: call.name.clone(),
                            arguments,
                            invalid_arguments: invalid,
                        })),
                    ));
                    output_tokens += 1;
                }
            }
            let input_tokens = input_words(&request);
            let output_tokens = u64::try_from(output_tokens).unwrap_or(u64::MAX);
            let usage = TokenUsage {
                input_tokens,
                output_tokens,
                total_tokens: input_tokens + output_tokens,
                reasoning_tokens: 0,
                estimated: false,
            };
            steps.push((Duration::ZERO, Ok(ModelEvent::Usage { usage, cache: None })));
            steps.push((Duration::ZERO, Ok(ModelEvent::Finished(finish))));
        }
        Ok(futures::stream::iter(steps)
            .then(|(delay, event)| async move {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                event
            })
            .boxed())
    }
}

/// `text` up to the first of the `stop` sequences, and whether one was found.
fn cut_at_stop<'a>(text: &'a str, stop: &[String]) -> (&'a str, bool) {
    match stop
        .iter()
        .filter(|sequence| !sequence.is_empty())
        .filter_map(|sequence| text.find(sequence.as_str()))
        .min()
    {
        Some(at) => (&text[..at], true),
        None => (text, false),
    }
}

/// `text` in pieces of [`ARGUMENT_PIECE_CHARS`] characters.
fn pieces(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars
        .chunks(ARGUMENT_PIECE_CHARS)
        .map(|chunk| chunk.iter().collect())
        .collect()
}

/// Whitespace-separated words of every message's text, results and call arguments.
fn input_words(request: &ModelRequest) -> u64 {
    let words: usize = request
        .messages
        .iter()
        .map(|message| {
            text_of(&message.content).split_whitespace().count()
                + message
                    .tool_calls
                    .iter()
                    .map(|call| call.arguments.to_string().split_whitespace().count())
                    .sum::<usize>()
        })
        .sum();
    u64::try_from(words).unwrap_or(u64::MAX)
}

/// The built-in reply to `request` (see the module documentation).
fn built_in_turn(request: &ModelRequest) -> Turn {
    let trailing_results: Vec<_> = request
        .messages
        .iter()
        .rev()
        .take_while(|message| message.role == Role::Tool)
        .collect();
    if !trailing_results.is_empty() {
        let text = trailing_results
            .iter()
            .rev()
            .map(|message| {
                format!(
                    "`{}` answered {}.",
                    message.tool_name.as_deref().unwrap_or("tool"),
                    text_of(&message.content)
                )
            })
            .collect::<Vec<_>>()
            .join(" ");
        return Turn {
            text,
            ..Turn::default()
        };
    }
    let input = request
        .messages
        .iter()
        .rev()
        .find(|message| message.role == Role::User)
        .map(|message| text_of(&message.content))
        .unwrap_or_default();
    if request.tools.is_empty()
        && let Some(text) = summary_of(&input)
    {
        return Turn {
            text,
            ..Turn::default()
        };
    }
    let mut tool_calls = requested_calls(request, &input);
    if request.parallel_tool_calls == Some(false) {
        tool_calls.truncate(1);
    }
    if !tool_calls.is_empty() {
        return Turn {
            tool_calls,
            ..Turn::default()
        };
    }
    let text = match count_to(&input) {
        Some(n) => {
            let numbers: Vec<String> = (1..=n).map(|i| i.to_string()).collect();
            format!("{}.", numbers.join(" "))
        }
        None => {
            let greeting = format!(
                "Hello! I am behest's built-in demo model. You said: “{}”. Ask me what time it \
                 is to see a tool call, or to count to 200 to have time to cancel.",
                input.trim()
            );
            match request.instructions.as_deref().map(str::trim) {
                Some(instructions) if !instructions.is_empty() => {
                    format!("(My instructions: “{instructions}”.) {greeting}")
                }
                _ => greeting,
            }
        }
    };
    Turn {
        text,
        ..Turn::default()
    }
}

/// The built-in summary of a summariser's prompt (see the module documentation), `None` when
/// `input` holds no `<conversation>` transcript.
fn summary_of(input: &str) -> Option<String> {
    let (before, rest) = input.split_once("<conversation>")?;
    let (transcript, _) = rest.split_once("</conversation>")?;
    let first_words = |text: &str| {
        let words: Vec<&str> = text.split_whitespace().collect();
        let mut kept = words[..words.len().min(8)].join(" ");
        if words.len() > 8 {
            kept.push_str(" …");
        }
        kept
    };
    let messages = transcript
        .lines()
        .filter(|line| {
            ["[user]", "[assistant]", "[system]"].contains(line)
                || line.starts_with("[result of the tool `")
        })
        .count();
    let last_input = transcript
        .rsplit("[user]\n")
        .next()
        .filter(|_| transcript.contains("[user]\n"))
        .map(|text| text.split("\n[").next().unwrap_or(text));
    let mut summary = String::new();
    if let Some((_, previous)) = before.split_once("<summary>")
        && let Some((previous, _)) = previous.split_once("</summary>")
    {
        summary.push_str(&format!("Before: {} ", first_words(previous)));
    }
    summary.push_str(&format!("Summary of {messages} earlier messages."));
    if let Some(last_input) = last_input {
        summary.push_str(&format!(
            " The user last asked: “{}”.",
            first_words(last_input)
        ));
    }
    Some(summary)
}

/// The tool calls the input asks for, under the run's `tool_choice`.
fn requested_calls(request: &ModelRequest, input: &str) -> Vec<ScriptedCall> {
    let offered = |name: &str| request.tools.iter().any(|tool| tool.name == name);
    if request.tools.is_empty() || request.tool_choice == ToolChoice::Mode(ToolChoiceMode::None) {
        return Vec::new();
    }
    let mut calls = Vec::new();
    let mut rest = input;
    while let Some(at) = rest.find("call ") {
        // A word of its own: "recall x" is no request.
        let word_start = rest[..at]
            .chars()
            .next_back()
            .is_none_or(|c| !c.is_alphanumeric());
        let after = &rest[at + "call ".len()..];
        if !word_start {
            rest = after;
            continue;
        }
        let name_len = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
            .unwrap_or(after.len());
        let name = &after[..name_len];
        rest = &after[name_len..];
        if name.is_empty() || !offered(name) {
            continue;
        }
        let arguments = {
            let trimmed = rest.trim_start();
            if trimmed.starts_with('{') {
                let mut values = serde_json::Deserializer::from_str(trimmed).into_iter::<Value>();
                match values.next() {
                    Some(Ok(value)) => {
                        rest = &trimmed[values.byte_offset()..];
                        value
                    }
                    // Not valid JSON: the call carries the text up to the next `call `.
                    _ => {
                        let end = trimmed.find(" call ").unwrap_or(trimmed.len());
                        rest = &trimmed[end..];
                        Value::String(trimmed[..end].trim_end().to_owned())
                    }
                }
            } else {
                empty_object()
            }
        };
        calls.push(ScriptedCall {
            name: name.to_owned(),
            arguments,
        });
    }
    if calls.is_empty() && input.to_lowercase().contains("time") && offered("current_time") {
        calls.push(ScriptedCall {
            name: "current_time".to_owned(),
            arguments: empty_object(),
        });
    }
    if calls.is_empty() {
        let forced = match &request.tool_choice {
            ToolChoice::Tool { name } => Some(name.clone()),
            ToolChoice::Mode(ToolChoiceMode::Required) => {
                request.tools.first().map(|tool| tool.name.clone())
            }
            ToolChoice::Mode(_) => None,
        };
        calls.extend(forced.map(|name| ScriptedCall {
            name,
            arguments: empty_object(),
        }));
    }
    calls
}

/// `N` of "count to N" (case-insensitive), at most [`MAX_COUNT`].
fn count_to(input: &str) -> Option<u64> {
    let lower = input.to_lowercase();
    let at = lower.find("count to ")?;
    let digits: String = lower[at + "count to ".len()..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse::<u64>().ok().map(|n| n.clamp(1, MAX_COUNT))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{ContentPart, Message, MessageId, RunId, SessionId};
    use crate::provider::ToolSpec;

    fn user(text: &str) -> Message {
        Message {
            id: MessageId::new(),
            session_id: SessionId::new(),
            run_id: RunId::new(),
            role: Role::User,
            content: vec![ContentPart::Text {
                text: text.to_owned(),
            }],
            reasoning: Vec::new(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            tool_name: None,
            created_at: chrono::Utc::now(),
            status: Default::default(),
        }
    }

    fn request(input: &str, tools: &[&str]) -> ModelRequest {
        ModelRequest {
            model: "demo".to_owned(),
            messages: vec![user(input)].into(),
            tools: tools
                .iter()
                .map(|name| ToolSpec {
                    name: (*name).to_owned(),
                    description: String::new(),
                    parameters: empty_object(),
                })
                .collect(),
            tool_choice: ToolChoice::default(),
            max_output_tokens: Some(100),
            ..ModelRequest::default()
        }
    }

    #[test]
    fn explicit_calls_parse_arguments_and_bad_json() {
        let calls = requested_calls(
            &request("", &["add", "echo"]),
            "please call add {\"a\": 1, \"b\": 2} then call echo {oops and call nothing {} recall add",
        );
        assert_eq!(calls.len(), 2, "{calls:?}");
        assert_eq!(calls[0].name, "add");
        assert_eq!(calls[0].arguments, serde_json::json!({"a": 1, "b": 2}));
        assert_eq!(calls[1].name, "echo");
        assert_eq!(calls[1].arguments, Value::String("{oops and".to_owned()));
    }

    #[test]
    fn a_summariser_prompt_gets_a_short_summary_of_the_transcript() {
        let long = "word ".repeat(300);
        let prompt = format!(
            "Summary of the conversation before this part:\n<summary>\nThe user greeted.\n\
             </summary>\n\nConversation to summarise:\n<conversation>\n[user]\nhello\n\n\
             [assistant]\n{long}\n(called the tool `add` with {{}})\n\n[result of the tool \
             `add`]\n3\n\n[user]\nwhat is the weather in Paris today and tomorrow please\n\n[assistant]\n\
             {long}\n</conversation>\n\nWrite the summary."
        );
        let turn = built_in_turn(&request(&prompt, &[]));
        assert_eq!(
            turn.text,
            "Before: The user greeted. Summary of 5 earlier messages. The user last asked: \
             “what is the weather in Paris today and …”."
        );
        assert!(turn.tool_calls.is_empty());
        // Offered tools, or no transcript: not a summariser's request.
        let with_tools = built_in_turn(&request(&prompt, &["add"]));
        assert!(with_tools.text.starts_with("Hello!"), "{}", with_tools.text);
        let plain = built_in_turn(&request("summarise <conversation> please", &[]));
        assert!(plain.text.starts_with("Hello!"), "{}", plain.text);
    }

    #[test]
    fn time_keyword_needs_the_tool_and_respects_none() {
        assert_eq!(
            requested_calls(&request("", &["current_time"]), "What time is it?").len(),
            1
        );
        assert!(requested_calls(&request("", &[]), "What time is it?").is_empty());
        let mut none = request("", &["current_time"]);
        none.tool_choice = ToolChoice::Mode(ToolChoiceMode::None);
        assert!(requested_calls(&none, "What time is it?").is_empty());
    }

    #[test]
    fn count_is_bounded() {
        assert_eq!(count_to("Count to 5 please"), Some(5));
        assert_eq!(count_to("count to 99999999"), Some(MAX_COUNT));
        assert_eq!(count_to("count to many"), None);
        let turn = built_in_turn(&request("count to 3", &[]));
        assert_eq!(turn.text, "1 2 3.");
    }

    #[test]
    fn stop_instructions_and_parallel_calls_are_honoured() {
        assert_eq!(
            cut_at_stop("one two END three", &["END".to_owned()]),
            ("one two ", true)
        );
        assert_eq!(cut_at_stop("one", &["x".to_owned()]), ("one", false));
        let mut greeting = request("hi", &[]);
        greeting.instructions = Some("Be kind.".to_owned());
        assert!(
            built_in_turn(&greeting)
                .text
                .starts_with("(My instructions: “Be kind.”.) Hello!")
        );
        let mut calls = request("call a call b", &["a", "b"]);
        assert_eq!(built_in_turn(&calls).tool_calls.len(), 2);
        calls.parallel_tool_calls = Some(false);
        assert_eq!(built_in_turn(&calls).tool_calls.len(), 1);
    }

    #[tokio::test]
    async fn reply_is_cut_at_max_output_tokens() -> Result<(), ProviderError> {
        let config = Config::from_toml(
            "[providers.s]\nkind = \"scripted\"\ntoken_delay_ms = 0\n[providers.s.models.m]\ncontext_window = 100\nmax_output_tokens = 10\n",
        )
        .map_err(|e| ProviderError::new("s", ErrorClass::InvalidRequest, e.to_string()))?;
        let provider = Scripted::new("s", &config.providers["s"])?;
        let mut request = request("count to 50", &[]);
        request.max_output_tokens = Some(4);
        let events: Vec<_> = provider.stream(request).await?.collect().await;
        let texts = events
            .iter()
            .filter(|e| matches!(e, Ok(ModelEvent::TextDelta(_))))
            .count();
        assert_eq!(texts, 4);
        assert_eq!(
            events.last(),
            Some(&Ok(ModelEvent::Finished(FinishReason::Length)))
        );
        Ok(())
    }
}
