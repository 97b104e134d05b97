//! Reading Server-Sent Events frame by frame, each frame stamped with the time the bytes that
//! completed it arrived.

use std::collections::VecDeque;
use std::time::Instant;

use axum::body::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;

use crate::{BenchError, Result};

/// One SSE frame (event) as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// When the bytes completing it arrived.
    pub at: Instant,
    /// `id:` as a number, if any; of a projected format's `N.j`, the `N`.
    pub id: Option<u64>,
    /// Of a projected format's `id: N.j` (frame `j` of event `N`, not its last), the `j`.
    pub part: Option<u32>,
    /// `event:`, empty when absent.
    pub event: String,
    /// `data:` lines joined by `\n`.
    pub data: String,
}

impl Frame {
    /// Same content (id, event, data), whatever the arrival time.
    pub fn same_as(&self, other: &Frame) -> bool {
        self.id == other.id
            && self.part == other.part
            && self.event == other.event
            && self.data == other.data
    }
}

/// A frame-by-frame reader of an SSE response body.
pub struct SseReader {
    body: BoxStream<'static, reqwest::Result<Bytes>>,
    buffer: Vec<u8>,
    frames: VecDeque<Frame>,
}

impl SseReader {
    /// Reads `response`'s body.
    pub fn new(response: reqwest::Response) -> Self {
        Self {
            body: response.bytes_stream().boxed(),
            buffer: Vec::new(),
            frames: VecDeque::new(),
        }
    }

    /// The next frame; `None` when the server ended the body.
    pub async fn next(&mut self) -> Result<Option<Frame>> {
        loop {
            if let Some(frame) = self.frames.pop_front() {
                return Ok(Some(frame));
            }
            match self.body.next().await {
                None => {
                    if self.buffer.iter().any(|b| !b.is_ascii_whitespace()) {
                        return Err(BenchError("the SSE body ended inside a frame".to_owned()));
                    }
                    return Ok(None);
                }
                Some(Err(error)) => return Err(error.into()),
                Some(Ok(bytes)) => {
                    let at = Instant::now();
                    self.buffer.extend_from_slice(&bytes);
                    self.split(at)?;
                }
            }
        }
    }

    fn split(&mut self, at: Instant) -> Result<()> {
        let mut start = 0;
        while let Some(end) = find_blank_line(&self.buffer[start..]) {
            let block = &self.buffer[start..start + end];
            if let Some(frame) = parse_block(block, at)? {
                self.frames.push_back(frame);
            }
            start += end + 2;
        }
        self.buffer.drain(..start);
        Ok(())
    }
}

fn find_blank_line(bytes: &[u8]) -> Option<usize> {
    bytes.windows(2).position(|pair| pair == b"\n\n")
}

fn parse_block(block: &[u8], at: Instant) -> Result<Option<Frame>> {
    let text = std::str::from_utf8(block)
        .map_err(|_| BenchError("an SSE frame is not UTF-8".to_owned()))?;
    let mut frame = Frame {
        at,
        id: None,
        part: None,
        event: String::new(),
        data: String::new(),
    };
    let mut fields = 0;
    let mut data_lines = 0;
    for line in text.split('\n') {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.is_empty() || line.starts_with(':') {
            continue; // keep-alive comment
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        fields += 1;
        match field {
            "id" => {
                let invalid = || BenchError(format!("SSE id `{value}` is not a sequence number"));
                let (sequence, part) = match value.split_once('.') {
                    Some((sequence, part)) => {
                        (sequence, Some(part.parse().map_err(|_| invalid())?))
                    }
                    None => (value, None),
                };
                frame.id = Some(sequence.parse().map_err(|_| invalid())?);
                frame.part = part;
            }
            "event" => frame.event = value.to_owned(),
            "data" => {
                if data_lines > 0 {
                    frame.data.push('\n');
                }
                frame.data.push_str(value);
                data_lines += 1;
            }
            _ => {}
        }
    }
    Ok((fields > 0).then_some(frame))
}
