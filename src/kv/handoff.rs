//! Handoff of an installed snapshot to the local KV (docs/ARCHITECTURE.md, "Handoff").
//!
//! Always writes the atomic `<snapshot>.replmeta` record first; then, per
//! `[handoff] mode`, sends a templated line to the KV's admin address and
//! requires `+OK`, runs a program with `KVSYNC_*` in its environment and
//! requires exit status 0, or seeds a Redis/Valkey server and requires a
//! partial resync (`crate::kv::redis`). Every step has the configured deadline. A failed
//! handoff leaves the installed snapshot in place; the caller reports it.
//! Values reach the KV as data: the record escapes control characters, a
//! command line holding one is refused, and programs get values only in
//! their environment (no shell).

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::config::{HandoffConfig, HandoffMode, RedisConfig};
use crate::kv::payload::Payload;
use crate::peer_text::{escape_controls, has_control};
use crate::snapshot::SnapshotInfo;
use crate::store::install::{self, InstallError};

/// What the KV receives.
#[derive(Debug, Clone)]
pub struct HandoffRecord {
    /// Installed snapshot.
    pub path: PathBuf,
    pub info: SnapshotInfo,
    /// The source agent (its node id and address).
    pub source: String,
}

impl HandoffRecord {
    /// Path of the `.replmeta` record next to the snapshot.
    pub fn replmeta_path(&self) -> PathBuf {
        let mut p = self.path.clone().into_os_string();
        p.push(".replmeta");
        PathBuf::from(p)
    }

    /// The record's text: `REPLMETA <M>` first, then `key value` lines,
    /// one per line whatever the values hold (control characters escaped).
    pub fn render(&self) -> String {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        format!(
            "REPLMETA {}\nsnapshot {}\nsource {}\nformat {}\nsize {}\nchecksum {:#x}\ntime_unix_ms {}\n",
            self.info.seq,
            escape_controls(&self.path.display().to_string()),
            escape_controls(&self.source),
            self.info.format,
            self.info.size,
            self.info.checksum,
            now_ms
        ) + &self
            .info
            .repl_id
            .as_ref()
            .map(|id| format!("replid {}\n", escape_controls(id)))
            .unwrap_or_default()
    }
}

/// Why the KV did not take the snapshot.
#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    /// The `.replmeta` record could not be written.
    #[error("cannot write the handoff record: {0}")]
    Record(#[from] InstallError),
    /// The KV admin address did not answer in time or refused the connection.
    #[error("KV admin address {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    /// The KV answered something other than `+OK`.
    #[error("KV at {addr} refused the handoff: {reply:?}")]
    Refused { addr: String, reply: String },
    /// The handoff program failed.
    #[error("handoff program {program:?} {status}")]
    Program { program: String, status: String },
    /// The Redis/Valkey server did not continue from the snapshot.
    #[error(transparent)]
    Redis(#[from] crate::kv::redis::RedisError),
    /// The command line would carry a control character; nothing was sent.
    #[error("refusing to send a command line with control characters: {0}")]
    Unsafe(String),
    /// No answer within the deadline.
    #[error("handoff timed out after {0:?}")]
    Timeout(Duration),
    #[error("mode \"redis-stream\" needs the instance's stream feed, which is not running ([stream] dir)")]
    NoFeed,
}

/// Writes the record, then hands off per `config` (with this agent's
/// stream `log`, when it has one). Returns a short description of what
/// was done. A `redis-replicate` or `redis-stream`
/// seeding that began while the snapshot arrived (`early`) is finished;
/// without one the installed file is served.
pub async fn hand_off(
    config: &HandoffConfig,
    redis: &RedisConfig,
    record: &HandoffRecord,
    log: Option<&crate::kv::restart::StreamLog>,
    early: Option<crate::kv::seed::Early>,
) -> Result<String, HandoffError> {
    install::write_atomic(&record.replmeta_path(), record.render().as_bytes())?;
    let deadline = config.timeout;
    let work = async {
        match config.mode {
            HandoffMode::File => Ok(format!("wrote {}", record.replmeta_path().display())),
            HandoffMode::Command => send_command(config, record).await,
            HandoffMode::Exec => run_program(config, record).await,
            HandoffMode::Redis => {
                Ok(
                    crate::kv::restart::hand_off(redis, deadline, &record.path, &record.info, log)
                        .await?,
                )
            }
            HandoffMode::RedisReplicate => Ok(match early {
                Some(early) => early.finish(&record.info).await?,
                None => {
                    let rdb = Payload::File(record.path.clone());
                    let dir = record.path.parent().unwrap_or(Path::new("."));
                    crate::kv::seed::replicate(redis, deadline, rdb, &record.info, dir).await?
                }
            }),
            HandoffMode::RedisStream => Ok(match early {
                Some(early) => early.finish(&record.info).await?,
                None => {
                    let feed = log.map(|l| &l.feed).ok_or(HandoffError::NoFeed)?;
                    crate::kv::seed::attach(redis, deadline, feed, &record.info, None).await?
                }
            }),
        }
    };
    tokio::time::timeout(deadline, work)
        .await
        .map_err(|_| HandoffError::Timeout(deadline))?
}

/// Expands `{seq}`, `{path}`, `{source}` in a template into one line; a
/// value that would break the line (a control character) is refused.
pub fn expand(template: &str, record: &HandoffRecord) -> Result<String, HandoffError> {
    let line = template
        .replace("{seq}", &record.info.seq.to_string())
        .replace("{path}", &record.path.display().to_string())
        .replace("{source}", &record.source);
    if has_control(&line) {
        return Err(HandoffError::Unsafe(escape_controls(&line).into_owned()));
    }
    Ok(line)
}

async fn send_command(
    config: &HandoffConfig,
    record: &HandoffRecord,
) -> Result<String, HandoffError> {
    let addr = config.command_addr.clone();
    let connect = |source| HandoffError::Connect {
        addr: addr.clone(),
        source,
    };
    let mut stream = tokio::net::TcpStream::connect(&addr)
        .await
        .map_err(connect)?;
    let line = expand(&config.command_template, record)?;
    stream
        .write_all(format!("{line}\r\n").as_bytes())
        .await
        .map_err(connect)?;
    let mut reply = String::new();
    BufReader::new(&mut stream)
        .read_line(&mut reply)
        .await
        .map_err(connect)?;
    let reply = reply.trim_end().to_string();
    if reply == "+OK" {
        Ok(format!("{addr} accepted {line:?}"))
    } else {
        Err(HandoffError::Refused { addr, reply })
    }
}

async fn run_program(
    config: &HandoffConfig,
    record: &HandoffRecord,
) -> Result<String, HandoffError> {
    let program = config.exec[0].clone();
    let fail = |status: String| HandoffError::Program {
        program: program.clone(),
        status,
    };
    let output = tokio::process::Command::new(&program)
        .args(&config.exec[1..])
        .env("KVSYNC_SEQ", record.info.seq.to_string())
        .env("KVSYNC_SNAPSHOT", &record.path)
        .env("KVSYNC_SOURCE", &record.source)
        .env("KVSYNC_FORMAT", record.info.format.as_str())
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| fail(format!("could not start: {e}")))?;
    if output.status.success() {
        Ok(format!("{program} exited 0"))
    } else {
        let stderr = String::from_utf8_lossy(&output.stderr);
        Err(fail(format!("{}: {}", output.status, stderr.trim())))
    }
}

/// Reads the sequence number back from a `.replmeta` record.
pub fn read_replmeta_seq(path: &Path) -> Option<u64> {
    let text = String::from_utf8(crate::sys::fs::read_regular(path, 4096).ok()?).ok()?;
    text.lines().next()?.strip_prefix("REPLMETA ")?.parse().ok()
}
