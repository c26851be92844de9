//! Mending a damaged record of the log from upstream. A reader that finds
//! a record whose bytes no longer match their hash stops before it
//! ([`super::log::Damaged`]); this task, beside the log's writer, fetches
//! that record's bytes alone once more — from the primary's backlog
//! ([`follow::fetch_again`], asked only when the primary's `INFO` says the
//! backlog holds them, so never a fork) or from an upstream agent's log
//! ([`pull::fetch_again`]) — and writes them back in place once they match
//! the record's hash. The records and segments after it stay as they are.
//!
//! Only when nothing upstream holds the range any more, or after
//! [`TRIES`] failed tries, is the log cut back to the record, as a record
//! whose length cannot be read is: its writer then fetches the stream
//! again from there, a full resync of the primary when its backlog no
//! longer holds it, and the log says so.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::follow::{self, Follow, FollowError};
use super::log::LogError;
use super::pull::{self, Pull, PullError};
use super::{SharedLog, Stream};

/// Tries to fetch a record again before the log is cut back to it.
pub const TRIES: u32 = 5;
/// The longest one try may take, from asking to the record written back.
pub const FETCH_DEADLINE: Duration = Duration::from_secs(60);
/// The pause after a cut back to a damaged record failed.
const AFTER_FAILED_CUT: Duration = Duration::from_secs(5);

/// Whom the log's writer follows, and so where a damaged record is
/// fetched again.
pub enum Upstream {
    Primary(Follow),
    Agents(Arc<Pull>),
}

/// Why a damaged record was not mended.
#[derive(Debug, thiserror::Error)]
pub enum MendError {
    #[error(transparent)]
    Primary(#[from] FollowError),
    #[error(transparent)]
    Agent(#[from] PullError),
    /// The bytes fetched did not match the record's hash, or could not be
    /// written back.
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("no answer from upstream within {FETCH_DEADLINE:?}")]
    TimedOut,
    /// The log's history names no replication id at the record.
    #[error("the log's history holds no replication id at the record")]
    NoHistory,
}

impl MendError {
    /// Nothing upstream holds the range: trying again cannot mend it.
    fn not_held(&self) -> bool {
        match self {
            MendError::Primary(e) => matches!(e, FollowError::NotInBacklog { .. }),
            MendError::Agent(e) => e.not_held(),
            MendError::NoHistory => true,
            MendError::Log(_) | MendError::TimedOut => false,
        }
    }
}

/// What to do after a try to mend a record ended with `result`, the
/// `tries`-th.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    Mended,
    Again(Duration),
    Cut,
}

fn step(result: &Result<(), MendError>, tries: u32) -> Step {
    match result {
        Ok(()) => Step::Mended,
        Err(e) if e.not_held() || tries >= TRIES => Step::Cut,
        Err(_) => Step::Again(Duration::from_secs(1 << tries.min(4))),
    }
}

impl Stream {
    /// Writes `bytes`, the damaged record at `offset` fetched again, back
    /// in place (on a thread that may block), and counts it.
    fn mend(&self, offset: u64, bytes: &[u8]) -> Result<(), LogError> {
        if self.write(|l| l.mend(offset, bytes))? {
            self.gauges.mended.inc();
        }
        Ok(())
    }
}

/// Mends the log's damaged records from `upstream` until `stop`, oldest
/// first, as readers find them.
pub async fn run(upstream: Upstream, stream: SharedLog, stop: CancellationToken) {
    let mut tries = 0;
    loop {
        let next = stream.view(|l| {
            let d = l.damaged().first()?.clone();
            Some((l.replid_at(d.offset).map(str::to_string), d))
        });
        let Some((replid, damaged)) = next else {
            tokio::select! {
                _ = stop.cancelled() => return,
                () = stream.damage_found() => continue,
            }
        };
        let (offset, len) = (damaged.offset, damaged.len);
        let result = match replid {
            Some(replid) => tokio::select! {
                _ = stop.cancelled() => return,
                r = tokio::time::timeout(
                    FETCH_DEADLINE,
                    mend_one(&upstream, &stream, &replid, (offset, len)),
                ) => r.unwrap_or(Err(MendError::TimedOut)),
            },
            None => Err(MendError::NoHistory),
        };
        tries += 1;
        match step(&result, tries) {
            Step::Mended => {
                tries = 0;
                info!(offset, len, "the damaged record of the stream log is mended: fetched again from upstream and written back in place; the log goes on whole");
            }
            Step::Again(pause) => {
                let e = result.err().map(|e| e.to_string()).unwrap_or_default();
                warn!(offset, len, error = %e, "the damaged record of the stream log could not be fetched again; it is tried again in {pause:?}");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
            }
            Step::Cut => {
                tries = 0;
                let e = result.err().map(|e| e.to_string()).unwrap_or_default();
                stream.cut_at_damage(
                    offset,
                    format!("nothing upstream gives the damaged record of offsets {offset}..{} again ({e})", offset + len),
                );
                // A cut that failed (the disk) leaves the record to mend:
                // it is looked at again after a pause, never at once.
                if stream.view(|l| l.damaged().iter().any(|d| d.offset == offset)) {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(AFTER_FAILED_CUT) => {}
                    }
                }
            }
        }
    }
}

/// One try: the record's bytes from `upstream`, written back in place.
async fn mend_one(
    upstream: &Upstream,
    stream: &SharedLog,
    replid: &str,
    (offset, len): (u64, u64),
) -> Result<(), MendError> {
    let bytes = match upstream {
        Upstream::Primary(f) => follow::fetch_again(f, replid, offset, len).await?,
        Upstream::Agents(p) => pull::fetch_again(p, stream, (replid, offset), len).await?,
    };
    let s = stream.clone();
    tokio::task::spawn_blocking(move || s.mend(offset, &bytes))
        .await
        .expect("log mend task")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_tried_again_until_nothing_upstream_holds_it_or_the_tries_run_out() {
        let failed = || {
            MendError::Agent(PullError::Unreachable {
                upstream: "u:1".into(),
                message: "refused".into(),
            })
        };
        let not_held = || {
            MendError::Primary(FollowError::NotInBacklog {
                addr: "p:1".into(),
                why: "its backlog holds offsets 10..20".into(),
            })
        };
        assert_eq!(step(&Ok(()), 3), Step::Mended);
        assert_eq!(step(&Err(failed()), 1), Step::Again(Duration::from_secs(2)));
        assert_eq!(
            step(&Err(failed()), TRIES - 1),
            Step::Again(Duration::from_secs(16))
        );
        assert_eq!(step(&Err(failed()), TRIES), Step::Cut);
        assert_eq!(step(&Err(not_held()), 1), Step::Cut, "nothing to wait for");
    }
}
