//! PEM files: reading one and checking it holds what it should (a
//! certificate chain or one private key). Used by `config` to report a bad
//! `[tls]` file at once, and by `rpc::tls` to build TLS settings.

use std::path::{Path, PathBuf};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Why a PEM file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PemError {
    /// The file cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file holds no usable block of the wanted kind.
    #[error("{path} holds no usable PEM {kind} ({message})")]
    BadPem {
        path: PathBuf,
        kind: &'static str,
        message: String,
    },
}

/// The largest PEM file read (a CA bundle is a few hundred KiB).
const MAX_PEM: u64 = 4 << 20;

/// What a PEM file must hold.
#[derive(Debug, Clone, Copy)]
pub enum PemKind {
    /// One or more certificates (a chain, or CA certificates).
    Certificates,
    /// One private key (PKCS#8, PKCS#1 or SEC1).
    PrivateKey,
}

/// Reads a PEM file and checks that it holds what `kind` says.
pub fn read_pem(path: &Path, kind: PemKind) -> Result<Vec<u8>, PemError> {
    let bytes = super::fs::read_operator_file(path, MAX_PEM).map_err(|source| PemError::Read {
        path: path.to_owned(),
        source,
    })?;
    let bad = |kind: &'static str, message: String| PemError::BadPem {
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
