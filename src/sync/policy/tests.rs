//! The replica job's rules, case by case.

use std::net::SocketAddr;
use std::path::Path;

use crate::store::room::RoomError;
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::store::install::InstallError;

const MIB: u64 = 1 << 20;

fn offer(transport: TransportKind, size: u64) -> Offer {
    Offer {
        session_id: "s1".into(),
        token: [7; SESSION_TOKEN_LEN],
        transport,
        endpoint: "127.0.0.1:7100".parse::<SocketAddr>().unwrap(),
        format: "kvr1".into(),
        snapshot: SnapshotId {
            size,
            seq: 42,
            checksum: 0xabc,
            digest: Some(blake3::hash(b"manifest")),
        },
        source_node: "src-a".into(),
        origin_node: None,
        name: "snap-42.kvr1".into(),
        piece_size: 16 * MIB,
        data_tls: false,
        tcp_streams: 1,
        rdma_device: String::new(),
        backlog_bytes_left: 0,
        instance: String::new(),
    }
}

fn limits(tls: DataTls) -> Limits<'static> {
    Limits {
        data_tls: tls,
        max_snapshot_bytes: 100 * MIB,
        min_free_after: 10 * MIB,
        dir: Path::new("/snapshots"),
    }
}

fn plan(
    asked: Option<TransportMode>,
    mode: TransportMode,
    fallback: bool,
    available: bool,
) -> Result<TransportPlan, NoRdma> {
    TransportPlan::new(asked, mode, fallback, available)
}

#[test]
fn a_tcp_request_never_asks_for_rdma() {
    let p = plan(Some(TransportMode::Tcp), TransportMode::Rdma, false, true).unwrap();
    assert!(!p.want_rdma && !p.insist() && !p.fell_back && !p.tcp_offer_is_fallback());
}

#[test]
fn auto_asks_for_rdma_when_it_is_here_and_may_fall_back() {
    let p = plan(None, TransportMode::Auto, false, true).unwrap();
    assert!(p.want_rdma && p.may_fall_back && !p.insist());
    // A TCP offer to auto is the source's choice, not a fallback.
    assert!(!p.tcp_offer_is_fallback());
    let p = plan(None, TransportMode::Auto, false, false).unwrap();
    assert!(
        !p.want_rdma && !p.fell_back,
        "auto without rdma is plain tcp"
    );
}

#[test]
fn required_rdma_that_is_missing_fails_unless_fallback_is_on() {
    assert_eq!(
        plan(Some(TransportMode::Rdma), TransportMode::Tcp, false, false),
        Err(NoRdma)
    );
    let p = plan(Some(TransportMode::Rdma), TransportMode::Tcp, true, false).unwrap();
    assert!(p.fell_back && !p.want_rdma && p.may_fall_back);
}

#[test]
fn required_rdma_insists_and_never_falls_back() {
    let p = plan(None, TransportMode::Rdma, false, true).unwrap();
    assert!(p.insist() && p.want_rdma && p.tcp_offer_is_fallback());
    let timeout = JobError::Protocol(Blk3Error::Timeout {
        waiting_for: "PDON",
        after: Duration::from_secs(1),
    });
    assert_eq!(p.fall_back_after(&timeout), None);
    let p = plan(None, TransportMode::Rdma, true, true).unwrap();
    assert!(!p.insist());
    assert_eq!(p.fall_back_after(&timeout), Some("timeout"));
}

#[test]
fn rdma_failures_fall_back_by_reason_and_local_ones_do_not() {
    let cases: Vec<(JobError, Option<&str>)> = vec![
        (JobError::Checksum("piece 3".into()), Some("checksum")),
        (
            JobError::Protocol(Blk3Error::PeerFailed("disk".into())),
            Some("peer_failed"),
        ),
        (
            JobError::Protocol(Blk3Error::MrinfoLength {
                announced: 1,
                mrinfo: 2,
            }),
            Some("protocol"),
        ),
        (
            JobError::DataConnect {
                endpoint: "10.0.0.1:7100".parse().unwrap(),
                source: std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into(),
            },
            Some("connect"),
        ),
        (JobError::Cancelled, None),
        (local_failure(), None),
    ];
    for (err, reason) in cases {
        assert_eq!(fallback_reason(&err), reason, "{err}");
    }
}

#[test]
fn an_offer_must_answer_the_request() {
    let asked = Asked {
        format: Format::Kvr1,
        snapshot: Some(SnapshotId {
            size: MIB,
            seq: 42,
            checksum: 0xabc,
            digest: None,
        }),
        rdma: false,
        instance: String::new(),
    };
    assert!(answers(&offer(TransportKind::Tcp, MIB), &asked).is_ok());
    let mut by_digest = asked.clone();
    by_digest.snapshot.as_mut().unwrap().digest = Some(blake3::hash(b"manifest"));
    assert!(answers(&offer(TransportKind::Tcp, MIB), &by_digest).is_ok());
    by_digest.snapshot.as_mut().unwrap().digest = Some(blake3::hash(b"a forgery's"));
    let err = answers(&offer(TransportKind::Tcp, MIB), &by_digest).unwrap_err();
    assert!(
        err.to_string().contains("not the requested seq 42"),
        "same size, seq and checksum, another manifest: {err}"
    );
    let other = offer(TransportKind::Tcp, 2 * MIB);
    let err = answers(&other, &asked).unwrap_err().to_string();
    assert!(err.contains("not the requested seq 42"), "{err}");
    let mut rdb = offer(TransportKind::Tcp, MIB);
    rdb.format = "rdb".into();
    let err = answers(&rdb, &asked).unwrap_err().to_string();
    assert!(err.contains("format rdb"), "{err}");
    let err = answers(&offer(TransportKind::Rdma, MIB), &asked).unwrap_err();
    assert!(
        matches!(err, JobError::BadOffer(_)),
        "rdma was not asked for"
    );
    let latest = Asked {
        snapshot: None,
        rdma: true,
        ..asked
    };
    assert!(answers(&offer(TransportKind::Rdma, 2 * MIB), &latest).is_ok());
}

#[test]
fn an_offer_of_another_instance_is_refused() {
    let asked = Asked {
        format: Format::Kvr1,
        snapshot: None,
        rdma: false,
        instance: "shard-1".into(),
    };
    let mut of = offer(TransportKind::Tcp, MIB);
    of.instance = "shard-2".into();
    let err = answers(&of, &asked).unwrap_err().to_string();
    assert!(
        err.contains("of instance \"shard-2\", not the requested \"shard-1\""),
        "{err}"
    );
    of.instance = "shard-1".into();
    assert!(answers(&of, &asked).is_ok());
    // A source that predates instances names none: its only one.
    of.instance = String::new();
    assert!(answers(&of, &asked).is_ok());
}

#[test]
fn required_tls_refuses_a_plain_tcp_offer_but_not_rdma() {
    let l = limits(DataTls::Required);
    let err = within_limits(&l, "src:7000", &offer(TransportKind::Tcp, MIB), u64::MAX);
    assert!(
        err.unwrap_err().to_string().contains("without TLS"),
        "plain tcp under tls = required"
    );
    let mut tls = offer(TransportKind::Tcp, MIB);
    tls.data_tls = true;
    assert!(within_limits(&l, "src:7000", &tls, u64::MAX).is_ok());
    // RDMA is governed by its own setting (checked on the source).
    assert!(within_limits(&l, "src:7000", &offer(TransportKind::Rdma, MIB), u64::MAX).is_ok());
}

#[test]
fn size_and_free_space_limits_hold_at_their_edges() {
    let l = limits(DataTls::Auto);
    let at = |size, free| within_limits(&l, "src:7000", &offer(TransportKind::Tcp, size), free);
    assert!(at(100 * MIB, u64::MAX).is_ok());
    assert!(matches!(
        at(100 * MIB + 1, u64::MAX),
        Err(JobError::Room(RoomError::TooLarge { max, .. })) if max == 100 * MIB
    ));
    // The snapshot plus the kept headroom must fit.
    assert!(at(50 * MIB, 60 * MIB).is_ok());
    assert!(matches!(
        at(50 * MIB, 60 * MIB - 1),
        Err(JobError::Room(RoomError::NoRoom { keep, .. })) if keep == 10 * MIB
    ));
    assert!(at(u64::MAX / 2, u64::MAX / 2).is_err(), "no overflow");
}

#[test]
fn rdma_never_pins_more_than_the_memory_budget() {
    assert_eq!(
        too_large_to_pin(&offer(TransportKind::Rdma, MIB), MIB),
        None
    );
    let why = too_large_to_pin(&offer(TransportKind::Rdma, MIB + 1), MIB).unwrap();
    assert!(why.contains("cache.memory_budget"), "{why}");
    assert_eq!(
        too_large_to_pin(&offer(TransportKind::Tcp, 10 * MIB), MIB),
        None
    );
}

fn local_failure() -> JobError {
    JobError::Install(Arc::new(InstallError::Io {
        op: "write",
        path: "/snapshots/x".into(),
        source: std::io::Error::from_raw_os_error(28),
    }))
}

fn unreachable() -> JobError {
    JobError::Unreachable {
        source_addr: "src:7000".into(),
        message: "connection refused".into(),
    }
}

fn next(err: &JobError, made: u32, checksum_failures: u32, upstream: bool) -> Next {
    let attempts = Attempts {
        made,
        checksum_failures,
    };
    after_failure(err, attempts, upstream, &SyncConfig::default(), 1.0)
}

#[test]
fn a_failing_source_hands_over_to_the_next_upstream_at_once() {
    for err in [
        JobError::Checksum("piece 1".into()),
        unreachable(),
        JobError::BadOffer("format".into()),
        JobError::Refused {
            code: tonic::Code::PermissionDenied,
            message: "no".into(),
        },
    ] {
        assert_eq!(next(&err, 1, 1, true), Next::NextSource, "{err}");
    }
}

#[test]
fn local_and_operator_failures_end_the_job_even_with_upstreams() {
    for err in [
        local_failure(),
        JobError::Cancelled,
        JobError::Room(RoomError::TooLarge { size: 2, max: 1 }),
    ] {
        assert_eq!(next(&err, 1, 0, true), Next::GiveUp, "{err}");
    }
}

#[test]
fn a_source_this_agent_will_not_dial_is_passed_over_never_retried() {
    let err = JobError::WillNotDial(crate::rpc::dial::ConnectError::Unproved("src:7000".into()));
    assert_eq!(next(&err, 1, 0, true), Next::NextSource);
    assert_eq!(next(&err, 1, 0, false), Next::GiveUp);
}

#[test]
fn transient_failures_retry_with_doubling_backoff_until_retries_run_out() {
    // SyncConfig::default(): 3 retries, 1 s doubling up to 30 s.
    assert_eq!(
        next(&unreachable(), 1, 0, false),
        Next::Retry(Duration::from_secs(1))
    );
    assert_eq!(
        next(&unreachable(), 3, 0, false),
        Next::Retry(Duration::from_secs(4))
    );
    assert_eq!(next(&unreachable(), 4, 0, false), Next::GiveUp);
    let no_snapshot_yet = JobError::Refused {
        code: tonic::Code::NotFound,
        message: "no snapshot".into(),
    };
    assert!(matches!(
        next(&no_snapshot_yet, 1, 0, false),
        Next::Retry(_)
    ));
    let denied = JobError::Refused {
        code: tonic::Code::PermissionDenied,
        message: "no".into(),
    };
    assert_eq!(next(&denied, 1, 0, false), Next::GiveUp);
}

#[test]
fn a_second_checksum_failure_from_the_same_source_is_the_end() {
    let bad = JobError::Checksum("piece 3".into());
    assert!(matches!(next(&bad, 1, 1, false), Next::Retry(_)));
    assert_eq!(next(&bad, 2, 2, false), Next::GiveUp);
}

#[test]
fn a_cancelled_tcp_link_is_not_retried_but_a_broken_one_is() {
    let cancelled = JobError::Transport(LinkError::Tcp(TcpError::Cancelled));
    assert!(!is_transient(&cancelled) && !blames_source(&cancelled));
    let closed = JobError::Transport(LinkError::Tcp(TcpError::Closed("reading")));
    assert!(is_transient(&closed) && blames_source(&closed));
    let length = JobError::Protocol(Blk3Error::AnnouncedLength {
        offered: 1,
        announced: 2,
    });
    assert!(!is_transient(&length) && blames_source(&length));
}

#[test]
fn backoff_doubles_caps_and_takes_its_jitter() {
    let (base, max) = (Duration::from_millis(100), Duration::from_secs(1));
    let b = |attempt, jitter| backoff(base, max, attempt, jitter);
    assert_eq!(b(1, 1.0), base);
    assert_eq!(b(2, 1.0), base * 2);
    assert_eq!(b(5, 1.0), max);
    assert_eq!(b(60, 1.0), max, "no shift overflow");
    assert_eq!(b(0, 1.0), base);
    assert_eq!(b(2, 0.75), Duration::from_millis(150));
}

#[test]
fn a_relayed_offer_resumes_by_its_origin() {
    let mut o = offer(TransportKind::Tcp, MIB);
    assert_eq!(o.origin(), "src-a");
    o.origin_node = Some("origin".into());
    assert_eq!(o.origin(), "origin");
}
