//! Cursor pagination shared by the list routes: `limit` (1 to 200, default 50), an opaque
//! `cursor` (the last id of the previous page), newest first, and a byte budget per page
//! (`runtime.max_page_bytes`): a page stops once its records' serialized size passes it.

use std::str::FromStr;

use axum::http::StatusCode;
use serde::Deserialize;
use utoipa::IntoParams;

use super::ApiError;
use crate::domain::{RunId, RunStatus, SessionId};

const DEFAULT_LIMIT: u32 = 50;
const MAX_LIMIT: u32 = 200;

/// A validated page request: how many items, and the id to continue before.
#[derive(Debug, Clone, Copy)]
pub struct Page<Id> {
    /// Items per page.
    pub limit: u32,
    /// Continue with items older than this id.
    pub before: Option<Id>,
}

impl<Id: FromStr> Page<Id> {
    /// Validates `limit` and parses `cursor`.
    ///
    /// # Errors
    /// 400 `invalid_query` for a limit out of range; 400 `invalid_cursor` for a cursor this
    /// server did not return.
    pub fn parse(limit: Option<u32>, cursor: Option<&str>) -> Result<Self, ApiError> {
        let limit = limit.unwrap_or(DEFAULT_LIMIT);
        if !(1..=MAX_LIMIT).contains(&limit) {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_query",
                format!("limit must be between 1 and {MAX_LIMIT}"),
            )
            .field("limit"));
        }
        let before = cursor
            .map(|cursor| {
                cursor.parse().map_err(|_| {
                    ApiError::new(
                        StatusCode::BAD_REQUEST,
                        "invalid_cursor",
                        "the cursor is not one this server returned",
                    )
                    .field("cursor")
                })
            })
            .transpose()?;
        Ok(Self { limit, before })
    }

    /// How many items to fetch: one more than the page, to know whether another page follows.
    #[must_use]
    pub fn fetch(&self) -> u32 {
        self.limit + 1
    }

    /// Cuts `items` (fetched with [`Page::fetch`]) to the page: at most `limit` items, and no
    /// more once their serialized size passed `max_bytes` (the item that passes it is kept, so
    /// every page makes progress). Returns the next cursor when more items follow.
    pub fn finish<T: serde::Serialize>(
        &self,
        items: &mut Vec<T>,
        max_bytes: usize,
        id: impl Fn(&T) -> String,
    ) -> Option<String> {
        let mut keep = items.len().min(self.limit as usize);
        let mut bytes = 0usize;
        for (index, item) in items.iter().enumerate().take(keep) {
            bytes += serde_json::to_vec(item).map_or(0, |json| json.len());
            if bytes > max_bytes {
                keep = index + 1;
                break;
            }
        }
        if items.len() <= keep {
            return None;
        }
        items.truncate(keep);
        items.last().map(id)
    }
}

/// Query of the lists keyed by run (`GET /runs`, `GET /snapshots`); an unknown parameter is 400
/// `invalid_query`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct RunListQuery {
    /// Only those of this session's runs.
    #[param(value_type = Option<String>, format = Uuid)]
    session_id: Option<String>,
    /// Only those in this status.
    pub status: Option<RunStatus>,
    /// Page size, 1 to 200; default 50. A page may hold fewer when its records pass the
    /// server's byte budget (`runtime.max_page_bytes`, default 1 MiB); `next_cursor` continues.
    #[param(minimum = 1, maximum = 200)]
    limit: Option<u32>,
    /// `next_cursor` of the previous page, unchanged (today the last run id of that page).
    #[param(value_type = Option<String>, format = Uuid)]
    cursor: Option<String>,
}

impl RunListQuery {
    /// The validated page and session filter.
    ///
    /// # Errors
    /// 400 as [`Page::parse`]; 400 `invalid_query` when `session_id` is not a UUID.
    pub fn parse(&self) -> Result<(Page<RunId>, Option<SessionId>), ApiError> {
        let page = Page::parse(self.limit, self.cursor.as_deref())?;
        let session_id = self
            .session_id
            .as_deref()
            .map(|raw| {
                raw.parse().map_err(|_| {
                    ApiError::new(
                        StatusCode::BAD_REQUEST,
                        "invalid_query",
                        "session_id is not a UUID",
                    )
                    .field("session_id")
                })
            })
            .transpose()?;
        Ok((page, session_id))
    }
}
