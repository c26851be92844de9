//! Ring sessions between two threads over the emulated fabric (an
//! emulation of an RC queue pair: RNR, rkey and bounds checks, ordering
//! and flushes are enforced): the stream arrives whole across wraps and an
//! id change, a feed that grows wakes the source, a lying header ends the
//! session with nothing logged, and a cut connection loses nothing when
//! the next session starts where the log ends.

use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::*;
use crate::blk3::ring::{HEADER_LEN, MIN_RING};
use crate::blk3::stream::STREAM_KEY_LEN;
use crate::transport::emulated::{EmuFaults, EmuQp};

const KEY: [u8; STREAM_KEY_LEN] = [5; STREAM_KEY_LEN];
const TOKEN: [u8; SESSION_TOKEN_LEN] = [9; SESSION_TOKEN_LEN];
const T: Duration = Duration::from_secs(10);
const OLD: [u8; REPLID_LEN] = [b'a'; REPLID_LEN];
const NEW: [u8; REPLID_LEN] = [b'b'; REPLID_LEN];

/// The source's stream: bytes as they come, and one id change.
#[derive(Default)]
struct Shared {
    bytes: Vec<u8>,
    change_at: Option<u64>,
    applied: Vec<u64>,
}

struct Feed(Arc<Mutex<Shared>>);

impl RingFeed for Feed {
    type Error = std::convert::Infallible;

    fn next(
        &mut self,
        at: u64,
        replid: &[u8; REPLID_LEN],
        due: &dyn Fn(u64) -> u64,
    ) -> Result<Next, std::convert::Infallible> {
        let s = self.0.lock().unwrap();
        if s.change_at == Some(at) && *replid == OLD {
            return Ok(Next::Epoch(NEW));
        }
        let until = match s.change_at {
            Some(c) if c > at => c,
            _ => s.bytes.len() as u64,
        };
        let end = at + due(until.saturating_sub(at));
        Ok(match end > at {
            true => Next::Bytes(s.bytes[at as usize..end as usize].to_vec()),
            false => Next::Wait,
        })
    }

    fn applied(&mut self, offset: u64) {
        self.0.lock().unwrap().applied.push(offset);
    }

    fn window(&mut self, _due: &dyn Fn(u64) -> u64, _sent: u64) {}
}

#[derive(Default)]
struct Sink {
    bytes: Vec<u8>,
    epochs: Vec<(u64, [u8; REPLID_LEN])>,
    /// Stop (as cancelled) once this much is logged.
    stop_at: Option<(u64, CancellationToken)>,
}

impl RingSink for Sink {
    type Error = std::convert::Infallible;

    fn append(&mut self, offset: u64, bytes: Vec<u8>) -> Result<(), std::convert::Infallible> {
        assert_eq!(offset, self.bytes.len() as u64, "logged in order");
        self.bytes.extend_from_slice(&bytes);
        if let Some((at, cancel)) = &self.stop_at {
            if self.bytes.len() as u64 >= *at {
                cancel.cancel();
            }
        }
        Ok(())
    }

    fn epoch(
        &mut self,
        offset: u64,
        replid: &[u8; REPLID_LEN],
    ) -> Result<(), std::convert::Infallible> {
        self.epochs.push((offset, *replid));
        Ok(())
    }

    fn applied(&mut self) -> Option<u64> {
        Some(self.bytes.len() as u64)
    }

    fn tick(&mut self, _at: u64) -> Result<(), std::convert::Infallible> {
        Ok(())
    }
}

fn stream(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i % 251) as u8 ^ (i >> 12) as u8)
        .collect()
}

type SourceEnd = JoinHandle<(u64, Result<(), RingRunError<std::convert::Infallible>>)>;

/// A source on a thread, serving `shared` from `from`; its waker.
fn source(
    shared: &Arc<Mutex<Shared>>,
    from: u64,
    lie: Option<HeaderLie>,
    faults: EmuFaults,
) -> (
    std::net::SocketAddr,
    SourceEnd,
    std::sync::mpsc::Receiver<Waker>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (wakers, waker) = std::sync::mpsc::channel();
    let shared = shared.clone();
    let end = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        let mut qp = EmuQp::incoming(s, T, faults).unwrap();
        assert_eq!(qp.private_data(), TOKEN, "the token is the private data");
        let _ = wakers.send(qp.waker().unwrap());
        let s = RingSource {
            key: KEY,
            from,
            replid: OLD,
            window: 4 << 20,
            silent: T,
            cancel: CancellationToken::new(),
            lie,
            spin: Duration::MAX,
        };
        run_source(qp, s, &mut Feed(shared))
    });
    (addr, end, waker)
}

/// The replica stopped once it had everything: the source's session
/// ends on the link (as when a replica agent stops); where it stood.
fn replica_left(end: SourceEnd) -> u64 {
    let (at, served) = end.join().unwrap();
    let e = served.unwrap_err();
    assert!(
        ["disconnected", "completion_error"].contains(&e.reason()),
        "{e}"
    );
    at
}

fn replica(
    addr: std::net::SocketAddr,
    sink: &mut Sink,
    from: u64,
) -> Result<(), RingRunError<std::convert::Infallible>> {
    let qp = EmuQp::dial(addr, T, EmuFaults::default()).unwrap();
    let cancel = sink
        .stop_at
        .as_ref()
        .map(|(_, c)| c.clone())
        .unwrap_or_default();
    let r = RingReplica {
        key: KEY,
        from,
        window: 4 << 20,
        size: MIN_RING,
        token: TOKEN,
        silent: T,
        cancel,
        spin: Duration::MAX,
    };
    run_replica(qp, r, sink)
}

#[test]
fn the_stream_arrives_whole_across_wraps_and_an_id_change() {
    let len = 5 * MIN_RING as usize + 12_345;
    let want = stream(len);
    let shared = Arc::new(Mutex::new(Shared {
        bytes: want.clone(),
        change_at: Some(3 * MIN_RING + 7),
        ..Default::default()
    }));
    let (addr, end, _) = source(&shared, 0, None, EmuFaults::default());
    let mut sink = Sink {
        stop_at: Some((len as u64, CancellationToken::new())),
        ..Default::default()
    };
    replica(addr, &mut sink, 0).unwrap();
    assert_eq!(replica_left(end), len as u64);
    assert!(sink.bytes == want, "the log holds the stream");
    assert_eq!(sink.epochs, [(3 * MIN_RING + 7, NEW)]);
    let applied = shared.lock().unwrap().applied.clone();
    assert!(
        !applied.is_empty() && applied.windows(2).all(|w| w[0] <= w[1]),
        "{applied:?}"
    );
}

#[test]
fn a_feed_that_grows_wakes_the_source() {
    let shared = Arc::new(Mutex::new(Shared::default()));
    let (addr, end, waker) = source(&shared, 0, None, EmuFaults::default());
    let want = stream(300_000);
    let writer = {
        let (shared, want) = (shared.clone(), want.clone());
        std::thread::spawn(move || {
            let wake = waker.recv().unwrap();
            for chunk in want.chunks(10_000) {
                shared.lock().unwrap().bytes.extend_from_slice(chunk);
                wake();
            }
        })
    };
    let mut sink = Sink {
        stop_at: Some((want.len() as u64, CancellationToken::new())),
        ..Default::default()
    };
    replica(addr, &mut sink, 0).unwrap();
    writer.join().unwrap();
    replica_left(end);
    assert!(sink.bytes == want);
}

#[test]
fn a_waker_ends_a_wait_on_the_completion_queue() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let _peer = std::thread::spawn(move || listener.accept().unwrap());
    let mut qp = EmuQp::dial(addr, T, EmuFaults::default()).unwrap();
    let wake = qp.waker().unwrap();
    wake();
    let started = Instant::now();
    assert_eq!(qp.poll(Duration::from_secs(60)).unwrap(), None);
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "woken, not timed out"
    );
    assert_eq!(
        qp.poll(Duration::ZERO).unwrap(),
        None,
        "one wake, one return"
    );
}

#[test]
fn a_header_that_lies_ends_the_session_with_nothing_logged() {
    for (lie, want) in [
        (HeaderLie::Magic, "bad_header"),
        (HeaderLie::SequenceBack, "bad_header"),
    ] {
        let shared = Arc::new(Mutex::new(Shared {
            bytes: stream(1000),
            ..Default::default()
        }));
        let (addr, end, _) = source(&shared, 0, Some(lie), EmuFaults::default());
        let mut sink = Sink::default();
        let e = replica(addr, &mut sink, 0).unwrap_err();
        assert_eq!(e.reason(), want, "{lie:?}: {e}");
        assert!(sink.bytes.is_empty(), "{lie:?}: nothing is logged");
        let (_, served) = end.join().unwrap();
        let e = served.unwrap_err();
        assert!(
            matches!(e, RingRunError::Peer(_)),
            "the source hears why: {e}"
        );
    }
}

#[test]
fn a_cut_connection_loses_nothing_when_the_next_session_starts_at_the_log_end() {
    let len = 3 * MIN_RING as usize;
    let want = stream(len);
    let shared = Arc::new(Mutex::new(Shared {
        bytes: want.clone(),
        ..Default::default()
    }));
    let cut = EmuFaults {
        cut_after: Some(MIN_RING + 1000),
        ..Default::default()
    };
    let (addr, end, _) = source(&shared, 0, None, cut);
    let mut sink = Sink::default();
    let e = replica(addr, &mut sink, 0).unwrap_err();
    assert!(
        ["disconnected", "completion_error", "timeout"].contains(&e.reason()),
        "{e}"
    );
    assert!(end.join().unwrap().1.is_err(), "the source saw the cut too");
    let logged = sink.bytes.len() as u64;
    assert!(logged < len as u64, "the cut came before the end");
    assert!(
        sink.bytes[..] == want[..logged as usize],
        "what was logged is the stream"
    );
    let (addr, end, _) = source(&shared, logged, None, EmuFaults::default());
    sink.stop_at = Some((len as u64, CancellationToken::new()));
    replica(addr, &mut sink, logged).unwrap();
    replica_left(end);
    assert!(sink.bytes == want, "no gap, nothing twice");
}

#[test]
fn a_ring_the_source_cannot_take_is_refused_before_any_write() {
    assert!(matches!(
        RingSender::new(KEY, 0, 1 << 20, HEADER_LEN + 3),
        Err(RingError::BadRing(_))
    ));
}
