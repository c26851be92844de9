//! Drives a [`RingSender`] and a [`RingReceiver`] against each other over
//! a virtual RC wire: the source's Writes and Sends reach the replica in
//! the order they were posted (a Write lands in the ring's memory, a Send
//! needs a posted receive or it is an RNR error), answers come back the
//! same way, and proptest picks who acts next and where the connection
//! breaks. Each break starts a new session where the replica's log ends.

use std::collections::VecDeque;

use proptest::prelude::*;

use super::*;

const KEY: [u8; STREAM_KEY_LEN] = [3; STREAM_KEY_LEN];
const SIZE: u64 = MIN_RING;

/// What the source posted, in order.
enum Op {
    Write { to: u64, bytes: Vec<u8>, end: u64 },
    Send(Token),
}

/// The whole stream, with the replication id changes in it.
struct Stream {
    bytes: Vec<u8>,
    /// (offset, id), ascending; the first at offset 0.
    epochs: Vec<(u64, [u8; REPLID_LEN])>,
}

impl Stream {
    fn id_at(&self, offset: u64) -> [u8; REPLID_LEN] {
        self.epochs
            .iter()
            .rev()
            .find(|(at, _)| *at <= offset)
            .expect("an id from 0")
            .1
    }
}

struct Session {
    tx: RingSender,
    rx: RingReceiver,
    /// The source's idea of the replica's id where it stands.
    tx_id: [u8; REPLID_LEN],
    to_replica: VecDeque<Op>,
    to_source: VecDeque<Token>,
    /// Completions the replica has not processed, and receives it has posted.
    replica_cq: VecDeque<Token>,
    replica_posted: u32,
    source_cq: VecDeque<Token>,
    source_posted: u32,
    ring: Vec<u8>,
}

/// The replica's log: what it took, and the ids it switched to.
struct Log {
    bytes: Vec<u8>,
    id: [u8; REPLID_LEN],
    /// What the replica acknowledged last in this session.
    acked: u64,
    applied: u64,
}

impl Session {
    fn new(log: &Log, window: u64) -> Session {
        let from = log.bytes.len() as u64;
        let rx = RingReceiver::new(KEY, from, window, SIZE).unwrap();
        let mut ring = vec![0u8; rx.ring_len() as usize];
        ring[..PRODUCER_LEN].copy_from_slice(&rx.initial_header());
        let tx = RingSender::new(KEY, from, window, rx.ring_len()).unwrap();
        Session {
            tx,
            rx,
            tx_id: log.id,
            to_replica: VecDeque::new(),
            to_source: VecDeque::new(),
            replica_cq: VecDeque::new(),
            replica_posted: CREDITS,
            source_cq: VecDeque::new(),
            source_posted: CREDITS,
            ring,
        }
    }

    /// The source sends what it may: an id change, a span, or a poll.
    fn source_sends(&mut self, s: &Stream, available: u64) {
        let at = self.tx.sent();
        let id = s.id_at(at);
        if id != self.tx_id {
            if let Some(t) = self.tx.epoch(&id) {
                self.tx_id = id;
                self.to_replica.push_back(Op::Send(t));
            }
            return;
        }
        // A span never crosses an id change.
        let until = s
            .epochs
            .iter()
            .map(|(o, _)| *o)
            .find(|o| *o > at)
            .unwrap_or(u64::MAX)
            .min(available);
        let bytes = &s.bytes[at as usize..until as usize];
        if let Some(p) = self.tx.publish(bytes) {
            let end = self.tx.sent();
            for w in &p.writes {
                self.to_replica.push_back(Op::Write {
                    to: w.to,
                    bytes: bytes[w.from..w.from + w.len].to_vec(),
                    end,
                });
            }
            self.to_replica.push_back(Op::Write {
                to: 0,
                bytes: p.header.to_vec(),
                end,
            });
            self.to_replica.push_back(Op::Send(p.token));
        } else if let Some(t) = self.tx.poll() {
            self.to_replica.push_back(Op::Send(t));
        }
    }

    /// The next of the source's operations lands at the replica.
    fn deliver_to_replica(&mut self, log: &Log) {
        match self.to_replica.pop_front() {
            Some(Op::Write { to, bytes, end }) => {
                if to >= HEADER_LEN {
                    // Never over a byte the replica has not made its own.
                    assert!(
                        end <= log.acked + SIZE,
                        "a write up to {end} overwrites bytes the replica acknowledged only to {}",
                        log.acked
                    );
                }
                self.ring[to as usize..to as usize + bytes.len()].copy_from_slice(&bytes);
            }
            Some(Op::Send(t)) => {
                assert!(self.replica_posted > 0, "RNR: {t:?} found no receive");
                self.replica_posted -= 1;
                self.replica_cq.push_back(t);
            }
            None => {}
        }
    }

    /// The replica takes one completion: posts its receive again, checks,
    /// copies out, logs.
    fn replica_takes(&mut self, log: &mut Log) {
        let Some(t) = self.replica_cq.pop_front() else {
            return;
        };
        self.replica_posted += 1;
        match t {
            Token::Strm { offset, len, mac } => {
                let header = Header::read(self.ring[..PRODUCER_LEN].try_into().unwrap());
                let spans = self.rx.on_span(offset, len, &header).unwrap();
                let mut copy = Vec::with_capacity(len as usize);
                for w in spans {
                    copy.extend_from_slice(&self.ring[w.to as usize..w.to as usize + w.len]);
                }
                self.rx.accept(offset, &copy, &mac).unwrap();
                log.bytes.extend_from_slice(&copy);
            }
            Token::Sepo {
                offset,
                replid,
                mac,
            } => {
                self.rx.epoch(offset, &replid, &mac).unwrap();
                log.id = replid;
            }
            other => panic!("the replica got {other:?}"),
        }
    }

    /// The replica answers what it owes.
    fn replica_answers(&mut self, log: &mut Log, tick: bool) {
        while let Some(t) = self.rx.answer(Some(log.applied), tick) {
            let Token::Rack { acked, .. } = t else {
                unreachable!()
            };
            log.acked = acked;
            self.to_source.push_back(t);
        }
    }

    fn deliver_to_source(&mut self) {
        if let Some(t) = self.to_source.pop_front() {
            assert!(self.source_posted > 0, "RNR: {t:?} found no receive");
            self.source_posted -= 1;
            self.source_cq.push_back(t);
        }
    }

    fn source_takes(&mut self) {
        if let Some(Token::Rack { acked, applied }) = self.source_cq.pop_front() {
            self.source_posted += 1;
            self.tx.on_answer(acked, applied).unwrap();
        }
    }
}

fn stream_of(len: usize, epochs: &[usize]) -> Stream {
    let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
    let mut at: Vec<u64> = epochs.iter().map(|e| (*e % len) as u64).collect();
    at.sort();
    at.dedup();
    let mut list = vec![(0, [b'a'; REPLID_LEN])];
    for (i, o) in at.into_iter().filter(|o| *o > 0).enumerate() {
        list.push((o, [b'b' + i as u8; REPLID_LEN]));
    }
    Stream {
        bytes,
        epochs: list,
    }
}

/// Runs `steps` (each a choice of who acts), breaking the connection where
/// `breaks` says, then runs without breaks until everything arrived.
fn run(s: &Stream, window: u64, steps: &[u8], produce: &[u32]) -> Log {
    let mut log = Log {
        bytes: Vec::new(),
        id: s.epochs[0].1,
        acked: 0,
        applied: 0,
    };
    let mut session = Session::new(&log, window);
    let mut available = 0u64;
    let mut produce = produce.iter().cycle();
    let total = s.bytes.len() as u64;
    let mut step = |session: &mut Session, log: &mut Log, available: &mut u64, choice: u8| {
        match choice % 9 {
            0 => *available = (*available + *produce.next().unwrap() as u64).min(total),
            1 => session.source_sends(s, *available),
            2 | 3 => session.deliver_to_replica(log),
            4 => session.replica_takes(log),
            5 => session.replica_answers(log, false),
            6 => session.deliver_to_source(),
            7 => session.source_takes(),
            _ => {
                // The downstream server applies what the log holds.
                log.applied = log.acked;
                session.replica_answers(log, true);
            }
        }
    };
    for &c in steps {
        if c == u8::MAX {
            // The connection breaks: what is in flight is gone; the next
            // session asks from the log's end.
            log.acked = log.bytes.len() as u64;
            session = Session::new(&log, window);
            continue;
        }
        step(&mut session, &mut log, &mut available, c);
    }
    available = total;
    let mut rounds = 0;
    while (log.bytes.len() as u64) < total || !session.to_replica.is_empty() {
        for c in 0..9 {
            step(&mut session, &mut log, &mut available, c);
        }
        rounds += 1;
        assert!(rounds < 1_000_000, "the stream stopped flowing");
    }
    log
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn the_replica_logs_the_stream_exactly_whatever_the_order_and_breaks(
        len in 1usize..(3 * SIZE as usize),
        epochs in prop::collection::vec(0usize..1 << 22, 0..4),
        window in prop::sample::select(vec![64u64 << 10, 1 << 20, 4 << 20]),
        steps in prop::collection::vec(prop_oneof![40 => 0u8..9, 1 => Just(u8::MAX)], 0..400),
        produce in prop::collection::vec(1u32..(600 << 10), 1..8),
    ) {
        let s = stream_of(len, &epochs);
        let log = run(&s, window, &steps, &produce);
        prop_assert!(log.bytes == s.bytes, "the log differs from the stream");
        prop_assert_eq!(log.id, s.id_at(len as u64));
    }
}

#[test]
fn a_span_that_wraps_is_written_in_two_and_read_back_whole() {
    assert_eq!(
        place(SIZE, SIZE - 10, 30),
        [
            RingWrite {
                from: 0,
                to: HEADER_LEN + SIZE - 10,
                len: 10
            },
            RingWrite {
                from: 10,
                to: HEADER_LEN,
                len: 20
            }
        ]
    );
    assert_eq!(place(SIZE, 3 * SIZE + 5, 7).len(), 1);
    assert_eq!(place(SIZE, SIZE - 7, 7).len(), 1, "ends at the ring's end");
}

#[test]
fn a_ring_that_is_no_power_of_two_or_out_of_bounds_is_refused() {
    for len in [
        0,
        HEADER_LEN,
        HEADER_LEN + SIZE + 1,
        HEADER_LEN + SIZE / 2,
        HEADER_LEN + 2 * MAX_RING,
    ] {
        assert!(
            matches!(
                RingSender::new(KEY, 0, 1 << 20, len),
                Err(RingError::BadRing(_))
            ),
            "{len}"
        );
    }
    assert!(RingSender::new(KEY, 0, 1 << 20, HEADER_LEN + 2 * SIZE).is_ok());
}

#[test]
fn a_header_with_a_wrong_magic_or_a_sequence_that_goes_back_is_refused() {
    let mut tx = RingSender::new(KEY, 100, 1 << 20, HEADER_LEN + SIZE).unwrap();
    let bytes = [9u8; 50];
    let p = tx.publish(&bytes).unwrap();
    let Token::Strm { offset, len, mac } = p.token else {
        unreachable!()
    };
    let good = Header::read(&p.header);
    let lie = |f: &dyn Fn(&mut Header)| {
        let mut h = good;
        f(&mut h);
        let mut rx = RingReceiver::new(KEY, 100, 1 << 20, SIZE).unwrap();
        rx.on_span(offset, len, &h)
    };
    assert_eq!(lie(&|h| h.magic = *b"NOTARING"), Err(RingError::BadMagic));
    assert_eq!(
        lie(&|h| h.write_seq = 99),
        Err(RingError::SequenceBack { was: 100, now: 99 })
    );
    assert!(
        matches!(
            lie(&|h| h.write_seq = 149),
            Err(RingError::BadHeader { .. })
        ),
        "before the span's end"
    );
    assert!(matches!(
        lie(&|h| h.head = 0),
        Err(RingError::BadHeader { .. })
    ));
    assert!(matches!(
        lie(&|h| h.size = 2 * SIZE),
        Err(RingError::BadHeader { .. })
    ));
    let mut rx = RingReceiver::new(KEY, 100, 1 << 20, SIZE).unwrap();
    let spans = rx.on_span(offset, len, &good).unwrap();
    assert_eq!(spans.len(), 1);
    // Bytes changed in the ring after the header was written fail the MAC
    // on the replica's copy.
    let mut copy = bytes.to_vec();
    copy[7] ^= 1;
    assert_eq!(
        rx.accept(offset, &copy, &mac),
        Err(RingError::Stream(StreamError::Forged { offset: 100 }))
    );
}

#[test]
fn credits_bound_both_sides_and_a_stray_answer_is_refused() {
    let mut tx = RingSender::new(KEY, 0, 64 << 20, HEADER_LEN + 64 * SIZE).unwrap();
    assert_eq!(tx.on_answer(0, 0), Err(RingError::Unasked));
    let bytes = [1u8; 64];
    let mut sent = 0;
    while tx.publish(&bytes[..1]).is_some() {
        sent += 1;
    }
    assert_eq!(sent, CREDITS - 1, "one receive is left for RDFL");
    assert!(
        tx.poll().is_none(),
        "a poll goes only when nothing is unanswered"
    );
    // A source that ignores its credits is refused by the replica.
    let mut rx = RingReceiver::new(KEY, 0, 64 << 20, SIZE).unwrap();
    let mut stray = RingSender::new(KEY, 0, 64 << 20, HEADER_LEN + SIZE).unwrap();
    let mut refused = None;
    for _ in 0..CREDITS {
        let p = stray.publish(&bytes[..1]).unwrap_or_else(|| {
            stray.unanswered -= 1;
            stray.publish(&bytes[..1]).unwrap()
        });
        let Token::Strm { offset, len, mac } = p.token else {
            unreachable!()
        };
        match rx.on_span(offset, len, &Header::read(&p.header)) {
            Ok(_) => rx.accept(offset, &bytes[..1], &mac).unwrap(),
            Err(e) => {
                refused = Some(e);
                break;
            }
        }
    }
    assert_eq!(refused, Some(RingError::NoCredit));
}

#[test]
fn a_poll_is_answered_when_the_servers_applied_more_or_on_the_tick() {
    let mut tx = RingSender::new(KEY, 0, 1 << 20, HEADER_LEN + SIZE).unwrap();
    let mut rx = RingReceiver::new(KEY, 0, 1 << 20, SIZE).unwrap();
    let header = Header::read(&rx.initial_header());
    let poll = |tx: &mut RingSender, rx: &mut RingReceiver| {
        let Some(Token::Strm { offset, len, mac }) = tx.poll() else {
            panic!("a poll when nothing is unanswered")
        };
        assert!(rx.on_span(offset, len, &header).unwrap().is_empty());
        rx.accept(offset, &[], &mac).unwrap();
    };
    poll(&mut tx, &mut rx);
    let none = Token::Rack {
        acked: 0,
        applied: NONE_APPLIED,
    };
    assert_eq!(rx.answer(None, false), Some(none), "the first answer");
    assert_eq!(tx.on_answer(0, NONE_APPLIED), Ok(None), "no server reports");
    poll(&mut tx, &mut rx);
    assert_eq!(rx.answer(None, false), None, "held: nothing new");
    let zero = Token::Rack {
        acked: 0,
        applied: 0,
    };
    assert_eq!(
        rx.answer(Some(0), false),
        Some(zero.clone()),
        "a server reports"
    );
    assert_eq!(tx.on_answer(0, 0), Ok(Some(0)));
    poll(&mut tx, &mut rx);
    assert_eq!(rx.answer(Some(0), false), None, "held: nothing new");
    assert_eq!(rx.answer(Some(0), true), Some(zero), "the tick");
    assert_eq!(rx.answer(Some(0), true), None, "one answer per message");
}
