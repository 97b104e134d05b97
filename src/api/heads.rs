//! Request heads the HTTP parser would refuse, answered with problem+json instead of hyper's
//! bare, empty status. hyper parses a request's head before any of our code sees the request
//! and answers a head it refuses (a control character in a header value, a malformed header
//! name or line, too many headers, a target `http::Uri` refuses) with an empty `400`/`431`
//! and closes the connection. hyper 1.x offers no hook for that answer, and its one option
//! about bad header lines (`ignore_invalid_headers`) drops them silently, which would turn a
//! bad `Idempotency-Key` into no key at all. So the accept loop's socket wrapper
//! (`connections.rs`) shows each head's bytes to a [`HeadCheck`] before hyper reads them: it
//! parses them with the same parser hyper uses (`httparse`, same defaults), and when the
//! head is one hyper would refuse, the bytes are withheld from hyper, the client gets the
//! problem+json answer here, and the connection closes (as hyper would close it).
//!
//! Bounded and conservative: a head is looked at only where the socket's state says one
//! begins (a new connection, or the first bytes after a connection went idle), only up to
//! [`MAX_CHECKED_HEAD`] bytes, and after an idle time only a head whose request line is
//! well-formed is refused here (bytes after an idle time may be the rest of a body hyper
//! drains). Whatever is not checked here is still refused by hyper, with its bare status.

use axum::extract::Request;
use axum::http::{HeaderName, Method, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;

use super::ApiError;

/// The most head bytes a [`HeadCheck`] keeps while a head arrives in parts; a longer head is
/// left to hyper (whose own limit is about 400 KiB, answered `431`).
pub const MAX_CHECKED_HEAD: usize = 64 * 1024;

/// The most header lines hyper reads in a head (its default): more is `431`.
const MAX_HEADERS: usize = 100;

/// Where a connection's next bytes stand, for the check of a request head.
#[derive(Debug)]
enum Scan {
    /// A head begins with the next bytes: the first of the connection (`strict`: the request
    /// line is checked too) or the first after an idle time.
    Start { strict: bool },
    /// A head arrived in part: its bytes so far.
    Partial { strict: bool, head: Vec<u8> },
    /// Not at a head (a body, a head already checked, or one beyond the bound).
    Off,
}

/// The check of a connection's request heads (see the module's documentation).
#[derive(Debug)]
pub struct HeadCheck {
    scan: Scan,
}

impl Default for HeadCheck {
    /// A new connection: its first bytes are a request head.
    fn default() -> Self {
        Self {
            scan: Scan::Start { strict: true },
        }
    }
}

impl HeadCheck {
    /// A connection that was idle receives bytes: they begin a head.
    pub fn restart(&mut self) {
        self.scan = Scan::Start { strict: false };
    }

    /// The bytes that follow are no head (a request is being answered).
    pub fn stop(&mut self) {
        self.scan = Scan::Off;
    }

    /// Looks at bytes just read. `Some` is the whole HTTP/1.1 response (problem+json,
    /// `Connection: close`) to send instead of letting hyper read the head.
    pub fn check(&mut self, bytes: &[u8]) -> Option<Bytes> {
        let (strict, verdict) = match &mut self.scan {
            Scan::Off => return None,
            Scan::Start { strict } => (*strict, judge(bytes, *strict)),
            Scan::Partial { strict, head } => {
                if head.len() + bytes.len() > MAX_CHECKED_HEAD {
                    self.scan = Scan::Off;
                    return None;
                }
                head.extend_from_slice(bytes);
                (*strict, judge(head, *strict))
            }
        };
        match verdict {
            Verdict::Partial => {
                if let Scan::Start { .. } = self.scan {
                    if bytes.len() > MAX_CHECKED_HEAD {
                        self.scan = Scan::Off;
                    } else {
                        self.scan = Scan::Partial {
                            strict,
                            head: bytes.to_vec(),
                        };
                    }
                }
                None
            }
            Verdict::Fine => {
                self.scan = Scan::Off;
                None
            }
            Verdict::Refuse(error) => {
                self.scan = Scan::Off;
                Some(response(&error))
            }
        }
    }
}

/// What a head's bytes so far say.
#[derive(Debug)]
enum Verdict {
    /// Not whole yet, nothing wrong so far.
    Partial,
    /// Whole, or wrong in a way left to hyper.
    Fine,
    /// Wrong: the answer.
    Refuse(ApiError),
}

/// Parses a head as hyper does (httparse with its defaults, then the checks hyper makes of a
/// complete head: method, target, `Content-Length`).
fn judge(bytes: &[u8], strict: bool) -> Verdict {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(bytes) {
        Ok(httparse::Status::Partial) => Verdict::Partial,
        Ok(httparse::Status::Complete(_)) => complete(&request),
        Err(error) => {
            // A request line is whole once its version is read: the error is in a header.
            let in_headers = request.version.is_some();
            if !strict && !in_headers {
                return Verdict::Fine;
            }
            Verdict::Refuse(refusal(error, bytes, in_headers))
        }
    }
}

/// The checks hyper makes of a head httparse read whole.
fn complete(request: &httparse::Request<'_, '_>) -> Verdict {
    if let Some(method) = request.method
        && Method::from_bytes(method.as_bytes()).is_err()
    {
        return Verdict::Refuse(malformed("the request method is not a token"));
    }
    if let Some(path) = request.path
        && Uri::try_from(path).is_err()
    {
        return Verdict::Refuse(malformed(
            "the request target is not a valid URI (RFC 9112 §3.2)",
        ));
    }
    let mut length: Option<u64> = None;
    for header in request.headers.iter() {
        if HeaderName::from_bytes(header.name.as_bytes()).is_err() {
            return Verdict::Refuse(invalid_header(header.name, "is not a valid header name"));
        }
        if header.name.eq_ignore_ascii_case("content-length") {
            match content_length(header.value) {
                Some(value) if length.is_none_or(|before| before == value) => {
                    length = Some(value);
                }
                Some(_) => {
                    return Verdict::Refuse(invalid_header(
                        "Content-Length",
                        "is given twice with different values",
                    ));
                }
                None => {
                    return Verdict::Refuse(invalid_header(
                        "Content-Length",
                        "is not a number of bytes",
                    ));
                }
            }
        }
    }
    Verdict::Fine
}

/// A `Content-Length` value as hyper reads it: decimal digits, or a list of equal ones.
fn content_length(value: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(value).ok()?;
    let mut length = None;
    for part in text.split(',') {
        let part = part.trim_matches([' ', '\t']);
        if part.is_empty() || !part.bytes().all(|byte| byte.is_ascii_digit()) {
            return None;
        }
        let value: u64 = part.parse().ok()?;
        if length.is_some_and(|before| before != value) {
            return None;
        }
        length = Some(value);
    }
    length
}

/// The answer to a head httparse refused.
fn refusal(error: httparse::Error, bytes: &[u8], in_headers: bool) -> ApiError {
    match error {
        httparse::Error::TooManyHeaders => ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "too_many_headers",
            format!("the request has more than {MAX_HEADERS} header lines"),
        ),
        httparse::Error::HeaderName | httparse::Error::HeaderValue | httparse::Error::NewLine
            if in_headers =>
        {
            match bad_header_line(bytes) {
                Some((name, what)) => invalid_header(&name, &what),
                None => ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_header",
                    "a header line is malformed: each is `Name: value` with visible ASCII \
                     characters, spaces and tabs, ending with CRLF",
                ),
            }
        }
        httparse::Error::Version => {
            malformed("the request line does not end with HTTP/1.0 or HTTP/1.1")
        }
        _ => malformed(
            "the request line is malformed: it is `METHOD target HTTP/1.1` with a token, a \
             target without spaces or control characters, and CRLF",
        ),
    }
}

/// `400 malformed_request`.
fn malformed(detail: &str) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "malformed_request", detail)
}

/// `400 invalid_header` naming the header (`field`).
fn invalid_header(name: &str, what: &str) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_header",
        format!("the header `{name}` {what}"),
    )
    .field(name)
}

/// The first header line that breaks RFC 9110's grammar, for the answer: its name (lossy) and
/// what is wrong with it.
fn bad_header_line(head: &[u8]) -> Option<(String, String)> {
    let mut lines = head
        .split(|byte| *byte == b'\n')
        .skip_while(|line| line.is_empty() || *line == b"\r");
    lines.next()?; // the request line
    for line in lines {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            return None;
        }
        let Some(colon) = line.iter().position(|byte| *byte == b':') else {
            return Some((
                String::from_utf8_lossy(line).chars().take(40).collect(),
                "line has no colon".to_owned(),
            ));
        };
        let (name, value) = (&line[..colon], &line[colon + 1..]);
        let name_text: String = String::from_utf8_lossy(name).chars().take(40).collect();
        if name.is_empty() || HeaderName::from_bytes(name).is_err() {
            return Some((name_text, "is not a valid header name".to_owned()));
        }
        if let Some(byte) = value
            .iter()
            .find(|byte| (**byte < 0x20 && **byte != b'\t') || **byte == 0x7f)
        {
            return Some((
                name_text,
                format!(
                    "contains the control character 0x{byte:02x}: header values are visible \
                     characters, spaces and tabs"
                ),
            ));
        }
    }
    None
}

/// The whole HTTP/1.1 response of a refusal: problem+json, `Connection: close`.
fn response(error: &ApiError) -> Bytes {
    let problem = error.problem();
    let body = serde_json::to_vec(problem).unwrap_or_default();
    let status = StatusCode::from_u16(problem.status).unwrap_or(StatusCode::BAD_REQUEST);
    let mut bytes = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/problem+json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or("Bad Request"),
        body.len()
    )
    .into_bytes();
    bytes.extend_from_slice(&body);
    Bytes::from(bytes)
}

/// The headers a request may give once: with two, a gateway that reads the first and a server
/// that reads the last would see two requests (RFC 9110 §7.2 for `Host`; `Content-Type` is a
/// singleton field, §8.3).
const SINGLE_HEADERS: [(HeaderName, &str); 5] = [
    (header::AUTHORIZATION, "Authorization"),
    (header::HOST, "Host"),
    (header::CONTENT_TYPE, "Content-Type"),
    (
        HeaderName::from_static("idempotency-key"),
        "Idempotency-Key",
    ),
    (HeaderName::from_static("last-event-id"), "Last-Event-ID"),
];

/// Middleware of every request: `Authorization`, `Host`, `Content-Type`, `Idempotency-Key` or
/// `Last-Event-ID` given
/// more than once (two lines, whatever their values) is `400 duplicate_header` naming the
/// header (`field`), before authentication and routing.
pub async fn refuse_repeated_headers(request: Request, next: Next) -> Response {
    let headers = request.headers();
    for (name, spelled) in &SINGLE_HEADERS {
        if headers.get_all(name).iter().nth(1).is_some() {
            return ApiError::new(
                StatusCode::BAD_REQUEST,
                "duplicate_header",
                format!("the header `{spelled}` is given more than once; give it once"),
            )
            .field(spelled)
            .into_response();
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(head: &[u8]) -> Option<String> {
        HeadCheck::default()
            .check(head)
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
    }

    #[test]
    fn control_character_in_a_header_value_is_invalid_header() {
        let answer = answer(b"POST /runs HTTP/1.1\r\nHost: x\r\nIdempotency-Key: a\x01b\r\n\r\n")
            .expect("refused");
        assert!(
            answer.starts_with("HTTP/1.1 400 Bad Request\r\n"),
            "{answer}"
        );
        assert!(answer.contains("application/problem+json"), "{answer}");
        assert!(answer.contains(r#""code":"invalid_header""#), "{answer}");
        assert!(answer.contains(r#""field":"Idempotency-Key""#), "{answer}");
        assert!(answer.contains("0x01"), "{answer}");
    }

    #[test]
    fn a_good_head_passes_and_later_bytes_are_not_looked_at() {
        let mut check = HeadCheck::default();
        assert!(
            check
                .check(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n\x01\x02 body")
                .is_none()
        );
        assert!(check.check(b"\x01\x02\x03").is_none());
    }

    #[test]
    fn a_head_in_parts_is_checked_whole() {
        let mut check = HeadCheck::default();
        assert!(check.check(b"GET / HTTP/1.1\r\nLast-Event-ID: 1").is_none());
        let answer = check.check(b"\x7f\r\n\r\n").expect("refused");
        assert!(String::from_utf8_lossy(&answer).contains("Last-Event-ID"));
    }

    #[test]
    fn after_an_idle_time_only_header_errors_are_refused() {
        let mut check = HeadCheck::default();
        check.restart();
        assert!(
            check
                .check(b"\x00\x01 drained body bytes\r\n\r\n")
                .is_none()
        );
        check.restart();
        assert!(check.check(b"GET / HTTP/1.1\r\nX: \x01\r\n\r\n").is_some());
        assert!(answer(b"\x00\x01 not a request\r\n\r\n").is_some());
    }

    #[test]
    fn complete_heads_get_hypers_other_checks() {
        let twice = answer(b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n")
            .expect("refused");
        assert!(twice.contains("Content-Length"), "{twice}");
        assert!(answer(b"POST / HTTP/1.1\r\nContent-Length: 3, 3\r\n\r\n").is_none());
        let many: String = (0..=MAX_HEADERS).map(|i| format!("X-{i}: v\r\n")).collect();
        let head = format!("GET / HTTP/1.1\r\n{many}\r\n");
        let too_many = answer(head.as_bytes()).expect("refused");
        assert!(too_many.starts_with("HTTP/1.1 431 "), "{too_many}");
    }
}
