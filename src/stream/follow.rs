//! Following the local primary as one of its replicas, into the log: the
//! replica's side of the replication protocol (`AUTH`, `REPLCONF capa
//! psync2`, `PSYNC <id> <offset>`), the stream appended record by record
//! as it arrives, and `REPLCONF ACK` of what the log holds.
//!
//! Where it starts: the log's end when it holds a stream; else the oldest
//! offered snapshot's (id, M), so every snapshot offered continues into the
//! log; else `PSYNC ? -1`. The primary answers `+CONTINUE` (from its
//! backlog: no fork) or `+FULLRESYNC <id> <offset>` with an RDB, as it
//! would for any replica; that RDB becomes an offered snapshot
//! (`stream-<offset>.rdb` in `snapshot_dir`, the one before it removed) and
//! the log starts over at its offset. A `+CONTINUE <new id>` after the
//! primary's restart or promotion continues the log under the new id.
//! When a reader needs a snapshot that continues into the log and none
//! does, one is taken from the primary on a link of its own
//! ([`snapshots_on_demand`]).
//!
//! Acknowledgement, every second as a replica's, and at once when the
//! primary asks (`REPLCONF GETACK` in the stream, which `WAIT` sends) or,
//! with `ack = "replicas"`, when the servers below acknowledge more:
//! with `ack = "log"` the primary is told the log's end, so `WAIT` counts
//! the agent once the bytes are in its log; with `ack = "replicas"` the
//! lowest offset the servers fed from the log acknowledged (none: no
//! acknowledgement), so `WAIT` counts it once a replica server has them.
//! Either way those acknowledgements measure the replication lag
//! ([`Lag`]). A lost link, a primary that falls silent for
//! [`PRIMARY_TIMEOUT`], a log that cannot be written or one a reader cut
//! back after damage ends the session; the next continues from the log's
//! end (the primary's backlog, or a full resync, refills what was cut).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::log::{Log, LogError};
use super::policy::{self, Backoff, LogStep, Promotion, Psync};
use super::{SharedLog, WriterState};
use crate::config::StreamAck;
use crate::config::{AuthError, HostPort, ServerAuth, TlsFiles};
use crate::kv::redis::Info;
use crate::kv::resp;
use crate::metrics::Metrics;
use crate::rpc::tls::{tcp_halves, tls_halves, KvRead, KvWrite};
use crate::store::room::{Room, RoomError};

/// The end of a `REPLCONF GETACK *` in the stream: the primary asks its
/// replicas where they stand (as `WAIT` does), and a replica answers at
/// once. The primary writes the command in capitals.
pub(crate) const GETACK: &[u8] = b"\r\n$6\r\nGETACK\r\n";
/// A primary that sends nothing (not even its pings) for this long is
/// taken as gone, as a replica's `repl-timeout` does.
pub const PRIMARY_TIMEOUT: Duration = Duration::from_secs(60);
/// The most stream bytes one record takes from the socket.
const READ_CHUNK: usize = 256 << 10;
/// Longest reply line accepted from the primary.
const MAX_LINE: usize = 512;
/// Longest `INFO replication` accepted from the primary.
const MAX_INFO: usize = 64 << 10;

/// What the follower needs to know of its instance.
#[derive(Clone)]
pub struct Follow {
    pub instance: String,
    /// The primary (`host:port`) and how to authenticate to it.
    pub primary: String,
    pub auth: ServerAuth,
    /// Where an RDB of a full resync is offered.
    pub snapshot_dir: PathBuf,
    /// `[sync] max_snapshot_bytes` and `min_free_after`: an RDB the
    /// primary announces is refused before a byte is written unless it
    /// fits.
    pub max_rdb: u64,
    pub min_free_after: u64,
    /// The (replication id, M) of the snapshots offered now.
    pub offered: super::pull::Offered,
    pub ack: StreamAck,
    pub metrics: Arc<Metrics>,
}

/// When each stretch of the stream was logged, until the servers fed from
/// the log acknowledge it: the replication lag's samples.
#[derive(Debug, Default)]
pub struct Lag {
    pending: VecDeque<(u64, Instant)>,
}

impl Lag {
    /// The most stretches awaiting acknowledgement (the oldest go first).
    const MAX: usize = 1 << 16;

    /// The stream up to `end` was logged `at`.
    pub fn logged(&mut self, end: u64, at: Instant) {
        if self.pending.len() == Lag::MAX {
            self.pending.pop_front();
        }
        self.pending.push_back((end, at));
    }

    /// The downstreams acknowledged up to `offset` by `now`: how long each
    /// stretch it completes took.
    pub fn applied(&mut self, offset: u64, now: Instant) -> Vec<Duration> {
        let mut out = Vec::new();
        while let Some(&(end, at)) = self.pending.front() {
            if end > offset {
                break;
            }
            out.push(now.saturating_duration_since(at));
            self.pending.pop_front();
        }
        out
    }

    /// When the oldest stretch not yet acknowledged was logged.
    pub fn oldest(&self) -> Option<Instant> {
        self.pending.front().map(|&(_, at)| at)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FollowError {
    #[error("the primary {addr}: {source}")]
    Io {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the primary {addr} answered {answer:?} to {asked}")]
    Refused {
        addr: String,
        asked: &'static str,
        answer: String,
    },
    #[error("the primary {0} sent nothing for {PRIMARY_TIMEOUT:?}")]
    Silent(String),
    #[error("the RDB of a full resync: {0}")]
    Rdb(std::io::Error),
    #[error("the primary {addr} announced an RDB that is not taken: {source}")]
    RdbRefused {
        addr: String,
        #[source]
        source: RoomError,
    },
    #[error(transparent)]
    Log(#[from] LogError),
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error("the primary {addr} refused the login ({who}): {answer:?}")]
    LoginRefused {
        addr: String,
        who: String,
        answer: String,
    },
    #[error("TLS to the primary {addr}: {why} (check [redis] tls_ca_file, and that the server's certificate names the address the agent uses)")]
    Tls { addr: String, why: String },
    /// A range the primary's backlog does not hold (or may not by the
    /// time it is asked): not asked, never a full resync.
    #[error("the primary {addr} does not hold the range: {why}")]
    NotInBacklog { addr: String, why: String },
}

/// Follows the primary until `stop`, reconnecting after every failure
/// ([`Backoff`]: 100 ms, doubling to 5 s while sessions fail before any
/// stream).
pub async fn run(follow: Follow, log: SharedLog, stop: CancellationToken) {
    let mut backoff = Backoff::default();
    loop {
        let before = log.position();
        let result = tokio::select! {
            _ = stop.cancelled() => return,
            r = session(&follow, &log) => r,
        };
        if let Err(e) = result {
            follow
                .metrics
                .stream_reconnects
                .with_label_values(&[&follow.instance, "primary"])
                .inc();
            if matches!(e, FollowError::Log(LogError::Io { .. })) {
                follow
                    .metrics
                    .stream_write_errors
                    .with_label_values(&[&follow.instance])
                    .inc();
            }
            warn!(instance = %follow.instance, error = %e, "following the primary into the stream log stopped; it reconnects");
            log.set_state(WriterState::Reconnecting {
                reason: e.to_string(),
            });
        }
        let pause = backoff.failed(log.position() != before);
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        backoff.paused();
    }
}

/// Where to ask the primary to continue from: `(id, offset)` of the
/// replica's state, or `None` for a full resync.
fn start_point(follow: &Follow, log: &SharedLog) -> Option<(String, u64)> {
    log.position()
        .or_else(|| (follow.offered)().into_iter().min_by_key(|(_, m)| *m))
}

/// The primary's side of the link, over TCP or TLS.
type LinkRead = BufReader<KvRead>;
type LinkWrite = KvWrite;

/// A replication link to the primary: connected (over TLS when `[redis]
/// tls` is on), authenticated and announced as a replica that understands
/// PSYNC2.
struct Link {
    read: LinkRead,
    write: LinkWrite,
    addr: String,
}

impl Link {
    async fn open(follow: &Follow) -> Result<Link, FollowError> {
        let addr = follow.primary.clone();
        let io_err = |source| FollowError::Io {
            addr: addr.clone(),
            source,
        };
        let stream = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(&addr))
            .await
            .map_err(|_| io_err(std::io::ErrorKind::TimedOut.into()))?
            .map_err(io_err)?;
        stream.set_nodelay(true).map_err(io_err)?;
        let (read, write) = match follow.auth.tls() {
            None => tcp_halves(stream),
            Some(files) => tls_halves(tls_handshake(&addr, files, stream).await?),
        };
        let read = BufReader::with_capacity(READ_CHUNK, read);
        let mut link = Link { read, write, addr };
        if let Some(c) = follow.auth.credentials()? {
            let user = c.user.as_deref().into_iter();
            let auth: Vec<&str> = ["AUTH"]
                .into_iter()
                .chain(user)
                .chain([&*c.password])
                .collect();
            // A server that echoes what it refused (AUTH renamed away)
            // would put the password in the log: it is cut out.
            link.ask("AUTH", &auth).await.map_err(|e| match e {
                FollowError::Refused { addr, answer, .. } => FollowError::LoginRefused {
                    addr,
                    answer: match c.password.is_empty() {
                        true => answer,
                        false => answer.replace(&*c.password, "<password>"),
                    },
                    who: follow.auth.to_string(),
                },
                e => e,
            })?;
        }
        let port = ["REPLCONF", "listening-port", "0"];
        link.ask("REPLCONF listening-port", &port).await?;
        link.ask("REPLCONF capa", &["REPLCONF", "capa", "psync2"])
            .await?;
        Ok(link)
    }

    /// The primary's `INFO replication`, on this link.
    async fn info(&mut self) -> Result<Info, FollowError> {
        let addr = self.addr.clone();
        let io_err = |source| FollowError::Io {
            addr: addr.clone(),
            source,
        };
        self.write
            .write_all(&resp::command(&["INFO", "replication"]))
            .await
            .map_err(io_err)?;
        let head = reply(&mut self.read, &self.addr).await?;
        let len = head
            .strip_prefix('$')
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|&n| n <= MAX_INFO)
            .ok_or_else(|| FollowError::Refused {
                addr: self.addr.clone(),
                asked: "INFO replication",
                answer: head.clone(),
            })?;
        let mut text = vec![0u8; len + 2];
        tokio::time::timeout(PRIMARY_TIMEOUT, self.read.read_exact(&mut text))
            .await
            .map_err(|_| FollowError::Silent(self.addr.clone()))?
            .map_err(io_err)?;
        Ok(Info::parse(&String::from_utf8_lossy(&text[..len])))
    }

    /// Sends the command `args` and reads its status reply (`+…`).
    async fn ask(&mut self, asked: &'static str, args: &[&str]) -> Result<String, FollowError> {
        self.write
            .write_all(&resp::command(args))
            .await
            .map_err(|source| FollowError::Io {
                addr: self.addr.clone(),
                source,
            })?;
        let answer = reply(&mut self.read, &self.addr).await?;
        match answer.starts_with('+') {
            true => Ok(answer),
            false => Err(FollowError::Refused {
                addr: self.addr.clone(),
                asked,
                answer,
            }),
        }
    }
}

async fn session(follow: &Follow, log: &SharedLog) -> Result<(), FollowError> {
    let addr = follow.primary.as_str();
    let mut link = Link::open(follow).await?;
    let promoted = promotion(follow, log).await?;
    let asked = start_point(follow, log);
    let (id, offset) = match &asked {
        Some((id, offset)) => (id.clone(), (offset + 1).to_string()),
        None => ("?".to_string(), "-1".to_string()),
    };
    let answer = link.ask("PSYNC", &["PSYNC", &id, &offset]).await?;
    let Link {
        mut read, write, ..
    } = link;
    let refused = || FollowError::Refused {
        addr: addr.to_string(),
        asked: "PSYNC",
        answer: answer.clone(),
    };
    let log_ = log.clone();
    let start = asked.as_ref().map_or(0, |(_, at)| *at);
    let empty = log.position().is_none();
    let later = match policy::psync(&answer, asked, promoted.as_ref(), empty) {
        Psync::FullResync { replid, offset } => {
            receive_rdb(follow, &mut read, offset).await?;
            blocking(move || log_.write(|l| l.restart(&replid, offset))).await?;
            info!(instance = %follow.instance, offset, "full resync from the primary: its RDB is offered and the stream log starts over at its offset");
            None
        }
        Psync::Continue { now, later } => {
            blocking(move || {
                log_.write(|log| match now {
                    LogStep::Restart(id, at) => log.restart(&id, at),
                    LogStep::Switch(new) => log.switch(&new),
                    LogStep::Keep => Ok(()),
                })
            })
            .await?;
            info!(instance = %follow.instance, offset = start, "the primary continues the stream");
            later
        }
        Psync::Refused => return Err(refused()),
    };
    log.set_state(WriterState::FollowingPrimary);
    stream_into(follow, (read, write), log, later).await
}

/// Reads the primary's promotion point and, when the log holds more of
/// the previous history than the primary took over with, cuts the log
/// back to that point: those bytes are writes the old primary took after
/// the promotion, lost to the failover. They are counted
/// (`kvsync_stream_diverged_bytes_total`) and reported in status, never
/// merged into the new history; the servers fed from them need a
/// re-seeding (no log under the new history continues them). A primary
/// whose `INFO` cannot be read is followed as before: `PSYNC` alone then
/// decides, and a log past the point costs a full resync.
async fn promotion(follow: &Follow, log: &SharedLog) -> Result<Option<Promotion>, FollowError> {
    let info = match crate::kv::redis::info(&follow.primary, &follow.auth, "replication").await {
        Ok(info) => info,
        Err(e) => {
            warn!(instance = %follow.instance, error = %e, "cannot read the primary's INFO replication: a promotion point is not looked for");
            return Ok(None);
        }
    };
    let Some(promoted) = Promotion::from_info(&info) else {
        return Ok(None);
    };
    let Some((id, end)) = log.position() else {
        return Ok(Some(promoted));
    };
    if id != promoted.previous || end <= promoted.at {
        return Ok(Some(promoted));
    }
    let (at, log_) = (promoted.at, log.clone());
    blocking(move || log_.write(|l| l.cut(at))).await?;
    let kept = log.position().map_or(at, |(_, e)| e);
    let lost = end - at;
    follow
        .metrics
        .stream_diverged
        .with_label_values(&[&follow.instance])
        .inc_by(lost);
    let what = format!(
        "{lost} bytes of {id} past offset {at}, where {} took over as primary, were dropped from the log: writes the old primary took after the promotion; servers fed from them need a re-seeding",
        follow.primary
    );
    warn!(instance = %follow.instance, lost, at, kept, "{what}");
    log.set_diverged(what);
    Ok(Some(promoted))
}

/// The `len` bytes of the stream after `offset` of `replid` once more,
/// from the primary's backlog, to mend a damaged record of the log: on a
/// link of its own, the primary's `INFO replication` read right before
/// `PSYNC <replid> <offset+1>`, which is asked only when the backlog holds
/// those bytes with room to spare ([`policy::backlog_holds`]); read for
/// those bytes and closed. Any answer but a continuation closes the link
/// before anything more is read; the link says it takes an RDB as a
/// stream (`capa eof`), so that a primary that syncs replicas without a
/// disk (Redis 7 and Valkey by default) starts no fork for a replica gone
/// before its `repl-diskless-sync-delay`.
pub async fn fetch_again(
    follow: &Follow,
    replid: &str,
    offset: u64,
    len: u64,
) -> Result<Vec<u8>, FollowError> {
    let addr = follow.primary.clone();
    let mut link = Link::open(follow).await?;
    link.ask("REPLCONF capa", &["REPLCONF", "capa", "eof"])
        .await?;
    let info = link.info().await?;
    policy::backlog_holds(&info, replid, offset, len).map_err(|why| FollowError::NotInBacklog {
        addr: addr.clone(),
        why,
    })?;
    let asked = (offset + 1).to_string();
    let answer = link.ask("PSYNC", &["PSYNC", replid, &asked]).await?;
    if !answer.starts_with("+CONTINUE") {
        return Err(FollowError::NotInBacklog {
            addr,
            why: format!("it answered {answer:?}"),
        });
    }
    let mut bytes = vec![0u8; len as usize];
    tokio::time::timeout(PRIMARY_TIMEOUT, link.read.read_exact(&mut bytes))
        .await
        .map_err(|_| FollowError::Silent(addr.clone()))?
        .map_err(|source| FollowError::Io { addr, source })?;
    Ok(bytes)
}

/// Takes a snapshot of the primary's history now, on a link of its own,
/// as a replica's full resync does (`PSYNC ? -1`, a fork of the primary):
/// its RDB is offered as `stream-<offset>.rdb`, and the log, which follows
/// the same primary, continues it. Returns its offset.
async fn take_snapshot(follow: &Follow) -> Result<u64, FollowError> {
    let mut link = Link::open(follow).await?;
    let answer = link.ask("PSYNC", &["PSYNC", "?", "-1"]).await?;
    let words: Vec<&str> = answer.split_whitespace().collect();
    let offset = match words.as_slice() {
        ["+FULLRESYNC", _, offset] => offset.parse().ok(),
        _ => None,
    };
    let Some(offset) = offset else {
        return Err(FollowError::Refused {
            addr: follow.primary.clone(),
            asked: "PSYNC ? -1",
            answer,
        });
    };
    receive_rdb(follow, &mut link.read, offset).await?;
    Ok(offset)
}

/// Least time between two snapshots taken on demand: each is a fork of
/// the primary.
const SNAPSHOT_EVERY: Duration = Duration::from_secs(30);

/// Takes a snapshot of the primary whenever a reader of the log needs one
/// that continues into it and none does ([`super::Stream::want_snapshot`]):
/// a reader too old for the log, or one whose log went past a failover's
/// promotion point, at an agent that holds no snapshot of the history it
/// follows (the promoted server's agent, whose log continued by `PSYNC`).
/// At most one every [`SNAPSHOT_EVERY`], until `stop`.
pub async fn snapshots_on_demand(follow: Follow, log: SharedLog, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            () = log.snapshot_wanted() => {}
        }
        // One continues already, or the log has not started: its first
        // sync brings one.
        if log.floor(&(follow.offered)()) != u64::MAX || log.position().is_none() {
            continue;
        }
        match take_snapshot(&follow).await {
            Ok(offset) => {
                follow
                    .metrics
                    .stream_snapshots_taken
                    .with_label_values(&[&follow.instance])
                    .inc();
                info!(instance = %follow.instance, offset, "a reader needs a snapshot that continues into the log and none did: the primary's RDB is offered")
            }
            Err(e) => {
                warn!(instance = %follow.instance, error = %e, "a reader needs a snapshot that continues into the log, and none could be taken from the primary")
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(SNAPSHOT_EVERY) => {}
        }
    }
}

/// The TLS handshake with the primary at `addr` (`host:port`): its
/// certificate must chain to the configured CA for that host's name or IP.
async fn tls_handshake(
    addr: &str,
    files: &TlsFiles,
    stream: TcpStream,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, FollowError> {
    let refused = |why: String| FollowError::Tls {
        addr: addr.to_string(),
        why,
    };
    let config = crate::rpc::tls::kv_client(files).map_err(|e| refused(e.to_string()))?;
    let host: HostPort = addr.parse().map_err(|e| refused(format!("{e}")))?;
    let name = rustls_pki_types::ServerName::try_from(host.host.trim_matches(['[', ']']))
        .map_err(|e| refused(e.to_string()))?
        .to_owned();
    let connect = tokio_rustls::TlsConnector::from(config).connect(name, stream);
    tokio::time::timeout(Duration::from_secs(5), connect)
        .await
        .map_err(|_| refused("no TLS handshake within 5s".into()))?
        .map_err(|e| refused(e.to_string()))
}

/// The primary's reply line, skipping the empty lines it sends to keep
/// the link alive while it prepares an RDB.
async fn reply(read: &mut LinkRead, addr: &str) -> Result<String, FollowError> {
    loop {
        let line = tokio::time::timeout(PRIMARY_TIMEOUT, resp::read_line(read, MAX_LINE))
            .await
            .map_err(|_| FollowError::Silent(addr.to_string()))?
            .map_err(|source| FollowError::Io {
                addr: addr.to_string(),
                source,
            })?;
        if !line.is_empty() {
            return Ok(line);
        }
    }
}

/// Receives the `$<len>` RDB of a full resync into a hidden temp file of
/// `snapshot_dir`, then offers it as `stream-<offset>.rdb`.
async fn receive_rdb(follow: &Follow, read: &mut LinkRead, offset: u64) -> Result<(), FollowError> {
    let line = reply(read, &follow.primary).await?;
    let len: u64 = line
        .strip_prefix('$')
        .and_then(|l| l.parse().ok())
        .ok_or_else(|| FollowError::Refused {
            addr: follow.primary.clone(),
            asked: "PSYNC (the RDB's length)",
            answer: line.clone(),
        })?;
    let dir = follow.snapshot_dir.clone();
    let limits = Room {
        max_snapshot_bytes: follow.max_rdb,
        min_free_after: follow.min_free_after,
        dir: &dir,
    };
    let free = crate::sys::fs::free_bytes(&dir).map_err(FollowError::Rdb)?;
    limits
        .fits(len, free)
        .map_err(|source| FollowError::RdbRefused {
            addr: follow.primary.clone(),
            source,
        })?;
    let tmp = tempfile::Builder::new()
        .prefix(".kvsync-stream-")
        .suffix(".tmp")
        .tempfile_in(&dir)
        .map_err(FollowError::Rdb)?;
    let (file, tmp_path) = tmp.into_parts();
    let mut file = tokio::fs::File::from_std(file);
    let copied = tokio::io::copy(&mut read.take(len), &mut file)
        .await
        .map_err(FollowError::Rdb)?;
    if copied != len {
        return Err(FollowError::Rdb(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("the primary closed the link after {copied} of {len} bytes"),
        )));
    }
    file.sync_all().await.map_err(FollowError::Rdb)?;
    drop(file);
    let name = format!("stream-{offset}.rdb");
    blocking(move || offer_rdb(&dir, &name, tmp_path))
        .await
        .map_err(FollowError::Rdb)?;
    Ok(())
}

/// Renames the received RDB into place and removes the follower's earlier
/// ones: the newest continues into the log, the older ones no longer do.
fn offer_rdb(dir: &Path, name: &str, tmp: tempfile::TempPath) -> std::io::Result<()> {
    let path = dir.join(name);
    tmp.persist(&path).map_err(|e| e.error)?;
    crate::sys::fs::sync_dir(dir)?;
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if n != name && n.starts_with("stream-") && n.ends_with(".rdb") {
            std::fs::remove_file(&p)?;
        }
    }
    Ok(())
}

async fn blocking<T: Send + 'static, E: Send + 'static>(
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, E> {
    tokio::task::spawn_blocking(f).await.expect("log task")
}

/// Logs one read from the primary, `bytes` past `end`: up to a promoted
/// primary's `switch` point under the old id, then the switch to its new
/// id and the rest. Returns the log's new end.
async fn log_read(
    log: &SharedLog,
    mut bytes: Vec<u8>,
    end: u64,
    switch: &mut Option<(String, u64)>,
) -> Result<u64, LogError> {
    let split = policy::before_switch(end, bytes.len(), switch.as_ref());
    let (old, new): (Vec<u8>, _) = match split {
        Some(before) => (bytes.drain(..before).collect(), switch.take()),
        None => (std::mem::take(&mut bytes), None),
    };
    let middle = end + old.len() as u64;
    let new_end = middle + bytes.len() as u64;
    let switches = new.is_some();
    let write = move |l: &mut Log| {
        l.append(end, &old)?;
        if let Some((id, _)) = &new {
            l.switch(id)?;
        }
        l.append(middle, &bytes)
    };
    match switches {
        // A new id makes a segment and writes the history: off the runtime.
        true => {
            let log = log.clone();
            blocking(move || log.write(write)).await?
        }
        false => log.append(write).await?,
    }
    Ok(new_end)
}

/// The stream: every read becomes a record, appended at the log's end;
/// the log's end is acknowledged, and each second the log is flushed (as
/// `everysec` asks) and trimmed to its retention. `switch`: a promoted
/// primary's new replication id and the offset its history starts at,
/// still ahead of the log's end (the read that crosses it is split there).
async fn stream_into(
    follow: &Follow,
    (mut read, mut write): (LinkRead, LinkWrite),
    log: &SharedLog,
    mut switch: Option<(String, u64)>,
) -> Result<(), FollowError> {
    let addr = follow.primary.as_str();
    let io_err = |source| FollowError::Io {
        addr: addr.to_string(),
        source,
    };
    let (_, mut end) = log.position().expect("the session set the log's start");
    let mut heard = Instant::now();
    let mut buf = Vec::with_capacity(READ_CHUNK);
    let (mut lag, mut acks, mut acked) = (Lag::default(), log.watch_acks(), 0);
    let name = [follow.instance.as_str()];
    let lag_seconds = follow.metrics.stream_lag.with_label_values(&name);
    // The once-a-second work: the primary's silence, the log's housekeeping
    // and an acknowledgement even when nothing changed, as a replica sends.
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The end of the last read, where a GETACK may have begun.
    let mut tail: Vec<u8> = Vec::new();
    loop {
        // Acknowledge now: the primary asked (`ack = "log"`), the servers
        // below acknowledged more (`ack = "replicas"`), or a second passed.
        let ack_now = tokio::select! {
            n = read.read_buf(&mut buf) => {
                let n = n.map_err(io_err)?;
                if n == 0 {
                    return Err(io_err(std::io::ErrorKind::UnexpectedEof.into()));
                }
                heard = Instant::now();
                let bytes = std::mem::replace(&mut buf, Vec::with_capacity(READ_CHUNK));
                let asked = asks_for_ack(&mut tail, &bytes);
                end = log_read(log, bytes, end, &mut switch).await?;
                lag.logged(end, Instant::now());
                follow.ack == StreamAck::Log && asked
            }
            Ok(()) = acks.changed() => {
                if let Some(applied) = log.applied() {
                    for took in lag.applied(applied, Instant::now()) {
                        lag_seconds.observe(took.as_secs_f64());
                    }
                }
                follow.ack == StreamAck::Replicas
            }
            _ = tick.tick() => {
                if heard.elapsed() > PRIMARY_TIMEOUT {
                    return Err(FollowError::Silent(addr.to_string()));
                }
                let (log, floor) = (log.clone(), log.floor(&(follow.offered)()));
                blocking(move || log.tick(end, floor)).await?;
                true
            }
        };
        log.set_behind_since(log.applied().and(lag.oldest()).map(Instant::into_std));
        if !ack_now {
            continue;
        }
        if let Some(offset) = policy::ack_offset(follow.ack, end, log.applied(), acked) {
            let ack = resp::command(&["REPLCONF", "ACK", &offset.to_string()]);
            write.write_all(&ack).await.map_err(io_err)?;
            acked = offset;
            log.set_upstream_acked(offset);
        }
    }
}

/// Whether `bytes`, read after `tail` (the end of the read before, kept
/// here for the next), hold a `REPLCONF GETACK`: the primary waits for
/// the answer (`WAIT`), so it goes out at once rather than on the
/// once-a-second tick. A value that happens to hold the same bytes costs
/// one early acknowledgement, nothing more.
pub(crate) fn asks_for_ack(tail: &mut Vec<u8>, bytes: &[u8]) -> bool {
    const KEEP: usize = GETACK.len() - 1;
    tail.extend_from_slice(&bytes[..bytes.len().min(KEEP)]);
    let asked = memchr::memmem::find(tail, GETACK).is_some()
        || memchr::memmem::find(bytes, GETACK).is_some();
    // Keep the last KEEP bytes read so far.
    if bytes.len() >= KEEP {
        tail.clear();
        tail.extend_from_slice(&bytes[bytes.len() - KEEP..]);
    } else {
        tail.drain(..tail.len().saturating_sub(KEEP));
    }
    asked
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_is_measured_per_stretch_from_logged_to_acknowledged() {
        let t0 = Instant::now();
        let mut lag = Lag::default();
        lag.logged(100, t0);
        lag.logged(200, t0 + Duration::from_millis(10));
        lag.logged(300, t0 + Duration::from_millis(20));
        assert!(lag.applied(99, t0).is_empty(), "nothing completed");
        // An acknowledgement inside a stretch completes the ones before it.
        let done = lag.applied(250, t0 + Duration::from_millis(30));
        assert_eq!(done, [Duration::from_millis(30), Duration::from_millis(20)]);
        assert_eq!(lag.oldest(), Some(t0 + Duration::from_millis(20)));
        let done = lag.applied(300, t0 + Duration::from_millis(25));
        assert_eq!(done, [Duration::from_millis(5)]);
        assert_eq!(lag.oldest(), None, "nothing behind");
        assert!(lag.applied(1000, t0).is_empty(), "each counted once");
    }

    #[test]
    fn a_getack_is_found_whole_or_split_across_reads() {
        let cmd = b"*3\r\n$8\r\nREPLCONF\r\n$6\r\nGETACK\r\n$1\r\n*\r\n";
        let set = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n";
        let mut tail = Vec::new();
        assert!(!asks_for_ack(&mut tail, set));
        assert!(asks_for_ack(&mut tail, cmd), "whole");
        assert!(!asks_for_ack(&mut tail, set), "once");
        // Split at every point, and read a byte at a time.
        for at in 1..cmd.len() {
            let mut tail = Vec::new();
            let (a, b) = cmd.split_at(at);
            let found = asks_for_ack(&mut tail, a) | asks_for_ack(&mut tail, b);
            assert!(found, "split at {at}");
        }
        let mut tail = Vec::new();
        let found = cmd
            .iter()
            .fold(false, |f, b| asks_for_ack(&mut tail, &[*b]) | f);
        assert!(found, "a byte at a time");
        assert!(tail.len() < GETACK.len());
    }

    #[test]
    fn lag_keeps_a_bounded_backlog_of_stretches() {
        let t0 = Instant::now();
        let mut lag = Lag::default();
        for end in 1..=(Lag::MAX as u64 + 10) {
            lag.logged(end, t0);
        }
        assert_eq!(lag.applied(u64::MAX, t0).len(), Lag::MAX);
    }
}
