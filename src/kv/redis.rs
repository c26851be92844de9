//! Talking to Redis/Valkey servers (docs/ARCHITECTURE.md, "Snapshot formats" and "Handoff"): the source's
//! pre-flight check (does the primary's backlog still hold M+1 for this RDB?)
//! and the replica's `redis` handoff (place the RDB, restart the server
//! following the primary, confirm a partial resync).
//!
//! Owns the server conversations (through the `redis` crate) and the
//! reading of `INFO`; the RDB format itself is `snapshot::rdb`, and when a
//! handoff runs is `handoff`'s business.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::config::RedisConfig;
use crate::snapshot::SnapshotInfo;
use crate::store::install;

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
}

pub(crate) fn server_err(addr: &str, e: impl std::fmt::Display) -> RedisError {
    RedisError::Server {
        addr: addr.to_string(),
        message: e.to_string(),
    }
}

/// A connection to `addr` (with `password` when set).
pub(crate) async fn connect(
    addr: &str,
    password: &str,
) -> Result<redis::aio::MultiplexedConnection, RedisError> {
    let url = if password.is_empty() {
        format!("redis://{addr}/")
    } else {
        format!("redis://:{password}@{addr}/")
    };
    let client = redis::Client::open(url).map_err(|e| server_err(addr, e))?;
    let connect = client.get_multiplexed_async_connection();
    tokio::time::timeout(Duration::from_secs(5), connect)
        .await
        .map_err(|_| server_err(addr, "no answer within 5s"))?
        .map_err(|e| server_err(addr, e))
}

/// `INFO <section>` of the server at `addr`.
pub async fn info(addr: &str, password: &str, section: &str) -> Result<Info, RedisError> {
    infos(addr, password, &[section]).await
}

/// `INFO` of several sections of the server at `addr`, over one
/// connection, merged.
pub async fn infos(addr: &str, password: &str, sections: &[&str]) -> Result<Info, RedisError> {
    let mut con = connect(addr, password).await?;
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

/// What the pre-flight check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preflight {
    /// Bytes the primary can still write before offset M+1 leaves its backlog.
    pub backlog_bytes_left: u64,
}

/// How long a seeding is expected to take, and how much the primary
/// writes meanwhile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Foresight {
    /// The primary's write rate, bytes per second.
    pub write_rate: f64,
    /// Moving and loading the RDB, bytes per second each.
    pub transfer_rate: u64,
    pub load_rate: u64,
    pub safety: f64,
}

impl Foresight {
    /// Seconds a seeding of `size` bytes is expected to take.
    pub fn seconds(&self, size: u64) -> f64 {
        size as f64 / self.transfer_rate.max(1) as f64 + size as f64 / self.load_rate.max(1) as f64
    }

    /// The backlog a seeding of an RDB of `size` bytes saved at `seq` needs
    /// when the primary is at `master`: what was written since the save,
    /// plus what the primary writes during the seeding, times the safety
    /// factor.
    pub fn backlog_needed(&self, master: u64, seq: u64, size: u64) -> u64 {
        let ahead = self.write_rate * self.seconds(size) * self.safety;
        master.saturating_sub(seq) + ahead.ceil() as u64
    }
}

/// Decides from the primary's `INFO replication` whether a replica loading
/// an RDB saved at (`repl_id`, `seq`) can continue with a partial resync.
pub fn check_backlog(repl: &Info, repl_id: &str, seq: u64) -> Result<Preflight, RedisError> {
    let next = seq + 1;
    let current = repl.get("master_replid").unwrap_or("");
    let second = repl.get("master_replid2").unwrap_or("");
    let same_history =
        current == repl_id || (second == repl_id && next <= repl.num("second_repl_offset"));
    if !same_history {
        return Err(RedisError::Precondition(format!(
            "the primary's replication id is {current}, the RDB was saved under {repl_id}: the primary restarted or failed over since; save a fresh RDB on the primary"
        )));
    }
    if repl.num("repl_backlog_active") == 0 {
        return Err(RedisError::Precondition(
            "the primary has no replication backlog: a replica could only full-sync; attach a replica once (or set repl-backlog-size) and save a fresh RDB".into(),
        ));
    }
    let (first, histlen) = (
        repl.num("repl_backlog_first_byte_offset"),
        repl.num("repl_backlog_histlen"),
    );
    let master = repl.num("master_repl_offset");
    let size = repl.num("repl_backlog_size");
    if next < first {
        return Err(RedisError::Precondition(format!(
            "the primary's backlog no longer holds offset {next} (it starts at {first}): {} bytes were written since the save and repl-backlog-size is {size}; save a fresh RDB, or grow repl-backlog-size",
            master.saturating_sub(seq)
        )));
    }
    if next > first + histlen {
        return Err(RedisError::Precondition(format!(
            "the RDB's offset {seq} is ahead of the primary ({master}): it was not saved by this primary"
        )));
    }
    Ok(Preflight {
        backlog_bytes_left: size.saturating_sub(master - seq),
    })
}

/// What the backlog guard measured on the local primary.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sizing {
    /// M+1 is still in the backlog, with this much slack.
    pub checked: Preflight,
    /// The backlog the seeding needs, and the one the primary has.
    pub needed: u64,
    pub size: u64,
    pub foresight: Foresight,
}

impl Sizing {
    /// Why the backlog is too small, with the figures behind it.
    pub fn shortfall(&self, rdb_size: u64) -> String {
        let f = &self.foresight;
        format!(
            "the primary writes {:.0} bytes/s; seeding this {rdb_size}-byte RDB is expected to take {:.1} s (transfer at {} bytes/s, load at {} bytes/s), so with a safety factor of {} its backlog must hold {} bytes, and repl-backlog-size is {}",
            f.write_rate,
            f.seconds(rdb_size),
            f.transfer_rate,
            f.load_rate,
            f.safety,
            self.needed,
            self.size
        )
    }
}

/// The source's pre-flight measurement of its local primary: M+1 is still
/// in the backlog (or an error says why not), and the backlog a seeding
/// needs to still hold it when the replica asks, at the write rate measured
/// over `rate_window`. `measured` are the transfer and load rates this
/// agent last saw (the rate it served a session at, and the RDB's size over
/// a replica's reported handoff time), where it has them; the configured
/// expectations stand in otherwise. Whether a shortfall is refused or the
/// backlog grown is the guard's business (`backlog`).
pub async fn measure(
    cfg: &RedisConfig,
    snapshot: &SnapshotInfo,
    measured: (Option<u64>, Option<u64>),
) -> Result<Sizing, RedisError> {
    let repl_id = snapshot.repl_id.as_deref().unwrap_or("");
    let (addr, password) = (&cfg.primary_addr, &cfg.password);
    let first = info(addr, password, "replication").await?;
    let mut repl = first.clone();
    let mut checked = check_backlog(&first, repl_id, snapshot.seq)?;
    if !cfg.rate_window.is_zero() {
        tokio::time::sleep(cfg.rate_window).await;
        repl = info(addr, password, "replication").await?;
        checked = check_backlog(&repl, repl_id, snapshot.seq)?;
    }
    let master = repl.num("master_repl_offset");
    let written = master.saturating_sub(first.num("master_repl_offset"));
    let foresight = Foresight {
        write_rate: written as f64 / cfg.rate_window.as_secs_f64().max(1e-3),
        transfer_rate: measured.0.unwrap_or(cfg.expected_transfer_rate.as_u64()),
        load_rate: measured.1.unwrap_or(cfg.expected_load_rate.as_u64()),
        safety: cfg.backlog_safety,
    };
    Ok(Sizing {
        checked,
        needed: foresight.backlog_needed(master, snapshot.seq, snapshot.size),
        size: repl.num("repl_backlog_size"),
        foresight,
    })
}

/// The server's `repl-backlog-size`.
pub async fn backlog_size(addr: &str, password: &str) -> Result<u64, RedisError> {
    let mut con = connect(addr, password).await?;
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
pub async fn set_backlog_size(addr: &str, password: &str, bytes: u64) -> Result<(), RedisError> {
    let mut con = connect(addr, password).await?;
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

/// Runs `argv` (with placeholders replaced) to completion within `timeout`.
async fn run(
    what: &'static str,
    argv: &[String],
    cfg: &RedisConfig,
    timeout: Duration,
) -> Result<(), RedisError> {
    let (host, port) = cfg.primary.rsplit_once(':').unwrap_or((&cfg.primary, ""));
    let argv: Vec<String> = argv
        .iter()
        .map(|a| {
            a.replace("{primary_host}", host)
                .replace("{primary_port}", port)
                .replace("{dir}", &cfg.dir.display().to_string())
                .replace("{dbfilename}", &cfg.dbfilename)
        })
        .collect();
    let command = argv.join(" ");
    let err = |message: String| RedisError::Command {
        what,
        command: command.clone(),
        message,
    };
    let child = tokio::process::Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(timeout, child)
        .await
        .map_err(|_| err(format!("did not finish within {timeout:?}")))?
        .map_err(|e| err(e.to_string()))?;
    if !out.status.success() {
        return Err(err(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
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

/// Puts `rdb` in place as `dir/dbfilename` atomically (hard link or copy to
/// a temp name in `dir`, fsync, rename, fsync the directory).
fn place(rdb: &Path, dir: &Path, dbfilename: &str) -> Result<(), RedisError> {
    let dest = dir.join(dbfilename);
    let temp = dir.join(format!(
        "{}{dbfilename}{}",
        install::TEMP_PREFIX,
        install::TEMP_SUFFIX
    ));
    let _ = std::fs::remove_file(&temp);
    let placed = std::fs::hard_link(rdb, &temp)
        .or_else(|_| std::fs::copy(rdb, &temp).map(drop))
        .and_then(|_| std::fs::File::open(&temp)?.sync_all())
        .and_then(|_| std::fs::rename(&temp, &dest));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&temp);
        return Err(RedisError::Place(format!(
            "{} → {}: {e}",
            rdb.display(),
            dest.display()
        )));
    }
    install::sync_dir(dir).map_err(|e| RedisError::Place(e.to_string()))
}

/// Seeds the local server with the verified RDB `rdb` saved at `info`:
/// stop it, place the file, start it following the primary, wait for the
/// link, and confirm the primary accepted a partial resync.
pub async fn seed(
    cfg: &RedisConfig,
    timeout: Duration,
    rdb: &Path,
    snapshot: &SnapshotInfo,
) -> Result<String, RedisError> {
    let before = info(&cfg.primary, &cfg.password, "stats").await?;

    // Stop the local server (it must not overwrite the file on exit).
    if cfg.stop.is_empty() {
        if let Ok(mut con) = connect(&cfg.server_addr, &cfg.password).await {
            let _: Result<(), _> = redis::cmd("SHUTDOWN")
                .arg("NOSAVE")
                .query_async(&mut con)
                .await;
        }
    } else {
        run("stop", &cfg.stop, cfg, timeout).await?;
    }
    let addr = cfg.server_addr.clone();
    until("the local server to stop", timeout, || {
        let addr = addr.clone();
        async move {
            tokio::net::TcpStream::connect(&addr)
                .await
                .is_err()
                .then_some(())
        }
    })
    .await?;

    place(rdb, &cfg.dir, &cfg.dbfilename)?;
    info!(dir = %cfg.dir.display(), dbfilename = %cfg.dbfilename, seq = snapshot.seq, "RDB in place; starting the server");
    run("start", &cfg.start, cfg, timeout).await?;

    confirm_partial(cfg, timeout, &before, snapshot).await
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
    let (server, password) = (cfg.server_addr.clone(), cfg.password.clone());
    let primary_port = cfg
        .primary
        .rsplit_once(':')
        .map_or("", |(_, p)| p)
        .to_string();
    until("master_link_status:up on the local server", timeout, || {
        let (server, password, port) = (server.clone(), password.clone(), primary_port.clone());
        async move {
            let repl = info(&server, &password, "replication").await.ok()?;
            (repl.get("master_link_status") == Some("up")
                && repl.get("master_port") == Some(port.as_str()))
            .then_some(())
        }
    })
    .await?;
    let after = info(&cfg.primary, &cfg.password, "stats").await?;
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
    fn the_backlog_needed_grows_with_the_write_rate_and_the_seeding_time() {
        let quiet = Foresight {
            write_rate: 0.0,
            transfer_rate: 100 << 20,
            load_rate: 100 << 20,
            safety: 2.0,
        };
        // Only what was written since the save.
        assert_eq!(quiet.backlog_needed(1_500, 1_000, 1 << 30), 500);
        assert!((quiet.seconds(1 << 30) - 20.48).abs() < 0.01);
        // 1 MB/s for 20.48 s, twice over.
        let busy = Foresight {
            write_rate: 1e6,
            ..quiet
        };
        assert_eq!(busy.backlog_needed(1_500, 1_000, 1 << 30), 500 + 40_960_000);
    }

    fn repl(first: u64, histlen: u64, master: u64) -> Info {
        Info::parse(&format!(
            "# Replication\r\nrole:master\r\nmaster_replid:aaaa\r\nmaster_replid2:bbbb\r\nsecond_repl_offset:100\r\nmaster_repl_offset:{master}\r\nrepl_backlog_active:1\r\nrepl_backlog_size:1000\r\nrepl_backlog_first_byte_offset:{first}\r\nrepl_backlog_histlen:{histlen}\r\n"
        ))
    }

    #[test]
    fn backlog_holding_the_next_offset_passes_and_reports_slack() {
        let p = check_backlog(&repl(1, 500, 500), "aaaa", 300).unwrap();
        assert_eq!(p.backlog_bytes_left, 800);
        // The previous id still works up to second_repl_offset.
        assert!(check_backlog(&repl(1, 500, 500), "bbbb", 50).is_ok());
        assert!(check_backlog(&repl(1, 500, 500), "bbbb", 200).is_err());
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

    #[test]
    fn refusals_say_what_to_do() {
        let e = check_backlog(&repl(2000, 1000, 2999), "aaaa", 1500).unwrap_err();
        assert!(e.to_string().contains("grow repl-backlog-size"), "{e}");
        let e = check_backlog(&repl(1, 500, 500), "cccc", 300).unwrap_err();
        assert!(e.to_string().contains("save a fresh RDB"), "{e}");
        let e = check_backlog(&repl(1, 500, 500), "aaaa", 900).unwrap_err();
        assert!(e.to_string().contains("ahead of the primary"), "{e}");
        let mut no_backlog = repl(0, 0, 0);
        no_backlog
            .0
            .insert("repl_backlog_active".into(), "0".into());
        assert!(check_backlog(&no_backlog, "aaaa", 0)
            .unwrap_err()
            .to_string()
            .contains("no replication backlog"));
    }
}
