//! The `redis-replicate` handoff: the replica's agent acts as a one-shot
//! master, so a running Redis/Valkey server takes the verified RDB over the
//! replication protocol, without a restart and without a file placed in its
//! directory, and then continues from M+1 with the real primary
//! (docs/ARCHITECTURE.md, "Handoff").
//!
//! The steps: listen on `[redis] seed_listen` (loopback, a fresh port);
//! record the server's `masterauth` and master ([`RECORD`]), set a random
//! one-time `masterauth` on it and `REPLICAOF` the seed address; answer
//! connections from the server's address as a master would (`PING`,
//! `AUTH`, `REPLCONF`; over TLS when the server opens with a TLS hello,
//! its `tls-replication yes`), and the first that proved the one-time
//! password gets its `PSYNC` answered with `+FULLRESYNC <repl-id> <M>` and the RDB
//! as one bulk payload; wait until the server has loaded it and reports the
//! RDB's replication id and offset; put its `masterauth` back, `REPLICAOF`
//! the primary and confirm the partial resync as the `redis` handoff does.
//! Every other connection gets an error and nothing else. A failure puts
//! the server's replication back as it was (its old master, or none); a
//! record left by a killed agent is put back by the next ([`recover`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tracing::{info, warn};

use crate::config::{HostPort, RedisConfig, TlsFiles};
use crate::kv::payload::{Accepted, Arriving, Payload, PayloadError, Verdict};
use crate::kv::redis::{
    confirm_partial, connect, info, infos, server_err, until, Info, RedisError,
};
use crate::rpc::tls::{tcp_halves, tls_halves, KvRead, KvWrite};
use crate::snapshot::SnapshotInfo;

/// The one-time `masterauth` record, in `snapshot_dir`: the server's own
/// value while the seed's is in force, so a killed agent puts it back.
pub const RECORD: &str = ".kvsync-seed-masterauth";

/// Most arguments, and bytes per argument, of a command the seed accepts.
const MAX_ARGS: usize = 16;
const MAX_ARG: usize = 1024;

/// Seeds the local server with `rdb` (saved at `snapshot`, kept in
/// `snapshot_dir`) over the replication protocol, then points it at the
/// primary. `timeout` bounds each wait on the server: for its connection,
/// and for its load once the whole payload is sent.
pub async fn replicate(
    cfg: &RedisConfig,
    timeout: Duration,
    rdb: Payload,
    snapshot: &SnapshotInfo,
    snapshot_dir: &Path,
) -> Result<String, RedisError> {
    let repl_id = snapshot
        .repl_id
        .as_deref()
        .ok_or_else(|| RedisError::Precondition("the RDB carries no replication id".into()))?;
    let before = info(&cfg.primary, &cfg.auth(), "stats").await?;
    let (server, auth) = (&cfg.server_addr, &cfg.auth());
    let record_path = snapshot_dir.join(RECORD);
    let mut con = connect(server, auth).await?;
    // A record left by a killed agent holds the server's own values.
    put_back(&mut con, cfg, &record_path).await?;
    let was = info(server, auth, "replication").await?;
    let listener = TcpListener::bind(&cfg.seed_listen).await.map_err(|e| {
        let why = if e.kind() == std::io::ErrorKind::AddrInUse {
            "is taken by another process".to_string()
        } else {
            e.to_string()
        };
        RedisError::Seed(format!(
            "[redis] seed_listen {} {why}; set its port to 0 so the agent takes a fresh free one for each seeding",
            cfg.seed_listen
        ))
    })?;
    let seed = listener
        .local_addr()
        .map_err(|e| RedisError::Seed(e.to_string()))?;
    let record = Record {
        masterauth: config_get(&mut con, server, "masterauth").await?,
        master: match (
            was.get("role"),
            was.get("master_host"),
            was.get("master_port"),
        ) {
            (Some("slave"), Some(host), Some(port)) => Some((host.to_string(), port.to_string())),
            _ => None,
        },
        seed_port: seed.port(),
    };
    let secret = one_time_secret();
    write_record(&record_path, &record)?;
    let seeded = async {
        config_set(&mut con, server, "masterauth", &secret).await?;
        replicaof(&mut con, server, &seed.ip().to_string(), seed.port()).await?;
        info!(%seed, seq = snapshot.seq, "serving the RDB to the local server as its master");
        let seeded = accept_seeded(
            &listener,
            (server_ip(server).await?, &secret),
            &cfg.tls_file_set(),
            timeout,
        )
        .await?;
        let (sent, was_sent) = tokio::sync::oneshot::channel();
        let mut serving = tokio::spawn(serve(
            seeded,
            rdb,
            repl_id.to_string(),
            snapshot.seq,
            sent,
        ));
        let loaded = async {
            match was_sent.await {
                Ok(()) => loaded(cfg, timeout, repl_id, snapshot.seq, seed.port()).await,
                // `serving` ended first, and says why.
                Err(_) => std::future::pending().await,
            }
        };
        let loaded = tokio::select! {
            r = loaded => r,
            r = &mut serving => Err(match r {
                Ok(Ok(())) => RedisError::Seed(
                    "the local server closed the seed connection before it had loaded the RDB (its log says why: a failed load?)".into(),
                ),
                Ok(Err(e)) => e,
                Err(e) => RedisError::Seed(format!("the seed task: {e}")),
            }),
            // Any other connection meanwhile is turned away.
            _ = turn_away(&listener) => unreachable!("turn_away never returns"),
        };
        // The seed connection stays open until the server leaves it for
        // the primary, so it never tries to reconnect to the seed.
        let serving = serving.abort_handle();
        if loaded.is_err() {
            serving.abort();
        }
        loaded.map(|()| serving)
    }
    .await;
    drop(listener);
    // The server's own masterauth again, before it meets any master.
    let restored = config_set(&mut con, server, "masterauth", &record.masterauth).await;
    let primary: HostPort = cfg
        .primary
        .parse()
        .map_err(|e| server_err(&cfg.primary, e))?;
    let followed = match (seeded, &restored) {
        (Ok(serving), Ok(())) => {
            let followed = replicaof(&mut con, server, &primary.host, primary.port).await;
            serving.abort();
            followed
        }
        (Err(e), _) => Err(e),
        (Ok(_), Err(e)) => Err(RedisError::Seed(e.to_string())),
    };
    if let Err(e) = followed {
        restore_role(&mut con, server, record.master.as_ref()).await;
        // Kept while the server may still hold the one-time password: the
        // next seeding, or the next agent, puts it back.
        if restored.is_ok() {
            remove_record(&record_path);
        }
        return Err(e);
    }
    remove_record(&record_path);
    confirm_partial(cfg, timeout, &before, snapshot).await
}

/// A seeding started while its snapshot still arrives: the server loads
/// the verified pieces as they come, and gets the last once
/// [`Early::finish`] accepts the snapshot ([`crate::kv::payload`]).
pub struct Early {
    task: tokio::task::JoinHandle<Result<String, RedisError>>,
    verdict: Verdict,
    /// What the manifest says the snapshot is (the server is told its
    /// replication id and M before the bytes prove them).
    announced: SnapshotInfo,
}

impl Early {
    /// `redis-replicate`: seeds the local server from `arriving` (in
    /// `snapshot_dir`), whose verdict is `verdict`.
    pub fn replicate(
        cfg: RedisConfig,
        timeout: Duration,
        snapshot_dir: PathBuf,
        arriving: Arriving,
        verdict: Verdict,
    ) -> Early {
        let announced = arriving.manifest.info.clone();
        let snapshot = announced.clone();
        let rdb = Payload::Arriving(arriving);
        let task =
            tokio::spawn(
                async move { replicate(&cfg, timeout, rdb, &snapshot, &snapshot_dir).await },
            );
        Early {
            task,
            verdict,
            announced,
        }
    }

    /// `redis-stream`: points the local server at `feed`, which was given
    /// the arriving snapshot `announced` (whose verdict is `verdict`) to
    /// serve; the wait for the server to follow starts with the verdict.
    pub fn attach(
        cfg: RedisConfig,
        timeout: Duration,
        feed: Feed,
        announced: SnapshotInfo,
        verdict: Verdict,
    ) -> Early {
        let (snapshot, accepted) = (announced.clone(), verdict.accepted());
        let task =
            tokio::spawn(
                async move { attach(&cfg, timeout, &feed, &snapshot, Some(accepted)).await },
            );
        Early {
            task,
            verdict,
            announced,
        }
    }

    /// The snapshot is verified and installed, and is `verified`: when
    /// that is the one announced, the server gets its last piece; then the
    /// seeding ends as [`replicate`] or [`attach`] does.
    pub async fn finish(self, verified: &SnapshotInfo) -> Result<String, RedisError> {
        let a = &self.announced;
        let same =
            verified.repl_id == a.repl_id && verified.seq == a.seq && verified.size == a.size;
        self.verdict.give(match same {
            true => Ok(()),
            false => Err(format!(
                "the verified RDB (replication id {:?}, M {}) is not the one the manifest announced ({:?}, {})",
                verified.repl_id, verified.seq, a.repl_id, a.seq
            )),
        });
        self.task
            .await
            .map_err(|e| RedisError::Seed(format!("the seed task: {e}")))?
    }

    /// The snapshot will not be accepted (`why`): the server's payload
    /// ends short, so it drops what it buffered and keeps its data, and its
    /// replication is put back as it was.
    pub async fn abandon(self, why: String) {
        self.verdict.give(Err(why));
        if let Ok(Err(e)) = self.task.await {
            info!(error = %e, "the seeding that began while the snapshot arrived is undone");
        }
    }
}

/// Where an instance's stream feed (`stream::feed`) listens, its password,
/// and where the server's own `masterauth` is kept while the feed's is in
/// force: what the `redis-stream` handoff points the server at.
#[derive(Debug, Clone)]
pub struct Feed {
    pub addr: SocketAddr,
    pub secret: String,
    pub server_auth: PathBuf,
}

/// The `redis-stream` handoff: points the local server at this agent's
/// feed (which answers it from the stream log) with the feed's password as
/// its `masterauth`, and waits until it has loaded `snapshot` (or
/// continued past it) and follows the feed. With `accepted`, the snapshot
/// still arrives: the wait starts once it is accepted. A failure, or a
/// refusal, puts the server's `masterauth` and replication back as they
/// were.
pub async fn attach(
    cfg: &RedisConfig,
    timeout: Duration,
    feed: &Feed,
    snapshot: &SnapshotInfo,
    accepted: Option<Accepted>,
) -> Result<String, RedisError> {
    let (server, auth) = (&cfg.server_addr, &cfg.auth());
    let mut con = connect(server, auth).await?;
    let was = info(server, auth, "replication").await?;
    let (master, old_auth) = take_auth(&mut con, server, &was, feed).await?;
    let (feed, secret) = (feed.addr, &feed.secret);
    let attached = async {
        config_set(&mut con, server, "masterauth", secret).await?;
        replicaof(&mut con, server, &feed.ip().to_string(), feed.port()).await?;
        if let Some(mut accepted) = accepted {
            accepted
                .wait()
                .await
                .map_err(|why| RedisError::Seed(format!("the snapshot was not accepted: {why}")))?;
        }
        let done = following(
            cfg,
            timeout,
            "the local server to follow the stream log's feed",
            feed.port(),
            snapshot.seq,
        )
        .await?;
        Ok::<_, RedisError>(done.num("master_repl_offset"))
    }
    .await;
    match attached {
        Ok(offset) => {
            info!(seq = snapshot.seq, offset, %feed, "the local server follows the stream log's feed");
            Ok(format!(
                "{server} follows this agent's stream log (feed {feed}) at offset {offset}, past the snapshot's {}",
                snapshot.seq
            ))
        }
        Err(e) => {
            let _ = config_set(&mut con, server, "masterauth", &old_auth).await;
            restore_role(&mut con, server, master.as_ref()).await;
            Err(e)
        }
    }
}

/// Before the server is pointed at `feed`: its master (from `was`, its
/// replication info) and its own `masterauth`, which is kept in the feed's
/// file unless it is the feed's already.
pub(crate) async fn take_auth(
    con: &mut redis::aio::MultiplexedConnection,
    server: &str,
    was: &Info,
    feed: &Feed,
) -> Result<(Option<(String, String)>, String), RedisError> {
    let master = match (
        was.get("role"),
        was.get("master_host"),
        was.get("master_port"),
    ) {
        (Some("slave"), Some(host), Some(port)) => Some((host.to_string(), port.to_string())),
        _ => None,
    };
    let own = config_get(con, server, "masterauth").await?;
    if own != feed.secret {
        crate::sys::fs::write_atomic(
            &feed.server_auth,
            own.as_bytes(),
            (".kvsync-feed-", ".tmp"),
            RECORD_MODE,
        )
        .map_err(|e| {
            RedisError::Seed(format!(
                "cannot keep the server's masterauth in {}: {e}",
                feed.server_auth.display()
            ))
        })?;
    }
    Ok((master, own))
}

/// The server's own `masterauth` kept by [`take_auth`] (`None`: nothing
/// was kept).
pub(crate) fn own_auth(feed: &Feed) -> Result<Option<String>, RedisError> {
    match crate::sys::fs::read_regular(&feed.server_auth, MAX_RECORD) {
        Ok(b) => Ok(Some(String::from_utf8_lossy(&b).into_owned())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(RedisError::Seed(format!(
            "cannot read the server's masterauth from {}: {e}",
            feed.server_auth.display()
        ))),
    }
}

/// At start of a `redis-stream` instance: a server that follows an earlier
/// run's feed (its `masterauth` is the feed's password, its master a port
/// the feed no longer listens on) is pointed at the feed's new address.
/// Tried again every few seconds while the server does not answer, until
/// it is done or `stop`.
pub async fn repoint(
    cfg: RedisConfig,
    feed: SocketAddr,
    secret: String,
    stop: tokio_util::sync::CancellationToken,
) {
    let server = &cfg.server_addr;
    loop {
        let done = async {
            let mut con = connect(server, &cfg.auth()).await?;
            if config_get(&mut con, server, "masterauth").await? != secret {
                return Ok(false);
            }
            let i = info(server, &cfg.auth(), "replication").await?;
            let port = feed.port().to_string();
            if i.get("role") == Some("slave") && i.get("master_port") != Some(port.as_str()) {
                replicaof(&mut con, server, &feed.ip().to_string(), feed.port()).await?;
                return Ok(true);
            }
            Ok::<_, RedisError>(false)
        };
        match done.await {
            Ok(true) => {
                return info!(server, %feed, "the server followed an earlier run's stream feed: pointed at this one")
            }
            Ok(false) => return,
            Err(_) => {}
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
    }
}

/// What the server had before a seeding changed it, kept in [`RECORD`]
/// while the seed's one-time `masterauth` is in force.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Record {
    /// The server's own `masterauth` (empty: none).
    masterauth: String,
    /// Its master (host, port), if it was a replica.
    master: Option<(String, String)>,
    /// The seed port it was pointed at.
    seed_port: u16,
}

/// The record is as private as the password it holds.
const RECORD_MODE: u32 = 0o600;
/// The largest record read.
const MAX_RECORD: u64 = 16 << 10;

fn write_record(path: &Path, record: &Record) -> Result<(), RedisError> {
    let text = serde_json::to_vec(record).expect("a record serialises");
    crate::sys::fs::write_atomic(path, &text, (".kvsync-seed-", ".tmp"), RECORD_MODE).map_err(|e| {
        RedisError::Seed(format!(
            "cannot record the server's masterauth in {} before seeding: {e}",
            path.display()
        ))
    })
}

fn remove_record(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            warn!(record = %path.display(), error = %e, "cannot remove the seed record");
        }
    }
}

/// Puts back what a killed agent's record holds: the server's own
/// `masterauth`, and its old master if it still points at the dead seed.
async fn put_back(
    con: &mut redis::aio::MultiplexedConnection,
    cfg: &RedisConfig,
    path: &Path,
) -> Result<(), RedisError> {
    let server = &cfg.server_addr;
    let text = match crate::sys::fs::read_regular(path, MAX_RECORD) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(RedisError::Seed(format!(
                "cannot read the seed record {}: {e}; set the server's masterauth back yourself and remove the file",
                path.display()
            )))
        }
    };
    let record: Record = serde_json::from_slice(&text).map_err(|e| {
        RedisError::Seed(format!(
            "the seed record {} is damaged ({e}); set the server's masterauth back yourself and remove the file",
            path.display()
        ))
    })?;
    config_set(con, server, "masterauth", &record.masterauth).await?;
    let repl = info(server, &cfg.auth(), "replication").await;
    let still_seeded = repl.map_or(true, |i| {
        i.get("master_port") == Some(record.seed_port.to_string().as_str())
    });
    if still_seeded {
        restore_role(con, server, record.master.as_ref()).await;
    }
    remove_record(path);
    info!(
        server,
        "put back the server's masterauth after a seeding an earlier agent did not finish"
    );
    Ok(())
}

/// At start: what a killed agent's seeding left on the server goes back,
/// tried again (every few seconds) while the server does not answer, for
/// example while it still loads, until `shutdown`.
pub async fn recover(
    cfg: RedisConfig,
    snapshot_dir: PathBuf,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let path = snapshot_dir.join(RECORD);
    let mut warned = false;
    while std::fs::symlink_metadata(&path).is_ok() {
        let done = async {
            let mut con = connect(&cfg.server_addr, &cfg.auth()).await?;
            put_back(&mut con, &cfg, &path).await
        };
        match done.await {
            Ok(()) => return,
            Err(e) if !warned => {
                warn!(error = %e, "cannot yet put back what an unfinished seeding changed on the server; trying again");
                warned = true;
            }
            Err(_) => {}
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
    }
}

/// A random password for one seeding.
fn one_time_secret() -> String {
    use std::fmt::Write;
    rand::random::<[u8; 24]>()
        .iter()
        .fold(String::new(), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

pub(crate) async fn config_get(
    con: &mut redis::aio::MultiplexedConnection,
    server: &str,
    name: &str,
) -> Result<String, RedisError> {
    let pair: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg(name)
        .query_async(con)
        .await
        .map_err(|e| server_err(server, e))?;
    Ok(pair.into_iter().nth(1).unwrap_or_default())
}

pub(crate) async fn config_set(
    con: &mut redis::aio::MultiplexedConnection,
    server: &str,
    name: &str,
    value: &str,
) -> Result<(), RedisError> {
    redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .query_async::<()>(con)
        .await
        .map_err(|e| set_refused(server, name, value, e))
}

/// A refused `CONFIG SET name value`, in words that never hold the value
/// (a password): a server that echoes what it refused (`CONFIG` renamed
/// away) would put it in the log.
fn set_refused(server: &str, name: &str, value: &str, e: impl std::fmt::Display) -> RedisError {
    let said = e.to_string();
    let said = match value.is_empty() {
        true => said,
        false => said.replace(value, "<value>"),
    };
    RedisError::Seed(format!(
        "the local server {server} refused CONFIG SET {name}: {} (kvsync sets a one-time masterauth for each seeding)",
        crate::peer_text::escape_controls(&said)
    ))
}

/// `REPLICAOF host port` on the local server.
pub(crate) async fn replicaof(
    con: &mut redis::aio::MultiplexedConnection,
    server: &str,
    host: &str,
    port: u16,
) -> Result<(), RedisError> {
    redis::cmd("REPLICAOF")
        .arg(host)
        .arg(port)
        .query_async::<()>(con)
        .await
        .map_err(|e| {
            RedisError::Seed(format!(
                "the local server {server} refused REPLICAOF {host} {port}: {e} (it must accept REPLICAOF from kvsync; a renamed or ACL-denied command cannot be used)"
            ))
        })
}

/// Puts the server's replication back as it was before the handoff: its
/// old master, or none.
pub(crate) async fn restore_role(
    con: &mut redis::aio::MultiplexedConnection,
    server: &str,
    master: Option<&(String, String)>,
) {
    let back = match master {
        Some((host, port)) => redis::cmd("REPLICAOF").arg(host).arg(port).clone(),
        None => redis::cmd("REPLICAOF").arg("NO").arg("ONE").clone(),
    };
    if let Err(e) = back.query_async::<()>(con).await {
        warn!(server, error = %e, "cannot put the server's replication back as it was");
    }
}

/// The address the local server connects from.
pub async fn server_ip(server: &str) -> Result<std::net::IpAddr, RedisError> {
    let addr = tokio::net::lookup_host(server)
        .await
        .map_err(|e| server_err(server, e))?
        .next()
        .ok_or_else(|| server_err(server, "no address"))?;
    Ok(addr.ip())
}

/// How long one connection has to authenticate and ask for the sync.
const HANDSHAKE: Duration = Duration::from_secs(5);
/// Connections authenticating at once, at most; a newcomer beyond that
/// ends the one that has got least far, the oldest of those. Enough that
/// under a flood of connections a server's own (its TLS handshake
/// included) has tens of milliseconds before it could be ended.
const MAX_HANDSHAKES: usize = 256;

/// How far a connection has got: nothing yet, its first byte (a command
/// or a TLS hello), authenticated.
#[derive(Default)]
struct Progress(std::sync::atomic::AtomicU8);

impl Progress {
    fn reached(&self, stage: u8) {
        self.0
            .fetch_max(stage, std::sync::atomic::Ordering::Relaxed);
    }
    fn stage(&self) -> u8 {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// A connection that proved the one-time password and asked for a sync
/// (`PSYNC`, else the old `SYNC`), over TCP or TLS.
pub struct Seeded {
    pub from: SocketAddr,
    pub read: BufReader<KvRead>,
    pub write: KvWrite,
    pub psync: bool,
    /// The sync request's words (`PSYNC <id> <offset>`).
    pub args: Vec<String>,
}

/// The first connection from `peer` that proves `secret` (the one-time
/// `masterauth`) and asks for a sync. Connections from elsewhere are
/// turned away at once; each from `peer` has [`HANDSHAKE`] to prove it,
/// concurrently, so one that never does delays nobody; at
/// [`MAX_HANDSHAKES`], the one that has got least far is dropped for a
/// newcomer, so other local processes (they share the server's address)
/// cannot keep the server out by flooding the port. A connection that
/// opens with a TLS handshake (a server with `tls-replication yes`) is
/// answered over TLS with `tls`'s certificate, read at that moment.
pub async fn accept_seeded(
    listener: &TcpListener,
    (peer, secret): (std::net::IpAddr, &str),
    tls: &TlsFiles,
    timeout: Duration,
) -> Result<Seeded, RedisError> {
    // Why the last connection from `peer` could not start over TLS, for
    // the operator if the server never gets through.
    let mut no_tls: Option<String> = None;
    let accept = async {
        let mut handshakes = tokio::task::JoinSet::new();
        // Those running, oldest first, and how far each has got.
        let mut running: Vec<(tokio::task::AbortHandle, Arc<Progress>)> = Vec::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let (stream, from) = accepted.map_err(|e| RedisError::Seed(e.to_string()))?;
                    if from.ip() != peer {
                        refuse(stream, from).await;
                        continue;
                    }
                    running.retain(|(task, _)| !task.is_finished());
                    if running.len() >= MAX_HANDSHAKES {
                        let least = (0..running.len())
                            .min_by_key(|&i| running[i].1.stage())
                            .expect("handshakes are running");
                        running.remove(least).0.abort();
                    }
                    let (secret, tls) = (secret.to_string(), tls.clone());
                    let progress = Arc::new(Progress::default());
                    let shown = progress.clone();
                    let task = handshakes.spawn(async move {
                        let shake = handshake(stream, from, secret, tls, &shown);
                        tokio::time::timeout(HANDSHAKE, shake)
                            .await
                            .unwrap_or(Err(None))
                    });
                    running.push((task, progress));
                }
                Some(done) = handshakes.join_next() => {
                    match done {
                        Ok(Ok(seeded)) => return Ok(seeded),
                        Ok(Err(Some(why))) => no_tls = Some(why),
                        Ok(Err(None)) | Err(_) => continue,
                    }
                }
            }
        }
    };
    let accepted = tokio::time::timeout(timeout, accept).await;
    accepted.map_err(|_| RedisError::Timeout {
        what: match no_tls {
            None => "the local server to connect to the seed".into(),
            Some(why) => format!("the local server to connect to the seed ({why})"),
        },
        after: timeout,
    })?
}

/// A master's side of a replica's handshake, up to its `PSYNC` or `SYNC`:
/// the connection then, once it has sent `AUTH` with `secret`; an error
/// (after an error reply) for anything else, which says why when the
/// connection came over TLS and TLS cannot be served.
async fn handshake(
    stream: TcpStream,
    from: SocketAddr,
    secret: String,
    tls: TlsFiles,
    progress: &Progress,
) -> Result<Seeded, Option<String>> {
    // A master's link to its replica carries the stream (`redis-stream`),
    // whose small writes must not wait for the server's delayed ACK.
    stream.set_nodelay(true).map_err(|_| None)?;
    let (read, mut write) = match opens_tls(&stream, progress).await {
        false => tcp_halves(stream),
        true => tls_halves(serve_tls(stream, from, &tls).await?),
    };
    let mut read = BufReader::new(read);
    let mut authenticated = false;
    loop {
        let args = read_command(&mut read).await.map_err(|_| None)?;
        let name = args[0].to_ascii_uppercase();
        let reply: &[u8] = match name.as_str() {
            "PING" => b"+PONG\r\n",
            // `AUTH <password>` or `AUTH <user> <password>` (masteruser).
            "AUTH" if args.len() <= 3 => {
                let given = args.last().expect("AUTH has a word");
                authenticated = args.len() > 1
                    && constant_time_eq::constant_time_eq(given.as_bytes(), secret.as_bytes());
                if authenticated {
                    progress.reached(2);
                    b"+OK\r\n"
                } else {
                    b"-WRONGPASS invalid password for this kvsync seed\r\n"
                }
            }
            "REPLCONF" if authenticated => b"+OK\r\n",
            "PSYNC" | "SYNC" if authenticated => {
                return Ok(Seeded {
                    from,
                    read,
                    write,
                    psync: name == "PSYNC",
                    args,
                })
            }
            _ => {
                b"-NOAUTH this kvsync seed serves only the server it set a one-time password on\r\n"
            }
        };
        write.write_all(reply).await.map_err(|_| None)?;
        if !authenticated && name != "PING" {
            warn!(%from, "refused a connection to the seed port that did not prove the one-time password");
            close_politely(read.into_inner(), write).await;
            return Err(None);
        }
    }
}

/// Whether the connection's first byte opens a TLS handshake (a record
/// of type 22), as a server with `tls-replication yes` sends; a plain
/// server opens with a command. A first byte is progress.
async fn opens_tls(stream: &TcpStream, progress: &Progress) -> bool {
    let mut first = [0u8; 1];
    let peeked = stream.peek(&mut first).await;
    if matches!(peeked, Ok(1)) {
        progress.reached(1);
    }
    matches!(peeked, Ok(1) if first[0] == 0x16)
}

/// The server's side of a TLS handshake on the seed or feed port, with
/// the certificate in `tls`; why not, when it cannot be (logged here).
async fn serve_tls(
    stream: TcpStream,
    from: SocketAddr,
    tls: &TlsFiles,
) -> Result<tokio_rustls::server::TlsStream<TcpStream>, Option<String>> {
    let refused = |why: String| {
        warn!(%from, %why, "a connection from the server's address opened a TLS handshake on the agent's replication port, which could not be completed");
        Some(format!(
            "a connection from its address came over TLS, and {why}"
        ))
    };
    let config = crate::rpc::tls::kv_server(tls).map_err(|e| refused(e.to_string()))?;
    tokio_rustls::TlsAcceptor::from(config)
        .accept(stream)
        .await
        .map_err(|e| refused(format!("its TLS handshake failed: {e}")))
}

/// Answers every further connection with an error and closes it.
async fn turn_away(listener: &TcpListener) {
    loop {
        if let Ok((stream, from)) = listener.accept().await {
            refuse(stream, from).await;
        }
    }
}

/// Answers a connection with an error and closes it, on a task of its
/// own (the accept loop goes on at once).
async fn refuse(mut stream: TcpStream, from: SocketAddr) {
    warn!(%from, "refused a connection to the seed port: it serves one server once");
    tokio::spawn(async move {
        let _ = stream
            .write_all(b"-ERR this kvsync seed serves one replica, once\r\n")
            .await;
        let (read, write) = stream.into_split();
        close_politely(read, write).await;
    });
}

/// Ends a refused connection so its error reply arrives: no more writes,
/// then what the client already sent is read away (for at most a second),
/// because closing with unread input resets the connection and can lose
/// the reply.
async fn close_politely(mut read: impl AsyncRead + Unpin, mut write: impl AsyncWrite + Unpin) {
    let _ = write.shutdown().await;
    let drain = async {
        let mut sink = [0u8; 1024];
        let mut left = 64usize << 10;
        while left > 0 {
            match read.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
}

/// The master's answer to the replica's sync request: `+FULLRESYNC
/// <repl-id> <M>` (to `PSYNC`) and the RDB's payload, then `sent`; then it
/// reads the replica's acknowledgements until the connection ends.
async fn serve(
    seeded: Seeded,
    rdb: Payload,
    repl_id: String,
    seq: u64,
    sent: tokio::sync::oneshot::Sender<()>,
) -> Result<(), RedisError> {
    let err = |e: std::io::Error| RedisError::Seed(format!("the seed connection: {e}"));
    let Seeded {
        mut read,
        mut write,
        psync,
        ..
    } = seeded;
    if psync {
        let line = format!("+FULLRESYNC {repl_id} {seq}\r\n");
        write.write_all(line.as_bytes()).await.map_err(err)?;
    }
    let len = rdb.send(&mut write).await.map_err(|e| match e {
        PayloadError::Io(e) => err(e),
        e => RedisError::Seed(format!("the RDB's payload ended short: {e}")),
    })?;
    info!(bytes = len, "RDB sent to the local server");
    let _ = sent.send(());
    // Its acknowledgements follow; nothing more is sent, so its offset
    // stays M.
    let mut sink = [0u8; 4096];
    while read.read(&mut sink).await.map_err(err)? > 0 {}
    Ok(())
}

/// One command: a RESP array of bulk strings, or an inline line.
pub async fn read_command<R: tokio::io::AsyncBufRead + Unpin>(
    read: &mut R,
) -> Result<Vec<String>, RedisError> {
    let bad = |what: &str| RedisError::Seed(format!("the local server sent {what}"));
    let line = read_line(read).await?;
    let Some(count) = line.strip_prefix('*') else {
        let args: Vec<String> = line.split_whitespace().map(str::to_string).collect();
        if args.is_empty() || args.len() > MAX_ARGS {
            return Err(bad("an empty or overlong inline command"));
        }
        return Ok(args);
    };
    let count: usize = count.parse().map_err(|_| bad("a malformed array"))?;
    if count == 0 || count > MAX_ARGS {
        return Err(bad("a command with too many arguments"));
    }
    let mut args = Vec::with_capacity(count);
    for _ in 0..count {
        let len: usize = read_line(read)
            .await?
            .strip_prefix('$')
            .and_then(|l| l.parse().ok())
            .filter(|l| *l <= MAX_ARG)
            .ok_or_else(|| bad("a malformed or overlong argument"))?;
        let mut arg = vec![0u8; len + 2];
        read.read_exact(&mut arg)
            .await
            .map_err(|e| RedisError::Seed(e.to_string()))?;
        arg.truncate(len);
        args.push(String::from_utf8(arg).map_err(|_| bad("a non-UTF-8 argument"))?);
    }
    Ok(args)
}

/// One CRLF-terminated line of at most `MAX_ARG` bytes.
async fn read_line<R: tokio::io::AsyncBufRead + Unpin>(read: &mut R) -> Result<String, RedisError> {
    crate::kv::resp::read_line(read, MAX_ARG)
        .await
        .map_err(|e| {
            RedisError::Seed(match e.kind() {
                std::io::ErrorKind::UnexpectedEof => {
                    "the local server closed the seed connection".to_string()
                }
                _ => format!("the local server sent {e}"),
            })
        })
}

/// Waits until the server follows the master on `port`: linked, not
/// loading, at offset `from` or past it; its replication and persistence
/// info then.
pub(crate) async fn following(
    cfg: &RedisConfig,
    timeout: Duration,
    what: &str,
    port: u16,
    from: u64,
) -> Result<crate::kv::redis::Info, RedisError> {
    let (server, auth) = (&cfg.server_addr, &cfg.auth());
    let port = port.to_string();
    until(what, timeout, || async {
        let i = infos(server, auth, &["replication", "persistence"])
            .await
            .ok()?;
        let linked = i.get("master_link_status") == Some("up")
            && i.get("master_port") == Some(port.as_str())
            && i.get("loading") == Some("0")
            && i.num("master_repl_offset") >= from;
        linked.then_some(i)
    })
    .await
}

/// Waits until the server has loaded the RDB from the seed: linked to it,
/// not loading, with the RDB's replication id and offset.
async fn loaded(
    cfg: &RedisConfig,
    timeout: Duration,
    repl_id: &str,
    seq: u64,
    seed_port: u16,
) -> Result<(), RedisError> {
    let done = following(
        cfg,
        timeout,
        "the local server to load the RDB from the seed",
        seed_port,
        0,
    )
    .await?;
    let (id, offset) = (
        done.get("master_replid").unwrap_or(""),
        done.num("master_repl_offset"),
    );
    if id != repl_id || offset != seq {
        return Err(RedisError::Seed(format!(
            "after loading, the local server reports replication id {id} offset {offset}, not the RDB's {repl_id} {seq}"
        )));
    }
    info!(seq, "the local server loaded the RDB from the seed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn parse(bytes: &[u8]) -> Result<Vec<String>, RedisError> {
        read_command(&mut BufReader::new(bytes)).await
    }

    async fn send(seed: SocketAddr, from: &str, lines: &[u8]) -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
        let mut s = socket.connect(seed).await.unwrap();
        s.write_all(lines).await.unwrap();
        s
    }

    async fn answer(mut s: TcpStream) -> String {
        let mut answer = String::new();
        s.read_to_string(&mut answer).await.unwrap();
        answer
    }

    #[test]
    fn a_refused_config_set_never_repeats_the_value_nor_a_line_break() {
        let echo = "ERR unknown command 'CONFIG', with args beginning with: 'SET' 'masterauth' 's3cr3t'\r\nforged";
        let said = set_refused("127.0.0.1:1", "masterauth", "s3cr3t", echo).to_string();
        assert!(!said.contains("s3cr3t") && !said.contains('\n'), "{said}");
        assert!(said.contains("'<value>'"), "{said}");
    }

    /// Only a connection from the server's address that proves the
    /// one-time password gets to sync; one that stays silent delays it
    /// not at all, and the others get nothing but errors.
    #[tokio::test]
    async fn the_seed_serves_only_the_connection_with_the_one_time_password() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let seed = listener.local_addr().unwrap();
        let stranger = send(seed, "127.0.0.2", b"PING\r\n").await;
        let _silent = send(seed, "127.0.0.1", b"").await;
        let guess = send(seed, "127.0.0.1", b"PING\r\nAUTH guess\r\nPSYNC ? -1\r\n").await;
        let bold = send(seed, "127.0.0.1", b"REPLCONF capa eof\r\nPSYNC ? -1\r\n").await;
        let server = send(
            seed,
            "127.0.0.1",
            b"PING\r\nAUTH default s3cret\r\nREPLCONF capa eof\r\nPSYNC ? -1\r\n",
        )
        .await;
        let ip = "127.0.0.1".parse().unwrap();
        let no_tls = TlsFiles::default();
        let seeded = accept_seeded(&listener, (ip, "s3cret"), &no_tls, Duration::from_secs(10))
            .await
            .unwrap();
        assert!(seeded.psync);
        assert_eq!(seeded.from, server.local_addr().unwrap());
        assert!(answer(stranger).await.starts_with("-ERR"));
        assert_eq!(
            answer(guess).await,
            "+PONG\r\n-WRONGPASS invalid password for this kvsync seed\r\n"
        );
        assert!(answer(bold).await.starts_with("-NOAUTH"));
    }

    /// A server with `tls-replication yes` opens with a TLS handshake: it
    /// is answered over TLS with the configured certificate, which it
    /// checks against its CA; without one set, the seed's timeout says
    /// which settings to set.
    #[tokio::test]
    async fn a_server_that_replicates_over_tls_is_answered_over_tls() {
        let dir = tempfile::tempdir().unwrap();
        let made = rcgen::generate_simple_self_signed(vec!["kvsync-agent".into()]).unwrap();
        let files = TlsFiles {
            ca: dir.path().join("ca.pem"),
            cert: dir.path().join("ca.pem"),
            key: dir.path().join("key.pem"),
        };
        std::fs::write(&files.cert, made.cert.pem()).unwrap();
        std::fs::write(&files.key, made.signing_key.serialize_pem()).unwrap();
        let ip = "127.0.0.1".parse().unwrap();
        let server = |seed: SocketAddr, files: TlsFiles| async move {
            let stream = TcpStream::connect(seed).await.unwrap();
            let config = crate::rpc::tls::kv_client(&files).unwrap();
            let name = rustls_pki_types::ServerName::try_from("kvsync-agent").unwrap();
            let connect = tokio_rustls::TlsConnector::from(config).connect(name, stream);
            let mut tls = connect.await?;
            tls.write_all(b"AUTH s3cret\r\nPSYNC ? -1\r\n").await?;
            let mut ok = [0u8; 5];
            tls.read_exact(&mut ok).await?;
            assert_eq!(&ok, b"+OK\r\n");
            Ok::<_, std::io::Error>(tls)
        };

        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let seed = listener.local_addr().unwrap();
        let _tls = tokio::spawn(server(seed, files.clone()));
        let seeded = accept_seeded(&listener, (ip, "s3cret"), &files, Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(seeded.args, ["PSYNC", "?", "-1"]);

        let unset = TlsFiles::default();
        let _refused = tokio::spawn(server(seed, files.clone()));
        let e = accept_seeded(&listener, (ip, "s3cret"), &unset, Duration::from_secs(2))
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("came over TLS") && e.contains("tls_cert_file"),
            "{e}"
        );
    }

    /// Local processes share the server's address: a flood of
    /// connections that stay silent, or say PING and no more, cannot keep
    /// the server's own connection out.
    #[tokio::test]
    async fn a_flood_from_the_servers_address_cannot_keep_the_server_out() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let seed = listener.local_addr().unwrap();
        let ip = "127.0.0.1".parse().unwrap();
        // Well inside HANDSHAKE, which a flood's connection may hold.
        let accepting = tokio::spawn(async move {
            let no_tls = TlsFiles::default();
            accept_seeded(&listener, (ip, "s3cret"), &no_tls, HANDSHAKE / 2).await
        });
        let mut flood = Vec::new();
        for i in 0..2 * MAX_HANDSHAKES {
            let hello: &[u8] = if i % 2 == 0 { b"" } else { b"PING\r\n" };
            flood.push(send(seed, "127.0.0.1", hello).await);
        }
        let server = send(seed, "127.0.0.1", b"PING\r\nAUTH s3cret\r\nPSYNC ? -1\r\n").await;
        let seeded = accepting
            .await
            .unwrap()
            .expect("the server's connection got through");
        assert_eq!(seeded.from, server.local_addr().unwrap());
    }

    #[tokio::test]
    async fn commands_are_read_in_both_forms_and_bounded() {
        assert_eq!(
            parse(b"*3\r\n$5\r\nPSYNC\r\n$1\r\n?\r\n$2\r\n-1\r\n")
                .await
                .unwrap(),
            ["PSYNC", "?", "-1"]
        );
        assert_eq!(parse(b"PING\r\n").await.unwrap(), ["PING"]);
        assert!(parse(b"*99\r\n").await.is_err());
        assert!(parse(b"*1\r\n$99999\r\n").await.is_err());
        assert!(parse(b"*1\r\n$4\r\nPI").await.is_err());
        assert!(parse(&[b'x'; 2000]).await.is_err());
        assert!(parse(b"").await.is_err());
    }
}
