//! A source's offers: a replica's request ([`Ask`]) for one of this agent's
//! instances becomes a session offer ([`Offered`]) of that instance's own
//! snapshot or of one it relays, on the
//! transport both ends can use, under TLS when both can, admitted under
//! the session limits, with the primary's backlog leased for a Redis
//! seeding and the snapshot's bytes held from this moment. A replica
//! agent's request to continue the replication stream ([`StreamAsk`])
//! becomes a stream session while the instance's log holds its offset,
//! else "too old" with the newest snapshot that continues into the log.
//! The gRPC service (`control::peer`) only translates the request and the
//! answer.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio_util::sync::CancellationToken;
use tracing::info;

use super::new_id;
use super::serve::{replica_key, DataEndpoints, OfferedSession, Refusal, SessionTable};
use crate::blk3::token::SESSION_TOKEN_LEN;
use crate::config::{Config, DataTls, TransportMode};
use crate::instance::{Instance, InstanceError, Instances};
use crate::kv::backlog::Lease;
use crate::kv::redis::RedisError;
use crate::snapshot::{Format, SnapshotId, SnapshotInfo};
use crate::store::cache::{CacheError, RelayFeed, SnapshotCache};
use crate::store::catalog::{Catalog, CatalogEntry};
use crate::store::relay::RelaySource;
use crate::store::served::{Served, SnapshotFile};
use crate::stream::log::Log;
use crate::stream::serve::{new_key, StreamOffers, StreamSession, WINDOW};
use crate::stream::WriterState;
use crate::transport::TransportKind;

/// What a replica asks a source for.
#[derive(Debug, Clone, Default)]
pub struct Ask {
    /// Its node id (a plain name; empty: unnamed).
    pub replica_node: String,
    /// The transports it can take.
    pub tcp: bool,
    pub rdma: bool,
    /// `Some(Rdma)`: RDMA or nothing; `Some(Tcp)`: TCP; `None`: either.
    pub preference: Option<TransportMode>,
    /// Its RDMA provider ("verbs", "emulated").
    pub rdma_provider: String,
    /// The format it installs (empty: whatever this source serves).
    pub format: String,
    /// It can run the data plane under TLS.
    pub data_tls: bool,
    /// Exactly this snapshot (`None`: the newest).
    pub snapshot: Option<SnapshotId>,
    /// TCP streams it asks for.
    pub tcp_streams: u32,
    /// Its streams share a piece queue (else it gets one stream).
    pub piece_queue: bool,
    /// The instance it asks for (empty: the only one).
    pub instance: String,
    /// It continues the snapshot from a stream log, not from the primary.
    pub from_stream_log: bool,
}

/// Why a source makes no offer.
#[derive(Debug, thiserror::Error)]
pub enum OfferError {
    /// The request contradicts this source (another format).
    #[error("{0}")]
    BadRequest(String),
    /// It names no instance of this source, or none among several.
    #[error(transparent)]
    Instance(#[from] InstanceError),
    /// The two ends cannot agree (transport, TLS, the primary's backlog).
    #[error("{0}")]
    Unsupported(String),
    #[error("this source is shutting down; retry against it after its restart")]
    Draining,
    /// Over a session limit; retry later.
    #[error("{0}")]
    Busy(String),
    /// No such snapshot (yet, or any more).
    #[error("{0}")]
    NoSnapshot(String),
    /// Its bytes cannot be held.
    #[error(transparent)]
    Cache(#[from] CacheError),
}

/// An offer made: the session is in the table, its snapshot held.
pub struct Offered {
    pub id: String,
    /// The instance whose snapshot it is.
    pub instance: Arc<Instance>,
    pub token: [u8; SESSION_TOKEN_LEN],
    pub entry: Arc<CatalogEntry>,
    /// The snapshot's file name at its origin.
    pub name: String,
    /// The agent that made it, when this agent relays it.
    pub origin: Option<String>,
    pub transport: TransportKind,
    /// TCP under TLS.
    pub tls: bool,
    pub streams: u32,
    /// Where the replica dials.
    pub endpoint: SocketAddr,
    /// Redis: bytes the primary can still write before M+1 leaves its backlog.
    pub backlog_bytes_left: u64,
}

/// What a source offers from, and under which limits.
pub struct Offers {
    /// The instances whose snapshots this agent offers.
    pub instances: Arc<Instances>,
    pub cache: Arc<SnapshotCache>,
    pub sessions: Arc<SessionTable>,
    pub data: Arc<DataEndpoints>,
    /// Cancelled when the agent starts draining: no new offers.
    pub draining: CancellationToken,
    /// Stream sessions offered and served.
    pub streams: Arc<StreamOffers>,
}

/// What a replica agent asks to continue the replication stream from.
#[derive(Debug, Clone, Default)]
pub struct StreamAsk {
    pub replica_node: String,
    pub instance: String,
    /// Its log's replication id and end (empty: it holds no stream yet,
    /// and starts where this agent's log does).
    pub replid: String,
    pub offset: u64,
    pub data_tls: bool,
    /// The replica can follow through an RDMA ring with this provider
    /// (empty: TCP only).
    pub rdma_provider: String,
}

/// A source's answer to a [`StreamAsk`].
pub enum StreamAnswer {
    Continue(StreamOffered),
    /// The log does not hold the offset: what it holds, and the newest
    /// snapshot that continues into it.
    TooOld {
        held: String,
        snapshot: Option<Arc<CatalogEntry>>,
        /// The replica's id ended in this log before the offset it asked
        /// from, where a later id took over: the replica holds bytes of
        /// that id past it, which this log's history never had.
        diverged_at: Option<u64>,
        /// The id the log runs under now, and its end.
        current: Option<(String, u64)>,
    },
}

/// A stream session offered: in the table, waiting for its connection.
pub struct StreamOffered {
    pub id: String,
    pub token: [u8; SESSION_TOKEN_LEN],
    pub key: [u8; crate::blk3::stream::STREAM_KEY_LEN],
    /// Where it starts.
    pub replid: String,
    pub offset: u64,
    pub tls: bool,
    pub endpoint: SocketAddr,
    /// The session runs over an RDMA ring: the endpoint to dial.
    pub rdma_endpoint: Option<SocketAddr>,
    pub window: u64,
}

/// The snapshot an offer is for.
struct Chosen {
    entry: Arc<CatalogEntry>,
    /// Its file name at its origin.
    name: String,
    /// The agent that made it, when this agent relays it.
    origin: Option<String>,
    /// Its relay image's source, while this agent still receives it.
    feed: Option<RelayFeed>,
}

impl Offers {
    /// Makes the offer `ask` can have. `local` is the address the replica
    /// reached this agent on, `remote` the replica's.
    pub async fn offer(
        &self,
        ask: &Ask,
        local: Option<SocketAddr>,
        remote: Option<SocketAddr>,
    ) -> Result<Offered, OfferError> {
        let instance = self.instances.resolve(&ask.instance)?;
        let config = &instance.config;
        let format = config.snapshot_format;
        if !ask.format.is_empty() && ask.format != format.as_str() {
            return Err(OfferError::BadRequest(format!(
                "this source serves {format} snapshots, the replica asked for {:?}",
                ask.format
            )));
        }
        let tls = data_tls(config, ask.data_tls)?;
        let transport = choose_transport(&self.data, ask)?;
        let tls = tls && transport == TransportKind::Tcp;
        if ask.from_stream_log {
            self.wait_for_log(&instance, ask.snapshot.as_ref()).await;
        }
        if self.draining.is_cancelled() {
            return Err(OfferError::Draining);
        }
        let replica_key = replica_key(&ask.replica_node, remote.map(|a| a.ip()), &instance.name);
        let admitted = self.sessions.admit(&replica_key).map_err(|refusal| {
            OfferError::Busy(match refusal {
                Refusal::Busy(limit) => format!(
                    "this source already serves {limit} sessions (sync.max_outgoing_syncs); retry in a few seconds"
                ),
                Refusal::ReplicaBusy(limit) => format!(
                    "replica {replica_key} already holds {limit} sessions of this source's instance (sync.max_sessions_per_replica); retry when one has ended"
                ),
            })
        })?;
        let mut chosen = choose(&instance, ask.snapshot.as_ref())?;
        let id = new_id();
        let (backlog, backlog_bytes_left) =
            lease_backlog(&instance, &id, &chosen.entry.info, ask.from_stream_log).await?;
        let snapshot = self.hold(&instance, &mut chosen, transport).await?;
        let replica = match ask.replica_node.as_str() {
            "" => "unnamed".to_string(),
            node => node.to_string(),
        };
        let asked = if ask.piece_queue { ask.tcp_streams } else { 1 };
        let streams = super::streams::granted(transport, asked, config.data.tcp_streams.most());
        let token = self.sessions.insert(
            OfferedSession {
                id: id.clone(),
                instance: instance.name.clone(),
                replica,
                replica_ip: remote.map(|a| a.ip()),
                entry: chosen.entry.clone(),
                snapshot,
                transport,
                tls,
                expires: Instant::now() + config.sync.session_token_ttl,
                origin: chosen.origin.clone(),
                backlog,
                streams,
            },
            admitted,
        );
        let endpoint = match (transport, self.data.rdma_endpoint()) {
            (TransportKind::Rdma, Some(rdma)) => rdma,
            _ => advertised(self.data.tcp, local),
        };
        info!(session = %id, instance = %instance.name, replica = %ask.replica_node, path = %chosen.entry.path.display(), seq = chosen.entry.info.seq, transport = transport.as_str(), tls, streams, %endpoint, relayed_from = ?chosen.origin, "offered snapshot");
        Ok(Offered {
            id,
            instance: instance.clone(),
            token,
            entry: chosen.entry,
            name: chosen.name,
            origin: chosen.origin,
            transport,
            tls,
            streams,
            endpoint,
            backlog_bytes_left,
        })
    }
}

impl Offers {
    /// What instance `name`'s stream log follows, and the instance.
    pub fn stream_source(&self, name: &str) -> Result<(String, Arc<Instance>), OfferError> {
        let instance = self.instances.resolve(name)?;
        let upstreams = instance.upstreams.as_ref().ok_or_else(|| {
            OfferError::Unsupported(format!(
                "instance {:?} of this agent keeps no replication stream ([stream] dir)",
                instance.name
            ))
        })?;
        Ok((upstreams.source().to_string(), instance.clone()))
    }

    /// Answers a replica agent that asks to continue the replication
    /// stream of one of this agent's instances. `local` is the address it
    /// reached this agent on, `remote` its own.
    pub fn open_stream(
        &self,
        ask: &StreamAsk,
        local: Option<SocketAddr>,
        remote: Option<SocketAddr>,
    ) -> Result<StreamAnswer, OfferError> {
        let instance = self.instances.resolve(&ask.instance)?;
        let config = &instance.config;
        let stream = instance.stream.as_ref().ok_or_else(|| {
            OfferError::Unsupported(format!(
                "instance {:?} of this agent keeps no replication stream ([stream] dir)",
                instance.name
            ))
        })?;
        let tls = data_tls(config, ask.data_tls)?;
        if self.draining.is_cancelled() {
            return Err(OfferError::Draining);
        }
        let start = stream.view(|log| stream_start(log, ask, &instance.catalog));
        let (replid, offset) = match start {
            Ok(start) => start,
            Err(too_old) => {
                if let StreamAnswer::TooOld { snapshot: None, .. } = *too_old {
                    stream.want_snapshot();
                }
                return Ok(*too_old);
            }
        };
        let (id, key) = (new_id(), new_key());
        // A ring when the replica can run one with this agent's provider;
        // it falls back to TCP by itself.
        let rdma_endpoint = self
            .data
            .rdma_endpoint()
            .filter(|_| ask.rdma_provider == self.data.local_rdma.probe().provider.as_str());
        let tls = tls && rdma_endpoint.is_none();
        let replica = match ask.replica_node.as_str() {
            "" => "unnamed".to_string(),
            node => node.to_string(),
        };
        let token = self
            .streams
            .insert(StreamSession {
                id: id.clone(),
                instance: instance.name.clone(),
                replica,
                host: remote.map(|r| r.ip()),
                stream: stream.clone(),
                key,
                replid: replid.clone(),
                from: offset,
                tls,
                rdma: rdma_endpoint.is_some(),
                stall_timeout: config.stream.stall_timeout,
                stall_end: config.stream.stall_end,
                max_per_host: config.stream.max_sessions_per_host,
                spin: config.stream.rdma_spin,
                expires: Instant::now() + config.sync.session_token_ttl,
            })
            .map_err(|busy| {
                stream.refused(&busy);
                OfferError::Busy(busy.to_string())
            })?;
        let endpoint = advertised(self.data.tcp, local);
        info!(session = %id, instance = %instance.name, replica = %ask.replica_node, remote = ?remote, %replid, offset, tls, rdma = ?rdma_endpoint, "offered the replication stream");
        Ok(StreamAnswer::Continue(StreamOffered {
            id,
            token,
            key,
            replid,
            offset,
            tls,
            endpoint,
            rdma_endpoint,
            window: WINDOW,
        }))
    }
}

/// Where a stream session asked for by `ask` starts in `log`: where the
/// log continues the replica's id and offset (or, for a replica with an
/// empty log, where this log starts), else the `TooOld` answer with what
/// the log holds and the newest of `catalog`'s snapshots that continues
/// into it.
fn stream_start(
    log: &Log,
    ask: &StreamAsk,
    catalog: &Catalog,
) -> Result<(String, u64), Box<StreamAnswer>> {
    let start = match ask.replid.as_str() {
        "" => log
            .first()
            .and_then(|first| Some((log.replid_at(first)?.to_string(), first))),
        id => log
            .continues(id, ask.offset)
            .ok()
            .map(|()| (id.to_string(), ask.offset)),
    };
    start.ok_or_else(|| {
        Box::new(StreamAnswer::TooOld {
            held: log.describe(),
            current: log.position(),
            diverged_at: log.superseded_at(&ask.replid).filter(|&at| ask.offset > at),
            snapshot: catalog
                .list()
                .into_iter()
                .filter(|e| {
                    e.info
                        .repl_id
                        .as_ref()
                        .is_some_and(|id| log.covers(id, e.info.seq).is_ok())
                })
                .max_by_key(|e| e.info.seq),
        })
    })
}

/// How long an offer to a replica fed from the stream log waits for the
/// log to reach the snapshot it would offer.
const LOG_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Offers that wait for the stream log at once, in this agent: more go on
/// to the offer's check at once.
const MAX_LOG_WAITERS: usize = 8;

/// Offers waiting for the stream log now.
static LOG_WAITERS: AtomicUsize = AtomicUsize::new(0);

/// A place among the [`MAX_LOG_WAITERS`], left on drop.
struct LogWaiter;

impl LogWaiter {
    fn enter() -> Option<LogWaiter> {
        let before = LOG_WAITERS.fetch_add(1, Ordering::Relaxed);
        if before >= MAX_LOG_WAITERS {
            LOG_WAITERS.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(LogWaiter)
    }
}

impl Drop for LogWaiter {
    fn drop(&mut self) {
        LOG_WAITERS.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Offers {
    /// For a replica fed from the stream log: waits, before it holds any
    /// session slot, until the instance's log continues the snapshot an
    /// offer would choose, while the log may still reach it: it holds
    /// nothing yet (its agent just started, or its primary is not up
    /// yet) or stands short of the snapshot under its id (saved by a
    /// server fed faster than the log). At most [`LOG_WAIT`], at most
    /// [`MAX_LOG_WAITERS`] offers at once, never once draining; the
    /// offer's own check ([`lease_backlog`]) decides after it.
    async fn wait_for_log(&self, instance: &Instance, want: Option<&SnapshotId>) {
        let Some(stream) = &instance.stream else {
            return;
        };
        let Ok(chosen) = choose(instance, want) else {
            return;
        };
        let info = &chosen.entry.info;
        let replid = info.repl_id.as_deref().unwrap_or_default();
        let Some(_waiter) = LogWaiter::enter() else {
            return;
        };
        let deadline = tokio::time::Instant::now() + LOG_WAIT;
        let mut changed = stream.watch();
        let mut told = false;
        loop {
            let (reachable, held) = stream.view(|log| {
                let reachable = log.continues(replid, info.seq).is_err()
                    && match log.position() {
                        None => true,
                        Some((id, end)) => id == replid && end < info.seq,
                    };
                (reachable, log.describe())
            });
            let needs_snapshot = matches!(stream.state(), WriterState::NeedsSnapshot { .. });
            if !reachable || needs_snapshot {
                return;
            }
            if !told {
                info!(
                    seq = info.seq,
                    held, "waiting for the stream log to reach the snapshot before offering it"
                );
                told = true;
            }
            tokio::select! {
                _ = self.draining.cancelled() => return,
                woke = tokio::time::timeout_at(deadline, changed.changed()) => {
                    if woke.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

/// For an RDB, when the instance's primary is configured: the backlog
/// guard's lease for session `id` (refused with what to do when the backlog
/// cannot hold M+1 through the seeding), and the slack it has now.
async fn lease_backlog(
    instance: &Instance,
    id: &str,
    info: &SnapshotInfo,
    from_stream_log: bool,
) -> Result<(Option<Lease>, u64), OfferError> {
    // A replica fed from a stream log takes the stream after M from this
    // agent's log, whose retention keeps every offered snapshot continuous:
    // what the primary's backlog still holds does not matter to it (a log
    // that may still reach the snapshot was waited for, in
    // `Offers::wait_for_log`).
    if let (true, Some(stream)) = (from_stream_log, &instance.stream) {
        let replid = info.repl_id.as_deref().unwrap_or_default();
        return stream.view(|log| match log.continues(replid, info.seq) {
            Ok(()) => Ok((None, 0)),
            Err(_) => Err(OfferError::Unsupported(format!(
                "this agent's stream log does not continue the snapshot of seq {} (it holds {}): a replica fed from a stream log needs a snapshot the log continues",
                info.seq,
                log.describe()
            ))),
        });
    }
    let Some(guard) = instance
        .backlog
        .as_ref()
        .filter(|_| info.format == Format::RedisRdb)
    else {
        return Ok((None, 0));
    };
    match guard.lease(id, info).await {
        Ok((lease, p)) => {
            info!(
                seq = info.seq,
                backlog_bytes_left = p.backlog_bytes_left,
                "redis pre-flight passed"
            );
            Ok((Some(lease), p.backlog_bytes_left))
        }
        Err(e @ RedisError::Precondition(_)) => Err(OfferError::Unsupported(e.to_string())),
        Err(e) => Err(OfferError::Unsupported(format!(
            "cannot check the primary's replication backlog: {e}"
        ))),
    }
}

/// The snapshot of `instance` to offer: `want`, or the newest (its own,
/// or one it relays, whichever is newer).
fn choose(instance: &Instance, want: Option<&SnapshotId>) -> Result<Chosen, OfferError> {
    let format = instance.config.snapshot_format;
    let own = match want {
        Some(id) => instance
            .catalog
            .list()
            .into_iter()
            .filter(|e| e.format() == format && id.is(&e.manifest))
            .max_by_key(|e| e.mtime),
        None => instance.catalog.latest(format),
    };
    // A relayed snapshot keeps its origin even once installed here (the
    // watcher then lists it too), so that partial syncs resume across
    // relays.
    let relayed = instance.relays.find(format, want).filter(|r| {
        own.as_ref()
            .is_none_or(|e| r.manifest.info.seq >= e.info.seq)
    });
    let Some(relayed) = relayed else {
        let entry = own.ok_or_else(|| match want {
            Some(id) => OfferError::NoSnapshot(format!(
                "this agent does not have {format} snapshot {id}, or no longer: it was superseded"
            )),
            None => OfferError::NoSnapshot(format!(
                "no valid {format} snapshot in {} yet{}",
                instance.config.snapshot_dir.display(),
                match instance.catalog.rejected().pop() {
                    Some((path, reason)) => crate::peer_text::escape_controls(&format!(
                        " ({} is not offered: {reason})",
                        path.file_name().unwrap_or_default().to_string_lossy()
                    ))
                    .into_owned(),
                    None => "; save one on the primary first".into(),
                }
            )),
        })?;
        let name = entry
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        return Ok(Chosen {
            entry,
            name,
            origin: None,
            feed: None,
        });
    };
    let (entry, feed) = match relayed.source {
        RelaySource::Feed(feed) => {
            let entry = CatalogEntry {
                path: feed.path.clone(),
                mtime: std::time::SystemTime::UNIX_EPOCH,
                info: relayed.manifest.info.clone(),
                manifest: relayed.manifest.clone(),
            };
            (entry, Some(feed))
        }
        RelaySource::File(entry) => (entry, None),
    };
    Ok(Chosen {
        entry: Arc::new(entry),
        name: relayed.name,
        origin: Some(relayed.origin),
        feed,
    })
}

impl Offers {
    /// Holds the chosen snapshot's bytes for a session over `transport`:
    /// a TCP session of a file on disk sends the file itself (the kernel's
    /// page cache is the shared copy); RDMA and a relay still receiving
    /// take a reference in the cache (loading it, or starting its relay
    /// image). A relayed file that changed is no longer relayed.
    async fn hold(
        &self,
        instance: &Instance,
        chosen: &mut Chosen,
        transport: TransportKind,
    ) -> Result<Served, OfferError> {
        let name = &instance.name;
        let held = match chosen.feed.take() {
            Some(feed) => self
                .cache
                .acquire_relay(name, feed)
                .await
                .map(Served::Image),
            None if transport == TransportKind::Tcp => {
                SnapshotFile::open(&chosen.entry).map(Served::File)
            }
            None => self
                .cache
                .acquire(name, &chosen.entry)
                .await
                .map(Served::Image),
        };
        if let (Err(CacheError::Changed { .. }), Some(_)) = (&held, &chosen.origin) {
            instance.relays.withdraw(&chosen.entry.info);
        }
        Ok(held?)
    }
}

/// Whether the TCP data path is encrypted: when both ends can. A source
/// that requires it refuses a replica that cannot.
fn data_tls(config: &Config, replica_can: bool) -> Result<bool, OfferError> {
    if config.data.tls == DataTls::Required && !replica_can {
        return Err(OfferError::Unsupported(
            "this source requires an encrypted data plane ([data] tls = \"required\"); give the replica a [tls] configuration with the fleet's CA".into(),
        ));
    }
    Ok(config.data_tls() && replica_can)
}

/// RDMA when both sides can and the replica did not ask for TCP; TCP
/// otherwise. A replica that requires RDMA is told why it cannot have it.
fn choose_transport(data: &DataEndpoints, ask: &Ask) -> Result<TransportKind, OfferError> {
    let probe = data.local_rdma.probe();
    let why_not = if !ask.rdma || ask.preference == Some(TransportMode::Tcp) {
        Some("the replica did not ask for it".to_string())
    } else if data.rdma_endpoint().is_none() {
        Some(data.local_rdma.reason())
    } else if ask.rdma_provider != probe.provider.as_str() {
        Some(format!(
            "this source uses the {} rdma provider, the replica {:?}",
            probe.provider, ask.rdma_provider
        ))
    } else {
        None
    };
    match why_not {
        None => Ok(TransportKind::Rdma),
        Some(why) if ask.preference == Some(TransportMode::Rdma) => Err(OfferError::Unsupported(
            format!("rdma required but this source cannot serve it: {why}"),
        )),
        Some(_) if ask.tcp => Ok(TransportKind::Tcp),
        Some(why) => Err(OfferError::Unsupported(format!(
            "no transport in common: the replica offers no tcp and rdma is not possible ({why})"
        ))),
    }
}

/// The data address a replica should dial: the listener's, or — when it is
/// bound to a wildcard — the address the replica reached us on.
fn advertised(data: SocketAddr, local: Option<SocketAddr>) -> SocketAddr {
    match local {
        Some(l) if data.ip().is_unspecified() => SocketAddr::new(l.ip(), data.port()),
        _ => data,
    }
}
