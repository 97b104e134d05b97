//! Structured output: a run's `output_schema` from create to the parsed answer.
//!
//! - **At create** the schema is checked like a client tool's `parameters`
//!   (`tools::schema`: at most 10000 subschemas, every `$ref` resolving inside it, no `$ref`
//!   cycle, compiling); a problem is 422 `invalid_field` naming `output_schema`. A run that
//!   carries the schema may not also set the wire format's own key in `provider_options`
//!   (`response_format`, `output_config`/`output_format`).
//! - **Each model call** carries it in the provider's native form
//!   (`provider::structured::StructuredOutput`), or, for a provider configured with
//!   `structured_output = "prompt"`, in words appended to the run's instructions.
//! - **The final answer** (the text of a turn without tool calls) is parsed as JSON — a
//!   Markdown code fence around it is allowed — and validated against the schema. An invalid
//!   one gets up to `runtime.output_corrections` corrective turns: a user message with the
//!   errors, stored and announced by `output_rejected`, and one more model call; then the run
//!   fails with error class `output_invalid`. The session stays valid for its next request
//!   either way (the rejected answer and the correction are ordinary messages).

use serde_json::Value;

use super::CreateRunError;
use crate::config::{ProviderKind, StructuredOutputMode};
use crate::domain::{ContentPart, Message, Role, RunRecord, RunStatus};
use crate::events::OutputViolation;
use crate::provider::structured::{ANTHROPIC_KEY, OPENAI_KEY, StructuredOutput};
use crate::tools::schema::ToolSchema;

/// The `provider_options` keys that would carry a second output format, per wire format.
fn wire_keys(kind: ProviderKind) -> &'static [&'static str] {
    match kind {
        ProviderKind::Openai => &[OPENAI_KEY],
        ProviderKind::Anthropic => &[ANTHROPIC_KEY, "output_format"],
        ProviderKind::Scripted => &[],
    }
}

/// Checks a run's `output_schema` (see the module's documentation).
///
/// # Errors
/// `invalid_field` naming `output_schema` (the schema cannot be used) or `provider_options`
/// (it sets the wire format's own output key too).
pub(super) fn check_schema(
    schema: &Value,
    provider_options: Option<&Value>,
    kind: ProviderKind,
) -> Result<(), CreateRunError> {
    if let Err(error) = crate::tools::schema::compile(schema) {
        return Err(CreateRunError::InvalidField {
            field: "output_schema",
            reason: error.to_string(),
        });
    }
    if let Some(Value::Object(options)) = provider_options
        && let Some(key) = wire_keys(kind)
            .iter()
            .find(|key| options.contains_key(**key))
    {
        return Err(CreateRunError::InvalidField {
            field: "provider_options",
            reason: format!(
                "`{key}` carries the output format, which the run's `output_schema` sets; give \
                 one of them"
            ),
        });
    }
    Ok(())
}

/// What a run's model calls carry of its schema: the native form (`None` in `prompt` mode or
/// without a schema).
pub(super) fn native(record: &RunRecord, mode: StructuredOutputMode) -> Option<StructuredOutput> {
    match mode {
        StructuredOutputMode::Native => record.output_schema.clone().map(StructuredOutput::new),
        StructuredOutputMode::Prompt => None,
    }
}

/// The instructions a run's model calls carry: the run's, and in `prompt` mode the schema in
/// words after them.
pub(super) fn instructions(record: &RunRecord, mode: StructuredOutputMode) -> Option<String> {
    match (&record.output_schema, mode) {
        (Some(schema), StructuredOutputMode::Prompt) => {
            let request = format!(
                "Answer with a single JSON value that matches this JSON Schema, and nothing \
                 else (no prose, no code fence):\n{schema}"
            );
            Some(match record.instructions.as_deref() {
                Some(own) if !own.trim().is_empty() => format!("{own}\n\n{request}"),
                _ => request,
            })
        }
        _ => record.instructions.clone(),
    }
}

/// A run's compiled output schema and the corrective turns it has left.
#[derive(Debug)]
pub(super) struct OutputCheck {
    schema: ToolSchema,
    /// Corrective turns used so far.
    pub used: u32,
    /// Corrective turns allowed (`runtime.output_corrections`).
    pub allowed: u32,
}

/// What the check of a final answer decided.
#[derive(Debug)]
pub(super) enum Verdict {
    /// It matches: the parsed value.
    Valid(Value),
    /// It does not, and a corrective turn is left: its number (from 1), the errors, the user
    /// message to store.
    Correct {
        attempt: u32,
        errors: Vec<OutputViolation>,
        message: String,
    },
    /// It does not, and no corrective turn is left: the run's error.
    Fail(String),
}

impl OutputCheck {
    /// The check of `record`'s answers, `None` without an `output_schema`; `used` corrective
    /// turns were logged before (a resumed run).
    pub(super) fn of(record: &RunRecord, allowed: u32, used: u32) -> Option<Self> {
        let schema = record.output_schema.as_ref()?;
        Some(Self {
            schema: ToolSchema::new(schema),
            used,
            allowed,
        })
    }

    /// Checks the final answer `text`; a `Correct` verdict counts its corrective turn.
    pub(super) fn check(&mut self, text: &str) -> Verdict {
        let (errors, described) = match parse_answer(text) {
            Ok(value) => match self.schema.violations(&value) {
                Ok(()) => return Verdict::Valid(value),
                Err(violations) => {
                    let errors: Vec<OutputViolation> = violations
                        .into_iter()
                        .map(|(instance_path, message)| OutputViolation {
                            instance_path,
                            message,
                        })
                        .collect();
                    let described = format!(
                        "the answer does not match the schema: {}",
                        describe(&errors)
                    );
                    (errors, described)
                }
            },
            Err(error) => (
                vec![OutputViolation {
                    instance_path: String::new(),
                    message: error.clone(),
                }],
                error,
            ),
        };
        if self.used >= self.allowed {
            let after = match self.used {
                0 => String::new(),
                1 => " after 1 corrective turn".to_owned(),
                n => format!(" after {n} corrective turns"),
            };
            return Verdict::Fail(format!("the final answer is invalid{after}: {described}"));
        }
        self.used += 1;
        Verdict::Correct {
            attempt: self.used,
            message: format!(
                "Your answer is not valid: {described}. Answer again with only a JSON value that \
                 matches the requested JSON Schema."
            ),
            errors,
        }
    }
}

/// Schema violations in words, for the model and for `run_failed`: `/a: …; /b: …`.
fn describe(errors: &[OutputViolation]) -> String {
    errors
        .iter()
        .map(|e| {
            if e.instance_path.is_empty() {
                e.message.clone()
            } else {
                format!("{}: {}", e.instance_path, e.message)
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The JSON value an answer's text holds: the whole text, or the inside of one Markdown code
/// fence around it (```` ```json … ``` ````).
///
/// # Errors
/// Why it is not JSON, in words.
pub(crate) fn parse_answer(text: &str) -> Result<Value, String> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err("the answer is empty; a JSON value is required".to_owned());
    }
    let inner = trimmed
        .strip_prefix("```")
        .and_then(|rest| rest.strip_suffix("```"))
        .map_or(trimmed, |fenced| {
            // The fence's first line may name the language.
            fenced.split_once('\n').map_or(fenced, |(_, body)| body)
        });
    serde_json::from_str(inner).map_err(|error| format!("the answer is not JSON ({error})"))
}

/// The parsed answer of a completed run with an `output_schema`: the JSON its last assistant
/// message's text holds (`messages` are the run's assistant messages, in order). The run
/// completed only after that text was validated, so this is the value `run_completed` carried.
#[must_use]
pub fn parsed_output(record: &RunRecord, messages: &[Message]) -> Option<Value> {
    if record.output_schema.is_none() || record.status != RunStatus::Completed {
        return None;
    }
    let last = messages
        .iter()
        .rev()
        .find(|message| message.role == Role::Assistant)?;
    parse_answer(&answer_text(last)).ok()
}

/// The text of an answer: its message's text parts, joined.
pub(super) fn answer_text(message: &Message) -> String {
    message
        .content
        .iter()
        .filter_map(|part| match part {
            ContentPart::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(allowed: u32) -> OutputCheck {
        OutputCheck {
            schema: ToolSchema::new(&json!({
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            })),
            used: 0,
            allowed,
        }
    }

    #[test]
    fn answers_parse_bare_or_fenced() {
        assert_eq!(parse_answer(" {\"a\": 1} "), Ok(json!({"a": 1})));
        assert_eq!(
            parse_answer("```json\n{\"a\": [1]}\n```"),
            Ok(json!({"a": [1]}))
        );
        assert_eq!(parse_answer("```\n2\n```"), Ok(json!(2)));
        assert!(parse_answer("Sure! {\"a\": 1}").is_err());
        assert!(parse_answer("   ").is_err());
    }

    #[test]
    fn an_invalid_answer_is_corrected_then_fails() {
        let mut check = check(1);
        match check.check(r#"{"city": "Oslo"}"#) {
            Verdict::Correct {
                attempt, errors, ..
            } => {
                assert_eq!(attempt, 1);
                assert_eq!(
                    errors,
                    vec![OutputViolation {
                        instance_path: String::new(),
                        message: "\"days\" is a required property".to_owned(),
                    }]
                );
            }
            other => panic!("{other:?}"),
        }
        match check.check("not json") {
            Verdict::Fail(error) => {
                assert!(error.contains("after 1 corrective turn"), "{error}");
                assert!(error.contains("not JSON"), "{error}");
            }
            other => panic!("{other:?}"),
        }
        let mut none = self::check(0);
        assert!(matches!(none.check("[]"), Verdict::Fail(_)));
        assert!(matches!(
            self::check(1).check(r#"{"city": "Oslo", "days": 3}"#),
            Verdict::Valid(value) if value == json!({"city": "Oslo", "days": 3})
        ));
    }
}
