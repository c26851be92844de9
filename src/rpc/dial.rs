//! How a process reaches an agent's gRPC server: plaintext or TLS, with the
//! bearer token of its (reloadable) token file on every call. Used by
//! replica agents to reach sources and by the CLI to reach agents.

use std::sync::Arc;
use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

use super::auth::{ClientAuth, Tokens};

/// A channel to another agent that presents a bearer token on every call.
pub type AgentChannel = InterceptedService<Channel, ClientAuth>;

/// How this process reaches other agents: over TLS or plaintext, and with
/// the bearer token of its (reloadable) token file.
#[derive(Clone)]
pub struct Dialer {
    pub tls: Option<ClientTlsConfig>,
    pub tokens: Arc<Tokens>,
}

impl Dialer {
    /// Opens a channel to an agent's gRPC address (`host:port`).
    pub async fn connect(&self, addr: &str, timeout: Duration) -> Result<AgentChannel, String> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| format!("bad address {addr:?}: {e}"))?
            .connect_timeout(timeout)
            .tcp_nodelay(true);
        if let Some(tls) = &self.tls {
            endpoint = endpoint
                .tls_config(tls.clone())
                .map_err(|e| format!("TLS settings: {}", error_chain(&e)))?;
        }
        let channel = endpoint.connect().await.map_err(|e| error_chain(&e))?;
        Ok(InterceptedService::new(channel, self.tokens.client()))
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
