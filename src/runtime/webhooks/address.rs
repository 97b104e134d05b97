//! Which addresses a webhook may reach: a host in `[webhooks] allowed_hosts` (when that list is
//! set) whose addresses are all public, unless `allow_private_addresses`. The same check runs
//! at a run's create and inside the delivery client's DNS resolver, so the connection goes only
//! to addresses that passed it (a DNS answer that changes in between cannot reach a private
//! address).

use std::net::{IpAddr, SocketAddr};

/// Whether `ip` is no public address: loopback, private (RFC 1918), link-local, carrier-grade
/// NAT (100.64/10), unspecified, broadcast, multicast, `0.0.0.0/8`, IPv6 unique-local
/// (fc00::/7) or link-local (fe80::/10), or an IPv4-mapped one of those.
#[must_use]
pub fn is_private(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || a == 0
                || (a == 100 && (b & 0xc0) == 64)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_private(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
        }
    }
}

/// The addresses `host` resolves to (port 0), refused with a message when any is private and
/// `allow_private` is false, or when there are none.
///
/// # Errors
/// The lookup's failure, or which address is not allowed.
pub async fn resolve(host: &str, allow_private: bool) -> Result<Vec<SocketAddr>, String> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let addresses: Vec<SocketAddr> = tokio::net::lookup_host((host, 0))
        .await
        .map_err(|error| format!("`{host}` does not resolve: {error}"))?
        .collect();
    if addresses.is_empty() {
        return Err(format!("`{host}` resolves to no address"));
    }
    if !allow_private && let Some(address) = addresses.iter().find(|a| is_private(a.ip())) {
        return Err(format!(
            "`{host}` resolves to {}, a loopback, private or link-local address (the server's \
             [webhooks] allow_private_addresses is off)",
            address.ip()
        ));
    }
    Ok(addresses)
}

/// The delivery client's DNS resolver: [`resolve`], so a connection only goes to addresses
/// that passed the check.
#[derive(Debug, Clone, Copy)]
pub(super) struct CheckedResolver {
    pub(super) allow_private: bool,
}

impl reqwest::dns::Resolve for CheckedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let allow_private = self.allow_private;
        Box::pin(async move {
            let addresses = resolve(name.as_str(), allow_private).await.map_err(
                |message| -> Box<dyn std::error::Error + Send + Sync> {
                    Box::new(std::io::Error::other(message))
                },
            )?;
            Ok(Box::new(addresses.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::is_private;

    #[test]
    fn private_and_public_addresses() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "::",
            "fc00::1",
            "fd12::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
        ] {
            assert!(is_private(private.parse().unwrap()), "{private}");
        }
        for public in ["1.1.1.1", "93.184.216.34", "100.128.0.1", "2606:4700::1111"] {
            assert!(!is_private(public.parse().unwrap()), "{public}");
        }
    }
}
