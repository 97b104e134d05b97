//! The stored layout of a logged event: its payload once, its envelope as a few compact values
//! from which the JSON the watchers were sent is derived again, byte for byte.
//!
//! A live event's `data` is `{"sequence":…,"run_id":"…","timestamp":"…","trace_id":"…",
//! "span_id":"…","type":"…",<payload fields>}`. `sequence` and `run_id` are the row's key; the
//! `type` is a small code; the timestamp, span id and trace id are an integer and two byte
//! strings (the trace id only when it is not the run id, the default trace of a run without a
//! `traceparent`); the payload fields are kept as sent, less the kind's first field name. An
//! event is stored that way only when [`StoredEvent::render`] gives back exactly the bytes that
//! were sent; any other one is stored verbatim. Migration `0006_compact_events` converts the
//! older rows with the same rules, in SQL.

use chrono::{DateTime, SecondsFormat};

use super::LoggedEvent;
use crate::domain::RunId;

/// One kind of event in the store: its code, its `type` tag, and the text its payload fields
/// start with (the first field's name), left out of the stored body.
struct Kind {
    code: i16,
    tag: &'static str,
    first_field: &'static str,
}

/// The stored codes. Part of the storage format (and of migration 0006's SQL): append only,
/// never renumber or change a row.
const KINDS: &[Kind] = &[
    kind(1, "run_started", "session_id"),
    kind(2, "context_built", "message_count"),
    kind(3, "model_started", "provider"),
    kind(4, "text_delta", "delta"),
    kind(5, "tool_call_started", "call_id"),
    kind(6, "tool_call_delta", "call_id"),
    kind(7, "tool_call_completed", "call"),
    kind(8, "tool_execution_started", "call_id"),
    kind(9, "tool_execution_finished", "call_id"),
    kind(10, "assistant_message_committed", "message_id"),
    kind(11, "tool_message_committed", "message_id"),
    kind(12, "usage_recorded", "usage"),
    kind(13, "cache_metrics", "cache_creation_input_tokens"),
    kind(14, "run_completed", "finish_reason"),
    kind(15, "run_failed", "error"),
    kind(16, "run_cancelled", ""),
    kind(17, "doom_loop_detected", "description"),
    kind(18, "compaction_circuit_opened", "consecutive_failures"),
    kind(19, "reasoning_delta", "delta"),
    kind(20, "model_retrying", "attempt"),
    kind(21, "run_resumed", "iteration"),
    kind(22, "tool_calls_required", "message_id"),
    kind(23, "context_compacted", "compaction_id"),
    kind(24, "context_compaction_started", "trigger"),
    kind(25, "output_rejected", "message_id"),
    kind(26, "tool_progress", "call_id"),
    kind(27, "tool_approval_decided", "call_id"),
];

const fn kind(code: i16, tag: &'static str, first_field: &'static str) -> Kind {
    Kind {
        code,
        tag,
        first_field,
    }
}

/// The code of a type no [`KINDS`] row names: the row is verbatim and its `type` is read from
/// its JSON.
pub const UNKNOWN_KIND: i16 = 0;

fn by_tag(tag: &str) -> Option<&'static Kind> {
    KINDS.iter().find(|kind| kind.tag == tag)
}

fn by_code(code: i16) -> Option<&'static Kind> {
    KINDS.iter().find(|kind| kind.code == code)
}

fn is_terminal(tag: &str) -> bool {
    matches!(tag, "run_completed" | "run_failed" | "run_cancelled")
}

/// The envelope values of a compact row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredEnvelope {
    /// `timestamp`, in nanoseconds since the Unix epoch (UTC).
    pub emitted_at: i64,
    /// `span_id`: its 8 bytes (16 lowercase hex characters on the wire).
    pub span_id: Vec<u8>,
    /// `trace_id`: its 16 bytes (32 lowercase hex characters on the wire), or `None` when it
    /// is the run id's 32 hex characters.
    pub trace_id: Option<Vec<u8>>,
}

/// An event as a row of the `events` table holds it, less its key (`run_id`, `sequence`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredEvent {
    /// The `type` tag's code ([`UNKNOWN_KIND`] for a tag this version does not know).
    pub kind: i16,
    /// The envelope's values; `None` for a verbatim row.
    pub envelope: Option<StoredEnvelope>,
    /// Compact row: the payload fields after the kind's first field name (UTF-8 JSON text).
    /// Verbatim row: the event's whole JSON.
    pub body: String,
}

impl StoredEvent {
    /// The stored form of `event`, an event of run `run_id`: compact when rendering it gives
    /// back `event.data` exactly, verbatim otherwise.
    #[must_use]
    pub fn encode(run_id: RunId, event: &LoggedEvent) -> Self {
        let known = by_tag(&event.event_type);
        if let Some(kind) = known
            && let Some(compact) = compact(run_id, kind, &event.data)
            && compact.render(run_id, event.sequence).as_deref() == Some(&*event.data)
        {
            return compact;
        }
        Self {
            kind: known.map_or(UNKNOWN_KIND, |kind| kind.code),
            envelope: None,
            body: event.data.to_string(),
        }
    }

    /// The logged event again: `data` byte for byte what was sent live.
    ///
    /// # Errors
    /// A description of what is wrong when the row is not one [`StoredEvent::encode`] writes
    /// (an unknown kind code, a verbatim row without a `type`, bad envelope values).
    pub fn decode(self, run_id: RunId, sequence: u64) -> Result<LoggedEvent, String> {
        let kind = by_code(self.kind);
        let (event_type, data) = match (&self.envelope, kind) {
            (Some(_), Some(kind)) => {
                let data = self.render(run_id, sequence).ok_or_else(|| {
                    format!(
                        "event {sequence}: envelope values out of range (kind {})",
                        self.kind
                    )
                })?;
                (kind.tag.to_owned(), data)
            }
            (Some(_), None) => {
                return Err(format!("event {sequence}: unknown kind {}", self.kind));
            }
            (None, Some(kind)) => (kind.tag.to_owned(), self.body),
            (None, None) => {
                let event_type = verbatim_type(&self.body)
                    .ok_or_else(|| format!("event {sequence}: no type (kind {})", self.kind))?;
                (event_type, self.body)
            }
        };
        Ok(LoggedEvent {
            sequence,
            terminal: is_terminal(&event_type),
            event_type,
            data: data.into(),
        })
    }

    /// The JSON of a compact row; `None` for a verbatim row or values no event has (an
    /// unknown kind, a timestamp out of range, ids of the wrong length).
    #[must_use]
    pub fn render(&self, run_id: RunId, sequence: u64) -> Option<String> {
        use std::fmt::Write as _;
        let envelope = self.envelope.as_ref()?;
        let kind = by_code(self.kind)?;
        let timestamp = DateTime::from_timestamp_nanos(envelope.emitted_at)
            .to_rfc3339_opts(SecondsFormat::AutoSi, true);
        let trace_id = match &envelope.trace_id {
            Some(bytes) if bytes.len() == 16 => hex::encode(bytes),
            Some(_) => return None,
            None => run_id.0.simple().to_string(),
        };
        if envelope.span_id.len() != 8 {
            return None;
        }
        let mut data = String::with_capacity(160 + self.body.len());
        let _ = write!(
            data,
            "{{\"sequence\":{sequence},\"run_id\":\"{run_id}\",\"timestamp\":\"{timestamp}\",\
             \"trace_id\":\"{trace_id}\",\"span_id\":\"{}\",\"type\":\"{}\"",
            hex::encode(&envelope.span_id),
            kind.tag,
        );
        if !kind.first_field.is_empty() || !self.body.is_empty() {
            data.push(',');
            if !kind.first_field.is_empty() {
                let _ = write!(data, "\"{}\":", kind.first_field);
            }
            data.push_str(&self.body);
        }
        data.push('}');
        Some(data)
    }
}

/// The compact values `data` would have, if it has the envelope's layout (checked by the
/// caller, which renders them back).
fn compact(run_id: RunId, kind: &Kind, data: &str) -> Option<StoredEvent> {
    let (_, rest) = data.split_once(",\"timestamp\":\"")?;
    let (timestamp, rest) = rest.split_once("\",\"trace_id\":\"")?;
    let (trace_id, rest) = rest.split_once("\",\"span_id\":\"")?;
    let (span_id, rest) = rest.split_once("\",\"type\":\"")?;
    let tail = rest.strip_prefix(kind.tag)?.strip_prefix('"')?;
    let fields = match tail {
        "}" => "",
        _ => tail.strip_prefix(',')?.strip_suffix('}')?,
    };
    let body = if kind.first_field.is_empty() {
        fields
    } else {
        fields
            .strip_prefix('"')?
            .strip_prefix(kind.first_field)?
            .strip_prefix("\":")?
    };
    let emitted_at = DateTime::parse_from_rfc3339(timestamp)
        .ok()?
        .timestamp_nanos_opt()?;
    let trace_id = if trace_id == run_id.0.simple().to_string() {
        None
    } else {
        Some(hex::decode(trace_id).ok()?).filter(|bytes| bytes.len() == 16)
    };
    let span_id = hex::decode(span_id).ok().filter(|bytes| bytes.len() == 8)?;
    Some(StoredEvent {
        kind: kind.code,
        envelope: Some(StoredEnvelope {
            emitted_at,
            span_id,
            trace_id,
        }),
        body: body.to_owned(),
    })
}

fn verbatim_type(data: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_str(data).ok()?;
    value.get("type")?.as_str().map(str::to_owned)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    fn logged(event_type: &str, data: String) -> LoggedEvent {
        LoggedEvent {
            sequence: 7,
            terminal: is_terminal(event_type),
            event_type: event_type.to_owned(),
            data: data.into(),
        }
    }

    fn envelope(run_id: RunId, timestamp: &str, trace_id: &str, span_id: &str) -> String {
        format!(
            "{{\"sequence\":7,\"run_id\":\"{run_id}\",\"timestamp\":\"{timestamp}\",\
             \"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\""
        )
    }

    #[test]
    fn every_code_names_its_row() {
        // Appended in code order; a code another branch took may be missing until it merges.
        let mut last = 0;
        for kind in KINDS {
            assert!(kind.code > last, "{} after code {last}", kind.tag);
            last = kind.code;
            assert_eq!(by_code(kind.code).map(|k| k.tag), Some(kind.tag));
        }
        let tags: Vec<&str> = crate::events::variant_schemas()
            .iter()
            .map(|variant| variant.tag)
            .collect();
        for tag in &tags {
            assert!(by_tag(tag).is_some(), "{tag} has a stored code");
        }
        assert_eq!(tags.len(), KINDS.len());
    }

    #[test]
    fn compact_rows_render_the_sent_bytes() {
        let run_id = RunId::new();
        let simple = run_id.0.simple().to_string();
        let cases = [
            (
                "text_delta",
                "2026-12-03T13:58:12.123456789Z",
                simple.as_str(),
                ",\"delta\":\" t5\"}",
            ),
            (
                "text_delta",
                "2026-12-03T13:58:12.120Z",
                simple.as_str(),
                ",\"delta\":\"\\\"é\\n\"}",
            ),
            (
                "run_cancelled",
                "2026-12-03T13:58:12Z",
                "4bf92f3577b34da6a3ce929d0e0e4736",
                "}",
            ),
            (
                "run_failed",
                "2026-12-03T13:58:12.123400Z",
                simple.as_str(),
                ",\"error\":\"x\",\"error_class\":\"internal\"}",
            ),
        ];
        for (event_type, timestamp, trace_id, tail) in cases {
            let data = format!(
                "{},\"type\":\"{event_type}\"{tail}",
                envelope(run_id, timestamp, trace_id, "00f067aa0ba902b7")
            );
            let event = logged(event_type, data.clone());
            let stored = StoredEvent::encode(run_id, &event);
            assert!(stored.envelope.is_some(), "{data}");
            assert!(stored.body.len() + 100 < data.len(), "{stored:?}");
            assert_eq!(stored.clone().decode(run_id, 7).unwrap(), event);
        }
    }

    #[test]
    fn anything_else_is_stored_verbatim() {
        let run_id = RunId::new();
        let simple = run_id.0.simple().to_string();
        let odd = [
            // Empty span id (no trace context), upper-case hex, a fraction AutoSi never writes,
            // another key order, an unknown type.
            (
                "text_delta",
                format!(
                    "{},\"type\":\"text_delta\",\"delta\":\"a\"}}",
                    envelope(run_id, "2026-12-03T13:58:12Z", &simple, "")
                ),
            ),
            (
                "text_delta",
                format!(
                    "{},\"type\":\"text_delta\",\"delta\":\"a\"}}",
                    envelope(run_id, "2026-12-03T13:58:12Z", &simple, "00F067AA0BA902B7")
                ),
            ),
            (
                "text_delta",
                format!(
                    "{},\"type\":\"text_delta\",\"delta\":\"a\"}}",
                    envelope(
                        run_id,
                        "2026-12-03T13:58:12.100000Z",
                        &simple,
                        "00f067aa0ba902b7"
                    )
                ),
            ),
            (
                "text_delta",
                format!(
                    "{},\"type\":\"text_delta\",\"other\":1,\"delta\":\"a\"}}",
                    envelope(run_id, "2026-12-03T13:58:12Z", &simple, "00f067aa0ba902b7")
                ),
            ),
            (
                "brand_new",
                format!(
                    "{},\"type\":\"brand_new\"}}",
                    envelope(run_id, "2026-12-03T13:58:12Z", &simple, "00f067aa0ba902b7")
                ),
            ),
        ];
        for (event_type, data) in odd {
            let event = logged(event_type, data.clone());
            let stored = StoredEvent::encode(run_id, &event);
            assert_eq!(stored.envelope, None, "{data}");
            assert_eq!(stored.body, data);
            assert_eq!(stored.decode(run_id, 7).unwrap(), event);
        }
    }
}
