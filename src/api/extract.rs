//! Extractors whose rejections are problem+json ([`ApiError`]).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::{HeaderMap, StatusCode, header};
use serde::de::DeserializeOwned;

use super::ApiError;

/// A JSON object body with problem+json rejections: `Content-Type: application/json` (or
/// `application/*+json`; else 415 `unsupported_media_type`), valid JSON with no object key
/// given twice anywhere (else 400 `malformed_json`: a gateway that reads the first of two keys
/// and a server that reads the last would see two requests), an object (else 422 `invalid_body`: serde would read an
/// array as a struct's fields in order), then `T` (else 422 `invalid_body` naming the field).
#[derive(Debug)]
pub struct Json<T>(pub T);

/// A JSON request body: the fields it accepts and what each must be, in words, for the 422s
/// that replace serde's messages.
pub trait Body {
    /// The body's top-level fields, in order.
    const FIELDS: &'static [&'static str];
    /// What a top-level field must be (e.g. "must be a string").
    fn expectation(field: &str) -> Option<&'static str>;
}

/// Any JSON (the raw value before a body type is applied): no named fields.
impl Body for serde_json::Value {
    const FIELDS: &'static [&'static str] = &[];
    fn expectation(_: &str) -> Option<&'static str> {
        None
    }
}

impl Body for crate::domain::CreateRunRequest {
    const FIELDS: &'static [&'static str] = &Self::FIELDS;
    fn expectation(field: &str) -> Option<&'static str> {
        Self::expectation(field)
    }
}

/// The server's body limit in bytes (`[runtime] max_body_bytes`), put in each request's
/// extensions by the router, so that a body over it is refused naming the limit.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);

impl<S: Send + Sync, T: DeserializeOwned + Body> FromRequest<S> for Json<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        if !json_content_type(request.headers()) {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "send the body as `Content-Type: application/json`",
            ));
        }
        let limit = request.extensions().get::<BodyLimit>().copied();
        let history = matches!(request.uri().path(), "/chat" | "/ag-ui");
        let bytes = Bytes::from_request(request, state)
            .await
            .map_err(|rejection| body_rejection(&rejection, limit, history))?;
        let value = strict::from_slice(&bytes).map_err(|error| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "malformed_json",
                format!("the body is not valid JSON: {error}"),
            )
        })?;
        if !value.is_object() {
            return Err(ApiError::body_mismatch::<T>("invalid type: not an object"));
        }
        serde_path_to_error::deserialize(value)
            .map(Json)
            .map_err(|error| ApiError::body_mismatch::<T>(&error.to_string()))
    }
}

/// `axum::extract::Query` with problem+json rejections.
#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct Query<T>(pub T);

/// No body: a `POST` that takes none (cancel, compact, reset) refuses one that is not empty
/// with 400 `unexpected_body`, rather than ignore what the client meant to send.
#[derive(Debug)]
pub struct NoBody;

impl<S: Send + Sync> FromRequest<S> for NoBody {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let limit = request.extensions().get::<BodyLimit>().copied();
        let history = matches!(request.uri().path(), "/chat" | "/ag-ui");
        let bytes = Bytes::from_request(request, state)
            .await
            .map_err(|rejection| body_rejection(&rejection, limit, history))?;
        if bytes.is_empty() {
            return Ok(Self);
        }
        Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "unexpected_body",
            "this route takes no request body; send the request without one",
        ))
    }
}

/// Whether the request says its body is JSON: `application/json` or `application/<x>+json`,
/// parameters (`; charset=utf-8`) aside, as axum's `Json` accepts.
fn json_content_type(headers: &HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
    else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or_default().trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    kind.eq_ignore_ascii_case("application")
        && (subtype.eq_ignore_ascii_case("json") || subtype.to_ascii_lowercase().ends_with("+json"))
}

/// A body that could not be read: too large (413 `payload_too_large`, naming the `limit`, and
/// for `/chat` and `/ag-ui`, whose clients send a whole `history`, how to send less) or cut
/// off.
fn body_rejection(rejection: &BytesRejection, limit: Option<BodyLimit>, history: bool) -> ApiError {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        let mut detail = String::from("the body is larger than the server accepts");
        if let Some(BodyLimit(bytes)) = limit {
            detail.push_str(&format!(
                ": at most {bytes} bytes (`[runtime] max_body_bytes`)"
            ));
        }
        if history {
            detail.push_str(
                "; the client sends the whole history, and behest reads only the last message \
                 (it keeps the rest): send only that (README, \"Long chats\")",
            );
        }
        return ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", detail);
    }
    ApiError::new(
        rejection.status(),
        "invalid_body",
        "the request body could not be read",
    )
}

/// JSON parsing that refuses an object key given twice, at any depth (`serde_json` keeps the
/// last one silently).
mod strict {
    use std::fmt;

    use serde::de::{DeserializeSeed, Deserializer, Error, MapAccess, SeqAccess, Visitor};
    use serde_json::{Map, Value};

    /// Parses `bytes` as one JSON value (trailing whitespace only).
    ///
    /// # Errors
    /// `serde_json`'s error (with line and column): a syntax error, nesting past its limit,
    /// or "duplicate key `k`".
    pub(super) fn from_slice(bytes: &[u8]) -> Result<Value, serde_json::Error> {
        let mut deserializer = serde_json::Deserializer::from_slice(bytes);
        let value = Strict.deserialize(&mut deserializer)?;
        deserializer.end()?;
        Ok(value)
    }

    /// A JSON value, each object's keys checked for repeats.
    struct Strict;

    impl<'de> DeserializeSeed<'de> for Strict {
        type Value = Value;
        fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
            deserializer.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for Strict {
        type Value = Value;

        fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
            formatter.write_str("a JSON value")
        }
        fn visit_bool<E: Error>(self, value: bool) -> Result<Value, E> {
            Ok(Value::Bool(value))
        }
        fn visit_i64<E: Error>(self, value: i64) -> Result<Value, E> {
            Ok(Value::from(value))
        }
        fn visit_u64<E: Error>(self, value: u64) -> Result<Value, E> {
            Ok(Value::from(value))
        }
        fn visit_f64<E: Error>(self, value: f64) -> Result<Value, E> {
            Ok(serde_json::Number::from_f64(value).map_or(Value::Null, Value::Number))
        }
        fn visit_str<E: Error>(self, value: &str) -> Result<Value, E> {
            Ok(Value::String(value.to_owned()))
        }
        fn visit_string<E: Error>(self, value: String) -> Result<Value, E> {
            Ok(Value::String(value))
        }
        fn visit_unit<E: Error>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_none<E: Error>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
            deserializer.deserialize_any(self)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
            let mut items = Vec::new();
            while let Some(item) = seq.next_element_seed(Strict)? {
                items.push(item);
            }
            Ok(Value::Array(items))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
            let mut object = Map::new();
            while let Some(key) = map.next_key::<String>()? {
                if object.contains_key(&key) {
                    return Err(A::Error::custom(format_args!(
                        "the key `{key}` is given twice in one object"
                    )));
                }
                let value = map.next_value_seed(Strict)?;
                object.insert(key, value);
            }
            Ok(Value::Object(object))
        }
    }

    #[cfg(test)]
    mod tests {
        use serde_json::json;

        #[test]
        fn repeated_keys_are_refused_at_any_depth() {
            let same =
                super::from_slice(br#"{"a": [1, -2, 3.5, null, true, "x"], "b": {"c": {}}}"#)
                    .unwrap();
            assert_eq!(
                same,
                json!({"a": [1, -2, 3.5, null, true, "x"], "b": {"c": {}}})
            );
            for bad in [
                r#"{"a": 1, "a": 2}"#,
                r#"{"a": {"b": 1, "c": 2, "b": 1}}"#,
                r#"[{"x": [{"k": 1, "k": 1}]}]"#,
            ] {
                let error = super::from_slice(bad.as_bytes()).unwrap_err().to_string();
                assert!(error.contains("given twice"), "{bad}: {error}");
            }
            assert!(super::from_slice(b"{} {}").is_err());
        }
    }
}

/// Path parameters with a problem+json rejection: 400 `invalid_path` (e.g. a segment that is
/// not UTF-8 once percent-decoded, `/runs/%ff`), instead of axum's plain-text answer.
#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
pub struct Path<T>(pub T);
