//! Relay fan-out between real agent processes, started with the `kvsync
//! fanout` command: six replicas seeded through a tree of degree 2 get
//! exact copies while the origin sends the snapshot only twice, over TCP
//! and over the emulated RDMA fabric; a relay
//! killed mid-transfer leaves its children to pull from further up and
//! resume what they verified; a relay serving a forgery of the origin's
//! snapshot that CRC32 cannot tell apart is refused by its digest. Caches
//! and serving state are released at the end.

mod common;

use std::process::{Command, Output};

use common::netns::block_on;
use common::node::*;
use common::*;
use kvsync::rpc::pb;

const MIB: u64 = 1 << 20;
/// Every agent's extra config: 1 MiB pieces.
const PIECES: &str = "[data]\npiece_size = \"1MiB\"\n";

/// `kvsync fanout --source <origin> --replica … --degree 2 --wait --json`.
fn fanout_command(origin: &Node, replicas: &[Node]) -> Command {
    let mut cmd = Command::new(kvsync_bin());
    cmd.args(["fanout", "--source", &origin.grpc(), "--degree", "2"]);
    for r in replicas {
        cmd.args(["--replica", &r.grpc()]);
    }
    cmd.args(["--wait", "--json"]);
    cmd
}

/// The fan-out's JSON summary from the command's output.
fn summary(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "fanout printed no JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The summary's node for `replica`.
fn node<'a>(s: &'a serde_json::Value, replica: &Node) -> &'a serde_json::Value {
    s["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["replica"] == replica.grpc().as_str())
        .unwrap_or_else(|| panic!("{} is not in {s}", replica.grpc()))
}

/// `[transport]` of agents on the emulated RDMA fabric (an emulation of RC
/// queue pairs, not hardware).
const EMULATED: &str = "mode = \"rdma\"\nrdma_provider = \"emulated\"";

/// Waits until a sync running on `node` has received `bytes`.
async fn receiving(node: &Node, bytes: u64) {
    let client = node.client().await;
    wait_for_async(
        &format!("{} to receive {bytes} bytes", node.grpc()),
        DEADLINE,
        || {
            let mut c = client.clone();
            async move {
                let s = c.get_status(pb::GetStatusRequest::default()).await.ok()?;
                let s = s.into_inner();
                s.running.iter().find(|p| p.bytes_done >= bytes).map(drop)
            }
        },
    )
    .await;
}

fn start_nodes(root: &std::path::Path, n: usize, transport: &str, extra: &str) -> Vec<Node> {
    (0..n)
        .map(|i| Node::start_with(root, &format!("r{i}"), transport, extra, &[]))
        .collect()
}

/// A caller who holds an orchestrator token names replicas the origin may
/// not dial: the fan-out is refused before any connection is made, so the
/// origin is neither a port scanner nor a forwarder of the caller's token.
#[test]
fn a_fanout_to_a_replica_not_in_allowed_replicas_is_refused_before_any_connection() {
    let root = tempfile::tempdir().unwrap();
    let allowed = Node::start(root.path(), "allowed", PIECES, &[]);
    let origin = Node::start(
        root.path(),
        "origin",
        &format!(
            "{PIECES}[fanout]\nallowed_replicas = [\"{}\"]\n",
            allowed.grpc()
        ),
        &[],
    );
    put_snapshot(&origin.dir, "s.kvr1", 2 << 20, 3);
    block_on(origin.offered(3));
    let target = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    target.set_nonblocking(true).unwrap();
    let out = Command::new(kvsync_bin())
        .args([
            "fanout",
            "--source",
            &origin.grpc(),
            "--replica",
            &allowed.grpc(),
        ])
        .args([
            "--replica",
            &target.local_addr().unwrap().to_string(),
            "--wait",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("allowed_replicas"), "{err}");
    assert!(
        matches!(target.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the origin connected to the target"
    );
    // Nothing was started on the allowed replica either.
    let status = block_on(allowed.status());
    assert!(
        status.running.is_empty() && status.recent.is_empty(),
        "{status:?}"
    );
}

/// With no `allowed_replicas` (the default), a caller who holds an
/// orchestrator token can make the origin dial any address; the answer
/// reads the same for a closed port, a silent one and one that speaks
/// something else than gRPC, so the origin tells the caller nothing about
/// what listens where (its log says).
#[test]
fn a_fanout_answers_the_same_for_a_closed_port_and_one_that_is_no_agent() {
    use std::io::{Read, Write};
    let root = tempfile::tempdir().unwrap();
    let origin = Node::start(root.path(), "origin", PIECES, &[]);
    put_snapshot(&origin.dir, "s.kvr1", 2 << 20, 3);
    block_on(origin.offered(3));
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    // A silent listener, and one that answers every connection as a web
    // server would.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let web = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (silent_addr, web_addr) = (
        silent.local_addr().unwrap().to_string(),
        web.local_addr().unwrap().to_string(),
    );
    std::thread::spawn(move || {
        for c in web.incoming() {
            let Ok(mut c) = c else { return };
            let mut buf = [0; 1024];
            let _ = c.read(&mut buf);
            let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n");
        }
    });
    let out = Command::new(kvsync_bin())
        .args(["fanout", "--source", &origin.grpc()])
        .args([
            "--replica",
            &closed,
            "--replica",
            &silent_addr,
            "--replica",
            &web_addr,
        ])
        .args(["--wait", "--json"])
        .output()
        .unwrap();
    let s = summary(&out);
    for addr in [&closed, &silent_addr, &web_addr] {
        let n = s["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["replica"] == addr.as_str())
            .unwrap_or_else(|| panic!("{addr} is not in {s}"));
        assert_eq!(
            n["error"].as_str().unwrap(),
            format!("cannot reach an agent at {addr}"),
            "{s}"
        );
    }
    drop(silent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_replicas_through_relays_get_exact_copies_while_the_origin_sends_two() {
    for (transport, label) in [("mode = \"tcp\"", "tcp"), (EMULATED, "rdma")] {
        six_replicas_of_degree_two(transport, label).await;
    }
}

async fn six_replicas_of_degree_two(transport: &str, label: &str) {
    let root = tempfile::tempdir().unwrap();
    let size = 24 * MIB;
    let origin = Node::start_with(root.path(), "origin", transport, PIECES, &[]);
    let bytes = put_snapshot(&origin.dir, "s.kvr1", size, 9);
    origin.offered(9).await;
    let replicas = start_nodes(root.path(), 6, transport, PIECES);

    let out = fanout_command(&origin, &replicas).output().unwrap();
    let s = summary(&out);
    assert!(out.status.success(), "{s}");
    assert_eq!(
        (s["succeeded"].as_u64(), s["failed"].as_u64()),
        (Some(6), Some(0)),
        "{s}"
    );
    assert_eq!(s["snapshot"]["seq"], 9);

    // The tree: the origin feeds r0 and r1; r0 feeds r2 and r3, r1 r4 and r5.
    for (i, r) in replicas.iter().enumerate() {
        let n = node(&s, r);
        let (parent, role, depth) = match i {
            0 | 1 => (origin.grpc(), "relay", 1),
            2 | 3 => (replicas[0].grpc(), "leaf", 2),
            _ => (replicas[1].grpc(), "leaf", 2),
        };
        assert_eq!(n["parent"], parent.as_str(), "r{i}: {n}");
        assert_eq!(
            (n["role"].as_str(), n["depth"].as_u64()),
            (Some(role), Some(depth))
        );
        let sync = &n["sync"];
        assert_eq!(sync["status"], "succeeded", "r{i}: {n}");
        assert_eq!(sync["transport"], label, "r{i}: {n}");
        let installed = sync["installed_path"].as_str().unwrap();
        assert!(
            std::fs::read(installed).unwrap() == bytes,
            "r{i}: exact copy"
        );
        assert_eq!(replmeta_seq(installed), Some(9));
    }

    // The origin sent the snapshot twice; each relay forwarded it twice.
    assert_eq!(s["origin_bytes_sent"].as_u64(), Some(2 * size), "{s}");
    for r in &replicas[..2] {
        assert_eq!(node(&s, r)["relay_bytes"].as_u64(), Some(2 * size), "{s}");
        assert_eq!(r.metric("kvsync_relay_bytes_total"), (2 * size) as f64);
        let relaying = r.status().await.relaying;
        assert_eq!(relaying.len(), 1, "{relaying:?}");
        assert_eq!(relaying[0].origin_node_id, "origin");
        assert_eq!(relaying[0].state, "installed");
    }
    for r in &replicas[2..] {
        assert_eq!(r.metric("kvsync_relay_bytes_total"), 0.0);
    }
    // Nothing holds a snapshot any more.
    origin.wait_released();
    for r in &replicas {
        r.wait_released();
        assert!(r.temp_files().is_empty(), "{:?}", r.temp_files());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_mid_transfer_leaves_its_children_to_resume_from_the_origin() {
    let root = tempfile::tempdir().unwrap();
    let size = 32 * MIB;
    // The origin sends 16 MiB/s in all: the transfer takes seconds.
    let origin = Node::start(
        root.path(),
        "origin",
        &format!("{PIECES}[sync]\nrate_limit = \"16MiB\"\n"),
        &[],
    );
    let bytes = put_snapshot(&origin.dir, "s.kvr1", size, 4);
    origin.offered(4).await;
    let mut replicas = start_nodes(root.path(), 4, "mode = \"tcp\"", PIECES);
    let fanout = fanout_command(&origin, &replicas)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();

    // r2 and r3 pull from r0; once r2 holds a few pieces, r0 dies (while it
    // still receives: it is reported failed, not succeeded, below).
    receiving(&replicas[2], 4 * MIB).await;
    replicas[0].proc.signal(libc::SIGKILL);
    replicas[0].proc.wait_exit();

    let out = fanout.wait_with_output().unwrap();
    let s = summary(&out);
    assert!(!out.status.success(), "one replica failed: {s}");
    assert_eq!(
        (s["succeeded"].as_u64(), s["failed"].as_u64()),
        (Some(3), Some(1)),
        "{s}"
    );
    assert!(
        !node(&s, &replicas[0])["error"].as_str().unwrap().is_empty(),
        "{s}"
    );
    for (i, r) in replicas.iter().enumerate().skip(1) {
        let sync = &node(&s, r)["sync"];
        assert_eq!(sync["status"], "succeeded", "r{i}: {s}");
        let installed = sync["installed_path"].as_str().unwrap();
        assert!(
            std::fs::read(installed).unwrap() == bytes,
            "r{i}: exact copy"
        );
    }
    // r2 turned to the origin and kept what it had verified from r0.
    let r2 = replicas[2].status().await;
    let p = r2.recent.first().expect("r2's sync");
    assert_eq!(p.source, origin.grpc(), "{p:?}");
    assert_eq!(p.abandoned_sources, vec![replicas[0].grpc()], "{p:?}");
    assert!(p.resumed_bytes >= 4 * MIB, "{p:?}");

    // Serving state and caches are released everywhere still running.
    origin.wait_released();
    for r in &mut replicas[1..] {
        r.wait_released();
        assert!(r.temp_files().is_empty(), "{:?}", r.temp_files());
    }
}

/// `bytes` with a record value changed so that the file's CRC32, and so
/// its size, seq and checksum, stay: still a valid KVR1 snapshot.
fn crc_neutral_forgery(bytes: &[u8]) -> Vec<u8> {
    let valid = |b: &[u8]| {
        let mut v = kvsync::snapshot::Verifier::new(kvsync::snapshot::Format::Kvr1, b.len() as u64)
            .unwrap();
        v.update(b).is_ok() && v.finish().is_ok()
    };
    (0..)
        .map(|k| (MIB + 977 * k) as usize)
        .map(|at| {
            let mut forged = bytes.to_vec();
            for (b, d) in forged[at..]
                .iter_mut()
                .zip(kvsync::transport::CRC32_NEUTRAL)
            {
                *b ^= d;
            }
            forged
        })
        .find(|forged| valid(forged))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_serving_a_crc_neutral_forgery_is_refused_by_the_digest_and_the_origin_serves() {
    let root = tempfile::tempdir().unwrap();
    let origin = Node::start(root.path(), "origin", PIECES, &[]);
    let bytes = put_snapshot(&origin.dir, "s.kvr1", 4 * MIB, 4);
    origin.offered(4).await;
    // An unmodified agent holding a doctored copy of the origin's snapshot.
    let relay = Node::start(root.path(), "relay", PIECES, &[]);
    let forged = crc_neutral_forgery(&bytes);
    std::fs::write(root.path().join("forged.tmp"), &forged).unwrap();
    std::fs::rename(root.path().join("forged.tmp"), relay.dir.join("s.kvr1")).unwrap();
    relay.offered(4).await;
    let genuine = origin.status().await.latest_snapshots.remove(0);
    let doctored = relay.status().await.latest_snapshots.remove(0);
    assert_eq!(
        (genuine.size, genuine.seq, genuine.checksum),
        (doctored.size, doctored.seq, doctored.checksum),
        "the forgery has the origin's size, seq and checksum"
    );
    assert_ne!(genuine.manifest_digest, doctored.manifest_digest);

    let pull = |digest: Vec<u8>| {
        let mut request = through(&relay, &origin, &genuine);
        request.snapshot.as_mut().unwrap().manifest_digest = digest;
        request
    };
    // By size, seq and checksum alone, the relay's copy is the snapshot
    // asked for: that request installs the forgery.
    let fooled = Node::start(root.path(), "fooled", PIECES, &[]);
    let p = run_sync(&fooled, pull(Vec::new())).await;
    assert_eq!(p.phase, pb::Phase::Succeeded as i32, "{p:?}");
    assert!(std::fs::read(&p.installed_path).unwrap() == forged);
    // It does not pass that on as the origin's snapshot: it was not
    // asked for by digest.
    assert!(fooled.status().await.relaying.is_empty());
    // With the origin's digest (what a fan-out sends every child), the
    // relay's snapshot is not the one asked for: the replica turns to the
    // origin and installs the genuine bytes.
    let replica = Node::start(root.path(), "replica", PIECES, &[]);
    let p = run_sync(&replica, pull(genuine.manifest_digest.clone())).await;
    assert_eq!(p.phase, pb::Phase::Succeeded as i32, "{p:?}");
    assert_eq!(p.source, origin.grpc(), "{p:?}");
    assert_eq!(p.abandoned_sources, vec![relay.grpc()], "{p:?}");
    assert!(std::fs::read(&p.installed_path).unwrap() == bytes);
    assert!(
        replica.temp_files().is_empty(),
        "{:?}",
        replica.temp_files()
    );
}

/// 4 MiB pieces: a relay's blocks are a quarter of one.
const BIG_PIECES: &str = "[data]\npiece_size = \"4MiB\"\n";

/// A request to pull the origin's snapshot `genuine` from `relay`, with
/// the origin as its upstream.
fn through(relay: &Node, origin: &Node, genuine: &pb::SnapshotEntry) -> pb::StartFullSyncRequest {
    pb::StartFullSyncRequest {
        source: relay.grpc(),
        upstream: vec![origin.grpc()],
        snapshot: Some(pb::SnapshotId {
            size: genuine.size,
            seq: genuine.seq,
            checksum: genuine.checksum,
            manifest_digest: genuine.manifest_digest.clone(),
        }),
        transport: pb::TransportPreference::Tcp as i32,
        ..Default::default()
    }
}

/// Waits until `node` relays a snapshot it is still receiving.
async fn relaying(node: &Node) {
    let client = node.client().await;
    wait_for_async(&format!("{} to relay", node.grpc()), DEADLINE, || {
        let mut c = client.clone();
        async move {
            let s = c.get_status(pb::GetStatusRequest::default()).await.ok()?;
            s.into_inner().relaying.first().map(drop)
        }
    })
    .await;
}

/// A relay passes a piece on while it still arrives: its origin stalls
/// 3 MiB into the first 4 MiB piece, so the relay has verified nothing,
/// and still its child receives the blocks that landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_passes_on_the_blocks_of_a_piece_before_the_piece_is_whole() {
    let root = tempfile::tempdir().unwrap();
    let faults = format!("stall_after={}", 3 * MIB);
    let origin = Node::start(
        root.path(),
        "origin",
        BIG_PIECES,
        &[("KVSYNC_FAULTS", &faults)],
    );
    put_snapshot(&origin.dir, "s.kvr1", 8 * MIB, 4);
    origin.offered(4).await;
    let genuine = origin.status().await.latest_snapshots.remove(0);
    let relay = Node::start(root.path(), "relay", BIG_PIECES, &[]);
    start_sync(&relay, through(&origin, &origin, &genuine)).await;
    relaying(&relay).await;
    let child = Node::start(root.path(), "child", BIG_PIECES, &[]);
    start_sync(&child, through(&relay, &origin, &genuine)).await;
    receiving(&child, 2 * MIB).await;
    let r = relay.status().await;
    let own = r.running.first().expect("the relay still receives");
    assert!(own.bytes_done <= 3 * MIB, "stalled mid-piece: {own:?}");
    let c = child.status().await;
    let p = c.running.first().expect("the child still receives");
    assert_eq!(p.source, relay.grpc(), "{p:?}");
    assert!(p.bytes_done >= 2 * MIB && p.bytes_done <= 3 * MIB, "{p:?}");
}

/// A piece that fails the relay's own check after the relay began passing
/// it on: the relay ends its child's session, the child drops those bytes
/// (it keeps only verified pieces) and pulls from the origin, and installs
/// the origin's exact bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_piece_that_fails_the_relays_check_after_it_was_passed_on_sends_the_child_up() {
    let root = tempfile::tempdir().unwrap();
    // The relay's first piece takes 4 s at 1 MiB/s, its last bytes damaged.
    let faults = format!("corrupt_at={}", 4 * MIB - 16);
    let origin = Node::start(
        root.path(),
        "origin",
        &format!("{BIG_PIECES}[sync]\nrate_limit = \"1MiB\"\n"),
        &[("KVSYNC_FAULTS", &faults)],
    );
    let bytes = put_snapshot(&origin.dir, "s.kvr1", 5 * MIB, 4);
    origin.offered(4).await;
    let genuine = origin.status().await.latest_snapshots.remove(0);
    let relay = Node::start(root.path(), "relay", BIG_PIECES, &[]);
    let relay_sync = start_sync(&relay, through(&origin, &origin, &genuine)).await;
    relaying(&relay).await;
    let child = Node::start(root.path(), "child", BIG_PIECES, &[]);
    let p = run_sync(&child, through(&relay, &origin, &genuine)).await;
    assert_eq!(p.phase, pb::Phase::Succeeded as i32, "{p:?}");
    assert_eq!(p.source, origin.grpc(), "{p:?}");
    assert_eq!(p.abandoned_sources, vec![relay.grpc()], "{p:?}");
    assert!(std::fs::read(&p.installed_path).unwrap() == bytes);
    let r = wait_done(&relay, &relay_sync).await;
    assert_eq!(r.phase, pb::Phase::Succeeded as i32, "{r:?}");
    assert_eq!(r.pieces_refetched, 1, "{r:?}");
    assert!(relay
        .proc
        .log()
        .contains("piece 0 failed this relay's own check"));
    assert!(child.temp_files().is_empty(), "{:?}", child.temp_files());
    origin.wait_released();
    relay.wait_released();
}

/// Starts `request` on `replica` and follows it to its end.
async fn run_sync(replica: &Node, request: pb::StartFullSyncRequest) -> pb::SyncProgress {
    let id = start_sync(replica, request).await;
    wait_done(replica, &id).await
}

/// Starts `request` on `replica`; its sync id.
async fn start_sync(replica: &Node, request: pb::StartFullSyncRequest) -> String {
    replica
        .client()
        .await
        .start_full_sync(request)
        .await
        .expect("start sync")
        .into_inner()
        .sync_id
}

#[test]
fn across_hosts_a_fanout_heals_around_a_killed_relay_with_the_callers_token() {
    let Some(hosts) = common::netns::Hosts::create_n("fan-out across hosts", 7) else {
        return;
    };
    let root = tempfile::tempdir().unwrap();
    let tcp = "mode = \"tcp\"";
    // Every agent on its own host's address, with a bearer token; the
    // origin sends 16 MiB/s in all.
    let origin_extra = format!("{PIECES}[sync]\nrate_limit = \"16MiB\"\n");
    let origin = hosts.run_in(0, || {
        Node::start_at(root.path(), "origin", &hosts.ip(0), tcp, &origin_extra, &[])
    });
    let mut replicas: Vec<Node> = (1..7)
        .map(|h| {
            hosts.run_in(h, || {
                Node::start_at(
                    root.path(),
                    &format!("r{}", h - 1),
                    &hosts.ip(h),
                    tcp,
                    PIECES,
                    &[],
                )
            })
        })
        .collect();
    let bytes = put_snapshot(&origin.dir, "s.kvr1", 32 * MIB, 8);
    let tokens = root.path().join("origin.tokens");
    let fanout = hosts.run_in(0, || {
        block_on(origin.offered(8));
        let mut cmd = fanout_command(&origin, &replicas);
        cmd.arg("--token-file")
            .arg(&tokens)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    });
    // r2 and r3 pull from r0 (host 1) across the bridge; r0 dies mid-transfer.
    hosts.run_in(3, || block_on(receiving(&replicas[2], 4 * MIB)));
    replicas[0].proc.signal(libc::SIGKILL);
    replicas[0].proc.wait_exit();
    let out = fanout.wait_with_output().unwrap();
    let s = summary(&out);
    assert_eq!(
        (s["succeeded"].as_u64(), s["failed"].as_u64()),
        (Some(5), Some(1)),
        "{s}"
    );
    for (i, r) in replicas.iter().enumerate().skip(1) {
        let sync = &node(&s, r)["sync"];
        assert_eq!(sync["status"], "succeeded", "r{i}: {s}");
        assert!(
            std::fs::read(r.dir.join("s.kvr1")).unwrap() == bytes,
            "r{i}: exact copy"
        );
    }
    for i in [2, 3] {
        let sync = &node(&s, &replicas[i])["sync"];
        assert_eq!(
            sync["source"],
            origin.grpc().as_str(),
            "r{i} turned to the origin: {s}"
        );
        assert_eq!(
            sync["abandoned_sources"][0],
            replicas[0].grpc().as_str(),
            "{s}"
        );
    }
    hosts.run_in(0, || origin.wait_released());
    for (i, r) in replicas.iter_mut().enumerate().skip(1) {
        hosts.run_in(i + 1, || r.wait_released());
    }
}
