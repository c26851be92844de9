//! One session over several TCP connections at once.
//!
//! Owns running a replica's session on the streams its offer granted: the
//! missing pieces are split into one share per stream
//! ([`Receiver::shares`]), each stream runs its own BLK3 session for its
//! share into the one [`Receiver`] (through a [`Share`]), the first stream
//! that fails stops the others, and the session has one verdict: the first
//! real failure, or success once every stream succeeded and the whole
//! snapshot verifies.

use std::sync::Mutex;

use crate::blk3::token::SESSION_TOKEN_LEN;
use crate::blk3::Blk3Error;
use crate::config::MAX_TCP_STREAMS;
use crate::transport::session::{Canceller, DataLink, SessionResult};
use crate::transport::{Faults, TransportKind};

use super::receive::{Receiver, Share};

/// The streams a session over `transport` runs on when `asked` for (0:
/// a peer that does not know streams) from a source whose own `[data]
/// tcp_streams` is `most`: TCP at most that, RDMA one.
pub fn granted(transport: TransportKind, asked: u32, most: u32) -> u32 {
    match transport {
        TransportKind::Tcp => asked.clamp(1, most.clamp(1, MAX_TCP_STREAMS)),
        TransportKind::Rdma => 1,
    }
}

/// Runs the session proved by `token` over `links` (two or more) into
/// `receiver`; returns its verdict and the receiver for the install decision.
pub fn run(
    links: Vec<DataLink>,
    token: [u8; SESSION_TOKEN_LEN],
    offered_len: u64,
    receiver: Receiver,
    faults: &Faults,
) -> (SessionResult, Receiver) {
    let shares = receiver.shares(links.len() as u32);
    let cancellers: Vec<Canceller> = links.iter().map(DataLink::canceller).collect();
    let shared = Mutex::new(receiver);
    let results: Vec<SessionResult> = std::thread::scope(|scope| {
        let streams: Vec<_> = links
            .into_iter()
            .zip(shares)
            .map(|(link, need)| {
                let (shared, cancellers) = (&shared, &cancellers);
                scope.spawn(move || {
                    let result = match Share::new(shared, need) {
                        Ok(mut share) => link.run(token, offered_len, &mut share, faults).0,
                        Err(e) => Ok(Err(Blk3Error::CannotReceive(format!(
                            "open the staging file for a stream: {e}"
                        )))),
                    };
                    if !matches!(result, Ok(Ok(_))) {
                        cancellers.iter().for_each(Canceller::cancel);
                    }
                    result
                })
            })
            .collect();
        streams
            .into_iter()
            .map(|s| s.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let mut receiver = shared
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let result = match verdict(results) {
        Ok(Ok(outcome)) => match crate::transport::Sink::verify(&mut receiver) {
            Ok(()) => Ok(Ok(outcome)),
            Err(reason) => Ok(Err(Blk3Error::Checksum(reason.to_string()))),
        },
        failed => failed,
    };
    (result, receiver)
}

/// The session's verdict from its streams': the first real failure (a
/// stream stopped because another failed is not one), else a cancellation,
/// else success.
fn verdict(results: Vec<SessionResult>) -> SessionResult {
    let mut cancelled = None;
    let mut ok = None;
    for result in results {
        match result {
            Ok(Ok(outcome)) => {
                ok.get_or_insert(outcome);
            }
            Err(e) if e.is_cancelled() => {
                cancelled.get_or_insert(e);
            }
            failed => return failed,
        }
    }
    match (cancelled, ok) {
        (Some(e), _) => Err(e),
        (None, Some(outcome)) => Ok(Ok(outcome)),
        (None, None) => unreachable!("a session runs on at least one stream"),
    }
}
