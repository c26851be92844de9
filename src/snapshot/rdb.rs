//! Redis/Valkey RDB files, as far as kvsync needs them (docs/ARCHITECTURE.md, "Snapshot formats"): the
//! header, the aux fields before the first database — above all the
//! replication position `repl-id` / `repl-offset` / `repl-stream-db` that
//! makes a partial resync possible — and the trailer: `0xFF`, then the
//! 8-byte little-endian CRC-64/Jones of every byte before it (0 when the
//! server ran with checksums off).
//!
//! The keyspace itself is not parsed: the CRC covers it, and the server that
//! loads the file parses it. Verification streams: the head is parsed as
//! soon as its bytes are there ("not enough bytes yet" is a value, not an
//! error), the CRC runs over every byte as it passes.

use crc_fast::{CrcAlgorithm, Digest};

use super::{Corruption, Format, SnapshotInfo};

/// CRC-64/Jones as Redis computes it (check value `0xe9c6d914c4b8d9ca`),
/// by crc-fast (carry-less multiply where the CPU has it; BENCHMARKS.md).
pub fn crc64(bytes: &[u8]) -> u64 {
    crc_fast::checksum(CrcAlgorithm::Crc64Redis, bytes)
}

/// RDB versions read from `REDIS00NN` headers (Redis 5.0 … 7.4).
pub const REDIS_VERSIONS: std::ops::RangeInclusive<u32> = 9..=12;
/// RDB versions read from `VALKEYNNN` headers.
pub const VALKEY_VERSIONS: std::ops::RangeInclusive<u32> = 80..=99;
/// Header length (`REDIS0011` or `VALKEY080`).
const HEADER_LEN: usize = 9;
/// Trailer: the EOF opcode and the CRC.
const TRAILER_LEN: u64 = 9;
/// The aux section kvsync reads must fit in this many bytes.
const MAX_HEAD: usize = 1 << 20;

const OP_AUX: u8 = 0xFA;
const OP_EOF: u8 = 0xFF;

/// What the head of an RDB says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Head {
    /// `REDIS` or `VALKEY`.
    pub server: &'static str,
    pub version: u32,
    /// Replication id of the primary that saved the file.
    pub repl_id: Option<String>,
    /// Replication offset M at the save.
    pub repl_offset: Option<u64>,
    pub repl_stream_db: Option<u64>,
    /// `redis-ver` aux field.
    pub server_version: Option<String>,
    /// `ctime` aux field (unix seconds).
    pub ctime: Option<u64>,
}

/// Why the head cannot be parsed (or `Ok(None)`: more bytes needed).
type Parse<T> = Result<Option<T>, Corruption>;

/// A cursor over the head bytes seen so far.
struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn byte(&mut self) -> Option<u8> {
        let v = *self.b.get(self.pos)?;
        self.pos += 1;
        Some(v)
    }

    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.b.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }

    fn bad(&self, what: impl Into<String>) -> Corruption {
        Corruption::Malformed {
            offset: self.pos as u64,
            what: what.into(),
        }
    }
}

/// A length or, for the special encodings, the encoding number.
enum Len {
    Plain(u64),
    Encoded(u8),
}

fn read_len(c: &mut Cursor) -> Parse<Len> {
    let Some(b) = c.byte() else { return Ok(None) };
    Ok(Some(match b >> 6 {
        0 => Len::Plain((b & 0x3f) as u64),
        1 => match c.byte() {
            Some(n) => Len::Plain((((b & 0x3f) as u64) << 8) | n as u64),
            None => return Ok(None),
        },
        2 => match b {
            0x80 => match c.take(4) {
                Some(s) => Len::Plain(u32::from_be_bytes(s.try_into().expect("4 bytes")) as u64),
                None => return Ok(None),
            },
            0x81 => match c.take(8) {
                Some(s) => Len::Plain(u64::from_be_bytes(s.try_into().expect("8 bytes"))),
                None => return Ok(None),
            },
            _ => return Err(c.bad(format!("unknown length encoding {b:#04x}"))),
        },
        _ => Len::Encoded(b & 0x3f),
    }))
}

fn plain_len(c: &mut Cursor) -> Parse<u64> {
    match read_len(c)? {
        None => Ok(None),
        Some(Len::Plain(n)) => Ok(Some(n)),
        Some(Len::Encoded(e)) => Err(c.bad(format!("encoded value {e} where a length belongs"))),
    }
}

/// Reads a string in any of the encodings Redis writes (raw, INT8/16/32,
/// LZF); integers come back as their decimal text.
fn read_string(c: &mut Cursor) -> Parse<Vec<u8>> {
    let int = |s: Option<&[u8]>, f: fn(&[u8]) -> i64| s.map(|s| f(s).to_string().into_bytes());
    Ok(match read_len(c)? {
        None => None,
        Some(Len::Plain(n)) => {
            if n as usize > MAX_HEAD {
                return Err(c.bad(format!("aux string of {n} bytes")));
            }
            c.take(n as usize).map(<[u8]>::to_vec)
        }
        Some(Len::Encoded(0)) => int(c.take(1), |s| s[0] as i8 as i64),
        Some(Len::Encoded(1)) => int(c.take(2), |s| i16::from_le_bytes([s[0], s[1]]) as i64),
        Some(Len::Encoded(2)) => int(c.take(4), |s| {
            i32::from_le_bytes(s.try_into().expect("4 bytes")) as i64
        }),
        Some(Len::Encoded(3)) => {
            let (Some(clen), Some(ulen)) = (plain_len(c)?, plain_len(c)?) else {
                return Ok(None);
            };
            if ulen as usize > MAX_HEAD || clen > ulen.max(16) * 2 {
                return Err(c.bad(format!("LZF string of {clen} → {ulen} bytes")));
            }
            let at = c.pos;
            match c.take(clen as usize) {
                None => None,
                Some(data) => Some(lzf_decompress(data, ulen as usize).map_err(|e| {
                    Corruption::Malformed {
                        offset: at as u64,
                        what: format!("LZF string: {e}"),
                    }
                })?),
            }
        }
        Some(Len::Encoded(e)) => return Err(c.bad(format!("unknown string encoding {e}"))),
    })
}

/// LZF decompression (the format Redis uses for compressed strings).
pub fn lzf_decompress(input: &[u8], out_len: usize) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(out_len);
    let mut i = 0;
    while i < input.len() {
        let ctrl = input[i] as usize;
        i += 1;
        if ctrl < 32 {
            // A literal run of ctrl + 1 bytes.
            let run = ctrl + 1;
            let lit = input.get(i..i + run).ok_or("literal run past the input")?;
            out.extend_from_slice(lit);
            i += run;
        } else {
            // A back reference: length (ctrl >> 5) + 2, offset from 13 bits.
            let mut len = ctrl >> 5;
            if len == 7 {
                len += *input.get(i).ok_or("reference length past the input")? as usize;
                i += 1;
            }
            len += 2;
            let low = *input.get(i).ok_or("reference offset past the input")? as usize;
            i += 1;
            let back = ((ctrl & 0x1f) << 8) + low + 1;
            let start = out
                .len()
                .checked_sub(back)
                .ok_or("reference before the start of the output")?;
            for k in 0..len {
                let b = out[start + k];
                out.push(b);
            }
        }
        if out.len() > out_len {
            return Err(format!("output longer than the announced {out_len} bytes"));
        }
    }
    if out.len() != out_len {
        return Err(format!(
            "output of {} bytes, announced {out_len}",
            out.len()
        ));
    }
    Ok(out)
}

/// Parses the header and the aux fields up to the first other opcode.
/// `Ok(None)`: the bytes end inside the head.
pub fn parse_head(b: &[u8]) -> Parse<Head> {
    if b.len() < HEADER_LEN {
        // Reject a wrong magic as soon as its bytes are there.
        let known = [&b"REDIS"[..], b"VALKEY"]
            .iter()
            .any(|m| m.starts_with(&b[..b.len().min(m.len())]) || b.starts_with(m));
        return if known { Ok(None) } else { Err(bad_magic(b)) };
    }
    let mut head = Head::default();
    let (server, digits, range) = if b.starts_with(b"REDIS") {
        ("REDIS", &b[5..9], REDIS_VERSIONS)
    } else if b.starts_with(b"VALKEY") {
        ("VALKEY", &b[6..9], VALKEY_VERSIONS)
    } else {
        return Err(bad_magic(b));
    };
    let version = std::str::from_utf8(digits)
        .ok()
        .filter(|d| d.bytes().all(|c| c.is_ascii_digit()))
        .and_then(|d| d.parse::<u32>().ok())
        .ok_or_else(|| bad_magic(b))?;
    if !range.contains(&version) {
        return Err(Corruption::UnknownVersion {
            offset: (HEADER_LEN - digits.len()) as u64,
            version: version.min(u16::MAX as u32) as u16,
        });
    }
    head.server = server;
    head.version = version;
    let mut c = Cursor { b, pos: HEADER_LEN };
    loop {
        match c.b.get(c.pos) {
            None => return Ok(None),
            Some(&OP_AUX) => c.pos += 1,
            Some(_) => return Ok(Some(head)),
        }
        let (Some(key), Some(value)) = (read_string(&mut c)?, read_string(&mut c)?) else {
            return Ok(None);
        };
        let text = || String::from_utf8_lossy(&value).into_owned();
        let number = |c: &Cursor| {
            text().parse::<u64>().map_err(|_| {
                c.bad(format!(
                    "aux {} is not a number: {:?}",
                    String::from_utf8_lossy(&key),
                    text()
                ))
            })
        };
        match key.as_slice() {
            b"repl-id" => head.repl_id = Some(text()),
            b"repl-offset" => head.repl_offset = Some(number(&c)?),
            b"repl-stream-db" => head.repl_stream_db = Some(number(&c)?),
            b"redis-ver" | b"valkey-ver" => head.server_version = Some(text()),
            b"ctime" => head.ctime = number(&c).ok(),
            _ => {}
        }
    }
}

fn bad_magic(b: &[u8]) -> Corruption {
    Corruption::BadMagic {
        expected: "REDIS00NN or VALKEYNNN",
        found: String::from_utf8_lossy(&b[..b.len().min(HEADER_LEN)]).into_owned(),
    }
}

/// Streaming RDB verifier (see the module docs).
#[derive(Clone)]
pub struct RdbVerifier {
    total: u64,
    pos: u64,
    head_bytes: Vec<u8>,
    head: Option<Head>,
    /// Boxed: crc-fast's state is about 450 bytes.
    crc: Box<Digest>,
    /// The last 9 bytes: the EOF opcode and the stored CRC.
    trailer: [u8; TRAILER_LEN as usize],
}

impl RdbVerifier {
    pub fn new(total: u64) -> RdbVerifier {
        RdbVerifier {
            total,
            pos: 0,
            head_bytes: Vec::new(),
            head: None,
            crc: Box::new(Digest::new(CrcAlgorithm::Crc64Redis)),
            trailer: [0; TRAILER_LEN as usize],
        }
    }

    pub fn update(&mut self, bytes: &[u8]) -> Result<(), Corruption> {
        let start = self.pos;
        let end = start + bytes.len() as u64;
        if end > self.total {
            return Err(Corruption::Length {
                expected: self.total,
                got: end,
            });
        }
        self.pos = end;
        if self.head.is_none() {
            let want = MAX_HEAD
                .saturating_sub(self.head_bytes.len())
                .min(bytes.len());
            self.head_bytes.extend_from_slice(&bytes[..want]);
            match parse_head(&self.head_bytes)? {
                Some(h) => {
                    self.head = Some(h);
                    self.head_bytes = Vec::new();
                }
                None if self.head_bytes.len() >= MAX_HEAD => {
                    return Err(Corruption::Malformed {
                        offset: MAX_HEAD as u64,
                        what: "aux fields longer than 1 MiB".into(),
                    })
                }
                None => {}
            }
        }
        // The CRC covers everything before the 8 CRC bytes.
        let crc_end = self.total.saturating_sub(8);
        if start < crc_end {
            let n = (crc_end.min(end) - start) as usize;
            self.crc.update(&bytes[..n]);
        }
        let tail_start = self.total.saturating_sub(TRAILER_LEN);
        for (i, &b) in bytes.iter().enumerate() {
            let at = start + i as u64;
            if at >= tail_start {
                self.trailer[(at - tail_start) as usize] = b;
            }
        }
        Ok(())
    }

    pub fn finish(self) -> Result<SnapshotInfo, Corruption> {
        if self.pos != self.total {
            return Err(Corruption::Length {
                expected: self.total,
                got: self.pos,
            });
        }
        let needed = (HEADER_LEN as u64) + TRAILER_LEN;
        if self.total < needed {
            return Err(Corruption::TooShort {
                len: self.total,
                needed,
            });
        }
        let Some(head) = self.head else {
            return Err(Corruption::Malformed {
                offset: self.total,
                what: "the file ends inside the aux fields (truncated)".into(),
            });
        };
        let eof_at = self.total - TRAILER_LEN;
        if self.trailer[0] != OP_EOF {
            return Err(Corruption::Malformed {
                offset: eof_at,
                what: format!(
                    "no EOF opcode before the checksum (found {:#04x}): the file is truncated or not a complete RDB",
                    self.trailer[0]
                ),
            });
        }
        let stored = u64::from_le_bytes(self.trailer[1..].try_into().expect("8 bytes"));
        let actual = self.crc.finalize();
        if stored != 0 && stored != actual {
            return Err(Corruption::ChecksumMismatch {
                offset: eof_at + 1,
                expected: stored,
                actual,
            });
        }
        if stored == 0 {
            tracing::warn!(
                "RDB checksum is disabled (rdbchecksum no): the bytes cannot be verified"
            );
        }
        let (Some(repl_id), Some(offset)) = (head.repl_id.clone(), head.repl_offset) else {
            return Err(Corruption::NoReplicationPosition);
        };
        Ok(SnapshotInfo {
            format: Format::RedisRdb,
            size: self.total,
            seq: offset,
            checksum: stored,
            records: 0,
            created_ms: head.ctime.unwrap_or(0).saturating_mul(1000),
            repl_id: Some(repl_id),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A raw string (length-prefixed, short).
    fn s(v: &[u8]) -> Vec<u8> {
        let mut out = vec![v.len() as u8];
        out.extend_from_slice(v);
        out
    }

    fn aux(k: &[u8], v: Vec<u8>) -> Vec<u8> {
        let mut out = vec![OP_AUX];
        out.extend(s(k));
        out.extend(v);
        out
    }

    /// A small RDB: header, `fields`, an empty keyspace, EOF, CRC.
    fn rdb(header: &[u8], fields: &[Vec<u8>], checksum: bool) -> Vec<u8> {
        let mut b = header.to_vec();
        for f in fields {
            b.extend_from_slice(f);
        }
        b.push(0xFE); // SELECTDB 0, then one string key
        b.push(0);
        b.extend([0x00]);
        b.extend(s(b"k"));
        b.extend(s(b"v"));
        b.push(OP_EOF);
        let crc = if checksum { crc64(&b) } else { 0 };
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    fn repl(offset: Vec<u8>) -> Vec<Vec<u8>> {
        vec![
            aux(b"redis-ver", s(b"7.0.15")),
            aux(b"repl-stream-db", vec![0xC0, 0]),
            aux(b"repl-id", s(&[b'a'; 40])),
            aux(b"repl-offset", offset),
        ]
    }

    fn verify(b: &[u8]) -> Result<SnapshotInfo, Corruption> {
        let mut v = RdbVerifier::new(b.len() as u64);
        // Byte by byte: the head parse must cope with any split.
        for chunk in b.chunks(3) {
            v.update(chunk)?;
        }
        v.finish()
    }

    #[test]
    fn crc64_jones_check_value() {
        assert_eq!(crc64(b"123456789"), 0xe9c6d914c4b8d9ca);
    }

    #[test]
    fn replication_position_in_every_integer_encoding() {
        for (enc, want) in [
            (vec![0xC0, 0x7f], 127u64),                      // INT8
            (vec![0xC1, 0x39, 0x30], 12345),                 // INT16 LE
            (vec![0xC2, 0x15, 0xcd, 0x5b, 0x07], 123456789), // INT32 LE
            (s(b"9876543210123"), 9876543210123),            // too large: a string
        ] {
            let info = verify(&rdb(b"REDIS0011", &repl(enc), true)).unwrap();
            assert_eq!(info.seq, want);
            assert_eq!(info.repl_id.as_deref(), Some(&"a".repeat(40)[..]));
        }
        let info = verify(&rdb(b"VALKEY080", &repl(vec![0xC0, 5]), true)).unwrap();
        assert_eq!(info.seq, 5);
    }

    #[test]
    fn lzf_compressed_and_long_length_aux_values() {
        // "aaaaaaaaaaaaaaaaaaaa" as LZF: literal 'a', then a back reference
        // of 19 bytes at distance 1.
        let lzf = vec![0x00, b'a', 0xE0, 19 - 9, 0x00];
        assert_eq!(lzf_decompress(&lzf, 20).unwrap(), vec![b'a'; 20]);
        let mut compressed = vec![0xC3, lzf.len() as u8, 20];
        compressed.extend(&lzf);
        let mut long = vec![0x80, 0, 0, 0, 3];
        long.extend(b"abc");
        let mut fields = repl(vec![0xC0, 1]);
        fields.push(aux(b"compressed", compressed));
        fields.push(aux(b"long", long));
        fields.push(aux(b"fourteen", [vec![0x40, 2], b"xy".to_vec()].concat()));
        assert_eq!(verify(&rdb(b"REDIS0010", &fields, true)).unwrap().seq, 1);
    }

    #[test]
    fn clear_errors_for_bad_files() {
        let good = rdb(b"REDIS0011", &repl(vec![0xC0, 1]), true);
        let e = verify(b"KVR1 not an rdb at all").unwrap_err();
        assert!(matches!(e, Corruption::BadMagic { .. }), "{e}");
        let e = verify(&rdb(b"REDIS0099", &repl(vec![0xC0, 1]), true)).unwrap_err();
        assert!(
            matches!(e, Corruption::UnknownVersion { version: 99, .. }),
            "{e}"
        );
        let e = verify(&good[..good.len() - 4]).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        let mut flipped = good.clone();
        flipped[good.len() - 12] ^= 1;
        assert!(matches!(
            verify(&flipped).unwrap_err(),
            Corruption::ChecksumMismatch { .. }
        ));
        let e = verify(&rdb(b"REDIS0011", &[aux(b"redis-ver", s(b"7.0.15"))], true)).unwrap_err();
        assert_eq!(e, Corruption::NoReplicationPosition);
        assert!(e.to_string().contains("no replication position"), "{e}");
        let e = verify(&good[..12]).unwrap_err();
        assert!(matches!(e, Corruption::TooShort { .. }), "{e}");
        let e = verify(&good[..30]).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        assert!(
            lzf_decompress(&[0xE0, 5, 0], 10).is_err(),
            "reference before the start"
        );
        assert!(
            lzf_decompress(&[0x05, b'a'], 6).is_err(),
            "literal past the input"
        );
    }

    #[test]
    fn disabled_checksum_is_reported_not_failed() {
        let info = verify(&rdb(b"REDIS0011", &repl(vec![0xC0, 3]), false)).unwrap();
        assert_eq!((info.checksum, info.seq), (0, 3));
    }

    proptest::proptest! {
        /// Any byte flipped in a valid RDB is reported (CRC, structure),
        /// never a panic, and garbage after a valid head likewise.
        #[test]
        fn damaged_rdbs_are_errors_not_panics(
            at in 0usize..10_000,
            flip in 1u8..=255,
            tail in proptest::collection::vec(proptest::num::u8::ANY, 0..256),
        ) {
            let mut b = rdb(b"REDIS0011", &repl(vec![0xC0, 7]), true);
            let at = at % b.len();
            b[at] ^= flip;
            proptest::prop_assert!(verify(&b).is_err());
            let mut head = rdb(b"REDIS0011", &repl(vec![0xC0, 7]), true);
            head.truncate(60);
            head.extend(tail);
            let _ = verify(&head);
            let _ = lzf_decompress(&head, 300);
        }
    }
}
