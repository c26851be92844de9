//! Relay fan-out, run by the origin's agent: seeds many replicas with one
//! snapshot through a tree of relays instead of a star.
//!
//! [`FanoutManager::start`] checks the request, fixes the snapshot (the
//! origin's latest, by identity, so every replica gets the same one) and
//! plans the tree ([`plan`]); a task per fan-out then starts each replica's
//! sync on its agent (`Orchestrator.StartFullSync`, with the caller's own
//! bearer token) with its parent as the source and its other ancestors as
//! the upstream it turns to when the parent fails. A relay's children start
//! once it is moving bytes (it offers pieces as they verify); children of a
//! relay that failed before that start from its nearest live ancestor. It
//! follows every sync (`WatchSync`) into one [`pb::FanoutStatus`] that
//! `WatchFanout` streams, and ends when every sync has ended. With
//! `stream`, each replica's stream log is first told to follow the same
//! chain (`SetStreamUpstream`): its parent, then the rest of the way up,
//! which its puller turns to when the parent fails.

pub mod plan;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::instance::Instances;
use crate::metrics::Metrics;
use crate::rpc::auth::ClientAuth;
use crate::rpc::{is_terminal, pb, AgentChannel, Dialer};
use crate::sync::{new_id, unix_ms, SyncError};
use plan::Place;

/// Most replicas in one fan-out.
pub const MAX_REPLICAS: usize = 1024;
/// Most children per node.
pub const MAX_DEGREE: u32 = 64;
/// The degree when the request leaves it 0.
pub const DEFAULT_DEGREE: u32 = 2;
/// How long reaching a replica's agent, and each call but the watch, may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Finished fan-outs kept for WatchFanout.
const KEEP_FINISHED: usize = 32;

/// What a fan-out is asked to do.
pub struct Request {
    /// The origin's gRPC address as the replicas reach it.
    pub origin: String,
    pub replicas: Vec<String>,
    pub degree: u32,
    pub transport: pb::TransportPreference,
    /// The caller's token, presented to the replicas' agents.
    pub auth: ClientAuth,
    /// The origin's instance, as named (empty: its only one); every
    /// replica installs into its instance of that name (or its only one).
    pub instance: String,
    /// Every replica's stream log follows the same tree too.
    pub stream: bool,
}

/// The fan-outs this agent runs as their origin.
pub struct FanoutManager {
    instances: Arc<Instances>,
    metrics: Arc<Metrics>,
    dialer: Dialer,
    /// `[fanout] allowed_replicas`: the agents a fan-out may call.
    allowed: Vec<String>,
    shutdown: CancellationToken,
    fanouts: Mutex<Vec<(String, watch::Receiver<pb::FanoutStatus>)>>,
}

impl FanoutManager {
    pub fn new(
        instances: Arc<Instances>,
        metrics: Arc<Metrics>,
        dialer: Dialer,
        allowed: Vec<String>,
        shutdown: CancellationToken,
    ) -> Arc<FanoutManager> {
        Arc::new(FanoutManager {
            instances,
            metrics,
            dialer,
            allowed,
            shutdown,
            fanouts: Mutex::default(),
        })
    }

    /// Checks the request, plans the tree and starts the fan-out of this
    /// agent's latest snapshot; returns its id.
    pub fn start(self: &Arc<Self>, req: Request) -> Result<String, SyncError> {
        let bad = |why: String| Err(SyncError::BadRequest(why));
        if req.replicas.is_empty() || req.replicas.len() > MAX_REPLICAS {
            return bad(format!("give 1 to {MAX_REPLICAS} replicas"));
        }
        let degree = if req.degree == 0 {
            DEFAULT_DEGREE
        } else {
            req.degree
        };
        if degree > MAX_DEGREE {
            return bad(format!("degree is at most {MAX_DEGREE}"));
        }
        let mut seen = std::collections::HashSet::new();
        for r in req.replicas.iter().chain([&req.origin]) {
            if !crate::rpc::dial::is_agent_addr(r) {
                return bad(format!("{r:?} is not an agent's gRPC address host:port"));
            }
        }
        if let Some(r) = req
            .replicas
            .iter()
            .find(|r| !crate::rpc::dial::allowed(&self.allowed, r))
        {
            return bad(format!(
                "replica {r} is not in this origin's [fanout] allowed_replicas: it calls only the agents listed there"
            ));
        }
        if let Some(twice) = req.replicas.iter().find(|r| !seen.insert(r.as_str())) {
            return bad(format!("replica {twice} is listed twice"));
        }
        if seen.contains(req.origin.as_str()) {
            return bad("the origin cannot be one of its replicas".into());
        }
        let instance = self
            .instances
            .resolve(&req.instance)
            .map_err(|e| SyncError::BadRequest(e.to_string()))?;
        let format = instance.config.snapshot_format;
        let entry = instance.catalog.latest(format).ok_or_else(|| {
            SyncError::CannotStart(format!(
                "instance {} of this agent has no valid {format} snapshot to fan out yet",
                instance.name
            ))
        })?;
        let id = new_id();
        let places = plan::plan(req.replicas.len(), degree as usize);
        let status = pb::FanoutStatus {
            fanout_id: id.clone(),
            origin: req.origin.clone(),
            snapshot: Some(entry.manifest.id().into()),
            degree,
            nodes: req
                .replicas
                .iter()
                .zip(&places)
                .map(|(r, p)| pb::FanoutNode {
                    replica: r.clone(),
                    depth: p.depth,
                    role: if p.children.is_empty() {
                        "leaf"
                    } else {
                        "relay"
                    }
                    .into(),
                    ..Default::default()
                })
                .collect(),
            started_unix_ms: unix_ms(),
            instance: instance.name.clone(),
            ..Default::default()
        };
        let (tx, rx) = watch::channel(status);
        {
            let mut fanouts = self.fanouts.lock().expect("fanouts lock");
            fanouts.push((id.clone(), rx));
            let finished = fanouts.iter().filter(|(_, r)| r.borrow().done).count();
            if finished > KEEP_FINISHED {
                if let Some(oldest) = fanouts.iter().position(|(_, r)| r.borrow().done) {
                    fanouts.remove(oldest);
                }
            }
        }
        info!(fanout = %id, instance = %instance.name, replicas = req.replicas.len(), degree, seq = entry.info.seq, "fan-out started");
        let run = Run {
            manager: self.clone(),
            req,
            places,
            status: tx,
            sent_before: self.source_bytes(&instance.name),
            started: Instant::now(),
        };
        tokio::spawn(run.run());
        Ok(id)
    }

    /// The fan-out's status, following its changes.
    pub fn watch(&self, id: &str) -> Result<watch::Receiver<pb::FanoutStatus>, SyncError> {
        self.fanouts
            .lock()
            .expect("fanouts lock")
            .iter()
            .find(|(i, _)| i == id)
            .map(|(_, r)| r.clone())
            .ok_or_else(|| SyncError::NoSuchSync(id.to_string()))
    }

    /// Bytes this agent has sent as a source of `instance`, over every
    /// transport.
    fn source_bytes(&self, instance: &str) -> u64 {
        ["tcp", "rdma"]
            .iter()
            .map(|t| {
                self.metrics
                    .fullsync_bytes
                    .with_label_values(&[instance, "source", t])
                    .get()
            })
            .sum()
    }
}

/// What a node's follower reports.
enum Event {
    /// Its sync's id and its agent's relay bytes before it started.
    Started(usize, String, u64),
    Progress(usize, Box<pb::SyncProgress>),
    /// The sync could not be started or followed.
    Lost(usize, String),
    /// Its sync ended.
    Ended(usize),
}

/// One running fan-out.
struct Run {
    manager: Arc<FanoutManager>,
    req: Request,
    places: Vec<Place>,
    status: watch::Sender<pb::FanoutStatus>,
    sent_before: u64,
    started: Instant,
}

/// Where a node stands.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stage {
    Waiting,
    Started,
    /// Moving bytes: its children may start.
    Serving,
    Succeeded,
    Failed,
}

impl Run {
    async fn run(self) {
        let n = self.places.len();
        let mut stages = vec![Stage::Waiting; n];
        let mut relay_before = vec![0u64; n];
        let (tx, mut rx) = mpsc::channel(64);
        for i in 0..n {
            if self.places[i].parent.is_none() {
                self.launch(i, &stages, &tx);
                stages[i] = Stage::Started;
            }
        }
        let mut open = n;
        while open > 0 {
            let event = tokio::select! {
                e = rx.recv() => e,
                _ = self.manager.shutdown.cancelled() => None,
            };
            let Some(event) = event else {
                warn!("fan-out stopped: the agent is shutting down (the replicas' syncs go on)");
                break;
            };
            let i = match event {
                Event::Started(i, sync_id, before) => {
                    relay_before[i] = before;
                    self.status.send_modify(|s| s.nodes[i].sync_id = sync_id);
                    continue;
                }
                Event::Progress(i, p) => {
                    let moving = (pb::Phase::Transferring as i32..=pb::Phase::Succeeded as i32)
                        .contains(&p.phase);
                    if stages[i] == Stage::Started && moving {
                        stages[i] = Stage::Serving;
                    }
                    self.status.send_modify(|s| {
                        s.nodes[i].parent = p.source.clone();
                        s.nodes[i].progress = Some(*p);
                    });
                    i
                }
                Event::Lost(i, why) => {
                    warn!(replica = %self.req.replicas[i], error = %why, "fan-out lost a replica");
                    stages[i] = Stage::Failed;
                    open -= 1;
                    self.status.send_modify(|s| {
                        s.nodes[i].error = why;
                        s.failed += 1;
                    });
                    i
                }
                Event::Ended(i) => {
                    let ok = self.status.borrow().nodes[i]
                        .progress
                        .as_ref()
                        .is_some_and(|p| p.phase == pb::Phase::Succeeded as i32);
                    stages[i] = if ok { Stage::Succeeded } else { Stage::Failed };
                    open -= 1;
                    self.status.send_modify(|s| {
                        if ok {
                            s.succeeded += 1;
                        } else {
                            s.failed += 1;
                        }
                    });
                    i
                }
            };
            // Its children start once it serves, or from further up when
            // it will not.
            if matches!(stages[i], Stage::Serving | Stage::Succeeded | Stage::Failed) {
                for &c in &self.places[i].children {
                    if stages[c] == Stage::Waiting {
                        self.launch(c, &stages, &tx);
                        stages[c] = Stage::Started;
                    }
                }
            }
        }
        let instance = self.status.borrow().instance.clone();
        let sent = self
            .manager
            .source_bytes(&instance)
            .saturating_sub(self.sent_before);
        let elapsed = self.started.elapsed();
        // Relays serve their children after their own sync ended: what they
        // forwarded is known now.
        let relays = self
            .places
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.children.is_empty());
        let me = &self;
        let after = futures::future::join_all(
            relays.map(|(i, _)| async move { (i, me.relay_bytes_of(i).await) }),
        )
        .await;
        self.status.send_modify(|s| {
            for (i, bytes) in after {
                if let Some(b) = bytes {
                    s.nodes[i].relay_bytes = b.saturating_sub(relay_before[i]);
                }
            }
            s.done = true;
            s.origin_bytes_sent = sent;
            s.duration_ms = elapsed.as_millis() as u64;
        });
        let s = self.status.borrow();
        info!(fanout = %s.fanout_id, succeeded = s.succeeded, failed = s.failed, origin_bytes_sent = sent, ?elapsed, "fan-out finished");
    }

    /// Replica `i`'s agent's relay bytes, when it answers in time.
    async fn relay_bytes_of(&self, i: usize) -> Option<u64> {
        let channel = self
            .manager
            .dialer
            .connect_as(&self.req.replicas[i], CALL_TIMEOUT, self.req.auth.clone())
            .await
            .ok()?;
        relay_bytes(&mut OrchestratorClient::new(channel)).await
    }

    /// Starts replica `i`'s sync from its nearest ancestor that has not
    /// failed, with the rest of the way up to the origin as its upstream,
    /// and follows it.
    fn launch(&self, i: usize, stages: &[Stage], tx: &mpsc::Sender<Event>) {
        let addr = |j: usize| self.req.replicas[j].clone();
        let mut chain: Vec<String> = plan::ancestors(&self.places, i)
            .into_iter()
            .filter(|&a| stages[a] != Stage::Failed)
            .map(addr)
            .collect();
        chain.push(self.req.origin.clone());
        let stream = self.req.stream.then(|| pb::SetStreamUpstreamRequest {
            instance: self.req.instance.clone(),
            upstreams: chain.clone(),
        });
        let source = chain.remove(0);
        self.status
            .send_modify(|s| s.nodes[i].parent = source.clone());
        let start = pb::StartFullSyncRequest {
            source,
            transport: self.req.transport as i32,
            snapshot: self.status.borrow().snapshot.clone(),
            upstream: chain,
            instance: self.req.instance.clone(),
            source_instance: self.req.instance.clone(),
        };
        let follower = Follower {
            index: i,
            replica: addr(i),
            dialer: self.manager.dialer.clone(),
            auth: self.req.auth.clone(),
            tx: tx.clone(),
        };
        tokio::spawn(follower.run(stream, start));
    }
}

/// Starts one replica's sync and reports it until it ends.
struct Follower {
    index: usize,
    replica: String,
    dialer: Dialer,
    auth: ClientAuth,
    tx: mpsc::Sender<Event>,
}

type OrchestratorClient = pb::orchestrator_client::OrchestratorClient<AgentChannel>;

impl Follower {
    async fn run(
        self,
        stream: Option<pb::SetStreamUpstreamRequest>,
        start: pb::StartFullSyncRequest,
    ) {
        let i = self.index;
        let event = match self.follow(stream, start).await {
            Ok(()) => Event::Ended(i),
            Err(why) => Event::Lost(i, why),
        };
        let _ = self.tx.send(event).await;
    }

    /// `Ok` once the sync ended; `Err` when it could not be started or
    /// followed.
    async fn follow(
        &self,
        stream: Option<pb::SetStreamUpstreamRequest>,
        start: pb::StartFullSyncRequest,
    ) -> Result<(), String> {
        let replica = &self.replica;
        // Refused, unreachable, silent, or not an agent at all: until an
        // agent has answered, the caller is not told which (the origin is
        // no port scanner); its log says.
        let unreachable = |e: &dyn std::fmt::Display| {
            warn!(%replica, error = %e, "cannot reach a fan-out replica");
            format!("cannot reach an agent at {replica}")
        };
        let channel = self
            .dialer
            .connect_as(replica, CALL_TIMEOUT, self.auth.clone())
            .await
            .map_err(|e| unreachable(&e))?;
        let mut client = OrchestratorClient::new(channel);
        let status = client.get_status(pb::GetStatusRequest::default());
        let before = tokio::time::timeout(CALL_TIMEOUT, status)
            .await
            .map_err(|_| unreachable(&format!("no answer within {CALL_TIMEOUT:?}")))?
            .map_err(|s| unreachable(&s))?
            .into_inner()
            .relay_bytes;
        if let Some(chain) = stream {
            tokio::time::timeout(CALL_TIMEOUT, client.set_stream_upstream(chain))
                .await
                .map_err(|_| {
                    format!("{replica} did not answer SetStreamUpstream within {CALL_TIMEOUT:?}")
                })?
                .map_err(|s| {
                    format!("{replica} refused the stream's upstreams: {}", s.message())
                })?;
        }
        let started = tokio::time::timeout(CALL_TIMEOUT, client.start_full_sync(start))
            .await
            .map_err(|_| format!("{replica} did not answer StartFullSync within {CALL_TIMEOUT:?}"))?
            .map_err(|s| format!("{replica} refused the sync: {}", s.message()))?
            .into_inner();
        let id = started.sync_id;
        let _ = self
            .tx
            .send(Event::Started(self.index, id.clone(), before))
            .await;
        let mut stream = client
            .watch_sync(pb::WatchSyncRequest { sync_id: id })
            .await
            .map_err(|s| format!("cannot follow the sync on {replica}: {}", s.message()))?
            .into_inner();
        while let Some(p) = stream.next().await {
            let p = p.map_err(|s| format!("lost the sync on {replica}: {}", s.message()))?;
            let end = is_terminal(p.phase);
            let _ = self.tx.send(Event::Progress(self.index, Box::new(p))).await;
            if end {
                return Ok(());
            }
        }
        Err(format!(
            "{replica} stopped reporting the sync before it ended"
        ))
    }
}

/// The agent's `relay_bytes`, when its status can be read in time.
async fn relay_bytes(client: &mut OrchestratorClient) -> Option<u64> {
    let status = tokio::time::timeout(
        CALL_TIMEOUT,
        client.get_status(pb::GetStatusRequest::default()),
    );
    Some(status.await.ok()?.ok()?.into_inner().relay_bytes)
}
