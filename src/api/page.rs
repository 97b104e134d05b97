//! Cursor pagination shared by the list routes: `limit` (1 to 200, default 50) and an opaque
//! `cursor` (the last id of the previous page), newest first.

use std::str::FromStr;

use axum::http::StatusCode;

use super::ApiError;

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

    /// Cuts `items` (fetched with [`Page::fetch`]) to the page; returns the next cursor when
    /// more items follow.
    pub fn finish<T>(&self, items: &mut Vec<T>, id: impl Fn(&T) -> String) -> Option<String> {
        let limit = self.limit as usize;
        if items.len() <= limit {
            return None;
        }
        items.truncate(limit);
        items.last().map(id)
    }
}
