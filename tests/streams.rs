//! Syncs over several TCP streams at once, between real agent processes:
//! exact copies at 1, 2, 4 and 7 streams for odd sizes (no payload, the
//! smallest record, a size that is no multiple of the piece size), a
//! session whose streams are all cut midway, resumed by the retry, and one
//! whose one stream is cut, finished by the others; `tcp_streams = "auto"`
//! on loopback (one stream) and over a link whose handshake counts as
//! 60 ms (three), the source freeing the session once its streams ended.

mod common;

use common::node::*;
use common::{wait_for_async, DEADLINE};
use kvsync::rpc::pb;
use kvsync::snapshot::kvr1::MIN_LEN;

const MIB: u64 = 1 << 20;
/// The source's config: 1 MiB pieces, and up to 16 streams per session.
const PIECES: &str = "[data]\npiece_size = \"1MiB\"\ntcp_streams = 16\n";

fn streams(n: u32) -> String {
    format!("[data]\ntcp_streams = {n}\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_stream_count_and_odd_size_gives_an_exact_copy() {
    let root = tempfile::tempdir().unwrap();
    let source = Node::start(root.path(), "source", PIECES, &[]);
    let replicas: Vec<(u32, Node)> = [1, 2, 4, 7]
        .into_iter()
        .map(|n| {
            (
                n,
                Node::start(root.path(), &format!("r{n}"), &streams(n), &[]),
            )
        })
        .collect();
    // No payload; one smallest record (8 bytes); no multiple of a piece.
    let sizes = [MIN_LEN, MIN_LEN + 8, 5 * MIB + 12_345];
    for (seq, size) in (1..).zip(sizes) {
        let bytes = put_snapshot(&source.dir, "s.kvr1", size, seq);
        source.offered(seq).await;
        for (n, replica) in &replicas {
            let p = sync_ok(replica, &source).await;
            assert_eq!(p.seq, seq);
            assert!(
                std::fs::read(replica.dir.join("s.kvr1")).unwrap() == bytes,
                "{n} streams, {size} bytes: not an exact copy"
            );
            assert!(replica.temp_files().is_empty());
            if *n > 1 {
                assert!(p.detail.contains(&format!("{n} streams")), "{}", p.detail);
            }
        }
    }
    // Every stream is its own session on the source, all served from the file.
    assert_eq!(source.metric("kvsync_snapshot_cache_loads_total"), 0.0);
    assert_eq!(
        source.metric("kvsync_fullsync_in_progress{role=\"source\"}"),
        0.0
    );
}

/// A 32 MiB sync on 4 streams from a source whose data plane has
/// `faults`, to a replica whose `[sync]` section is `sync`: the sync's
/// end (an exact copy, no temp file left) and the source.
async fn cut_sync(root: &std::path::Path, faults: &str, sync: &str) -> (pb::SyncProgress, Node) {
    let source = Node::start(root, "source", PIECES, &[("KVSYNC_FAULTS", faults)]);
    let bytes = put_snapshot(&source.dir, "s.kvr1", 32 * MIB, 7);
    source.offered(7).await;
    let replica = Node::start(
        root,
        "replica",
        &format!("{}[sync]\n{sync}", streams(4)),
        &[],
    );
    let p = sync_ok(&replica, &source).await;
    assert!(
        std::fs::read(&p.installed_path).unwrap() == bytes,
        "exact copy"
    );
    assert!(replica.temp_files().is_empty());
    (p, source)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_cut_midway_fail_the_attempt_and_the_retry_resumes() {
    let root = tempfile::tempdir().unwrap();
    // Every stream's session is cut after 5 MiB: the first attempt cannot
    // finish 32 MiB on 4 streams; what verified is kept and resumed.
    let retries = "retries = 4\nretry_backoff = \"50ms\"\n";
    let (p, _source) = cut_sync(root.path(), "cut_after=5242880", retries).await;
    assert!(p.attempts >= 2, "{p:?}");
    assert!(p.resumed_bytes >= 4 * MIB, "{p:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_midway_hands_its_pieces_to_the_others() {
    let root = tempfile::tempdir().unwrap();
    // Only the session's second stream is cut, after 5 MiB: the pieces it
    // took and did not verify go back to the queue, the other three fetch
    // them, and the first attempt succeeds. Before the queue, one stream's
    // failure failed the attempt.
    let faults = "cut_after=5242880,cut_stream=1";
    let (p, source) = cut_sync(root.path(), faults, "retries = 0\n").await;
    assert_eq!(p.attempts, 1, "{p:?}");
    // The source sent the cut stream's unverified pieces once more, no
    // other piece twice.
    let sent = source.metric("kvsync_fullsync_bytes_total");
    assert!(sent < (32 + 5 + 4) as f64 * MIB as f64, "{sent}");
}

/// A 64 MiB sync with `tcp_streams = "auto"` (replica faults `faults`)
/// from a source that grants 4 streams and sends at most 16 MiB/s in all,
/// so the first second leaves more than 2 s to go: an exact copy in one
/// attempt, and the source frees the session once its streams ended (the
/// ones never dialled do not hold it until the token expires, 60 s).
async fn auto_sync(faults: &str) -> pb::SyncProgress {
    let root = tempfile::tempdir().unwrap();
    let source = Node::start(
        root.path(),
        "source",
        "[data]\npiece_size = \"1MiB\"\ntcp_streams = 4\n[sync]\nrate_limit = \"16MiB\"\n",
        &[],
    );
    let bytes = put_snapshot(&source.dir, "s.kvr1", 64 * MIB, 3);
    source.offered(3).await;
    let env = [("KVSYNC_FAULTS", faults)];
    let replica = Node::start(
        root.path(),
        "replica",
        "[data]\ntcp_streams = \"auto\"\n",
        &env,
    );
    let p = sync_ok(&replica, &source).await;
    assert!(
        std::fs::read(&p.installed_path).unwrap() == bytes,
        "exact copy"
    );
    assert_eq!(p.attempts, 1, "{p:?}");
    assert!(replica.temp_files().is_empty());
    wait_for_async("the source to free the session", DEADLINE, || async {
        (source.status().await.serving_sessions == 0).then_some(())
    })
    .await;
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_runs_one_stream_on_a_lan() {
    // Loopback's round trip is far under 10 ms: one stream of the 4.
    let p = auto_sync("").await;
    assert!(
        p.detail.contains("tcp_streams = auto: 1 of 4 streams"),
        "{}",
        p.detail
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_adds_streams_after_the_first_second_over_a_long_link() {
    // The replica's handshakes count as 60 ms: a long link, 3 streams by
    // the rule (one per 25 ms).
    let p = auto_sync("handshake_ms=60").await;
    let three = "tcp_streams = auto: 3 of 4 streams for a 60 ms round trip";
    assert!(p.detail.contains(three), "{}", p.detail);
}
