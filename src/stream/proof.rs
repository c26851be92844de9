//! Which server addresses an agent may act on. A failover or a release
//! sends a server `REPLICAOF <addr>` (and hands `<addr>` the servers'
//! password as `masterauth`); a fake or mistyped `<addr>` would make the
//! server wipe itself with whatever that address sends. So an address is
//! acted on only once something the operator wrote proves it:
//! - the instance's configuration names it (the local server, `[redis]
//!   primary_addr` or else `server_addr`; `[redis] primary`, `[stream]
//!   servers`): by the same text, or as an IP address the configured name
//!   resolves to (Sentinel names servers by IP address where a
//!   configuration may say `localhost`), never as another name that
//!   resolves alike ([`same_addr`]);
//! - or a configured peer agent (`[stream] peers`, `upstream`), asked over
//!   gRPC, names it as the server it sits beside together with that
//!   server's `run_id` (from a peer on another host, only an IP address
//!   that is no loopback, unspecified or link-local one),
//!   and the server at the address, asked only then, reports the same
//!   `run_id`.
//!
//! What is acted on is the address as asked, once proved: an IP address,
//! or the very text the configuration or the peer gave.
//!
//! What a caller names in a request (an address, the peers to look among)
//! proves nothing: a caller's typo or an attacker's fake would otherwise
//! decide. Nothing is sent to an address before it is proved: not `AUTH`,
//! not `INFO`.

use std::net::SocketAddr;
use std::time::Duration;

use crate::config::Config;

/// What a peer agent said of itself: what its log follows, and the server
/// beside it with the `run_id` it reported.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerReport {
    /// `primary <addr>` or `agent <addr>, then …`.
    pub source: String,
    /// Its server's address (empty: none).
    pub server: String,
    /// The `run_id` its server reported (empty: it did not answer).
    pub run_id: String,
}

/// Why an address is trusted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Proof {
    /// The instance's configuration names it, under this setting.
    Config(&'static str),
    /// A configured peer named it as the server beside it, with this
    /// `run_id`, which the server must report too ([`Proof::run_id`]).
    Peer { peer: String, run_id: String },
}

impl Proof {
    /// The `run_id` the server must report, when a peer's word proves it.
    pub fn run_id(&self) -> Option<&str> {
        match self {
            Proof::Config(_) => None,
            Proof::Peer { run_id, .. } => Some(run_id),
        }
    }
}

impl std::fmt::Display for Proof {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Proof::Config(setting) => write!(f, "named in {setting}"),
            Proof::Peer { peer, .. } => write!(f, "the server of the configured peer {peer}"),
        }
    }
}

/// Why a peer's report could not be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AskError {
    /// A caller named it, and no caller's token came to ask it with.
    #[error("not a configured peer")]
    NotConfigured,
    #[error("unreachable: {0}")]
    Unreachable(String),
    #[error("no answer within {0:?}")]
    Silent(std::time::Duration),
    #[error("refused: {0}")]
    Refused(String),
}

/// Why an address is not acted on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("nothing proves the server {addr}: it is not in [redis] server_addr, primary_addr or primary, nor in [stream] servers, and no configured peer ([stream] peers, upstream) reports it as its server{}; add it to [stream] servers (or its agent to [stream] peers) if it is one of this instance's servers", asked.as_deref().map(|a| format!(" (asked: {a})")).unwrap_or_default())]
pub struct Unproved {
    pub addr: String,
    /// What the configured peers answered, when any were asked.
    pub asked: Option<String>,
}

/// The server addresses the configuration names, with their settings.
pub fn configured(c: &Config) -> Vec<(&'static str, &str)> {
    let r = &c.redis;
    let mut named = vec![("[redis] primary_addr", r.primary_addr.as_str())];
    // server_addr is a server only where it is the local one (its default
    // is no server of this instance's otherwise).
    if r.primary_addr.is_empty() && c.handoff.mode.is_redis() {
        named.push(("[redis] server_addr", r.server_addr.as_str()));
    }
    named.push(("[redis] primary", r.primary.as_str()));
    named.extend(
        c.stream
            .servers
            .iter()
            .map(|s| ("[stream] servers", s.as_str())),
    );
    named.retain(|(_, a)| !a.is_empty());
    named
}

/// The agents whose word on their own server counts: `[stream] peers` and
/// `upstream`.
pub fn configured_peers(c: &Config) -> Vec<String> {
    let mut peers = c.stream.peers.clone();
    if !c.stream.upstream.is_empty() && !peers.contains(&c.stream.upstream) {
        peers.push(c.stream.upstream.clone());
    }
    peers
}

/// How long resolving a name may take.
const RESOLVE: Duration = Duration::from_secs(5);

/// The socket addresses `addr` (`host:port`) stands for (none when it
/// does not resolve in time).
async fn resolve(addr: &str) -> Vec<SocketAddr> {
    let Ok(hp) = addr.parse::<crate::config::HostPort>() else {
        return Vec::new();
    };
    let lookup = tokio::net::lookup_host((hp.host.as_str(), hp.port));
    // Bound to a name so the lookup, which borrows `hp`, ends before it.
    let found = match tokio::time::timeout(RESOLVE, lookup).await {
        Ok(Ok(found)) => found.collect(),
        _ => Vec::new(),
    };
    found
}

/// Whether the address `asked` (what a request or a Sentinel names) is
/// the server at `known` (what the configuration or a peer names): the
/// same text, or `asked` is an IP address `known` resolves to (Sentinel
/// names servers by IP address where a configuration may say
/// `localhost`). A name that is not an IP address is taken by its text
/// only: it would be resolved again when acted on, by other resolvers, to
/// any of its addresses (one may be another listener's), and may resolve
/// differently by then.
pub async fn same_addr(known: &str, asked: &str) -> bool {
    if known == asked {
        return true;
    }
    match asked.parse::<SocketAddr>() {
        Ok(ip) => resolve(known).await.contains(&ip),
        Err(_) => false,
    }
}

/// Whether a peer's word on its server at `server` can mean a server
/// here: from a peer on this host (`peer` a loopback address or
/// `localhost`), any address; from another host, only an IP address that
/// is no loopback, unspecified or link-local one (its `127.0.0.1`, or a
/// name that resolves to a loopback address here, such as `127.1` or a
/// host alias, would mean this host's).
fn speaks_of_here(peer: &str, server: &str) -> bool {
    let ip = |a: &str| a.parse::<SocketAddr>().map(|a| a.ip().to_canonical());
    let on_this_host = match ip(peer) {
        Ok(ip) => ip.is_loopback(),
        Err(_) => peer
            .parse::<crate::config::HostPort>()
            .is_ok_and(|a| a.host.eq_ignore_ascii_case("localhost")),
    };
    on_this_host
        || ip(server)
            .is_ok_and(|ip| !ip.is_loopback() && !ip.is_unspecified() && !is_link_local(ip))
}

fn is_link_local(ip: std::net::IpAddr) -> bool {
    match ip {
        std::net::IpAddr::V4(v4) => v4.is_link_local(),
        std::net::IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// What proves `addr` for an instance configured as `c`, given what its
/// configured peers reported (`reports`: peer, and its answer or why
/// none): the configuration first, then a peer's word.
pub async fn prove(
    c: &Config,
    addr: &str,
    reports: &[(String, Result<PeerReport, AskError>)],
) -> Result<Proof, Unproved> {
    for (setting, named) in configured(c) {
        if same_addr(named, addr).await {
            return Ok(Proof::Config(setting));
        }
    }
    let peers = configured_peers(c);
    for (peer, report) in reports {
        let Ok(r) = report else { continue };
        if peers.contains(peer)
            && !r.server.is_empty()
            && !r.run_id.is_empty()
            && speaks_of_here(peer, &r.server)
            && same_addr(&r.server, addr).await
        {
            return Ok(Proof::Peer {
                peer: peer.clone(),
                run_id: r.run_id.clone(),
            });
        }
    }
    let asked = reports
        .iter()
        .filter(|(p, _)| peers.contains(p))
        .map(|(p, r)| match r {
            Ok(r) if r.server.is_empty() => format!("{p} has no server"),
            Ok(r) => format!("{p} sits beside {}", r.server),
            Err(e) => format!("{p}: {e}"),
        })
        .collect::<Vec<_>>();
    Err(Unproved {
        addr: addr.to_string(),
        asked: (!asked.is_empty()).then(|| asked.join("; ")),
    })
}

/// [`prove`], asking the configured peers (`ask(peer)`) only when the
/// configuration alone does not prove `addr`.
pub async fn prove_asking<F, Fut>(c: &Config, addr: &str, ask: F) -> Result<Proof, Unproved>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<PeerReport, AskError>>,
{
    if let Ok(proof) = prove(c, addr, &[]).await {
        return Ok(proof);
    }
    let peers = configured_peers(c);
    let reports = futures::future::join_all(
        peers
            .iter()
            .map(|p| async { (p.clone(), ask(p.clone()).await) }),
    )
    .await;
    prove(c, addr, &reports).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(toml: &str) -> Config {
        toml::from_str(toml).unwrap()
    }

    fn report(server: &str, run_id: &str) -> Result<PeerReport, AskError> {
        Ok(PeerReport {
            source: "primary 10.0.0.1:6379".into(),
            server: server.into(),
            run_id: run_id.into(),
        })
    }

    #[tokio::test]
    async fn the_configuration_proves_its_own_addresses_by_text_or_as_an_ip_they_resolve_to() {
        let c = config(
            "[redis]\nprimary_addr = \"localhost:6379\"\n[stream]\nservers = [\"10.0.0.2:6380\", \"127.0.0.1:6381\"]\n",
        );
        let p = |a: &'static str| prove(&c, a, &[]);
        let primary = Ok(Proof::Config("[redis] primary_addr"));
        assert_eq!(p("localhost:6379").await, primary);
        assert_eq!(p("127.0.0.1:6379").await, primary, "Sentinel's IP");
        assert_eq!(
            p("10.0.0.2:6380").await,
            Ok(Proof::Config("[stream] servers"))
        );
        // Another port, a typo, a name that does not resolve; and a name
        // that resolves to a configured address among others (localhost:
        // ::1 too, where another process may listen), which would be
        // resolved again, by other resolvers, when acted on.
        for bad in [
            "127.0.0.1:6378",
            "10.0.0.2:680",
            "no-such-host.invalid:6379",
            "localhost:6381",
        ] {
            let e = p(bad).await.unwrap_err();
            assert_eq!(e.addr, bad);
            assert!(e.to_string().contains("[stream] servers"), "{e}");
        }
        // server_addr counts only where it is the local server: a redis
        // handoff's, on an agent that follows no primary.
        let c = config("[redis]\nserver_addr = \"10.0.0.3:6379\"\n");
        assert!(prove(&c, "10.0.0.3:6379", &[]).await.is_err());
        let stream = "[handoff]\nmode = \"redis-stream\"\n[redis]\n";
        let c = config(&format!("{stream}server_addr = \"10.0.0.3:6379\"\n"));
        assert!(prove(&c, "10.0.0.3:6379", &[]).await.is_ok());
        let c = config(&format!("{stream}primary_addr = \"10.0.0.1:6379\"\n"));
        assert!(
            prove(&c, "127.0.0.1:6379", &[]).await.is_err(),
            "the default server_addr is no server of the instance"
        );
    }

    #[tokio::test]
    async fn only_a_configured_peer_proves_the_server_beside_it_and_only_with_its_run_id() {
        let c = config("[stream]\npeers = [\"10.0.0.9:35101\"]\nupstream = \"10.0.0.8:35101\"\n");
        let configured = ("10.0.0.9:35101".to_string(), report("10.0.0.2:6380", "abc"));
        assert_eq!(
            prove(&c, "10.0.0.2:6380", std::slice::from_ref(&configured)).await,
            Ok(Proof::Peer {
                peer: "10.0.0.9:35101".into(),
                run_id: "abc".into()
            })
        );
        let upstream = ("10.0.0.8:35101".to_string(), report("10.0.0.4:6380", "def"));
        assert!(prove(&c, "10.0.0.4:6380", &[upstream]).await.is_ok());
        // A peer the caller named, not the configuration: its word is not
        // proof, however it answers.
        let named = ("10.6.6.6:35101".to_string(), report("10.6.6.6:6379", "x"));
        let e = prove(&c, "10.6.6.6:6379", &[named]).await.unwrap_err();
        assert_eq!(e.asked, None);
        // A configured peer whose server did not answer proves nothing.
        let silent = ("10.0.0.9:35101".to_string(), report("10.0.0.2:6380", ""));
        assert!(prove(&c, "10.0.0.2:6380", &[silent]).await.is_err());
        // A peer on another host speaks of its own loopback, not this
        // one's, under whatever spelling; and of its servers by address.
        for own in [
            "127.0.0.1:6379",
            "127.1:6379",
            "[::ffff:127.0.0.1]:6379",
            "0.0.0.0:6379",
            "localhost:6379",
            "[fe80::1]:6379",
            "redis-a:6379",
        ] {
            let r = ("10.0.0.9:35101".to_string(), report(own, "abc"));
            assert!(prove(&c, own, &[r]).await.is_err(), "{own}");
        }
        let c_local = config("[stream]\npeers = [\"127.0.0.1:35101\"]\n");
        let same_host = (
            "127.0.0.1:35101".to_string(),
            report("127.0.0.1:6379", "abc"),
        );
        assert!(prove(&c_local, "127.0.0.1:6379", &[same_host])
            .await
            .is_ok());
        let e = prove(&c, "10.0.0.5:6380", &[configured]).await.unwrap_err();
        assert!(
            e.to_string()
                .contains("10.0.0.9:35101 sits beside 10.0.0.2:6380"),
            "{e}"
        );
    }
}
