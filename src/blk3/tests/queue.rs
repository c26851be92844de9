//! Several streams of one session on the virtual wire, sharing the
//! replica's [`PieceQueue`] and the source's [`Claims`]: whatever the
//! interleaving, damaged pieces and streams that die (the replica hands
//! their pieces back at once, the source notices some steps later), no
//! piece is sent twice unless a PREQ or a NEED after a death asks again,
//! none is lost, and no token meets a missing receive.

use std::collections::{HashMap, VecDeque};

use super::super::share::Take;
use super::*;

/// One stream: its two machines, the receives each has posted, their
/// inboxes, and what its drivers are blocked on.
struct Pair {
    src: Source,
    rep: Replica,
    /// Posted receives: the source's, the replica's.
    posted: [VecDeque<Kind>; 2],
    inbox: [VecDeque<Input>; 2],
    /// Bytes of each piece streamed to this replica since it last took it.
    landed: HashMap<u32, u64>,
    /// Pieces the replica took from the queue and has not verified.
    held: Vec<u32>,
    /// The source's driver waits for these pieces to be free.
    claim: Option<Vec<u32>>,
    /// The replica's driver waits on the queue.
    more: bool,
    /// Pieces the source's claims granted.
    took: u32,
    src_done: Option<Result<Outcome, Blk3Error>>,
    rep_done: Option<Result<Outcome, Blk3Error>>,
    /// The replica is gone; the source notices at this step.
    dead: Option<usize>,
}

struct Session {
    pieces: Pieces,
    pairs: Vec<Pair>,
    queue: PieceQueue,
    claims: Claims,
    /// Per piece: times streamed, claims granted, times it may rightly be
    /// sent again (a failed check, a hand-back).
    streamed: HashMap<u32, u32>,
    claimed: HashMap<u32, u32>,
    again: HashMap<u32, u32>,
    verified: Vec<u32>,
    /// Checks each piece fails before it passes.
    bad: HashMap<u32, u32>,
    rnr: usize,
}

const SRC: usize = 0;
const REP: usize = 1;

impl Session {
    fn new(len: u64, streams: u32, bad: HashMap<u32, u32>) -> Session {
        let pieces = Pieces { len, size: MIB };
        let queue = PieceQueue::new(0..pieces.count(), MIB, streams);
        let pairs = (0..streams)
            .map(|_| {
                let mut src = Source::new(len, SEQ, MIB, BulkMode::Stream).queued();
                let mut rep = Replica::new(len, MIB, Vec::new(), 3).queued(queue.batch());
                rep.start(Duration::ZERO);
                src.start(Duration::ZERO);
                Pair {
                    src,
                    rep,
                    posted: Default::default(),
                    inbox: Default::default(),
                    landed: Default::default(),
                    held: Vec::new(),
                    claim: None,
                    more: false,
                    took: 0,
                    src_done: None,
                    rep_done: None,
                    dead: None,
                }
            })
            .collect();
        Session {
            pieces,
            pairs,
            queue,
            claims: Claims::default(),
            streamed: Default::default(),
            claimed: Default::default(),
            again: Default::default(),
            verified: Vec::new(),
            bad,
            rnr: 0,
        }
    }

    /// Delivers `t` from `from` of pair `k` to its peer.
    fn deliver(&mut self, k: usize, from: usize, t: Token) {
        let pair = &mut self.pairs[k];
        let to = 1 - from;
        if pair.posted[to].pop_front().is_none() {
            self.rnr += 1;
            return;
        }
        if let Token::Preq { index } = t {
            *self.again.entry(index).or_default() += 1;
        }
        pair.inbox[to].push_back(Input::Received(t));
    }

    /// The source's driver tries its claim; false while it must wait.
    fn claim(&mut self, k: usize, pieces: &[u32]) -> bool {
        let claimed = match self.claims.claim(k as u32, pieces) {
            Err(super::super::share::Refused::Held) => return false,
            Ok(()) => {
                self.pairs[k].took += pieces.len() as u32;
                for &i in pieces {
                    *self.claimed.entry(i).or_default() += 1;
                }
                Ok(())
            }
            Err(e) => Err(e.to_string()),
        };
        self.pairs[k].inbox[SRC].push_front(Input::Claimed(claimed));
        true
    }

    /// The replica's driver asks the queue; false while it must wait.
    fn more(&mut self, k: usize, wait: bool) -> bool {
        let ranges = match self.queue.take() {
            Take::Pieces(pieces) => {
                self.pairs[k].held.extend(&pieces);
                runs(pieces)
            }
            Take::Wait if wait => return false,
            Take::Wait | Take::Done => Vec::new(),
        };
        self.pairs[k].inbox[REP].push_front(Input::MorePieces(ranges));
        true
    }

    /// Runs pair `k`'s commands and one input per side; true if anything moved.
    fn step(&mut self, k: usize) -> bool {
        let mut moved = false;
        if let Some(pieces) = self.pairs[k].claim.clone() {
            if !self.claim(k, &pieces) {
                return false;
            }
            self.pairs[k].claim = None;
            moved = true;
        }
        if self.pairs[k].more {
            if !self.more(k, true) {
                return moved;
            }
            self.pairs[k].more = false;
            moved = true;
        }
        while let Some(cmd) = self.pairs[k].rep.poll() {
            moved = true;
            match cmd {
                Command::PostRecv(kind) => self.pairs[k].posted[REP].push_back(kind),
                Command::Send(t) => self.deliver(k, REP, t),
                Command::PrepareReceive { .. } => {
                    self.pairs[k].inbox[REP].push_back(Input::ReceiveReady { addr: 0, rkey: 0 })
                }
                Command::TakePiece { index, len, .. } => {
                    let pair = &mut self.pairs[k];
                    assert_eq!(pair.landed.remove(&index), Some(len), "piece {index}");
                    let result = match self.bad.get_mut(&index) {
                        Some(n) if *n > 0 => {
                            *n -= 1;
                            Err(format!("piece {index} damaged"))
                        }
                        _ => {
                            self.queue.verified(index);
                            pair.held.retain(|&i| i != index);
                            self.verified.push(index);
                            Ok(())
                        }
                    };
                    pair.inbox[REP].push_back(Input::PieceChecked { index, result });
                }
                Command::MorePieces { wait } => {
                    if !self.more(k, wait) {
                        self.pairs[k].more = true;
                        return true;
                    }
                }
                Command::Verify => {
                    let ok = if self.queue.left() == 0 {
                        Ok(())
                    } else {
                        Err("pieces missing".to_string())
                    };
                    self.pairs[k].inbox[REP].push_back(Input::Verified(ok));
                }
                Command::Done(r) => {
                    // However it ended, its driver hands back what it held.
                    let held = std::mem::take(&mut self.pairs[k].held);
                    self.queue.hand_back(held);
                    self.pairs[k].rep_done = Some(r);
                }
                other => panic!("replica command {other:?}"),
            }
        }
        while let Some(cmd) = self.pairs[k].src.poll() {
            moved = true;
            match cmd {
                Command::PostRecv(kind) => self.pairs[k].posted[SRC].push_back(kind),
                Command::Send(t) => self.deliver(k, SRC, t),
                Command::PrepareSource => self.pairs[k].inbox[SRC].push_back(Input::SourceReady),
                Command::Claim { pieces } => {
                    if !self.claim(k, &pieces) {
                        self.pairs[k].claim = Some(pieces);
                        return true;
                    }
                }
                Command::StreamPiece { index, len, .. } => {
                    *self.pairs[k].landed.entry(index).or_default() += len;
                    *self.streamed.entry(index).or_default() += 1;
                }
                Command::Done(r) => {
                    let unfinished = self.pairs[k].src.unfinished();
                    self.claims.end(k as u32, &unfinished);
                    self.pairs[k].src_done = Some(r);
                }
                other => panic!("source command {other:?}"),
            }
        }
        let pair = &mut self.pairs[k];
        for side in [SRC, REP] {
            if let Some(input) = pair.inbox[side].pop_front() {
                moved = true;
                match side {
                    SRC => pair.src.handle(input, Duration::ZERO),
                    _ => pair.rep.handle(input, Duration::ZERO),
                }
            }
        }
        moved
    }

    /// Pair `k`'s replica dies: its pieces go back to the queue now, the
    /// source notices `later` steps on.
    fn kill(&mut self, k: usize, now: usize, later: usize) {
        let pair = &mut self.pairs[k];
        if pair.dead.is_some() || pair.rep_done.is_some() {
            return;
        }
        pair.dead = Some(now + later);
        for &i in &pair.held {
            *self.again.entry(i).or_default() += 1;
        }
        self.queue.hand_back(pair.held.drain(..));
    }

    /// Runs the session: `order` picks which stream moves at each step,
    /// `kills` are (stream, step, steps until its source notices).
    fn run(&mut self, order: &[u8], kills: &[(usize, usize, usize)]) {
        let n = self.pairs.len();
        let mut idle = 0;
        for now in 0..200_000 {
            for &(k, at, later) in kills {
                if at == now {
                    self.kill(k, now, later);
                }
            }
            for k in 0..n {
                if self.pairs[k].dead == Some(now) {
                    let unfinished = self.pairs[k].src.unfinished();
                    self.claims.end(k as u32, &unfinished);
                }
            }
            let live: Vec<usize> = (0..n)
                .filter(|&k| self.pairs[k].dead.is_none() && self.pairs[k].rep_done.is_none())
                .collect();
            let pending = (0..n).any(|k| self.pairs[k].dead.is_some_and(|d| d > now));
            if live.is_empty() && !pending {
                // The live streams' sources end with their replicas.
                for k in 0..n {
                    if self.pairs[k].dead.is_none() {
                        while self.step(k) {}
                    }
                }
                return;
            }
            if live.is_empty() {
                continue;
            }
            let k = live
                [order.get(now % order.len().max(1)).copied().unwrap_or(0) as usize % live.len()];
            if self.step(k) || (0..n).any(|k| self.pairs[k].dead.is_none() && self.step(k)) {
                idle = 0;
            } else {
                idle += 1;
                if idle >= 100 && !pending {
                    for (k, p) in self.pairs.iter().enumerate() {
                        eprintln!("{k}: dead {:?} claim {:?} more {} src {:?} rep {:?} held {:?} inbox {:?} posted {:?}", p.dead, p.claim, p.more, p.src, p.rep, p.held, p.inbox, p.posted);
                    }
                    eprintln!("queue {:?} claims {:?}", self.queue, self.claims);
                    panic!("the session is stuck");
                }
            }
        }
        panic!("the session did not end");
    }
}

proptest::proptest! {
    /// The shared queue's rules hold whatever the interleaving.
    #[test]
    fn streams_sharing_a_queue_send_each_piece_once_and_lose_none(
        pieces in 1u32..40,
        streams in 1u32..5,
        order in proptest::collection::vec(0u8..8, 1..64),
        bad in proptest::collection::vec((0u32..40, 1u32..3), 0..3),
        kills in proptest::collection::vec((1usize..5, 0usize..400, 0usize..50), 0..3),
    ) {
        let len = pieces as u64 * MIB - 7;
        let count = pieces;
        let bad: HashMap<u32, u32> = bad.into_iter().map(|(i, n)| (i % count, n)).collect();
        let kills: Vec<_> = kills
            .into_iter()
            .filter(|&(k, ..)| k < streams as usize)
            .collect();
        let mut s = Session::new(len, streams, bad);
        s.run(&order, &kills);
        proptest::prop_assert_eq!(s.rnr, 0);
        // None lost: every piece verified, exactly once.
        let mut verified = s.verified.clone();
        verified.sort_unstable();
        proptest::prop_assert_eq!(verified, (0..s.pieces.count()).collect::<Vec<_>>());
        // None sent twice unless asked again.
        for i in 0..s.pieces.count() {
            let streamed = s.streamed.get(&i).copied().unwrap_or(0);
            let claimed = s.claimed.get(&i).copied().unwrap_or(0);
            let again = s.again.get(&i).copied().unwrap_or(0);
            proptest::prop_assert!(streamed <= claimed, "piece {i}: {streamed} sends, {claimed} claims");
            proptest::prop_assert!(claimed <= 1 + again, "piece {i}: {claimed} claims, {again} asked again");
        }
        // Every stream that lived ended well, both sides.
        for (k, pair) in s.pairs.iter().enumerate() {
            if pair.dead.is_none() {
                proptest::prop_assert!(matches!(pair.rep_done, Some(Ok(_))), "{k}: {:?}", pair.rep_done);
                proptest::prop_assert!(matches!(pair.src_done, Some(Ok(_))), "{k}: {:?}", pair.src_done);
            }
        }
    }
}

/// Two streams, one moving a quarter as often: the fast one takes most of
/// the pieces, where fixed shares would have given each half.
#[test]
fn a_fast_stream_takes_more_pieces() {
    let mut s = Session::new(64 * MIB, 2, HashMap::new());
    s.run(&[0, 0, 0, 0, 1], &[]);
    let took: Vec<u32> = s.pairs.iter().map(|p| p.took).collect();
    assert_eq!(took.iter().sum::<u32>(), 64);
    assert!(took[0] >= 2 * took[1], "{took:?}");
    for pair in &s.pairs {
        assert!(matches!(pair.rep_done, Some(Ok(_))), "{:?}", pair.rep_done);
    }
}
