//! Addresses in the configuration: `host:port` ([`HostPort`]), read
//! with this type and never split by hand.

/// A `host:port` address: a name or an IP (an IPv6 one in brackets) and a
/// numeric port. Addresses are read with this, never split by hand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort {
    pub host: String,
    pub port: u16,
}

impl HostPort {
    /// What tells two spellings of one address apart from two addresses,
    /// without asking a resolver: the host in lower case, an IP address in
    /// its canonical form, every loopback name and address as one, and
    /// the port's number.
    pub fn same_host_key(&self) -> (String, u16) {
        let host = match crate::sys::numeric_ip(&self.host).map(|ip| ip.to_canonical()) {
            Some(ip) if ip.is_loopback() || ip.is_unspecified() => "local".to_string(),
            Some(ip) => ip.to_string(),
            None if self.host.eq_ignore_ascii_case("localhost") => "local".to_string(),
            None => self.host.to_ascii_lowercase(),
        };
        (host, self.port)
    }
}

/// Text that is not `host:port`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not host:port")]
pub struct NotHostPort(pub String);

impl std::str::FromStr for HostPort {
    type Err = NotHostPort;

    fn from_str(s: &str) -> Result<HostPort, NotHostPort> {
        let bad = || NotHostPort(s.chars().take(300).collect());
        let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
        let port = port.parse().map_err(|_| bad())?;
        let host = match host.strip_prefix('[') {
            Some(inner) => inner.strip_suffix(']').ok_or_else(bad)?,
            None if host.contains(':') => return Err(bad()),
            None => host,
        };
        if host.is_empty() {
            return Err(bad());
        }
        Ok(HostPort {
            host: host.to_string(),
            port,
        })
    }
}

impl std::fmt::Display for HostPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.host.contains(':') {
            true => write!(f, "[{}]:{}", self.host, self.port),
            false => write!(f, "{}:{}", self.host, self.port),
        }
    }
}

/// True for `host:port` with a numeric port.
pub(super) fn is_host_port(s: &str) -> bool {
    s.parse::<HostPort>().is_ok()
}
