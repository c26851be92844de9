//! `[stream]`: the replication stream's log (where it lives, how long
//! it keeps what, when it flushes), whom it follows and what it
//! acknowledges; and its checks.

use std::path::PathBuf;
use std::time::Duration;

use bytesize::ByteSize;
use serde::{Deserialize, Serialize};

use super::addr::is_host_port;
use super::{normal_path, Config, HostPort, Problems, ServerAuth};

/// Stream sessions an agent offers or serves at once, at most (every
/// instance, every host together).
pub const MAX_STREAM_SESSIONS: usize = 256;

/// The replication stream's log (`[stream]`, or `[instance.stream]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StreamConfig {
    /// The log's directory; empty (the default) leaves the stream off. On
    /// the primary's host (`[redis] primary_addr` set) the agent follows
    /// the primary as a replica into it; elsewhere it follows `upstream`.
    pub dir: PathBuf,
    /// The agent (its gRPC `host:port`) whose stream log this one follows,
    /// instead of a primary.
    pub upstream: String,
    /// The upstream's instance to follow (empty: this one's name).
    pub upstream_instance: String,
    /// The log keeps whole segments while it holds at most `retain` bytes
    /// and they are younger than `retain_age`, and always what the
    /// snapshots it offers need to continue.
    pub retain: ByteSize,
    #[serde(with = "humantime_serde")]
    pub retain_age: Duration,
    /// The size a segment file is closed at.
    pub segment_size: ByteSize,
    /// The log's newest bytes kept in memory (up to twice this), from which
    /// readers at or near its end are served without a file read; 0 reads
    /// every byte from the files.
    pub memory_tail: ByteSize,
    pub fsync: Fsync,
    /// What the agent that follows a primary acknowledges to it.
    pub ack: StreamAck,
    /// When the upstream agent no longer holds the log's offset (or, after
    /// a failover, the log went past the promotion point), start the log
    /// over at the snapshot the upstream names and sync that snapshot from
    /// it (re-seeding a `redis-stream` server), once no other upstream of
    /// the chain holds the offset. Off, the writer's state says it needs a
    /// snapshot, and a sync of one starts the log over. The old primary's
    /// agent uses it once a failover moved it onto another agent.
    pub reseed: bool,
    /// An agent that follows `upstream`: the RDMA ring it registers for the
    /// stream (a power of two, 1 MiB to 1 GiB; 0 keeps the stream on TCP).
    /// Used when `[transport] mode` is not `tcp`, both agents have RDMA and
    /// the same provider; a failed ring session goes on over TCP from what
    /// the log holds and the ring is tried again after `rdma_retry`.
    pub rdma_ring: ByteSize,
    /// How long the stream runs over TCP after a ring session failed
    /// before the ring is tried again.
    #[serde(with = "humantime_serde")]
    pub rdma_retry: Duration,
    /// A replica agent whose session's credit window stays full this long
    /// while the log holds more, or whose socket takes nothing for this
    /// long, is marked lagging (status,
    /// `kvsync_stream_lagging_downstreams`); its source keeps waiting and
    /// the log keeps the stream, the primary is never slowed.
    #[serde(with = "humantime_serde")]
    pub stall_timeout: Duration,
    /// A session stalled this long (its window full or its socket
    /// taking nothing while the log holds more) is ended: a replica that
    /// takes the stream again asks for a new one from its log's end, one
    /// that never does holds nothing of the source's.
    #[serde(with = "humantime_serde")]
    pub stall_end: Duration,
    /// Stream sessions offered or served at once to the agents of one
    /// host (by the address they ask from), every instance together.
    pub max_sessions_per_host: usize,
    /// A `redis-stream` server more than this many bytes behind the log,
    /// or still short of where the log stood `ready_lag` ago, makes its
    /// instance `degraded` (not ready in `/readyz`) until it catches up.
    pub ready_behind: ByteSize,
    #[serde(with = "humantime_serde")]
    pub ready_lag: Duration,
    /// The longest a ring session spins on its completion queue before it
    /// blocks on the completion channel (verbs spin 20 µs, 200 µs on soft
    /// devices; a lower value trades latency for CPU, 0 always blocks).
    #[serde(with = "humantime_serde")]
    pub rdma_spin: Duration,
    /// The agents (gRPC `host:port`) of the instance's other servers: at a
    /// failover (`kvsync stream follow --primary`) the log follows the one
    /// among them whose log follows the new primary. Each one's word on the
    /// server beside it (checked against that server's `run_id`) proves
    /// that server's address to a failover.
    pub peers: Vec<String>,
    /// The instance's other servers (`host:port`) a failover or a release
    /// may point a server at, besides `[redis]`'s own addresses and those
    /// the configured peers report: an address nothing proves is never
    /// sent `REPLICAOF`, `AUTH` or the password.
    pub servers: Vec<String>,
    /// Redis Sentinels (`host:port`) that watch the instance's primary:
    /// the agent asks them who the primary is (at start and after each
    /// reconnect) and follows each `+switch-master` of `master_name` as
    /// `kvsync stream follow --primary` does.
    pub sentinels: Vec<String>,
    /// The name the Sentinels monitor the primary under.
    pub master_name: String,
    /// The ACL user kvsync is to the Sentinels (empty: `default`).
    pub sentinel_user: String,
    /// The Sentinels' password (`requirepass`, or the user's), if they
    /// have one. Prefer `sentinel_password_file`.
    pub sentinel_password: String,
    /// A file holding the Sentinels' password, read at every connection.
    pub sentinel_password_file: PathBuf,
    /// Reach the Sentinels over TLS, with `[redis]`'s TLS files.
    pub sentinel_tls: bool,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            dir: PathBuf::new(),
            upstream: String::new(),
            upstream_instance: String::new(),
            retain: ByteSize::gib(1),
            retain_age: Duration::from_secs(24 * 3600),
            segment_size: ByteSize::mib(64),
            memory_tail: ByteSize::mib(8),
            fsync: Fsync::Everysec,
            ack: StreamAck::Log,
            reseed: true,
            rdma_ring: ByteSize::mib(16),
            rdma_retry: Duration::from_secs(30),
            stall_timeout: Duration::from_secs(10),
            stall_end: Duration::from_secs(60),
            max_sessions_per_host: 32,
            ready_behind: ByteSize::mib(64),
            ready_lag: Duration::from_secs(30),
            rdma_spin: Duration::from_micros(200),
            peers: Vec::new(),
            servers: Vec::new(),
            sentinels: Vec::new(),
            master_name: String::new(),
            sentinel_user: String::new(),
            sentinel_password: String::new(),
            sentinel_password_file: PathBuf::new(),
            sentinel_tls: false,
        }
    }
}

impl StreamConfig {
    pub fn enabled(&self) -> bool {
        !self.dir.as_os_str().is_empty()
    }

    /// The instance asked of upstreams and peers for instance `name`.
    pub fn upstream_instance_of(&self, name: &str) -> String {
        match self.upstream_instance.as_str() {
            "" => name.to_string(),
            other => other.to_string(),
        }
    }
}

/// What the agent that follows a primary acknowledges to it (`REPLCONF
/// ACK`), which is what the primary's `WAIT` and `min-replicas-to-write`
/// count it for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StreamAck {
    /// The log's end: the agent counts as one replica once the bytes are in
    /// its log, as a plain replica counts once it has them. The default:
    /// the primary's link and its writers never wait on the agents and
    /// servers further down, which a replica of the primary could not
    /// speak for anyway.
    Log,
    /// The lowest offset the servers fed from the log (directly, or through
    /// the agents it serves) acknowledged, so `WAIT 1` returns once a replica
    /// server has the write. With no downstream connected the agent sends
    /// no acknowledgement at all: `min-replicas-max-lag` then sees it lag
    /// (write safety degrades, as it should), and after the primary's
    /// `repl-timeout` the primary drops it and it continues from its log.
    Replicas,
}

impl StreamAck {
    pub fn name(self) -> &'static str {
        match self {
            StreamAck::Log => "log",
            StreamAck::Replicas => "replicas",
        }
    }
}

/// When the stream log's records are flushed to the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fsync {
    /// After every record: nothing acknowledged is lost to a power cut.
    Always,
    /// At most a second after a record, as AOF's `everysec`: a power cut
    /// may lose the last second, a crash of the agent loses nothing.
    Everysec,
}

impl Config {
    /// `[stream]`: a log needs a primary to follow, a directory of its own.
    /// How the agent reaches and logs in to the Sentinels (over TLS with
    /// `[redis]`'s files when `sentinel_tls` is on).
    pub fn sentinel_auth(&self) -> ServerAuth {
        let st = &self.stream;
        let tls = st.sentinel_tls.then(|| self.redis.tls_file_set());
        ServerAuth::new(
            &st.sentinel_user,
            &st.sentinel_password,
            &st.sentinel_password_file,
        )
        .with_tls(tls)
    }

    pub(super) fn check_stream(&self, p: &mut Problems) {
        let st = &self.stream;
        if !st.enabled() {
            return;
        }
        if !st.dir.is_absolute() {
            p.bad(
                "stream.dir",
                format!("must be an absolute path, got {:?}", st.dir),
            );
        }
        if normal_path(&st.dir) == normal_path(&self.snapshot_dir) {
            p.bad(
                "stream.dir",
                "must not be snapshot_dir, whose every file is taken for a snapshot".into(),
            );
        }
        match (self.redis.primary_addr.is_empty(), st.upstream.is_empty()) {
            (true, true) => p.bad(
                "stream.dir",
                "needs what to follow into the log: [redis] primary_addr (the local primary) or stream.upstream (another agent)".into(),
            ),
            (false, false) => p.bad(
                "stream.upstream",
                "a log follows one source: the primary of [redis] primary_addr or stream.upstream, not both".into(),
            ),
            _ => {}
        }
        if !st.upstream.is_empty() && !is_host_port(&st.upstream) {
            p.bad(
                "stream.upstream",
                format!("must be an agent's gRPC host:port, got {:?}", st.upstream),
            );
        }
        if let Some(bad) = st.peers.iter().find(|a| !is_host_port(a)) {
            p.bad(
                "stream.peers",
                format!("must be agents' gRPC host:port, got {bad:?}"),
            );
        }
        if let Some(bad) = st.servers.iter().find(|a| !is_host_port(a)) {
            p.bad(
                "stream.servers",
                format!("must be servers' host:port, got {bad:?}"),
            );
        }
        self.check_sentinels(p);
        if !st.upstream.is_empty() && st.ack != StreamAck::Log {
            p.bad(
                "stream.ack",
                "is what the agent that follows a primary acknowledges to it; an agent that follows stream.upstream always passes its servers' acknowledgements on".into(),
            );
        }
        if !(ByteSize::mib(1)..=ByteSize::gib(4)).contains(&st.segment_size) {
            p.bad(
                "stream.segment_size",
                format!("must be 1 MiB to 4 GiB, got {}", st.segment_size),
            );
        }
        let ring = st.rdma_ring.as_u64();
        if ring != 0
            && (!ring.is_power_of_two()
                || !(crate::blk3::ring::MIN_RING..=crate::blk3::ring::MAX_RING).contains(&ring))
        {
            p.bad(
                "stream.rdma_ring",
                format!(
                    "must be 0 or a power of two from 1 MiB to 1 GiB, got {}",
                    st.rdma_ring
                ),
            );
        }
        if st.stall_end <= st.stall_timeout {
            p.bad(
                "stream.stall_end",
                format!(
                    "must be longer than stall_timeout ({:?}), got {:?}",
                    st.stall_timeout, st.stall_end
                ),
            );
        }
        let most = MAX_STREAM_SESSIONS;
        if !(1..=most).contains(&st.max_sessions_per_host) {
            p.bad(
                "stream.max_sessions_per_host",
                format!("must be 1 to {most}, got {}", st.max_sessions_per_host),
            );
        }
        if st.memory_tail > ByteSize::gib(1) {
            p.bad(
                "stream.memory_tail",
                format!("must be at most 1 GiB, got {}", st.memory_tail),
            );
        }
        if st.retain < st.segment_size {
            p.bad(
                "stream.retain",
                format!(
                    "must hold at least one segment ({}), got {}",
                    st.segment_size, st.retain
                ),
            );
        }
    }

    /// `[stream] sentinels`: each a host:port listed once (each is one vote
    /// of the majority the agent acts on), with the name they monitor the
    /// primary under and the peers a failover picks among.
    fn check_sentinels(&self, p: &mut Problems) {
        let st = &self.stream;
        if let Some(bad) = st.sentinels.iter().find(|a| !is_host_port(a)) {
            p.bad(
                "stream.sentinels",
                format!("must be Sentinels' host:port, got {bad:?}"),
            );
        }
        let one = |a: &String| a.parse::<HostPort>().ok().map(|a| a.same_host_key());
        if let Some(twice) = st.sentinels.iter().enumerate().find_map(|(n, a)| {
            let key = one(a)?;
            st.sentinels[..n]
                .iter()
                .any(|b| one(b).as_ref() == Some(&key))
                .then_some(a)
        }) {
            p.bad(
                "stream.sentinels",
                format!("lists the Sentinel at {twice:?} twice (under one name or another): each Sentinel is one vote of the majority the agent acts on"),
            );
        }
        if !st.sentinels.is_empty() && st.peers.is_empty() {
            p.bad(
                "stream.peers",
                "must name the agents of the instance's other servers when stream.sentinels is set: after a failover the log follows the one among them that follows the new primary".into(),
            );
        }
        if st.sentinels.is_empty() != st.master_name.is_empty() {
            p.bad(
                "stream.master_name",
                "and stream.sentinels go together: the Sentinels to ask and the name they monitor the primary under".into(),
            );
        }
    }
}
