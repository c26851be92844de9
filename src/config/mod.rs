//! Agent configuration: the TOML schema, its defaults, and `validate()`.
//!
//! Owns parsing (serde, every unknown key at once: [`keys`], human sizes
//! and durations) and
//! the semantic checks that report every bad setting at once, each with its
//! key. It does not open sockets or directories; callers do that with the
//! values found here. CLI flags override the file in `cli`.
//!
//! Each wing's sections and their checks live in a file of their own:
//! `stream` (`[stream]`), `redis` (`[redis]`, `[handoff]`), `data`
//! (`[data]`, `[transport]`), `grpc` (`[grpc]`, `[tls]`, `[auth]`), the
//! addresses they hold (`addr`) and how kvsync logs in to the servers
//! and Sentinels they name (`server_auth`). This file keeps the whole
//! ([`Config`]), the instances, the smaller sections, loading and the one
//! `validate()` that runs every check and reports every problem at once.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytesize::ByteSize;
use serde::{Deserialize, Serialize};

use crate::snapshot::Format;

mod addr;
mod data;
mod grpc;
mod keys;
mod redis;
mod server_auth;
mod stream;

pub use addr::{HostPort, NotHostPort};
pub use data::{
    Auto, DataConfig, DataTls, RdmaProvider, TcpStreams, TransportConfig, TransportMode,
    AUTO_TCP_STREAMS, MAX_SERVED_STREAMS, MAX_TCP_STREAMS,
};
pub use grpc::{AuthConfig, GrpcConfig, TlsConfig};
pub use redis::{fixed_port, HandoffConfig, HandoffMode, RedisConfig};
pub use server_auth::{AuthError, Credentials, ServerAuth, TlsFiles};
pub use stream::{Fsync, StreamAck, StreamConfig, MAX_STREAM_SESSIONS};

/// The whole agent configuration (one TOML file).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    /// Name of this agent in logs, status and handoff records.
    pub node_id: String,
    /// Directory the local KV writes its snapshots to (source role) and where
    /// received snapshots are installed (replica role).
    pub snapshot_dir: PathBuf,
    /// Format of the snapshots in `snapshot_dir`.
    pub snapshot_format: Format,
    /// Create a missing `snapshot_dir`, `[stream] dir` or `state_dir` (with its
    /// parents) at start. Off, a missing one is refused: a mistyped path
    /// stops the agent instead of becoming a new, empty directory.
    pub create_dirs: bool,
    /// The agent's own directory (none of a KV's): the finished syncs
    /// `status` lists are kept there across restarts. Unset, they are kept
    /// in memory only.
    pub state_dir: Option<PathBuf>,
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
#[serde(default)]
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

/// Fan-outs this agent runs as their origin.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct FanoutConfig {
    /// The replicas' agents a fan-out may call, with the caller's token:
    /// gRPC addresses (`host:port`) or names a certificate proves, as for
    /// `[sync] allowed_sources`; empty allows any address a caller names.
    pub allowed_replicas: Vec<String>,
}

/// Prometheus endpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct MetricsConfig {
    /// Address serving `/metrics` (empty string disables the endpoint).
    pub listen: String,
}

/// Shared snapshot cache (source side).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
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
#[serde(default)]
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
#[serde(default)]
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
            create_dirs: false,
            state_dir: None,
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

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            listen: "127.0.0.1:9464".into(),
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
        let (config, unknown) = keys::parse(text)?;
        match unknown.is_empty() {
            true => Ok(config),
            false => Err(keys::report(text, &unknown)),
        }
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
        self.check_grpc(&mut p);
        self.check_data(&mut p);
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

    /// Identity and listen addresses.
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
                let mode = i.handoff.mode;
                let seeds =
                    mode == HandoffMode::RedisReplicate || mode.runs_feed(i.stream.enabled());
                let fixed = fixed_port(&i.redis.seed_listen);
                (seeds && fixed).then(|| i.redis.seed_listen.clone())
            }),
        ];
        for (what, of) in checks {
            for message in shared(what, of) {
                p.bad("instance", message);
            }
        }
        if let Some(state) = &self.state_dir {
            let state_path = normal_path(state);
            let within = |dir: &Path| Path::new(&state_path).starts_with(normal_path(dir));
            let used = instances
                .iter()
                .find(|i| within(&i.snapshot_dir) || (i.stream.enabled() && within(&i.stream.dir)));
            if !state.is_absolute() {
                p.bad(
                    "state_dir",
                    format!("must be an absolute path, got {state:?}"),
                );
            } else if let Some(i) = used {
                p.bad(
                    "state_dir",
                    format!(
                        "{state_path} is in instance {:?}'s snapshot_dir or stream log dir; give the agent a directory of its own",
                        i.name
                    ),
                );
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
        self.check_server_auth(p);
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
        for inst in self.instances() {
            let named = match self.instance.is_empty() {
                true => String::new(),
                false => format!(" (instance {:?})", inst.name),
            };
            let view = self.for_instance(&inst);
            for (key, inline) in [
                ("redis.password", view.redis.auth().is_inline()),
                ("stream.sentinel_password", view.sentinel_auth().is_inline()),
            ] {
                if inline {
                    w.push(format!("{key}{named} is written in the configuration, which ends up wherever the file goes (config management, support bundles): keep it in {key}_file, readable by the agent alone"));
                }
            }
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
mod tests;
