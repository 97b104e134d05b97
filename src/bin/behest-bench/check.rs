//! The hard check: every stream the driver reads has contiguous sequences from the cursor, the
//! fake's tokens in order and once each, exactly one terminal event and nothing after it; all
//! watchers of one run see the same content. Any violation fails the command. A run resumed
//! after a crash (`run_resumed`) may abandon the model call it was streaming: the text of that
//! call (after the `model_started` that `abandoned_after` names) is dropped, and the call's
//! tokens start again from the first.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::fake::token_text;
use crate::sse::Frame;

/// The run's terminal event types.
pub const TERMINAL: [&str; 3] = ["run_completed", "run_failed", "run_cancelled"];

/// Violations found so far, and how much was checked.
#[derive(Debug, Default)]
pub struct Checks {
    violations: Mutex<Vec<String>>,
    streams: AtomicU64,
    events: AtomicU64,
}

impl Checks {
    /// Records a violation.
    pub fn fail(&self, violation: String) {
        let mut violations = self
            .violations
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Keep the report readable; the count is what fails the run.
        if violations.len() < 10_000 {
            violations.push(violation);
        }
    }

    /// Records a checked stream and its violations.
    pub fn stream(&self, label: &str, summary: &StreamSummary) {
        self.streams.fetch_add(1, Ordering::Relaxed);
        self.events.fetch_add(summary.events, Ordering::Relaxed);
        for error in &summary.errors {
            self.fail(format!("{label}: {error}"));
        }
    }

    /// Every violation so far.
    pub fn violations(&self) -> Vec<String> {
        self.violations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Streams and events checked.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.streams.load(Ordering::Relaxed),
            self.events.load(Ordering::Relaxed),
        )
    }
}

/// What a checked stream held.
#[derive(Debug, Clone, Default)]
pub struct StreamSummary {
    /// Frames read.
    pub events: u64,
    /// Last sequence read.
    pub last_sequence: u64,
    /// The terminal event's type, if one arrived.
    pub terminal: Option<String>,
    /// Text deltas read (those of an abandoned model call left out).
    pub tokens: u32,
    /// `run_resumed` events read.
    pub resumed: u32,
    /// Hash of every frame's id, type and data, in order.
    pub hash: u64,
    /// What was wrong.
    pub errors: Vec<String>,
}

/// Checks a behest event stream frame by frame, without keeping the frames.
#[derive(Debug)]
pub struct StreamCheck {
    next: u64,
    check_tokens: bool,
    hasher: DefaultHasher,
    summary: StreamSummary,
    /// The stream's cursor: it reads the events after this sequence.
    after: u64,
    /// The last `model_started`: its sequence, and the text deltas read before it.
    model_started: Option<(u64, u32)>,
}

impl StreamCheck {
    /// A stream resumed after sequence `after` (0: from the start). Token texts are checked
    /// only from the start (a resumed stream starts mid-answer).
    pub fn new(after: u64) -> Self {
        Self {
            next: after + 1,
            check_tokens: after == 0,
            hasher: DefaultHasher::new(),
            summary: StreamSummary {
                last_sequence: after,
                ..StreamSummary::default()
            },
            after,
            model_started: None,
        }
    }

    fn error(&mut self, error: String) {
        if self.summary.errors.len() < 20 {
            self.summary.errors.push(error);
        }
    }

    /// Checks the next frame.
    pub fn push(&mut self, frame: &Frame) {
        self.summary.events += 1;
        if let Some(part) = frame.part {
            self.error(format!(
                "a frame id with a part (`.{part}`) in behest's format"
            ));
        }
        match frame.id {
            None => self.error(format!("a `{}` frame without an id", frame.event)),
            Some(id) if id != self.next => {
                let what = if id < self.next {
                    "duplicated or reordered"
                } else {
                    "lost"
                };
                self.error(format!(
                    "sequence {id} where {} was due ({what} events)",
                    self.next
                ));
                self.next = id + 1;
            }
            Some(id) => self.next = id + 1,
        }
        if let Some(terminal) = &self.summary.terminal {
            let terminal = terminal.clone();
            self.error(format!(
                "`{}` after the terminal event `{terminal}`",
                frame.event
            ));
        }
        if TERMINAL.contains(&frame.event.as_str()) {
            self.summary.terminal = Some(frame.event.clone());
        }
        if frame.event == "model_started" {
            self.model_started = frame.id.map(|id| (id, self.summary.tokens));
        }
        if frame.event == "run_resumed" {
            self.resumed(frame);
        }
        if frame.event == "text_delta" {
            self.summary.tokens += 1;
            if self.check_tokens {
                let expected = format!("\"delta\":\"{}\"", token_text(self.summary.tokens));
                if !frame.data.contains(&expected) {
                    self.error(format!(
                        "text_delta {} does not carry token {} (lost, duplicated or reordered \
                         tokens): {}",
                        self.summary.tokens, self.summary.tokens, frame.data
                    ));
                }
            }
        }
        self.summary.last_sequence = frame.id.unwrap_or(self.summary.last_sequence);
        frame.id.hash(&mut self.hasher);
        frame.event.hash(&mut self.hasher);
        frame.data.hash(&mut self.hasher);
    }

    /// A `run_resumed`: the text deltas after the `model_started` its `abandoned_after` names
    /// belong to an abandoned call and no longer count.
    fn resumed(&mut self, frame: &Frame) {
        self.summary.resumed += 1;
        let abandoned_after = serde_json::from_str::<serde_json::Value>(&frame.data)
            .ok()
            .and_then(|data| data.get("abandoned_after").map(serde_json::Value::as_u64));
        match (abandoned_after, self.model_started) {
            (None, _) => self.error(format!(
                "a `run_resumed` without an `abandoned_after` field: {}",
                frame.data
            )),
            (Some(None), _) => {}
            (Some(Some(sequence)), Some((model_started, tokens))) if sequence == model_started => {
                self.summary.tokens = tokens;
            }
            // The abandoned call began before this stream's cursor: nothing of it was read.
            (Some(Some(sequence)), None) if sequence <= self.after => {}
            (Some(Some(sequence)), _) => self.error(format!(
                "`run_resumed` abandons the call after sequence {sequence}, which is not the last \
                 `model_started` ({:?})",
                self.model_started.map(|(sequence, _)| sequence)
            )),
        }
    }

    /// Ends the check: the stream must have ended with one terminal event (of type
    /// `terminal` when given) and, checked from the start, carry `tokens` text deltas.
    pub fn finish(mut self, terminal: Option<&str>, tokens: Option<u32>) -> StreamSummary {
        match (&self.summary.terminal, terminal) {
            (None, _) => self.error("the stream ended without a terminal event".to_owned()),
            (Some(got), Some(want)) if got != want => {
                let got = got.clone();
                self.error(format!(
                    "terminal event `{got}` where `{want}` was expected"
                ));
            }
            _ => {}
        }
        if let Some(tokens) = tokens
            && self.check_tokens
            && self.summary.tokens != tokens
        {
            let got = self.summary.tokens;
            self.error(format!("{got} text deltas where {tokens} were sent"));
        }
        self.summary.hash = self.hasher.finish();
        self.summary
    }
}

/// What a projected format (`?format=ai-sdk`, `ai-sdk-v7`, `ag-ui`) calls a text delta and
/// the end of a completed run.
#[derive(Debug, Clone, Copy)]
pub struct Projected {
    /// The `type` of a frame carrying one text delta (`delta`).
    pub text: &'static str,
    /// The `type` of the frame that ends a completed run.
    pub finish: &'static str,
    /// The `data:` sent after that, without an id, if any.
    pub done: Option<&'static str>,
}

impl Projected {
    /// The AI SDK UI message stream (both dialects).
    pub const AI_SDK: Self = Self {
        text: "text-delta",
        finish: "finish",
        done: Some("[DONE]"),
    };
    /// AG-UI.
    pub const AG_UI: Self = Self {
        text: "TEXT_MESSAGE_CONTENT",
        finish: "RUN_FINISHED",
        done: None,
    };
}

/// The fields of a projected frame's JSON the check reads.
#[derive(serde::Deserialize)]
struct ProjectedFrame<'a> {
    #[serde(rename = "type", borrow)]
    kind: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    delta: Option<std::borrow::Cow<'a, str>>,
}

/// Checks a stream in a projected format read from the start, frame by frame: ids `N.j` /
/// `N` in order (the frames of one event numbered `N.1 … N.(k-1)`, `N`, none skipped; events
/// in increasing sequence — an event may have no frame), the fake's tokens in order and once
/// each, the finish frame once and last (then the format's `[DONE]`).
#[derive(Debug)]
pub struct ProjectedCheck {
    format: Projected,
    /// The last frame's id: event, and part (`None`: its last frame).
    last: Option<(u64, Option<u32>)>,
    done: bool,
    hasher: DefaultHasher,
    summary: StreamSummary,
}

impl ProjectedCheck {
    /// A stream in `format`, from the run's start.
    pub fn new(format: Projected) -> Self {
        Self {
            format,
            last: None,
            done: false,
            hasher: DefaultHasher::new(),
            summary: StreamSummary::default(),
        }
    }

    fn error(&mut self, error: String) {
        if self.summary.errors.len() < 20 {
            self.summary.errors.push(error);
        }
    }

    /// Checks the next frame; true when it carried a text delta.
    pub fn push(&mut self, frame: &Frame) -> bool {
        self.summary.events += 1;
        frame.id.hash(&mut self.hasher);
        frame.part.hash(&mut self.hasher);
        frame.data.hash(&mut self.hasher);
        if self.done {
            self.error(format!("`{}` after the end", frame.data));
        }
        if self.summary.terminal.is_some() {
            if Some(frame.data.as_str()) == self.format.done && frame.id.is_none() {
                self.done = true;
            } else {
                self.error(format!("`{}` after the finish frame", frame.data));
            }
            return false;
        }
        self.order(frame);
        let parsed = match serde_json::from_str::<ProjectedFrame>(&frame.data) {
            Ok(parsed) => parsed,
            Err(error) => {
                self.error(format!(
                    "a frame that is not typed JSON ({error}): {}",
                    frame.data
                ));
                return false;
            }
        };
        if parsed.kind == self.format.finish {
            self.summary.terminal = Some(parsed.kind.into_owned());
            self.done = self.format.done.is_none();
            return false;
        }
        if parsed.kind != self.format.text {
            return false;
        }
        self.summary.tokens += 1;
        let expected = token_text(self.summary.tokens);
        if parsed.delta.as_deref() != Some(expected.as_str()) {
            let tokens = self.summary.tokens;
            self.error(format!(
                "text delta {tokens} does not carry token {tokens} (lost, duplicated or \
                 reordered tokens): {}",
                frame.data
            ));
        }
        true
    }

    /// The frame's id follows the last one.
    fn order(&mut self, frame: &Frame) {
        let Some(sequence) = frame.id else {
            self.error(format!("a frame without an id: {}", frame.data));
            return;
        };
        let id = (sequence, frame.part);
        let next = match self.last {
            // Within an event: the next part, or its last frame.
            Some((last, Some(part))) => {
                sequence == last && frame.part.is_none_or(|next| next == part + 1)
            }
            // A later event: from its first frame.
            Some((last, None)) => sequence > last && frame.part.is_none_or(|part| part == 1),
            None => sequence >= 1 && frame.part.is_none_or(|part| part == 1),
        };
        if !next {
            let show = |(sequence, part): (u64, Option<u32>)| match part {
                Some(part) => format!("{sequence}.{part}"),
                None => sequence.to_string(),
            };
            let last = self.last.map_or_else(|| "the start".to_owned(), show);
            self.error(format!(
                "id {} after {last} (lost, duplicated or reordered frames)",
                show(id)
            ));
        }
        self.summary.last_sequence = sequence;
        self.last = Some(id);
    }

    /// Ends the check: the stream must have ended with the finish frame (and the format's
    /// `[DONE]`) and carry `tokens` text deltas, when given.
    pub fn finish(mut self, tokens: Option<u32>) -> StreamSummary {
        if self.summary.terminal.is_none() || !self.done {
            self.error("the stream ended before its finish".to_owned());
        }
        if let Some(tokens) = tokens
            && self.summary.tokens != tokens
        {
            let got = self.summary.tokens;
            self.error(format!("{got} text deltas where {tokens} were sent"));
        }
        self.summary.hash = self.hasher.finish();
        self.summary
    }
}

/// Checks a stream read directly from the fake provider: tokens 1..=n in order, `[DONE]` last.
#[derive(Debug, Default)]
pub struct DirectCheck {
    tokens: u32,
    done: bool,
    usage: bool,
    errors: Vec<String>,
    frames: u64,
}

impl DirectCheck {
    /// Checks the next frame; returns true when it carried a token.
    pub fn push(&mut self, frame: &Frame) -> bool {
        self.frames += 1;
        if self.done {
            self.errors.push("data after [DONE]".to_owned());
        }
        if frame.data == "[DONE]" {
            self.done = true;
            return false;
        }
        if frame.data.contains("\"usage\":{") {
            self.usage = true;
        }
        let Some(text) = content_of(&frame.data) else {
            return false;
        };
        if text.is_empty() {
            return false;
        }
        self.tokens += 1;
        if text != token_text(self.tokens) && self.errors.len() < 20 {
            self.errors.push(format!(
                "token {} arrived as `{text}` (lost, duplicated or reordered)",
                self.tokens
            ));
        }
        true
    }

    /// Ends the check of a stream that ran to the end with `tokens` tokens.
    pub fn finish(mut self, tokens: u32) -> StreamSummary {
        if !self.done {
            self.errors
                .push("the stream ended without [DONE]".to_owned());
        }
        if !self.usage {
            self.errors.push("the stream had no usage chunk".to_owned());
        }
        if self.tokens != tokens {
            self.errors
                .push(format!("{} tokens where {tokens} were sent", self.tokens));
        }
        StreamSummary {
            events: self.frames,
            tokens: self.tokens,
            errors: self.errors,
            terminal: Some("[DONE]".to_owned()),
            ..StreamSummary::default()
        }
    }
}

/// The `delta.content` string of a chunk, without parsing the JSON (the fake's tokens need no
/// escaping).
fn content_of(data: &str) -> Option<&str> {
    let start = data.find("\"content\":\"")? + "\"content\":\"".len();
    let end = data[start..].find('"')?;
    Some(&data[start..start + end])
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::{Projected, ProjectedCheck};
    use crate::fake::token_text;
    use crate::sse::Frame;

    fn frame(id: Option<(u64, Option<u32>)>, data: &str) -> Frame {
        Frame {
            at: Instant::now(),
            id: id.map(|(sequence, _)| sequence),
            part: id.and_then(|(_, part)| part),
            event: String::new(),
            data: data.to_owned(),
        }
    }

    fn text(id: (u64, Option<u32>), k: u32) -> Frame {
        let data = format!(
            r#"{{"delta":"{}","id":"m","type":"text-delta"}}"#,
            token_text(k)
        );
        frame(Some(id), &data)
    }

    /// An AI SDK stream of two tokens: start (2 frames), two deltas, finish, `[DONE]`.
    fn stream() -> Vec<Frame> {
        vec![
            frame(Some((1, Some(1))), r#"{"type":"start"}"#),
            frame(Some((1, None)), r#"{"type":"start-step"}"#),
            text((3, None), 1),
            text((4, None), 2),
            frame(Some((6, None)), r#"{"type":"finish"}"#),
            frame(None, "[DONE]"),
        ]
    }

    fn check(frames: &[Frame]) -> Vec<String> {
        let mut check = ProjectedCheck::new(Projected::AI_SDK);
        for frame in frames {
            check.push(frame);
        }
        check.finish(Some(2)).errors
    }

    #[test]
    fn a_whole_stream_passes() {
        assert_eq!(check(&stream()), Vec::<String>::new());
    }

    #[test]
    fn lost_duplicated_and_late_frames_fail() {
        // The last frame of event 1 (a lost first frame reads as a one-frame event: the
        // comparison with the replay finds that).
        let mut lost_part = stream();
        lost_part.remove(1);
        let mut duplicated = stream();
        duplicated.insert(3, text((3, None), 1));
        let mut swapped = stream();
        swapped.swap(2, 3);
        let mut after_end = stream();
        after_end.push(text((7, None), 3));
        let mut unfinished = stream();
        unfinished.truncate(5);
        for (name, frames) in [
            ("lost part", lost_part),
            ("duplicated", duplicated),
            ("swapped", swapped),
            ("after the end", after_end),
            ("no [DONE]", unfinished),
        ] {
            assert!(!check(&frames).is_empty(), "{name}: no violation found");
        }
    }
}
