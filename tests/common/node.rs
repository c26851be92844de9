//! A real agent process as a test node, and the sync helpers the
//! end-to-end tests share: generate and offer snapshots, start and follow
//! syncs over gRPC, read metrics.

use std::path::{Path, PathBuf};

use futures::StreamExt;
use kvsync::rpc::auth::ClientAuth;
use kvsync::rpc::pb;
use kvsync::rpc::pb::orchestrator_client::OrchestratorClient;
use kvsync::rpc::AgentChannel;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use super::*;

pub struct Node {
    pub proc: AgentProcess,
    pub dir: PathBuf,
    /// The bearer token its gRPC listener requires, if any.
    pub token: Option<String>,
}

/// The token of test agents whose gRPC listener other hosts can reach
/// (such a listener must authenticate its callers).
pub const EXPOSED_TOKEN: &str = "kvsync-test-token-0123456789";

/// What an agent named `name` listening on `ip` needs in its config: on a
/// loopback address nothing; on another (reachable from other hosts)
/// gRPC in plaintext to callers with [`EXPOSED_TOKEN`], which it also
/// sends to the agents it calls. Returns the `[grpc]` line, the `[auth]`
/// section and the token its callers use.
pub fn exposed_auth(root: &Path, name: &str, ip: &str) -> (&'static str, String, Option<String>) {
    if ip.starts_with("127.") {
        return ("", String::new(), None);
    }
    let tokens = root.join(format!("{name}.tokens"));
    std::fs::write(&tokens, format!("{EXPOSED_TOKEN}\n")).unwrap();
    let auth = format!(
        "[auth]\ntoken_file = \"{}\"\nsend_token_in_clear = true\n",
        tokens.display()
    );
    ("plaintext = true\n", auth, Some(EXPOSED_TOKEN.to_string()))
}

impl Node {
    /// Starts an agent named `name` under `root`; `extra` is appended to its
    /// config file.
    pub fn start(root: &Path, name: &str, extra: &str, env: &[(&str, &str)]) -> Node {
        Node::start_with(root, name, "mode = \"tcp\"", extra, env)
    }

    /// Starts an agent whose `[transport]` section is `transport`.
    pub fn start_with(
        root: &Path,
        name: &str,
        transport: &str,
        extra: &str,
        env: &[(&str, &str)],
    ) -> Node {
        Node::start_at(root, name, "127.0.0.1", transport, extra, env)
    }

    /// Starts an agent listening on `ip` (gRPC in plaintext unless `extra`
    /// has `[tls]`).
    pub fn start_at(
        root: &Path,
        name: &str,
        ip: &str,
        transport: &str,
        extra: &str,
        env: &[(&str, &str)],
    ) -> Node {
        // One attempt per sync unless a test asks for retries: tests check
        // what each failure does.
        let extra = if take_section(extra, "[sync]\n").0.contains("retries =") {
            extra.to_string()
        } else if extra.contains("[sync]\n") {
            extra.replacen("[sync]\n", "[sync]\nretries = 0\n", 1)
        } else {
            format!("{extra}\n[sync]\nretries = 0\n")
        };
        // `[data]` keys of `extra` join the [data] section written here.
        let (data_extra, extra) = take_section(&extra, "[data]\n");
        let extra = extra.as_str();
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let config = root.join(format!("{name}.toml"));
        let (plaintext, auth, token) = exposed_auth(root, name, ip);
        // A silent peer fails a transfer after 5 s (not 30 s) in tests.
        std::fs::write(
            &config,
            format!(
                "node_id = \"{name}\"\ncreate_dirs = true\nsnapshot_dir = \"{}\"\nstate_dir = \"{}\"\n[grpc]\nlisten = \"{ip}:0\"\n{plaintext}[data]\ntcp_listen = \"{ip}:0\"\nrdma_port = 0\npeer_timeout = \"5s\"\n{data_extra}[metrics]\nlisten = \"{ip}:0\"\n[watch]\ndebounce = \"20ms\"\n{auth}[transport]\n{transport}\n{extra}",
                dir.display(),
                root.join(format!("{name}-state")).display()
            ),
        )
        .unwrap();
        let proc = AgentProcess::start_env(&["--config", config.to_str().unwrap()], env, root);
        Node { proc, dir, token }
    }

    pub fn grpc(&self) -> String {
        self.proc.addr("grpc")
    }

    pub fn data(&self) -> String {
        self.proc.addr("data")
    }

    pub async fn client(&self) -> OrchestratorClient<AgentChannel> {
        let channel = Channel::from_shared(format!("http://{}", self.grpc()))
            .unwrap()
            .connect()
            .await
            .expect("connect agent");
        OrchestratorClient::new(InterceptedService::new(
            channel,
            ClientAuth::new(self.token.clone()),
        ))
    }

    /// Waits until the agent offers a snapshot with `seq`.
    pub async fn offered(&self, seq: u64) {
        self.offered_in("", seq).await
    }

    /// Waits until the agent's instance `instance` (`""`: its only one)
    /// offers a snapshot with `seq`.
    pub async fn offered_in(&self, instance: &str, seq: u64) {
        let c = self.client().await;
        wait_for_async(
            &format!("{} to offer seq {seq} of {instance:?}", self.grpc()),
            DEADLINE,
            || {
                let mut c = c.clone();
                async move {
                    let list = c
                        .list_snapshots(pb::ListSnapshotsRequest {
                            instance: instance.into(),
                        })
                        .await
                        .unwrap()
                        .into_inner();
                    list.snapshots.iter().any(|s| s.seq == seq).then_some(())
                }
            },
        )
        .await;
    }

    /// Sends SIGHUP and waits until the agent says it reloaded.
    pub fn reload(&self) {
        let before = self.proc.log().matches("SIGHUP: reloaded").count();
        self.proc.signal(libc::SIGHUP);
        wait_for("the reload", DEADLINE, || {
            let log = self.proc.log();
            assert!(!log.contains("not reloaded"), "{log}");
            (log.matches("SIGHUP: reloaded").count() > before).then_some(())
        });
    }

    /// kvsync's temp files in the snapshot directory.
    pub fn temp_files(&self) -> Vec<String> {
        std::fs::read_dir(&self.dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(kvsync::store::install::TEMP_PREFIX))
            .collect()
    }

    /// The agent's status.
    pub async fn status(&self) -> pb::AgentStatus {
        self.client()
            .await
            .get_status(pb::GetStatusRequest::default())
            .await
            .unwrap()
            .into_inner()
    }

    /// Asks this agent, as a source, for a TCP offer of its kvr1 snapshot.
    pub async fn open_offer(&self) -> pb::SyncOffer {
        pb::peer_client::PeerClient::connect(format!("http://{}", self.grpc()))
            .await
            .unwrap()
            .open_full_sync(pb::OpenFullSyncRequest {
                format: "kvr1".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
    }

    /// The piece manifest of an offer this agent made.
    pub async fn manifest(&self, offer: &pb::SyncOffer) -> kvsync::snapshot::manifest::Manifest {
        let mut parts = pb::peer_client::PeerClient::connect(format!("http://{}", self.grpc()))
            .await
            .unwrap()
            .get_manifest(pb::GetManifestRequest {
                session_id: offer.session_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut bytes = Vec::new();
        while let Some(part) = parts.message().await.unwrap() {
            bytes.extend_from_slice(&part.data);
        }
        kvsync::snapshot::manifest::Manifest::decode(&bytes).unwrap()
    }

    /// Waits until this agent holds no snapshot in its cache (every offer
    /// and session released it).
    pub fn wait_released(&self) {
        wait_for("the agent to release its snapshots", DEADLINE, || {
            (self.metric("kvsync_snapshot_cache_refs") == 0.0).then_some(())
        });
    }

    /// The value of a series; a missing series fails the test (it is
    /// not a zero).
    pub fn metric(&self, name_and_labels: &str) -> f64 {
        let scrape = self.proc.metrics();
        metric_value(&scrape, name_and_labels)
            .unwrap_or_else(|| panic!("{name_and_labels} is not in the scrape:\n{scrape}"))
    }
}

/// The gRPC health of the agent at `addr`, asked without a token (health
/// is open for probes).
pub async fn grpc_health(addr: &str) -> tonic_health::pb::health_check_response::ServingStatus {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect agent");
    let status = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect("health check")
        .into_inner()
        .status;
    tonic_health::pb::health_check_response::ServingStatus::try_from(status).expect("a status")
}

/// Splits the lines of `header`'s section out of `config`: (its keys, the
/// rest of `config`).
fn take_section(config: &str, header: &str) -> (String, String) {
    let Some(start) = config.find(header) else {
        return (String::new(), config.to_string());
    };
    let body = &config[start + header.len()..];
    let end = body.find("\n[").map_or(body.len(), |i| i + 1);
    let rest = format!("{}{}", &config[..start], &body[end..]);
    (body[..end].to_string(), rest)
}

/// Writes a generated snapshot into `dir` as `name` (temp + rename).
pub fn put_snapshot(dir: &Path, name: &str, size: u64, seq: u64) -> Vec<u8> {
    let path = dir.join(name);
    gen_snapshot(&path, size, seq);
    std::fs::read(&path).unwrap()
}

/// A source agent (started with `env`) offering a generated `s.kvr1`.
pub async fn offering_source(
    root: &Path,
    size: u64,
    seq: u64,
    env: &[(&str, &str)],
) -> (Node, Vec<u8>) {
    let source = Node::start(root, "source", "", env);
    let bytes = put_snapshot(&source.dir, "s.kvr1", size, seq);
    source.offered(seq).await;
    (source, bytes)
}

/// The fault that stalls a TCP source after 1 MiB, keeping a transfer in
/// flight for as long as a test needs.
pub const STALL_AFTER_1MIB: (&str, &str) = ("KVSYNC_FAULTS", "stall_after=1048576");

/// A source offering an 8 MiB `s.kvr1` with sequence `seq` whose transfers
/// stall after 1 MiB.
pub async fn stalling_source(root: &Path, seq: u64) -> Node {
    offering_source(root, 8 << 20, seq, &[STALL_AFTER_1MIB])
        .await
        .0
}

/// Starts a sync and returns its id once 1 MiB has arrived.
pub async fn sync_in_flight(replica: &Node, source: &Node) -> String {
    let id = start_sync(replica, source).await;
    wait_bytes(replica, &id, 1 << 20).await;
    id
}

/// Syncs from the agent at `source` (any address) and follows it to its end.
pub async fn sync_from(replica: &Node, source: &str) -> pb::SyncProgress {
    sync_into(replica, source, "").await
}

/// Syncs instance `instance` of the agent at `source` into the same-named
/// instance of `replica` (`""`: their only ones) and follows it to its end.
pub async fn sync_into(replica: &Node, source: &str, instance: &str) -> pb::SyncProgress {
    let id = replica
        .client()
        .await
        .start_full_sync(pb::StartFullSyncRequest {
            source: source.to_string(),
            instance: instance.to_string(),
            ..Default::default()
        })
        .await
        .expect("start sync")
        .into_inner()
        .sync_id;
    wait_done(replica, &id).await
}

pub async fn start_sync(replica: &Node, source: &Node) -> String {
    let mut c = replica.client().await;
    let r = c
        .start_full_sync(pb::StartFullSyncRequest {
            source: source.grpc(),
            transport: 0,
            ..Default::default()
        })
        .await
        .expect("start sync")
        .into_inner();
    r.sync_id
}

/// Follows a sync to its end.
pub async fn wait_done(replica: &Node, id: &str) -> pb::SyncProgress {
    let mut c = replica.client().await;
    let mut stream = c
        .watch_sync(pb::WatchSyncRequest { sync_id: id.into() })
        .await
        .unwrap()
        .into_inner();
    let follow = async {
        let mut last = None;
        while let Some(p) = stream.next().await {
            last = Some(p.unwrap());
        }
        last.expect("at least one progress update")
    };
    tokio::time::timeout(DEADLINE * 2, follow)
        .await
        .expect("sync finished in time")
}

/// Cancels sync `id`, which is still transferring, and follows it to its
/// end: cancelled.
pub async fn cancel_while_transferring(replica: &Node, id: &str) {
    let p = replica.status().await;
    let sync = p.running.iter().find(|s| s.sync_id == id).unwrap();
    assert_eq!(sync.phase, pb::Phase::Transferring as i32, "{sync:?}");
    let mut c = replica.client().await;
    c.cancel_sync(pb::CancelSyncRequest { sync_id: id.into() })
        .await
        .unwrap();
    let p = wait_done(replica, id).await;
    assert_eq!(p.phase, pb::Phase::Cancelled as i32, "{p:?}");
}

/// Waits until the sync reports at least `bytes` received.
pub async fn wait_bytes(replica: &Node, id: &str, bytes: u64) {
    let mut c = replica.client().await;
    let mut stream = c
        .watch_sync(pb::WatchSyncRequest { sync_id: id.into() })
        .await
        .unwrap()
        .into_inner();
    tokio::time::timeout(DEADLINE, async {
        while let Some(p) = stream.next().await {
            if p.unwrap().bytes_done >= bytes {
                return;
            }
        }
        panic!("sync ended before {bytes} bytes arrived");
    })
    .await
    .expect("bytes arrived in time");
}

pub async fn sync_ok(replica: &Node, source: &Node) -> pb::SyncProgress {
    let id = start_sync(replica, source).await;
    let p = wait_done(replica, &id).await;
    assert_eq!(
        p.phase,
        pb::Phase::Succeeded as i32,
        "sync failed: {}\nreplica log:\n{}",
        p.error,
        replica.proc.log()
    );
    p
}

pub fn replmeta_seq(installed: &str) -> Option<u64> {
    kvsync::kv::handoff::read_replmeta_seq(Path::new(&format!("{installed}.replmeta")))
}

/// `kvsync <global> sync --agent <replica> --source <source> --wait --json`
/// as a process.
pub fn cli_sync(global: &[&str], replica: &Node, source: &Node) -> std::process::Output {
    std::process::Command::new(kvsync_bin())
        .args(global)
        .args([
            "sync",
            "--agent",
            &replica.grpc(),
            "--source",
            &source.grpc(),
        ])
        .args(["--wait", "--json"])
        .output()
        .unwrap()
}

/// `kvsync sync --wait --json` that must succeed: its JSON summary.
pub fn cli_sync_ok(replica: &Node, source: &Node) -> serde_json::Value {
    let out = cli_sync(&[], replica, source);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}
