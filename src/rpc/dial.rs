//! How a process reaches an agent's gRPC server: plaintext or TLS, with the
//! bearer token of its (reloadable) token file on every call, and which
//! agents an allow list lets it dial, what an agent's address looks like
//! and which name its certificate must carry. Used by replica agents to reach
//! sources, by origins to reach a fan-out's replicas and by the CLI to
//! reach agents.

use std::sync::Arc;
use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

use super::auth::{ClientAuth, Tokens};

/// How long establishing a connection to a peer may take: an agent's gRPC
/// endpoint or a data endpoint.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A channel to another agent that presents a bearer token on every call.
pub type AgentChannel = InterceptedService<Channel, ClientAuth>;

/// How this process reaches other agents: over TLS or plaintext, and with
/// the bearer token of its (reloadable) token file.
#[derive(Clone)]
pub struct Dialer {
    pub tls: Option<ClientTlsConfig>,
    pub tokens: Arc<Tokens>,
    /// Present tokens without TLS to any address (`[auth]
    /// send_token_in_clear`; the CLI, whose operator chose the address).
    pub token_in_clear: bool,
    /// Without TLS, the addresses this process's own token may still go to
    /// (an agent's `sync.allowed_sources` address entries).
    pub listed: Vec<String>,
    /// TLS for the TCP data path to sources (`None`: plaintext only).
    pub data_tls: Option<Arc<rustls::ClientConfig>>,
}

/// Why a channel to an agent could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("refusing to send this agent's token in clear text to {0}: set [tls], or [auth] send_token_in_clear = true on a trusted network")]
    TokenInClear(String),
    #[error("refusing to present this agent's token to {0}: without [tls] nothing proves which process answers there (on this host too); set [tls], list {0} in sync.allowed_sources, or [auth] send_token_in_clear = true on a trusted network")]
    Unproved(String),
    #[error("bad address {addr:?}: {reason}")]
    BadAddress { addr: String, reason: String },
    #[error("TLS settings: {0}")]
    Tls(String),
    /// The connection failed: the error and its sources, on one line.
    #[error("{0}")]
    Failed(String),
}

impl Dialer {
    /// Opens a channel to an agent's gRPC address (`host:port`) that
    /// presents this process's own token (for an agent, the fleet's peer
    /// token): only to an agent TLS proved (its certificate checked against
    /// the name dialled), or listed by address, or where `token_in_clear`
    /// says so. Loopback proves nothing: any local user can listen there.
    pub async fn connect(
        &self,
        addr: &str,
        timeout: Duration,
    ) -> Result<AgentChannel, ConnectError> {
        let auth = self.tokens.client();
        if self.tls.is_none()
            && auth.is_some()
            && !self.token_in_clear
            && !self.listed.iter().any(|a| a == addr)
        {
            return Err(ConnectError::Unproved(addr.to_string()));
        }
        self.open(addr, timeout, auth).await
    }

    /// Opens a channel that presents `auth` instead of this agent's token
    /// (a caller's token passed on, for calls made on its behalf, to the
    /// agents the caller named): never in clear text off this host unless
    /// `token_in_clear` says so.
    pub async fn connect_as(
        &self,
        addr: &str,
        timeout: Duration,
        auth: ClientAuth,
    ) -> Result<AgentChannel, ConnectError> {
        if self.tls.is_none() && auth.is_some() && !self.token_in_clear && !is_local(addr) {
            return Err(ConnectError::TokenInClear(addr.to_string()));
        }
        self.open(addr, timeout, auth).await
    }

    /// Whether [`Dialer::connect`] to `addr` presents a token in clear
    /// text to another host (the CLI warns of it).
    pub fn token_in_clear_to(&self, addr: &str) -> bool {
        self.tls.is_none() && self.tokens.client().is_some() && !is_local(addr)
    }

    async fn open(
        &self,
        addr: &str,
        timeout: Duration,
        auth: ClientAuth,
    ) -> Result<AgentChannel, ConnectError> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| ConnectError::BadAddress {
                addr: addr.chars().take(300).collect(),
                reason: e.to_string(),
            })?
            .connect_timeout(timeout)
            .tcp_nodelay(true)
            // A peer that vanished (no FIN, no RST) ends long-lived streams
            // such as WatchSync instead of leaving them waiting.
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true);
        if let Some(tls) = &self.tls {
            endpoint = endpoint
                .tls_config(tls.clone())
                .map_err(|e| ConnectError::Tls(error_chain(&e)))?;
        }
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| ConnectError::Failed(error_chain(&e)))?;
        Ok(InterceptedService::new(channel, auth))
    }
}

/// An error and its sources on one line (a transport error's sources carry
/// the useful part: refused, TLS alert, certificate unknown, …).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let text = s.to_string();
        if !msg.contains(&text) {
            msg = format!("{msg}: {text}");
        }
        src = s.source();
    }
    msg
}

/// `host:port` names this host (a loopback address or `localhost`).
/// Whether an allow list (`[sync] allowed_sources`, `[fanout]
/// allowed_replicas`) lets this agent dial the agent at `addr`: an address
/// entry is that address; a name entry is the name the agent's certificate
/// proves, the host part of the address it is dialled at (configuration
/// allows name entries only under [tls], where the certificate is checked
/// against that name). What an agent says about itself (its node id) never
/// admits it. An empty list allows any address.
pub fn allowed(list: &[String], addr: &str) -> bool {
    let host = addr.parse::<crate::config::HostPort>().map(|a| a.host);
    list.is_empty()
        || list
            .iter()
            .any(|a| a == addr || (!a.contains(':') && host.as_ref().is_ok_and(|h| h == a)))
}

fn is_local(addr: &str) -> bool {
    match addr.parse::<std::net::SocketAddr>() {
        Ok(a) => a.ip().is_loopback(),
        Err(_) => addr
            .parse::<crate::config::HostPort>()
            .is_ok_and(|a| a.host == "localhost"),
    }
}

/// Longest accepted agent address.
const MAX_ADDR_LEN: usize = 256;

/// Whether `addr` has the form of an agent's gRPC address (`host:port`).
pub fn is_agent_addr(addr: &str) -> bool {
    !addr.is_empty()
        && addr.len() <= MAX_ADDR_LEN
        && !addr.contains(['/', ' '])
        && !crate::peer_text::has_control(addr)
        && addr.contains(':')
}

/// The name an agent's certificate must carry: `[tls] server_name`, or
/// else the host of the agent's gRPC address, as for gRPC.
pub fn tls_name(server_name: &str, agent_addr: &str) -> String {
    if !server_name.is_empty() {
        return server_name.to_string();
    }
    agent_addr
        .parse::<crate::config::HostPort>()
        .map_or(agent_addr.to_string(), |a| a.host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_certificate_name_is_the_configured_one_or_the_source_host() {
        assert_eq!(
            tls_name("agents.example", "10.0.0.1:7000"),
            "agents.example"
        );
        assert_eq!(tls_name("", "src-a.example:7000"), "src-a.example");
        assert_eq!(tls_name("", "[fd00::1]:7000"), "fd00::1");
        assert_eq!(tls_name("", "bare-host"), "bare-host");
    }

    #[test]
    fn allow_lists_match_the_address_or_the_proved_host_never_the_claimed_node_id() {
        let list = |entries: &[&str]| entries.iter().map(|e| e.to_string()).collect::<Vec<_>>();
        assert!(allowed(&[], "src:7000"));
        assert!(allowed(&list(&["src:7000"]), "src:7000"));
        // A name is the host TLS checked the certificate against.
        assert!(allowed(&list(&["src"]), "src:7000"));
        assert!(!allowed(&list(&["src:7001", "other"]), "src:7000"));
        // The node id an agent claims ("src-a") plays no part.
        assert!(!allowed(&list(&["src-a"]), "src:7000"));
    }

    #[tokio::test]
    async fn tokens_stay_off_the_wire_in_clear_text_unless_allowed() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tokens");
        std::fs::write(&file, "0123456789abcdef0123\n").unwrap();
        let mut dialer = Dialer {
            tls: None,
            tokens: Tokens::load(Some(&file)).unwrap(),
            token_in_clear: false,
            listed: vec!["127.0.0.1:2".into()],
            data_tls: None,
        };
        let t = Duration::from_millis(200);
        // This agent's own token: not to an address nothing proves, not
        // even on loopback, where any local user can listen.
        for addr in ["192.0.2.1:35101", "127.0.0.1:1"] {
            let err = dialer.connect(addr, t).await.err().unwrap();
            assert!(matches!(err, ConnectError::Unproved(_)), "{err}");
        }
        // Listed by address: the call goes ahead (and fails to connect,
        // nobody listens).
        let err = dialer.connect("127.0.0.1:2", t).await.err().unwrap();
        assert!(matches!(err, ConnectError::Failed(_)), "{err}");
        // A caller's token passed on: to this host only.
        let caller = || ClientAuth::new(Some("caller-token-0123456789".into()));
        let err = dialer
            .connect_as("192.0.2.1:35101", t, caller())
            .await
            .err()
            .unwrap();
        assert!(matches!(err, ConnectError::TokenInClear(_)), "{err}");
        assert!(is_local("127.0.0.1:1") && is_local("[::1]:1") && is_local("localhost:1"));
        assert!(!is_local("10.0.0.1:1") && !is_local("primary-1:1"));
        // Allowed everywhere (the CLI): what it warns of is known.
        dialer.token_in_clear = true;
        let err = dialer.connect("127.0.0.1:1", t).await.err().unwrap();
        assert!(matches!(err, ConnectError::Failed(_)), "{err}");
        assert!(dialer.token_in_clear_to("10.0.0.1:35101"));
        assert!(!dialer.token_in_clear_to("127.0.0.1:35101"));
    }
}
