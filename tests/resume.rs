//! Pieces and resume between real agent processes: a damaged piece is
//! fetched again alone (TCP and the emulated RDMA fabric, an emulation of
//! RC queue pairs), and one changed on the wire so that its CRC32 stays is
//! caught every time; a cut connection, a SIGKILLed replica agent and a
//! restarted source resume where they stopped and move only the rest; a
//! changed snapshot and a journal that lies start over cleanly (the lie is
//! caught by the read-back that runs beside the transfer, and the job's
//! retry starts over). Bytes moved are counted at the source.

mod common;

use std::path::{Path, PathBuf};

use common::node::*;
use common::*;
use kvsync::rpc::pb;

const MIB: u64 = 1 << 20;
/// 32 pieces of 1 MiB.
const SIZE: u64 = 32 * MIB;
/// The source's config: 1 MiB pieces.
const PIECES: &str = "[data]\npiece_size = \"1MiB\"\n";

fn tcp_bytes_sent(source: &Node) -> f64 {
    source.metric("kvsync_fullsync_bytes_total{role=\"source\",transport=\"tcp\"}")
}

/// The installed snapshot of a finished sync.
fn installed(p: &pb::SyncProgress) -> Vec<u8> {
    std::fs::read(&p.installed_path).unwrap()
}

/// `[transport]` of an agent on the emulated fabric.
const EMULATED: &str = "mode = \"rdma\"\nrdma_provider = \"emulated\"\nfallback_to_tcp = true";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_damaged_piece_is_fetched_again_alone_over_tcp_and_emulated_rdma() {
    for (transport, label, fault) in [
        ("mode = \"tcp\"", "tcp", "corrupt_at=5000000"),
        (EMULATED, "rdma", "rdma_corrupt_at=5000000"),
    ] {
        let root = tempfile::tempdir().unwrap();
        let env = [("KVSYNC_FAULTS", fault)];
        let source = Node::start_with(root.path(), "source", transport, PIECES, &env);
        let bytes = put_snapshot(&source.dir, "s.kvr1", SIZE, 3);
        source.offered(3).await;
        let replica = Node::start_with(root.path(), "replica", transport, "", &[]);
        let p = sync_ok(&replica, &source).await;
        assert!(installed(&p) == bytes, "{label}: exact copy");
        assert_eq!(p.pieces_refetched, 1, "{label}: {p:?}");
        assert!(
            p.fallback_reason.is_empty(),
            "{label}: same transport: {p:?}"
        );
        assert!(
            p.check.contains("blake3 of each of 32 pieces"),
            "{}",
            p.check
        );
        let refetch = format!("kvsync_piece_refetch_total{{transport=\"{label}\"}}");
        assert_eq!(replica.metric(&refetch), 1.0, "{label}");
        let sent = format!("kvsync_fullsync_bytes_total{{role=\"source\",transport=\"{label}\"}}");
        wait_for("the source to count its bytes", DEADLINE, || {
            (source.metric(&sent) == (SIZE + MIB) as f64).then_some(())
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_piece_past_its_retries_fails_and_keeps_the_previous_snapshot() {
    let root = tempfile::tempdir().unwrap();
    let env = [("KVSYNC_FAULTS", "corrupt_at=5000000")];
    let source = Node::start(root.path(), "source", PIECES, &env);
    put_snapshot(&source.dir, "s.kvr1", SIZE, 21);
    source.offered(21).await;
    let replica = Node::start(
        root.path(),
        "replica",
        "[data]\npiece_retries = 0\nresume_ttl = \"3s\"\n",
        &[],
    );
    let previous = put_snapshot(&replica.dir, "s.kvr1", 4096, 20);
    let id = start_sync(&replica, &source).await;
    let p = wait_done(&replica, &id).await;
    assert_eq!(
        (p.phase, p.result.as_str()),
        (pb::Phase::Failed as i32, "checksum_mismatch")
    );
    assert!(
        p.error.contains("piece 4") && p.error.contains("failed its check 1 times"),
        "{}",
        p.error
    );
    assert!(std::fs::read(replica.dir.join("s.kvr1")).unwrap() == previous);
    assert!(!replica.dir.join("s.kvr1.replmeta").exists());
    assert_eq!(
        replica.metric("kvsync_fullsync_total{result=\"checksum_mismatch\",role=\"replica\",transport=\"tcp\"}"),
        1.0
    );
    wait_for("the source to count the RDFL", DEADLINE, || {
        (source.metric(
            "kvsync_fullsync_total{result=\"checksum_mismatch\",role=\"source\",transport=\"tcp\"}",
        ) == 1.0)
            .then_some(())
    });
    // What verified stays for a sync to resume: the file and its journal.
    let temps = replica.temp_files();
    assert_eq!(temps.len(), 2, "{temps:?}");
    assert!(temps.iter().any(|t| t.ends_with(".journal")), "{temps:?}");
    // Not resumed within data.resume_ttl: swept, and logged.
    wait_for("the partial sync to be swept", DEADLINE, || {
        let logged = replica
            .proc
            .log()
            .contains("not resumed within data.resume_ttl");
        (logged && replica.temp_files().is_empty()).then_some(())
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_on_the_wire_that_crc32_cannot_see_fails_its_piece_every_time() {
    // As an on-path attacker without the key would: 5 bytes of piece 4
    // changed in every sending, so that the piece's CRC32 stays the same.
    let root = tempfile::tempdir().unwrap();
    let env = [("KVSYNC_FAULTS", "forge_at=5000000")];
    let source = Node::start(root.path(), "source", PIECES, &env);
    put_snapshot(&source.dir, "s.kvr1", SIZE, 21);
    source.offered(21).await;
    let replica = Node::start(root.path(), "replica", "[data]\npiece_retries = 2\n", &[]);
    let previous = put_snapshot(&replica.dir, "s.kvr1", 4096, 20);
    let id = start_sync(&replica, &source).await;
    let p = wait_done(&replica, &id).await;
    assert_eq!(
        (p.phase, p.result.as_str()),
        (pb::Phase::Failed as i32, "checksum_mismatch"),
        "{p:?}"
    );
    assert!(
        p.error.contains("piece 4") && p.error.contains("failed its check 3 times"),
        "{}",
        p.error
    );
    assert_eq!(p.pieces_refetched, 3, "{p:?}");
    assert!(std::fs::read(replica.dir.join("s.kvr1")).unwrap() == previous);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_resumes_and_the_retry_moves_only_the_rest() {
    let root = tempfile::tempdir().unwrap();
    // 64 MiB: what the socket buffers held at the cut is small beside it.
    let size = 2 * SIZE;
    let cut = size * 6 / 10;
    let env = [("KVSYNC_FAULTS", format!("cut_after={cut}"))];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let source = Node::start(root.path(), "source", PIECES, &env);
    let bytes = put_snapshot(&source.dir, "s.kvr1", size, 7);
    source.offered(7).await;
    let replica = Node::start(
        root.path(),
        "replica",
        "[sync]\nretries = 1\nretry_backoff = \"50ms\"\n",
        &[],
    );
    let p = sync_ok(&replica, &source).await;
    assert_eq!(p.attempts, 2, "{p:?}");
    assert!(installed(&p) == bytes, "exact copy");
    assert!(p.resumed_bytes >= 32 * MIB, "{p:?}");
    assert_eq!(
        replica.metric("kvsync_resumed_bytes_total"),
        p.resumed_bytes as f64
    );
    // The first session stopped at the cut; the retry moved the rest.
    let total = wait_for("the source to count both sessions", DEADLINE, || {
        let t = tcp_bytes_sent(&source);
        (t >= size as f64).then_some(t)
    });
    let retry = total - cut as f64;
    assert!(
        retry <= 0.45 * size as f64,
        "the retry moved {retry} of {size} bytes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rdma_session_cut_midway_resumes_over_tcp() {
    let root = tempfile::tempdir().unwrap();
    let env = [("KVSYNC_FAULTS", "rdma_cut_after=20000000")];
    let source = Node::start_with(root.path(), "source", EMULATED, PIECES, &env);
    let bytes = put_snapshot(&source.dir, "s.kvr1", SIZE, 8);
    source.offered(8).await;
    let replica = Node::start_with(root.path(), "replica", EMULATED, "", &[]);
    let p = sync_ok(&replica, &source).await;
    assert!(installed(&p) == bytes, "exact copy");
    assert!(!p.fallback_reason.is_empty(), "{p:?}");
    // What the RDMA session verified before the cut (pieces whose PDON
    // still got through) stays; TCP moves exactly the rest.
    assert!(p.resumed_bytes >= 8 * MIB, "{p:?}");
    let tcp = wait_for("the source to count the tcp session", DEADLINE, || {
        let t = tcp_bytes_sent(&source);
        (t > 0.0).then_some(t)
    });
    assert_eq!(tcp, (SIZE - p.resumed_bytes) as f64);
}

/// A replica agent SIGKILLed while the source stalls after 20 MiB, once its
/// journal records at least 16 pieces; the source is stopped too. Returns
/// the replica's directory.
async fn killed_midway(root: &Path, seq: u64) -> PathBuf {
    let env = [("KVSYNC_FAULTS", "stall_after=20971520")];
    let source = Node::start(root, "source", PIECES, &env);
    put_snapshot(&source.dir, "s.kvr1", SIZE, seq);
    source.offered(seq).await;
    let mut replica = Node::start(root, "replica", "", &[]);
    let id = start_sync(&replica, &source).await;
    wait_bytes(&replica, &id, 20 * MIB).await;
    let journal = wait_for("a journal of 16 pieces", DEADLINE, || {
        let path = replica
            .temp_files()
            .into_iter()
            .find(|t| t.ends_with(".journal"))?;
        let bytes = std::fs::read(replica.dir.join(&path)).ok()?;
        let j = kvsync::store::journal::Journal::decode(&bytes).ok()?;
        (j.verified.iter().filter(|v| **v).count() >= 16).then_some(j)
    });
    assert_eq!(journal.source, "source");
    replica.proc.child.kill().unwrap();
    replica.proc.child.wait().unwrap();
    replica.dir.clone()
}

/// The partial file of `dir` (not its journal).
fn partial(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.to_string_lossy()
                .ends_with(kvsync::store::install::TEMP_SUFFIX)
        })
        .expect("a partial file")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_and_a_restarted_source_resume_where_they_stopped() {
    let root = tempfile::tempdir().unwrap();
    killed_midway(root.path(), 5).await;
    // Both agents start again; the source still has the same snapshot.
    let replica = Node::start(root.path(), "replica", "", &[]);
    assert_eq!(replica.temp_files().len(), 2, "kept for resuming");
    let source = Node::start(root.path(), "source", PIECES, &[]);
    source.offered(5).await;
    // As an operator runs it: `kvsync sync --wait --json`.
    let v = cli_sync_ok(&replica, &source);
    let resumed = v["resumed_bytes"].as_u64().unwrap();
    assert!(resumed >= 16 * MIB, "{v}");
    assert_eq!(v["pieces_refetched"], 0, "{v}");
    let got = std::fs::read(v["installed_path"].as_str().unwrap()).unwrap();
    assert!(got == std::fs::read(source.dir.join("s.kvr1")).unwrap());
    let sent = wait_for("the source to count", DEADLINE, || {
        let t = tcp_bytes_sent(&source);
        (t > 0.0).then_some(t)
    });
    assert_eq!(sent, (SIZE - resumed) as f64, "only the rest moved");
    assert!(
        replica.temp_files().is_empty(),
        "{:?}",
        replica.temp_files()
    );
    // `kvsync status` says so too.
    let status = std::process::Command::new(kvsync_bin())
        .args(["status", "--agent", &replica.grpc()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    let said = format!("(resumed {resumed} bytes, 0 piece(s) fetched again)");
    assert!(text.contains(&said), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_snapshot_at_the_source_starts_over_never_a_mix() {
    let root = tempfile::tempdir().unwrap();
    killed_midway(root.path(), 5).await;
    let replica = Node::start(root.path(), "replica", "", &[]);
    let source = Node::start(root.path(), "source", PIECES, &[]);
    let new = put_snapshot(&source.dir, "s.kvr1", SIZE, 6);
    source.offered(6).await;
    let p = sync_ok(&replica, &source).await;
    assert_eq!(p.resumed_bytes, 0, "{p:?}");
    assert!(installed(&p) == new, "the new snapshot, whole");
    let sent = wait_for("the source to count", DEADLINE, || {
        let t = tcp_bytes_sent(&source);
        (t > 0.0).then_some(t)
    });
    assert_eq!(sent, SIZE as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_that_lies_is_detected_and_the_sync_starts_over() {
    let root = tempfile::tempdir().unwrap();
    let dir = killed_midway(root.path(), 5).await;
    // The journal claims piece 3; the file no longer holds it.
    let path = partial(&dir);
    let mut held = std::fs::read(&path).unwrap();
    held[3 * MIB as usize + 17] ^= 0xff;
    std::fs::write(&path, held).unwrap();
    // The claimed pieces are checked while the rest moves: the lie fails
    // that attempt at its end, and the retry starts over.
    let retry = "[sync]\nretries = 1\nretry_backoff = \"50ms\"\n";
    let replica = Node::start(root.path(), "replica", retry, &[]);
    let source = Node::start(root.path(), "source", PIECES, &[]);
    source.offered(5).await;
    let p = sync_ok(&replica, &source).await;
    assert_eq!((p.attempts, p.resumed_bytes), (2, 0), "{p:?}");
    assert!(
        p.last_error.contains("the resume journal was wrong"),
        "{p:?}"
    );
    assert!(installed(&p) == std::fs::read(source.dir.join("s.kvr1")).unwrap());
    assert!(
        replica
            .proc
            .log()
            .contains("the resume journal is wrong (piece 3 is not what the manifest says)"),
        "{}",
        replica.proc.log()
    );

    // A truncated journal is no journal: the start-up sweep removes its file.
    let root = tempfile::tempdir().unwrap();
    let dir = killed_midway(root.path(), 5).await;
    let journal = kvsync::store::install::journal_path(&partial(&dir));
    let bytes = std::fs::read(&journal).unwrap();
    std::fs::write(&journal, &bytes[..bytes.len() / 2]).unwrap();
    let replica = Node::start(root.path(), "replica", "", &[]);
    assert!(
        replica.temp_files().is_empty(),
        "{:?}",
        replica.temp_files()
    );
    assert!(replica
        .proc
        .log()
        .contains("removed temp files of an earlier run that cannot be resumed"));
}
