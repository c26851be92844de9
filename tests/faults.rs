//! Faults against real agent processes: a source killed with SIGKILL, a
//! snapshot rewritten under a running transfer, a replica whose disk fills.
//! Each must end in a clean error that loses nothing — no temp file, the
//! previous snapshot in place — or in exactly the offered bytes.

mod common;

use common::node::*;
use common::*;
use kvsync::rpc::pb;

/// Asserts the failure left the replica as it was: no temp file, the
/// previous snapshot unchanged, nothing else installed.
fn assert_untouched(replica: &Node, previous: &[u8], offered_name: &str) {
    assert!(
        replica.temp_files().is_empty(),
        "{:?}",
        replica.temp_files()
    );
    assert_eq!(
        std::fs::read(replica.dir.join("prev.kvr1")).unwrap(),
        previous
    );
    assert!(!replica.dir.join(offered_name).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_sigkilled_mid_transfer_fails_cleanly_and_a_retry_succeeds_once_it_is_back() {
    let root = tempfile::tempdir().unwrap();
    let (mut source, bytes) = offering_source(
        root.path(),
        16 << 20,
        70,
        &[("KVSYNC_FAULTS", "stall_after=2097152")],
    )
    .await;
    let replica = Node::start(root.path(), "replica", "", &[]);
    let previous = put_snapshot(&replica.dir, "prev.kvr1", 1 << 20, 1);
    let (grpc, data) = (source.grpc(), source.data());
    let id = start_sync(&replica, &source).await;
    wait_bytes(&replica, &id, 2 << 20).await;
    source.proc.child.kill().unwrap(); // SIGKILL
    source.proc.child.wait().unwrap();

    let p = wait_done(&replica, &id).await;
    assert_eq!(p.phase, pb::Phase::Failed as i32, "{p:?}");
    assert!(
        p.error.contains("closed") || p.error.contains("reset"),
        "{}",
        p.error
    );
    assert_untouched(&replica, &previous, "s.kvr1");

    // The source comes back on the same addresses, without the fault.
    let config = root.path().join("source.toml");
    source.proc = AgentProcess::start(
        &[
            "--config",
            config.to_str().unwrap(),
            "--grpc-listen",
            &grpc,
            "--data-listen",
            &data,
        ],
        root.path(),
    );
    source.offered(70).await;
    let p = sync_ok(&replica, &source).await;
    assert_eq!(std::fs::read(&p.installed_path).unwrap(), bytes);
    assert_eq!(
        std::fs::read(replica.dir.join("prev.kvr1")).unwrap(),
        previous
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_rewritten_in_place_mid_transfer_delivers_the_offered_bytes_or_fails_cleanly() {
    let root = tempfile::tempdir().unwrap();
    // 32 MiB at 16 MiB/s: the rewrite lands while bytes are moving.
    let source = Node::start(
        root.path(),
        "source",
        "[sync]\nrate_limit = \"16MiB\"\n",
        &[],
    );
    let offered = put_snapshot(&source.dir, "s.kvr1", 32 << 20, 80);
    source.offered(80).await;
    let replica = Node::start(root.path(), "replica", "", &[]);
    let previous = put_snapshot(&replica.dir, "prev.kvr1", 1 << 20, 1);
    let id = start_sync(&replica, &source).await;
    wait_bytes(&replica, &id, 4 << 20).await;

    // Overwrite the file in place (same inode, same size, new content).
    let newer = root.path().join("newer.kvr1");
    gen_snapshot(&newer, 32 << 20, 81);
    let newer = std::fs::read(&newer).unwrap();
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(source.dir.join("s.kvr1"))
            .unwrap();
        f.write_all(&newer).unwrap();
        f.sync_all().unwrap();
    }

    let p = wait_done(&replica, &id).await;
    if p.phase == pb::Phase::Succeeded as i32 {
        assert_eq!(std::fs::read(&p.installed_path).unwrap(), offered);
        assert_eq!(p.seq, 80);
    } else {
        assert_eq!(p.phase, pb::Phase::Failed as i32, "{p:?}");
        assert_untouched(&replica, &previous, "s.kvr1");
    }
    // The rewritten file is then offered as itself, and delivered exactly.
    source.offered(81).await;
    let p = sync_ok(&replica, &source).await;
    assert_eq!(p.seq, 81);
    assert_eq!(std::fs::read(&p.installed_path).unwrap(), newer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_full_on_the_replica_fails_cleanly_and_releases_the_space() {
    let root = tempfile::tempdir().unwrap();
    let Some(fs) = SmallFs::mount(&root.path().join("replica"), "8m") else {
        return;
    };
    let (source, _) = offering_source(root.path(), 16 << 20, 90, &[]).await;
    let replica = Node::start(root.path(), "replica", "", &[]);
    let previous = put_snapshot(&replica.dir, "prev.kvr1", 1 << 20, 1);
    let used = fs.used_bytes();

    let id = start_sync(&replica, &source).await;
    let p = wait_done(&replica, &id).await;
    assert_eq!(p.phase, pb::Phase::Failed as i32, "{p:?}");
    // Refused before anything is reserved (a write that still hits a full
    // disk is the data-path failure table's "no room" case).
    assert!(
        p.error.contains("not enough free space") && p.error.contains("sync.min_free_after"),
        "{}",
        p.error
    );
    assert_untouched(&replica, &previous, "s.kvr1");
    assert_eq!(fs.used_bytes(), used, "the space is released");
    source.wait_released();
}
