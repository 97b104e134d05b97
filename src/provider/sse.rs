//! The Server-Sent Events machinery shared by the streaming adapters: a response body (reads
//! of any size) split into SSE events by `eventsource_stream`, handed one by one to the wire
//! format's [`StreamParser`], and the [`ModelEvent`]s it produces yielded in order until the
//! stream ends or fails.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};

use eventsource_stream::{EventStream, EventStreamError, Eventsource};
use futures::{Stream, StreamExt};

use super::http::ReadError;
use super::{ErrorClass, ModelEvent, ModelStream, ProviderError};
use crate::domain::FinishReason;

/// The items a parser produced and the driver has not yielded yet, oldest first.
pub(super) type Out = VecDeque<Result<ModelEvent, ProviderError>>;

/// Whether the stream goes on after an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// Read the next event.
    Continue,
    /// The stream is over (its end or an error was pushed).
    End,
}

/// The state of one call's stream in one wire format.
pub(super) trait StreamParser {
    /// The provider id, for errors.
    fn provider(&self) -> &str;

    /// Handles one SSE event (`event` is its type, `message` by default; `data` its joined
    /// `data:` lines), pushing what it yields to `out`.
    fn on_event(&mut self, event: &str, data: &str, out: &mut Out) -> Step;

    /// The body ended cleanly (not cut) without the wire format's closing event, after at
    /// least one event: pushes the normal end or the error that this means.
    fn end_of_body(&mut self, out: &mut Out);

    /// The normal end: open tool calls closed, then `Usage` when reported, then `Finished`.
    fn finish_events(&mut self, out: &mut Out);
}

/// Runs `parser` over an event-stream body. A read error ends the stream with its class
/// (`server` for malformed UTF-8 or SSE); a body that ends cleanly without any event (empty,
/// or not an event stream at all) ends it with `server`, quoting its first bytes; any other
/// clean end is the parser's [`StreamParser::end_of_body`].
pub(super) fn parse<S, B, E, P>(bytes: S, parser: P) -> ModelStream
where
    S: Stream<Item = Result<B, E>> + Send + 'static,
    B: AsRef<[u8]> + Send + 'static,
    E: Into<ReadError> + Send + 'static,
    P: StreamParser + Send + 'static,
{
    let head = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&head);
    let bytes = bytes.inspect(move |read| {
        if let Ok(read) = read {
            let mut head = seen.lock().unwrap_or_else(PoisonError::into_inner);
            let room = HEAD_BYTES.saturating_sub(head.len());
            let read = read.as_ref();
            head.extend_from_slice(read.get(..room.min(read.len())).unwrap_or_default());
        }
    });
    let driver = Driver {
        events: Box::pin(bytes.eventsource()),
        parser,
        out: VecDeque::new(),
        ended: false,
        any_event: false,
        head,
    };
    futures::stream::unfold(driver, |mut driver| async move {
        loop {
            if let Some(item) = driver.out.pop_front() {
                return Some((item, driver));
            }
            if driver.ended {
                return None;
            }
            match driver.events.next().await {
                None => {
                    driver.ended = true;
                    if driver.any_event {
                        driver.parser.end_of_body(&mut driver.out);
                    } else {
                        let head = driver.head.lock().unwrap_or_else(PoisonError::into_inner);
                        let message = if head.iter().all(u8::is_ascii_whitespace) {
                            EMPTY_STREAM.to_owned()
                        } else {
                            format!(
                                "the answer is not an event stream: {}",
                                super::http::body_summary(&head)
                            )
                        };
                        drop(head);
                        let error = ProviderError::new(
                            driver.parser.provider(),
                            ErrorClass::Server,
                            message,
                        );
                        driver.out.push_back(Err(error));
                    }
                }
                Some(Err(error)) => {
                    driver.ended = true;
                    let error = read_error(driver.parser.provider(), error);
                    driver.out.push_back(Err(error));
                }
                Some(Ok(event)) => {
                    driver.any_event = true;
                    let step = driver
                        .parser
                        .on_event(&event.event, &event.data, &mut driver.out);
                    driver.ended = step == Step::End;
                }
            }
        }
    })
    .boxed()
}

struct Driver<S, P> {
    events: Pin<Box<EventStream<S>>>,
    parser: P,
    out: Out,
    ended: bool,
    /// Whether the body held at least one event.
    any_event: bool,
    /// The body's first [`HEAD_BYTES`] bytes, quoted when it holds no event.
    head: Arc<Mutex<Vec<u8>>>,
}

/// The message of the `server` error for a 2xx event stream that ended without any event and
/// without any byte but whitespace.
const EMPTY_STREAM: &str = "the answer is an empty event stream";

/// Whether `error` is [`parse`]'s error for an empty event stream.
pub(super) fn is_empty_stream(error: &ProviderError) -> bool {
    error.class == ErrorClass::Server && error.status.is_none() && error.message == EMPTY_STREAM
}

/// Bytes of the body kept for an error message when it holds no event.
const HEAD_BYTES: usize = 1024;

fn read_error<E: Into<ReadError>>(provider: &str, error: EventStreamError<E>) -> ProviderError {
    match error {
        EventStreamError::Transport(error) => {
            let error = error.into();
            ProviderError::new(provider, error.class, error.message)
        }
        EventStreamError::Utf8(error) => ProviderError::new(
            provider,
            ErrorClass::Server,
            format!("malformed stream: {error}"),
        ),
        EventStreamError::Parser(error) => ProviderError::new(
            provider,
            ErrorClass::Server,
            format!("malformed stream: {error}"),
        ),
    }
}

/// The `Finished` reason of a stream that reported `reported` and completed `completed` tool
/// calls: `tool_calls` when calls completed and the model said `stop` or nothing (some servers
/// do), `unknown` when it said nothing and made no call (a server that interrupted the
/// generation ends the stream so), else what it said.
pub(super) fn final_reason(reported: Option<FinishReason>, completed: usize) -> FinishReason {
    match reported {
        Some(FinishReason::Stop) | None if completed > 0 => FinishReason::ToolCalls,
        Some(reason) => reason,
        None => FinishReason::Unknown,
    }
}
