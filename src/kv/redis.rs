//! The Redis/Valkey client every KV-side module talks through: connecting
//! (with `AUTH`), reading `INFO` into [`Info`], getting and setting
//! `repl-backlog-size`, waiting for a server's state, and confirming from a
//! primary's counters that a replica continued with a partial resync.
//! [`RedisError`] is every such conversation's failure. What is asked, and
//! when, is the caller's: the source's pre-flight (`preflight`), the
//! handoffs (`restart`, `seed`), health and checks.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::config::{HostPort, RedisConfig, ServerAuth, TlsFiles};
use crate::snapshot::SnapshotInfo;
use crate::sys::pem::{read_pem, PemKind};

/// A conversation with a server failed.
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    /// The server could not be reached or answered with an error.
    #[error("redis at {addr}: {message}")]
    Server { addr: String, message: String },
    /// The primary cannot continue replication from this RDB.
    #[error("{0}")]
    Precondition(String),
    /// Placing the RDB failed.
    #[error("placing the RDB: {0}")]
    Place(String),
    /// The start or stop command failed.
    #[error("{what} command {command:?}: {message}")]
    Command {
        what: &'static str,
        command: String,
        message: String,
    },
    /// The replica came up with a full resync instead of a partial one.
    #[error("the primary answered with a FULL resync (sync_full {full_before} → {full_after}): the replica did not continue from M = {seq}; check that the backlog still held offset {next} and that the server started with replicaof set before loading")]
    FullResync {
        seq: u64,
        next: u64,
        full_before: u64,
        full_after: u64,
    },
    /// The `redis-replicate` seed failed.
    #[error("redis-replicate seed: {0}")]
    Seed(String),
    /// The cluster handoff was refused before anything changed, or a
    /// step of it failed.
    #[error("cluster: {0}")]
    Cluster(String),
    /// A wait ran out of time.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: String, after: Duration },
}

/// `INFO` output as key → value.
#[derive(Debug, Default, Clone)]
pub struct Info(HashMap<String, String>);

impl Info {
    pub fn parse(text: &str) -> Info {
        Info(
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .filter_map(|l| l.trim_end().split_once(':'))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    pub fn num(&self, key: &str) -> u64 {
        self.get(key).and_then(|v| v.parse().ok()).unwrap_or(0)
    }

    /// Of a primary's `INFO replication`: whether offset `next` under the
    /// replication id `id` is in its history (its id, or the one it
    /// continued from, up to where it did).
    pub fn holds_history(&self, id: &str, next: u64) -> bool {
        self.get("master_replid") == Some(id)
            || (self.get("master_replid2") == Some(id) && next <= self.num("second_repl_offset"))
    }

    /// Of a primary's `INFO replication`: the offsets its backlog holds
    /// (a `PSYNC` from any of them continues), `None` without a backlog.
    pub fn backlog(&self) -> Option<std::ops::RangeInclusive<u64>> {
        let first = self.num("repl_backlog_first_byte_offset");
        let last = first + self.num("repl_backlog_histlen");
        (self.get("repl_backlog_active") == Some("1")).then_some(first..=last)
    }
}

/// A conversation's failure; what the server said is the server's text,
/// its control characters escaped (a reply with a line break forges no
/// log line).
pub(crate) fn server_err(addr: &str, e: impl std::fmt::Display) -> RedisError {
    RedisError::Server {
        addr: addr.to_string(),
        message: crate::peer_text::escape_controls(&e.to_string()).into_owned(),
    }
}

/// A client of the server (or Sentinel) at `addr`, authenticated as
/// `auth` says (the password file read now).
pub(crate) fn client(addr: &str, auth: &ServerAuth) -> Result<redis::Client, RedisError> {
    use redis::IntoConnectionInfo;
    let scheme = match auth.tls() {
        Some(_) => "rediss",
        None => "redis",
    };
    let info = format!("{scheme}://{addr}/")
        .into_connection_info()
        .map_err(|e| server_err(addr, e))?;
    let mut settings = info.redis_settings().clone();
    if let Some(c) = auth.credentials().map_err(|e| server_err(addr, e))? {
        if let Some(user) = &c.user {
            settings = settings.set_username(user);
        }
        settings = settings.set_password(&c.password);
    }
    let info = info.set_redis_settings(settings);
    match auth.tls() {
        None => redis::Client::open(info),
        Some(tls) => redis::Client::build_with_tls(info, certificates(addr, tls)?),
    }
    .map_err(|e| server_err(addr, e))
}

/// The TLS files of a connection to `addr`, read and checked now.
fn certificates(addr: &str, tls: &TlsFiles) -> Result<redis::TlsCertificates, RedisError> {
    let read = |path: &std::path::Path, kind| {
        read_pem(path, kind).map_err(|e| server_err(addr, format!("[redis] TLS: {e}")))
    };
    let client_tls = match tls.cert.as_os_str().is_empty() {
        true => None,
        false => Some(redis::ClientTlsConfig {
            client_cert: read(&tls.cert, PemKind::Certificates)?,
            client_key: read(&tls.key, PemKind::PrivateKey)?,
        }),
    };
    Ok(redis::TlsCertificates {
        client_tls,
        root_cert: Some(read(&tls.ca, PemKind::Certificates)?),
    })
}

/// A connection to `addr`, authenticated as `auth` says.
pub(crate) async fn connect(
    addr: &str,
    auth: &ServerAuth,
) -> Result<redis::aio::MultiplexedConnection, RedisError> {
    let client = client(addr, auth)?;
    let connect = client.get_multiplexed_async_connection();
    tokio::time::timeout(Duration::from_secs(5), connect)
        .await
        .map_err(|_| server_err(addr, "no answer within 5s"))?
        .map_err(|e| refused(addr, auth, e))
}

/// A failed connection's error; one the server refused to log in says
/// who kvsync tried to be, so the operator knows what to check.
pub(crate) fn refused(addr: &str, auth: &ServerAuth, e: redis::RedisError) -> RedisError {
    match e.kind() {
        redis::ErrorKind::AuthenticationFailed => {
            server_err(addr, format!("{e} (logging in as {auth})"))
        }
        _ => server_err(addr, e),
    }
}

/// `INFO <section>` of the server at `addr`.
pub async fn info(addr: &str, auth: &ServerAuth, section: &str) -> Result<Info, RedisError> {
    infos(addr, auth, &[section]).await
}

/// `INFO` of several sections of the server at `addr`, over one
/// connection, merged.
pub async fn infos(addr: &str, auth: &ServerAuth, sections: &[&str]) -> Result<Info, RedisError> {
    let mut con = connect(addr, auth).await?;
    let mut text = String::new();
    for section in sections {
        let part: String = redis::cmd("INFO")
            .arg(*section)
            .query_async(&mut con)
            .await
            .map_err(|e| server_err(addr, e))?;
        text.push_str(&part);
    }
    Ok(Info::parse(&text))
}

/// The server's `repl-backlog-size`.
pub async fn backlog_size(addr: &str, auth: &ServerAuth) -> Result<u64, RedisError> {
    let mut con = connect(addr, auth).await?;
    let pair: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("repl-backlog-size")
        .query_async(&mut con)
        .await
        .map_err(|e| server_err(addr, e))?;
    pair.get(1).and_then(|v| v.parse().ok()).ok_or_else(|| {
        server_err(
            addr,
            format!("CONFIG GET repl-backlog-size answered {pair:?}"),
        )
    })
}

/// Sets the server's `repl-backlog-size` to `bytes`.
pub async fn set_backlog_size(addr: &str, auth: &ServerAuth, bytes: u64) -> Result<(), RedisError> {
    let mut con = connect(addr, auth).await?;
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("repl-backlog-size")
        .arg(bytes)
        .query_async::<()>(&mut con)
        .await
        .map_err(|e| server_err(addr, e))
}

/// Whether the server described by `INFO server` keeps its backlog's
/// history when `repl-backlog-size` changes: Redis 7.0 and later (its
/// backlog shares the replication buffer), and every Valkey (which reports
/// a `redis_version` of 7.2). Older servers free the backlog on a resize.
pub fn resize_keeps_history(server: &Info) -> bool {
    let version = server.get("redis_version").unwrap_or("");
    let major: u64 = version
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    major >= 7 || server.get("valkey_version").is_some()
}

/// Polls `check` every 20 ms until it yields a value or `timeout` passes.
pub(crate) async fn until<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> F,
) -> Result<T, RedisError> {
    let end = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if Instant::now() >= end {
            return Err(RedisError::Timeout {
                what: what.to_string(),
                after: timeout,
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the local server's link to `cfg.primary` is up, then
/// confirms from the primary's counters (`before` = its `INFO stats` when
/// the handoff began) that it continued with a partial resync.
pub(crate) async fn confirm_partial(
    cfg: &RedisConfig,
    timeout: Duration,
    before: &Info,
    snapshot: &SnapshotInfo,
) -> Result<String, RedisError> {
    let (server, auth) = (cfg.server_addr.clone(), cfg.auth());
    let primary_port = cfg
        .primary
        .parse::<HostPort>()
        .map_or(String::new(), |a| a.port.to_string());
    until("master_link_status:up on the local server", timeout, || {
        let (server, auth, port) = (server.clone(), auth.clone(), primary_port.clone());
        async move {
            let repl = info(&server, &auth, "replication").await.ok()?;
            (repl.get("master_link_status") == Some("up")
                && repl.get("master_port") == Some(port.as_str()))
            .then_some(())
        }
    })
    .await?;
    let after = info(&cfg.primary, &cfg.auth(), "stats").await?;
    let (full_before, full_after) = (before.num("sync_full"), after.num("sync_full"));
    let (partial_before, partial_after) =
        (before.num("sync_partial_ok"), after.num("sync_partial_ok"));
    if full_after > full_before || partial_after <= partial_before {
        warn!(
            full_before,
            full_after, partial_before, partial_after, "redis handoff: not a partial resync"
        );
        return Err(RedisError::FullResync {
            seq: snapshot.seq,
            next: snapshot.seq + 1,
            full_before,
            full_after,
        });
    }
    Ok(format!(
        "redis: partial resync accepted (PSYNC {} {}), master_link_status:up",
        snapshot.repl_id.as_deref().unwrap_or("?"),
        snapshot.seq + 1
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_error_with_a_line_break_stays_on_one_line() {
        let said = server_err(
            "127.0.0.1:1",
            "ERR x\n2026-01-01T00:00:00Z ERROR forged \x1b[2J",
        );
        let said = said.to_string();
        assert!(!said.contains('\n') && !said.contains('\x1b'), "{said}");
    }

    #[test]
    fn only_servers_that_keep_the_backlog_on_a_resize_may_be_grown() {
        let server = |v: &str| Info::parse(&format!("# Server\r\n{v}\r\n"));
        assert!(resize_keeps_history(&server("redis_version:7.0.15")));
        assert!(resize_keeps_history(&server(
            "redis_version:7.2.4\r\nvalkey_version:8.0.1"
        )));
        assert!(!resize_keeps_history(&server("redis_version:6.2.14")));
        assert!(!resize_keeps_history(&server("")));
    }
}
