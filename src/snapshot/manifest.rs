//! The piece manifest of a snapshot: its identity and one CRC32 per
//! fixed-size piece (docs/ARCHITECTURE.md, "Pieces and resume").
//!
//! The source computes it in the pass that validates the snapshot
//! ([`PieceHasher`] fed by the watcher's read), keeps it in the catalog and
//! streams it to replicas; a replica checks every piece against it as the
//! piece lands, so a damaged piece is fetched again alone, and a sync cut
//! short resumes with the pieces it already verified. The encoding carries
//! its own CRC32 ([`Manifest::digest`]), which the offer repeats, so a
//! manifest that changed or was damaged on its way is refused. CRC32 is
//! crc32fast's (SIMD where the CPU has it): the fastest check measured
//! here, see BENCHMARKS.md.

use crate::snapshot::{Format, SnapshotInfo};

/// Default piece size (`[data] piece_size`).
pub const DEFAULT_PIECE_SIZE: u64 = 16 << 20;
/// Smallest and largest piece sizes (powers of two).
pub const MIN_PIECE_SIZE: u64 = 1 << 20;
pub const MAX_PIECE_SIZE: u64 = 256 << 20;

const MAGIC: &[u8; 4] = b"KVSM";
const VERSION: u8 = 1;
/// Longest replication id kept (Redis uses 40 characters).
const MAX_REPL_ID: usize = 255;

/// Why bytes are not a manifest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error("not a kvsync manifest (magic {0:?})")]
    Magic(Vec<u8>),
    #[error("manifest version {0} is not one this build reads")]
    Version(u8),
    #[error("manifest truncated: {0}")]
    Truncated(&'static str),
    #[error("manifest checksum {stored:#010x} does not match its bytes ({actual:#010x})")]
    Checksum { stored: u32, actual: u32 },
    #[error("manifest is inconsistent: {0}")]
    Inconsistent(String),
}

/// A snapshot's identity and the CRC32 of each of its pieces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    /// The snapshot this manifest describes (size, seq, checksum, format…).
    pub info: SnapshotInfo,
    /// Bytes per piece; the last piece may be shorter.
    pub piece_size: u64,
    /// CRC32 of each piece, in order.
    pub crcs: Vec<u32>,
    /// The CRC32 that ends the encoding, computed once.
    digest: u32,
}

impl Manifest {
    /// Number of pieces of a snapshot of `len` bytes.
    pub fn count_for(len: u64, piece_size: u64) -> u64 {
        len.div_ceil(piece_size)
    }

    pub fn pieces(&self) -> u32 {
        self.crcs.len() as u32
    }

    /// Offset and length of piece `index`.
    pub fn range(&self, index: u32) -> (u64, u64) {
        let offset = index as u64 * self.piece_size;
        (offset, self.piece_size.min(self.info.size - offset))
    }

    /// The encoded manifest (ends with the CRC32 of what precedes it).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.encode_body();
        out.extend_from_slice(&self.digest.to_be_bytes());
        out
    }

    /// The encoding without its closing CRC32.
    fn encode_body(&self) -> Vec<u8> {
        let info = &self.info;
        let mut out = Vec::with_capacity(80 + 4 * self.crcs.len());
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.push(match info.format {
            Format::Kvr1 => 0,
            Format::RedisRdb => 1,
        });
        for v in [
            info.size,
            info.seq,
            info.checksum,
            info.records,
            info.created_ms,
            self.piece_size,
        ] {
            out.extend_from_slice(&v.to_be_bytes());
        }
        let id = info.repl_id.as_deref().unwrap_or("").as_bytes();
        let id = &id[..id.len().min(MAX_REPL_ID)];
        out.push(id.len() as u8);
        out.push(info.repl_id.is_some() as u8);
        out.extend_from_slice(id);
        out.extend_from_slice(&(self.crcs.len() as u32).to_be_bytes());
        for crc in &self.crcs {
            out.extend_from_slice(&crc.to_be_bytes());
        }
        out
    }

    /// The CRC32 that ends the encoding: what offers and journals quote.
    pub fn digest(&self) -> u32 {
        self.digest
    }

    /// Decodes and checks a manifest: its own checksum, its piece size,
    /// and a piece count that fits its size.
    pub fn decode(b: &[u8]) -> Result<Manifest, ManifestError> {
        let mut r = Reader(b);
        let magic = r.take(4, "magic")?;
        if magic != MAGIC {
            return Err(ManifestError::Magic(magic.to_vec()));
        }
        if b.len() < 8 {
            return Err(ManifestError::Truncated("checksum"));
        }
        let (body, tail) = b.split_at(b.len() - 4);
        let stored = u32::from_be_bytes(tail.try_into().expect("4 bytes"));
        let actual = crc32fast::hash(body);
        if stored != actual {
            return Err(ManifestError::Checksum { stored, actual });
        }
        let mut r = Reader(&body[4..]);
        let version = r.u8("version")?;
        if version != VERSION {
            return Err(ManifestError::Version(version));
        }
        let format = match r.u8("format")? {
            0 => Format::Kvr1,
            1 => Format::RedisRdb,
            f => return Err(ManifestError::Inconsistent(format!("format {f}"))),
        };
        let [size, seq, checksum, records, created_ms, piece_size] = [
            r.u64("size")?,
            r.u64("seq")?,
            r.u64("checksum")?,
            r.u64("records")?,
            r.u64("created")?,
            r.u64("piece size")?,
        ];
        let id_len = r.u8("replication id")? as usize;
        let has_id = r.u8("replication id")? != 0;
        let id = r.take(id_len, "replication id")?;
        let repl_id = if has_id {
            Some(
                std::str::from_utf8(id)
                    .map_err(|_| ManifestError::Inconsistent("replication id is not UTF-8".into()))?
                    .to_string(),
            )
        } else {
            None
        };
        check_piece_size(piece_size).map_err(|e| ManifestError::Inconsistent(e.to_string()))?;
        let count = r.u32("piece count")? as u64;
        if count != Manifest::count_for(size, piece_size) {
            return Err(ManifestError::Inconsistent(format!(
                "{count} pieces for {size} bytes in pieces of {piece_size}"
            )));
        }
        let crcs = r.take(4 * count as usize, "piece checksums")?;
        if !r.0.is_empty() {
            return Err(ManifestError::Inconsistent(format!(
                "{} bytes after the piece checksums",
                r.0.len()
            )));
        }
        Ok(Manifest {
            info: SnapshotInfo {
                format,
                size,
                seq,
                checksum,
                records,
                created_ms,
                repl_id,
            },
            piece_size,
            crcs: crcs
                .chunks_exact(4)
                .map(|c| u32::from_be_bytes(c.try_into().expect("4 bytes")))
                .collect(),
            digest: stored,
        })
    }
}

/// A piece size kvsync does not use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("piece size {0} is not a power of two between 1 MiB and 256 MiB")]
pub struct BadPieceSize(pub u64);

/// `Ok` for a power of two between 1 MiB and 256 MiB.
pub fn check_piece_size(size: u64) -> Result<(), BadPieceSize> {
    if size.is_power_of_two() && (MIN_PIECE_SIZE..=MAX_PIECE_SIZE).contains(&size) {
        Ok(())
    } else {
        Err(BadPieceSize(size))
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], ManifestError> {
        if self.0.len() < n {
            return Err(ManifestError::Truncated(what));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, ManifestError> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, ManifestError> {
        Ok(u32::from_be_bytes(
            self.take(4, what)?.try_into().expect("4"),
        ))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, ManifestError> {
        Ok(u64::from_be_bytes(
            self.take(8, what)?.try_into().expect("8"),
        ))
    }
}

/// CRC32 of each piece of a byte stream fed in order, in any cuts.
pub struct PieceHasher {
    piece_size: u64,
    crcs: Vec<u32>,
    current: crc32fast::Hasher,
    in_piece: u64,
}

impl PieceHasher {
    pub fn new(piece_size: u64) -> PieceHasher {
        PieceHasher {
            piece_size,
            crcs: Vec::new(),
            current: crc32fast::Hasher::new(),
            in_piece: 0,
        }
    }

    pub fn update(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let n = ((self.piece_size - self.in_piece) as usize).min(bytes.len());
            self.current.update(&bytes[..n]);
            self.in_piece += n as u64;
            bytes = &bytes[n..];
            if self.in_piece == self.piece_size {
                self.end_piece();
            }
        }
    }

    fn end_piece(&mut self) {
        let done = std::mem::replace(&mut self.current, crc32fast::Hasher::new());
        self.crcs.push(done.finalize());
        self.in_piece = 0;
    }

    /// The manifest of the snapshot whose bytes were fed.
    pub fn finish(mut self, info: SnapshotInfo) -> Manifest {
        if self.in_piece > 0 {
            self.end_piece();
        }
        let mut manifest = Manifest {
            info,
            piece_size: self.piece_size,
            crcs: self.crcs,
            digest: 0,
        };
        manifest.digest = crc32fast::hash(&manifest.encode_body());
        manifest
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn info(size: u64) -> SnapshotInfo {
        SnapshotInfo {
            format: Format::RedisRdb,
            size,
            seq: 42,
            checksum: 0xfeed,
            records: 3,
            created_ms: 7,
            repl_id: Some("8371b4fb1155b71f4a04d3e1bc3e18c4a990aeeb".into()),
        }
    }

    fn manifest_of(bytes: &[u8], piece: u64) -> Manifest {
        let mut h = PieceHasher::new(piece);
        for cut in bytes.chunks(7777) {
            h.update(cut);
        }
        h.finish(info(bytes.len() as u64))
    }

    #[test]
    fn pieces_cover_the_bytes_in_any_cuts() {
        let bytes: Vec<u8> = (0..(3 * MIN_PIECE_SIZE + 5)).map(|i| i as u8).collect();
        let m = manifest_of(&bytes, MIN_PIECE_SIZE);
        assert_eq!(m.pieces(), 4);
        for i in 0..m.pieces() {
            let (off, len) = m.range(i);
            let piece = &bytes[off as usize..(off + len) as usize];
            assert_eq!(m.crcs[i as usize], crc32fast::hash(piece));
        }
        assert_eq!(m.range(3), (3 * MIN_PIECE_SIZE, 5));
        assert_eq!(manifest_of(&[], MIN_PIECE_SIZE).pieces(), 0);
    }

    #[test]
    fn round_trip_and_every_damage_is_refused() {
        let m = manifest_of(&vec![9u8; 2 * MIN_PIECE_SIZE as usize + 1], MIN_PIECE_SIZE);
        let enc = m.encode();
        assert_eq!(Manifest::decode(&enc).unwrap(), m);
        assert_eq!(
            m.digest(),
            u32::from_be_bytes(enc[enc.len() - 4..].try_into().unwrap())
        );
        for i in 0..enc.len() {
            let mut bad = enc.clone();
            bad[i] ^= 0x40;
            assert!(Manifest::decode(&bad).is_err(), "flip at {i}");
        }
        for cut in 0..enc.len() {
            assert!(Manifest::decode(&enc[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn piece_sizes_are_powers_of_two_in_range() {
        assert!(check_piece_size(DEFAULT_PIECE_SIZE).is_ok());
        assert!(check_piece_size(MIN_PIECE_SIZE).is_ok());
        assert!(check_piece_size(MAX_PIECE_SIZE).is_ok());
        for bad in [0, 1, MIN_PIECE_SIZE / 2, 3 << 20, MAX_PIECE_SIZE * 2] {
            assert!(check_piece_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_one_tib_manifest_is_small() {
        let count = Manifest::count_for(1 << 40, DEFAULT_PIECE_SIZE);
        assert_eq!(count, 65536);
        // 4 bytes per piece plus a fixed header: 256 KiB and change.
        assert!(4 * count + 128 < 300 << 10);
    }

    proptest! {
        #[test]
        fn decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Manifest::decode(&bytes);
        }
    }
}
