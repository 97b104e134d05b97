//! The resume cursor of the projected formats: `N` or `N.j` (the SSE `id:` of a frame).
//!
//! An event of sequence `N` that projects to `k` frames sends them with the ids `N.1 … N.(k-1)`
//! and `N` for the last one. `N` means "after every frame of event `N`"; `N.j` (`1 ≤ j`) means
//! "after frame `j` of event `N`": the stream resumes with frame `j + 1`. A `j` at or past the
//! event's last frame means the same as `N`.

use std::fmt;

use axum::http::StatusCode;

use crate::api::ApiError;

/// Where a stream resumes: after event `sequence`, or after its frame `frame` (from 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    /// The event's sequence.
    pub sequence: u64,
    /// After this frame of the event (1-based); `None`: after all of its frames.
    pub frame: Option<u32>,
}

impl Cursor {
    /// After every frame of event `sequence`.
    #[must_use]
    pub fn after(sequence: u64) -> Self {
        Self {
            sequence,
            frame: None,
        }
    }

    /// Parses `N` or `N.j`: decimal digits, at most 19 after leading zeros for `N` (64 bits),
    /// and for `j` digits of a number from 1 to 2^32 − 1. With `frames: false` (behest's own
    /// format) only `N` is accepted. Errors: 400 `invalid_cursor` with `field: last_event_id`.
    pub fn parse(raw: &str, frames: bool) -> Result<Self, ApiError> {
        let invalid = || {
            let grammar = if frames {
                "an event sequence number, or `sequence.frame` (decimal digits)"
            } else {
                "an event sequence number (decimal digits)"
            };
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_cursor",
                format!("`{raw}` is not {grammar}"),
            )
            .field("last_event_id")
        };
        let (sequence, frame) = match raw.split_once('.') {
            Some((sequence, frame)) if frames => (sequence, Some(frame)),
            Some(_) => return Err(invalid()),
            None => (raw, None),
        };
        let sequence = digits(sequence, 19).ok_or_else(invalid)?;
        let frame = match frame {
            None => None,
            Some(frame) => {
                let frame = digits(frame, 10)
                    .and_then(|frame| u32::try_from(frame).ok())
                    .filter(|frame| *frame >= 1)
                    .ok_or_else(invalid)?;
                Some(frame)
            }
        };
        Ok(Self { sequence, frame })
    }

    /// The SSE id of frame `index` (0-based) of the `count` frames of event `sequence`.
    #[must_use]
    pub fn frame_id(sequence: u64, index: usize, count: usize) -> Self {
        let frame = (index + 1 < count).then(|| u32::try_from(index + 1).unwrap_or(u32::MAX));
        Self { sequence, frame }
    }

    /// How many of the `count` frames of event `sequence` this cursor has already seen: all of
    /// them for an earlier event (or `N` itself), none for a later one, `j` for `N.j`.
    #[must_use]
    pub fn seen(&self, sequence: u64, count: usize) -> usize {
        if sequence < self.sequence {
            return count;
        }
        if sequence > self.sequence {
            return 0;
        }
        match self.frame {
            None => count,
            Some(frame) => usize::try_from(frame).unwrap_or(usize::MAX).min(count),
        }
    }
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.frame {
            None => write!(f, "{}", self.sequence),
            Some(frame) => write!(f, "{}.{frame}", self.sequence),
        }
    }
}

/// Decimal digits only (no sign, space or dot), at most `max` after leading zeros.
fn digits(raw: &str, max: usize) -> Option<u64> {
    let ok = !raw.is_empty()
        && raw.bytes().all(|b| b.is_ascii_digit())
        && raw.trim_start_matches('0').len() <= max;
    ok.then(|| raw.parse::<u64>().ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_grammars_parse_and_print_back() {
        for raw in ["0", "7", "16.1", "16.2", "9223372036854775807.4294967295"] {
            let cursor = Cursor::parse(raw, true).map(|c| c.to_string());
            assert_eq!(cursor.as_deref().ok(), Some(raw));
        }
        assert_eq!(Cursor::parse("007", false).ok(), Some(Cursor::after(7)));
        for bad in [
            "",
            ".",
            "5.",
            ".5",
            "5.0",
            "5.1.2",
            "+5",
            " 5",
            "-1",
            "5.x",
            "5.4294967296",
        ] {
            assert!(Cursor::parse(bad, true).is_err(), "{bad}");
        }
        assert!(Cursor::parse("5.1", false).is_err());
    }

    #[test]
    fn frame_ids_end_with_the_plain_sequence() {
        let ids: Vec<String> = (0..3)
            .map(|i| Cursor::frame_id(9, i, 3).to_string())
            .collect();
        assert_eq!(ids, ["9.1", "9.2", "9"]);
        assert_eq!(Cursor::frame_id(4, 0, 1).to_string(), "4");
        let cut = Cursor::parse("9.2", true).ok();
        assert_eq!(
            cut.map(|c| (c.seen(8, 2), c.seen(9, 3), c.seen(10, 1))),
            Some((2, 2, 0))
        );
    }
}
