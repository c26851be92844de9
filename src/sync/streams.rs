//! One session over several TCP connections at once.
//!
//! Owns running a replica's session on the streams its offer granted: each
//! stream runs its own BLK3 session into the one [`Receiver`] (through a
//! [`Share`] of it), taking its pieces a batch at a time from the session's
//! queue as it runs low, so fast streams take more; a stream that fails
//! hands its unverified pieces back and the others fetch them. The session
//! has one verdict: success once a stream saw every piece verified and the
//! whole snapshot verifies, else the first real failure (every stream
//! failed). With `tcp_streams = "auto"` the session starts on one stream
//! and [`auto_count`] decides, after its first second, how many more to
//! dial with the same token.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::blk3::token::SESSION_TOKEN_LEN;
use crate::blk3::Blk3Error;
use crate::config::MAX_TCP_STREAMS;
use crate::transport::session::{Canceller, DataLink, DialSpec, SessionResult};
use crate::transport::TransportKind;

use super::receive::{Receiver, Share, Shared};

/// A round trip under this is a LAN's: one stream fills the link, whose
/// limits are the disks and CPUs.
pub const AUTO_LAN: Duration = Duration::from_millis(10);

/// `auto` runs one stream per this much round trip: one stream whose
/// window Linux's default largest receive buffer (6 MiB) bounds moves
/// about 1 Gbit/s at 25 ms, and each further 25 ms needs another stream
/// to keep that.
pub const AUTO_ROUND_TRIP_PER_STREAM: Duration = Duration::from_millis(25);

/// `auto` measures its first stream this long before it decides.
pub const AUTO_MEASURE: Duration = Duration::from_secs(1);

/// When the rest would arrive within this at the first second's rate,
/// more streams do not pay for their dial and slow start.
pub const AUTO_SOON: Duration = Duration::from_secs(2);

/// The streams `tcp_streams = "auto"` runs a session on, given the first
/// stream's TCP handshake (`round_trip`), what it received in its first
/// `elapsed`, the bytes still to come and the streams granted (`most`):
/// one on a LAN (round trip under [`AUTO_LAN`]) or when the rest arrives
/// within [`AUTO_SOON`] at that rate; else one per
/// [`AUTO_ROUND_TRIP_PER_STREAM`] of round trip, at most `most`.
pub fn auto_count(
    round_trip: Duration,
    received: u64,
    elapsed: Duration,
    left: u64,
    most: u32,
) -> u32 {
    if round_trip < AUTO_LAN || left == 0 {
        return 1;
    }
    let rate = received as f64 / elapsed.as_secs_f64().max(1e-3);
    if rate > 0.0 && (left as f64 / rate) < AUTO_SOON.as_secs_f64() {
        return 1;
    }
    let per = round_trip
        .as_micros()
        .div_ceil(AUTO_ROUND_TRIP_PER_STREAM.as_micros());
    (per.min(u32::MAX as u128) as u32).clamp(1, most.max(1))
}

/// How an `auto` session dials its further streams.
pub struct Grow {
    /// The source's data endpoint, as the first stream dialled it.
    pub spec: DialSpec,
    /// The streams the source granted.
    pub most: u32,
    /// The first stream's TCP handshake.
    pub round_trip: Duration,
}

/// Stops a session's links, those dialled later too.
#[derive(Clone, Default)]
pub struct Cancel(Arc<Mutex<(bool, Vec<Canceller>)>>);

impl Cancel {
    /// Stops `link` now if the session was cancelled, else when it is.
    pub fn add(&self, link: &DataLink) {
        let mut state = self.0.lock().expect("cancel lock");
        let canceller = link.canceller();
        if state.0 {
            canceller.cancel();
        }
        state.1.push(canceller);
    }

    /// The session was cancelled: dial no further link.
    pub fn cancelled(&self) -> bool {
        self.0.lock().expect("cancel lock").0
    }

    /// Stops every link added, and those added from now on.
    pub fn cancel(&self) {
        let mut state = self.0.lock().expect("cancel lock");
        state.0 = true;
        state.1.iter().for_each(Canceller::cancel);
    }
}

/// The streams a session over `transport` runs on when `asked` for (0:
/// a peer that does not know streams) from a source whose own `[data]
/// tcp_streams` is `most`: TCP at most that, RDMA one.
pub fn granted(transport: TransportKind, asked: u32, most: u32) -> u32 {
    match transport {
        TransportKind::Tcp => asked.clamp(1, most.clamp(1, MAX_TCP_STREAMS)),
        TransportKind::Rdma => 1,
    }
}

/// Runs the session proved by `token` over `links` (two or more, or one
/// that `grow` adds to) into `receiver`; returns its verdict, the receiver
/// for the install decision, and the streams it ran on.
pub fn run(
    links: Vec<DataLink>,
    grow: Option<Grow>,
    cancel: &Cancel,
    token: [u8; SESSION_TOKEN_LEN],
    offered_len: u64,
    receiver: Receiver,
) -> (SessionResult, Receiver, u32) {
    let planned = grow.as_ref().map_or(links.len() as u32, |g| g.most);
    let shared = Shared::new(receiver, planned);
    let stream = |link: DataLink| {
        let shared = &shared;
        move || match Share::new(shared) {
            Ok(mut share) => link.run(token, offered_len, &mut share).0,
            Err(e) => Ok(Err(Blk3Error::CannotReceive(format!(
                "open the staging file for a stream: {e}"
            )))),
        }
    };
    let started = Instant::now();
    let results: Vec<SessionResult> = std::thread::scope(|scope| {
        let mut streams: Vec<_> = links.into_iter().map(|l| scope.spawn(stream(l))).collect();
        let later = grow.map(|grow| {
            let (shared, stream) = (&shared, &stream);
            scope.spawn(move || {
                let (received, left) = shared.progress_by(started + AUTO_MEASURE);
                let n = auto_count(grow.round_trip, received, started.elapsed(), left, grow.most);
                info!(
                    round_trip_ms = grow.round_trip.as_millis() as u64,
                    first_second_bytes = received,
                    left_bytes = left,
                    streams = n,
                    "tcp_streams = auto"
                );
                let mut more = Vec::new();
                for _ in 1..n {
                    if cancel.cancelled() {
                        break;
                    }
                    match DataLink::dial(&grow.spec) {
                        Ok(link) => {
                            cancel.add(&link);
                            more.push(scope.spawn(stream(link)));
                        }
                        Err(e) => {
                            warn!(error = %e, "dial a further stream; the session goes on without it");
                            break;
                        }
                    }
                }
                more
            })
        });
        if let Some(later) = later {
            streams.extend(
                later
                    .join()
                    .unwrap_or_else(|p| std::panic::resume_unwind(p)),
            );
        }
        streams
            .into_iter()
            .map(|s| s.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let ran = results.len() as u32;
    let mut receiver = shared.into_inner();
    let result = match verdict(results) {
        Ok(Ok(outcome)) => match crate::transport::Sink::verify(&mut receiver) {
            Ok(()) => Ok(Ok(outcome)),
            Err(reason) => Ok(Err(Blk3Error::Checksum(reason.to_string()))),
        },
        failed => failed,
    };
    (result, receiver, ran)
}

/// The session's verdict from its streams': success when one succeeded
/// (it saw every piece verified), else the first real failure, else a
/// cancellation.
fn verdict(results: Vec<SessionResult>) -> SessionResult {
    let mut cancelled = None;
    let mut failed = None;
    for result in results {
        match result {
            Ok(Ok(outcome)) => return Ok(Ok(outcome)),
            Err(e) if e.is_cancelled() => {
                cancelled.get_or_insert(Err(e));
            }
            other => {
                failed.get_or_insert(other);
            }
        }
    }
    failed
        .or(cancelled)
        .expect("a session runs on at least one stream")
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const SECOND: Duration = Duration::from_secs(1);
    const MIB: u64 = 1 << 20;

    #[test]
    fn auto_runs_a_stream_per_25_ms_of_round_trip_up_to_the_grant() {
        let count = |rtt_ms: u32, most| auto_count(MS * rtt_ms, 8 * MIB, SECOND, 512 * MIB, most);
        assert_eq!(count(0, 8), 1, "loopback");
        assert_eq!(count(9, 8), 1, "a LAN");
        assert_eq!(count(10, 8), 1);
        assert_eq!(count(26, 8), 2);
        assert_eq!(count(100, 8), 4);
        assert_eq!(count(200, 8), 8);
        assert_eq!(count(200, 4), 4, "never more than granted");
        assert_eq!(count(1000, 8), 8);
    }

    #[test]
    fn auto_stays_on_one_stream_when_the_rest_arrives_soon() {
        let rtt = MS * 100;
        // 8 MiB in the first second: 15 MiB more is under 2 s.
        assert_eq!(auto_count(rtt, 8 * MIB, SECOND, 15 * MIB, 8), 1);
        assert_eq!(auto_count(rtt, 8 * MIB, SECOND, 16 * MIB, 8), 4);
        assert_eq!(auto_count(rtt, 8 * MIB, SECOND, 0, 8), 1, "all verified");
        // Nothing arrived yet (slow start on a long link): more streams.
        assert_eq!(auto_count(rtt, 0, SECOND, MIB, 8), 4);
    }
}
