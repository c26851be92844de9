//! One session over several TCP connections at once.
//!
//! Owns running a replica's session on the streams its offer granted: each
//! stream runs its own BLK3 session into the one [`Receiver`] (through a
//! [`Share`] of it), taking its pieces a batch at a time from the session's
//! queue as it runs low, so fast streams take more; a stream that fails
//! hands its unverified pieces back and the others fetch them. The session
//! has one verdict: success once a stream saw every piece verified and the
//! whole snapshot verifies, else the first real failure (every stream
//! failed).

use crate::blk3::token::SESSION_TOKEN_LEN;
use crate::blk3::Blk3Error;
use crate::config::MAX_TCP_STREAMS;
use crate::transport::session::{DataLink, SessionResult};
use crate::transport::{Faults, TransportKind};

use super::receive::{Receiver, Share, Shared};

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
    let shared = Shared::new(receiver, links.len() as u32);
    let results: Vec<SessionResult> = std::thread::scope(|scope| {
        let streams: Vec<_> = links
            .into_iter()
            .map(|link| {
                let shared = &shared;
                scope.spawn(move || match Share::new(shared) {
                    Ok(mut share) => link.run(token, offered_len, &mut share, faults).0,
                    Err(e) => Ok(Err(Blk3Error::CannotReceive(format!(
                        "open the staging file for a stream: {e}"
                    )))),
                })
            })
            .collect();
        streams
            .into_iter()
            .map(|s| s.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let mut receiver = shared.into_inner();
    let result = match verdict(results) {
        Ok(Ok(outcome)) => match crate::transport::Sink::verify(&mut receiver) {
            Ok(()) => Ok(Ok(outcome)),
            Err(reason) => Ok(Err(Blk3Error::Checksum(reason.to_string()))),
        },
        failed => failed,
    };
    (result, receiver)
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
