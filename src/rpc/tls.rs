//! TLS settings from the agent's PEM files.
//!
//! Owns building tonic's server and client TLS settings for the gRPC
//! control plane (`[tls]` for agents, the `--tls-*` options for the CLI),
//! the rustls settings of the TCP data plane (same files, TLS 1.3), and
//! those of a replication link to a Redis/Valkey server over TLS
//! (`[redis] tls`'s files, read at each connection). A file without a
//! usable certificate or key is refused when the agent starts (and by
//! `check-config`, through `pem`), not at the first handshake.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::config::{TlsConfig, TlsFiles};
use crate::sys::pem::{read_pem, PemError, PemKind};

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
    /// rustls refused the certificates or key.
    #[error("TLS: {0}")]
    Rustls(String),
    /// TLS is to be served to a server, but no certificate is set.
    #[error("set [redis] tls_cert_file and tls_key_file to a certificate the server trusts (its tls-ca-cert-file)")]
    NoIdentity,
}

/// The data plane's crypto: TLS 1.3 only, AES-128-GCM preferred (the
/// fastest suite with AES-NI), no session tickets (a session is one
/// connection). Both ends let the keys be extracted, for kernel TLS.
fn data_provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(provider)
}

fn rustls_err(e: impl std::fmt::Display) -> TlsError {
    TlsError::Rustls(e.to_string())
}

/// The CA certificates in `ca` (PEM), as rustls's roots.
fn roots(ca: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&read_pem(ca, PemKind::Certificates)?) {
        roots.add(cert.map_err(rustls_err)?).map_err(rustls_err)?;
    }
    Ok(roots)
}

/// A certificate chain and its private key (PEM), as rustls takes them.
type RustlsIdentity = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

fn identity(cert: &Path, key: &Path) -> Result<RustlsIdentity, TlsError> {
    let certs = CertificateDer::pem_slice_iter(&read_pem(cert, PemKind::Certificates)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(rustls_err)?;
    let key =
        PrivateKeyDer::from_pem_slice(&read_pem(key, PemKind::PrivateKey)?).map_err(rustls_err)?;
    Ok((certs, key))
}

/// The data-plane server settings (a source's TCP data listener); `None`
/// when `[tls]` is off. The session token authenticates the replica.
pub fn data_server(cfg: &TlsConfig) -> Result<Option<Arc<rustls::ServerConfig>>, TlsError> {
    let (Some(cert), Some(key)) = (&cfg.cert_file, &cfg.key_file) else {
        return Ok(None);
    };
    let (certs, key) = identity(cert, key)?;
    let mut config = rustls::ServerConfig::builder_with_provider(data_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(rustls_err)?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(rustls_err)?;
    config.send_tls13_tickets = 0;
    config.enable_secret_extraction = true;
    Ok(Some(Arc::new(config)))
}

/// The data-plane client settings (a replica reaching a source): sources
/// must chain to `ca_file`. `None` when `[tls]` is off.
pub fn data_client(cfg: &TlsConfig) -> Result<Option<Arc<rustls::ClientConfig>>, TlsError> {
    let Some(ca) = &cfg.ca_file else {
        return Ok(None);
    };
    let roots = roots(ca)?;
    let mut config = rustls::ClientConfig::builder_with_provider(data_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(rustls_err)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.enable_secret_extraction = true;
    Ok(Some(Arc::new(config)))
}

/// A replication link to a Redis/Valkey server over TLS: the server's
/// certificate must chain to `files.ca`; the client certificate and key
/// are presented when set. TLS 1.2 and 1.3, as the servers offer.
pub fn kv_client(files: &TlsFiles) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let roots = roots(&files.ca)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(rustls_err)?
        .with_root_certificates(roots);
    let config = match files.cert.as_os_str().is_empty() {
        true => config.with_no_client_auth(),
        false => {
            let (certs, key) = identity(&files.cert, &files.key)?;
            config
                .with_client_auth_cert(certs, key)
                .map_err(rustls_err)?
        }
    };
    Ok(Arc::new(config))
}

/// The agent's replication ports (the seed and the stream feed) to a
/// server that replicates over TLS (its `tls-replication yes`): the agent
/// presents `files`' certificate and key, which the server must trust. The
/// server is proved by its address and a one-time password, not by a
/// client certificate. TLS 1.2 and 1.3, as the servers offer.
pub fn kv_server(files: &TlsFiles) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    if files.cert.as_os_str().is_empty() {
        return Err(TlsError::NoIdentity);
    }
    let (certs, key) = identity(&files.cert, &files.key)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(rustls_err)?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(rustls_err)?;
    Ok(Arc::new(config))
}

/// One direction of a connection to or from a Redis/Valkey server, over
/// TCP or TLS.
pub type KvRead = Box<dyn AsyncRead + Send + Unpin>;
pub type KvWrite = Box<dyn AsyncWrite + Send + Unpin>;

/// A plain TCP connection's two directions (no lock between them).
pub fn tcp_halves(stream: TcpStream) -> (KvRead, KvWrite) {
    let (read, write) = stream.into_split();
    (Box::new(read), Box::new(write))
}

/// A TLS connection's two directions.
pub fn tls_halves<S: AsyncRead + AsyncWrite + Send + 'static>(stream: S) -> (KvRead, KvWrite) {
    let (read, write) = tokio::io::split(stream);
    (Box::new(read), Box::new(write))
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
