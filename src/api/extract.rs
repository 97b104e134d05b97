//! Extractors whose rejections are problem+json ([`ApiError`]).

use axum::extract::{FromRequest, FromRequestParts, Request};
use serde::de::DeserializeOwned;

use super::ApiError;

/// A JSON object body with problem+json rejections: `Content-Type: application/json`, valid
/// JSON (else 400 `malformed_json`), an object (else 422 `invalid_body`: serde would read an
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

impl<S: Send + Sync, T: DeserializeOwned + Body> FromRequest<S> for Json<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let axum::Json(value) =
            axum::Json::<serde_json::Value>::from_request(request, state).await?;
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
