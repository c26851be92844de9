//! TLS of the control plane.
//!
//! Owns reading and checking the PEM files (`[tls]` for agents, the
//! `--tls-*` options for the CLI) and building tonic's server and client TLS
//! settings from them. A file without a usable certificate or key is refused
//! when the agent starts and by `check-config`, not at the first handshake.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::config::TlsConfig;

/// A client that has not finished its handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What a PEM file must hold.
#[derive(Debug, Clone, Copy)]
pub enum PemKind {
    /// One or more certificates (a chain, or CA certificates).
    Certificates,
    /// One private key (PKCS#8, PKCS#1 or SEC1).
    PrivateKey,
}

/// Why a PEM file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} holds no usable PEM {kind} ({message})")]
    BadPem {
        path: PathBuf,
        kind: &'static str,
        message: String,
    },
    #[error("TLS needs cert_file, key_file and ca_file together")]
    Incomplete,
}

/// Reads a PEM file and checks that it holds what `kind` says.
pub fn read_pem(path: &Path, kind: PemKind) -> Result<Vec<u8>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })?;
    let bad = |kind: &'static str, message: String| TlsError::BadPem {
        path: path.to_owned(),
        kind,
        message,
    };
    match kind {
        PemKind::Certificates => {
            let certs = CertificateDer::pem_slice_iter(&bytes)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad("certificate", e.to_string()))?;
            if certs.is_empty() {
                return Err(bad("certificate", "no CERTIFICATE block".into()));
            }
        }
        PemKind::PrivateKey => {
            PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| bad("private key", e.to_string()))?;
        }
    }
    Ok(bytes)
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
