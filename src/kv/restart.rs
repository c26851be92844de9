//! The `redis` handoff: seeding a replica server by restart. Stop the
//! local server, place the verified RDB as its `dir/dbfilename` atomically,
//! start it following the primary, and confirm the primary accepted a
//! partial resync from M+1 (docs/ARCHITECTURE.md, "Handoff").

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
pub async fn hand_off(
    cfg: &RedisConfig,
    timeout: Duration,
    rdb: &Path,
    snapshot: &SnapshotInfo,
) -> Result<String, RedisError> {
    let before = server_info(&cfg.primary, &cfg.password, "stats").await?;

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
