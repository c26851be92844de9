//! TLS of the gRPC control plane.
//!
//! Owns building tonic's server and client TLS settings from the PEM files
//! (`[tls]` for agents, the `--tls-*` options for the CLI). A file without a
//! usable certificate or key is refused when the agent starts (and by
//! `check-config`, through `pem`), not at the first handshake.

use std::path::Path;
use std::time::Duration;

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::config::TlsConfig;
use crate::pem::{read_pem, PemError, PemKind};

/// A client that has not finished its handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why TLS settings cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file is unusable.
    #[error(transparent)]
    Pem(#[from] PemError),
    /// Only some of the three files are set.
    #[error("TLS needs cert_file, key_file and ca_file together")]
    Incomplete,
}

/// The agent's identity (certificate chain and key) and the CA
/// certificates its peers must chain to, read and checked.
fn agent_files(cfg: &TlsConfig) -> Result<(Identity, Certificate), TlsError> {
    let (Some(cert), Some(key), Some(ca)) = (&cfg.cert_file, &cfg.key_file, &cfg.ca_file) else {
        return Err(TlsError::Incomplete);
    };
    Ok((
        Identity::from_pem(
            read_pem(cert, PemKind::Certificates)?,
            read_pem(key, PemKind::PrivateKey)?,
        ),
        Certificate::from_pem(read_pem(ca, PemKind::Certificates)?),
    ))
}

/// The gRPC server's TLS settings; `None` when `[tls]` is off.
pub fn server(cfg: &TlsConfig) -> Result<Option<ServerTlsConfig>, TlsError> {
    if !cfg.enabled() {
        return Ok(None);
    }
    let (identity, ca) = agent_files(cfg)?;
    let mut tls = ServerTlsConfig::new()
        .identity(identity)
        .timeout(HANDSHAKE_TIMEOUT);
    if cfg.client_auth {
        tls = tls.client_ca_root(ca);
    }
    Ok(Some(tls))
}

/// How this agent connects to other agents; `None` when `[tls]` is off.
/// It always presents its certificate, for peers that require one.
pub fn agent_client(cfg: &TlsConfig) -> Result<Option<ClientTlsConfig>, TlsError> {
    if !cfg.enabled() {
        return Ok(None);
    }
    let (identity, ca) = agent_files(cfg)?;
    Ok(Some(client_config(ca, Some(identity), &cfg.server_name)))
}

/// Client TLS from files: the CA certificates servers must chain to and,
/// for agents that require client certificates, a certificate and key.
pub fn client(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
    server_name: &str,
) -> Result<ClientTlsConfig, TlsError> {
    let ca = Certificate::from_pem(read_pem(ca, PemKind::Certificates)?);
    let identity = match identity {
        Some((cert, key)) => Some(Identity::from_pem(
            read_pem(cert, PemKind::Certificates)?,
            read_pem(key, PemKind::PrivateKey)?,
        )),
        None => None,
    };
    Ok(client_config(ca, identity, server_name))
}

fn client_config(
    ca: Certificate,
    identity: Option<Identity>,
    server_name: &str,
) -> ClientTlsConfig {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(ca)
        .timeout(HANDSHAKE_TIMEOUT);
    if let Some(identity) = identity {
        tls = tls.identity(identity);
    }
    if !server_name.is_empty() {
        tls = tls.domain_name(server_name);
    }
    tls
}
