//! The replica's receiving end of one data session, for every transport.
//!
//! [`Receiver`] is the [`Sink`] the TCP and RDMA drivers feed: it owns the
//! staging file, the streaming checksum, the first local failure (a full
//! disk, a write error, corrupt bytes) and the verified snapshot's info, and
//! at the end makes the one install decision ([`Receiver::finish`]): a
//! verified staging file, or the job error that says why not. Dropping it
//! before install removes the temp file.

use std::fs::File;

use crate::blk3::{Blk3Error, Outcome};
use crate::install::{InstallError, Staging};
use crate::snapshot::SnapshotInfo;
use crate::transport::session::SessionResult;
use crate::transport::Sink;

use super::error::JobError;

/// A verified snapshot in its staging file, ready to install.
pub struct Received {
    pub staging: Staging,
    pub outcome: Outcome,
    pub info: SnapshotInfo,
}

/// Takes a session's bytes into a staging file and decides what they are.
pub struct Receiver {
    staging: Staging,
    /// Bytes handed over by the transport (also after a local failure).
    received: u64,
    progress: Box<dyn Fn(u64) + Send + Sync>,
    failure: Option<InstallError>,
    info: Option<SnapshotInfo>,
}

impl Receiver {
    /// Receives into `staging`, reporting the bytes received to `progress`.
    pub fn new(staging: Staging, progress: impl Fn(u64) + Send + Sync + 'static) -> Receiver {
        Receiver {
            staging,
            received: 0,
            progress: Box::new(progress),
            failure: None,
            info: None,
        }
    }

    /// Bytes written to the staging file.
    pub fn written(&self) -> u64 {
        self.staging.written()
    }

    /// Keeps the first local failure and returns its text for the peer.
    fn fail(&mut self, e: InstallError) -> String {
        let reason = e.to_string();
        self.failure.get_or_insert(e);
        reason
    }

    fn landed(
        &mut self,
        bytes: &[u8],
        stage: impl FnOnce(&mut Staging, &[u8]) -> Result<(), InstallError>,
    ) {
        self.received += bytes.len() as u64;
        if self.failure.is_none() {
            if let Err(e) = stage(&mut self.staging, bytes) {
                self.fail(e);
            }
        }
        (self.progress)(self.received);
    }

    /// The install decision for a session that ended with `result`.
    pub fn finish(self, result: SessionResult) -> Result<Received, JobError> {
        let verdict = match result {
            Err(e) if e.is_cancelled() => return Err(JobError::Cancelled),
            Err(e) => return Err(JobError::Transport(e)),
            Ok(v) => v,
        };
        match (verdict, self.failure) {
            (Ok(outcome), None) => Ok(Received {
                outcome,
                info: self.info.expect("a verified session has its snapshot info"),
                staging: self.staging,
            }),
            // The bytes were bad: the source or the wire is to blame.
            (Err(Blk3Error::Checksum(reason)), Some(InstallError::Corrupt(_)) | None) => {
                Err(JobError::Checksum(reason))
            }
            // This host could not take them (disk full, I/O error).
            (_, Some(local)) => Err(JobError::Install(local)),
            (Err(e), None) => Err(JobError::Protocol(e)),
        }
    }
}

impl Sink for Receiver {
    fn prepare(&mut self, len: u64) -> Result<(), String> {
        self.staging.prepare(len).map_err(|e| self.fail(e))
    }

    fn write(&mut self, bytes: &[u8]) {
        self.landed(bytes, Staging::write);
    }

    fn file(&self) -> &File {
        self.staging.file()
    }

    fn absorb(&mut self, bytes: &[u8]) {
        self.landed(bytes, Staging::absorb);
    }

    fn verify(&mut self) -> Result<(), String> {
        if let Some(e) = &self.failure {
            return Err(e.to_string());
        }
        match self.staging.verify() {
            Ok(info) => {
                self.info = Some(info);
                Ok(())
            }
            Err(e) => Err(self.fail(e)),
        }
    }
}
