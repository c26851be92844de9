//! The documented scripts that start processes, run as a user runs them:
//! each does what it says, and nothing it started outlives it
//! (`common::run_script` finds every process by an inherited marker).
//! `scripts/rxe-vm.sh` is run the same way by every soft-RoCE VM test;
//! `scripts/bench.sh` (release builds, GiB files) is a benchmark, not a test.

mod common;

use common::*;

#[test]
fn the_demo_script_syncs_and_leaves_nothing_running() {
    let out = run_script(
        "demo.sh",
        &["--size", "4MiB", "--json"],
        &[("KVSYNC_BIN", kvsync_bin())],
    );
    assert!(out.status.success(), "{out:?}");
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["status"], "succeeded", "{summary}");
    assert_eq!(summary["bytes"], 4 << 20, "{summary}");
    assert_eq!(summary["seq"], 1_000_042, "{summary}");
}

#[test]
fn the_redis_seeding_demo_seeds_a_replica_and_leaves_nothing_running() {
    seeding_demo("redis");
}

#[test]
fn the_valkey_seeding_demo_also_times_a_dual_channel_full_sync() {
    let stdout = seeding_demo("valkey");
    assert!(
        stdout.contains("== Valkey dual-channel full sync") && stdout.contains("replica keys 2100"),
        "{stdout}"
    );
    // Its row has the dual-channel columns: time, ratio, forks, CoW.
    let row = stdout.lines().find(|l| l.starts_with("| ")).unwrap();
    assert_eq!(row.matches('|').count(), 12, "{row}");
}

/// Runs the seeding demo small against `server` and checks what every
/// run must show; its output.
fn seeding_demo(server: &str) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let out = run_script(
        "redis-seed-demo.sh",
        &["2000", "32"],
        &[
            ("KVSYNC_BIN", kvsync_bin()),
            ("TMPDIR", tmp.path().to_str().unwrap()),
            ("SERVER", server),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The seeded replica continued with a partial resync (the primary's
    // one full sync is the helper that created its backlog).
    assert!(
        stdout.contains("\"status\":\"succeeded\"")
            && stdout.contains("primary after: sync_full=1 sync_partial_ok=1"),
        "{stdout}"
    );
    assert!(stdout.contains("keys: primary 2100,"), "{stdout}");
    // Its work directory went with it.
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    stdout.into_owned()
}
