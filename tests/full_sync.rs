//! Full syncs between real agent processes on 127.0.0.1 (port 0 everywhere):
//! real gRPC, real TCP data connections, real files, and every failure the
//! full-sync issue names (a source killed mid-transfer: `tests/faults.rs`).

mod common;

use std::io::{Read, Write};

use common::node::*;
use common::*;
use kvsync::blk3::Token;
use kvsync::rpc::pb;
use kvsync::rpc::pb::peer_client::PeerClient;
use tonic::transport::Channel;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn syncs_small_odd_and_64mib_snapshots_byte_identical() {
    let root = tempfile::tempdir().unwrap();
    let source = Node::start(root.path(), "source", "", &[]);
    let replica = Node::start(root.path(), "replica", "", &[]);
    for (i, size) in [36u64, 1_234_567, 64 << 20].into_iter().enumerate() {
        let seq = 100 + i as u64;
        let name = format!("snap-{seq}.kvr1");
        let bytes = put_snapshot(&source.dir, &name, size, seq);
        source.offered(seq).await;
        let p = sync_ok(&replica, &source).await;
        assert_eq!((p.seq, p.bytes_done, p.bytes_total), (seq, size, size));
        assert_eq!(p.result, "ok");
        assert_eq!(p.transport, pb::Transport::Tcp as i32);
        let installed = replica.dir.join(&name);
        assert_eq!(p.installed_path, installed.display().to_string());
        assert!(
            std::fs::read(&installed).unwrap() == bytes,
            "installed bytes differ for size {size}"
        );
        assert_eq!(replmeta_seq(&p.installed_path), Some(seq));
        assert!(
            replica.temp_files().is_empty(),
            "{:?}",
            replica.temp_files()
        );
    }
    // The replica's own catalog now offers what it received (it can serve).
    replica.offered(102).await;
    let scrape = replica.proc.metrics();
    assert_eq!(
        metric_value(
            &scrape,
            "kvsync_fullsync_total{result=\"ok\",role=\"replica\",transport=\"tcp\"}"
        ),
        Some(3.0)
    );
    assert!(
        metric_value(
            &scrape,
            "kvsync_fullsync_bytes_total{role=\"replica\",transport=\"tcp\"}"
        )
        .unwrap()
            >= (64 << 20) as f64
    );
    assert_eq!(
        metric_value(&scrape, "kvsync_handoff_total{mode=\"file\",result=\"ok\"}"),
        Some(3.0)
    );
    assert!(scrape.contains("kvsync_fullsync_duration_seconds_bucket"));
    assert_eq!(
        metric_value(&scrape, "kvsync_bulk_duration_seconds_count"),
        Some(3.0)
    );
    assert!(
        metric_value(
            &scrape,
            "kvsync_last_success_timestamp_seconds{role=\"replica\"}"
        )
        .unwrap()
            > 0.0
    );
    assert_eq!(
        source.metric("kvsync_fullsync_total{result=\"ok\",role=\"source\",transport=\"tcp\"}"),
        3.0
    );
    assert_eq!(
        source.metric("kvsync_fullsync_in_progress{role=\"source\"}"),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_replicas_and_a_straggler_share_one_cache_load() {
    let root = tempfile::tempdir().unwrap();
    // RDMA sessions (here over the emulated fabric) send from the cache;
    // TCP ones send the file from the kernel's page cache.
    let emulated = "mode = \"auto\"\nrdma_provider = \"emulated\"";
    let source = Node::start_with(
        root.path(),
        "source",
        emulated,
        "[cache]\nlinger = \"5s\"\n",
        &[],
    );
    let bytes = put_snapshot(&source.dir, "s.kvr1", 16 << 20, 7);
    source.offered(7).await;
    // An offer held open keeps the snapshot loaded, so the four pulls are
    // guaranteed to overlap it whatever the scheduling.
    let mut peer = PeerClient::connect(format!("http://{}", source.grpc()))
        .await
        .unwrap();
    let held = peer
        .open_full_sync(pb::OpenFullSyncRequest {
            transports: vec![pb::Transport::Rdma as i32],
            rdma_reachable: true,
            preference: pb::TransportPreference::Rdma as i32,
            rdma_provider: "emulated".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let replicas: Vec<Node> = (0..4)
        .map(|i| Node::start_with(root.path(), &format!("r{i}"), emulated, "", &[]))
        .collect();
    let ids = futures::future::join_all(replicas.iter().map(|r| start_sync(r, &source))).await;
    for (r, id) in replicas.iter().zip(&ids) {
        let p = wait_done(r, id).await;
        assert_eq!(p.phase, pb::Phase::Succeeded as i32, "{}", p.error);
        assert_eq!(p.transport, pb::Transport::Rdma as i32);
        assert!(std::fs::read(r.dir.join("s.kvr1")).unwrap() == bytes);
    }
    assert_eq!(
        source.metric("kvsync_snapshot_cache_loads_total"),
        1.0,
        "one load for all pulls"
    );
    assert_eq!(source.metric("kvsync_snapshot_cache_hits_total"), 4.0);
    assert!(source.proc.log().contains("reusing snapshot buffer ref="));
    // Use the held token and hang up: that session ends and releases too.
    let straggler = Node::start_with(root.path(), "straggler", emulated, "", &[]);
    let token: [u8; 32] = held.session_token.as_slice().try_into().unwrap();
    {
        use kvsync::transport::fabric::Fabric;
        let endpoint = held.data_endpoint.parse().unwrap();
        let mut qp =
            kvsync::transport::emulated::EmuQp::dial(endpoint, DEADLINE, Default::default())
                .unwrap();
        qp.connect(&token, DEADLINE).unwrap();
    }
    wait_for("every reference released", DEADLINE, || {
        (source.metric("kvsync_snapshot_cache_refs") == 0.0).then_some(())
    });
    // A straggler within cache.linger still shares the one load.
    sync_ok(&straggler, &source).await;
    assert!(std::fs::read(straggler.dir.join("s.kvr1")).unwrap() == bytes);
    assert_eq!(source.metric("kvsync_snapshot_cache_loads_total"), 1.0);
    assert_eq!(source.metric("kvsync_snapshot_cache_hits_total"), 5.0);
    // After the linger time nobody holds it: the buffer is freed.
    wait_for("cache to empty", DEADLINE, || {
        (source.metric("kvsync_snapshot_cache_entries") == 0.0).then_some(())
    });
    assert_eq!(source.metric("kvsync_snapshot_cache_bytes"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn command_and_exec_handoffs() {
    let root = tempfile::tempdir().unwrap();
    let (source, _) = offering_source(root.path(), 100_000, 55, &[]).await;

    // `command`: a small KV admin listener that answers +OK.
    let kv = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let kv_addr = kv.local_addr().unwrap();
    let got = tokio::spawn(async move {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
        let (mut s, _) = kv.accept().await.unwrap();
        let mut line = String::new();
        tokio::io::BufReader::new(&mut s)
            .read_line(&mut line)
            .await
            .unwrap();
        s.write_all(b"+OK\r\n").await.unwrap();
        line
    });
    let replica = Node::start(
        root.path(),
        "cmd",
        &format!("[handoff]\nmode = \"command\"\ncommand_addr = \"{kv_addr}\"\ncommand_template = \"REPLMETA {{seq}} {{path}}\"\n"),
        &[],
    );
    let p = sync_ok(&replica, &source).await;
    let line = got.await.unwrap();
    assert_eq!(line.trim_end(), format!("REPLMETA 55 {}", p.installed_path));
    assert_eq!(
        replica.metric("kvsync_handoff_total{mode=\"command\",result=\"ok\"}"),
        1.0
    );

    // `exec`: a program sees KVSYNC_SEQ, KVSYNC_SNAPSHOT, KVSYNC_SOURCE.
    let out = root.path().join("exec-out");
    let exec_replica = Node::start(
        root.path(),
        "exec",
        &format!(
            "[handoff]\nmode = \"exec\"\nexec = [\"sh\", \"-c\", \"echo $KVSYNC_SEQ $KVSYNC_SNAPSHOT $KVSYNC_SOURCE > {}\"]\n",
            out.display()
        ),
        &[],
    );
    let p = sync_ok(&exec_replica, &source).await;
    let text = std::fs::read_to_string(&out).unwrap();
    assert_eq!(
        text.trim(),
        format!("55 {} source@{}", p.installed_path, source.grpc())
    );
    assert_eq!(replmeta_seq(&p.installed_path), Some(55));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_failure_keeps_the_installed_snapshot() {
    let root = tempfile::tempdir().unwrap();
    let (source, bytes) = offering_source(root.path(), 50_000, 9, &[]).await;
    let kv = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let kv_addr = kv.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
        let (mut s, _) = kv.accept().await.unwrap();
        let mut line = String::new();
        tokio::io::BufReader::new(&mut s)
            .read_line(&mut line)
            .await
            .unwrap();
        s.write_all(b"-ERR not now\r\n").await.unwrap();
    });
    let replica = Node::start(
        root.path(),
        "replica",
        &format!("[handoff]\nmode = \"command\"\ncommand_addr = \"{kv_addr}\"\n"),
        &[],
    );
    let id = start_sync(&replica, &source).await;
    let p = wait_done(&replica, &id).await;
    assert_eq!(p.phase, pb::Phase::Failed as i32);
    assert!(
        p.error.contains("handoff failed") && p.error.contains("-ERR not now"),
        "{}",
        p.error
    );
    assert!(
        std::fs::read(replica.dir.join("s.kvr1")).unwrap() == bytes,
        "snapshot stays installed"
    );
    assert_eq!(
        replica.metric("kvsync_handoff_total{mode=\"command\",result=\"failed\"}"),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_past_its_timeout_fails_and_its_program_is_stopped() {
    let root = tempfile::tempdir().unwrap();
    let (source, bytes) = offering_source(root.path(), 50_000, 9, &[]).await;
    let pid_file = root.path().join("handoff.pid");
    let replica = Node::start(
        root.path(),
        "replica",
        &format!(
            "[handoff]\nmode = \"exec\"\ntimeout = \"2s\"\nexec = [\"sh\", \"-c\", \"echo $$ > {}; exec sleep 600\"]\n",
            pid_file.display()
        ),
        &[],
    );
    let id = start_sync(&replica, &source).await;
    let p = wait_done(&replica, &id).await;
    assert_eq!(p.phase, pb::Phase::Failed as i32);
    assert!(
        p.error.contains("handoff timed out after 2s"),
        "{}",
        p.error
    );
    assert_eq!(std::fs::read(replica.dir.join("s.kvr1")).unwrap(), bytes);
    assert_eq!(
        replica.metric("kvsync_handoff_total{mode=\"exec\",result=\"failed\"}"),
        1.0
    );
    // The program was started, and is stopped with the handoff.
    let pid = std::fs::read_to_string(&pid_file).unwrap();
    let stat = format!("/proc/{}/stat", pid.trim());
    wait_for("the handoff program to be stopped", DEADLINE, || {
        let state = std::fs::read_to_string(&stat).ok();
        // Gone, or a zombie until the agent reaps it.
        state
            .is_none_or(|s| {
                s.rsplit(')')
                    .next()
                    .is_some_and(|r| r.trim_start().starts_with('Z'))
            })
            .then_some(())
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_unreachable_or_without_snapshot() {
    let root = tempfile::tempdir().unwrap();
    let replica = Node::start(root.path(), "replica", "", &[]);
    // Nothing listens on a port we bound and released.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let p = sync_from(&replica, &dead.to_string()).await;
    assert_eq!(p.phase, pb::Phase::Failed as i32);
    assert!(p.error.contains("unreachable"), "{}", p.error);

    let mut c = replica.client().await;
    let empty_source = Node::start(root.path(), "empty", "", &[]);
    let id = start_sync(&replica, &empty_source).await;
    let p = wait_done(&replica, &id).await;
    assert_eq!(p.phase, pb::Phase::Failed as i32);
    assert!(
        p.error.contains("NotFound") && p.error.contains("no valid kvr1 snapshot"),
        "{}",
        p.error
    );
    assert!(replica.temp_files().is_empty());

    // The source refuses directly with NOT_FOUND.
    let mut peer = PeerClient::connect(format!("http://{}", empty_source.grpc()))
        .await
        .unwrap();
    let err = peer
        .open_full_sync(pb::OpenFullSyncRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    // A file there that is not a valid snapshot is named, with why.
    std::fs::write(
        empty_source.dir.join("broken.kvr1"),
        b"KVR1 but nothing else",
    )
    .unwrap();
    wait_for("the broken file rejected", DEADLINE, || {
        (empty_source.metric("kvsync_snapshots_rejected_total{reason=\"not_a_snapshot\"}") > 0.0)
            .then_some(())
    });
    let err = peer
        .open_full_sync(pb::OpenFullSyncRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    assert!(
        err.message().contains("broken.kvr1 is not offered"),
        "{}",
        err.message()
    );

    // Bad arguments and unknown syncs map to their codes.
    let err = c
        .start_full_sync(pb::StartFullSyncRequest {
            source: "no port".into(),
            transport: 0,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    let err = c
        .watch_sync(pb::WatchSyncRequest {
            sync_id: "nope".into(),
        })
        .await
        .err()
        .unwrap();
    assert_eq!(err.code(), tonic::Code::NotFound);
    let err = c
        .cancel_sync(pb::CancelSyncRequest {
            sync_id: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
}

/// Sends a SESS frame with `token` to a data endpoint; returns the reply.
fn present_token(data: &str, token: [u8; 32]) -> Token {
    open_with_token(data, token).0
}

/// Presents `token` on a new data connection: the reply, and the
/// connection, which the source serves until it closes.
fn open_with_token(data: &str, token: [u8; 32]) -> (Token, std::net::TcpStream) {
    let mut s = std::net::TcpStream::connect(data).unwrap();
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    s.write_all(&Token::Sess { token }.encode_frame()).unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 600];
    loop {
        if let Some((t, _)) = Token::decode_frame(&buf).unwrap() {
            return (t, s);
        }
        let n = s.read(&mut chunk).unwrap();
        assert!(n > 0, "connection closed without a reply");
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_used_expired_or_other_transport_session_tokens_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let refused = |reply: &Token| matches!(reply, Token::Rdfl { reason } if reason.contains("unknown, used or expired"));
    // The emulated fabric lets this source offer RDMA sessions too.
    let emulated = "mode = \"auto\"\nrdma_provider = \"emulated\"";
    let source = Node::start_with(
        root.path(),
        "source",
        emulated,
        "[data]\ntcp_streams = 2\n",
        &[],
    );
    put_snapshot(&source.dir, "s.kvr1", 10_000, 3);
    source.offered(3).await;

    // Guessed token.
    let reply = present_token(&source.data(), [0x42; 32]);
    assert!(refused(&reply), "{reply:?}");
    assert_eq!(source.metric("kvsync_data_auth_failures_total"), 1.0);

    // A real token works once: the first use gets SRDY, the second is refused.
    let offer = source.open_offer().await;
    let token: [u8; 32] = offer.session_token.as_slice().try_into().unwrap();
    assert_eq!(present_token(&offer.data_endpoint, token), Token::Srdy);
    let reply = present_token(&offer.data_endpoint, token);
    assert!(refused(&reply), "{reply:?}");

    // A token granted two TCP streams opens exactly two connections.
    let mut peer = PeerClient::connect(format!("http://{}", source.grpc()))
        .await
        .unwrap();
    let ask = |n| pb::OpenFullSyncRequest {
        tcp_streams: n,
        piece_queue: true,
        ..Default::default()
    };
    // A replica whose streams do not share a piece queue gets one.
    let old = pb::OpenFullSyncRequest {
        piece_queue: false,
        ..ask(2)
    };
    let one = peer.open_full_sync(old).await.unwrap().into_inner();
    assert_eq!((one.tcp_streams, one.piece_queue), (1, false));
    let two = peer.open_full_sync(ask(2)).await.unwrap().into_inner();
    assert_eq!((two.tcp_streams, two.piece_queue), (2, true));
    let token: [u8; 32] = two.session_token.as_slice().try_into().unwrap();
    let (reply, first) = open_with_token(&two.data_endpoint, token);
    assert_eq!(reply, Token::Srdy);
    // The second while the first still runs: once a session's streams
    // all ended, its unused ones are refused too.
    assert_eq!(present_token(&two.data_endpoint, token), Token::Srdy);
    let reply = present_token(&two.data_endpoint, token);
    assert!(refused(&reply), "{reply:?}");
    drop(first);
    // A session that ran on one of its two streams and ended refuses the
    // other: it does not hold its place on the source until it expires.
    let over = peer.open_full_sync(ask(2)).await.unwrap().into_inner();
    let token: [u8; 32] = over.session_token.as_slice().try_into().unwrap();
    assert_eq!(present_token(&over.data_endpoint, token), Token::Srdy);
    wait_for_async("the session to end", DEADLINE, || async {
        (source.status().await.serving_sessions == 0).then_some(())
    })
    .await;
    let reply = present_token(&over.data_endpoint, token);
    assert!(
        matches!(&reply, Token::Rdfl { reason } if reason.contains("have all ended")),
        "{reply:?}"
    );
    assert_eq!(
        source.metric(r#"kvsync_data_connections_refused_total{reason="session_over"}"#),
        1.0
    );
    // More than the source's own [data] tcp_streams is granted that: one
    // token never fetches the snapshot on more connections than the
    // source allows (before, any replica got 16).
    let many = peer.open_full_sync(ask(16)).await.unwrap().into_inner();
    assert_eq!(many.tcp_streams, 2);

    // A token offered for RDMA does not open a TCP session.
    let rdma_offer = peer
        .open_full_sync(pb::OpenFullSyncRequest {
            transports: vec![pb::Transport::Tcp as i32, pb::Transport::Rdma as i32],
            rdma_reachable: true,
            preference: pb::TransportPreference::Rdma as i32,
            rdma_provider: "emulated".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(rdma_offer.transport, pb::Transport::Rdma as i32);
    let token: [u8; 32] = rdma_offer.session_token.as_slice().try_into().unwrap();
    let reply = present_token(&source.data(), token);
    assert!(refused(&reply), "{reply:?}");
    assert_eq!(source.metric("kvsync_data_auth_failures_total"), 4.0);
    // Guessed, replayed (twice) and other-transport tokens, by reason.
    assert_eq!(
        source.metric(r#"kvsync_data_connections_refused_total{reason="bad_token"}"#),
        4.0
    );

    // An expired token is refused (a source whose tokens live 300 ms; the
    // test waits until the expiry has passed, so nothing races it).
    let short = Node::start(
        root.path(),
        "short",
        "[sync]\nsession_token_ttl = \"300ms\"\n",
        &[],
    );
    put_snapshot(&short.dir, "s.kvr1", 10_000, 4);
    short.offered(4).await;
    let offer = short.open_offer().await;
    let expires = offer.token_expires_unix_ms;
    wait_for("token expiry", DEADLINE, || {
        (kvsync::sync::unix_ms() > expires + 50).then_some(())
    });
    let token: [u8; 32] = offer.session_token.as_slice().try_into().unwrap();
    let reply = present_token(&offer.data_endpoint, token);
    assert!(refused(&reply), "{reply:?}");
    assert_eq!(short.metric("kvsync_data_auth_failures_total"), 1.0);
    // Expired and abandoned offers release their cache references.
    short.wait_released();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unwritable_snapshot_dir_is_refused_before_transfer() {
    let root = tempfile::tempdir().unwrap();
    let (source, _) = offering_source(root.path(), 10_000, 3, &[]).await;
    let replica = Node::start(root.path(), "replica", "", &[]);
    // The directory is replaced by a file: nothing can be created in it.
    std::fs::remove_dir_all(&replica.dir).unwrap();
    std::fs::write(&replica.dir, b"not a directory").unwrap();
    let mut c = replica.client().await;
    let err = c
        .start_full_sync(pb::StartFullSyncRequest {
            source: source.grpc(),
            transport: 0,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(err.message().contains("not writable"), "{}", err.message());
    assert_eq!(
        source.metric("kvsync_snapshot_cache_loads_total"),
        0.0,
        "no transfer started"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offered_snapshot_is_delivered_even_if_deleted_or_replaced() {
    let root = tempfile::tempdir().unwrap();
    let (source, original) = offering_source(root.path(), 3 << 20, 30, &[]).await;
    let offer = source.open_offer().await;
    // After the offer: replace the file, then delete it.
    put_snapshot(&source.dir, "s.kvr1", 1 << 20, 31);
    std::fs::remove_file(source.dir.join("s.kvr1")).unwrap();

    let dest = tempfile::tempdir().unwrap();
    let token: [u8; 32] = offer.session_token.as_slice().try_into().unwrap();
    let endpoint = offer.data_endpoint.clone();
    let size = offer.snapshot_size;
    let dest_path = dest.path().to_owned();
    let manifest = std::sync::Arc::new(source.manifest(&offer).await);
    let received = tokio::task::spawn_blocking(move || {
        let mut receiver =
            kvsync::sync::receive::Receiver::open(&dest_path, "t", "source", manifest, 3, |_| {})
                .unwrap();
        let mut link = kvsync::transport::tcp::Link::new(
            std::net::TcpStream::connect(endpoint).unwrap(),
            Default::default(),
        )
        .unwrap();
        let result = kvsync::transport::tcp::run_replica(&mut link, token, size, &mut receiver);
        let received = receiver
            .finish(result.map_err(Into::into))
            .expect("session succeeds");
        received.staging.install("got.kvr1").unwrap()
    })
    .await
    .unwrap();
    assert!(
        std::fs::read(received).unwrap() == original,
        "exactly the offered snapshot"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_transfer_and_repeated_start() {
    let root = tempfile::tempdir().unwrap();
    let source = stalling_source(root.path(), 40).await;
    let replica = Node::start(root.path(), "replica", "", &[]);
    let previous = put_snapshot(&replica.dir, "s.kvr1", 4096, 39);
    let id = sync_in_flight(&replica, &source).await;

    // Starting again from the same source returns the running sync.
    let mut c = replica.client().await;
    let again = c
        .start_full_sync(pb::StartFullSyncRequest {
            source: source.grpc(),
            transport: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (again.sync_id.as_str(), again.created),
        (id.as_str(), false)
    );

    assert!(
        c.cancel_sync(pb::CancelSyncRequest {
            sync_id: id.clone()
        })
        .await
        .unwrap()
        .into_inner()
        .cancelled
    );
    let p = wait_done(&replica, &id).await;
    assert_eq!(p.phase, pb::Phase::Cancelled as i32, "{}", p.error);
    assert_eq!(p.result, "cancelled");
    assert!(
        replica.temp_files().is_empty(),
        "{:?}",
        replica.temp_files()
    );
    assert!(std::fs::read(replica.dir.join("s.kvr1")).unwrap() == previous);
    assert_eq!(
        replica.metric(
            "kvsync_fullsync_total{result=\"cancelled\",role=\"replica\",transport=\"tcp\"}"
        ),
        1.0
    );
    // The source notices the replica left and frees the session.
    source.wait_released();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_of_a_snapshot_being_received_from_another_source_is_the_running_one() {
    let root = tempfile::tempdir().unwrap();
    // Two sources holding the same snapshot, each sending 4 MiB/s: a sync
    // of its 8 MiB takes two seconds.
    let slow = "[sync]\nrate_limit = \"4MiB\"\n";
    let (first, second) = (
        Node::start(root.path(), "first", slow, &[]),
        Node::start(root.path(), "second", slow, &[]),
    );
    let bytes = put_snapshot(&first.dir, "s.kvr1", 8 << 20, 40);
    put_snapshot(&second.dir, "s.kvr1", 8 << 20, 40);
    first.offered(40).await;
    second.offered(40).await;
    let digest = first.status().await.latest_snapshots[0]
        .manifest_digest
        .clone();
    assert_eq!(
        second.status().await.latest_snapshots[0].manifest_digest,
        digest,
        "the same snapshot"
    );
    let replica = Node::start(root.path(), "replica", "", &[]);
    let pull = |source: &Node| pb::StartFullSyncRequest {
        source: source.grpc(),
        snapshot: Some(pb::SnapshotId {
            manifest_digest: digest.clone(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut c = replica.client().await;
    let running = c.start_full_sync(pull(&first)).await.unwrap().into_inner();
    assert!(running.created);
    wait_bytes(&replica, &running.sync_id, 1 << 20).await;
    let again = c.start_full_sync(pull(&second)).await.unwrap().into_inner();
    assert_eq!(
        (again.sync_id.as_str(), again.created),
        (running.sync_id.as_str(), false)
    );
    assert_eq!(replica.temp_files().len(), 1, "{:?}", replica.temp_files());
    // One sync, one install, an exact copy.
    let p = wait_done(&replica, &running.sync_id).await;
    assert_eq!(p.phase, pb::Phase::Succeeded as i32, "{p:?}");
    assert!(std::fs::read(&p.installed_path).unwrap() == bytes);
    assert_eq!(replica.status().await.recent.len(), 1);
    assert!(
        replica.temp_files().is_empty(),
        "{:?}",
        replica.temp_files()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_status_are_served() {
    let root = tempfile::tempdir().unwrap();
    let node = Node::start(root.path(), "n", "", &[]);
    put_snapshot(&node.dir, "s.kvr1", 1000, 77);
    node.offered(77).await;
    let channel = Channel::from_shared(format!("http://{}", node.grpc()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let r = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "kvsync.v1.Orchestrator".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        r.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    let out = std::process::Command::new(kvsync_bin())
        .args(["status", "--json", "--agent", &node.grpc()])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["node_id"], "n");
    assert_eq!(v["latest_snapshots"][0]["seq"], 77);
    assert_eq!(v["transports"][0], "tcp");
}

#[test]
fn cli_sync_wait_json_summary() {
    let root = tempfile::tempdir().unwrap();
    let source = Node::start(root.path(), "source", "", &[]);
    put_snapshot(&source.dir, "s.kvr1", 2 << 20, 88);
    let replica = Node::start(root.path(), "replica", "", &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(source.offered(88));
    let v = cli_sync_ok(&replica, &source);
    assert_eq!(v["status"], "succeeded");
    assert_eq!(v["bytes"], 2 << 20);
    assert_eq!(v["seq"], 88);
    assert_eq!(v["transport"], "tcp");
    assert!(v["duration_ms"].as_u64().is_some());

    // One exact snapshot, by the digest `kvsync snapshots` prints.
    let cli = |args: &[&str]| {
        std::process::Command::new(kvsync_bin())
            .args(args)
            .output()
            .unwrap()
    };
    let listed = cli(&["snapshots", "--agent", &source.grpc(), "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    let digest = listed[0]["manifest_digest"].as_str().unwrap().to_string();
    assert_eq!(digest.len(), 64, "{listed}");
    let by_digest = |digest: &str| {
        let (r, s) = (replica.grpc(), source.grpc());
        cli(&[
            "sync",
            "--agent",
            &r,
            "--source",
            &s,
            "--snapshot",
            digest,
            "--wait",
            "--json",
        ])
    };
    let out = by_digest(&digest);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = by_digest(&"0".repeat(64));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stdout);
    assert!(
        err.contains("does not have kvr1 snapshot manifest 0000"),
        "{err}"
    );
    let out = by_digest("not-hex");
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a manifest digest"));

    // A failing sync exits non-zero with the reason.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let out = std::process::Command::new(kvsync_bin())
        .args([
            "sync",
            "--agent",
            &replica.grpc(),
            "--source",
            &dead.to_string(),
            "--wait",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unreachable"));
}

/// Every metric name in `expr`-like text (`kvsync_` identifiers).
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("kvsync_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_queries_only_existing_metrics() {
    let root = tempfile::tempdir().unwrap();
    let source = Node::start(root.path(), "source", "", &[]);
    let replica = Node::start(root.path(), "replica", "", &[]);
    put_snapshot(&source.dir, "s.kvr1", 100_000, 5);
    std::fs::write(source.dir.join("broken.kvr1"), b"KVR1 but nothing else").unwrap();
    source.offered(5).await;
    sync_ok(&replica, &source).await;
    wait_for("rejection counted", DEADLINE, || {
        (source.metric("kvsync_snapshots_rejected_total{reason=\"not_a_snapshot\"}") > 0.0)
            .then_some(())
    });
    let exported: std::collections::BTreeSet<String> =
        [source.proc.metrics(), replica.proc.metrics()]
            .iter()
            .flat_map(|scrape| {
                scrape
                    .lines()
                    .filter(|l| !l.starts_with('#'))
                    .filter_map(|l| l.split(['{', ' ']).next().map(str::to_string))
                    .collect::<Vec<_>>()
            })
            .collect();
    let dashboard: serde_json::Value =
        serde_json::from_str(include_str!("../grafana/kvsync-dashboard.json"))
            .expect("dashboard is JSON");
    let mut used = std::collections::BTreeSet::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            used.extend(metric_names(target["expr"].as_str().expect("expr")));
        }
    }
    used.extend(metric_names(&dashboard["templating"].to_string()));
    // Every query of a per-instance series follows the dashboard's
    // instance variable.
    let per_instance: std::collections::BTreeSet<String> =
        [source.proc.metrics(), replica.proc.metrics()]
            .iter()
            .flat_map(|scrape| {
                scrape
                    .lines()
                    .filter(|l| l.contains("kv_instance=\"default\""))
                    .filter_map(|l| l.split('{').next().map(str::to_string))
                    .collect::<Vec<_>>()
            })
            .collect();
    assert!(
        per_instance.contains("kvsync_fullsync_total"),
        "{per_instance:?}"
    );
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("expr");
            if metric_names(expr).iter().any(|n| per_instance.contains(n)) {
                assert!(
                    expr.contains("kv_instance=~\"$kv_instance\""),
                    "{expr} does not follow the kv_instance variable"
                );
            }
        }
    }
    assert!(
        used.len() >= 12,
        "the dashboard covers the agent's metrics: {used:?}"
    );
    // The local KV's series exist only beside a KV server, the stream's
    // lag only beside a stream log: tests/redis.rs and tests/stream.rs
    // check those names against agents that have them.
    let missing: Vec<&String> = used
        .iter()
        .filter(|n| {
            !exported.contains(*n)
                && !n.starts_with("kvsync_kv_")
                && !n.starts_with("kvsync_stream_")
        })
        .collect();
    assert!(
        missing.is_empty(),
        "dashboard queries metrics no agent exports: {missing:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_killed_mid_transfer_frees_source_and_restart_sweeps_temp() {
    let root = tempfile::tempdir().unwrap();
    let source = stalling_source(root.path(), 60).await;
    let mut replica = Node::start(root.path(), "replica", "", &[]);
    sync_in_flight(&replica, &source).await;
    assert_eq!(
        replica.temp_files().len(),
        1,
        "the staging file exists mid-transfer"
    );

    replica.proc.child.kill().unwrap();
    replica.proc.child.wait().unwrap();
    wait_for(
        "source to free the session and its cache reference",
        DEADLINE,
        || (source.metric("kvsync_snapshot_cache_refs") == 0.0).then_some(()),
    );
    assert_eq!(
        source.metric("kvsync_fullsync_in_progress{role=\"source\"}"),
        0.0
    );
    assert_eq!(
        replica.temp_files().len(),
        1,
        "a killed agent cannot clean up"
    );

    // Nothing verified yet (the snapshot is one 16 MiB piece): no journal,
    // nothing to resume.
    let restarted = Node::start(root.path(), "replica", "", &[]);
    assert!(
        restarted.temp_files().is_empty(),
        "stale temp files are removed at start"
    );
    assert!(restarted
        .proc
        .log()
        .contains("removed temp files of an earlier run that cannot be resumed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_cancel_stops_a_sync_and_status_keeps_only_the_recent_ones() {
    let root = tempfile::tempdir().unwrap();
    let source = stalling_source(root.path(), 21).await;
    let replica = Node::start(root.path(), "replica", "[sync]\nkeep_recent = 2\n", &[]);
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id = sync_in_flight(&replica, &source).await;
        let out = std::process::Command::new(kvsync_bin())
            .args(["cancel", "--agent", &replica.grpc(), &id])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "cancelled");
        let p = wait_done(&replica, &id).await;
        assert_eq!(p.phase, pb::Phase::Cancelled as i32, "{p:?}");
        ids.push(id);
    }
    // Cancelling a finished sync says so.
    let out = std::process::Command::new(kvsync_bin())
        .args(["cancel", "--agent", &replica.grpc(), &ids[2]])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "already finished"
    );
    let status = replica.status().await;
    let recent: Vec<&str> = status.recent.iter().map(|p| p.sync_id.as_str()).collect();
    assert_eq!(
        recent,
        [ids[2].as_str(), ids[1].as_str()],
        "keep_recent = 2, newest first"
    );
    assert!(replica.temp_files().is_empty());
}
