//! The `redis` handoff: seeding a replica server by restart. Stop the
//! local server, place the verified RDB as its `dir/dbfilename` atomically,
//! start it following the primary, and confirm the primary accepted a
//! partial resync from M+1 (docs/ARCHITECTURE.md, "Handoff"). A cluster
//! node is made its shard primary's replica by its `nodes.conf` and
//! joined by `crate::kv::cluster`; one that cannot get its `nodes.conf`
//! and RDB is put back and started again as it was.

use std::path::Path;
use std::time::Duration;

use tracing::info;

use crate::config::{HostPort, RedisConfig};
use crate::kv::redis::{confirm_partial, connect, info as server_info, until, RedisError};
use crate::snapshot::SnapshotInfo;
use crate::store::install;

/// Runs `argv` (with placeholders replaced) to completion within `timeout`.
async fn run(
    what: &'static str,
    argv: &[String],
    cfg: &RedisConfig,
    timeout: Duration,
) -> Result<(), RedisError> {
    let (host, port) = match cfg.primary.parse::<HostPort>() {
        Ok(primary) => (primary.host, primary.port.to_string()),
        Err(_) => (cfg.primary.clone(), String::new()),
    };
    let argv: Vec<String> = argv
        .iter()
        .map(|a| {
            a.replace("{primary_host}", &host)
                .replace("{primary_port}", &port)
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

/// Puts `rdb` in place as `dir/dbfilename` atomically: a hard link or a
/// copy under a fresh random temp name in `dir` (created with `O_EXCL`, so
/// never through a link someone planted), fsync, rename, fsync the
/// directory.
fn place(rdb: &Path, dir: &Path, dbfilename: &str) -> Result<(), RedisError> {
    let dest = dir.join(dbfilename);
    let temp = || {
        let mut b = tempfile::Builder::new();
        b.prefix(install::TEMP_PREFIX).suffix(install::TEMP_SUFFIX);
        b
    };
    let placed = temp()
        .make_in(dir, |path| std::fs::hard_link(rdb, path))
        .map(|linked| linked.into_temp_path())
        .or_else(|_| {
            let mut copy = temp().tempfile_in(dir)?;
            std::io::copy(&mut crate::sys::fs::open_read(rdb)?, &mut copy)?;
            copy.as_file().sync_all()?;
            Ok::<_, std::io::Error>(copy.into_temp_path())
        })
        .and_then(|temp| temp.persist(&dest).map_err(|e| e.error));
    if let Err(e) = placed {
        return Err(RedisError::Place(format!(
            "{} → {}: {e}",
            rdb.display(),
            dest.display()
        )));
    }
    install::sync_dir(dir).map_err(|e| RedisError::Place(e.to_string()))
}

/// Fails, before anything is stopped, unless `dir` has room for `rdb`
/// (a copy, when it is on another file system) and a `nodes.conf`.
fn room_for(rdb: &Path, dir: &Path) -> Result<(), RedisError> {
    use std::os::unix::fs::MetadataExt;
    let meta = |p: &Path| {
        std::fs::metadata(p).map_err(|e| RedisError::Place(format!("{}: {e}", p.display())))
    };
    let (file, at) = (meta(rdb)?, meta(dir)?);
    let copy = if file.dev() == at.dev() {
        0
    } else {
        file.size()
    };
    let need = copy + (1 << 20);
    let free = crate::sys::fs::free_bytes(dir)
        .map_err(|e| RedisError::Place(format!("{}: {e}", dir.display())))?;
    if free < need {
        return Err(RedisError::Place(format!(
            "{} has {free} bytes free, the RDB needs {need}: nothing was stopped; free some space",
            dir.display()
        )));
    }
    Ok(())
}

/// Why a shard primary cannot continue an RDB from M+1 itself.
#[derive(Debug, PartialEq)]
enum Cannot {
    /// The RDB is another shard's or another history's: nothing may.
    History(String),
    /// Its backlog no longer holds M+1: this agent's stream log may.
    Backlog(String),
}

/// Where a cluster node continues its RDB from, decided before it is
/// stopped: first from this agent's stream feed (its address), whenever
/// the agent's log continues the RDB into the primary's backlog
/// ([`through_log`]); else from the shard primary itself (`None`), when
/// its backlog holds M+1.
/// Refused when neither can: a node that loaded an RDB its primary cannot
/// continue is synced in full, a fork of the primary. (The backlog may
/// still move on before the node asks, which the confirmation then says.)
async fn route(
    cfg: &RedisConfig,
    snapshot: &SnapshotInfo,
    log: Option<&StreamLog>,
) -> Result<Option<std::net::SocketAddr>, RedisError> {
    let repl = server_info(&cfg.primary, &cfg.auth(), "replication").await?;
    let seed_listen = cfg.seed_listen.as_str();
    decide(&cfg.primary, &repl, snapshot, log, seed_listen).map_err(RedisError::Cluster)
}

/// [`route`]'s decision, of the primary `p`'s `INFO replication`
/// (`repl`) and this agent's `log` with its feed on `seed_listen`.
fn decide(
    p: &str,
    repl: &crate::kv::redis::Info,
    snapshot: &SnapshotInfo,
    log: Option<&StreamLog>,
    seed_listen: &str,
) -> Result<Option<std::net::SocketAddr>, String> {
    // The feed whenever it can: the source did not hold the primary's
    // backlog for this seeding, which may lose M+1 while the node loads.
    // Only at a fixed port: a node left on it by an agent that stopped
    // midway finds the agent's next run there, not whoever took the port.
    let fixed = crate::config::fixed_port(seed_listen);
    let through = log.filter(|log| fixed && through_log(repl, log.end.as_ref()));
    match (continues(p, repl, snapshot), through) {
        (Err(Cannot::History(why)), _) => Err(why),
        (_, Some(log)) => Ok(Some(log.feed.addr)),
        (Ok(()), None) => Ok(None),
        (Err(Cannot::Backlog(why)), None) => Err(match log {
            Some(_) if !fixed => format!(
                "{why}. This agent's stream log would fill the gap from a fixed [redis] seed_listen port (not {seed_listen})"
            ),
            Some(_) => format!(
                "{why}. This agent's stream log does not fill the gap either: it does not hold the RDB's offset, or it does not reach the primary's backlog"
            ),
            None => format!(
                "{why}. A stream log on this agent following the primary's agent ([stream] dir and upstream) would fill the gap"
            ),
        }),
    }
}

/// Whether the primary `p` (its `INFO replication`, `repl`) continues
/// `snapshot` from M+1: the RDB's history is the primary's (its
/// replication id, or the one it continued from, up to where it did),
/// and its backlog holds M+1. Why not, if not.
fn continues(
    p: &str,
    repl: &crate::kv::redis::Info,
    snapshot: &SnapshotInfo,
) -> Result<(), Cannot> {
    let (id, next) = (snapshot.repl_id.as_deref().unwrap_or(""), snapshot.seq + 1);
    let (replid, replid2) = (
        repl.get("master_replid").unwrap_or(""),
        repl.get("master_replid2").unwrap_or(""),
    );
    let second = repl.num("second_repl_offset");
    if !repl.holds_history(id, next) {
        return Err(Cannot::History(format!(
            "the primary {p} cannot continue this RDB (replication id {id:?} at offset {}): it runs under {replid} (before that {replid2} up to offset {second}), so the RDB is another shard's or another history's. Sync a snapshot of this shard's primary; nothing was stopped",
            snapshot.seq
        )));
    }
    match repl.backlog() {
        Some(held) if held.contains(&next) => Ok(()),
        held => Err(Cannot::Backlog(format!(
            "the primary {p}'s backlog holds offsets {}, not {next}: the node would be synced in full, a fork of the primary. Sync a newer snapshot, or grow the primary's repl-backlog-size; nothing was stopped",
            held.map_or("none (it has no backlog)".into(), |h| format!("{} to {}", h.start(), h.end()))
        ))),
    }
}

/// Whether this agent's log, continuing the RDB and ending at `end` (its
/// replication id there and its end offset), fills the gap to the
/// primary (its `INFO replication`, `repl`): it ends in the primary's
/// history where the backlog holds the next offset, so a node fed up to
/// the log's end continues from the primary.
fn through_log(repl: &crate::kv::redis::Info, end: Option<&(String, u64)>) -> bool {
    let Some((id, end)) = end else {
        return false;
    };
    let at_primary = repl.get("master_replid") == Some(id.as_str());
    at_primary && repl.backlog().is_some_and(|held| held.contains(&(end + 1)))
}

/// This agent's stream log as a cluster handoff may use it: the feed that
/// serves it, and where the log ends (its replication id there and its end
/// offset) when it continues the RDB handed off (`None` when it does not).
pub struct StreamLog {
    pub feed: crate::kv::seed::Feed,
    pub end: Option<(String, u64)>,
}

/// Seeds the local server with the verified RDB `rdb` saved at `info`:
/// stop it, place the file, start it following the primary, wait for the
/// link, and confirm the primary accepted a partial resync. A cluster
/// node whose primary's backlog no longer holds M+1 is first fed up to
/// the primary's backlog from this agent's stream `log`, when it can.
pub async fn hand_off(
    cfg: &RedisConfig,
    timeout: Duration,
    rdb: &Path,
    snapshot: &SnapshotInfo,
    log: Option<&StreamLog>,
) -> Result<String, RedisError> {
    let before = server_info(&cfg.primary, &cfg.auth(), "stats").await?;
    // In cluster mode, decide everything (or refuse) before stopping.
    let mut cluster = crate::kv::cluster::plan(cfg).await?;
    if let Some(plan) = &mut cluster {
        plan.via = route(cfg, snapshot, log).await?;
    }
    room_for(rdb, &cfg.dir)?;
    if let Some(plan) = &cluster {
        plan.still_as_planned(cfg).await?;
    }

    // Stop the local server (it must not overwrite the file on exit).
    if cfg.stop.is_empty() {
        if let Ok(mut con) = connect(&cfg.server_addr, &cfg.auth()).await {
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

    // A cluster node that cannot get its nodes.conf and its RDB is put
    // back and started again as it was.
    let placed = match &cluster {
        None => place(rdb, &cfg.dir, &cfg.dbfilename),
        Some(plan) => {
            // (what failed, whether the new nodes.conf is in place)
            let outcome = match plan.write() {
                Err(e) => Err((
                    RedisError::Cluster(format!("writing {}: {e}", plan.nodes_conf.display())),
                    false,
                )),
                Ok(()) => place(rdb, &cfg.dir, &cfg.dbfilename).map_err(|e| (e, true)),
            };
            match outcome {
                Ok(()) => Ok(()),
                Err((e, written)) => {
                    let back = match written {
                        true => plan.restore(),
                        false => Ok(()),
                    };
                    let again = match (back, plan.was_running()) {
                        (Err(e), _) => {
                            format!("not started again: its nodes.conf could not be put back: {e}")
                        }
                        (Ok(()), false) => "left stopped, as it was".to_string(),
                        (Ok(()), true) => match run("start", &cfg.start, cfg, timeout).await {
                            Ok(()) => "started again as it was".to_string(),
                            Err(e) => format!("not started again: {e}"),
                        },
                    };
                    Err(RedisError::Cluster(format!(
                        "{}; the server was {again}",
                        crate::kv::cluster::message(&e)
                    )))
                }
            }
        }
    };
    placed?;
    info!(dir = %cfg.dir.display(), dbfilename = %cfg.dbfilename, seq = snapshot.seq, "RDB in place; starting the server");
    let started = run("start", &cfg.start, cfg, timeout).await;
    let Some(plan) = cluster else {
        started?;
        return confirm_partial(cfg, timeout, &before, snapshot).await;
    };
    let changed = |e: RedisError| {
        RedisError::Cluster(format!(
            "kvsync wrote {} and placed the RDB, then: {}",
            plan.nodes_conf.display(),
            crate::kv::cluster::message(&e)
        ))
    };
    started.map_err(changed)?;
    let no_failover = plan.hold_failover(cfg, timeout).await.map_err(changed)?;
    let joined = async {
        match log.filter(|_| plan.via.is_some()) {
            None => {
                let resynced = confirm_partial(cfg, timeout, &before, snapshot).await?;
                Ok(resynced + &plan.join(cfg, timeout).await?)
            }
            // The gap first, from the feed; the primary continues after it.
            Some(log) => {
                let at = plan.fill_gap(cfg, timeout, &log.feed, snapshot).await?;
                let joined = plan.join(cfg, timeout).await?;
                confirm_partial(cfg, timeout, &before, snapshot).await?;
                Ok(format!(
                    "this agent's stream log fed the node from offset {} to {at}; then the primary's partial resync accepted from offset {} on, no full sync{joined}",
                    snapshot.seq + 1,
                    at + 1
                ))
            }
        }
    }
    .await;
    plan.give_failover_back(cfg, &no_failover, joined).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An RDB saved under `id` at offset `seq`.
    fn rdb(id: &str, seq: u64) -> SnapshotInfo {
        SnapshotInfo {
            format: crate::snapshot::Format::RedisRdb,
            size: 0,
            seq,
            checksum: 0,
            records: 0,
            created_ms: 0,
            repl_id: Some(id.into()),
        }
    }

    #[test]
    fn an_rdb_is_continued_only_from_the_primarys_history_and_backlog() {
        let repl = |text: &str| crate::kv::redis::Info::parse(&text.replace(' ', "\r\n"));
        let primary = repl("master_replid:aaa master_replid2:bbb second_repl_offset:500 repl_backlog_active:1 repl_backlog_first_byte_offset:100 repl_backlog_histlen:1000");
        assert_eq!(
            continues("p", &primary, &rdb("aaa", 99)),
            Ok(()),
            "M+1 is the backlog's first byte"
        );
        assert_eq!(
            continues("p", &primary, &rdb("aaa", 1099)),
            Ok(()),
            "M is the primary's offset"
        );
        assert_eq!(
            continues("p", &primary, &rdb("bbb", 499)),
            Ok(()),
            "before the promotion"
        );
        for (id, seq, says, history) in [
            ("ccc", 200, "another shard's", true),
            ("bbb", 500, "another shard's", true),
            (
                "aaa",
                98,
                "backlog holds offsets 100 to 1100, not 99",
                false,
            ),
            ("aaa", 1100, "not 1101", false),
        ] {
            let (e, of_history) = match continues("p", &primary, &rdb(id, seq)).unwrap_err() {
                Cannot::History(e) => (e, true),
                Cannot::Backlog(e) => (e, false),
            };
            assert!(
                e.contains(says) && e.ends_with("nothing was stopped") && of_history == history,
                "{id} {seq}: {e}"
            );
        }
        let none = repl("master_replid:aaa repl_backlog_active:0");
        assert!(
            matches!(continues("p", &none, &rdb("aaa", 0)), Err(Cannot::Backlog(e)) if e.contains("no backlog")),
            "no backlog"
        );
    }

    /// The feed whenever the log reaches the backlog, even while the
    /// backlog still holds M+1 (the source did not hold it for this
    /// seeding), and only from a fixed port; the primary itself otherwise.
    #[test]
    fn a_node_is_fed_by_the_agent_whenever_its_log_reaches_the_primary() {
        let repl = |text: &str| crate::kv::redis::Info::parse(&text.replace(' ', "\r\n"));
        let primary = repl("master_replid:aaa repl_backlog_active:1 repl_backlog_first_byte_offset:100 repl_backlog_histlen:1000");
        let rdb = |seq: u64| rdb("aaa", seq);
        let log = |end: Option<u64>| StreamLog {
            feed: crate::kv::seed::Feed {
                addr: "127.0.0.1:6400".parse().unwrap(),
                secret: String::new(),
                server_auth: "kept".into(),
            },
            end: end.map(|e| ("aaa".to_string(), e)),
        };
        let feed = Ok(Some("127.0.0.1:6400".parse().unwrap()));
        let fixed = "127.0.0.1:6400";
        let reaching = log(Some(1099));
        assert_eq!(
            decide("p", &primary, &rdb(500), Some(&reaching), fixed),
            feed,
            "M+1 still held"
        );
        assert_eq!(
            decide("p", &primary, &rdb(50), Some(&reaching), fixed),
            feed,
            "the gap"
        );
        assert_eq!(
            decide("p", &primary, &rdb(500), None, fixed),
            Ok(None),
            "no log"
        );
        let short = log(None);
        assert_eq!(
            decide("p", &primary, &rdb(500), Some(&short), fixed),
            Ok(None)
        );
        for (log, listen, says) in [
            (None, fixed, "A stream log on this agent"),
            (Some(&short), fixed, "does not fill the gap either"),
            (
                Some(&reaching),
                "127.0.0.1:0",
                "from a fixed [redis] seed_listen port",
            ),
        ] {
            let e = decide("p", &primary, &rdb(50), log, listen).unwrap_err();
            assert!(
                e.contains("backlog holds offsets 100 to 1100, not 51") && e.contains(says),
                "{e}"
            );
        }
        let other = SnapshotInfo {
            repl_id: Some("zzz".into()),
            ..rdb(500)
        };
        let e = decide("p", &primary, &other, Some(&reaching), fixed).unwrap_err();
        assert!(
            e.contains("another history's"),
            "never another history: {e}"
        );
    }

    #[test]
    fn a_log_fills_the_gap_only_up_into_the_primarys_backlog_and_history() {
        let repl = |text: &str| crate::kv::redis::Info::parse(&text.replace(' ', "\r\n"));
        let primary = repl("master_replid:aaa repl_backlog_active:1 repl_backlog_first_byte_offset:100 repl_backlog_histlen:1000");
        let end = |id: &str, end: u64| Some((id.to_string(), end));
        assert!(
            through_log(&primary, end("aaa", 99).as_ref()),
            "the log ends where the backlog begins"
        );
        assert!(
            through_log(&primary, end("aaa", 1099).as_ref()),
            "the log is at the primary's offset"
        );
        assert!(
            !through_log(&primary, end("aaa", 98).as_ref()),
            "it ends before the backlog"
        );
        assert!(
            !through_log(&primary, end("aaa", 1100).as_ref()),
            "past the primary: not its history"
        );
        assert!(
            !through_log(&primary, end("bbb", 500).as_ref()),
            "another history"
        );
        assert!(
            !through_log(&primary, None),
            "the log does not continue the RDB"
        );
        let none = repl("master_replid:aaa repl_backlog_active:0");
        assert!(!through_log(&none, end("aaa", 0).as_ref()), "no backlog");
    }

    /// Another user of the directory plants a link wherever a temp name
    /// could be, over and over, while RDBs are placed by copy (the RDB is
    /// on another file system): the link's target is never written.
    #[test]
    fn placing_an_rdb_never_writes_through_a_planted_link() {
        let Ok(shm) = tempfile::tempdir_in("/dev/shm") else {
            return; // no second file system to force the copy
        };
        let rdb = shm.path().join("received.rdb");
        std::fs::write(&rdb, b"REDIS0011 the new data").unwrap();
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("victim");
        std::fs::write(&victim, b"root's own bytes").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let fixed = dir.path().join(format!(
            "{}dump.rdb{}",
            install::TEMP_PREFIX,
            install::TEMP_SUFFIX
        ));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let planter = {
            let (stop, victim, fixed) = (stop.clone(), victim.clone(), fixed.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = std::os::unix::fs::symlink(&victim, &fixed);
                }
            })
        };
        for _ in 0..200 {
            let _ = place(&rdb, dir.path(), "dump.rdb");
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        planter.join().unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"root's own bytes");
        assert_eq!(
            std::fs::read(dir.path().join("dump.rdb")).unwrap(),
            b"REDIS0011 the new data"
        );
    }
}
