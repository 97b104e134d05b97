//! Tool calls as models really send them, for every adapter: argument text to JSON (repaired
//! only where the repair is unambiguous) and call ids that are unique within the session.

use std::collections::HashSet;

use serde_json::{Value, json};

use crate::domain::Message;

/// A call's arguments from the model's text: `(arguments, invalid_arguments)`.
///
/// - Empty text, only whitespace or `null`: `{}` (a call without parameters).
/// - A JSON object: it, `invalid_arguments` `None`.
/// - The one repair: raw control characters (U+0000 to U+001F, e.g. a newline in code a model
///   writes into a string) inside JSON strings are escaped (`\n`, `\r`, `\t`, `\u00XX`). JSON
///   forbids them there, and the escaped text has exactly one meaning.
/// - Anything else (text cut by the output limit, garbled text, two objects in a row such as
///   `{"a":1}{"a":1}`, trailing text, a value that is not an object): `{}` with
///   `invalid_arguments` the raw text, so that the call is reported, never dropped.
pub(super) fn parse_arguments(raw: &str) -> (Value, Option<String>) {
    let trimmed = raw.trim();
    if trimmed.is_empty() || trimmed == "null" {
        return (json!({}), None);
    }
    let parsed = serde_json::from_str::<Value>(trimmed).ok().or_else(|| {
        escape_controls_in_strings(trimmed)
            .and_then(|repaired| serde_json::from_str::<Value>(&repaired).ok())
    });
    match parsed {
        Some(value @ Value::Object(_)) => (value, None),
        _ => (json!({}), Some(raw.to_owned())),
    }
}

/// `text` with raw control characters inside JSON strings escaped; `None` when there is none.
fn escape_controls_in_strings(text: &str) -> Option<String> {
    let mut out = String::with_capacity(text.len() + 8);
    let (mut in_string, mut escaped, mut changed) = (false, false, false);
    for c in text.chars() {
        if in_string && !escaped && u32::from(c) < 0x20 {
            changed = true;
            match c {
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                other => out.push_str(&format!("\\u{:04x}", u32::from(other))),
            }
            continue;
        }
        out.push(c);
        if escaped {
            escaped = false;
        } else if in_string && c == '\\' {
            escaped = true;
        } else if c == '"' {
            in_string = !in_string;
        }
    }
    changed.then_some(out)
}

/// The call ids of one response, unique among themselves and the ids of the request's
/// history, so that every tool result pairs with exactly one call.
#[derive(Debug, Default)]
pub(super) struct CallIds {
    used: HashSet<String>,
    generated: usize,
}

impl CallIds {
    /// Ids already used by the tool calls of `history`.
    pub(super) fn of_history(history: &[Message]) -> Self {
        Self {
            used: history
                .iter()
                .flat_map(|message| message.tool_calls.iter().map(|call| call.id.clone()))
                .collect(),
            generated: 0,
        }
    }

    /// The id a call gets: the provider's `id` when it is new; a used one (a server reusing
    /// ids across turns or within a response) with the first free suffix `_2`, `_3`, …; a
    /// missing (empty) one as the first free `call_0`, `call_1`, ….
    pub(super) fn assign(&mut self, id: &str) -> String {
        let id = if id.is_empty() {
            loop {
                let candidate = format!("call_{}", self.generated);
                self.generated += 1;
                if !self.used.contains(&candidate) {
                    break candidate;
                }
            }
        } else if self.used.contains(id) {
            (2..)
                .map(|n| format!("{id}_{n}"))
                .find(|candidate| !self.used.contains(candidate))
                .unwrap_or_default()
        } else {
            id.to_owned()
        };
        self.used.insert(id.clone());
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_parse_or_are_kept_raw() {
        let ok = |raw: &str, value: Value| assert_eq!(parse_arguments(raw), (value, None), "{raw}");
        ok("", json!({}));
        ok("  null ", json!({}));
        ok(r#"{"a":1}"#, json!({"a": 1}));
        // Raw newline and tab inside a string: escaped.
        ok(
            "{\"code\":\"fn main() {\n\tx\n}\"}",
            json!({"code": "fn main() {\n\tx\n}"}),
        );
        // A raw newline between tokens is plain whitespace.
        ok("{\n\"a\": \"b\\\"\"\n}", json!({"a": "b\""}));
        for raw in [
            r#"{"a":1}{"a":1}"#,
            r#"{"location": "Par"#,
            "[1, 2]",
            "\"text\"",
            r#"{"a":1} trailing"#,
            "{a: 1}",
        ] {
            assert_eq!(
                parse_arguments(raw),
                (json!({}), Some(raw.to_owned())),
                "{raw}"
            );
        }
    }

    #[test]
    fn ids_are_unique_across_history_and_response() {
        let mut ids = CallIds::default();
        ids.used.insert("call_0".to_owned());
        ids.used.insert("abc".to_owned());
        assert_eq!(ids.assign(""), "call_1");
        assert_eq!(ids.assign("abc"), "abc_2");
        assert_eq!(ids.assign("abc"), "abc_3");
        assert_eq!(ids.assign("new"), "new");
        assert_eq!(ids.assign("new"), "new_2");
        assert_eq!(ids.assign(""), "call_2");
    }
}
