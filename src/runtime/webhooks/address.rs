//! Which addresses a webhook may reach: a host in `[webhooks] allowed_hosts` (when that list is
//! set) whose addresses are all public, unless `allow_private_addresses`. The same check runs
//! at a run's create and inside the delivery client's DNS resolver, so the connection goes only
//! to addresses that passed it (a DNS answer that changes in between cannot reach a private
//! address).

use std::net::{IpAddr, SocketAddr};

/// Whether `ip` is no public address: any block of IANA's special-purpose registries
/// (<https://www.iana.org/assignments/iana-ipv4-special-registry>,
/// <https://www.iana.org/assignments/iana-ipv6-special-registry>) that is not globally
/// reachable — loopback, private (RFC 1918), link-local, carrier-grade NAT (100.64/10), IETF
/// protocol assignments (192.0.0/24), documentation (192.0.2/24, 198.51.100/24, 203.0.113/24,
/// 2001:db8::/32, 3fff::/20), benchmarking (198.18/15, 2001:2::/48), SRv6 SIDs (5f00::/16),
/// the 6to4 relay anycast
/// (192.88.99/24), reserved (240/4), broadcast, `0.0.0.0/8`, multicast, IPv6 unique-local
/// (fc00::/7), link-local (fe80::/10), site-local (fec0::/10), discard (100::/64), the IETF
/// protocol block 2001::/23 (Teredo among them), NAT64's local-use 64:ff9b:1::/48 — and an IPv6
/// address that carries an IPv4 one (IPv4-mapped `::ffff:0:0/96`, IPv4-translated
/// `::ffff:0:0:0/96`, IPv4-compatible `::/96`, NAT64 `64:ff9b::/96`, 6to4 `2002::/16`) when that
/// IPv4 address is not public.
#[must_use]
pub fn is_private(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, c, _] = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || a == 0
                || a >= 240
                || (a == 100 && (b & 0xc0) == 64)
                || (a, b, c) == (192, 0, 0)
                || (a, b, c) == (192, 0, 2)
                || (a, b, c) == (192, 88, 99)
                || (a == 198 && (b & 0xfe) == 18)
                || (a, b, c) == (198, 51, 100)
                || (a, b, c) == (203, 0, 113)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = embedded_v4(v6) {
                return is_private(IpAddr::V4(v4));
            }
            let s = v6.segments();
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || (s[0] & 0xffc0) == 0xfec0
                || s[..4] == [0x100, 0, 0, 0]
                || (s[0] == 0x2001 && s[1] < 0x200)
                || s[..2] == [0x2001, 0xdb8]
                || (s[0] & 0xfff0) == 0x3ff0
                || s[0] == 0x5f00
                || s[..3] == [0x64, 0xff9b, 1]
        }
    }
}

/// The IPv4 address an IPv6 address carries, by its prefix: IPv4-mapped (`::ffff:a.b.c.d`,
/// RFC 4291), IPv4-translated (`::ffff:0:a.b.c.d`, RFC 7915), IPv4-compatible (`::a.b.c.d`, deprecated; not `::` or `::1`), NAT64's well-known
/// prefix (`64:ff9b::a.b.c.d`, RFC 6052) and 6to4 (`2002:AABB:CCDD::/48`, RFC 3056).
fn embedded_v4(v6: std::net::Ipv6Addr) -> Option<std::net::Ipv4Addr> {
    let s = v6.segments();
    let tail = |hi: u16, lo: u16| {
        let [a, b] = hi.to_be_bytes();
        let [c, d] = lo.to_be_bytes();
        std::net::Ipv4Addr::new(a, b, c, d)
    };
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    match s {
        [0, 0, 0, 0, 0, 0, hi, lo] if hi != 0 => Some(tail(hi, lo)),
        [0, 0, 0, 0, 0xffff, 0, hi, lo] => Some(tail(hi, lo)),
        [0x64, 0xff9b, 0, 0, 0, 0, hi, lo] => Some(tail(hi, lo)),
        [0x2002, hi, lo, ..] => Some(tail(hi, lo)),
        _ => None,
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
            "`{host}` resolves to {}, an address that is not publicly reachable (the server's \
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
            "192.0.0.8",
            "192.0.2.1",
            "192.88.99.1",
            "198.18.0.1",
            "198.19.255.254",
            "198.51.100.7",
            "203.0.113.9",
            "240.0.0.1",
            "255.255.255.255",
            "64:ff9b::7f00:1",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b:1::1",
            "2002:7f00:1::1",
            "2002:c0a8:101::1",
            "::7f00:1",
            "2001:db8::1",
            "2001::1",
            "2001:2::1",
            "100::1",
            "fec0::1",
            "3fff::1",
            "3fff:fff::1",
            "5f00::1",
            "::ffff:0:7f00:1",
        ] {
            assert!(is_private(private.parse().unwrap()), "{private}");
        }
        for public in [
            "1.1.1.1",
            "93.184.216.34",
            "100.128.0.1",
            "198.20.0.1",
            "192.0.1.1",
            "2606:4700::1111",
            "64:ff9b::101:101",
            "2002:101:101::1",
            "2a00:1450::1",
        ] {
            assert!(!is_private(public.parse().unwrap()), "{public}");
        }
    }
}
