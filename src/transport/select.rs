//! Local interface choice for RDMA (docs/ARCHITECTURE.md, "Transports"): which address the RDMA
//! listener binds and replicas connect from, and how a loopback peer is
//! mapped to a real interface (RDMA cannot use loopback).
//!
//! Pure functions over an interface list, so scoring and mapping are tested
//! on synthetic lists; [`interfaces`] reads the host's.

use std::net::IpAddr;

/// One address of one interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Iface {
    pub name: String,
    pub ip: IpAddr,
    /// Prefix length of the address's subnet.
    pub prefix: u8,
}

/// The host's interface addresses.
pub fn interfaces() -> Vec<Iface> {
    if_addrs::get_if_addrs()
        .unwrap_or_default()
        .into_iter()
        .map(|i| Iface {
            ip: i.ip(),
            prefix: match &i.addr {
                if_addrs::IfAddr::V4(a) => a.prefixlen,
                if_addrs::IfAddr::V6(a) => a.prefixlen,
            },
            name: i.name,
        })
        .collect()
}

/// How suitable an interface is for RDMA: `en*`/`eth*` best, `ib*` next,
/// anything else last; `None` for `lo`, `docker*`, `veth*`, loopback,
/// link-local and unspecified addresses.
pub fn score(iface: &Iface) -> Option<u8> {
    let n = iface.name.as_str();
    let unusable = match iface.ip {
        IpAddr::V4(ip) => ip.is_loopback() || ip.is_link_local() || ip.is_unspecified(),
        IpAddr::V6(ip) => {
            ip.is_loopback() || ip.is_unspecified() || (ip.segments()[0] & 0xffc0) == 0xfe80
        }
    };
    if unusable || n == "lo" || n.starts_with("docker") || n.starts_with("veth") {
        return None;
    }
    Some(if n.starts_with("en") || n.starts_with("eth") {
        3
    } else if n.starts_with("ib") {
        2
    } else {
        1
    })
}

/// True when `a` and `b` share the first `prefix` bits.
fn same_subnet(a: IpAddr, b: IpAddr, prefix: u8) -> bool {
    let bits = |ip: IpAddr| -> (u128, u32) {
        match ip {
            IpAddr::V4(v) => (u32::from(v) as u128, 32),
            IpAddr::V6(v) => (u128::from(v), 128),
        }
    };
    let ((x, w), (y, w2)) = (bits(a), bits(b));
    if w != w2 || prefix as u32 > w {
        return false;
    }
    let shift = w - prefix as u32;
    shift >= w || (x >> shift) == (y >> shift)
}

/// Picks the local interface: the configured one (by name or address) when
/// set; else, with a known non-loopback peer, the best-scored address in the
/// peer's subnet; else the best-scored address (IPv4 before IPv6, then list
/// order).
pub fn choose(ifaces: &[Iface], configured: &str, peer: Option<IpAddr>) -> Option<Iface> {
    if !configured.is_empty() {
        return ifaces
            .iter()
            .filter(|i| i.name == configured || i.ip.to_string() == configured)
            .min_by_key(|i| i.ip.is_ipv6())
            .cloned();
    }
    let usable = ifaces.iter().filter_map(|i| score(i).map(|s| (s, i)));
    // Highest score, IPv4 first, then list order.
    let best = |it: &mut dyn Iterator<Item = (u8, &Iface)>| {
        it.min_by_key(|(s, i)| (std::cmp::Reverse(*s), i.ip.is_ipv6()))
            .map(|(_, i)| i.clone())
    };
    if let Some(peer) = peer.filter(|p| !p.is_loopback()) {
        let mut near = usable
            .clone()
            .filter(|(_, i)| same_subnet(i.ip, peer, i.prefix));
        if let Some(i) = best(&mut near) {
            return Some(i);
        }
    }
    best(&mut usable.clone())
}

/// RDMA cannot use loopback: a loopback peer is this host, reached through
/// the chosen local address.
pub fn map_peer(peer: IpAddr, local: IpAddr) -> IpAddr {
    if peer.is_loopback() {
        local
    } else {
        peer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn i(name: &str, ip: &str, prefix: u8) -> Iface {
        Iface {
            name: name.into(),
            ip: ip.parse().unwrap(),
            prefix,
        }
    }

    fn host() -> Vec<Iface> {
        vec![
            i("lo", "127.0.0.1", 8),
            i("docker0", "172.17.0.1", 16),
            i("veth12ab", "172.17.0.5", 16),
            i("wlan0", "192.168.1.20", 24),
            i("ib0", "10.10.0.7", 16),
            i("eth0", "169.254.3.3", 16),
            i("eth0", "fe80::1", 64),
            i("enp3s0", "10.20.0.7", 24),
            i("enp3s0", "fd00::7", 64),
        ]
    }

    #[test]
    fn scoring_prefers_ethernet_then_infiniband_and_skips_virtual_and_loopback() {
        let h = host();
        let scores: Vec<_> = h.iter().map(score).collect();
        assert_eq!(
            scores,
            vec![
                None,
                None,
                None,
                Some(1),
                Some(2),
                None,
                None,
                Some(3),
                Some(3)
            ]
        );
        assert_eq!(choose(&h, "", None).unwrap().ip.to_string(), "10.20.0.7");
    }

    #[test]
    fn a_known_peer_selects_the_interface_in_its_subnet() {
        let h = host();
        let peer = Some("10.10.3.9".parse().unwrap());
        assert_eq!(choose(&h, "", peer).unwrap().name, "ib0");
        let far = Some("8.8.8.8".parse().unwrap());
        assert_eq!(choose(&h, "", far).unwrap().name, "enp3s0");
        let lo = Some("127.0.0.1".parse().unwrap());
        assert_eq!(choose(&h, "", lo).unwrap().name, "enp3s0");
    }

    #[test]
    fn configured_interface_wins_by_name_or_address() {
        let h = host();
        assert_eq!(choose(&h, "ib0", None).unwrap().ip.to_string(), "10.10.0.7");
        assert_eq!(choose(&h, "192.168.1.20", None).unwrap().name, "wlan0");
        assert_eq!(
            choose(&h, "enp3s0", None).unwrap().ip.to_string(),
            "10.20.0.7"
        );
        assert_eq!(choose(&h, "eth9", None), None);
    }

    #[test]
    fn only_loopback_means_no_interface() {
        assert_eq!(
            choose(&[i("lo", "127.0.0.1", 8), i("lo", "::1", 128)], "", None),
            None
        );
    }

    #[test]
    fn loopback_peer_maps_to_the_local_interface() {
        let local: IpAddr = "10.0.2.15".parse().unwrap();
        assert_eq!(map_peer("127.0.0.1".parse().unwrap(), local), local);
        assert_eq!(map_peer("::1".parse().unwrap(), local), local);
        let other: IpAddr = "10.0.2.16".parse().unwrap();
        assert_eq!(map_peer(other, local), other);
    }

    #[test]
    fn subnet_arithmetic() {
        let a: IpAddr = "10.1.2.3".parse().unwrap();
        assert!(same_subnet(a, "10.1.2.200".parse().unwrap(), 24));
        assert!(!same_subnet(a, "10.1.3.3".parse().unwrap(), 24));
        assert!(same_subnet(a, "99.9.9.9".parse().unwrap(), 0));
        assert!(!same_subnet(a, "::1".parse().unwrap(), 0));
    }
}
