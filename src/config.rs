//! Agent configuration: the TOML schema, its defaults, and `validate()`.
//!
//! Owns parsing (serde, `deny_unknown_fields`, human sizes and durations) and
//! the semantic checks that report every bad setting at once, each with its
//! key. It does not open sockets or directories; callers do that with the
//! values found here. CLI flags override the file in `cli`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytesize::ByteSize;
use serde::{Deserialize, Serialize};

use crate::blk3::plan::MAX_CHUNK_MB;
use crate::snapshot::Format;
use crate::sys::pem::{read_pem, PemKind};

/// The whole agent configuration (one TOML file).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Name of this agent in logs, status and handoff records.
    pub node_id: String,
    /// Directory the local KV writes its snapshots to (source role) and where
    /// received snapshots are installed (replica role).
    pub snapshot_dir: PathBuf,
    /// Format of the snapshots in `snapshot_dir`.
    pub snapshot_format: Format,
    pub grpc: GrpcConfig,
    pub data: DataConfig,
    pub transport: TransportConfig,
    pub metrics: MetricsConfig,
    pub handoff: HandoffConfig,
    pub cache: CacheConfig,
    pub watch: WatchConfig,
    pub sync: SyncConfig,
    pub redis: RedisConfig,
    pub stream: StreamConfig,
    pub auth: AuthConfig,
    pub tls: TlsConfig,
    pub fanout: FanoutConfig,
    /// The KV instances this agent serves (`[[instance]]`), when it serves
    /// more than the one the top-level `snapshot_dir`, `snapshot_format`,
    /// `[handoff]` and `[redis]` describe; those four are then set in each
    /// instance instead.
    pub instance: Vec<InstanceConfig>,
}

/// The name of the one instance of a file without `[[instance]]` tables.
pub const DEFAULT_INSTANCE: &str = "default";

/// The settings that belong to one KV instance: its snapshot directory and
/// format, how a received snapshot reaches it, and its Redis/Valkey server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InstanceConfig {
    /// How requests, status and metrics (`kv_instance`) name it: a plain
    /// name, as node ids are.
    pub name: String,
    pub snapshot_dir: PathBuf,
    pub snapshot_format: Format,
    pub handoff: HandoffConfig,
    pub redis: RedisConfig,
    pub stream: StreamConfig,
}

impl Default for InstanceConfig {
    fn default() -> Self {
        let c = Config::default();
        InstanceConfig {
            name: String::new(),
            snapshot_dir: c.snapshot_dir,
            snapshot_format: c.snapshot_format,
            handoff: c.handoff,
            redis: c.redis,
            stream: c.stream,
        }
    }
}

/// The keys a file with `[[instance]]` tables sets per instance only.
const INSTANCE_KEYS: [&str; 5] = [
    "snapshot_dir",
    "snapshot_format",
    "handoff",
    "redis",
    "stream",
];

/// The replication stream's log (`[stream]`, or `[instance.stream]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
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
    pub fsync: Fsync,
    /// What the agent that follows a primary acknowledges to it.
    pub ack: StreamAck,
    /// When the upstream agent no longer holds the log's offset (or, after
    /// a failover, the log went past the promotion point), start the log
    /// over at the snapshot the upstream names and sync that snapshot from
    /// it (re-seeding a `redis-stream` server), instead of only reporting
    /// it. The old primary's agent uses it once a failover moved it onto
    /// another agent.
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
    /// The Sentinels' `requirepass`, if they have one.
    pub sentinel_password: String,
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
            fsync: Fsync::Everysec,
            ack: StreamAck::Log,
            reseed: false,
            rdma_ring: ByteSize::mib(16),
            rdma_retry: Duration::from_secs(30),
            stall_timeout: Duration::from_secs(10),
            rdma_spin: Duration::from_micros(200),
            peers: Vec::new(),
            servers: Vec::new(),
            sentinels: Vec::new(),
            master_name: String::new(),
            sentinel_password: String::new(),
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

/// Fan-outs this agent runs as their origin.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FanoutConfig {
    /// The replicas' agents a fan-out may call, with the caller's token:
    /// gRPC addresses (`host:port`) or names a certificate proves, as for
    /// `[sync] allowed_sources`; empty allows any address a caller names.
    pub allowed_replicas: Vec<String>,
}

/// TLS of the control plane (gRPC), for the server and for every connection
/// this agent makes to other agents. On when the three files are set.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// This agent's certificate chain (PEM): served, and presented to peers
    /// that require client certificates.
    pub cert_file: Option<PathBuf>,
    /// Its private key (PEM).
    pub key_file: Option<PathBuf>,
    /// The CA certificates (PEM) other agents' certificates must chain to.
    pub ca_file: Option<PathBuf>,
    /// Require clients (orchestrators, CLIs, other agents) to present a
    /// certificate signed by `ca_file` (mutual TLS).
    pub client_auth: bool,
    /// Name checked in peers' certificates instead of the host part of
    /// their address (for fleets that address agents by IP).
    pub server_name: String,
}

impl Config {
    /// Whether this agent encrypts its TCP data path (when its peer can).
    pub fn data_tls(&self) -> bool {
        self.data.tls != DataTls::Off && self.tls.enabled()
    }

    /// Whether this agent may use RDMA, which has no TLS: not when the data
    /// plane must be encrypted, unless the fabric is declared trusted.
    pub fn rdma_allowed_unencrypted(&self) -> bool {
        self.data.tls != DataTls::Required || self.transport.rdma_unencrypted_ok
    }
}

impl TlsConfig {
    /// True when any of the files is set (validation then requires all three).
    pub fn enabled(&self) -> bool {
        self.cert_file.is_some() || self.key_file.is_some() || self.ca_file.is_some()
    }
}

/// Control-plane authentication.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// File of accepted bearer tokens (one per line; the first is presented
    /// to peers). Every Orchestrator and Peer RPC must carry one. Empty
    /// turns authentication off. Reloaded on SIGHUP.
    pub token_file: Option<PathBuf>,
    /// Tokens of the agent-to-agent Peer service. When set, Peer calls need
    /// one of these and Orchestrator calls one of `token_file`'s (a token of
    /// the other service gets PERMISSION_DENIED), and the first is what this
    /// agent presents to sources. Reloaded on SIGHUP.
    pub peer_token_file: Option<PathBuf>,
    /// Present this agent's token to a non-loopback source without TLS
    /// (trusted networks only); refused otherwise.
    pub send_token_in_clear: bool,
}

/// Redis/Valkey: the local primary (source role, pre-flight check) and the
/// local server a `redis` handoff seeds (replica role).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// Source: the local primary (`host:port`) whose backlog must still hold
    /// M+1 before a snapshot is offered; empty skips the check.
    pub primary_addr: String,
    /// Password for the servers (`AUTH`), if they require one.
    pub password: String,
    /// Replica: the local server (`host:port`).
    pub server_addr: String,
    /// Replica: the server's `dir` and `dbfilename`.
    pub dir: PathBuf,
    pub dbfilename: String,
    /// Replica: the primary to follow (`host:port`).
    pub primary: String,
    /// Replica: the command that (re)starts the server with `replicaof
    /// <primary>` and `appendonly no`, and returns once it is started
    /// (e.g. `systemctl restart redis-replica`, or `redis-server … --daemonize
    /// yes`). `{primary_host}`, `{primary_port}`, `{dir}`, `{dbfilename}` are
    /// replaced.
    pub start: Vec<String>,
    /// Replica: the command that stops the server; empty sends
    /// `SHUTDOWN NOSAVE` to `server_addr`.
    pub stop: Vec<String>,
    /// How often the local server's replication state is read into the
    /// `kvsync_kv_*` metrics (`0s` turns it off).
    #[serde(with = "humantime_serde")]
    pub health_interval: Duration,
    /// Source: the backlog guard. The primary's write rate is measured over
    /// the last `rate_window`, sampled in the background (`0s`: not
    /// measured); a seeding is estimated to take
    /// the RDB's size at the slowest of `expected_transfer_rate`, the rate
    /// this agent last served a session at and its `[sync] rate_limit`,
    /// plus its size at the rate a replica last
    /// reported loading one (else `expected_load_rate`); the
    /// backlog must hold what was written since the save plus that rate
    /// over that time, times `backlog_safety`, or the offer is refused.
    #[serde(with = "humantime_serde")]
    pub rate_window: Duration,
    pub expected_transfer_rate: ByteSize,
    pub expected_load_rate: ByteSize,
    pub backlog_safety: f64,
    /// Source: instead of refusing, raise the primary's `repl-backlog-size`
    /// (`CONFIG SET`) to what a seeding needs, up to `max_backlog`, at the
    /// offer and again whenever the primary writes faster during the
    /// seeding than foreseen, and put the operator's value back once no
    /// seeding needs it (Redis 7.0 and later, Valkey: older servers lose
    /// the backlog on a resize).
    pub grow_backlog: bool,
    pub max_backlog: ByteSize,
    /// Source: where the operator's `repl-backlog-size` is remembered while
    /// kvsync's is in force; empty means `<snapshot_dir>/.kvsync-redis-backlog`.
    /// Set it when the agent may only read the primary's directory.
    pub backlog_record: PathBuf,
    /// Replica (handoff mode `redis`): how often a sample of keys is
    /// compared with `primary` (`0s`: never), and how many keys.
    #[serde(with = "humantime_serde")]
    pub consistency_interval: Duration,
    pub consistency_sample: usize,
    /// Replica (handoff mode `redis-replicate`): where the agent listens,
    /// for one connection from the local server, while it serves it the
    /// RDB as its master (a fresh port per sync with port 0).
    pub seed_listen: String,
}

impl RedisConfig {
    /// The local server whose replication health the agent reports: the
    /// primary it pre-flights, or the replica a `redis` handoff seeds.
    pub fn local_server(&self, handoff: HandoffMode) -> Option<&str> {
        if !self.primary_addr.is_empty() {
            Some(&self.primary_addr)
        } else if handoff.is_redis() {
            Some(&self.server_addr)
        } else {
            None
        }
    }
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            primary_addr: String::new(),
            password: String::new(),
            server_addr: "127.0.0.1:6379".into(),
            dir: PathBuf::from("/var/lib/redis"),
            dbfilename: "dump.rdb".into(),
            primary: String::new(),
            start: Vec::new(),
            stop: Vec::new(),
            health_interval: Duration::from_secs(5),
            rate_window: Duration::from_secs(2),
            expected_transfer_rate: ByteSize::mib(100),
            expected_load_rate: ByteSize::mib(32),
            backlog_safety: 2.0,
            grow_backlog: false,
            max_backlog: ByteSize::gib(1),
            backlog_record: PathBuf::new(),
            consistency_interval: Duration::ZERO,
            consistency_sample: 1000,
            seed_listen: "127.0.0.1:0".into(),
        }
    }
}

/// A `host:port` address: a name or an IP (an IPv6 one in brackets) and a
/// numeric port. Addresses are read with this, never split by hand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort {
    pub host: String,
    pub port: u16,
}

impl HostPort {
    /// What tells two spellings of one address apart from two addresses,
    /// without asking a resolver: the host in lower case, an IP address in
    /// its canonical form, every loopback name and address as one, and
    /// the port's number.
    pub fn same_host_key(&self) -> (String, u16) {
        let host = match crate::sys::numeric_ip(&self.host).map(|ip| ip.to_canonical()) {
            Some(ip) if ip.is_loopback() || ip.is_unspecified() => "local".to_string(),
            Some(ip) => ip.to_string(),
            None if self.host.eq_ignore_ascii_case("localhost") => "local".to_string(),
            None => self.host.to_ascii_lowercase(),
        };
        (host, self.port)
    }
}

/// Text that is not `host:port`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not host:port")]
pub struct NotHostPort(pub String);

impl std::str::FromStr for HostPort {
    type Err = NotHostPort;

    fn from_str(s: &str) -> Result<HostPort, NotHostPort> {
        let bad = || NotHostPort(s.chars().take(300).collect());
        let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
        let port = port.parse().map_err(|_| bad())?;
        let host = match host.strip_prefix('[') {
            Some(inner) => inner.strip_suffix(']').ok_or_else(bad)?,
            None if host.contains(':') => return Err(bad()),
            None => host,
        };
        if host.is_empty() {
            return Err(bad());
        }
        Ok(HostPort {
            host: host.to_string(),
            port,
        })
    }
}

impl std::fmt::Display for HostPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.host.contains(':') {
            true => write!(f, "[{}]:{}", self.host, self.port),
            false => write!(f, "{}:{}", self.host, self.port),
        }
    }
}

/// True for `host:port` with a numeric port.
fn is_host_port(s: &str) -> bool {
    s.parse::<HostPort>().is_ok()
}

/// Control plane (gRPC) settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GrpcConfig {
    /// Address the gRPC server binds (`host:port`; port 0 picks a free port).
    pub listen: String,
    /// Serve gRPC without TLS on an address other hosts can reach. Without
    /// `[tls]`, only a loopback `listen` is accepted unless this is set.
    pub plaintext: bool,
    /// Open connections, at most, in total and from one address; more are
    /// closed at once.
    pub max_connections: usize,
    pub max_connections_per_peer: usize,
    /// Requests in flight on one connection (HTTP/2 streams), at most.
    pub max_streams_per_connection: u32,
    /// How long a connection may take to make its first authenticated
    /// request; one that has not is closed then, or earlier when a
    /// newcomer needs its place at a connection limit.
    #[serde(with = "humantime_serde")]
    pub handshake_timeout: Duration,
}

/// Data plane settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Address of the TCP data listener (`host:port`).
    pub tcp_listen: String,
    /// Port of the RDMA listener, bound to the chosen interface address
    /// (never a wildcard); 0 picks a free port.
    pub rdma_port: u16,
    /// A data connection whose peer stops answering (link cut, host gone)
    /// fails after this long.
    #[serde(with = "humantime_serde")]
    pub peer_timeout: Duration,
    /// The least a bulk transfer must move per second, averaged over
    /// `min_rate_window`, or the session ends (`0` turns the floor off).
    pub min_rate: ByteSize,
    #[serde(with = "humantime_serde")]
    pub min_rate_window: Duration,
    /// How long a new data connection may take to prove its session; until
    /// it has, it holds no thread and no memory beyond its socket.
    #[serde(with = "humantime_serde")]
    pub hello_timeout: Duration,
    /// Data connections still proving their session, at most, in total and
    /// from one address; more are closed at once.
    pub max_pending_connections: usize,
    pub max_pending_per_peer: usize,
    /// TLS on the TCP data path (with the `[tls]` files).
    pub tls: DataTls,
    /// After rustls's handshake, hand the records to the kernel (kTLS)
    /// where it has the `tls` module: the source then sends with
    /// `sendfile` as without TLS, and the replica reads decrypted bytes.
    pub kernel_tls: bool,
    /// Source: the size of the pieces its snapshots are checked and
    /// resumed in (a power of two, 1 MiB to 256 MiB).
    pub piece_size: ByteSize,
    /// Replica: how often one damaged piece is fetched again before the
    /// session fails (0 to 8).
    pub piece_retries: u32,
    /// Replica: how long a partly received snapshot with its journal is
    /// kept for a sync to resume.
    #[serde(with = "humantime_serde")]
    pub resume_ttl: Duration,
    /// Replica: TCP connections one sync runs on at once, each taking
    /// its pieces from the session's queue (1 to [`MAX_TCP_STREAMS`]), or
    /// `"auto"`: one, and more once its first second shows a long link
    /// (`sync::streams::auto_count`). More than one helps where one stream
    /// is limited by its window: long, fat links. Source: the most it
    /// grants one session (`"auto"`: [`AUTO_TCP_STREAMS`]).
    pub tcp_streams: TcpStreams,
}

/// The most TCP streams one sync runs on.
pub const MAX_TCP_STREAMS: u32 = 16;

/// The most TCP streams `tcp_streams = "auto"` asks for and grants.
pub const AUTO_TCP_STREAMS: u32 = 8;

/// `[data] tcp_streams`: a count, or `"auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TcpStreams {
    /// This many, as far as the source grants them.
    Fixed(u32),
    /// One to start with; the count from its measured round trip and
    /// first second.
    Auto(Auto),
}

/// The word `"auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Auto {
    Auto,
}

impl TcpStreams {
    pub const AUTO: TcpStreams = TcpStreams::Auto(Auto::Auto);

    /// The most streams this setting asks for (replica) or grants (source).
    pub fn most(self) -> u32 {
        match self {
            TcpStreams::Fixed(n) => n,
            TcpStreams::Auto(_) => AUTO_TCP_STREAMS,
        }
    }

    pub fn is_auto(self) -> bool {
        matches!(self, TcpStreams::Auto(_))
    }
}

impl std::fmt::Display for TcpStreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TcpStreams::Fixed(n) => write!(f, "{n}"),
            TcpStreams::Auto(_) => f.write_str("\"auto\""),
        }
    }
}

/// The most data connections a source serves at once: each of the
/// `sync.max_outgoing_syncs` sessions on up to `data.tcp_streams` streams,
/// each stream on a thread of its own (the agent's thread pool has room
/// for these and its other blocking work).
pub const MAX_SERVED_STREAMS: usize = 1024;

/// Whether the TCP data path is encrypted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataTls {
    /// On when `[tls]` is configured on both ends.
    Auto,
    /// Always: a peer without TLS is refused, and RDMA (which has no TLS)
    /// is not used unless `[transport] rdma_unencrypted_ok`.
    Required,
    /// Never.
    Off,
}

/// Which data transport a sync uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportMode {
    /// Never probe RDMA.
    Tcp,
    /// Require RDMA (fail unless `fallback_to_tcp`).
    Rdma,
    /// Probe; RDMA if usable, else TCP.
    Auto,
}

impl std::fmt::Display for TransportMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportMode::Tcp => "tcp",
            TransportMode::Rdma => "rdma",
            TransportMode::Auto => "auto",
        })
    }
}

/// Transport and BLK3 bulk-phase tuning.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransportConfig {
    pub mode: TransportMode,
    /// RDMA Write chunk size in MiB (1..=32).
    pub chunk_mb: u32,
    /// RDMA Writes in flight, posted as one linked list (1..=1024).
    pub pipeline: u32,
    /// Signal every n-th Write (1..=pipeline).
    pub signal_batch: u32,
    /// With `mode = "rdma"`, retry a failed RDMA session over TCP (`auto`
    /// always does).
    pub fallback_to_tcp: bool,
    /// With `[data] tls = "required"`, RDMA (unencrypted) may still be used:
    /// the fabric is trusted (isolated, or IPsec/MACsec below it).
    pub rdma_unencrypted_ok: bool,
    /// RDMA implementation: real verbs, or the userspace emulation.
    pub rdma_provider: RdmaProvider,
    /// Interface (name or address) for RDMA; empty picks one by score.
    pub interface: String,
}

/// Which RDMA implementation moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RdmaProvider {
    /// libibverbs + librdmacm (a NIC, or soft-RoCE).
    Verbs,
    /// The emulated RC fabric over TCP: an emulation for tests and hosts
    /// without RDMA, not a fast path.
    Emulated,
}

impl RdmaProvider {
    pub fn as_str(self) -> &'static str {
        match self {
            RdmaProvider::Verbs => "verbs",
            RdmaProvider::Emulated => "emulated",
        }
    }
}

impl std::fmt::Display for RdmaProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Prometheus endpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Address serving `/metrics` (empty string disables the endpoint).
    pub listen: String,
}

/// How a received snapshot is handed to the local KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HandoffMode {
    /// Only the `.replmeta` record.
    File,
    /// Send a templated line to the KV's admin address, expect `+OK`.
    Command,
    /// Run a program with `KVSYNC_*` variables.
    Exec,
    /// Redis/Valkey restart with `replicaof`.
    Redis,
    /// Redis/Valkey seeded over the replication protocol by the agent,
    /// without a restart.
    #[serde(rename = "redis-replicate")]
    RedisReplicate,
    /// Redis/Valkey fed by the agent as its master from the stream log
    /// (`[stream]`), seeded with the snapshot first, without a restart.
    #[serde(rename = "redis-stream")]
    RedisStream,
}

impl HandoffMode {
    /// The name in the configuration and the `mode` metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            HandoffMode::File => "file",
            HandoffMode::Command => "command",
            HandoffMode::Exec => "exec",
            HandoffMode::Redis => "redis",
            HandoffMode::RedisReplicate => "redis-replicate",
            HandoffMode::RedisStream => "redis-stream",
        }
    }

    /// A mode that seeds a Redis/Valkey server.
    pub fn is_redis(self) -> bool {
        matches!(
            self,
            HandoffMode::Redis | HandoffMode::RedisReplicate | HandoffMode::RedisStream
        )
    }
}

/// Handoff settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HandoffConfig {
    pub mode: HandoffMode,
    /// `command` mode: the KV's admin address (`host:port`).
    pub command_addr: String,
    /// `command` mode: the line sent; `{seq}`, `{path}`, `{source}` are replaced.
    pub command_template: String,
    /// `exec` mode: program and arguments.
    pub exec: Vec<String>,
    /// Deadline for the KV to accept the handoff.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
}

/// Shared snapshot cache (source side).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Most memory all loaded snapshot buffers may take together.
    pub memory_budget: ByteSize,
    /// How long a new session waits for budget before it is refused.
    #[serde(with = "humantime_serde")]
    pub acquire_timeout: Duration,
    /// How long a loaded snapshot nobody holds stays in memory, so that a
    /// straggler replica shares it (`0s`: freed at once).
    #[serde(with = "humantime_serde")]
    pub linger: Duration,
}

/// Snapshot directory watcher.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WatchConfig {
    /// A file must be quiet this long before it is validated.
    #[serde(with = "humantime_serde")]
    pub debounce: Duration,
    /// Full rescan interval (a safety net for missed events).
    #[serde(with = "humantime_serde")]
    pub rescan_interval: Duration,
}

/// Replica-side sync jobs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SyncConfig {
    /// Completed syncs kept in status.
    pub keep_recent: usize,
    /// Lifetime of a data-plane session token handed out by a source.
    #[serde(with = "humantime_serde")]
    pub session_token_ttl: Duration,
    /// Replica syncs running at once; more are refused (RESOURCE_EXHAUSTED).
    pub max_incoming_syncs: usize,
    /// Source sessions offered or served at once; more are refused.
    pub max_outgoing_syncs: usize,
    /// On SIGTERM/SIGINT: how long running transfers may take to finish
    /// before they are cancelled.
    #[serde(with = "humantime_serde")]
    pub drain_timeout: Duration,
    /// Data-plane bandwidth limit of this agent, bytes per second (`0` =
    /// unlimited); applies to TCP sends and receives and to RDMA writes.
    /// Reloaded on SIGHUP.
    pub rate_limit: ByteSize,
    /// Retries of a sync after a transient failure (source unreachable or
    /// busy, network cut, one checksum mismatch).
    pub retries: u32,
    /// First retry delay; doubles per attempt (with jitter) up to the max.
    #[serde(with = "humantime_serde")]
    pub retry_backoff: Duration,
    #[serde(with = "humantime_serde")]
    pub retry_backoff_max: Duration,
    /// Largest snapshot this agent accepts from a source; a larger offer is
    /// refused before anything is reserved.
    pub max_snapshot_bytes: ByteSize,
    /// Free space a sync must leave on the snapshot directory's file
    /// system (the KV shares the disk).
    pub min_free_after: ByteSize,
    /// Sources this agent pulls from: gRPC addresses (`host:port`) or node
    /// ids; empty allows any source the orchestrator names.
    pub allowed_sources: Vec<String>,
    /// Sessions one replica (a node id at an address) may hold on one
    /// instance of this source at once.
    pub max_sessions_per_replica: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            node_id: default_node_id(),
            snapshot_dir: PathBuf::from("/var/lib/kvstore/snapshots"),
            snapshot_format: Format::Kvr1,
            grpc: GrpcConfig::default(),
            data: DataConfig::default(),
            transport: TransportConfig::default(),
            metrics: MetricsConfig::default(),
            handoff: HandoffConfig::default(),
            cache: CacheConfig::default(),
            watch: WatchConfig::default(),
            sync: SyncConfig::default(),
            redis: RedisConfig::default(),
            stream: StreamConfig::default(),
            auth: AuthConfig::default(),
            tls: TlsConfig::default(),
            fanout: FanoutConfig::default(),
            instance: Vec::new(),
        }
    }
}

fn default_node_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "kvsync".to_string())
}

impl Default for GrpcConfig {
    fn default() -> Self {
        GrpcConfig {
            listen: "127.0.0.1:35101".into(),
            plaintext: false,
            max_connections: 1024,
            max_connections_per_peer: 64,
            max_streams_per_connection: 128,
            handshake_timeout: Duration::from_secs(5),
        }
    }
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            tcp_listen: "127.0.0.1:35102".into(),
            rdma_port: 35201,
            peer_timeout: Duration::from_secs(30),
            min_rate: ByteSize::mib(1),
            min_rate_window: Duration::from_secs(30),
            hello_timeout: Duration::from_secs(5),
            max_pending_connections: 4096,
            max_pending_per_peer: 64,
            tls: DataTls::Auto,
            kernel_tls: true,
            piece_size: ByteSize::b(crate::snapshot::manifest::DEFAULT_PIECE_SIZE),
            piece_retries: 3,
            resume_ttl: Duration::from_secs(3600),
            tcp_streams: TcpStreams::Fixed(1),
        }
    }
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            mode: TransportMode::Auto,
            chunk_mb: 4,
            pipeline: 32,
            signal_batch: 8,
            fallback_to_tcp: true,
            rdma_unencrypted_ok: false,
            rdma_provider: RdmaProvider::Verbs,
            interface: String::new(),
        }
    }
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            listen: "127.0.0.1:9464".into(),
        }
    }
}

impl Default for HandoffConfig {
    fn default() -> Self {
        HandoffConfig {
            mode: HandoffMode::File,
            command_addr: String::new(),
            command_template: "REPLMETA {seq} {path}".into(),
            exec: Vec::new(),
            timeout: Duration::from_secs(30),
        }
    }
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            memory_budget: ByteSize::gib(8),
            acquire_timeout: Duration::from_secs(60),
            linger: Duration::from_secs(30),
        }
    }
}

impl Default for WatchConfig {
    fn default() -> Self {
        WatchConfig {
            debounce: Duration::from_millis(500),
            rescan_interval: Duration::from_secs(30),
        }
    }
}

impl Default for SyncConfig {
    fn default() -> Self {
        SyncConfig {
            keep_recent: 32,
            session_token_ttl: Duration::from_secs(60),
            max_incoming_syncs: 4,
            max_outgoing_syncs: 16,
            drain_timeout: Duration::from_secs(120),
            rate_limit: ByteSize::b(0),
            retries: 3,
            retry_backoff: Duration::from_secs(1),
            retry_backoff_max: Duration::from_secs(30),
            max_snapshot_bytes: ByteSize::tib(1),
            min_free_after: ByteSize::mib(256),
            allowed_sources: Vec::new(),
            max_sessions_per_replica: 4,
        }
    }
}

/// One bad setting: the dotted key and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub key: String,
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

/// Why a configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file is not valid TOML for this schema (unknown key, wrong type).
    #[error("invalid config {path}: {message}")]
    Parse { path: PathBuf, message: String },
    /// Settings parsed but are not usable; every problem is listed.
    #[error("invalid configuration ({} problems):\n{}", .0.len(), .0.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Problem>),
}

impl Config {
    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let config = Config::read(path)?;
        config.validate().map_err(ConfigError::Invalid)?;
        Ok(config)
    }

    /// Reads and parses a config file, without validating it (for callers
    /// that apply overrides first, then validate).
    pub fn read(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Config::parse(&text).map_err(|message| ConfigError::Parse {
            path: path.to_owned(),
            message,
        })
    }

    /// Parses TOML text (no validation).
    pub fn parse(text: &str) -> Result<Config, String> {
        let table: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
        if table.contains_key("instance") {
            if let Some(key) = INSTANCE_KEYS.iter().find(|k| table.contains_key(**k)) {
                return Err(format!(
                    "`{key}` is set at the top level and the file has [[instance]] tables: with instances, {} belong in each [[instance]]",
                    INSTANCE_KEYS.join(", ")
                ));
            }
        }
        toml::from_str(text).map_err(|e| e.to_string())
    }

    /// The instances this agent serves: the `[[instance]]` tables, or the
    /// one named `default` that the top-level sections describe.
    pub fn instances(&self) -> Vec<InstanceConfig> {
        if !self.instance.is_empty() {
            return self.instance.clone();
        }
        vec![InstanceConfig {
            name: DEFAULT_INSTANCE.into(),
            snapshot_dir: self.snapshot_dir.clone(),
            snapshot_format: self.snapshot_format,
            handoff: self.handoff.clone(),
            redis: self.redis.clone(),
            stream: self.stream.clone(),
        }]
    }

    /// The configuration one instance's parts run with: this agent's
    /// shared sections, and the instance's own in the top-level places.
    pub fn for_instance(&self, instance: &InstanceConfig) -> Config {
        Config {
            snapshot_dir: instance.snapshot_dir.clone(),
            snapshot_format: instance.snapshot_format,
            handoff: instance.handoff.clone(),
            redis: instance.redis.clone(),
            stream: instance.stream.clone(),
            instance: Vec::new(),
            ..self.clone()
        }
    }

    /// Checks every setting and returns all problems found.
    pub fn validate(&self) -> Result<(), Vec<Problem>> {
        let mut p = Problems::default();
        self.check_basics(&mut p);
        self.check_transport(&mut p);
        self.check_instances(&mut p);
        self.check_limits(&mut p);
        self.check_tls(&mut p);
        self.check_auth(&mut p);
        if p.0.is_empty() {
            Ok(())
        } else {
            Err(p.0)
        }
    }

    /// Identity, directory and listen addresses.
    fn check_basics(&self, p: &mut Problems) {
        if !crate::peer_text::is_plain_name(&self.node_id) {
            p.bad(
                "node_id",
                format!(
                    "must be a plain name (1 to {} letters, digits, '.', '_', '-'), got {:?}",
                    crate::peer_text::MAX_NAME,
                    self.node_id
                ),
            );
        }
        for (key, value, may_be_empty) in [
            ("grpc.listen", &self.grpc.listen, false),
            ("data.tcp_listen", &self.data.tcp_listen, false),
            ("metrics.listen", &self.metrics.listen, true),
        ] {
            if !(may_be_empty && value.is_empty()) && value.parse::<SocketAddr>().is_err() {
                p.bad(key, format!("expected ip:port, got {value:?}"));
            }
        }
        if self.data.peer_timeout < Duration::from_secs(1) {
            p.bad("data.peer_timeout", "must be at least 1s".into());
        }
        if self.data.min_rate_window < Duration::from_secs(1) {
            p.bad("data.min_rate_window", "must be at least 1s".into());
        }
        if self.grpc.max_connections_per_peer == 0
            || self.grpc.max_connections_per_peer > self.grpc.max_connections
        {
            p.bad(
                "grpc.max_connections_per_peer",
                "must be between 1 and grpc.max_connections".into(),
            );
        }
        if self.grpc.handshake_timeout.is_zero() {
            p.bad("grpc.handshake_timeout", "must be greater than zero".into());
        }
        if self.grpc.max_streams_per_connection == 0 {
            p.bad(
                "grpc.max_streams_per_connection",
                "must be at least 1".into(),
            );
        }
        if self.data.tls == DataTls::Required && !self.tls.enabled() {
            p.bad(
                "data.tls",
                "\"required\" needs [tls] cert_file, key_file and ca_file".into(),
            );
        }
        if self.data.tls == DataTls::Required
            && self.transport.mode == TransportMode::Rdma
            && !self.transport.rdma_unencrypted_ok
        {
            p.bad(
                "transport.mode",
                "\"rdma\" with [data] tls = \"required\": RDMA has no TLS; use \"auto\" or \"tcp\", or set [transport] rdma_unencrypted_ok = true on a trusted fabric".into(),
            );
        }
        if self.data.hello_timeout.is_zero() {
            p.bad("data.hello_timeout", "must be greater than zero".into());
        }
        if self.data.max_pending_connections == 0 {
            p.bad("data.max_pending_connections", "must be at least 1".into());
        }
        if self.data.max_pending_per_peer == 0
            || self.data.max_pending_per_peer > self.data.max_pending_connections
        {
            p.bad(
                "data.max_pending_per_peer",
                "must be between 1 and data.max_pending_connections".into(),
            );
        }
        if let Err(why) = crate::snapshot::manifest::check_piece_size(self.data.piece_size.as_u64())
        {
            p.bad("data.piece_size", why.to_string());
        }
        if self.data.piece_retries > crate::blk3::MAX_PIECE_SENDS - 1 {
            p.bad(
                "data.piece_retries",
                format!("must be at most {}", crate::blk3::MAX_PIECE_SENDS - 1),
            );
        }
        if let TcpStreams::Fixed(n) = self.data.tcp_streams {
            if !(1..=MAX_TCP_STREAMS).contains(&n) {
                p.bad(
                    "data.tcp_streams",
                    format!("must be \"auto\" or between 1 and {MAX_TCP_STREAMS}"),
                );
            }
        }
        let limit = self.sync.rate_limit.as_u64();
        if limit > 0 && self.data.min_rate.as_u64() > limit {
            p.bad(
                "data.min_rate",
                format!("{} is above sync.rate_limit ({}): this agent's own sends would fail it; lower it", self.data.min_rate, self.sync.rate_limit),
            );
        }
    }

    /// `[transport]`: the RDMA bulk parameters.
    fn check_transport(&self, p: &mut Problems) {
        let t = &self.transport;
        if !(1..=MAX_CHUNK_MB).contains(&t.chunk_mb) {
            p.bad(
                "transport.chunk_mb",
                format!("must be 1..={MAX_CHUNK_MB}, got {}", t.chunk_mb),
            );
        }
        if !(1..=1024).contains(&t.pipeline) {
            p.bad(
                "transport.pipeline",
                format!("must be 1..=1024, got {}", t.pipeline),
            );
        }
        if t.signal_batch == 0 || t.signal_batch > t.pipeline {
            p.bad(
                "transport.signal_batch",
                format!(
                    "must be 1..=pipeline ({}), got {}",
                    t.pipeline, t.signal_batch
                ),
            );
        }
    }

    /// Every instance's own settings, each problem under the instance's
    /// name when the file has `[[instance]]` tables; and what instances
    /// may not share: a name, a directory, a Redis server, a seed port.
    fn check_instances(&self, p: &mut Problems) {
        let instances = self.instances();
        let tables = !self.instance.is_empty();
        for (i, inst) in instances.iter().enumerate() {
            let view = self.for_instance(inst);
            let mut own = Problems::default();
            view.check_instance(&mut own);
            let prefix = if tables {
                if !crate::peer_text::is_plain_name(&inst.name) {
                    p.bad(
                        &format!("instance[{i}].name"),
                        format!(
                            "must be a plain name (1 to {} letters, digits, '.', '_', '-'), got {:?}",
                            crate::peer_text::MAX_NAME,
                            inst.name
                        ),
                    );
                }
                format!("instance.{}.", inst.name)
            } else {
                String::new()
            };
            for problem in own.0 {
                p.bad(&format!("{prefix}{}", problem.key), problem.message);
            }
        }
        let shared = |what: &str, key: fn(&InstanceConfig) -> Option<String>| {
            let mut seen: Vec<(String, &str)> = Vec::new();
            let mut found = Vec::new();
            for inst in &instances {
                let Some(k) = key(inst) else { continue };
                match seen.iter().find(|(s, _)| *s == k) {
                    Some((_, other)) => found.push(format!(
                        "instances {other:?} and {:?} share {what} {k}; give each its own",
                        inst.name
                    )),
                    None => seen.push((k, &inst.name)),
                }
            }
            found
        };
        type Key = fn(&InstanceConfig) -> Option<String>;
        let checks: [(&str, Key); 6] = [
            ("the name", |i| Some(i.name.clone())),
            ("the stream log dir", |i| {
                i.stream.enabled().then(|| normal_path(&i.stream.dir))
            }),
            ("the snapshot_dir", |i| Some(normal_path(&i.snapshot_dir))),
            ("the Redis primary", |i| {
                (!i.redis.primary_addr.is_empty()).then(|| i.redis.primary_addr.clone())
            }),
            ("the Redis server", |i| {
                i.handoff
                    .mode
                    .is_redis()
                    .then(|| i.redis.server_addr.clone())
            }),
            ("the seed port", |i| {
                let seeds = matches!(
                    i.handoff.mode,
                    HandoffMode::RedisReplicate | HandoffMode::RedisStream
                );
                let fixed = i
                    .redis
                    .seed_listen
                    .parse::<SocketAddr>()
                    .is_ok_and(|a| a.port() != 0);
                (seeds && fixed).then(|| i.redis.seed_listen.clone())
            }),
        ];
        for (what, of) in checks {
            for message in shared(what, of) {
                p.bad("instance", message);
            }
        }
    }

    /// One instance's own settings, on its view ([`Config::for_instance`]).
    fn check_instance(&self, p: &mut Problems) {
        if !self.snapshot_dir.is_absolute() {
            p.bad(
                "snapshot_dir",
                format!("must be an absolute path, got {:?}", self.snapshot_dir),
            );
        }
        self.check_handoff(p);
        self.check_stream(p);
    }

    /// `[stream]`: a log needs a primary to follow, a directory of its own.
    fn check_stream(&self, p: &mut Problems) {
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

    /// `[handoff]`, and `[redis]` for the redis mode and the pre-flight.
    fn check_handoff(&self, p: &mut Problems) {
        let h = &self.handoff;
        match h.mode {
            HandoffMode::Command if h.command_addr.parse::<SocketAddr>().is_err() => p.bad(
                "handoff.command_addr",
                format!(
                    "mode \"command\" needs the KV admin address ip:port, got {:?}",
                    h.command_addr
                ),
            ),
            HandoffMode::Exec if h.exec.is_empty() => p.bad(
                "handoff.exec",
                "mode \"exec\" needs a program to run".into(),
            ),
            _ => {}
        }
        if h.mode == HandoffMode::Command && h.command_template.trim().is_empty() {
            p.bad("handoff.command_template", "must not be empty".into());
        }
        if h.timeout.is_zero() {
            p.bad("handoff.timeout", "must be greater than zero".into());
        }
        let r = &self.redis;
        if !r.primary_addr.is_empty() && !is_host_port(&r.primary_addr) {
            p.bad(
                "redis.primary_addr",
                format!("expected host:port, got {:?}", r.primary_addr),
            );
        }
        if !(r.backlog_safety.is_finite() && r.backlog_safety >= 1.0) {
            p.bad(
                "redis.backlog_safety",
                format!("must be at least 1, got {}", r.backlog_safety),
            );
        }
        for (key, rate) in [
            ("redis.expected_transfer_rate", r.expected_transfer_rate),
            ("redis.expected_load_rate", r.expected_load_rate),
        ] {
            if rate.as_u64() == 0 {
                p.bad(key, "must be greater than zero".into());
            }
        }
        if !r.backlog_record.as_os_str().is_empty() && !r.backlog_record.is_absolute() {
            p.bad(
                "redis.backlog_record",
                format!("must be an absolute path, got {:?}", r.backlog_record),
            );
        }
        if r.grow_backlog && r.max_backlog.as_u64() == 0 {
            p.bad(
                "redis.max_backlog",
                "must be greater than zero when redis.grow_backlog is on".into(),
            );
        }
        if h.mode.is_redis() {
            self.check_redis_handoff(p);
        }
    }

    /// `[redis]` as the redis handoff needs it.
    fn check_redis_handoff(&self, p: &mut Problems) {
        let r = &self.redis;
        let mode = self.handoff.mode.as_str();
        if self.snapshot_format != Format::RedisRdb {
            p.bad(
                "handoff.mode",
                format!("mode \"{mode}\" needs snapshot_format = \"redis-rdb\""),
            );
        }
        let streams = self.handoff.mode == HandoffMode::RedisStream;
        for (key, value) in [
            ("redis.server_addr", &r.server_addr),
            ("redis.primary", &r.primary),
        ] {
            // The stream handoff's server follows the agent, not a primary.
            if streams && key == "redis.primary" && value.is_empty() {
                continue;
            }
            if !is_host_port(value) {
                p.bad(
                    key,
                    format!("mode \"{mode}\" needs host:port, got {value:?}"),
                );
            }
        }
        if streams && !self.stream.enabled() {
            p.bad(
                "handoff.mode",
                "mode \"redis-stream\" feeds the server from the stream log: set [stream] dir (and upstream)".into(),
            );
        }
        if matches!(
            self.handoff.mode,
            HandoffMode::RedisReplicate | HandoffMode::RedisStream
        ) {
            if r.seed_listen.parse::<SocketAddr>().is_err() {
                p.bad(
                    "redis.seed_listen",
                    format!("expected ip:port, got {:?}", r.seed_listen),
                );
            }
            return;
        }
        if !r.dir.is_absolute() {
            p.bad(
                "redis.dir",
                format!("must be the server's absolute data dir, got {:?}", r.dir),
            );
        }
        if r.dbfilename.is_empty() || r.dbfilename.contains('/') {
            p.bad(
                "redis.dbfilename",
                format!("must be a file name, got {:?}", r.dbfilename),
            );
        }
        if r.start.is_empty() {
            p.bad("redis.start", "mode \"redis\" needs the command that (re)starts the server with replicaof and appendonly no".into());
        }
    }

    /// Admission limits, the cache budget, the watcher and offer timings.
    fn check_limits(&self, p: &mut Problems) {
        if self.sync.max_incoming_syncs == 0 {
            p.bad("sync.max_incoming_syncs", "must be at least 1".into());
        }
        if self.sync.max_outgoing_syncs == 0 {
            p.bad("sync.max_outgoing_syncs", "must be at least 1".into());
        }
        let streams = self.sync.max_outgoing_syncs as u64 * self.data.tcp_streams.most() as u64;
        if streams > MAX_SERVED_STREAMS as u64 {
            p.bad(
                "sync.max_outgoing_syncs",
                format!(
                    "{} sessions of up to data.tcp_streams = {} streams each are {streams} threads; a source serves at most {MAX_SERVED_STREAMS} streams at once",
                    self.sync.max_outgoing_syncs, self.data.tcp_streams
                ),
            );
        }
        if self.sync.max_sessions_per_replica == 0 {
            p.bad("sync.max_sessions_per_replica", "must be at least 1".into());
        }
        if self.sync.session_token_ttl.is_zero() {
            p.bad("sync.session_token_ttl", "must be greater than zero".into());
        }
        if self.cache.memory_budget.as_u64() == 0 {
            p.bad("cache.memory_budget", "must be greater than zero".into());
        }
        if self.watch.debounce > Duration::from_secs(60) {
            p.bad("watch.debounce", "must be at most 60s".into());
        }
        if self.watch.rescan_interval < Duration::from_secs(1) {
            p.bad("watch.rescan_interval", "must be at least 1s".into());
        }
    }

    /// `[tls]`: complete and readable, or off and then only on loopback
    /// (unless `grpc.plaintext` says otherwise).
    fn check_tls(&self, p: &mut Problems) {
        let tls = &self.tls;
        if tls.enabled() {
            if self.grpc.plaintext {
                p.bad(
                    "grpc.plaintext",
                    "contradicts [tls]: remove one of them".into(),
                );
            }
            for (key, file, kind) in [
                ("tls.cert_file", &tls.cert_file, PemKind::Certificates),
                ("tls.key_file", &tls.key_file, PemKind::PrivateKey),
                ("tls.ca_file", &tls.ca_file, PemKind::Certificates),
            ] {
                match file {
                    None => p.bad(
                        key,
                        "TLS needs cert_file, key_file and ca_file together".into(),
                    ),
                    Some(path) => {
                        if let Err(e) = read_pem(path, kind) {
                            p.bad(key, e.to_string());
                        }
                    }
                }
            }
            return;
        }
        if tls.client_auth {
            p.bad(
                "tls.client_auth",
                "needs cert_file, key_file and ca_file".into(),
            );
        }
        if self.grpc_exposed() && !self.grpc.plaintext {
            p.bad(
                "grpc.listen",
                format!(
                    "{} is reachable from other hosts: set [tls] cert_file, key_file and ca_file, or grpc.plaintext = true to serve gRPC without TLS",
                    self.grpc.listen
                ),
            );
        }
    }

    /// An exposed gRPC listener must authenticate its callers: TLS alone
    /// lets anyone start syncs or read snapshots.
    fn check_auth(&self, p: &mut Problems) {
        let tokens = self.auth.token_file.is_some();
        if self.auth.peer_token_file.is_some() && !tokens {
            p.bad(
                "auth.peer_token_file",
                "needs auth.token_file too (the orchestrators' tokens)".into(),
            );
        }
        let client_certs = self.tls.enabled() && self.tls.client_auth;
        if self.grpc_exposed() && !tokens && !client_certs {
            p.bad(
                "grpc.listen",
                format!(
                    "{} is reachable from other hosts but nothing authenticates callers: set [auth] token_file, or [tls] client_auth = true",
                    self.grpc.listen
                ),
            );
        }
        for (key, list, whom) in [
            ("sync.allowed_sources", &self.sync.allowed_sources, "source"),
            (
                "fanout.allowed_replicas",
                &self.fanout.allowed_replicas,
                "replica",
            ),
        ] {
            for (i, entry) in list.iter().enumerate() {
                let name = entry.parse::<HostPort>().map_or(entry.clone(), |a| a.host);
                if !crate::peer_text::is_plain_name(&name) {
                    p.bad(
                        key,
                        format!("entry {i} ({entry:?}) is neither host:port nor a name"),
                    );
                } else if !entry.contains(':') && !self.tls_proves_names() {
                    p.bad(
                        key,
                        format!("entry {i} ({entry:?}) is a name, and only a certificate proves one: without [tls] (or with tls.server_name, one name for every agent) a name is whatever a {whom} claims; list the {whom}'s address (host:port) instead, or configure [tls] so that the certificate of the host dialled is checked against the name"),
                    );
                }
            }
        }
    }

    /// Whether TLS proves which host a peer is: its certificate is checked
    /// against the host part of the address dialled.
    pub fn tls_proves_names(&self) -> bool {
        self.tls.enabled() && self.tls.server_name.is_empty()
    }

    /// The gRPC listener is reachable from other hosts.
    pub fn grpc_exposed(&self) -> bool {
        self.grpc
            .listen
            .parse::<SocketAddr>()
            .is_ok_and(|a| !a.ip().is_loopback())
    }

    /// Settings that work but expose more than an operator may mean to:
    /// `check-config` prints them and the agent logs them at start.
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        if self
            .metrics
            .listen
            .parse::<SocketAddr>()
            .is_ok_and(|a| a.ip().is_unspecified())
        {
            w.push(format!(
                "metrics.listen {} serves /metrics, unauthenticated, on every interface: bind it to the address your Prometheus scrapes (or loopback), or keep the port behind a firewall",
                self.metrics.listen
            ));
        }
        if self.grpc_exposed() && self.fanout.allowed_replicas.is_empty() {
            w.push("fanout.allowed_replicas is empty: a fan-out this agent runs as origin calls any address a caller names, with the caller's token; list the replicas' agents".into());
        }
        w
    }
}

/// A path with `.` components and trailing slashes left out, so that two
/// spellings of one directory compare equal.
fn normal_path(path: &Path) -> String {
    path.components().collect::<PathBuf>().display().to_string()
}

/// Every problem found, in order.
#[derive(Default)]
struct Problems(Vec<Problem>);

impl Problems {
    fn bad(&mut self, key: &str, message: String) {
        self.0.push(Problem {
            key: key.to_string(),
            message,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_host_and_port_and_print_back() {
        for (text, host, port) in [
            ("localhost:6379", "localhost", 6379),
            ("10.0.0.1:7000", "10.0.0.1", 7000),
            ("[fd00::1]:7000", "fd00::1", 7000),
        ] {
            let a: HostPort = text.parse().unwrap();
            assert_eq!((a.host.as_str(), a.port), (host, port));
            assert_eq!(a.to_string(), text);
        }
        for bad in [
            "",
            "host",
            ":7000",
            "host:",
            "host:x",
            "fd00::1:7000",
            "[fd00::1:7000",
        ] {
            assert!(bad.parse::<HostPort>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn defaults_are_valid() {
        let c = Config {
            node_id: "n".into(),
            ..Default::default()
        };
        c.validate().unwrap();
    }

    #[test]
    fn reference_config_parses_and_validates() {
        let text = include_str!("../deploy/kvsync.toml");
        let c = Config::parse(text).unwrap();
        c.validate().unwrap();
        assert_eq!(c.node_id, "primary-1");
        assert_eq!(c.cache.memory_budget, ByteSize::gib(8));
        assert_eq!(c.transport.mode, TransportMode::Auto);
    }

    #[test]
    fn a_file_without_instance_tables_is_one_instance_named_default() {
        let c = Config::parse("snapshot_dir = \"/srv/kv\"\n[handoff]\nmode = \"file\"\n").unwrap();
        let all = c.instances();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].name, DEFAULT_INSTANCE);
        assert_eq!(all[0].snapshot_dir, PathBuf::from("/srv/kv"));
        let view = c.for_instance(&all[0]);
        assert_eq!(view.snapshot_dir, c.snapshot_dir);
        assert!(view.instance.is_empty());
    }

    #[test]
    fn instances_get_their_own_sections_and_share_the_agents() {
        let c = Config::parse(
            "node_id = \"n\"\n[data]\ntcp_streams = 3\n[[instance]]\nname = \"a\"\nsnapshot_dir = \"/kv/a\"\nsnapshot_format = \"redis-rdb\"\n[instance.redis]\nprimary_addr = \"127.0.0.1:7001\"\n[[instance]]\nname = \"b\"\nsnapshot_dir = \"/kv/b\"\n",
        )
        .unwrap();
        c.validate().unwrap();
        let all = c.instances();
        let (a, b) = (c.for_instance(&all[0]), c.for_instance(&all[1]));
        assert_eq!(a.redis.primary_addr, "127.0.0.1:7001");
        assert_eq!(a.snapshot_format, Format::RedisRdb);
        assert_eq!(b.redis.primary_addr, "");
        assert_eq!(b.snapshot_format, Format::Kvr1);
        assert_eq!(
            (a.data.tcp_streams, b.data.tcp_streams),
            (TcpStreams::Fixed(3), TcpStreams::Fixed(3))
        );
    }

    #[test]
    fn instances_may_not_share_a_name_a_redis_server_or_a_seed_port() {
        let table = |name: &str, dir: &str, extra: &str| {
            format!("[[instance]]\nname = \"{name}\"\nsnapshot_dir = \"{dir}\"\nsnapshot_format = \"redis-rdb\"\n{extra}")
        };
        let replicate = |port: u16, seed: &str| {
            format!("[instance.handoff]\nmode = \"redis-replicate\"\n[instance.redis]\nserver_addr = \"127.0.0.1:{port}\"\nprimary = \"10.0.0.1:6379\"\nseed_listen = \"{seed}\"\n")
        };
        let problems = |text: String| {
            let c = Config::parse(&text).unwrap();
            c.validate().unwrap_err()
        };
        let p = problems(table("a", "/kv/a", "") + &table("a", "/kv/b", ""));
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(
            p[0].message.contains("\"a\" and \"a\" share the name"),
            "{p:?}"
        );
        let p = problems(
            table("a", "/kv/a", &replicate(7001, "127.0.0.1:7100"))
                + &table("b", "/kv/b", &replicate(7001, "127.0.0.1:7100")),
        );
        let text: Vec<_> = p.iter().map(|p| p.to_string()).collect();
        assert_eq!(text.len(), 2, "{text:?}");
        assert!(
            text[0].contains("share the Redis server 127.0.0.1:7001"),
            "{text:?}"
        );
        assert!(
            text[1].contains("share the seed port 127.0.0.1:7100"),
            "{text:?}"
        );
        // Port 0 is a fresh port per seeding: not shared.
        let c = Config::parse(
            &(table("a", "/kv/a", &replicate(7001, "127.0.0.1:0"))
                + &table("b", "/kv/b", &replicate(7002, "127.0.0.1:0"))),
        )
        .unwrap();
        c.validate().unwrap();
        let p = problems(table("bad name", "/kv/a", ""));
        assert_eq!(p[0].key, "instance[0].name", "{p:?}");
    }

    #[test]
    fn the_reference_configs_instance_example_parses_and_validates() {
        let text = include_str!("../deploy/kvsync.toml");
        let example: String = text[text.find("# [[instance]]").expect("the example")..]
            .lines()
            .map(|l| l.strip_prefix("# ").unwrap_or(l.trim_start_matches('#')))
            .map(|l| format!("{l}\n"))
            .collect();
        let c = Config::parse(&example).unwrap();
        c.validate().unwrap();
        let names: Vec<_> = c.instances().into_iter().map(|i| i.name).collect();
        assert_eq!(names, ["shard-1", "shard-2"]);
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err = Config::parse("[grpc]\nlisten = \"127.0.0.1:1\"\nlisen = 3\n").unwrap_err();
        assert!(err.contains("lisen"), "{err}");
        let err = Config::parse("nodeid = \"x\"").unwrap_err();
        assert!(err.contains("nodeid"), "{err}");
    }

    #[test]
    fn human_sizes_and_durations() {
        let c = Config::parse(
            "[cache]\nmemory_budget = \"256MiB\"\nacquire_timeout = \"2m 30s\"\n[watch]\ndebounce = \"250ms\"",
        )
        .unwrap();
        assert_eq!(c.cache.memory_budget.as_u64(), 256 << 20);
        assert_eq!(c.cache.acquire_timeout, Duration::from_secs(150));
        assert_eq!(c.watch.debounce, Duration::from_millis(250));
    }

    #[test]
    fn validate_reports_every_problem_with_its_key() {
        let c = Config::parse(
            r#"
node_id = ""
snapshot_dir = "relative/dir"
[grpc]
listen = "nowhere"
[transport]
chunk_mb = 64
pipeline = 4
signal_batch = 8
[handoff]
mode = "command"
[cache]
memory_budget = 0
[redis]
backlog_safety = 0.5
expected_transfer_rate = "0"
"#,
        )
        .unwrap();
        let problems = c.validate().unwrap_err();
        let keys: Vec<&str> = problems.iter().map(|p| p.key.as_str()).collect();
        for key in [
            "node_id",
            "snapshot_dir",
            "grpc.listen",
            "transport.chunk_mb",
            "transport.signal_batch",
            "handoff.command_addr",
            "cache.memory_budget",
            "redis.backlog_safety",
            "redis.expected_transfer_rate",
        ] {
            assert!(keys.contains(&key), "{key} missing from {keys:?}");
        }
        assert_eq!(problems.len(), 9, "{problems:?}");
    }

    fn valid() -> Config {
        Config {
            node_id: "n".into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_wildcard_metrics_address_and_an_open_fanout_are_warned_about() {
        let mut c = Config::default();
        assert!(c.warnings().is_empty());
        c.metrics.listen = "0.0.0.0:9464".into();
        c.grpc.listen = "10.0.0.1:35101".into();
        let w = c.warnings();
        assert!(w[0].starts_with("metrics.listen 0.0.0.0:9464"), "{w:?}");
        assert!(w[1].starts_with("fanout.allowed_replicas"), "{w:?}");
        c.metrics.listen = "10.0.0.1:9464".into();
        c.fanout.allowed_replicas = vec!["10.0.0.2:35101".into()];
        assert!(c.warnings().is_empty());
    }

    fn problem_keys(c: &Config) -> Vec<String> {
        c.validate()
            .err()
            .unwrap_or_default()
            .into_iter()
            .map(|p| p.key)
            .collect()
    }

    #[test]
    fn a_stream_log_needs_one_source_and_a_directory_of_its_own() {
        let mut c = valid();
        c.stream.dir = c.snapshot_dir.clone();
        c.stream.segment_size = ByteSize::kib(4);
        c.stream.rdma_ring = ByteSize::mib(3);
        assert_eq!(
            problem_keys(&c),
            [
                "stream.dir",
                "stream.dir",
                "stream.segment_size",
                "stream.rdma_ring"
            ]
        );
        c.stream.rdma_ring = ByteSize::b(0);
        c.stream.dir = "/var/lib/kvsync/stream".into();
        c.stream.segment_size = ByteSize::mib(64);
        c.redis.primary_addr = "127.0.0.1:6379".into();
        c.validate().unwrap();
        c.stream.upstream = "agent-a:7400".into();
        assert_eq!(problem_keys(&c), ["stream.upstream"], "one source, not two");
        c.redis.primary_addr.clear();
        c.validate().unwrap();
        c.stream.ack = StreamAck::Replicas;
        assert_eq!(problem_keys(&c), ["stream.ack"], "only the primary's agent");
        c.stream.ack = StreamAck::Log;
        c.stream.reseed = true;
        c.validate().unwrap();
        c.stream.upstream.clear();
        c.redis.primary_addr = "127.0.0.1:6379".into();
        c.validate()
            .expect("the primary's agent follows agents after a failover");
        c.redis.primary_addr.clear();
        c.stream.reseed = false;
        c.stream.upstream = "agent-a".into();
        assert_eq!(problem_keys(&c), ["stream.upstream"]);
        // The stream handoff feeds its server from the log: no primary.
        c.stream.upstream = "agent-a:7400".into();
        c.snapshot_format = Format::RedisRdb;
        c.handoff.mode = HandoffMode::RedisStream;
        c.redis.server_addr = "127.0.0.1:6380".into();
        c.validate().unwrap();
        c.stream.dir = PathBuf::new();
        assert_eq!(problem_keys(&c), ["handoff.mode"]);
        let text = "node_id = \"n\"\n[[instance]]\nname = \"a\"\nsnapshot_dir = \"/kv/a\"\n[instance.redis]\nprimary_addr = \"127.0.0.1:7001\"\n[instance.stream]\ndir = \"/log\"\n[[instance]]\nname = \"b\"\nsnapshot_dir = \"/kv/b\"\n[instance.redis]\nprimary_addr = \"127.0.0.1:7002\"\n[instance.stream]\ndir = \"/log\"\n";
        let c = Config::parse(text).unwrap();
        let problems = c.validate().unwrap_err();
        assert!(
            problems
                .iter()
                .any(|p| p.message.contains("share the stream log dir")),
            "{problems:?}"
        );
    }

    #[test]
    fn sentinels_come_with_a_master_name_and_peers() {
        let mut c = valid();
        c.stream.dir = "/var/lib/kvsync/stream".into();
        c.redis.primary_addr = "127.0.0.1:6379".into();
        c.stream.sentinels = vec!["10.0.0.9:26379".into(), "sentinel-b".into()];
        assert_eq!(
            problem_keys(&c),
            ["stream.sentinels", "stream.peers", "stream.master_name"]
        );
        c.stream.sentinels.pop();
        c.stream.master_name = "mymaster".into();
        c.stream.peers = vec!["agent-b:7400".into()];
        c.validate().unwrap();
        // One Sentinel under several spellings is one vote, not a majority.
        for twice in ["10.0.0.9:26379", "10.0.0.9:026379"] {
            c.stream.sentinels = vec!["10.0.0.9:26379".into(), twice.into()];
            assert_eq!(problem_keys(&c), ["stream.sentinels"], "{twice}");
        }
        c.stream.sentinels = vec![
            "127.0.0.1:26379".into(),
            "localhost:26379".into(),
            "[::1]:26379".into(),
        ];
        assert_eq!(problem_keys(&c), ["stream.sentinels"]);
        c.stream.sentinels = vec!["Sentinel-A:26379".into(), "sentinel-a:26379".into()];
        assert_eq!(problem_keys(&c), ["stream.sentinels"]);
        for twice in [
            "127.1:26379",
            "0.0.0.0:26379",
            "[::ffff:127.0.0.1]:26379",
            "0:26379",
            "2130706433:26379",
        ] {
            c.stream.sentinels = vec!["127.0.0.1:26379".into(), twice.into()];
            assert_eq!(problem_keys(&c), ["stream.sentinels"], "{twice}");
        }
        c.stream.sentinels = vec!["10.1:26379".into(), "10.0.0.1:26379".into()];
        assert_eq!(problem_keys(&c), ["stream.sentinels"]);
        c.stream.sentinels = vec!["127.0.0.1:26379".into(), "127.0.0.1:26380".into()];
        c.validate().unwrap();
        c.stream.sentinels.clear();
        assert_eq!(problem_keys(&c), ["stream.master_name"]);
    }

    #[test]
    fn piece_size_and_retries_are_bounded() {
        let mut c = valid();
        c.data.piece_size = ByteSize::mib(3);
        c.data.piece_retries = 9;
        assert_eq!(problem_keys(&c), ["data.piece_size", "data.piece_retries"]);
        c.data.piece_size = ByteSize::mib(1);
        c.data.piece_retries = 8;
        c.validate().unwrap();
    }

    #[test]
    fn tcp_streams_is_a_count_or_auto() {
        let streams =
            |v: &str| Config::parse(&format!("node_id = \"n\"\n[data]\ntcp_streams = {v}\n"));
        assert_eq!(streams("3").unwrap().data.tcp_streams, TcpStreams::Fixed(3));
        let auto = streams("\"auto\"").unwrap();
        assert_eq!(auto.data.tcp_streams, TcpStreams::AUTO);
        assert_eq!(auto.data.tcp_streams.most(), AUTO_TCP_STREAMS);
        auto.validate().unwrap();
        assert!(streams("\"many\"").is_err());
        assert_eq!(problem_keys(&streams("0").unwrap()), ["data.tcp_streams"]);
    }

    #[test]
    fn the_streams_a_source_may_serve_at_once_are_bounded() {
        let mut c = valid();
        c.data.tcp_streams = TcpStreams::Fixed(MAX_TCP_STREAMS);
        c.sync.max_outgoing_syncs = MAX_SERVED_STREAMS / MAX_TCP_STREAMS as usize;
        c.validate().unwrap();
        c.sync.max_outgoing_syncs += 1;
        assert_eq!(problem_keys(&c), ["sync.max_outgoing_syncs"]);
    }

    #[test]
    fn grpc_reachable_from_other_hosts_needs_tls_or_explicit_plaintext() {
        let mut c = valid();
        c.grpc.listen = "0.0.0.0:35101".into();
        let problems = c.validate().unwrap_err();
        assert!(
            problems[0].key == "grpc.listen" && problems[0].message.contains("plaintext = true"),
            "{problems:?}"
        );
        c.grpc.plaintext = true;
        c.auth.token_file = Some("/etc/kvsync/tokens".into());
        c.validate().unwrap();
    }

    #[test]
    fn exposed_grpc_must_authenticate_callers() {
        let mut c = valid();
        c.grpc.listen = "0.0.0.0:35101".into();
        c.grpc.plaintext = true;
        let problems = c.validate().unwrap_err();
        assert!(
            problems.len() == 1
                && problems[0].key == "grpc.listen"
                && problems[0].message.contains("token_file")
                && problems[0].message.contains("client_auth"),
            "{problems:?}"
        );
        c.grpc.listen = "127.0.0.1:35101".into();
        c.validate().unwrap();
    }

    #[test]
    fn peer_facing_names_are_plain() {
        let mut c = valid();
        c.node_id = "node 1\r\n".into();
        c.sync.allowed_sources = vec!["10.0.0.1:35101".into(), "a b:1".into()];
        assert_eq!(problem_keys(&c), ["node_id", "sync.allowed_sources"]);
    }

    #[test]
    fn a_name_in_allowed_sources_needs_a_certificate_to_prove_it() {
        let mut c = valid();
        c.sync.allowed_sources = vec!["primary-1".into()];
        let problems = c.validate().unwrap_err();
        assert!(
            problems[0]
                .message
                .contains("only a certificate proves one"),
            "{problems:?}"
        );
        c.tls.ca_file = Some("/ca.pem".into());
        assert!(c.tls_proves_names());
        // One name for every agent proves no host.
        c.tls.server_name = "fleet".into();
        assert!(!c.tls_proves_names());
    }

    #[test]
    fn tls_needs_three_usable_pem_files() {
        let dir = tempfile::tempdir().unwrap();
        let made = rcgen::generate_simple_self_signed(vec!["agent".into()]).unwrap();
        let (cert, key, junk) = (
            dir.path().join("c.pem"),
            dir.path().join("k.pem"),
            dir.path().join("junk.pem"),
        );
        std::fs::write(&cert, made.cert.pem()).unwrap();
        std::fs::write(&key, made.signing_key.serialize_pem()).unwrap();
        std::fs::write(&junk, "not pem").unwrap();

        let mut c = valid();
        c.tls.cert_file = Some(cert.clone());
        c.tls.client_auth = true;
        assert_eq!(problem_keys(&c), ["tls.key_file", "tls.ca_file"]);
        c.tls.key_file = Some(cert.clone());
        c.tls.ca_file = Some(dir.path().join("missing.pem"));
        let problems = c.validate().unwrap_err();
        assert!(
            problems[0].message.contains("no usable PEM private key"),
            "{problems:?}"
        );
        assert!(problems[1].message.contains("cannot read"), "{problems:?}");
        c.tls.key_file = Some(key);
        c.tls.ca_file = Some(junk);
        assert_eq!(problem_keys(&c), ["tls.ca_file"]);
        c.tls.ca_file = Some(cert);
        c.validate().unwrap();
        c.grpc.plaintext = true;
        assert_eq!(problem_keys(&c), ["grpc.plaintext"]);
        // Without TLS, client_auth has nothing to work with.
        let mut c = valid();
        c.tls.client_auth = true;
        assert_eq!(problem_keys(&c), ["tls.client_auth"]);
    }
}
