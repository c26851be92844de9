//! KVR1, the kvstore snapshot format: header, streaming verifier, writer and
//! the deterministic generator used by tests and benchmarks.
//!
//! Layout (little-endian): a 32-byte header — `"KVR1"`, version u16 = 1,
//! flags u16, seq u64 (M), created unix-ms u64, record count u64 — then
//! records (klen u32, vlen u32, key, value), then the CRC32 (IEEE) of every
//! byte before the trailer, as u32. Files are never loaded whole: the
//! verifier walks records and updates the CRC as bytes stream past.

use std::io::{self, Write};
use std::path::Path;

use super::{Corruption, Format, SnapshotInfo};

/// File magic.
pub const MAGIC: &[u8; 4] = b"KVR1";
/// The only version this build reads and writes.
pub const VERSION: u16 = 1;
/// Header length in bytes.
pub const HEADER_LEN: u64 = 32;
/// Trailer (CRC32) length in bytes.
pub const TRAILER_LEN: u64 = 4;
/// Smallest valid file: header + trailer, no records.
pub const MIN_LEN: u64 = HEADER_LEN + TRAILER_LEN;
/// Bytes of a record before its key and value.
pub const RECORD_HEAD_LEN: u64 = 8;

/// Parsed KVR1 header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub flags: u16,
    pub seq: u64,
    pub created_ms: u64,
    pub records: u64,
}

impl Header {
    /// Encodes the 32-byte header.
    pub fn encode(&self) -> [u8; HEADER_LEN as usize] {
        let mut b = [0u8; HEADER_LEN as usize];
        b[0..4].copy_from_slice(MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.created_ms.to_le_bytes());
        b[24..32].copy_from_slice(&self.records.to_le_bytes());
        b
    }

    /// Checks the magic (needs ≥ 4 bytes) and version (needs ≥ 6 bytes) of a
    /// header prefix; shorter prefixes pass what they can.
    fn check_prefix(b: &[u8]) -> Result<(), Corruption> {
        let n = b.len().min(4);
        if b[..n] != MAGIC[..n] {
            return Err(Corruption::BadMagic {
                expected: "KVR1",
                found: String::from_utf8_lossy(&b[..n]).into_owned(),
            });
        }
        if b.len() >= 6 {
            let version = u16::from_le_bytes([b[4], b[5]]);
            if version != VERSION {
                return Err(Corruption::UnknownVersion { offset: 4, version });
            }
        }
        Ok(())
    }

    /// Decodes a full header.
    pub fn decode(b: &[u8; HEADER_LEN as usize]) -> Result<Header, Corruption> {
        Header::check_prefix(b)?;
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Ok(Header {
            flags: u16::from_le_bytes([b[6], b[7]]),
            seq: u64_at(8),
            created_ms: u64_at(16),
            records: u64_at(24),
        })
    }
}

/// Where the record walker is inside the record area.
#[derive(Debug, Clone, Copy)]
enum RecordState {
    /// Collecting a record's 8-byte head; `start` is its offset.
    Head {
        buf: [u8; 8],
        have: usize,
        start: u64,
    },
    /// Skipping `remaining` bytes of key and value.
    Body { remaining: u64 },
}

/// Streaming KVR1 verifier for a snapshot of known total length.
#[derive(Debug, Clone)]
pub struct Kvr1Verifier {
    total: u64,
    /// End of the checksummed area (= start of the trailer).
    body_end: u64,
    pos: u64,
    crc: crc32fast::Hasher,
    header_buf: [u8; HEADER_LEN as usize],
    header: Option<Header>,
    record: RecordState,
    records_seen: u64,
    trailer: [u8; TRAILER_LEN as usize],
}

impl Kvr1Verifier {
    /// A verifier expecting exactly `total` bytes.
    pub fn new(total: u64) -> Kvr1Verifier {
        // Too-short files have no trailer; their bytes all count as header so
        // the first error reported is the most telling one.
        let body_end = if total >= MIN_LEN {
            total - TRAILER_LEN
        } else {
            total
        };
        Kvr1Verifier {
            total,
            body_end,
            pos: 0,
            crc: crc32fast::Hasher::new(),
            header_buf: [0; HEADER_LEN as usize],
            header: None,
            record: RecordState::Head {
                buf: [0; 8],
                have: 0,
                start: HEADER_LEN,
            },
            records_seen: 0,
            trailer: [0; TRAILER_LEN as usize],
        }
    }

    /// Feeds the next bytes of the snapshot.
    pub fn update(&mut self, mut bytes: &[u8]) -> Result<(), Corruption> {
        let end = self.pos + bytes.len() as u64;
        if end > self.total {
            return Err(Corruption::Length {
                expected: self.total,
                got: end,
            });
        }
        // Checksummed part (header + records).
        if self.pos < self.body_end {
            let n = (self.body_end - self.pos).min(bytes.len() as u64) as usize;
            let (body, rest) = bytes.split_at(n);
            self.crc.update(body);
            self.walk(body)?;
            bytes = rest;
        }
        // Trailer.
        if !bytes.is_empty() {
            let at = (self.pos - self.body_end) as usize;
            self.trailer[at..at + bytes.len()].copy_from_slice(bytes);
            self.pos += bytes.len() as u64;
        }
        Ok(())
    }

    /// Structural walk over header and records; advances `pos`.
    fn walk(&mut self, mut bytes: &[u8]) -> Result<(), Corruption> {
        if self.pos < HEADER_LEN {
            let at = self.pos as usize;
            let n = (HEADER_LEN as usize - at).min(bytes.len());
            self.header_buf[at..at + n].copy_from_slice(&bytes[..n]);
            self.pos += n as u64;
            bytes = &bytes[n..];
            Header::check_prefix(&self.header_buf[..self.pos as usize])?;
            if self.pos == HEADER_LEN {
                self.header = Some(Header::decode(&self.header_buf)?);
            }
        }
        while !bytes.is_empty() {
            match &mut self.record {
                RecordState::Body { remaining } => {
                    let n = (*remaining).min(bytes.len() as u64);
                    *remaining -= n;
                    self.pos += n;
                    bytes = &bytes[n as usize..];
                    if *remaining == 0 {
                        self.record = RecordState::Head {
                            buf: [0; 8],
                            have: 0,
                            start: self.pos,
                        };
                    }
                }
                RecordState::Head { buf, have, start } => {
                    let n = (8 - *have).min(bytes.len());
                    buf[*have..*have + n].copy_from_slice(&bytes[..n]);
                    *have += n;
                    self.pos += n as u64;
                    bytes = &bytes[n..];
                    if *have < 8 {
                        continue;
                    }
                    let klen = u32::from_le_bytes(buf[0..4].try_into().expect("4")) as u64;
                    let vlen = u32::from_le_bytes(buf[4..8].try_into().expect("4")) as u64;
                    let available = self.body_end - self.pos;
                    if klen + vlen > available {
                        return Err(Corruption::RecordPastEnd {
                            offset: *start,
                            needed: RECORD_HEAD_LEN + klen + vlen,
                            available: available + RECORD_HEAD_LEN,
                        });
                    }
                    self.records_seen += 1;
                    self.record = if klen + vlen == 0 {
                        RecordState::Head {
                            buf: [0; 8],
                            have: 0,
                            start: self.pos,
                        }
                    } else {
                        RecordState::Body {
                            remaining: klen + vlen,
                        }
                    };
                }
            }
        }
        Ok(())
    }

    /// Checks that every byte arrived, the records add up and the CRC matches.
    pub fn finish(self) -> Result<SnapshotInfo, Corruption> {
        if self.total < HEADER_LEN {
            return Err(Corruption::TruncatedHeader {
                len: self.total,
                needed: HEADER_LEN,
            });
        }
        if self.total < MIN_LEN {
            return Err(Corruption::TooShort {
                len: self.total,
                needed: MIN_LEN,
            });
        }
        if self.pos != self.total {
            return Err(Corruption::Length {
                expected: self.total,
                got: self.pos,
            });
        }
        let header = self.header.expect("a complete stream has a header");
        if let RecordState::Head { have, start, .. } = self.record {
            if have != 0 {
                return Err(Corruption::RecordPastEnd {
                    offset: start,
                    needed: RECORD_HEAD_LEN,
                    available: have as u64,
                });
            }
        }
        if self.records_seen != header.records {
            return Err(Corruption::RecordCount {
                offset: 24,
                expected: header.records,
                found: self.records_seen,
            });
        }
        let expected = u32::from_le_bytes(self.trailer) as u64;
        let actual = self.crc.finalize() as u64;
        if expected != actual {
            return Err(Corruption::ChecksumMismatch {
                offset: self.body_end,
                expected,
                actual,
            });
        }
        Ok(SnapshotInfo {
            format: Format::Kvr1,
            size: self.total,
            seq: header.seq,
            checksum: actual,
            records: header.records,
            created_ms: header.created_ms,
            repl_id: None,
        })
    }
}

/// Writes a KVR1 snapshot to any `Write`, computing the CRC as it goes.
pub struct Kvr1Writer<W: Write> {
    out: W,
    crc: crc32fast::Hasher,
    records_left: u64,
}

impl<W: Write> Kvr1Writer<W> {
    /// Writes the header; exactly `header.records` records must follow.
    pub fn new(mut out: W, header: Header) -> io::Result<Self> {
        let h = header.encode();
        out.write_all(&h)?;
        let mut crc = crc32fast::Hasher::new();
        crc.update(&h);
        Ok(Kvr1Writer {
            out,
            crc,
            records_left: header.records,
        })
    }

    /// Appends one record.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> io::Result<()> {
        if self.records_left == 0 {
            return Err(io::Error::other("more records than the header announced"));
        }
        let klen = u32::try_from(key.len()).map_err(io::Error::other)?;
        let vlen = u32::try_from(value.len()).map_err(io::Error::other)?;
        let mut head = [0u8; 8];
        head[..4].copy_from_slice(&klen.to_le_bytes());
        head[4..].copy_from_slice(&vlen.to_le_bytes());
        for part in [&head[..], key, value] {
            self.crc.update(part);
            self.out.write_all(part)?;
        }
        self.records_left -= 1;
        Ok(())
    }

    /// Writes the trailer and returns the inner writer and the CRC.
    pub fn finish(mut self) -> io::Result<(W, u32)> {
        if self.records_left != 0 {
            return Err(io::Error::other(format!(
                "{} announced records missing",
                self.records_left
            )));
        }
        let crc = self.crc.finalize();
        self.out.write_all(&crc.to_le_bytes())?;
        self.out.flush()?;
        Ok((self.out, crc))
    }
}

/// Why a generator cannot produce the requested file.
#[derive(Debug, thiserror::Error)]
pub enum GenError {
    /// The size cannot be written as a KVR1 file of exactly that length.
    #[error("{0}")]
    Size(String),
    /// Writing the file failed.
    #[error("cannot write {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: io::Error,
    },
}

/// Parameters of a deterministic generated snapshot.
#[derive(Debug, Clone, Copy)]
pub struct GenSpec {
    /// Exact file length, trailer included.
    pub size: u64,
    pub seq: u64,
    /// Header creation time (kept fixed so equal specs give equal files).
    pub created_ms: u64,
    /// Seed of the record contents.
    pub seed: u64,
}

/// Key length of generated records.
const GEN_KEY_LEN: u64 = 16;

impl GenSpec {
    /// Checks that `size` is expressible: header + trailer + records that fill
    /// the rest exactly (every record is at least 8 bytes).
    pub fn check(&self) -> Result<(), GenError> {
        if self.size < MIN_LEN {
            return Err(GenError::Size(format!(
                "a KVR1 snapshot is at least {MIN_LEN} bytes (32-byte header + 4-byte trailer); {} bytes cannot be expressed",
                self.size
            )));
        }
        let payload = self.size - MIN_LEN;
        if payload > 0 && payload < RECORD_HEAD_LEN {
            return Err(GenError::Size(format!(
                "{} bytes cannot be expressed exactly in KVR1: the {payload} bytes after header and trailer are less than one record (8 bytes); use {MIN_LEN} or at least {} bytes",
                self.size,
                MIN_LEN + RECORD_HEAD_LEN
            )));
        }
        Ok(())
    }

    /// The record sizes (head included) the generator emits, in order.
    fn record_sizes(&self) -> impl Iterator<Item = u64> {
        let mut left = self.size.saturating_sub(MIN_LEN);
        let mut rng = SplitMix64(self.seed ^ 0x5eed);
        std::iter::from_fn(move || {
            if left == 0 {
                return None;
            }
            // Values between 64 B and 16 KiB, like a typical KV workload.
            let want = RECORD_HEAD_LEN + GEN_KEY_LEN + 64 + rng.next() % (16 * 1024 - 64);
            let size = if want > left || left - want < RECORD_HEAD_LEN {
                left
            } else {
                want
            };
            left -= size;
            Some(size)
        })
    }

    /// Writes the snapshot to `out`; returns the CRC.
    pub fn write_to<W: Write>(&self, out: W) -> Result<u32, io::Error> {
        let records = self.record_sizes().count() as u64;
        let header = Header {
            flags: 0,
            seq: self.seq,
            created_ms: self.created_ms,
            records,
        };
        let mut w = Kvr1Writer::new(out, header)?;
        let mut rng = SplitMix64(self.seed);
        let mut value = Vec::new();
        for (i, size) in self.record_sizes().enumerate() {
            let body = size - RECORD_HEAD_LEN;
            let klen = body.min(GEN_KEY_LEN) as usize;
            let key = format!("{:016x}", i as u64);
            let vlen = (body as usize) - klen;
            value.resize(vlen, 0);
            rng.fill(&mut value);
            w.put(&key.as_bytes()[..klen], &value)?;
        }
        let (_, crc) = w.finish()?;
        Ok(crc)
    }

    /// Writes the snapshot to `path` through a temp file renamed into place,
    /// so a watcher never sees it half written.
    pub fn write_file(&self, path: &Path) -> Result<u32, GenError> {
        self.check()?;
        let io = |source| GenError::Io {
            path: path.to_owned(),
            source,
        };
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let tmp = tempfile::Builder::new()
            .prefix(".kvsync-gen-")
            .suffix(".tmp")
            .tempfile_in(dir)
            .map_err(io)?;
        let crc = self
            .write_to(io::BufWriter::with_capacity(1 << 20, tmp.as_file()))
            .map_err(io)?;
        tmp.as_file().sync_all().map_err(io)?;
        tmp.persist(path).map_err(|e| io(e.error))?;
        Ok(crc)
    }
}

/// Small deterministic PRNG (SplitMix64) for generated contents.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn fill(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next().to_le_bytes();
        let n = rest.len();
        rest.copy_from_slice(&last[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gen(size: u64, seq: u64) -> Vec<u8> {
        let spec = GenSpec {
            size,
            seq,
            created_ms: 7,
            seed: 1,
        };
        spec.check().unwrap();
        let mut out = Vec::new();
        spec.write_to(&mut out).unwrap();
        out
    }

    fn verify(bytes: &[u8], step: usize) -> Result<SnapshotInfo, Corruption> {
        let mut v = Kvr1Verifier::new(bytes.len() as u64);
        for chunk in bytes.chunks(step.max(1)) {
            v.update(chunk)?;
        }
        v.finish()
    }

    #[test]
    fn round_trip_writer_and_verifier() {
        let header = Header {
            flags: 3,
            seq: 42,
            created_ms: 1000,
            records: 3,
        };
        let mut w = Kvr1Writer::new(Vec::new(), header).unwrap();
        w.put(b"a", b"1").unwrap();
        w.put(b"", b"").unwrap();
        w.put(b"key", &[9u8; 300]).unwrap();
        let (bytes, crc) = w.finish().unwrap();
        for step in [1, 3, 7, 64, bytes.len()] {
            let info = verify(&bytes, step).unwrap();
            assert_eq!((info.seq, info.records, info.created_ms), (42, 3, 1000));
            assert_eq!(info.checksum, crc as u64);
            assert_eq!(info.size, bytes.len() as u64);
        }
        assert_eq!(
            Header::decode(bytes[..32].try_into().unwrap()).unwrap(),
            header
        );
    }

    #[test]
    fn generated_sizes_are_exact_and_valid() {
        for size in [36, 44, 45, 100, 4096, 65_537, 1 << 20, (1 << 20) + 13] {
            let bytes = gen(size, 9);
            assert_eq!(bytes.len() as u64, size);
            let info = verify(&bytes, 4093).unwrap();
            assert_eq!(info.seq, 9);
        }
        assert_eq!(gen(1 << 16, 1), gen(1 << 16, 1), "deterministic");
    }

    #[test]
    fn inexpressible_sizes_are_refused() {
        for size in [0, 35, 37, 43] {
            let spec = GenSpec {
                size,
                seq: 1,
                created_ms: 0,
                seed: 0,
            };
            let err = spec.check().unwrap_err().to_string();
            assert!(err.contains("cannot be expressed"), "{err}");
        }
    }

    #[test]
    fn each_corruption_has_its_own_error() {
        let good = gen(4096, 5);
        let mut bad_magic = good.clone();
        bad_magic[0] = b'X';
        assert!(matches!(
            verify(&bad_magic, 100),
            Err(Corruption::BadMagic { .. })
        ));

        let mut bad_version = good.clone();
        bad_version[4] = 2;
        assert_eq!(
            verify(&bad_version, 100),
            Err(Corruption::UnknownVersion {
                offset: 4,
                version: 2
            })
        );

        assert_eq!(
            verify(&good[..20], 100),
            Err(Corruption::TruncatedHeader {
                len: 20,
                needed: 32
            })
        );
        assert_eq!(
            verify(&good[..34], 100),
            Err(Corruption::TooShort {
                len: 34,
                needed: 36
            })
        );

        // Cut in the middle: the last record runs past the end.
        let cut = &good[..3000];
        assert!(matches!(
            verify(cut, 100),
            Err(Corruption::RecordPastEnd { .. })
        ));

        // Trailer mismatch.
        let mut bad_crc = good.clone();
        let n = bad_crc.len();
        bad_crc[n - 1] ^= 0xff;
        assert!(matches!(
            verify(&bad_crc, 100),
            Err(Corruption::ChecksumMismatch { offset, .. }) if offset == (n - 4) as u64
        ));

        // Header record count disagrees.
        let mut bad_count = good.clone();
        bad_count[24] = bad_count[24].wrapping_add(1);
        assert!(matches!(
            verify(&bad_count, 100),
            Err(Corruption::RecordCount { .. })
        ));
    }

    #[test]
    fn every_single_byte_flip_is_detected() {
        let good = gen(600, 77);
        for i in 0..good.len() {
            for bit in [0x01u8, 0x80] {
                let mut b = good.clone();
                b[i] ^= bit;
                assert!(
                    verify(&b, 64).is_err(),
                    "flip of bit {bit:#x} at {i} not detected"
                );
            }
        }
    }

    #[test]
    fn more_bytes_than_announced_is_an_error() {
        let good = gen(100, 1);
        let mut v = Kvr1Verifier::new(99);
        assert!(matches!(v.update(&good), Err(Corruption::Length { .. })));
    }

    proptest::proptest! {
        #[test]
        fn verifier_never_panics_on_garbage(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512), step in 1usize..64) {
            let _ = verify(&bytes, step);
        }

        #[test]
        fn chunking_does_not_change_the_result(size in 36u64..5000, step in 1usize..700) {
            let spec = GenSpec { size, seq: size, created_ms: 0, seed: size };
            if spec.check().is_ok() {
                let bytes = gen(size, size);
                proptest::prop_assert_eq!(verify(&bytes, step), verify(&bytes, bytes.len()));
            }
        }
    }
}
