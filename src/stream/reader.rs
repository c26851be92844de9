//! The one way to read a stream log, for every reader: a session served
//! over TCP or an RDMA ring (`serve`) and the feed to the local server
//! (`feed`). A reader stands at an offset under a replication id and asks
//! what follows ([`Stream::next`]): the log must still continue that id
//! there (a log started over by a full resync no longer does), then comes
//! an id change where the log's history has one, or the bytes the log
//! holds from there, as many as the reader says may go. A reader at or near
//! the log's end gets them from the newest bytes the log keeps in memory
//! (checked as they were appended), with no file read and no thread
//! hand-off; one further behind reads the file off the log's lock, each
//! record checked against its hash. A damaged one is never returned:
//! readers stop before it while it is fetched again from upstream alone
//! ([`super::mend`]); when not even its length can be read, the log is cut
//! back to it, so its writer fetches the stream again from there, and the
//! reader gets the error.

use tracing::{error, warn};

use super::log::{self, Log, LogError, ReadPlan};
use super::{SharedLog, Stream, WriterState};
use crate::blk3::stream::Next;
use crate::blk3::token::REPLID_LEN;

/// Under the log's lock: what a reader at `at` under `replid` reads next.
enum Plan {
    Wait,
    Epoch([u8; REPLID_LEN]),
    /// Bytes copied out of the log's newest ones in memory.
    Tail(Vec<u8>),
    /// Bytes to read from the file, off the lock.
    Read(ReadPlan, usize),
}

impl Stream {
    /// What follows `at` for a reader under `replid`: of the bytes the log
    /// holds past `at`, `due(held)` go (none: [`Next::Wait`]). From the
    /// log's memory at once, or from its files on the blocking pool.
    pub async fn next(
        self: &SharedLog,
        at: u64,
        replid: &str,
        due: &(dyn Fn(u64) -> u64 + Sync),
    ) -> Result<Next, LogError> {
        match self.plan(at, replid, due)? {
            Plan::Wait => Ok(Next::Wait),
            Plan::Epoch(id) => Ok(Next::Epoch(id)),
            Plan::Tail(run) => Ok(Next::Bytes(run)),
            Plan::Read(plan, n) => {
                let stream = self.clone();
                tokio::task::spawn_blocking(move || stream.read(&plan, at, n))
                    .await
                    .expect("log read task")
            }
        }
    }

    /// [`Stream::next`] on a thread that may block.
    pub fn next_blocking(
        &self,
        at: u64,
        replid: &str,
        due: &dyn Fn(u64) -> u64,
    ) -> Result<Next, LogError> {
        match self.plan(at, replid, due)? {
            Plan::Wait => Ok(Next::Wait),
            Plan::Epoch(id) => Ok(Next::Epoch(id)),
            Plan::Tail(run) => Ok(Next::Bytes(run)),
            Plan::Read(plan, n) => self.read(&plan, at, n),
        }
    }

    /// Bytes the log holds past `at`.
    pub fn held_past(&self, at: u64) -> u64 {
        held_past(&self.lock(), at)
    }

    fn plan(&self, at: u64, replid: &str, due: &dyn Fn(u64) -> u64) -> Result<Plan, LogError> {
        let log = self.lock();
        log.continues(replid, at)?;
        let now = log.replid_at(at).unwrap_or(replid);
        if now != replid {
            let id = now
                .as_bytes()
                .try_into()
                .expect("the log keeps 40-byte ids");
            return Ok(Plan::Epoch(id));
        }
        match due(held_past(&log, at)) as usize {
            0 => Ok(Plan::Wait),
            n => match log.read_tail(at, n) {
                Some(run) => {
                    self.gauges.read_from_memory.inc_by(run.len() as u64);
                    Ok(Plan::Tail(run))
                }
                None => Ok(Plan::Read(log.plan(at)?, n)),
            },
        }
    }

    /// The bytes of `plan` from `at`, at most `n`, each record checked;
    /// at a damaged record, those before it come on the next call.
    fn read(&self, plan: &ReadPlan, at: u64, n: usize) -> Result<Next, LogError> {
        let records = log::read(plan, n);
        if let Err(e @ LogError::Corrupt { offset, .. }) = &records {
            self.gauges.damaged.inc();
            match self.write(|l| l.mark_damaged(*offset)) {
                Ok(true) => {
                    warn!(error = %e, "a damaged record in the stream log: readers stop before offset {offset} while that record alone is fetched again from upstream");
                    self.damage_found.notify_one();
                    return Ok(Next::Wait);
                }
                Ok(false) => {}
                Err(why) => {
                    error!(error = %why, "the damaged record cannot be looked at: the log is cut back to it");
                }
            }
            self.cut_at_damage(*offset, e.to_string());
        }
        let mut run = log::contiguous(&records?, at);
        run.truncate(n);
        self.gauges.read_from_file.inc_by(run.len() as u64);
        Ok(match run.is_empty() {
            true => Next::Wait,
            false => Next::Bytes(run),
        })
    }

    /// Cuts the log back to the damaged record at `offset` (`why`), so
    /// its writer fetches the stream again from there: what the damage
    /// costs when the record cannot be mended alone.
    pub fn cut_at_damage(&self, offset: u64, why: String) {
        error!(error = %why, "a damaged record in the stream log: the log is cut back to offset {offset} and fetched again from upstream (a full resync when nothing upstream holds it)");
        self.gauges.cut.inc();
        self.set_state(WriterState::Refetching {
            offset,
            reason: why,
        });
        if let Err(cut) = self.write(|l| l.cut(offset)) {
            error!(error = %cut, "the stream log cannot be cut back to its damage");
        }
    }
}

/// Bytes a reader at `at` can read from `log`: to its end, or to the
/// next damaged record.
fn held_past(log: &Log, at: u64) -> u64 {
    let end = log.position().map_or(0, |(_, end)| end);
    end.saturating_sub(at).min(log.readable_from(at))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StreamConfig;
    use crate::metrics::Metrics;
    use crate::stream::log::Log;

    const A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

    /// A stream of id A over 100..110, then of B over 110..115.
    fn stream(dir: &std::path::Path) -> SharedLog {
        let mut log = Log::open(StreamConfig {
            dir: dir.to_path_buf(),
            ..StreamConfig::default()
        })
        .unwrap();
        log.restart(A, 100).unwrap();
        log.append(100, b"0123456789").unwrap();
        log.switch(B).unwrap();
        log.append(110, b"abcde").unwrap();
        Stream::new(
            log,
            super::super::source::Source::Primary("test".into()),
            &Metrics::new(),
            "reader-test",
        )
    }

    #[test]
    fn a_reader_gets_what_is_due_then_the_id_change_then_waits() {
        let dir = tempfile::tempdir().unwrap();
        let s = stream(dir.path());
        let all = |held: u64| held;
        assert_eq!(s.held_past(103), 12);
        assert_eq!(
            s.next_blocking(103, A, &|held| held.min(4)).unwrap(),
            Next::Bytes(b"3456".to_vec()),
            "as many bytes as are due, from inside a record"
        );
        assert_eq!(s.next_blocking(103, A, &|_| 0).unwrap(), Next::Wait);
        assert_eq!(
            s.next_blocking(103, A, &all).unwrap(),
            Next::Bytes(b"3456789".to_vec()),
            "never past the id's span"
        );
        assert_eq!(
            s.next_blocking(110, A, &all).unwrap(),
            Next::Epoch(B.as_bytes().try_into().unwrap())
        );
        assert_eq!(
            s.next_blocking(111, B, &all).unwrap(),
            Next::Bytes(b"bcde".to_vec())
        );
        assert_eq!(s.next_blocking(115, B, &all).unwrap(), Next::Wait);
    }

    #[test]
    fn a_reader_on_a_history_the_log_does_not_hold_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let s = stream(dir.path());
        let other = "cccccccccccccccccccccccccccccccccccccccc";
        for (at, id) in [(105, other), (112, A), (99, A)] {
            assert!(
                matches!(
                    s.next_blocking(at, id, &|held| held),
                    Err(LogError::NotHeld { .. })
                ),
                "{id} at {at}"
            );
        }
    }
}
