//! What the fuzz targets run (`fuzz/`, driven by `scripts/fuzz.sh`) and what
//! the test suite replays their kept inputs through (`fuzz/regressions/`):
//! every decoder that reads bytes from a peer, a snapshot or a resume
//! journal. Bad
//! input must come back as an error; a panic here is a bug.

use crate::blk3::token::{Token, FRAME_HEADER_LEN, MAX_TOKEN_LEN};
use crate::snapshot::kvr1::{self, Kvr1Verifier};
use crate::snapshot::rdb::{self, RdbVerifier};

/// A fuzz target: takes any bytes, panics only on a bug.
pub type Target = fn(&[u8]);

/// The fuzz targets by name, for the replay test.
pub const TARGETS: &[(&str, Target)] = &[
    ("blk3_token", blk3_token),
    ("tcp_frames", tcp_frames),
    ("kvr1", kvr1),
    ("rdb", rdb),
    ("manifest", manifest),
    ("journal", journal),
];

/// One BLK3 token (an RDMA receive, MRINFO among them): a token that
/// decodes re-encodes to itself.
pub fn blk3_token(data: &[u8]) {
    if let Ok(t) = Token::decode(data) {
        let again = Token::decode(&t.encode()).expect("an encoded token decodes");
        if !matches!(t, Token::Rdfl { .. }) {
            assert_eq!(again, t);
        }
    }
}

/// A TCP byte stream cut into frames the way the link reads it: each frame
/// consumes at least its header and never more than is there.
pub fn tcp_frames(data: &[u8]) {
    let mut rest = data;
    while let Ok(Some((_, used))) = Token::decode_frame(rest) {
        assert!((FRAME_HEADER_LEN..=FRAME_HEADER_LEN + MAX_TOKEN_LEN).contains(&used));
        assert!(used <= rest.len());
        rest = &rest[used..];
    }
}

/// The first byte picks how the rest is split into updates, as reads from
/// a file or a socket would split it.
fn chunks(data: &[u8]) -> (usize, &[u8]) {
    match data.split_first() {
        Some((step, rest)) => (usize::from(*step).max(1), rest),
        None => (1, data),
    }
}

/// A KVR1 snapshot: header, records and trailer, verified as streamed.
pub fn kvr1(data: &[u8]) {
    let (step, data) = chunks(data);
    if let Some(head) = data.get(..kvr1::HEADER_LEN as usize) {
        let _ = kvr1::Header::decode(head.try_into().expect("header length"));
    }
    let mut v = Kvr1Verifier::new(data.len() as u64);
    if data.chunks(step).all(|c| v.update(c).is_ok()) {
        let _ = v.finish();
    }
}

/// A Redis/Valkey RDB: header, aux fields (LZF strings among them),
/// trailer and CRC, verified as streamed.
pub fn rdb(data: &[u8]) {
    let _ = rdb::parse_head(data);
    if let [a, b, rest @ ..] = data {
        let _ = rdb::lzf_decompress(rest, usize::from(u16::from_le_bytes([*a, *b])));
    }
    let (step, data) = chunks(data);
    let mut v = RdbVerifier::new(data.len() as u64);
    if data.chunks(step).all(|c| v.update(c).is_ok()) {
        let _ = v.finish();
    }
}

/// A piece manifest as a source streams it: one that decodes describes
/// its snapshot consistently and re-encodes to the same bytes.
pub fn manifest(data: &[u8]) {
    if let Ok(m) = crate::snapshot::manifest::Manifest::decode(data) {
        assert_eq!(m.pieces() as u64, m.info.size.div_ceil(m.piece_size));
        assert_eq!(m.encode(), data);
    }
}

/// A resume journal as found next to a temp file: one that decodes has a
/// bitmap of its piece count and re-encodes to the same bytes.
pub fn journal(data: &[u8]) {
    if let Ok(j) = crate::store::journal::Journal::decode(data) {
        assert_eq!(j.verified.len() as u64, j.size.div_ceil(j.piece_size));
        let again = crate::store::journal::Journal::decode(&j.encode())
            .expect("an encoded journal decodes");
        assert_eq!(again, j);
    }
}
