//! Bearer-token authentication of the control plane.
//!
//! Owns the accepted tokens (read from `[auth] token_file`, one per line,
//! `#` comments allowed; reloaded on SIGHUP), the server interceptor that
//! requires `authorization: Bearer <token>` on every Orchestrator and Peer
//! RPC (UNAUTHENTICATED otherwise, counted), and the client interceptor that
//! presents this agent's token to its peers. Health and reflection stay open
//! for probes. Tokens are compared in constant time.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::{Request, Status};

use crate::metrics::Metrics;

/// The accepted tokens, and where they come from.
pub struct Tokens {
    file: Option<PathBuf>,
    accepted: RwLock<Vec<String>>,
}

/// Reads a token file: one token per line, blank lines and `#` comments skipped.
pub fn read_token_file(path: &Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read token file {}: {e}", path.display()))?;
    let tokens: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect();
    if tokens.is_empty() {
        return Err(format!("token file {} holds no token", path.display()));
    }
    if let Some(bad) = tokens
        .iter()
        .find(|t| t.len() < 16 || MetadataValue::<Ascii>::try_from(format!("Bearer {t}")).is_err())
    {
        return Err(format!(
            "token file {}: a token of {} characters is too short (16 at least) or not printable ASCII",
            path.display(),
            bad.len()
        ));
    }
    Ok(tokens)
}

impl Tokens {
    /// Loads `file` (`None`: authentication off).
    pub fn load(file: Option<&Path>) -> Result<Arc<Tokens>, String> {
        let accepted = match file {
            Some(f) => read_token_file(f)?,
            None => Vec::new(),
        };
        Ok(Arc::new(Tokens {
            file: file.map(Path::to_owned),
            accepted: RwLock::new(accepted),
        }))
    }

    /// Re-reads the file; on error the previous tokens stay in force.
    pub fn reload(&self) -> Result<usize, String> {
        let Some(file) = &self.file else {
            return Ok(0);
        };
        let tokens = read_token_file(file)?;
        let n = tokens.len();
        *self.accepted.write().expect("tokens lock") = tokens;
        Ok(n)
    }

    pub fn enabled(&self) -> bool {
        self.file.is_some()
    }

    /// Whether an `authorization` header value carries an accepted token.
    pub fn check(&self, header: Option<&str>) -> bool {
        let Some(token) = header.and_then(|h| h.strip_prefix("Bearer ")) else {
            return false;
        };
        self.accepted
            .read()
            .expect("tokens lock")
            .iter()
            .fold(false, |ok, t| {
                ok | constant_time_eq::constant_time_eq(t.as_bytes(), token.as_bytes())
            })
    }

    /// The token this agent presents to its peers (the file's first).
    pub fn client(&self) -> ClientAuth {
        ClientAuth::new(self.accepted.read().expect("tokens lock").first().cloned())
    }
}

/// Requires a valid bearer token (when authentication is on).
#[derive(Clone)]
pub struct ServerAuth {
    /// The tokens this service accepts.
    pub tokens: Arc<Tokens>,
    /// The other service's tokens, when the two differ: such a token is
    /// authentic but not allowed here (PERMISSION_DENIED).
    pub other: Option<Arc<Tokens>>,
    pub metrics: Arc<Metrics>,
    /// The gRPC connections still to prove themselves: a request that
    /// passes here proves its connection.
    pub connections: Arc<crate::rpc::conn_limit::Counter>,
}

impl ServerAuth {
    /// Authentication of the Orchestrator and the Peer service: one token
    /// set for both, or separate ones that refuse each other's tokens.
    pub fn pair(
        tokens: &Arc<Tokens>,
        peer_tokens: Option<&Arc<Tokens>>,
        metrics: &Arc<Metrics>,
        connections: &Arc<crate::rpc::conn_limit::Counter>,
    ) -> (ServerAuth, ServerAuth) {
        let auth = |tokens: &Arc<Tokens>, other: Option<&Arc<Tokens>>| ServerAuth {
            tokens: tokens.clone(),
            other: other.cloned(),
            metrics: metrics.clone(),
            connections: connections.clone(),
        };
        match peer_tokens {
            Some(peer) => (auth(tokens, Some(peer)), auth(peer, Some(tokens))),
            None => (auth(tokens, None), auth(tokens, None)),
        }
    }
}

impl Interceptor for ServerAuth {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let header = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        if !self.tokens.enabled() || self.tokens.check(header) {
            if let Some(addr) = req.remote_addr() {
                self.connections.prove(addr);
            }
            return Ok(req);
        }
        self.metrics.grpc_auth_failures.inc();
        if self.other.as_ref().is_some_and(|o| o.check(header)) {
            return Err(Status::permission_denied(
                "this token is for the other service (orchestrator and peer tokens are separate)",
            ));
        }
        Err(Status::unauthenticated(if header.is_none() {
            "missing bearer token: pass --token-file (or KVSYNC_TOKEN_FILE) with a token from this agent's [auth] token_file"
        } else {
            "bearer token not accepted by this agent"
        }))
    }
}

/// Presents a bearer token on every request (nothing when `None`).
#[derive(Clone)]
pub struct ClientAuth(Option<MetadataValue<Ascii>>);

impl ClientAuth {
    pub fn new(token: Option<String>) -> ClientAuth {
        ClientAuth(token.and_then(|t| format!("Bearer {t}").parse().ok()))
    }

    /// The `authorization` header of a request, to present it again.
    pub fn of<T>(req: &Request<T>) -> ClientAuth {
        ClientAuth(req.metadata().get("authorization").cloned())
    }

    /// Whether a token is presented.
    pub fn is_some(&self) -> bool {
        self.0.is_some()
    }
}

impl Interceptor for ClientAuth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_read_checked_and_reloaded() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("tokens");
        std::fs::write(
            &f,
            "# fleet tokens\nfirst-token-0123456789\n\nsecond-token-0123456789\n",
        )
        .unwrap();
        let t = Tokens::load(Some(&f)).unwrap();
        assert!(t.check(Some("Bearer first-token-0123456789")));
        assert!(t.check(Some("Bearer second-token-0123456789")));
        assert!(
            !t.check(Some("Bearer nope"))
                && !t.check(Some("first-token-0123456789"))
                && !t.check(None)
        );
        std::fs::write(&f, "third-token-0123456789\n").unwrap();
        assert_eq!(t.reload().unwrap(), 1);
        assert!(!t.check(Some("Bearer first-token-0123456789")));
        std::fs::write(&f, "").unwrap();
        assert!(t.reload().is_err(), "an empty file is refused");
        assert!(
            t.check(Some("Bearer third-token-0123456789")),
            "the old tokens stay"
        );
        std::fs::write(&f, "short\n").unwrap();
        assert!(Tokens::load(Some(&f)).is_err());
        assert!(!Tokens::load(None).unwrap().enabled());
    }
}
