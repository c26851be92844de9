//! Two hosts: agents in two network namespaces joined by a veth pair, on
//! real interface addresses. Syncs over TCP and the emulated RDMA fabric
//! (whose listener binds the interface the agent selects), and a cable cut
//! mid-transfer. Skipped, with the reason printed, where namespaces cannot
//! be created.

mod common;

use common::netns::{block_on, Hosts, IPS};
use common::node::*;
use common::*;
use kvsync::rpc::pb;

const EMULATED: &str = "mode = \"auto\"\nrdma_provider = \"emulated\"";

/// Starts a sync that prefers `transport` and follows it to its end.
async fn sync_with(
    replica: &Node,
    source: &Node,
    transport: pb::TransportPreference,
) -> pb::SyncProgress {
    let id = replica
        .client()
        .await
        .start_full_sync(pb::StartFullSyncRequest {
            source: source.grpc(),
            transport: transport as i32,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .sync_id;
    wait_done(replica, &id).await
}

#[test]
fn tcp_and_emulated_rdma_between_two_hosts_on_their_real_interfaces() {
    let Some(hosts) = Hosts::create("two-host syncs") else {
        return;
    };
    let root = tempfile::tempdir().unwrap();
    let source = hosts.run_in(0, || {
        Node::start_at(root.path(), "source", IPS[0], EMULATED, "", &[])
    });
    let replica = hosts.run_in(1, || {
        Node::start_at(root.path(), "replica", IPS[1], EMULATED, "", &[])
    });
    // Interface selection: each agent's RDMA listener is bound to its eth0
    // address (never loopback, never a wildcard).
    for (node, ip) in [(&source, IPS[0]), (&replica, IPS[1])] {
        let rdma = node.proc.addr("rdma");
        assert!(rdma.starts_with(&format!("emulated:{ip}:")), "{rdma}");
    }
    let probe = hosts.run_in(0, || {
        let config = root.path().join("source.toml");
        let out = std::process::Command::new(kvsync_bin())
            .args(["probe", "--json", "--config", config.to_str().unwrap()])
            .output()
            .unwrap();
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    });
    assert_eq!(probe["interface"], "eth0", "{probe}");
    assert_eq!(probe["local_addr"], IPS[0], "{probe}");
    assert_eq!(probe["choice"], "rdma", "{probe}");

    let bytes = put_snapshot(&source.dir, "s.kvr1", 6 << 20, 5);
    hosts.run_in(1, || {
        block_on(async {
            source.offered(5).await;
            for (preference, transport) in [
                (pb::TransportPreference::Tcp, pb::Transport::Tcp),
                (pb::TransportPreference::Auto, pb::Transport::Rdma),
            ] {
                let p = sync_with(&replica, &source, preference).await;
                assert_eq!(p.phase, pb::Phase::Succeeded as i32, "{p:?}");
                assert_eq!(p.transport, transport as i32, "{p:?}");
                assert_eq!(std::fs::read(&p.installed_path).unwrap(), bytes);
            }
        })
    });
}

#[test]
fn network_cut_mid_transfer_fails_cleanly_and_a_retry_after_the_link_returns_succeeds() {
    let Some(hosts) = Hosts::create("network cut") else {
        return;
    };
    let root = tempfile::tempdir().unwrap();
    // 48 MiB at 8 MiB/s: the cut lands mid-transfer.
    let source = hosts.run_in(0, || {
        Node::start_at(
            root.path(),
            "source",
            IPS[0],
            "mode = \"tcp\"",
            "[sync]\nrate_limit = \"8MiB\"\n",
            &[],
        )
    });
    let replica = hosts.run_in(1, || {
        Node::start_at(root.path(), "replica", IPS[1], "mode = \"tcp\"", "", &[])
    });
    let bytes = put_snapshot(&source.dir, "s.kvr1", 48 << 20, 7);
    let previous = put_snapshot(&replica.dir, "prev.kvr1", 1 << 20, 1);

    let id = hosts.run_in(1, || {
        block_on(async {
            source.offered(7).await;
            let id = start_sync(&replica, &source).await;
            wait_bytes(&replica, &id, 8 << 20).await;
            id
        })
    });
    hosts.set_link(0, false);
    let failed = hosts.run_in(1, || block_on(wait_done(&replica, &id)));
    assert_eq!(failed.phase, pb::Phase::Failed as i32, "{failed:?}");
    assert!(failed.error.contains("timed out"), "{}", failed.error);
    assert!(
        replica.temp_files().is_empty(),
        "{:?}",
        replica.temp_files()
    );
    assert!(!replica.dir.join("s.kvr1").exists());
    assert_eq!(
        std::fs::read(replica.dir.join("prev.kvr1")).unwrap(),
        previous
    );

    hosts.set_link(0, true);
    hosts.run_in(1, || {
        block_on(async {
            // The source gave up on the dead connection too.
            source.wait_released();
            let p = sync_ok(&replica, &source).await;
            assert_eq!(std::fs::read(&p.installed_path).unwrap(), bytes);
        })
    });
}
