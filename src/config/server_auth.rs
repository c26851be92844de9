//! How kvsync reaches a Redis/Valkey server or a Sentinel: over TLS or
//! not (the CA the server's certificate must chain to, the client
//! certificate a server with `tls-auth-clients` asks for), and who it is
//! there: an ACL user (or the server's `default` user) and its password,
//! written in the configuration or kept in a file; and the configuration's
//! checks of them. A password file is read at every connection, so a
//! rotated file is used from the next connection on, without a restart or
//! a SIGHUP (a Kubernetes Secret mounted as a volume changes that way).
//! The password never leaves this module except as the `AUTH` it is for:
//! `Debug` and `Display` show where it comes from, never what it is.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{Config, Problems};
use crate::sys::pem::{read_pem, PemKind};

/// How kvsync reaches and logs in to one kind of server (the instance's
/// servers, or its Sentinels).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ServerAuth {
    user: String,
    password: Password,
    tls: Option<Arc<TlsFiles>>,
}

/// A TLS connection's files: the CA certificates the server's certificate
/// must chain to (for the address's name or IP), and the client
/// certificate and key (both or neither) a server with `tls-auth-clients`
/// asks for. Read at every connection, like a password file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Clone, Default, PartialEq, Eq)]
enum Password {
    #[default]
    None,
    Inline(String),
    File(PathBuf),
}

/// A password file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("password file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("password file {} is empty", path.display())]
    Empty { path: PathBuf },
}

/// What to send as `AUTH` now: `[user] password`.
pub struct Credentials {
    pub user: Option<String>,
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .finish()
    }
}

impl ServerAuth {
    /// `user` (empty: the server's `default` user) with `password` written
    /// in the configuration, or read from `password_file` (an empty path:
    /// none). A configuration check refuses both at once; here the file
    /// wins.
    pub fn new(user: &str, password: &str, password_file: &Path) -> ServerAuth {
        let password = match (password, password_file.as_os_str().is_empty()) {
            (_, false) => Password::File(password_file.to_path_buf()),
            ("", true) => Password::None,
            (p, true) => Password::Inline(p.to_string()),
        };
        ServerAuth {
            user: user.to_string(),
            password,
            tls: None,
        }
    }

    /// The same, over TLS with `tls` when given.
    pub fn with_tls(self, tls: Option<TlsFiles>) -> ServerAuth {
        let tls = tls.map(Arc::new);
        ServerAuth { tls, ..self }
    }

    /// The TLS files, when the server is reached over TLS.
    pub fn tls(&self) -> Option<&TlsFiles> {
        self.tls.as_deref()
    }

    /// What to authenticate with now, the file read here; `None` when
    /// neither a user nor a password is set (no `AUTH` at all). A user
    /// without a password authenticates with an empty one (an ACL user
    /// with `nopass` takes any).
    pub fn credentials(&self) -> Result<Option<Credentials>, AuthError> {
        let password = match &self.password {
            Password::None if self.user.is_empty() => return Ok(None),
            Password::None => String::new(),
            Password::Inline(p) => p.clone(),
            Password::File(path) => read_password(path)?,
        };
        Ok(Some(Credentials {
            user: (!self.user.is_empty()).then(|| self.user.clone()),
            password,
        }))
    }

    /// The password alone (empty when none), for handing to a server as
    /// its `masterauth`.
    pub fn secret(&self) -> Result<String, AuthError> {
        Ok(self.credentials()?.map(|c| c.password).unwrap_or_default())
    }

    /// Whether the password is written in the configuration itself.
    pub fn is_inline(&self) -> bool {
        matches!(self.password, Password::Inline(_))
    }
}

/// Who kvsync logs in as, for an error that says what to check: the user
/// and where its password comes from, never the password.
impl fmt::Display for ServerAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.user.as_str() {
            "" => write!(f, "the default user")?,
            user => write!(f, "user {user:?}")?,
        }
        match &self.password {
            Password::None => write!(f, " without a password"),
            Password::Inline(_) => write!(f, " with the password in the configuration"),
            Password::File(p) => write!(f, " with the password in {}", p.display()),
        }
    }
}

impl fmt::Debug for ServerAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let password = match &self.password {
            Password::None => "none".to_string(),
            Password::Inline(_) => "<inline, redacted>".to_string(),
            Password::File(p) => format!("file {}", p.display()),
        };
        f.debug_struct("ServerAuth")
            .field("user", &self.user)
            .field("password", &password)
            .field("tls", &self.tls)
            .finish()
    }
}

/// The longest password file read.
const MAX_PASSWORD: u64 = 64 << 10;

/// The password in `path`: its content without the line ending an editor
/// or `echo` adds.
fn read_password(path: &Path) -> Result<String, AuthError> {
    let read = |source| AuthError::Read {
        path: path.to_path_buf(),
        source,
    };
    let bytes = crate::sys::fs::read_operator_file(path, MAX_PASSWORD).map_err(read)?;
    let text =
        String::from_utf8(bytes).map_err(|_| read(std::io::Error::other("not UTF-8 text")))?;
    let password = text.strip_suffix('\n').unwrap_or(&text);
    let password = password.strip_suffix('\r').unwrap_or(password);
    if password.is_empty() {
        return Err(AuthError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(password.to_string())
}

impl Config {
    /// `[redis]`'s and `[stream]`'s passwords: written inline or kept in a
    /// file, not both; a file given must hold one now (it is read again at
    /// every connection).
    pub(super) fn check_server_auth(&self, p: &mut Problems) {
        let (r, st) = (&self.redis, &self.stream);
        let set = |f: &PathBuf| !f.as_os_str().is_empty();
        if (r.tls || st.sentinel_tls) && !set(&r.tls_ca_file) {
            p.bad(
                "redis.tls_ca_file",
                "must name the CA certificates the servers' certificates chain to when redis.tls or stream.sentinel_tls is on".into(),
            );
        }
        // The certificate is also what a replica server with
        // `tls-replication yes` gets on the seed and feed ports, TLS on
        // or not.
        if set(&r.tls_cert_file) != set(&r.tls_key_file) {
            p.bad(
                "redis.tls_cert_file",
                "and redis.tls_key_file go together: the agent's certificate for its servers and its key".into(),
            );
        }
        for (key, file, kind) in [
            ("redis.tls_ca_file", &r.tls_ca_file, PemKind::Certificates),
            (
                "redis.tls_cert_file",
                &r.tls_cert_file,
                PemKind::Certificates,
            ),
            ("redis.tls_key_file", &r.tls_key_file, PemKind::PrivateKey),
        ] {
            if let (true, Err(e)) = (set(file), read_pem(file, kind)) {
                p.bad(key, e.to_string());
            }
        }
        for (key, inline, file, auth) in [
            (
                "redis.password_file",
                &r.password,
                &r.password_file,
                r.auth(),
            ),
            (
                "stream.sentinel_password_file",
                &st.sentinel_password,
                &st.sentinel_password_file,
                self.sentinel_auth(),
            ),
        ] {
            if file.as_os_str().is_empty() {
                continue;
            }
            if !inline.is_empty() {
                p.bad(
                    key,
                    "and the inline password are both set: keep one (the file)".into(),
                );
            } else if let Err(e) = auth.credentials() {
                p.bad(key, e.to_string());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_file_is_read_at_every_asking_without_its_line_ending() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pass");
        std::fs::write(&file, "first\n").unwrap();
        let auth = ServerAuth::new("kvsync", "", &file);
        let c = auth.credentials().unwrap().unwrap();
        assert_eq!(
            (c.user.as_deref(), c.password.as_str()),
            (Some("kvsync"), "first")
        );
        std::fs::write(&file, "sec:ond@/x\r\n").unwrap();
        assert_eq!(auth.secret().unwrap(), "sec:ond@/x");
        std::fs::write(&file, "\n").unwrap();
        assert!(matches!(auth.credentials(), Err(AuthError::Empty { .. })));
        std::fs::remove_file(&file).unwrap();
        let err = auth.credentials().unwrap_err().to_string();
        assert!(
            err.contains("pass") && err.contains("No such file"),
            "{err}"
        );
    }

    #[test]
    fn nothing_set_sends_no_auth_and_a_user_alone_an_empty_password() {
        assert!(ServerAuth::default().credentials().unwrap().is_none());
        let c = ServerAuth::new("repl", "", Path::new(""))
            .credentials()
            .unwrap()
            .unwrap();
        assert_eq!((c.user.as_deref(), c.password.as_str()), (Some("repl"), ""));
        let c = ServerAuth::new("", "pw", Path::new(""))
            .credentials()
            .unwrap()
            .unwrap();
        assert_eq!((c.user, c.password.as_str()), (None, "pw"));
    }

    #[test]
    fn a_password_file_that_is_a_fifo_or_too_large_is_refused_not_waited_on() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = ServerAuth::new("", "", &fifo).credentials().unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        let big = dir.path().join("big");
        std::fs::write(&big, vec![b'x'; MAX_PASSWORD as usize + 1]).unwrap();
        let err = ServerAuth::new("", "", &big).credentials().unwrap_err();
        assert!(err.to_string().contains("more than"), "{err}");
        // A link to a regular file is followed (a Kubernetes Secret's).
        let file = dir.path().join("pass");
        std::fs::write(&file, "pw").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert_eq!(ServerAuth::new("", "", &link).secret().unwrap(), "pw");
    }

    #[test]
    fn debug_never_shows_the_password() {
        let auth = ServerAuth::new("u", "hunter2-secret", Path::new(""));
        let shown = format!("{auth} {auth:?} {:?}", auth.credentials().unwrap());
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("redacted"), "{shown}");
    }
}
