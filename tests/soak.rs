//! Soak: eight replicas pull from one source at once, round after round,
//! with the snapshot changing between rounds. Every installed file must be
//! byte-identical to what was offered, and at the end the agents' open file
//! descriptors and RSS are back at their baseline and the source's cache is
//! empty. The suite runs a short soak; `scripts/soak.sh` the long one
//! (`KVSYNC_SOAK_ROUNDS`, `KVSYNC_SOAK_SIZE`).

mod common;

use common::node::*;
use common::*;
use kvsync::rpc::pb;

const REPLICAS: usize = 8;

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Open file descriptors and resident memory (KiB) of a process.
fn usage(pid: u32) -> (usize, u64) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
        .unwrap();
    (fds, rss)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_replicas_round_after_round_install_exact_copies_and_leak_nothing() {
    let rounds: u64 = env_or("KVSYNC_SOAK_ROUNDS", 5);
    let size = env_or("KVSYNC_SOAK_SIZE", bytesize::ByteSize::mib(8)).as_u64();
    // RSS may drift by allocator caching, never by a snapshot's worth.
    let slack_kib = 4 * 1024;
    let root = tempfile::tempdir().unwrap();
    // Memory is freed as soon as a round ends (no linger), so every round
    // checks that nothing leaked.
    let source = Node::start(root.path(), "source", "[cache]\nlinger = \"0s\"\n", &[]);
    let replicas: Vec<Node> = (0..REPLICAS)
        .map(|i| Node::start(root.path(), &format!("r{i}"), "", &[]))
        .collect();
    let agents = || std::iter::once(&source).chain(&replicas);

    let mut baseline = Vec::new();
    // Round 0 warms thread pools and allocator arenas; the baseline follows it.
    for round in 0..=rounds {
        let seq = 100 + round;
        let bytes = put_snapshot(&source.dir, "s.kvr1", size + round * 4099, seq);
        source.offered(seq).await;
        let ids = futures::future::join_all(replicas.iter().map(|r| start_sync(r, &source))).await;
        let done =
            futures::future::join_all(replicas.iter().zip(&ids).map(|(r, id)| wait_done(r, id)))
                .await;
        for (r, p) in replicas.iter().zip(done) {
            assert_eq!(p.phase, pb::Phase::Succeeded as i32, "round {round}: {p:?}");
            assert_eq!(p.seq, seq);
            assert!(
                std::fs::read(&p.installed_path).unwrap() == bytes,
                "round {round}: {} differs from the offered snapshot",
                p.installed_path
            );
            assert!(r.temp_files().is_empty());
        }
        wait_for("the source's cache to empty", DEADLINE, || {
            (source.metric("kvsync_snapshot_cache_refs") == 0.0
                && source.metric("kvsync_snapshot_cache_entries") == 0.0
                && source.metric("kvsync_snapshot_cache_bytes") == 0.0)
                .then_some(())
        });
        let now: Vec<_> = agents().map(|a| usage(a.proc.child.id())).collect();
        eprintln!(
            "soak round {round}: (fds, RSS KiB) source {:?}, replicas {:?}",
            now[0],
            &now[1..]
        );
        if round == 0 {
            baseline = now;
        }
    }
    assert_eq!(
        source.metric("kvsync_snapshot_cache_loads_total"),
        0.0,
        "TCP sessions send the file from the page cache, never an image in the agent's memory"
    );
    for (agent, (fds, rss)) in agents().zip(&baseline) {
        let pid = agent.proc.child.id();
        // Connections close asynchronously after a sync reports its end.
        let now = wait_for("descriptors back to the baseline", DEADLINE, || {
            let now = usage(pid);
            (now.0 <= *fds).then_some(now)
        });
        assert!(
            now.1 <= rss + slack_kib,
            "RSS of {pid} grew from {rss} KiB to {} KiB over {rounds} rounds",
            now.1
        );
    }
}
