//! `[grpc]`, `[tls]` and `[auth]`: the control plane's listener, its
//! TLS and who may call it; and their checks.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Config, HostPort, Problems};
use crate::sys::pem::{read_pem, PemKind};

/// TLS of the control plane (gRPC), for the server and for every connection
/// this agent makes to other agents. On when the three files are set.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct TlsConfig {
    /// This agent's certificate chain (PEM): served, and presented to peers
    /// that require client certificates.
    pub cert_file: Option<PathBuf>,
    /// Its private key (PEM).
    pub key_file: Option<PathBuf>,
    /// The CA certificates (PEM) other agents' certificates must chain to.
    pub ca_file: Option<PathBuf>,
    /// Require clients (orchestrators, CLIs, other agents) to present a
    /// certificate signed by `ca_file` (mutual TLS).
    pub client_auth: bool,
    /// Name checked in peers' certificates instead of the host part of
    /// their address (for fleets that address agents by IP).
    pub server_name: String,
}

impl TlsConfig {
    /// True when any of the files is set (validation then requires all three).
    pub fn enabled(&self) -> bool {
        self.cert_file.is_some() || self.key_file.is_some() || self.ca_file.is_some()
    }
}

/// Control-plane authentication.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct AuthConfig {
    /// File of accepted bearer tokens (one per line; the first is presented
    /// to peers). Every Orchestrator and Peer RPC must carry one. Empty
    /// turns authentication off. Reloaded on SIGHUP.
    pub token_file: Option<PathBuf>,
    /// Tokens of the agent-to-agent Peer service. When set, Peer calls need
    /// one of these and Orchestrator calls one of `token_file`'s (a token of
    /// the other service gets PERMISSION_DENIED), and the first is what this
    /// agent presents to sources. Reloaded on SIGHUP.
    pub peer_token_file: Option<PathBuf>,
    /// Present this agent's token to a non-loopback source without TLS
    /// (trusted networks only); refused otherwise.
    pub send_token_in_clear: bool,
}

/// Control plane (gRPC) settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct GrpcConfig {
    /// Address the gRPC server binds (`host:port`; port 0 picks a free port).
    pub listen: String,
    /// Serve gRPC without TLS on an address other hosts can reach. Without
    /// `[tls]`, only a loopback `listen` is accepted unless this is set.
    pub plaintext: bool,
    /// Open connections, at most, in total and from one address; more are
    /// closed at once.
    pub max_connections: usize,
    pub max_connections_per_peer: usize,
    /// Requests in flight on one connection (HTTP/2 streams), at most.
    pub max_streams_per_connection: u32,
    /// How long a connection may take to make its first authenticated
    /// request; one that has not is closed then, or earlier when a
    /// newcomer needs its place at a connection limit.
    #[serde(with = "humantime_serde")]
    pub handshake_timeout: Duration,
}

impl Default for GrpcConfig {
    fn default() -> Self {
        GrpcConfig {
            listen: "127.0.0.1:35101".into(),
            plaintext: false,
            max_connections: 1024,
            max_connections_per_peer: 64,
            max_streams_per_connection: 128,
            handshake_timeout: Duration::from_secs(5),
        }
    }
}

impl Config {
    /// `[grpc]`: its connection limits and timeouts.
    pub(super) fn check_grpc(&self, p: &mut Problems) {
        if self.grpc.max_connections_per_peer == 0
            || self.grpc.max_connections_per_peer > self.grpc.max_connections
        {
            p.bad(
                "grpc.max_connections_per_peer",
                "must be between 1 and grpc.max_connections".into(),
            );
        }
        if self.grpc.handshake_timeout.is_zero() {
            p.bad("grpc.handshake_timeout", "must be greater than zero".into());
        }
        if self.grpc.max_streams_per_connection == 0 {
            p.bad(
                "grpc.max_streams_per_connection",
                "must be at least 1".into(),
            );
        }
    }

    /// `[tls]`: complete and readable, or off and then only on loopback
    /// (unless `grpc.plaintext` says otherwise).
    pub(super) fn check_tls(&self, p: &mut Problems) {
        let tls = &self.tls;
        if tls.enabled() {
            if self.grpc.plaintext {
                p.bad(
                    "grpc.plaintext",
                    "contradicts [tls]: remove one of them".into(),
                );
            }
            for (key, file, kind) in [
                ("tls.cert_file", &tls.cert_file, PemKind::Certificates),
                ("tls.key_file", &tls.key_file, PemKind::PrivateKey),
                ("tls.ca_file", &tls.ca_file, PemKind::Certificates),
            ] {
                match file {
                    None => p.bad(
                        key,
                        "TLS needs cert_file, key_file and ca_file together".into(),
                    ),
                    Some(path) => {
                        if let Err(e) = read_pem(path, kind) {
                            p.bad(key, e.to_string());
                        }
                    }
                }
            }
            return;
        }
        if tls.client_auth {
            p.bad(
                "tls.client_auth",
                "needs cert_file, key_file and ca_file".into(),
            );
        }
        if self.grpc_exposed() && !self.grpc.plaintext {
            p.bad(
                "grpc.listen",
                format!(
                    "{} is reachable from other hosts: set [tls] cert_file, key_file and ca_file, or grpc.plaintext = true to serve gRPC without TLS",
                    self.grpc.listen
                ),
            );
        }
    }

    /// An exposed gRPC listener must authenticate its callers: TLS alone
    /// lets anyone start syncs or read snapshots.
    pub(super) fn check_auth(&self, p: &mut Problems) {
        let tokens = self.auth.token_file.is_some();
        if self.auth.peer_token_file.is_some() && !tokens {
            p.bad(
                "auth.peer_token_file",
                "needs auth.token_file too (the orchestrators' tokens)".into(),
            );
        }
        let client_certs = self.tls.enabled() && self.tls.client_auth;
        if self.grpc_exposed() && !tokens && !client_certs {
            p.bad(
                "grpc.listen",
                format!(
                    "{} is reachable from other hosts but nothing authenticates callers: set [auth] token_file, or [tls] client_auth = true",
                    self.grpc.listen
                ),
            );
        }
        for (key, list, whom) in [
            ("sync.allowed_sources", &self.sync.allowed_sources, "source"),
            (
                "fanout.allowed_replicas",
                &self.fanout.allowed_replicas,
                "replica",
            ),
        ] {
            for (i, entry) in list.iter().enumerate() {
                let name = entry.parse::<HostPort>().map_or(entry.clone(), |a| a.host);
                if !crate::peer_text::is_plain_name(&name) {
                    p.bad(
                        key,
                        format!("entry {i} ({entry:?}) is neither host:port nor a name"),
                    );
                } else if !entry.contains(':') && !self.tls_proves_names() {
                    p.bad(
                        key,
                        format!("entry {i} ({entry:?}) is a name, and only a certificate proves one: without [tls] (or with tls.server_name, one name for every agent) a name is whatever a {whom} claims; list the {whom}'s address (host:port) instead, or configure [tls] so that the certificate of the host dialled is checked against the name"),
                    );
                }
            }
        }
    }

    /// Whether TLS proves which host a peer is: its certificate is checked
    /// against the host part of the address dialled.
    pub fn tls_proves_names(&self) -> bool {
        self.tls.enabled() && self.tls.server_name.is_empty()
    }

    /// The gRPC listener is reachable from other hosts.
    pub fn grpc_exposed(&self) -> bool {
        self.grpc
            .listen
            .parse::<SocketAddr>()
            .is_ok_and(|a| !a.ip().is_loopback())
    }
}
