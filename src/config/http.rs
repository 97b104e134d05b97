//! `[http]`: how long a client connection may take to send a request, how long it may stay
//! idle, and how many may be open at once, so that slow or idle sockets cannot hold the
//! server (see `api::connections`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `[http]`: timeouts and the cap of client connections. Every timeout is in ms, from 1 to
/// 86400000 (one day).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Time a client has to send a request's whole head (request line and headers), from the
    /// connection's accept or from the first byte of a following request on a kept-alive
    /// connection; past it the connection is closed without an answer. Default 10000.
    pub header_read_timeout_ms: u64,
    /// Time a client has to send a request's whole body, from the end of its head; past it
    /// the request is answered `408 request_timeout` and the connection closed. Default 30000.
    pub body_read_timeout_ms: u64,
    /// Time a kept-alive connection may stay idle between a response and the next request's
    /// first byte before it is closed. Default 75000.
    pub keep_alive_timeout_ms: u64,
    /// Client connections open at once at most (event streams included). At the cap a new
    /// connection takes the place of the oldest one without a request in progress (idle, or
    /// still sending its head), which is closed; when every one has a request in progress the
    /// new one is closed as soon as it is accepted. Default: three quarters of the process's
    /// open-file soft limit (`ulimit -n`), at least 16 and at most 10000.
    pub max_connections: Option<usize>,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            keep_alive_timeout_ms: 75_000,
            max_connections: None,
        }
    }
}

/// The bounds of every `[http]` timeout, in ms.
const TIMEOUT_MS: std::ops::RangeInclusive<u64> = 1..=86_400_000;

impl HttpConfig {
    /// The problem with these settings, as a message naming the key, if any.
    pub(super) fn check(&self) -> Result<(), String> {
        for (key, value) in [
            ("header_read_timeout_ms", self.header_read_timeout_ms),
            ("body_read_timeout_ms", self.body_read_timeout_ms),
            ("keep_alive_timeout_ms", self.keep_alive_timeout_ms),
        ] {
            if !TIMEOUT_MS.contains(&value) {
                return Err(format!(
                    "http.{key} must be from 1 to 86400000 (one day), in ms"
                ));
            }
        }
        if self.max_connections == Some(0) {
            return Err("http.max_connections must be at least 1".to_owned());
        }
        Ok(())
    }

    /// [`HttpConfig::header_read_timeout_ms`] as a duration.
    #[must_use]
    pub fn header_read_timeout(&self) -> Duration {
        Duration::from_millis(self.header_read_timeout_ms)
    }

    /// [`HttpConfig::body_read_timeout_ms`] as a duration.
    #[must_use]
    pub fn body_read_timeout(&self) -> Duration {
        Duration::from_millis(self.body_read_timeout_ms)
    }

    /// [`HttpConfig::keep_alive_timeout_ms`] as a duration.
    #[must_use]
    pub fn keep_alive_timeout(&self) -> Duration {
        Duration::from_millis(self.keep_alive_timeout_ms)
    }

    /// The connection cap: `max_connections`, or by default three quarters of the open-file
    /// soft limit clamped to 16..=10000 (10000 where the limit cannot be read).
    #[must_use]
    pub fn max_connections(&self) -> usize {
        self.max_connections
            .unwrap_or_else(|| default_max_connections(open_file_limit()))
    }
}

/// Three quarters of `limit` (the open-file soft limit), clamped to 16..=10000; the quarter
/// left is for the database, provider and tool connections, and the process's own files.
fn default_max_connections(limit: Option<u64>) -> usize {
    let cap = limit.map_or(10_000, |limit| limit / 4 * 3 + limit % 4 * 3 / 4);
    usize::try_from(cap.clamp(16, 10_000)).unwrap_or(10_000)
}

/// The process's open-file soft limit (`RLIMIT_NOFILE`), when it can be read.
fn open_file_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        rlimit::getrlimit(rlimit::Resource::NOFILE)
            .ok()
            .map(|(soft, _)| soft)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_cap_is_three_quarters_of_the_limit_clamped() {
        assert_eq!(default_max_connections(Some(300)), 225);
        assert_eq!(default_max_connections(Some(1024)), 768);
        assert_eq!(default_max_connections(Some(10)), 16);
        assert_eq!(default_max_connections(Some(1 << 20)), 10_000);
        assert_eq!(default_max_connections(Some(u64::MAX)), 10_000);
        assert_eq!(default_max_connections(None), 10_000);
    }

    #[test]
    fn bad_settings_are_named() {
        let zero = HttpConfig {
            body_read_timeout_ms: 0,
            ..HttpConfig::default()
        };
        assert!(
            zero.check()
                .is_err_and(|e| e.contains("body_read_timeout_ms"))
        );
        let none = HttpConfig {
            max_connections: Some(0),
            ..HttpConfig::default()
        };
        assert!(none.check().is_err_and(|e| e.contains("max_connections")));
        assert_eq!(HttpConfig::default().check(), Ok(()));
    }

    #[test]
    fn the_section_is_read_and_checked_with_the_file() {
        use crate::config::Config;
        let http = Config::from_toml("[http]\nheader_read_timeout_ms = 500\nmax_connections = 8\n")
            .map(|config| config.http)
            .unwrap();
        assert_eq!(http.header_read_timeout_ms, 500);
        assert_eq!(http.max_connections(), 8);
        assert_eq!(http.keep_alive_timeout_ms, 75_000);
        for (toml, named) in [
            (
                "[http]\nkeep_alive_timeout_ms = 0\n",
                "http.keep_alive_timeout_ms",
            ),
            ("[http]\nheader_timeout_ms = 5\n", "header_timeout_ms"),
        ] {
            let error = Config::from_toml(toml).unwrap_err().to_string();
            assert!(error.contains(named), "{toml}: {error}");
        }
    }
}
