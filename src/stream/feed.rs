//! Being the local server's master from the stream log (`[handoff] mode =
//! "redis-stream"`). The feed listens on `[redis] seed_listen` and answers
//! the server as its primary would: a connection from the server's address
//! proves the feed's password (its `masterauth`, made once and kept in the
//! log's directory), then asks `PSYNC <id> <offset>`. The feed answers
//! `+CONTINUE <id>` when the log holds that id at that offset, and streams
//! the log from there; otherwise `+FULLRESYNC <id> <M>` with the RDB a
//! handoff gave it ([`FeedHandle::seed_with`], once the log continues it)
//! and the stream from M. While a sync still receives its snapshot the
//! feed serves that as it arrives ([`FeedHandle::seed_arriving`]), and
//! falls back to the installed RDB if it is refused. So the server's every
//! reconnect (its restart, a blip between them) continues from the log
//! without the primary. A connection ends where the log's replication id
//! changes: the server asks again and continues under the new id. A newer
//! connection from the server replaces the one before it. A server that asks for an offset
//! the log has not reached yet (it applied more than the log holds after
//! the log was cut, or it was just taken back from the primary) is
//! continued and fed once the log has it ([`Log::continues`]). The server's
//! `REPLCONF ACK` offsets are the log's [`Downstream::Server`]
//! acknowledgement, which the agent passes upstream. The handshake is
//! `kv::seed`'s, over TLS for a server with `tls-replication yes`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

#[cfg(doc)]
use super::log::Log;
use super::log::LogError;
use super::{Downstream, SharedLog};
use crate::blk3::stream::Next;
use crate::config::TlsFiles;
use crate::kv::payload::{Arriving, Payload, PayloadError};
use crate::kv::redis::RedisError;
use crate::kv::seed::{self, Seeded};
use crate::rpc::tls::{KvRead, KvWrite};

/// The feed's password file, in the stream log's directory.
pub const SECRET_FILE: &str = ".kvsync-feed-masterauth";
/// The server's own `masterauth` while the feed's is in force (its
/// primary's password, for a hand back), in the stream log's directory.
pub const SERVER_AUTH_FILE: &str = ".kvsync-feed-server-masterauth";
/// The most stream bytes one write to the server takes.
const CHUNK: u64 = 1 << 20;

/// What a handoff needs of the feed, and what it tells it.
#[derive(Clone)]
pub struct FeedHandle {
    pub addr: SocketAddr,
    pub secret: String,
    /// The RDBs a full resync may serve.
    seed: Arc<Mutex<Seeds>>,
    /// Where the server's own `masterauth` is kept ([`SERVER_AUTH_FILE`]).
    pub server_auth: PathBuf,
    /// How the feed answered its server's sync requests so far.
    served: Arc<watch::Sender<Served>>,
    /// A restarted server's new replication id, and the history it holds
    /// under it ([`FeedHandle::expect_restarted`]).
    restarted: Arc<Mutex<Option<Restarted>>>,
}

/// A restarted server's new replication id, and the history (id, offset)
/// it holds under it.
type Restarted = (String, (String, u64));

/// How many of the server's sync requests the feed continued from the log,
/// answered with a full resync, and refused.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    pub continued: u64,
    pub full: u64,
    /// Refused: a restarted server that took writes.
    pub refused: u64,
}

/// An RDB a full resync serves, its replication id and M.
type Seed = (Payload, String, u64);

/// The installed RDB, and the one a sync still receives, which is served
/// first unless it is refused.
#[derive(Default)]
struct Seeds {
    installed: Option<Seed>,
    arriving: Option<Seed>,
}

impl FeedHandle {
    /// Serves `rdb` (installed, saved at `replid` `m`) to the next full
    /// resync.
    pub fn seed_with(&self, rdb: PathBuf, replid: String, m: u64) {
        let mut seeds = self.seed.lock().expect("feed seed lock");
        *seeds = Seeds {
            installed: Some((Payload::File(rdb), replid, m)),
            arriving: None,
        };
    }

    /// Serves the snapshot `arriving` (saved at `replid` `m`) to the next
    /// full resync while it arrives; the installed one again if it is
    /// refused.
    pub fn seed_arriving(&self, arriving: Arriving, replid: String, m: u64) {
        self.seed.lock().expect("feed seed lock").arriving =
            Some((Payload::Arriving(arriving), replid, m));
    }

    /// What the next full resync serves.
    fn seed(&self) -> Option<Seed> {
        let seeds = self.seed.lock().expect("feed seed lock");
        let arriving = seeds.arriving.as_ref().filter(|(p, _, _)| !p.refused());
        arriving.or(seeds.installed.as_ref()).cloned()
    }

    /// What a handoff points the server at.
    pub fn target(&self) -> seed::Feed {
        seed::Feed {
            addr: self.addr,
            secret: self.secret.clone(),
            server_auth: self.server_auth.clone(),
        }
    }

    /// The server came back from a restart a master under the new id
    /// `own`, holding `held` (the log's id and the offset it reached, as
    /// its `master_replid2` says, checked by [`super::keep`] and
    /// [`super::hand::onto_feed`]): its next `PSYNC <own> <offset+1>` is
    /// continued as `held`, once; the same id at any other offset (it took
    /// writes meanwhile) is refused, never answered with a full resync.
    pub fn expect_restarted(&self, own: String, held: (String, u64)) {
        *self.restarted.lock().expect("feed restarted lock") = Some((own, held));
    }

    /// For an ask (the server's id and offset) under a restarted server's
    /// new id: the history it holds, at exactly its offset (once), or
    /// `Err` anywhere else; `Ok(None)` for any other ask.
    fn translate(&self, (id, at): &(String, u64)) -> Result<Option<(String, u64)>, ()> {
        let mut restarted = self.restarted.lock().expect("feed restarted lock");
        match &*restarted {
            Some((own, (_, held))) if own == id && held == at => {
                Ok(restarted.take().map(|(_, history)| history))
            }
            // Kept: every ask under that id is refused until the next.
            Some((own, _)) if own == id => {
                self.served.send_modify(|s| s.refused += 1);
                Err(())
            }
            _ => Ok(None),
        }
    }

    /// Wakes on every answer to a sync request.
    pub fn served(&self) -> watch::Receiver<Served> {
        self.served.subscribe()
    }
}

/// Why the feed could not start.
#[derive(Debug, thiserror::Error)]
pub enum FeedError {
    #[error("the stream feed's listener {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
    #[error("the stream feed's password file {}: {source}", path.display())]
    Secret {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The feed's password: made once, kept (0600) in `dir`.
fn secret(dir: &Path) -> Result<String, FeedError> {
    let path = dir.join(SECRET_FILE);
    let err = |source| FeedError::Secret {
        path: path.clone(),
        source,
    };
    match crate::sys::fs::read_regular(&path, 256) {
        Ok(b) if b.len() == 48 && b.iter().all(u8::is_ascii_hexdigit) => {
            return Ok(String::from_utf8(b).expect("hex digits"))
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let made: String = rand::random::<[u8; 24]>()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    crate::sys::fs::write_atomic(&path, made.as_bytes(), (".kvsync-feed-", ".tmp"), 0o600)
        .map_err(err)?;
    Ok(made)
}

/// Binds the feed on `listen` with its password from `dir`.
pub async fn bind(listen: &str, dir: &Path) -> Result<(TcpListener, FeedHandle), FeedError> {
    let err = |source| FeedError::Listen {
        addr: listen.to_string(),
        source,
    };
    let listener = TcpListener::bind(listen).await.map_err(err)?;
    let addr = listener.local_addr().map_err(err)?;
    let server_auth = dir.join(SERVER_AUTH_FILE);
    let dir = dir.to_path_buf();
    let secret = tokio::task::spawn_blocking(move || secret(&dir))
        .await
        .expect("feed secret task")?;
    Ok((
        listener,
        FeedHandle {
            addr,
            secret,
            seed: Arc::default(),
            server_auth,
            served: Arc::new(watch::Sender::new(Served::default())),
            restarted: Arc::default(),
        },
    ))
}

/// Serves the server at `server` from the log until `stop`, over TLS
/// with `tls`'s certificate when the server connects with TLS.
pub async fn run(
    listener: TcpListener,
    feed: FeedHandle,
    (server, tls): (String, TlsFiles),
    stream: SharedLog,
    stop: CancellationToken,
) {
    let mut current: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        let ip = tokio::select! {
            _ = stop.cancelled() => break,
            ip = seed::server_ip(&server) => ip,
        };
        let ip = match ip {
            Ok(ip) => ip,
            Err(e) => {
                warn!(error = %e, "the stream feed cannot resolve its server; it tries again");
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_secs(2)) => continue,
                }
            }
        };
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            a = seed::accept_seeded(&listener, (ip, &feed.secret), &tls, Duration::from_secs(3600)) => a,
        };
        match accepted {
            Ok(seeded) => {
                if let Some(old) = current.take() {
                    old.abort();
                }
                let (feed, stream) = (feed.clone(), stream.clone());
                current = Some(tokio::spawn(async move {
                    if let Err(e) = feed_one(seeded, &feed, &stream).await {
                        warn!(error = %e, "the stream feed's connection to its server ended");
                    }
                }));
            }
            Err(RedisError::Timeout { .. }) => {}
            Err(e) => warn!(error = %e, "the stream feed's listener"),
        }
    }
    if let Some(c) = current {
        c.abort();
    }
}

/// Why one connection of the feed ended.
#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error("the server's connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("the snapshot's payload: {0}")]
    Payload(#[from] PayloadError),
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("the server asked for {0}, which neither the log nor a snapshot continues")]
    Uncovered(String),
    #[error("the server asked for {0}, under the id it came back from a restart with, past what it held: it took writes, and is not fed")]
    TookWrites(String),
    #[error("the log's replication id changes at offset {0}: the server asks again")]
    Epoch(u64),
    #[error("the server closed the connection")]
    Closed,
}

/// The task reading a connection's acknowledgements, ended with it.
struct Reader(tokio::task::JoinHandle<()>);

impl Drop for Reader {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Answers one sync request and streams the log after it.
async fn feed_one(s: Seeded, feed: &FeedHandle, stream: &SharedLog) -> Result<(), ConnError> {
    let Seeded {
        read,
        mut write,
        psync,
        args,
        ..
    } = s;
    let asked = match (
        psync,
        args.get(1),
        args.get(2).and_then(|o| o.parse::<u64>().ok()),
    ) {
        (true, Some(id), Some(offset)) if offset > 0 => Some((id.clone(), offset - 1)),
        _ => None,
    };
    let held = match asked.as_ref().map(|a| feed.translate(a)).transpose() {
        Ok(held) => held.flatten(),
        Err(()) => {
            let _ = write
                .write_all(b"-ERR kvsync: this server took writes since it came back a master; it is not fed\r\n")
                .await;
            return Err(ConnError::TookWrites(format!("{asked:?}")));
        }
    };
    let restarted = held.is_some();
    let asked = held.or(asked);
    let (replid, mut at) = answer(&mut write, (psync, restarted), asked, feed, stream).await?;
    let mut acks = read_acks(read, stream);
    let mut changed = stream.watch();
    loop {
        loop {
            match stream.next(at, &replid, &|held| held.min(CHUNK)).await? {
                Next::Wait => break,
                Next::Epoch(_) => return Err(ConnError::Epoch(at)),
                // One write for what was read, however many records it holds.
                Next::Bytes(run) => {
                    write.write_all(&run).await?;
                    at += run.len() as u64;
                }
            }
        }
        tokio::select! {
            r = changed.changed() => if r.is_err() { return Ok(()) },
            _ = &mut acks.0 => return Err(ConnError::Closed),
        }
    }
}

/// Answers the server's `PSYNC` (or `SYNC`), `asked` its id and the
/// offset it holds: `+CONTINUE` where the log continues it, else the
/// snapshot that continues into the log (`+FULLRESYNC` and its RDB), else
/// an error. A `restarted` server (its ask translated) gets a continuation
/// or an error, never a full resync. Returns the id and offset the stream
/// goes on from.
async fn answer(
    write: &mut KvWrite,
    (psync, restarted): (bool, bool),
    asked: Option<(String, u64)>,
    feed: &FeedHandle,
    stream: &SharedLog,
) -> Result<(String, u64), ConnError> {
    let continued = asked.as_ref().and_then(|(id, at)| {
        stream.view(|log| {
            log.continues(id, *at).ok()?;
            Some((log.replid_at(*at)?.to_string(), *at))
        })
    });
    match continued {
        Some((id, at)) => {
            write
                .write_all(format!("+CONTINUE {id}\r\n").as_bytes())
                .await?;
            info!(offset = at, replid = %id, "the stream feed continues its server from the log");
            feed.served.send_modify(|s| s.continued += 1);
            Ok((id, at))
        }
        None if restarted => {
            let _ = write
                .write_all(b"-ERR kvsync: the stream log no longer continues this server; it is not fed\r\n")
                .await;
            Err(ConnError::Uncovered(format!(
                "{asked:?}, as a restarted server"
            )))
        }
        None => {
            let usable = feed
                .seed()
                .filter(|(_, id, m)| stream.view(|l| l.covers(id, *m).is_ok()));
            let Some((rdb, id, m)) = usable else {
                let why = asked.map_or("a full sync".to_string(), |(id, at)| {
                    format!("{id} at {}", at + 1)
                });
                let _ = write
                    .write_all(b"-ERR kvsync: no snapshot continues into this agent's stream log; sync one\r\n")
                    .await;
                return Err(ConnError::Uncovered(why));
            };
            if psync {
                write
                    .write_all(format!("+FULLRESYNC {id} {m}\r\n").as_bytes())
                    .await?;
            }
            feed.served.send_modify(|s| s.full += 1);
            let len = rdb.send(write).await?;
            info!(
                bytes = len,
                seq = m,
                "the stream feed sent its server the RDB; the stream follows"
            );
            Ok((id, m))
        }
    }
}

/// Reads the server's acknowledgements (`REPLCONF ACK`) into the stream,
/// on a task of their own that ends with the connection.
fn read_acks(mut read: BufReader<KvRead>, stream: &SharedLog) -> Reader {
    let acked = stream.clone();
    Reader(tokio::spawn(async move {
        while let Ok(cmd) = seed::read_command(&mut read).await {
            if cmd.len() == 3
                && cmd[0].eq_ignore_ascii_case("REPLCONF")
                && cmd[1].eq_ignore_ascii_case("ACK")
            {
                if let Ok(o) = cmd[2].parse() {
                    acked.acked(Downstream::Server, o);
                }
            }
        }
    }))
}
