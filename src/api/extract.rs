//! Extractors whose rejections are problem+json ([`ApiError`]).

use axum::extract::{FromRequest, FromRequestParts, Request};
use serde::de::DeserializeOwned;

use super::ApiError;

/// A JSON object body with problem+json rejections: `Content-Type: application/json`, valid
/// JSON (else 400 `malformed_json`), an object (else 422 `invalid_body`: serde would read an
/// array as a struct's fields in order), then `T` (else 422 `invalid_body` naming the field).
#[derive(Debug)]
pub struct Json<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Json<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        let axum::Json(value) =
            axum::Json::<serde_json::Value>::from_request(request, state).await?;
        if !value.is_object() {
            return Err(ApiError::body_mismatch("invalid type: not an object"));
        }
        serde_path_to_error::deserialize(value)
            .map(Json)
            .map_err(|error| ApiError::body_mismatch(&error.to_string()))
    }
}

/// `axum::extract::Query` with problem+json rejections.
#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct Query<T>(pub T);
