//! Drives a [`Source`] and a [`Replica`] against each other over a virtual
//! wire and clock. The wire behaves like an RC queue pair with a fast peer:
//! a Send that finds no posted receive on the other side is an RNR error, so
//! every pre-post rule is checked by every test.

use std::collections::VecDeque;
use std::time::Duration;

use super::*;

mod queue;

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
    piece_size: u64,
    /// Pieces the replica asks for (`None`: all).
    need: Option<Vec<(u32, u32)>>,
    retries: u32,
    /// Pieces whose check fails, and how many times.
    bad: std::collections::HashMap<u32, u32>,
    verify: Result<(), String>,
    /// What the replica's driver answers to PrepareReceive (Err: no room).
    prepare: Result<(), String>,
    /// Rewrites tokens in flight (from source if the bool is true).
    tamper: Box<dyn FnMut(bool, Token) -> Option<Token>>,
    /// The source's send queue stalls (a stalled fabric): no write and no
    /// Send behind one completes.
    stall_writes: bool,
    /// This side's driver drops this receive post (a buggy driver).
    skip_post: Option<(Side, Kind)>,
    /// The replica's longest wait for the next piece.
    piece_wait: Option<Duration>,
    /// The source's longest wait for a piece reply.
    reply_wait: Option<Duration>,
    /// What the streams of the source's session claimed, and which of
    /// them this one is.
    claims: std::rc::Rc<std::cell::RefCell<Claims>>,
    stream: u32,
}

const MIB: u64 = 1 << 20;

impl Sim {
    fn new(mode: BulkMode, len: u64) -> Sim {
        Sim {
            mode,
            len,
            offered: len,
            piece_size: MIB,
            need: None,
            retries: 3,
            bad: Default::default(),
            verify: Ok(()),
            prepare: Ok(()),
            tamper: Box::new(|_, t| Some(t)),
            stall_writes: false,
            skip_post: None,
            piece_wait: None,
            reply_wait: None,
            claims: Default::default(),
            stream: 0,
        }
    }

    fn pieces(&self) -> Pieces {
        Pieces {
            len: self.offered,
            size: self.piece_size,
        }
    }
}

struct Run {
    events: Vec<Event>,
    src: Option<Result<Outcome, Blk3Error>>,
    rep: Option<Result<Outcome, Blk3Error>>,
    /// Bytes the source put on the wire (writes executed, pieces streamed).
    written: u64,
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
        self.count_sent(side, kind) > 0
    }

    fn count_sent(&self, side: Side, kind: Kind) -> usize {
        self.events
            .iter()
            .filter(
                |e| matches!(e, Event::Cmd(s, Command::Send(t)) if *s == side && t.kind() == kind),
            )
            .count()
    }
}

const SEQ: u64 = 4242;

/// The source's send queue on the wire: writes and Sends, executed in order.
enum Sq {
    Write(WriteOp),
    Send(Token),
}

fn simulate(mut sim: Sim) -> Run {
    let pieces = sim.pieces();
    let need = sim
        .need
        .clone()
        .unwrap_or_else(|| need_ranges((0..pieces.count()).map(|_| true), 60));
    let mut src = Source::new(sim.len, SEQ, sim.piece_size, sim.mode);
    if let Some(wait) = sim.reply_wait {
        src = src.with_reply_wait(wait);
    }
    let mut rep = Replica::new(sim.offered, sim.piece_size, need, sim.retries);
    if let Some(wait) = sim.piece_wait {
        rep = rep.with_piece_wait(wait);
    }
    let mut now = Duration::ZERO;
    let mut events = Vec::new();
    let mut posted: [VecDeque<Kind>; 2] = [VecDeque::new(), VecDeque::new()];
    let mut inbox: [VecDeque<Input>; 2] = [VecDeque::new(), VecDeque::new()];
    let mut sq: VecDeque<Sq> = VecDeque::new();
    let (mut src_done, mut rep_done) = (None, None);
    let mut written = 0u64;
    // Bytes of each piece that reached the replica since it last took it.
    let mut landed: std::collections::HashMap<u32, u64> = Default::default();
    let mut region: Option<(u64, u32)> = None;
    let rdma = matches!(sim.mode, BulkMode::Rdma(_));

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
                    // RC: a source's Send goes behind its writes.
                    Command::Send(t) if side == Side::Src && rdma => sq.push_back(Sq::Send(t)),
                    Command::Send(t) => {
                        deliver(&mut sim, &mut events, &mut posted, &mut inbox, side, t)
                    }
                    Command::PrepareSource => inbox[i].push_back(Input::SourceReady),
                    // The driver claims at once: its answer comes first.
                    Command::Claim { pieces } => {
                        let claimed = sim.claims.borrow_mut().claim(sim.stream, &pieces);
                        inbox[i].push_front(Input::Claimed(claimed.map_err(|e| e.to_string())));
                    }
                    Command::MorePieces { .. } => unreachable!("one stream has no queue"),
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
                        sq.extend(writes.into_iter().map(Sq::Write));
                    }
                    Command::StreamPiece { index, len, .. } => {
                        written += len;
                        *landed.entry(index).or_default() += len;
                    }
                    Command::PrepareReceive { .. } if sim.prepare.is_err() => {
                        let reason = sim.prepare.clone().unwrap_err();
                        inbox[i].push_back(Input::ReceiveFailed(reason));
                    }
                    Command::PrepareReceive { .. } => {
                        let r = if rdma {
                            (0x7f00_0000_1000, 0xabcd)
                        } else {
                            (0, 0)
                        };
                        region = Some(r);
                        inbox[i].push_back(Input::ReceiveReady {
                            addr: r.0,
                            rkey: r.1,
                        });
                    }
                    Command::TakePiece { index, len, .. } => {
                        // Every byte of the piece is there before its PDON.
                        assert_eq!(
                            landed.remove(&index),
                            Some(len),
                            "piece {index} taken before it landed"
                        );
                        let result = match sim.bad.get_mut(&index) {
                            Some(n) if *n > 0 => {
                                *n -= 1;
                                Err(format!("piece {index} crc mismatch"))
                            }
                            _ => Ok(()),
                        };
                        inbox[i].push_back(Input::PieceChecked { index, result });
                    }
                    Command::Verify => inbox[i].push_back(Input::Verified(sim.verify.clone())),
                    Command::Done(r) => match side {
                        Side::Src => src_done = Some(r),
                        Side::Rep => rep_done = Some(r),
                    },
                }
            }
        }
        // The fabric executes the send queue in order, up to one signalled
        // write's completion per round.
        {
            while let Some(item) = sq.pop_front() {
                if sim.stall_writes && matches!(item, Sq::Write(_)) {
                    sq.push_front(item);
                    break;
                }
                progressed = true;
                match item {
                    Sq::Send(t) => {
                        deliver(&mut sim, &mut events, &mut posted, &mut inbox, Side::Src, t)
                    }
                    Sq::Write(w) => {
                        written += w.len;
                        let index = (w.offset / sim.piece_size) as u32;
                        *landed.entry(index).or_default() += w.len;
                        if w.signaled {
                            inbox[Side::Src as usize].push_back(Input::WriteCompleted { id: w.id });
                            break;
                        }
                    }
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
    sim.claims.borrow_mut().end(sim.stream, &src.unfinished());
    Run {
        events,
        src: src_done,
        rep: rep_done,
        written,
        rep_machine: rep,
        now,
    }
}

/// Delivers `t` from `side` to its peer, or records RNR when the peer has
/// no receive posted.
fn deliver(
    sim: &mut Sim,
    events: &mut Vec<Event>,
    posted: &mut [VecDeque<Kind>; 2],
    inbox: &mut [VecDeque<Input>; 2],
    side: Side,
    t: Token,
) {
    let peer = 1 - side as usize;
    let from_src = side == Side::Src;
    let Some(t) = (sim.tamper)(from_src, t) else {
        return;
    };
    if posted[peer].pop_front().is_none() {
        events.push(Event::Rnr(side, t.kind()));
        return;
    }
    events.push(Event::Deliver(
        if from_src { Side::Rep } else { Side::Src },
        t.clone(),
    ));
    inbox[peer].push_back(Input::Received(t));
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
        assert_eq!(run.count_sent(Side::Src, Kind::Pdon), 11);
        assert_eq!(run.count_sent(Side::Rep, Kind::Pack), 11);
    }
}

#[test]
fn token_order_follows_the_design() {
    let run = simulate(Sim::new(rdma(1, 4, 2), 5 << 20));
    let sends: Vec<(Side, Kind)> = run
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Cmd(s, Command::Send(t)) if !matches!(t.kind(), Kind::Pdon | Kind::Pack) => {
                Some((*s, t.kind()))
            }
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
            (Rep, Need),
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
    // The PDON window is posted before MRINFO; each reply's receive is
    // posted on the source before the PDON that provokes it.
    let pdon_posts = run
        .events
        .iter()
        .take(mrin)
        .filter(|e| **e == Event::Cmd(Side::Rep, Command::PostRecv(Kind::Pdon)))
        .count();
    assert_eq!(pdon_posts, PIECE_WINDOW as usize);
    for index in 0..3 {
        assert!(post(Side::Src, Kind::Pack) < send(Side::Src, Token::Pdon { index }));
    }
    assert!(post(Side::Rep, Kind::Replmeta) < run.pos_cmd(Side::Rep, &Command::Verify));
    // Source: CREA/RDPR before SRDY, MRINFO before BLK3, RDOK before BDON.
    let srdy = send(Side::Src, Token::Srdy);
    assert!(post(Side::Src, Kind::Crea) < srdy && post(Side::Src, Kind::Rdpr) < srdy);
    assert!(post(Side::Src, Kind::Mrin) < send(Side::Src, Token::Blk3 { len: 3 << 20 }));
    assert!(post(Side::Src, Kind::Need) < send(Side::Src, Token::Blk3 { len: 3 << 20 }));
    assert!(post(Side::Src, Kind::Rdok) < send(Side::Src, Token::Bdon));
    // The header goes out before the snapshot is prepared (registered).
    assert!(
        send(Side::Src, Token::Blk3 { len: 3 << 20 })
            < run.pos_cmd(Side::Src, &Command::PrepareSource)
    );
}

#[test]
fn harness_detects_a_missing_receive() {
    // A source that did not post its RDOK receive before BDON: the
    // replica's RDOK meets no receive, as on a real RC queue pair.
    let mut sim = Sim::new(BulkMode::Stream, 1000);
    sim.skip_post = Some((Side::Src, Kind::Rdok));
    let run = simulate(sim);
    assert_eq!(run.rnr().first(), Some(&&Event::Rnr(Side::Rep, Kind::Rdok)));
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
            waiting_for: "piece replies",
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
fn replica_with_a_piece_wait_fails_when_the_source_goes_silent() {
    // Over RDMA the replica sees no bytes: a source whose writes stop is
    // noticed by the missing piece announcements, long before the bulk's
    // size-scaled timeout.
    let wait = Duration::from_secs(7);
    let mut sim = Sim::new(rdma(4, 32, 8), 1 << 30);
    sim.stall_writes = true;
    sim.piece_wait = Some(wait);
    let run = simulate(sim);
    assert_eq!(
        run.rep,
        Some(Err(Blk3Error::Timeout {
            waiting_for: "pieces",
            after: wait
        }))
    );
    assert_eq!(run.now, wait);
    // A source that keeps announcing pieces is never cut off by it.
    for mode in [rdma(4, 32, 8), BulkMode::Stream] {
        let mut sim = Sim::new(mode, (64 << 20) + 5);
        sim.piece_wait = Some(wait);
        let run = simulate(sim);
        assert!(matches!(run.rep, Some(Ok(_))), "{:?}", run.rep);
    }
}

#[test]
fn source_with_a_reply_wait_fails_when_the_replica_goes_silent() {
    // The replica's answers stop reaching the source (its link is down):
    // the source gives the session up after the reply wait, not after the
    // bulk's size-scaled timeout.
    let wait = Duration::from_secs(5);
    let mut sim = Sim::new(rdma(4, 32, 8), 1 << 30);
    sim.tamper = Box::new(|from_src, t| {
        if !from_src && matches!(t.kind(), Kind::Pack | Kind::Preq) {
            None
        } else {
            Some(t)
        }
    });
    sim.reply_wait = Some(wait);
    let run = simulate(sim);
    assert_eq!(
        run.src,
        Some(Err(Blk3Error::Timeout {
            waiting_for: "piece replies",
            after: wait
        }))
    );
    // A replica that keeps answering is never cut off by it.
    for mode in [rdma(4, 32, 8), BulkMode::Stream] {
        let mut sim = Sim::new(mode, (64 << 20) + 5);
        sim.reply_wait = Some(wait);
        let run = simulate(sim);
        assert!(matches!(run.src, Some(Ok(_))), "{:?}", run.src);
    }
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
    let mut src = Source::new(8 << 20, 1, MIB, rdma(1, 8, 4));
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
    src.handle(
        Input::Received(Token::Need {
            ranges: vec![(0, 8)],
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
fn one_gib_at_defaults_posts_256_writes_64_signalled() {
    let mut sim = Sim::new(BulkMode::Rdma(BulkParams::default()), 1 << 30);
    sim.piece_size = 16 * MIB;
    let run = simulate(sim);
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
    // Every 8th, and each piece's last (every 4th).
    assert_eq!(writes.iter().filter(|w| w.signaled).count(), 64);
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
        victim in 0usize..40,
        replacement in 0usize..15,
        stream in proptest::bool::ANY,
    ) {
        let mode = if stream { BulkMode::Stream } else { rdma(1, 4, 2) };
        let mut sim = Sim::new(mode, len);
        let mut n = 0usize;
        let tokens = [
            Token::Srdy, Token::Crea, Token::Rdpr, Token::Rdgo, Token::Blk3 { len: 7 },
            Token::Mrin { addr: 1, rkey: 1, len: 1 }, Token::Bdon, Token::Rdok,
            Token::Rdfl { reason: "x".into() }, Token::Replmeta { seq: 1 }, Token::Sess { token: [0; 32] },
            Token::Need { ranges: vec![(0, 1)] }, Token::Pdon { index: 1 }, Token::Pack { index: 0 },
            Token::Preq { index: 2 },
        ];
        sim.tamper = Box::new(move |_, t| {
            n += 1;
            if n == victim + 1 { Some(tokens[replacement].clone()) } else { Some(t) }
        });
        let run = simulate(sim);
        let delivered_before = |at: usize, pred: &dyn Fn(&Token) -> bool| {
            run.events[..at].iter().any(|e| matches!(e, Event::Deliver(Side::Src, t) if pred(t)))
        };
        if let Some(first) = run.position(|e| matches!(e, Event::Cmd(Side::Src, Command::PostWrites { .. } | Command::StreamPiece { .. }))) {
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

/// PDONs delivered to the replica and not answered yet, at each event.
fn unanswered_high_water(run: &Run) -> usize {
    let (mut open, mut high) = (0i64, 0i64);
    for e in &run.events {
        match e {
            Event::Deliver(Side::Rep, Token::Pdon { .. }) => open += 1,
            Event::Deliver(Side::Src, Token::Pack { .. } | Token::Preq { .. }) => open -= 1,
            _ => {}
        }
        high = high.max(open);
    }
    high as usize
}

#[test]
fn a_damaged_piece_is_fetched_again_alone() {
    for mode in [rdma(1, 4, 2), BulkMode::Stream] {
        let len = 10 * MIB + 3;
        let mut sim = Sim::new(mode, len);
        sim.bad.insert(4, 1);
        let run = simulate(sim);
        assert!(run.rnr().is_empty(), "{:?}", run.rnr());
        assert_eq!(run.rep, Some(Ok(Outcome::Received { len, seq: SEQ })));
        assert_eq!(run.count_sent(Side::Rep, Kind::Preq), 1);
        assert!(run.events.contains(&Event::Cmd(
            Side::Rep,
            Command::Send(Token::Preq { index: 4 })
        )));
        assert_eq!(run.written, len + MIB, "only piece 4 moves twice");
    }
}

#[test]
fn a_piece_failing_past_its_retries_fails_the_session() {
    for mode in [rdma(1, 4, 2), BulkMode::Stream] {
        let mut sim = Sim::new(mode, 4 * MIB);
        sim.retries = 2;
        sim.bad.insert(1, 3);
        let run = simulate(sim);
        assert!(
            matches!(
                &run.rep,
                Some(Err(Blk3Error::PieceRetries {
                    index: 1,
                    tries: 3,
                    ..
                }))
            ),
            "{:?}",
            run.rep
        );
        // The source reads it as the replica's failed verification.
        assert!(
            matches!(&run.src, Some(Err(e)) if e.is_checksum_report()),
            "{:?}",
            run.src
        );
        assert!(!run.sent(Side::Src, Kind::Bdon));
    }
}

#[test]
fn the_source_caps_how_often_one_piece_is_sent() {
    let mut sim = Sim::new(BulkMode::Stream, 2 * MIB);
    sim.retries = 100;
    sim.bad.insert(0, 100);
    let run = simulate(sim);
    assert!(
        matches!(&run.src, Some(Err(Blk3Error::BadPiece(why))) if why.contains("more than 9 times")),
        "{:?}",
        run.src
    );
    assert_eq!(
        run.count_sent(Side::Src, Kind::Pdon),
        MAX_PIECE_SENDS as usize + 1
    );
}

#[test]
fn only_the_pieces_asked_for_move() {
    for mode in [rdma(1, 4, 2), BulkMode::Stream] {
        let len = 5 * MIB;
        let mut sim = Sim::new(mode, len);
        sim.need = Some(vec![(1, 1), (3, 2)]);
        let run = simulate(sim);
        assert_eq!(run.rep, Some(Ok(Outcome::Received { len, seq: SEQ })));
        assert_eq!(run.written, 3 * MIB);
        // Nothing needed: the handshake still runs, no byte moves.
        let mut sim = Sim::new(mode, len);
        sim.need = Some(vec![]);
        let run = simulate(sim);
        assert_eq!(run.rep, Some(Ok(Outcome::Received { len, seq: SEQ })));
        assert_eq!(run.written, 0);
        assert!(run.sent(Side::Rep, Kind::Mrin) && run.sent(Side::Src, Kind::Bdon));
    }
}

#[test]
fn a_need_outside_the_snapshot_or_out_of_order_is_refused() {
    for bad in [
        vec![(0, 6)],
        vec![(2, 1), (1, 1)],
        vec![(1, 0)],
        vec![(0, 2), (1, 2)],
    ] {
        let mut sim = Sim::new(BulkMode::Stream, 5 * MIB);
        sim.need = Some(bad.clone());
        let run = simulate(sim);
        assert!(
            matches!(&run.src, Some(Err(Blk3Error::BadPiece(_)))),
            "{bad:?}: {:?}",
            run.src
        );
        assert_eq!(run.written, 0, "{bad:?}");
    }
}

#[test]
fn the_streams_of_one_session_fetch_each_piece_once() {
    for mode in [rdma(1, 4, 2), BulkMode::Stream] {
        let claims = std::rc::Rc::new(std::cell::RefCell::new(Claims::default()));
        let mut streams = 0;
        let mut stream = |need: Vec<(u32, u32)>| {
            let mut sim = Sim::new(mode, 6 * MIB);
            sim.need = Some(need);
            sim.claims = claims.clone();
            sim.stream = streams;
            streams += 1;
            simulate(sim)
        };
        // Two shares apart: both are served.
        for share in [vec![(0, 2), (4, 1)], vec![(2, 2)]] {
            let run = stream(share.clone());
            assert!(matches!(run.src, Some(Ok(_))), "{share:?}: {:?}", run.src);
        }
        // A stream asking for a piece another stream has: refused before
        // any byte moves, and so is one asking for the whole again.
        for greedy in [vec![(3, 3)], vec![(0, 6)]] {
            let run = stream(greedy.clone());
            assert!(
                matches!(&run.src, Some(Err(Blk3Error::BadPiece(why))) if why.contains("another stream")),
                "{greedy:?}: {:?}",
                run.src
            );
            assert_eq!(run.written, 0, "{greedy:?}");
        }
        // What is left is still some stream's to take.
        assert!(matches!(stream(vec![(5, 1)]).src, Some(Ok(_))));
    }
}

#[test]
fn a_piece_token_out_of_turn_is_refused() {
    // A PDON for a piece the replica did not ask for.
    let mut sim = Sim::new(BulkMode::Stream, 3 * MIB);
    sim.need = Some(vec![(0, 1)]);
    sim.tamper = Box::new(|from_src, t| match t {
        Token::Pdon { .. } if from_src => Some(Token::Pdon { index: 2 }),
        t => Some(t),
    });
    let run = simulate(sim);
    assert!(
        matches!(
            run.rep,
            Some(Err(Blk3Error::Unexpected {
                got: Kind::Pdon,
                ..
            }))
        ),
        "{:?}",
        run.rep
    );
    // A PACK for a piece the source never announced.
    let mut sim = Sim::new(BulkMode::Stream, 3 * MIB);
    sim.tamper = Box::new(|from_src, t| match t {
        Token::Pack { .. } if !from_src => Some(Token::Pack { index: 77 }),
        t => Some(t),
    });
    let run = simulate(sim);
    assert!(
        matches!(run.src, Some(Err(Blk3Error::Unexpected { .. }))),
        "{:?}",
        run.src
    );
}

proptest::proptest! {
    /// The piece-token window: whatever the size, piece size, transport,
    /// resumed pieces and damaged pieces, no token ever meets a missing
    /// receive, no more than PIECE_WINDOW PDONs are unanswered, and the
    /// session ends well exactly when no piece fails past its retries.
    #[test]
    fn piece_window_never_overruns_the_posted_receives(
        pieces in 1u32..40,
        tail in 0u64..MIB,
        have in proptest::collection::vec(proptest::bool::ANY, 40),
        bad in proptest::collection::vec((0u32..40, 1u32..4), 0..4),
        stream in proptest::bool::ANY,
        pipeline in 1u32..8,
    ) {
        let len = (pieces as u64 - 1) * MIB + tail.max(1);
        let mode = if stream { BulkMode::Stream } else { rdma(1, pipeline, 2) };
        let mut sim = Sim::new(mode, len);
        let count = sim.pieces().count();
        sim.need = Some(need_ranges((0..count).map(|i| !have[i as usize]), 60));
        for (i, n) in &bad {
            sim.bad.insert(i % count, *n);
        }
        let fails = sim.bad.iter().any(|(i, n)| *n > sim.retries && !have[*i as usize]);
        let run = simulate(sim);
        proptest::prop_assert!(run.rnr().is_empty(), "RNR: {:?}", run.rnr());
        proptest::prop_assert!(unanswered_high_water(&run) <= PIECE_WINDOW as usize);
        proptest::prop_assert_eq!(matches!(run.rep, Some(Ok(_))), !fails, "{:?}", run.rep);
        proptest::prop_assert!(run.src.is_some() && run.rep.is_some());
    }
}
