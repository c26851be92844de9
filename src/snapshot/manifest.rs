//! The piece manifest of a snapshot: its identity and one BLAKE3 hash per
//! fixed-size piece (docs/ARCHITECTURE.md, "Pieces and resume").
//!
//! The source computes it in the pass that validates the snapshot
//! ([`PieceHasher`] fed by the watcher's read), keeps it in the catalog and
//! streams it to replicas; a replica checks every piece against it as the
//! piece lands, so a damaged piece is fetched again alone, and a sync cut
//! short resumes with the pieces it already verified. The encoding ends
//! with the BLAKE3 hash of what precedes it ([`Manifest::digest`]): the
//! snapshot's name that cannot be forged. Offers, journals, statuses and
//! `kvsync snapshots` carry it, and a replica asked for a digest accepts
//! only a manifest that hashes to it, whoever serves it. BLAKE3 because it
//! is cryptographic and, on one core here, faster than SHA-256 and about
//! half as fast as CRC32 (BENCHMARKS.md, "The piece hash").

use crate::snapshot::{Format, SnapshotInfo};

/// Default piece size (`[data] piece_size`).
pub const DEFAULT_PIECE_SIZE: u64 = 16 << 20;
/// Smallest and largest piece sizes (powers of two).
pub const MIN_PIECE_SIZE: u64 = 1 << 20;
pub const MAX_PIECE_SIZE: u64 = 256 << 20;

const MAGIC: &[u8; 4] = b"KVSM";
const VERSION: u8 = 2;
/// Bytes of a piece hash and of the digest.
pub const HASH_LEN: usize = 32;
/// Longest replication id kept (Redis uses 40 characters).
pub const MAX_REPL_ID: usize = 255;

/// Why bytes are not a manifest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error("not a kvsync manifest (magic {0:?})")]
    Magic(Vec<u8>),
    #[error("manifest version {0} is not one this build reads")]
    Version(u8),
    #[error("manifest truncated: {0}")]
    Truncated(&'static str),
    #[error("manifest digest {stored} does not match its bytes ({actual})")]
    Digest {
        stored: blake3::Hash,
        actual: blake3::Hash,
    },
    #[error("manifest is inconsistent: {0}")]
    Inconsistent(String),
}

/// A snapshot's identity and the BLAKE3 hash of each of its pieces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    /// The snapshot this manifest describes (size, seq, checksum, format…).
    pub info: SnapshotInfo,
    /// Bytes per piece; the last piece may be shorter.
    pub piece_size: u64,
    /// BLAKE3 of each piece, in order.
    pub hashes: Vec<blake3::Hash>,
    /// The BLAKE3 hash that ends the encoding, computed once.
    digest: blake3::Hash,
}

impl Manifest {
    /// Number of pieces of a snapshot of `len` bytes.
    pub fn count_for(len: u64, piece_size: u64) -> u64 {
        len.div_ceil(piece_size)
    }

    pub fn pieces(&self) -> u32 {
        self.hashes.len() as u32
    }

    /// Whether `hash` is piece `index`'s (in constant time).
    pub fn piece_is(&self, index: u32, hash: &blake3::Hash) -> bool {
        self.hashes[index as usize] == *hash
    }

    /// Offset and length of piece `index`.
    pub fn range(&self, index: u32) -> (u64, u64) {
        let offset = index as u64 * self.piece_size;
        (offset, self.piece_size.min(self.info.size - offset))
    }

    /// Encoded length of a manifest of `pieces` pieces, without the
    /// replication id (at most 255 bytes more).
    pub fn encoded_len(pieces: u64) -> u64 {
        FIXED_LEN + HASH_LEN as u64 * (pieces + 1)
    }

    /// The encoded manifest (ends with the BLAKE3 of what precedes it).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.encode_body();
        out.extend_from_slice(self.digest.as_bytes());
        out
    }

    /// The encoding without its closing digest.
    fn encode_body(&self) -> Vec<u8> {
        let info = &self.info;
        let mut out = Vec::with_capacity(80 + HASH_LEN * self.hashes.len());
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
        out.extend_from_slice(&(self.hashes.len() as u32).to_be_bytes());
        for hash in &self.hashes {
            out.extend_from_slice(hash.as_bytes());
        }
        out
    }

    /// The BLAKE3 hash that ends the encoding: the snapshot's name in
    /// offers, journals and requests.
    pub fn digest(&self) -> blake3::Hash {
        self.digest
    }

    /// Decodes and checks a manifest: its own digest, its piece size, and
    /// a piece count that fits its size.
    pub fn decode(b: &[u8]) -> Result<Manifest, ManifestError> {
        let mut r = Reader(b);
        let magic = r.take(4, "magic")?;
        if magic != MAGIC {
            return Err(ManifestError::Magic(magic.to_vec()));
        }
        if b.len() < 4 + HASH_LEN {
            return Err(ManifestError::Truncated("digest"));
        }
        let (body, tail) = b.split_at(b.len() - HASH_LEN);
        let stored = blake3::Hash::from_bytes(tail.try_into().expect("32 bytes"));
        let actual = blake3::hash(body);
        if stored != actual {
            return Err(ManifestError::Digest { stored, actual });
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
        let hashes = r.take(HASH_LEN * count as usize, "piece hashes")?;
        if !r.0.is_empty() {
            return Err(ManifestError::Inconsistent(format!(
                "{} bytes after the piece hashes",
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
            hashes: hashes
                .chunks_exact(HASH_LEN)
                .map(|c| blake3::Hash::from_bytes(c.try_into().expect("32 bytes")))
                .collect(),
            digest: stored,
        })
    }
}

/// Bytes of an encoding besides the replication id and the hashes:
/// magic, version, format, six u64s, the id's two bytes, the count.
const FIXED_LEN: u64 = 4 + 1 + 1 + 6 * 8 + 2 + 4;

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

/// BLAKE3 of each piece of a byte stream fed in order, in any cuts.
pub struct PieceHasher {
    piece_size: u64,
    hashes: Vec<blake3::Hash>,
    current: blake3::Hasher,
    in_piece: u64,
}

impl PieceHasher {
    pub fn new(piece_size: u64) -> PieceHasher {
        PieceHasher {
            piece_size,
            hashes: Vec::new(),
            current: blake3::Hasher::new(),
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
        self.hashes.push(self.current.finalize());
        self.current.reset();
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
            hashes: self.hashes,
            digest: blake3::Hash::from_bytes([0; HASH_LEN]),
        };
        manifest.digest = blake3::hash(&manifest.encode_body());
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
            assert!(m.piece_is(i, &blake3::hash(piece)));
        }
        assert_eq!(m.range(3), (3 * MIN_PIECE_SIZE, 5));
        assert_eq!(manifest_of(&[], MIN_PIECE_SIZE).pieces(), 0);
    }

    #[test]
    fn round_trip_and_every_damage_is_refused() {
        let m = manifest_of(&vec![9u8; 2 * MIN_PIECE_SIZE as usize + 1], MIN_PIECE_SIZE);
        let enc = m.encode();
        assert_eq!(Manifest::decode(&enc).unwrap(), m);
        assert_eq!(m.digest().as_bytes(), &enc[enc.len() - HASH_LEN..]);
        assert_eq!(enc.len() as u64, Manifest::encoded_len(3) + 40);
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
        // 32 bytes per piece plus a fixed header: 2 MiB and change.
        assert!(Manifest::encoded_len(count) + 255 < (2 << 20) + 4096);
    }

    proptest! {
        #[test]
        fn decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Manifest::decode(&bytes);
        }
    }
}
