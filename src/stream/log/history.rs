//! The stream log's history (`history.json`): the replication ids the
//! stream has carried and from which offset each ([`Epoch`]), the
//! generalisation of PSYNC2's second replication id. A replica that still
//! names an earlier id continues as long as its offset lies in that id's
//! span and is retained.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{io, LogError};
use crate::sys::fs::write_atomic;

/// The replication ids the history keeps, newest last.
const MAX_EPOCHS: usize = 64;
const HISTORY: &str = "history.json";

/// One replication id and the offset the stream carried it from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Epoch {
    pub replid: String,
    pub start: u64,
}

/// The epochs, oldest first, as saved in a log's directory.
#[derive(Debug, Default)]
pub(super) struct History(Vec<Epoch>);

impl History {
    /// The history saved in `dir` (none yet: empty).
    pub(super) fn load(dir: &Path) -> Result<History, LogError> {
        let path = dir.join(HISTORY);
        match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b)
                .map(History)
                .map_err(|e| LogError::Corrupt {
                    path: path.clone(),
                    offset: 0,
                    why: format!("unreadable history: {e}"),
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(History::default()),
            Err(e) => Err(io(&path)(e)),
        }
    }

    /// The history made again from the log's segments (their id and
    /// start, oldest first), saved in `dir`: each segment holds one id.
    pub(super) fn made_again<'a>(
        dir: &Path,
        segments: impl Iterator<Item = (&'a str, u64)>,
    ) -> Result<History, LogError> {
        let mut history = History::default();
        for (replid, start) in segments {
            if history.0.last().is_none_or(|e| e.replid != replid) {
                history.0.push(Epoch {
                    replid: replid.to_string(),
                    start,
                });
            }
        }
        history.save(dir)?;
        Ok(history)
    }

    fn save(&self, dir: &Path) -> Result<(), LogError> {
        let path = dir.join(HISTORY);
        let json = serde_json::to_vec(&self.0).expect("plain data");
        write_atomic(&path, &json, (".history", ".tmp"), 0o600).map_err(io(&path))
    }

    pub(super) fn epochs(&self) -> &[Epoch] {
        &self.0
    }

    /// Forgets every epoch (the log starts over).
    pub(super) fn clear(&mut self) {
        self.0.clear();
    }

    /// The stream is of `replid` from `start` on: a new epoch unless it
    /// already is, saved in `dir`.
    pub(super) fn begin(&mut self, dir: &Path, replid: &str, start: u64) -> Result<(), LogError> {
        if self.0.last().is_some_and(|e| e.replid == replid) {
            return Ok(());
        }
        self.0.push(Epoch {
            replid: replid.to_string(),
            start,
        });
        let drop = self.0.len().saturating_sub(MAX_EPOCHS);
        self.0.drain(..drop);
        self.save(dir)
    }

    /// The log was cut back to `at`: the epochs that began after it go.
    pub(super) fn cut(&mut self, dir: &Path, at: u64) -> Result<(), LogError> {
        let epochs = self.0.len();
        self.0.retain(|e| e.start <= at);
        match self.0.len() == epochs {
            true => Ok(()),
            false => self.save(dir),
        }
    }

    /// The replication id the stream is of at `offset`: the newest epoch
    /// that started at or before it (a change of id at `o` holds from `o`).
    pub(super) fn replid_at(&self, offset: u64) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|e| e.start <= offset)
            .map(|e| e.replid.as_str())
    }

    /// Where `replid`'s epoch ended because a later id took over there.
    pub(super) fn superseded_at(&self, replid: &str) -> Option<u64> {
        let i = self.0.iter().rposition(|e| e.replid == replid)?;
        self.0.get(i + 1).map(|next| next.start)
    }

    /// Whether `replid`'s span holds `offset`, the stream ending at `end`.
    pub(super) fn holds(&self, replid: &str, offset: u64, end: u64) -> bool {
        self.0.iter().enumerate().any(|(i, e)| {
            let until = self.0.get(i + 1).map_or(end, |n| n.start);
            e.replid == replid && e.start <= offset && offset <= until
        })
    }
}
