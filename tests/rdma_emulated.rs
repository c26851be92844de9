//! RDMA syncs between real agent processes over the emulated fabric (an
//! emulation of RC queue pairs over TCP; the host has no RDMA): transport
//! selection, both receive-memory paths, session proof in the connect
//! private data, and TCP fallback for each RDMA failure the fabric can
//! inject. The same code runs over real verbs in the soft-RoCE VM
//! (tests/rxe_vm.rs).

mod common;

use common::node::*;
use common::*;
use kvsync::rpc::pb;
use kvsync::transport::emulated::{EmuFaults, EmuQp};
use kvsync::transport::fabric::{Fabric, FabricError};

/// `[transport]` of an agent that uses the emulated fabric.
fn emulated(mode: &str, fallback: bool) -> String {
    format!("mode = \"{mode}\"\nrdma_provider = \"emulated\"\nfallback_to_tcp = {fallback}")
}

fn node(root: &std::path::Path, name: &str, transport: &str, env: &[(&str, &str)]) -> Node {
    Node::start_with(root, name, transport, "", env)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_syncs_over_the_emulated_fabric_byte_identical() {
    let root = tempfile::tempdir().unwrap();
    let source = node(root.path(), "source", &emulated("auto", true), &[]);
    let replica = node(root.path(), "replica", &emulated("auto", true), &[]);
    assert!(
        source.proc.addr("rdma").starts_with("emulated:"),
        "{:?}",
        source.proc.ready
    );
    for (i, size) in [36u64, (3 << 20) + 7].into_iter().enumerate() {
        let seq = 10 + i as u64;
        let name = format!("s-{seq}.kvr1");
        let bytes = put_snapshot(&source.dir, &name, size, seq);
        source.offered(seq).await;
        let p = sync_ok(&replica, &source).await;
        assert_eq!(p.transport, pb::Transport::Rdma as i32, "{p:?}");
        assert!(
            p.detail.contains("EMULATED") && p.detail.contains("registered temp-file mapping"),
            "{}",
            p.detail
        );
        assert_eq!(p.fallback_reason, "");
        assert!(std::fs::read(&p.installed_path).unwrap() == bytes);
        assert_eq!(replmeta_seq(&p.installed_path), Some(seq));
    }
    assert_eq!(
        source.metric(r#"kvsync_fullsync_total{result="ok",role="source",transport="rdma"}"#),
        2.0
    );
    assert_eq!(
        replica.metric(r#"kvsync_fullsync_total{result="ok",role="replica",transport="rdma"}"#),
        2.0
    );
    assert_eq!(replica.metric("kvsync_rdma_available"), 1.0);
    assert!(replica.temp_files().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_file_registration_receives_into_an_anonymous_buffer() {
    let root = tempfile::tempdir().unwrap();
    let source = node(root.path(), "source", &emulated("rdma", false), &[]);
    let replica = node(
        root.path(),
        "replica",
        &emulated("rdma", false),
        &[("KVSYNC_FAULTS", "rdma_no_file_mr=1")],
    );
    let bytes = put_snapshot(&source.dir, "s.kvr1", 5 << 20, 4);
    source.offered(4).await;
    let p = sync_ok(&replica, &source).await;
    assert_eq!(p.transport, pb::Transport::Rdma as i32);
    assert!(p.detail.contains("anonymous buffer"), "{}", p.detail);
    assert!(std::fs::read(&p.installed_path).unwrap() == bytes);
}

/// Starts a source with `faults` and a replica in `mode`, syncs, and
/// returns the result.
async fn sync_with_source_faults(
    faults: &str,
    mode: &str,
    fallback: bool,
) -> (tempfile::TempDir, Node, Node, pb::SyncProgress, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let source = node(
        root,
        "source",
        &emulated("auto", true),
        &[("KVSYNC_FAULTS", faults)],
    );
    let replica = node(root, "replica", &emulated(mode, fallback), &[]);
    let bytes = put_snapshot(&source.dir, "s.kvr1", 2 << 20, 9);
    source.offered(9).await;
    let id = start_sync(&replica, &source).await;
    let p = wait_done(&replica, &id).await;
    (dir, source, replica, p, bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_rkey_is_an_access_error_and_falls_back_to_tcp() {
    let (_dir, source, replica, p, bytes) =
        sync_with_source_faults("rdma_bad_rkey=1", "rdma", true).await;
    assert_eq!(
        p.phase,
        pb::Phase::Succeeded as i32,
        "{}\n{}",
        p.error,
        replica.proc.log()
    );
    assert_eq!(p.transport, pb::Transport::Tcp as i32);
    assert!(
        p.fallback_reason.starts_with("completion_error"),
        "{}",
        p.fallback_reason
    );
    assert!(std::fs::read(&p.installed_path).unwrap() == bytes);
    assert!(
        source.proc.log().contains("REM_ACCESS_ERR"),
        "{}",
        source.proc.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_connection_without_fallback_fails_cleanly() {
    let (_dir, _source, replica, p, _) =
        sync_with_source_faults("rdma_cut_after=1000000", "rdma", false).await;
    failed_leaving_nothing(&replica, &p, "rdma transfer failed");
}

/// The sync failed with `error` and left neither a temp file nor a snapshot.
fn failed_leaving_nothing(replica: &Node, p: &pb::SyncProgress, error: &str) {
    assert_eq!(p.phase, pb::Phase::Failed as i32, "{p:?}");
    assert!(p.error.contains(error), "{}", p.error);
    assert_eq!(p.installed_path, "");
    assert!(
        replica.temp_files().is_empty(),
        "{:?}",
        replica.temp_files()
    );
    assert!(
        std::fs::read_dir(&replica.dir).unwrap().next().is_none(),
        "nothing installed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_writing_into_a_verified_piece_gets_nothing_installed() {
    // Receive memory over the file: the write lands in the staging file;
    // the re-check after the revoke finds it and the sync fails.
    let (_dir, _source, replica, p, _) =
        sync_with_source_faults("rdma_write_after_verify=1", "rdma", false).await;
    failed_leaving_nothing(&replica, &p, "piece 0 changed after it was verified");
    // An anonymous receive buffer: piece 0 was copied out when its PDON
    // came, so the write changes nothing that is checked or installed.
    let dir = tempfile::tempdir().unwrap();
    let source = node(
        dir.path(),
        "source",
        &emulated("auto", true),
        &[("KVSYNC_FAULTS", "rdma_write_after_verify=1")],
    );
    let replica = node(
        dir.path(),
        "replica",
        &emulated("rdma", false),
        &[("KVSYNC_FAULTS", "rdma_no_file_mr=1")],
    );
    let bytes = put_snapshot(&source.dir, "s.kvr1", 2 << 20, 9);
    source.offered(9).await;
    let p = sync_ok(&replica, &source).await;
    assert!(p.detail.contains("anonymous buffer"), "{}", p.detail);
    assert!(std::fs::read(&p.installed_path).unwrap() == bytes);
    assert!(source.proc.log().contains("writing into a verified piece"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_only_source_is_used_over_tcp_as_each_mode_allows() {
    let root = tempfile::tempdir().unwrap();
    let source = Node::start(root.path(), "source", "", &[]);
    let replica = node(root.path(), "replica", &emulated("auto", true), &[]);
    put_snapshot(&source.dir, "s.kvr1", 4096, 2);
    source.offered(2).await;
    let p = sync_ok(&replica, &source).await;
    assert_eq!(p.transport, pb::Transport::Tcp as i32);
    assert_eq!(p.fallback_reason, "");
    assert_eq!(source.proc.addr("rdma"), "-");

    // mode = "rdma": with fallback it counts one; without, it fails clearly.
    let lenient = node(root.path(), "lenient", &emulated("rdma", true), &[]);
    let p = sync_ok(&lenient, &source).await;
    assert_eq!(p.transport, pb::Transport::Tcp as i32);
    assert!(
        p.fallback_reason.starts_with("unavailable"),
        "{}",
        p.fallback_reason
    );
    assert_eq!(
        lenient.metric(r#"kvsync_transport_fallback_total{reason="unavailable"}"#),
        1.0
    );
    let strict = node(root.path(), "strict", &emulated("rdma", false), &[]);
    let id = start_sync(&strict, &source).await;
    let p = wait_done(&strict, &id).await;
    assert_eq!(p.phase, pb::Phase::Failed as i32);
    assert!(
        p.error
            .contains("rdma required but this source cannot serve it"),
        "{}",
        p.error
    );
    assert!(strict.temp_files().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_connections_without_a_valid_session_token_are_rejected() {
    let root = tempfile::tempdir().unwrap();
    let source = node(root.path(), "source", &emulated("auto", true), &[]);
    let endpoint: std::net::SocketAddr = source
        .proc
        .addr("rdma")
        .trim_start_matches("emulated:")
        .parse()
        .unwrap();
    let mut qp = EmuQp::dial(endpoint, DEADLINE, EmuFaults::default()).unwrap();
    qp.post_recv(1).unwrap();
    match qp.connect(&[0x42; 32], DEADLINE) {
        Err(FabricError::Rejected(reason)) => assert!(reason.contains("session token"), "{reason}"),
        other => panic!("expected a rejection, got {other:?}"),
    }
    wait_for("auth failure counted", DEADLINE, || {
        (source.metric("kvsync_data_auth_failures_total") == 1.0).then_some(())
    });
}

/// The `rdma_hold_after` fault the VM tests make their events happen under:
/// while its file exists the source stops at that point of the transfer
/// (the replica has exactly those bytes), the transfer goes on when the
/// file goes, and a replica that dies meanwhile ends the held session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_transfer_stops_at_its_point_and_goes_on_when_released() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let hold = root.join("hold");
    let faults = format!("rdma_hold_after=2097152,hold_file={}", hold.display());
    let pieces = "[data]\npiece_size = \"1MiB\"";
    let source = Node::start_with(
        root,
        "source",
        &emulated("rdma", false),
        pieces,
        &[("KVSYNC_FAULTS", &faults)],
    );
    let replica = Node::start_with(root, "replica", &emulated("rdma", false), pieces, &[]);
    let bytes = put_snapshot(&source.dir, "s.kvr1", 6 << 20, 3);
    source.offered(3).await;

    std::fs::write(&hold, b"").unwrap();
    let id = start_sync(&replica, &source).await;
    wait_bytes(&replica, &id, 2 << 20).await;
    wait_for("the source to hold", DEADLINE, || {
        source
            .proc
            .log()
            .contains("holding the transfer")
            .then_some(())
    });
    let running = replica.status().await.running;
    assert_eq!(running.len(), 1, "{running:?}");
    assert_eq!(running[0].bytes_done, 2 << 20, "{running:?}");
    std::fs::remove_file(&hold).unwrap();
    let p = wait_done(&replica, &id).await;
    assert_eq!(p.phase, pb::Phase::Succeeded as i32, "{}", p.error);
    assert_eq!(
        (p.transport, p.fallback_reason.as_str()),
        (pb::Transport::Rdma as i32, "")
    );
    assert!(std::fs::read(&p.installed_path).unwrap() == bytes);

    // A replica killed while the transfer is held: the source notices the
    // connection is gone while it holds, and frees the session.
    let mut second = Node::start_with(root, "second", &emulated("rdma", false), pieces, &[]);
    std::fs::write(&hold, b"").unwrap();
    let id = start_sync(&second, &source).await;
    wait_bytes(&second, &id, 2 << 20).await;
    second.proc.signal(libc::SIGKILL);
    second.proc.wait_exit();
    wait_for_async("the held session to end", DEADLINE, || async {
        (source.status().await.serving_sessions == 0).then_some(())
    })
    .await;
    assert!(hold.exists(), "the session ended while still held");
}

/// Every offer passes the replica's checks, also the TCP offer it asks for
/// after an RDMA one went back (over the memory budget) or failed: here a
/// replica under `[data] tls = "required"` (RDMA allowed as a trusted
/// fabric) meets a source whose data plane has no TLS. The TCP offer that
/// follows is plaintext and must be refused before the session token goes
/// out in clear and before any byte moves.
#[test]
fn the_tcp_offer_after_rdma_gave_up_passes_the_same_checks() {
    let root = tempfile::tempdir().unwrap();
    let fleet = common::pki::Pki::new(root.path(), "fleet");
    let tls = |who: &str| fleet.agent_tls(who);
    let ca = fleet.ca_file().display().to_string();
    let trusted_rdma = format!("{}\nrdma_unencrypted_ok = true", emulated("auto", true));
    for (case, replica_extra, source_faults) in [
        (
            "rdma offer over the memory budget",
            "[cache]\nmemory_budget = \"1MiB\"\n",
            "",
        ),
        ("rdma transfer failed", "", "rdma_cut_after=1000000"),
    ] {
        let dir = root.path().join(case.replace(' ', "-"));
        std::fs::create_dir_all(&dir).unwrap();
        let source = Node::start_with(
            &dir,
            "source",
            &emulated("auto", true),
            &format!("{}[data]\ntls = \"off\"\n", tls("source")),
            &[("KVSYNC_FAULTS", source_faults)],
        );
        let replica = Node::start_with(
            &dir,
            "replica",
            &trusted_rdma,
            &format!(
                "{}{replica_extra}[data]\ntls = \"required\"\n",
                tls("replica")
            ),
            &[],
        );
        put_snapshot(&source.dir, "s.kvr1", 3 << 20, 5);
        let cli = |args: &[&str]| {
            let out = std::process::Command::new(kvsync_bin())
                .args(["--tls-ca", &ca])
                .args(args)
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr)
        };
        wait_for("the source to offer seq 5", DEADLINE, || {
            cli(&["snapshots", "--agent", &source.grpc(), "--json"])
                .contains("\"seq\":5")
                .then_some(())
        });
        let text = cli(&[
            "sync",
            "--agent",
            &replica.grpc(),
            "--source",
            &source.grpc(),
            "--wait",
            "--json",
        ]);
        // RDMA came first and gave up: the refused offer is the TCP one.
        assert!(
            text.contains("\"fallback_reason\":\"") && !text.contains("\"fallback_reason\":\"\""),
            "{case}: {text}"
        );
        let installed: Vec<_> = std::fs::read_dir(&replica.dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".kvr1"))
            .collect();
        assert!(
            installed.is_empty(),
            "{case}: a plaintext TCP offer was taken under tls = \"required\": {installed:?}\n{text}"
        );
        assert!(
            text.contains("tls = \\\"required\\\""),
            "{case}: the refusal names the setting: {text}"
        );
        assert_eq!(
            source.metric("kvsync_fullsync_bytes_total{role=\"source\",transport=\"tcp\"}"),
            0.0,
            "{case}: no byte moved over plaintext TCP"
        );
    }
}
