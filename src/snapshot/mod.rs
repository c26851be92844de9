//! Snapshot formats: what a snapshot is, how its bytes are verified.
//!
//! Owns the [`Format`] enum, the [`SnapshotInfo`] a verification produces and
//! the streaming [`Verifier`] used everywhere a snapshot's bytes pass by: the
//! watcher and `kvsync verify` (reading a file), the source cache (after a
//! load) and the replica (while bytes arrive). Per-format parsing lives in the
//! submodules; this module only dispatches and attaches file names to errors.
//! [`manifest`] holds a snapshot's identity and per-piece checksums.

pub mod kvr1;
pub mod manifest;
pub mod rdb;

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::sys::buf::AlignedBuf;

/// Snapshot file formats kvsync understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// kvstore snapshot: header, records, CRC32 trailer.
    Kvr1,
    /// Redis/Valkey RDB with `repl-id`/`repl-offset` aux fields.
    RedisRdb,
}

impl Format {
    /// Stable lowercase name used in config, metrics labels and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Kvr1 => "kvr1",
            Format::RedisRdb => "redis-rdb",
        }
    }

    /// The file extension kvsync installs this format under.
    pub fn extension(self) -> &'static str {
        match self {
            Format::Kvr1 => "kvr1",
            Format::RedisRdb => "rdb",
        }
    }

    /// Guesses the format from the first bytes of a file.
    pub fn detect(prefix: &[u8]) -> Option<Format> {
        if prefix.starts_with(kvr1::MAGIC) {
            Some(Format::Kvr1)
        } else if prefix.starts_with(b"REDIS") || prefix.starts_with(b"VALKEY") {
            Some(Format::RedisRdb)
        } else {
            None
        }
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a successful verification learned about a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SnapshotInfo {
    pub format: Format,
    /// Total length in bytes, trailer included.
    pub size: u64,
    /// Replication sequence number M.
    pub seq: u64,
    /// The checksum stored in the trailer (verified), if the format has one.
    pub checksum: u64,
    /// Number of records (KVR1).
    pub records: u64,
    /// Creation time from the header, unix milliseconds.
    pub created_ms: u64,
    /// Replication id of the primary that saved it (RDB).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repl_id: Option<String>,
}

/// A snapshot by its identity: what a replica asks for, what an offer holds.
/// Size, seq and checksum come from the file and can be forged by whoever
/// writes one; the manifest digest (BLAKE3 of every piece's hash and of
/// those three) cannot, so a replica given it takes only that snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotId {
    pub size: u64,
    pub seq: u64,
    pub checksum: u64,
    /// [`manifest::Manifest::digest`] (`None`: any manifest of these three).
    pub digest: Option<blake3::Hash>,
}

impl SnapshotId {
    /// Whether `manifest`'s snapshot is this one: by its digest when there
    /// is one (which covers size, seq and checksum), else by those three.
    pub fn is(&self, manifest: &manifest::Manifest) -> bool {
        match self.digest {
            Some(d) => d == manifest.digest(),
            None => self.same_file_fields(&manifest.id()),
        }
    }

    /// Whether `other` is this one as far as both say.
    pub fn matches(&self, other: &SnapshotId) -> bool {
        match (self.digest, other.digest) {
            (Some(a), Some(b)) => a == b,
            _ => self.same_file_fields(other),
        }
    }

    fn same_file_fields(&self, other: &SnapshotId) -> bool {
        (self.size, self.seq, self.checksum) == (other.size, other.seq, other.checksum)
    }
}

impl std::fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.digest {
            Some(d) if (self.size, self.seq, self.checksum) == (0, 0, 0) => {
                write!(f, "manifest {d}")
            }
            digest => {
                write!(
                    f,
                    "seq {} ({} bytes, checksum {:#x}",
                    self.seq, self.size, self.checksum
                )?;
                match digest {
                    Some(d) => write!(f, ", manifest {d})"),
                    None => f.write_str(")"),
                }
            }
        }
    }
}

impl manifest::Manifest {
    /// Its snapshot's identity, digest included.
    pub fn id(&self) -> SnapshotId {
        SnapshotId {
            size: self.info.size,
            seq: self.info.seq,
            checksum: self.info.checksum,
            digest: Some(self.digest()),
        }
    }
}

/// Why bytes are not a valid snapshot. Offsets are into the snapshot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Corruption {
    /// The file does not start with the format's magic.
    #[error("wrong magic {found:?} at offset 0 (expected {expected:?})")]
    BadMagic {
        expected: &'static str,
        found: String,
    },
    /// The header names a version this build does not read.
    #[error("unknown version {version} at offset {offset}")]
    UnknownVersion { offset: u64, version: u16 },
    /// Fewer bytes than a header.
    #[error("truncated header: {len} bytes, the header needs {needed}")]
    TruncatedHeader { len: u64, needed: u64 },
    /// Room for the header but not for the trailer.
    #[error("file of {len} bytes is shorter than header + trailer ({needed} bytes)")]
    TooShort { len: u64, needed: u64 },
    /// A record's header or body extends past the end of the record area.
    #[error("record at offset {offset} runs past the end of the records (needs {needed} bytes, {available} left)")]
    RecordPastEnd {
        offset: u64,
        needed: u64,
        available: u64,
    },
    /// The header's record count disagrees with the records present.
    #[error("header says {expected} records, found {found} (offset {offset})")]
    RecordCount {
        offset: u64,
        expected: u64,
        found: u64,
    },
    /// The trailer checksum does not match the bytes.
    #[error(
        "checksum mismatch at offset {offset}: trailer says {expected:#x}, bytes give {actual:#x}"
    )]
    ChecksumMismatch {
        offset: u64,
        expected: u64,
        actual: u64,
    },
    /// The stream ended before the announced length (or went past it).
    #[error("length mismatch: expected {expected} bytes, got {got}")]
    Length { expected: u64, got: u64 },
    /// The format is recognised but not supported by this build.
    #[error("format {0} is not supported yet")]
    Unsupported(Format),
    /// A structure inside the file is malformed.
    #[error("malformed at offset {offset}: {what}")]
    Malformed { offset: u64, what: String },
    /// An RDB without `repl-id`/`repl-offset`: no partial resync can follow it.
    #[error("no replication position in this RDB (the primary had no replication backlog when it saved); attach a replica or run with a backlog, then save again")]
    NoReplicationPosition,
}

/// Every `reason` label of `kvsync_snapshots_rejected_total`.
pub const REJECTION_REASONS: &[&str] = &[
    "unreadable",
    "not_a_snapshot",
    "truncated",
    "corrupt",
    "no_replication_position",
    "checksum_mismatch",
    "unsupported",
];

impl Corruption {
    /// Short label for metrics (`kvsync_snapshots_rejected_total{reason}`).
    pub fn reason(&self) -> &'static str {
        match self {
            Corruption::BadMagic { .. } | Corruption::UnknownVersion { .. } => "not_a_snapshot",
            Corruption::TruncatedHeader { .. }
            | Corruption::TooShort { .. }
            | Corruption::RecordPastEnd { .. }
            | Corruption::Length { .. } => "truncated",
            Corruption::RecordCount { .. } | Corruption::Malformed { .. } => "corrupt",
            Corruption::NoReplicationPosition => "no_replication_position",
            Corruption::ChecksumMismatch { .. } => "checksum_mismatch",
            Corruption::Unsupported(_) => "unsupported",
        }
    }
}

/// A snapshot file that could not be verified.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The bytes are not a valid snapshot.
    #[error("{path}: {corruption}")]
    Corrupt {
        path: PathBuf,
        corruption: Corruption,
    },
    /// Neither KVR1 nor RDB.
    #[error("{path}: not a snapshot kvsync knows (neither KVR1 nor RDB)")]
    UnknownFormat { path: PathBuf },
}

impl SnapshotError {
    /// What is wrong with the file, without its path.
    pub fn what(&self) -> String {
        match self {
            SnapshotError::Io { source, .. } => source.to_string(),
            SnapshotError::Corrupt { corruption, .. } => corruption.to_string(),
            SnapshotError::UnknownFormat { .. } => {
                "not a snapshot kvsync knows (neither KVR1 nor RDB)".into()
            }
        }
    }

    /// Short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            SnapshotError::Io { .. } => "unreadable",
            SnapshotError::Corrupt { corruption, .. } => corruption.reason(),
            SnapshotError::UnknownFormat { .. } => "not_a_snapshot",
        }
    }
}

/// Incremental verifier: feed the snapshot's bytes in order, then `finish`.
#[derive(Clone)]
pub enum Verifier {
    Kvr1(kvr1::Kvr1Verifier),
    Rdb(rdb::RdbVerifier),
}

impl Verifier {
    /// A verifier for `total_len` bytes of `format`.
    pub fn new(format: Format, total_len: u64) -> Result<Verifier, Corruption> {
        match format {
            Format::Kvr1 => Ok(Verifier::Kvr1(kvr1::Kvr1Verifier::new(total_len))),
            Format::RedisRdb => Ok(Verifier::Rdb(rdb::RdbVerifier::new(total_len))),
        }
    }

    /// Feeds the next bytes; fails as soon as the bytes cannot be valid.
    pub fn update(&mut self, bytes: &[u8]) -> Result<(), Corruption> {
        match self {
            Verifier::Kvr1(v) => v.update(bytes),
            Verifier::Rdb(v) => v.update(bytes),
        }
    }

    /// Checks completeness and the trailer checksum.
    pub fn finish(self) -> Result<SnapshotInfo, Corruption> {
        match self {
            Verifier::Kvr1(v) => v.finish(),
            Verifier::Rdb(v) => v.finish(),
        }
    }
}

/// Read size used when streaming a file through a verifier.
const READ_CHUNK: usize = 1 << 20;
/// Buffers in flight between the reader thread and the verifier.
const READ_DEPTH: usize = 3;

/// Verifies a snapshot file by streaming it (never loads it whole).
///
/// With `format = None` the format is detected from the first bytes.
pub fn verify_file(path: &Path, format: Option<Format>) -> Result<SnapshotInfo, SnapshotError> {
    verify_file_observed(path, format, |_| {})
}

/// [`verify_file`], showing every byte read to `observe` as it passes (the
/// watcher computes the piece manifest in the same pass).
pub fn verify_file_observed(
    path: &Path,
    format: Option<Format>,
    mut observe: impl FnMut(&[u8]),
) -> Result<SnapshotInfo, SnapshotError> {
    let io = |source| SnapshotError::Io {
        path: path.to_owned(),
        source,
    };
    let corrupt = |corruption| SnapshotError::Corrupt {
        path: path.to_owned(),
        corruption,
    };
    let mut file = crate::sys::fs::open_read(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    let format = match format {
        Some(f) => f,
        None => {
            let mut prefix = [0u8; 16];
            let n = read_full(&mut file, &mut prefix).map_err(io)?;
            Format::detect(&prefix[..n]).ok_or_else(|| SnapshotError::UnknownFormat {
                path: path.to_owned(),
            })?
        }
    };
    let mut verifier = Verifier::new(format, len).map_err(corrupt)?;
    let mut seen = 0u64;
    let mut failure = None;
    read_pipelined(crate::sys::fs::open_read(path).map_err(io)?, |chunk| {
        seen += chunk.len() as u64;
        let step = if seen > len {
            Err(Corruption::Length {
                expected: len,
                got: seen,
            })
        } else {
            observe(chunk);
            verifier.update(chunk)
        };
        step.map_err(|c| failure = Some(c)).is_ok()
    })
    .map_err(io)?;
    match failure {
        Some(c) => Err(corrupt(c)),
        None => verifier.finish().map_err(corrupt),
    }
}

/// Streams `file` through `consume` in `READ_CHUNK` pieces, reading ahead on
/// a second thread so that reading and checksumming overlap. `consume`
/// returns false to stop early.
pub fn read_pipelined(
    mut file: File,
    mut consume: impl FnMut(&[u8]) -> bool,
) -> std::io::Result<()> {
    use std::sync::mpsc;
    let (full_tx, full_rx) = mpsc::sync_channel::<std::io::Result<(AlignedBuf, usize)>>(READ_DEPTH);
    let (empty_tx, empty_rx) = mpsc::sync_channel::<AlignedBuf>(READ_DEPTH);
    for _ in 0..READ_DEPTH {
        empty_tx
            .send(AlignedBuf::new(READ_CHUNK)?)
            .expect("channel has room");
    }
    std::thread::scope(move |s| {
        s.spawn(move || {
            // Stops when the file ends, on an error, or when the consumer
            // hangs up.
            while let Ok(mut buf) = empty_rx.recv() {
                let r = read_full(&mut file, &mut buf);
                let done = !matches!(r, Ok(n) if n > 0);
                if full_tx.send(r.map(|n| (buf, n))).is_err() || done {
                    return;
                }
            }
        });
        let mut result = Ok(());
        for item in full_rx.iter() {
            match item {
                Ok((buf, n)) if n > 0 && consume(&buf[..n]) => {
                    let _ = empty_tx.send(buf);
                }
                Ok(_) => break,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        // Hang up so the reader thread ends before the scope joins it.
        drop(full_rx);
        drop(empty_tx);
        result
    })
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
fn read_full(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn early_failure_in_a_multi_chunk_file_stops_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.kvr1");
        let spec = kvr1::GenSpec {
            size: 5 * READ_CHUNK as u64 + 17,
            seq: 3,
            created_ms: 0,
            seed: 3,
        };
        spec.write_file(&path).unwrap();
        assert_eq!(verify_file(&path, None).unwrap().seq, 3);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[4] = 9;
        std::fs::write(&path, &bytes).unwrap();
        let err = verify_file(&path, Some(Format::Kvr1)).unwrap_err();
        assert!(
            matches!(
                err,
                SnapshotError::Corrupt {
                    corruption: Corruption::UnknownVersion { .. },
                    ..
                }
            ),
            "{err}"
        );
        let mut n = 0;
        read_pipelined(File::open(&path).unwrap(), |_| {
            n += 1;
            n < 2
        })
        .unwrap();
        assert_eq!(n, 2);
    }
}
