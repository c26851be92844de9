//! The replication stream: the incremental half of replication, after a
//! snapshot's M. An agent follows its primary ([`follow`]) or another
//! agent ([`pull`]) into a checksummed log on disk ([`log`]) and serves
//! that log on to other agents ([`serve`]) and to its local server as its
//! master ([`feed`]). [`Stream`] is one instance's
//! log as its writer and its readers share it.

pub mod feed;
pub mod follow;
pub mod log;
pub mod pull;
pub mod serve;

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

use self::log::Log;

/// One instance's stream log, shared by the task that writes it and the
/// sessions that read it, with what the writer last reported.
pub struct Stream {
    log: Mutex<Log>,
    /// Bumped after every write: readers wait on it for more stream.
    changed: watch::Sender<u64>,
    /// Where the stream comes from: `primary <addr>` or `agent <addr>`.
    pub source: String,
    /// The writer's state, for status (`following`, or why not).
    state: Mutex<String>,
}

/// A stream log shared by its writer and its readers.
pub type SharedLog = Arc<Stream>;

impl Stream {
    pub fn new(log: Log, source: String) -> SharedLog {
        Arc::new(Stream {
            log: Mutex::new(log),
            changed: watch::Sender::new(0),
            source,
            state: Mutex::new("starting".into()),
        })
    }

    /// The log, to read (a writer goes through [`Stream::write`]).
    pub fn lock(&self) -> MutexGuard<'_, Log> {
        self.log.lock().expect("stream log lock")
    }

    /// Changes the log and wakes its readers.
    pub fn write<T>(&self, f: impl FnOnce(&mut Log) -> T) -> T {
        let out = f(&mut self.lock());
        self.changed.send_modify(|n| *n += 1);
        out
    }

    /// Wakes after the next write.
    pub fn watch(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// The oldest offset a snapshot of `offered` (replication id, M)
    /// continues from, which the log's retention keeps (`u64::MAX`: none
    /// continues into the log).
    pub fn floor(&self, offered: &[(String, u64)]) -> u64 {
        let log = self.lock();
        offered
            .iter()
            .filter(|(id, m)| log.covers(id, *m).is_ok())
            .map(|(_, m)| *m)
            .min()
            .unwrap_or(u64::MAX)
    }

    pub fn set_state(&self, state: impl Into<String>) {
        *self.state.lock().expect("stream state lock") = state.into();
    }

    pub fn state(&self) -> String {
        self.state.lock().expect("stream state lock").clone()
    }
}
