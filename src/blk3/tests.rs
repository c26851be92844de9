//! Drives a [`Source`] and a [`Replica`] against each other over a virtual
//! wire and clock. The wire behaves like an RC queue pair with a fast peer:
//! a Send that finds no posted receive on the other side is an RNR error, so
//! every pre-post rule is checked by every test.

use std::collections::VecDeque;
use std::time::Duration;

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Src,
    Rep,
}

/// What happened, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    Cmd(Side, Command),
    /// A token arrived at this side.
    Deliver(Side, Token),
    Rnr(Side, Kind),
}

/// Knobs for the simulated drivers.
struct Sim {
    mode: BulkMode,
    len: u64,
    offered: u64,
    verify: Result<(), String>,
    /// What the replica's driver answers to PrepareReceive (Err: no room).
    prepare: Result<(), String>,
    /// Rewrites tokens in flight (from source if the bool is true).
    tamper: Box<dyn FnMut(bool, Token) -> Option<Token>>,
    /// The source's driver never completes writes (a stalled fabric).
    stall_writes: bool,
    /// This side's driver drops this receive post (a buggy driver).
    skip_post: Option<(Side, Kind)>,
}

impl Sim {
    fn new(mode: BulkMode, len: u64) -> Sim {
        Sim {
            mode,
            len,
            offered: len,
            verify: Ok(()),
            prepare: Ok(()),
            tamper: Box::new(|_, t| Some(t)),
            stall_writes: false,
            skip_post: None,
        }
    }
}

struct Run {
    events: Vec<Event>,
    src: Option<Result<Outcome, Blk3Error>>,
    rep: Option<Result<Outcome, Blk3Error>>,
    written: u64,
    src_machine: Source,
    rep_machine: Replica,
    now: Duration,
}

impl Run {
    fn rnr(&self) -> Vec<&Event> {
        self.events
            .iter()
            .filter(|e| matches!(e, Event::Rnr(..)))
            .collect()
    }

    fn position(&self, pred: impl Fn(&Event) -> bool) -> Option<usize> {
        self.events.iter().position(pred)
    }

    fn pos_cmd(&self, side: Side, c: &Command) -> usize {
        self.position(|e| *e == Event::Cmd(side, c.clone()))
            .unwrap_or_else(|| panic!("{side:?} never issued {c:?}: {:#?}", self.events))
    }

    fn sent(&self, side: Side, kind: Kind) -> bool {
        self.events
            .iter()
            .any(|e| matches!(e, Event::Cmd(s, Command::Send(t)) if *s == side && t.kind() == kind))
    }
}

const SEQ: u64 = 4242;

fn simulate(mut sim: Sim) -> Run {
    let mut src = Source::new(sim.len, SEQ, sim.mode);
    let mut rep = Replica::new(sim.offered, sim.mode);
    let mut now = Duration::ZERO;
    let mut events = Vec::new();
    let mut posted: [VecDeque<Kind>; 2] = [VecDeque::new(), VecDeque::new()];
    let mut inbox: [VecDeque<Input>; 2] = [VecDeque::new(), VecDeque::new()];
    let mut pending_writes: VecDeque<WriteOp> = VecDeque::new();
    let (mut src_done, mut rep_done) = (None, None);
    let mut written = 0u64;
    let mut region: Option<(u64, u32)> = None;

    rep.start(now);
    src.start(now);
    for _round in 0..1_000_000 {
        let mut progressed = false;
        // Drain commands of both sides.
        for side in [Side::Rep, Side::Src] {
            let i = side as usize;
            loop {
                let cmd = match side {
                    Side::Src => src.poll(),
                    Side::Rep => rep.poll(),
                };
                let Some(cmd) = cmd else { break };
                progressed = true;
                events.push(Event::Cmd(side, cmd.clone()));
                match cmd {
                    Command::PostRecv(k) if sim.skip_post == Some((side, k)) => {}
                    Command::PostRecv(k) => posted[i].push_back(k),
                    Command::Send(t) => {
                        let peer = 1 - i;
                        let from_src = side == Side::Src;
                        let Some(t) = (sim.tamper)(from_src, t) else {
                            continue;
                        };
                        if posted[peer].pop_front().is_none() {
                            events.push(Event::Rnr(side, t.kind()));
                            continue;
                        }
                        events.push(Event::Deliver(
                            if from_src { Side::Rep } else { Side::Src },
                            t.clone(),
                        ));
                        inbox[peer].push_back(Input::Received(t));
                    }
                    Command::PrepareSource => inbox[i].push_back(Input::SourceReady),
                    Command::PostWrites {
                        remote_addr,
                        rkey,
                        writes,
                    } => {
                        assert_eq!(
                            Some((remote_addr, rkey)),
                            region,
                            "writes go to the advertised region"
                        );
                        pending_writes.extend(writes);
                    }
                    Command::StreamBulk { len } => {
                        written += len;
                        inbox[i].push_back(Input::BulkSent);
                    }
                    Command::PrepareReceive { .. } if sim.prepare.is_err() => {
                        let reason = sim.prepare.clone().unwrap_err();
                        inbox[i].push_back(Input::ReceiveFailed(reason));
                    }
                    Command::PrepareReceive { .. } => {
                        let r = match sim.mode {
                            BulkMode::Rdma(_) => (0x7f00_0000_1000, 0xabcd),
                            BulkMode::Stream => (0, 0),
                        };
                        region = Some(r);
                        inbox[i].push_back(Input::ReceiveReady {
                            addr: r.0,
                            rkey: r.1,
                        });
                    }
                    Command::ReceiveBulk { .. } => inbox[i].push_back(Input::BulkReceived),
                    Command::Verify => inbox[i].push_back(Input::Verified(sim.verify.clone())),
                    Command::Done(r) => match side {
                        Side::Src => src_done = Some(r),
                        Side::Rep => rep_done = Some(r),
                    },
                }
            }
        }
        // The fabric executes writes in order, completing signalled ones.
        if !sim.stall_writes {
            while let Some(w) = pending_writes.pop_front() {
                written += w.len;
                progressed = true;
                if w.signaled {
                    inbox[Side::Src as usize].push_back(Input::WriteCompleted { id: w.id });
                    break;
                }
            }
        }
        for side in [Side::Src, Side::Rep] {
            if let Some(input) = inbox[side as usize].pop_front() {
                progressed = true;
                match side {
                    Side::Src => src.handle(input, now),
                    Side::Rep => rep.handle(input, now),
                }
            }
        }
        if src_done.is_some() && rep_done.is_some() {
            break;
        }
        if !progressed {
            // Nothing moves: advance the virtual clock to the next deadline.
            let next = [src.deadline(), rep.deadline()].into_iter().flatten().min();
            let Some(at) = next else { break };
            now = at;
            src.on_timeout(now);
            rep.on_timeout(now);
        }
    }
    Run {
        events,
        src: src_done,
        rep: rep_done,
        written,
        src_machine: src,
        rep_machine: rep,
        now,
    }
}

fn rdma(chunk_mb: u32, pipeline: u32, batch: u32) -> BulkMode {
    BulkMode::Rdma(BulkParams::new(chunk_mb, pipeline, batch))
}

#[test]
fn full_session_over_rdma_and_stream() {
    for mode in [rdma(1, 4, 2), rdma(4, 32, 8), BulkMode::Stream] {
        let len = (10 << 20) + 3;
        let run = simulate(Sim::new(mode, len));
        assert!(run.rnr().is_empty(), "RNR: {:?}", run.rnr());
        assert_eq!(run.src, Some(Ok(Outcome::Sent { len })));
        assert_eq!(run.rep, Some(Ok(Outcome::Received { len, seq: SEQ })));
        assert_eq!(run.written, len);
        assert_eq!(run.src_machine.bytes_done(), len);
    }
}

#[test]
fn token_order_follows_the_design() {
    let run = simulate(Sim::new(rdma(1, 4, 2), 5 << 20));
    let sends: Vec<(Side, Kind)> = run
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Cmd(s, Command::Send(t)) => Some((*s, t.kind())),
            _ => None,
        })
        .collect();
    use Kind::*;
    use Side::*;
    assert_eq!(
        sends,
        vec![
            (Src, Srdy),
            (Rep, Crea),
            (Rep, Rdpr),
            (Src, Rdgo),
            (Src, Blk3),
            (Rep, Mrin),
            (Src, Bdon),
            (Rep, Rdok),
            (Src, Replmeta)
        ]
    );
}

#[test]
fn receives_are_posted_before_the_messages_that_provoke_them() {
    let run = simulate(Sim::new(rdma(1, 4, 2), 3 << 20));
    let send = |side, t: Token| run.pos_cmd(side, &Command::Send(t));
    let post = |side, k| run.pos_cmd(side, &Command::PostRecv(k));
    // Replica: SRDY, RDGO, BLK3 before CREA; BDON before MRINFO; REPLMETA before verifying.
    let crea = send(Side::Rep, Token::Crea);
    for k in [Kind::Srdy, Kind::Rdgo, Kind::Blk3, Kind::Bdon] {
        assert!(post(Side::Rep, k) < crea, "{k} posted after CREA");
    }
    let mrin = run
        .position(|e| matches!(e, Event::Cmd(Side::Rep, Command::Send(Token::Mrin { .. }))))
        .unwrap();
    assert!(post(Side::Rep, Kind::Bdon) < mrin);
    assert!(post(Side::Rep, Kind::Replmeta) < run.pos_cmd(Side::Rep, &Command::Verify));
    // Source: CREA/RDPR before SRDY, MRINFO before BLK3, RDOK before BDON.
    let srdy = send(Side::Src, Token::Srdy);
    assert!(post(Side::Src, Kind::Crea) < srdy && post(Side::Src, Kind::Rdpr) < srdy);
    assert!(post(Side::Src, Kind::Mrin) < send(Side::Src, Token::Blk3 { len: 3 << 20 }));
    assert!(post(Side::Src, Kind::Rdok) < send(Side::Src, Token::Bdon));
    // The header goes out before the snapshot is prepared (registered).
    assert!(
        send(Side::Src, Token::Blk3 { len: 3 << 20 })
            < run.pos_cmd(Side::Src, &Command::PrepareSource)
    );
}

#[test]
fn harness_detects_a_missing_receive() {
    // A replica that did not post its REPLMETA receive before RDOK: the
    // source's REPLMETA meets no receive, as on a real RC queue pair.
    let mut sim = Sim::new(BulkMode::Stream, 1000);
    sim.skip_post = Some((Side::Rep, Kind::Replmeta));
    let run = simulate(sim);
    assert_eq!(
        run.rnr().first(),
        Some(&&Event::Rnr(Side::Src, Kind::Replmeta))
    );
}

#[test]
fn empty_snapshot_runs_the_whole_handshake() {
    for mode in [rdma(4, 32, 8), BulkMode::Stream] {
        let run = simulate(Sim::new(mode, 0));
        assert!(run.rnr().is_empty(), "{:?}", run.rnr());
        assert_eq!(run.rep, Some(Ok(Outcome::Received { len: 0, seq: SEQ })));
        assert_eq!(run.src, Some(Ok(Outcome::Sent { len: 0 })));
        assert!(
            !run.sent(Side::Rep, Kind::Mrin),
            "no MRINFO for an empty snapshot"
        );
        assert!(!run.events.iter().any(|e| matches!(
            e,
            Event::Cmd(
                _,
                Command::PostWrites { .. } | Command::PrepareReceive { .. }
            )
        )));
        assert!(run.sent(Side::Src, Kind::Bdon) && run.sent(Side::Src, Kind::Replmeta));
    }
}

#[test]
fn mrinfo_length_mismatch_is_refused_before_any_write() {
    let mut sim = Sim::new(rdma(1, 4, 2), 4 << 20);
    sim.tamper = Box::new(|from_src, t| match t {
        Token::Mrin { addr, rkey, len } if !from_src => Some(Token::Mrin {
            addr,
            rkey,
            len: len - 1,
        }),
        t => Some(t),
    });
    let run = simulate(sim);
    assert_eq!(
        run.src,
        Some(Err(Blk3Error::MrinfoLength {
            announced: 4 << 20,
            mrinfo: (4 << 20) - 1
        }))
    );
    assert!(!run
        .events
        .iter()
        .any(|e| matches!(e, Event::Cmd(_, Command::PostWrites { .. }))));
    assert_eq!(run.written, 0);
    assert!(matches!(&run.rep, Some(Err(Blk3Error::PeerFailed(r))) if r.contains("MRINFO length")));
}

#[test]
fn checksum_failure_sends_rdfl_and_no_replmeta() {
    let mut sim = Sim::new(BulkMode::Stream, 5000);
    sim.verify = Err("crc mismatch".into());
    let run = simulate(sim);
    assert_eq!(
        run.rep,
        Some(Err(Blk3Error::Checksum("crc mismatch".into())))
    );
    assert!(matches!(&run.src, Some(Err(Blk3Error::PeerFailed(r))) if r.contains("crc mismatch")));
    assert!(run.sent(Side::Rep, Kind::Rdfl));
    assert!(
        !run.sent(Side::Src, Kind::Replmeta),
        "REPLMETA only after RDOK"
    );
}

#[test]
fn replica_without_room_refuses_before_any_byte_moves() {
    for mode in [BulkMode::Stream, rdma(4, 32, 8)] {
        let mut sim = Sim::new(mode, 5000);
        sim.prepare = Err("no space left on device".into());
        let run = simulate(sim);
        assert_eq!(
            run.rep,
            Some(Err(Blk3Error::CannotReceive(
                "no space left on device".into()
            )))
        );
        assert!(
            matches!(&run.src, Some(Err(Blk3Error::PeerFailed(r))) if r.contains("no space left")),
            "{:?}",
            run.src
        );
        assert!(!run.sent(Side::Rep, Kind::Mrin), "no MRINFO without room");
        assert_eq!(run.written, 0, "no byte moves");
    }
}

#[test]
fn unexpected_token_fails_loudly() {
    let mut sim = Sim::new(BulkMode::Stream, 100);
    sim.tamper = Box::new(|from_src, t| match t {
        Token::Rdgo if from_src => Some(Token::Bdon),
        t => Some(t),
    });
    let run = simulate(sim);
    assert!(matches!(
        run.rep,
        Some(Err(Blk3Error::Unexpected {
            expected: Kind::Rdgo,
            got: Kind::Bdon,
            ..
        }))
    ));
    assert!(matches!(run.src, Some(Err(Blk3Error::PeerFailed(_)))));
}

#[test]
fn announced_length_must_match_the_offer() {
    let mut sim = Sim::new(BulkMode::Stream, 100);
    sim.offered = 99;
    let run = simulate(sim);
    assert_eq!(
        run.rep,
        Some(Err(Blk3Error::AnnouncedLength {
            offered: 99,
            announced: 100
        }))
    );
    assert!(!run
        .events
        .iter()
        .any(|e| matches!(e, Event::Cmd(Side::Rep, Command::PrepareReceive { .. }))));
}

#[test]
fn stalled_bulk_times_out_after_the_size_scaled_timeout() {
    let len = 1u64 << 30;
    let mut sim = Sim::new(rdma(4, 32, 8), len);
    sim.stall_writes = true;
    let run = simulate(sim);
    let scaled = size_scaled_timeout(len);
    assert_eq!(
        run.src,
        Some(Err(Blk3Error::Timeout {
            waiting_for: "bulk write completions",
            after: scaled
        }))
    );
    // The replica's BDON wait expires at the same moment.
    assert!(matches!(
        run.rep,
        Some(Err(Blk3Error::PeerFailed(_) | Blk3Error::Timeout { .. }))
    ));
    assert_eq!(run.now, scaled);
}

#[test]
fn replica_times_out_waiting_for_bdon() {
    // The source vanishes after the MRINFO: nothing ever arrives again.
    let mut sim = Sim::new(BulkMode::Stream, 2 << 30);
    sim.tamper = Box::new(|from_src, t| {
        if from_src && t.kind() == Kind::Bdon {
            None
        } else {
            Some(t)
        }
    });
    let run = simulate(sim);
    assert_eq!(
        run.rep,
        Some(Err(Blk3Error::Timeout {
            waiting_for: "BDON",
            after: size_scaled_timeout(2 << 30)
        }))
    );
    assert!(run.rep_machine.deadline().is_none());
}

#[test]
fn completion_out_of_plan_fails_the_source() {
    let mut src = Source::new(8 << 20, 1, rdma(1, 8, 4));
    src.start(Duration::ZERO);
    src.handle(Input::Received(Token::Crea), Duration::ZERO);
    src.handle(Input::Received(Token::Rdpr), Duration::ZERO);
    src.handle(
        Input::Received(Token::Mrin {
            addr: 1,
            rkey: 2,
            len: 8 << 20,
        }),
        Duration::ZERO,
    );
    src.handle(Input::SourceReady, Duration::ZERO);
    src.handle(Input::WriteCompleted { id: 7 }, Duration::ZERO);
    let done = std::iter::from_fn(|| src.poll()).find(|c| matches!(c, Command::Done(_)));
    assert!(matches!(
        done,
        Some(Command::Done(Err(Blk3Error::Completion(_))))
    ));
}

#[test]
fn one_gib_at_defaults_posts_256_writes_32_signalled() {
    let run = simulate(Sim::new(BulkMode::Rdma(BulkParams::default()), 1 << 30));
    let writes: Vec<&WriteOp> = run
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Cmd(Side::Src, Command::PostWrites { writes, .. }) => Some(writes.iter()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(writes.len(), 256);
    assert_eq!(writes.iter().filter(|w| w.signaled).count(), 32);
    assert_eq!(
        run.rep,
        Some(Ok(Outcome::Received {
            len: 1 << 30,
            seq: SEQ
        }))
    );
}

proptest::proptest! {
    /// Whatever the tokens in flight are rewritten to, neither side panics,
    /// no write is posted before a valid MRINFO, and REPLMETA only follows RDOK.
    #[test]
    fn invariants_hold_under_token_mutation(
        len in 0u64..(40 << 20),
        victim in 0usize..12,
        replacement in 0usize..11,
        stream in proptest::bool::ANY,
    ) {
        let mode = if stream { BulkMode::Stream } else { rdma(1, 4, 2) };
        let mut sim = Sim::new(mode, len);
        let mut n = 0usize;
        let tokens = [
            Token::Srdy, Token::Crea, Token::Rdpr, Token::Rdgo, Token::Blk3 { len: 7 },
            Token::Mrin { addr: 1, rkey: 1, len: 1 }, Token::Bdon, Token::Rdok,
            Token::Rdfl { reason: "x".into() }, Token::Replmeta { seq: 1 }, Token::Sess { token: [0; 32] },
        ];
        sim.tamper = Box::new(move |_, t| {
            n += 1;
            if n == victim + 1 { Some(tokens[replacement].clone()) } else { Some(t) }
        });
        let run = simulate(sim);
        let delivered_before = |at: usize, pred: &dyn Fn(&Token) -> bool| {
            run.events[..at].iter().any(|e| matches!(e, Event::Deliver(Side::Src, t) if pred(t)))
        };
        if let Some(first) = run.position(|e| matches!(e, Event::Cmd(Side::Src, Command::PostWrites { .. } | Command::StreamBulk { .. }))) {
            let valid_mrinfo = delivered_before(first, &|t| matches!(t, Token::Mrin { len: l, .. } if *l == len));
            proptest::prop_assert!(valid_mrinfo);
        }
        if let Some(at) = run.position(|e| matches!(e, Event::Cmd(Side::Src, Command::Send(Token::Replmeta { .. })))) {
            let rdok = delivered_before(at, &|t| *t == Token::Rdok);
            proptest::prop_assert!(rdok);
        }
        if let Some(Ok(_)) = run.rep {
            proptest::prop_assert!(run.sent(Side::Rep, Kind::Rdok));
        }
        // Whatever the peer sends, neither side hangs: each ends with a
        // verdict (by a token, or by its own deadline).
        proptest::prop_assert!(
            run.src.is_some() && run.rep.is_some(),
            "a side stopped without a result: src {:?}, rep {:?}",
            run.src,
            run.rep
        );
    }
}
