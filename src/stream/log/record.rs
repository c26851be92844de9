//! A record of the stream log: a checksummed piece of the stream, as it
//! is stored (`[offset u64][len u32][BLAKE3 of offset, len and bytes]
//! [bytes]`), and consecutive records as one run of bytes.

/// Record header: offset, length, BLAKE3.
pub const RECORD_HEADER: usize = 8 + 4 + 32;
/// The most bytes one record holds.
pub const MAX_RECORD: usize = 1 << 20;

/// A checksummed piece of the stream: its bytes follow offset `offset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub offset: u64,
    pub bytes: Vec<u8>,
    pub hash: [u8; 32],
}

impl Record {
    /// A record of `bytes`, hashed here (the log hashes what it appends
    /// itself, [`encode`]).
    #[cfg(test)]
    pub fn new(offset: u64, bytes: Vec<u8>) -> Record {
        let hash = Record::digest(offset, &bytes);
        Record {
            offset,
            bytes,
            hash,
        }
    }

    fn digest(offset: u64, bytes: &[u8]) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        h.update(&offset.to_be_bytes());
        h.update(&(bytes.len() as u32).to_be_bytes());
        h.update(bytes);
        *h.finalize().as_bytes()
    }

    /// Whether the bytes are the ones the hash was made of.
    pub fn verify(&self) -> bool {
        hashes_to(self.offset, &self.bytes, &self.hash)
    }

    /// The offset after its last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.bytes.len() as u64
    }

    /// The record as it is stored.
    #[cfg(test)]
    pub fn encode(&self, out: &mut Vec<u8>) {
        put(self.offset, &self.bytes, &self.hash, out);
    }

    /// A record header's offset and length.
    pub fn parse_header(h: &[u8; RECORD_HEADER]) -> (u64, usize, [u8; 32]) {
        let offset = u64::from_be_bytes(h[0..8].try_into().expect("8 bytes"));
        let len = u32::from_be_bytes(h[8..12].try_into().expect("4 bytes")) as usize;
        (offset, len, h[12..44].try_into().expect("32 bytes"))
    }
}

/// Whether `bytes` at `offset` are the ones a record's `hash` was made of.
pub fn hashes_to(offset: u64, bytes: &[u8], hash: &[u8; 32]) -> bool {
    Record::digest(offset, bytes) == *hash
}

/// The stream's `bytes` at `offset` as one stored record, hashed here,
/// appended to `out`.
pub fn encode(offset: u64, bytes: &[u8], out: &mut Vec<u8>) {
    put(offset, bytes, &Record::digest(offset, bytes), out);
}

fn put(offset: u64, bytes: &[u8], hash: &[u8; 32], out: &mut Vec<u8>) {
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(hash);
    out.extend_from_slice(bytes);
}

/// The stream from `from` on, as one run of bytes: `records` are
/// consecutive, and the first holds `from`.
pub fn contiguous(records: &[Record], from: u64) -> Vec<u8> {
    let mut run = Vec::with_capacity(records.iter().map(|r| r.bytes.len()).sum());
    for rec in records {
        let at = from + run.len() as u64;
        debug_assert!(rec.offset <= at && at <= rec.end(), "records run on");
        run.extend_from_slice(&rec.bytes[(at - rec.offset) as usize..]);
    }
    run
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_encoded_from_its_bytes_is_the_record_made_of_them() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        encode(7, b"SET k v", &mut a);
        Record::new(7, b"SET k v".to_vec()).encode(&mut b);
        assert_eq!(a, b);
        let (offset, len, hash) = Record::parse_header(a[..RECORD_HEADER].try_into().unwrap());
        let rec = Record {
            offset,
            bytes: a[RECORD_HEADER..RECORD_HEADER + len].to_vec(),
            hash,
        };
        assert!(rec.verify());
    }

    #[test]
    fn consecutive_records_make_one_run_from_an_offset_inside_the_first() {
        let recs = [
            Record::new(0, b"abc".to_vec()),
            Record::new(3, b"de".to_vec()),
            Record::new(5, b"fghi".to_vec()),
        ];
        assert_eq!(contiguous(&recs, 1), b"bcdefghi");
        assert_eq!(contiguous(&recs[1..], 3), b"defghi");
        assert_eq!(contiguous(&recs[2..], 9), b"");
    }
}
