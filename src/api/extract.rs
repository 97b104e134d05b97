//! Extractors whose rejections are problem+json ([`ApiError`]).

use axum::extract::FromRequest;
use axum::extract::FromRequestParts;

use super::ApiError;

/// `axum::Json` with problem+json rejections.
#[derive(Debug, FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
pub struct Json<T>(pub T);

/// `axum::extract::Query` with problem+json rejections.
#[derive(Debug, FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct Query<T>(pub T);
