//! What the fuzz targets run (`fuzz/`, driven by `scripts/fuzz.sh`) and what
//! the test suite replays their kept inputs through (`fuzz/regressions/`):
//! every decoder that reads bytes from a peer, a snapshot or a resume
//! journal. Bad
//! input must come back as an error; a panic here is a bug.

use crate::blk3::ring::{Header, RingReceiver, HEADER_LEN as RING_HEADER_LEN, PRODUCER_LEN};
use crate::blk3::stream::{ack_mac, data_mac, epoch_mac, Receiver, Sender, STREAM_KEY_LEN};
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
    ("stream_session", stream_session),
    ("ring_spans", ring_spans),
    ("getack", getack),
    ("log_files", log_files),
    ("primary_replies", primary_replies),
    ("upstreams_file", upstreams_file),
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

/// The key of the fuzzed stream sessions.
const KEY: [u8; STREAM_KEY_LEN] = [7; STREAM_KEY_LEN];

/// A MAC the fuzzer cannot forge: an odd first byte asks for the right one
/// (`right`), so the session's paths past the MAC are fuzzed too.
fn mac_or(mac: [u8; 32], right: impl FnOnce() -> [u8; 32]) -> [u8; 32] {
    match mac[0] & 1 {
        1 => right(),
        _ => mac,
    }
}

/// A stream session's peers' words (`STRM` with its bytes, `SEPO` to the
/// replica; `SACK`, `SAPP` to the source), in frames as the link reads
/// them: each is refused, or moves its session only as far as the rules
/// let it (within the window, never back, never past what was sent).
pub fn stream_session(data: &[u8]) {
    let (from, window) = (1000, 1 << 16);
    let (mut rx, mut tx) = (
        Receiver::new(KEY, from, window),
        Sender::new(KEY, from, window),
    );
    let mut rest = data;
    while let Ok(Some((token, used))) = Token::decode_frame(rest) {
        rest = &rest[used..];
        match token {
            Token::Strm { offset, len, mac } => {
                let n = (len as usize).min(rest.len());
                let (bytes, after) = rest.split_at(n);
                rest = after;
                let mac = mac_or(mac, || data_mac(&KEY, offset, bytes));
                let before = rx.next();
                match rx.accept(offset, bytes, &mac) {
                    Ok(()) => assert_eq!(rx.next(), before + n as u64),
                    Err(_) => assert_eq!(rx.next(), before),
                }
                // The source sends what it may of the same bytes.
                let _ = tx.frame(bytes);
            }
            Token::Sepo {
                offset,
                replid,
                mac,
            } => {
                let mac = mac_or(mac, || epoch_mac(&KEY, offset, &replid));
                let _ = rx.epoch(offset, &replid, &mac);
            }
            Token::Sack { offset, mac } => {
                let before = tx.acked();
                let mac = mac_or(mac, || ack_mac(&KEY, b"SACK", offset));
                if tx.on_sack(offset, &mac).is_ok() {
                    assert!(before <= tx.acked() && tx.acked() <= tx.sent());
                }
                let _ = rx.ack();
            }
            Token::Sapp { offset, mac } => {
                let mac = mac_or(mac, || ack_mac(&KEY, b"SAPP", offset));
                if let Ok(applied) = tx.on_sapp(offset, &mac) {
                    assert!(applied <= tx.acked());
                }
                let _ = rx.applied(offset);
            }
            _ => {}
        }
        assert!(rx.unacked() <= window);
        assert!(tx.sent() - tx.acked() <= window);
    }
}

/// A ring session as the replica takes it: each `STRM` read with the
/// header the ring's memory holds (32 bytes from the input; an odd first
/// byte asks for a well-formed one), its span placed only inside the ring
/// and its bytes accepted only under their MAC.
pub fn ring_spans(data: &[u8]) {
    let size = crate::blk3::ring::MIN_RING;
    let Ok(mut rx) = RingReceiver::new(KEY, 0, 1 << 20, size) else {
        return;
    };
    let mut rest = data;
    while let Ok(Some((token, used))) = Token::decode_frame(rest) {
        rest = &rest[used..];
        let Some((raw, after)) = rest.split_first_chunk::<PRODUCER_LEN>() else {
            return;
        };
        rest = after;
        match token {
            Token::Strm { offset, len, mac } => {
                let header = match raw[0] & 1 {
                    1 => Header::read(&Header::producer(
                        size,
                        offset.saturating_add(u64::from(len)),
                    )),
                    _ => Header::read(raw),
                };
                let Ok(writes) = rx.on_span(offset, len, &header) else {
                    continue;
                };
                let placed: usize = writes.iter().map(|w| w.len).sum();
                assert_eq!(placed, len as usize);
                for w in &writes {
                    assert!(
                        w.to >= RING_HEADER_LEN && w.to + w.len as u64 <= RING_HEADER_LEN + size
                    );
                }
                let n = (len as usize).min(rest.len());
                let (bytes, after) = rest.split_at(n);
                rest = after;
                let mac = mac_or(mac, || data_mac(&KEY, offset, bytes));
                let _ = rx.accept(offset, bytes, &mac);
            }
            Token::Sepo {
                offset,
                replid,
                mac,
            } => {
                let mac = mac_or(mac, || epoch_mac(&KEY, offset, &replid));
                let _ = rx.epoch(offset, &replid, &mac);
            }
            _ => {
                let _ = rx.answer(Some(u64::from(raw[1])), raw[2] & 1 == 1);
            }
        }
    }
}

/// The `REPLCONF GETACK` scanner of the primary's stream, fed the input in
/// reads of the sizes its first byte picks: it finds the request exactly
/// when the whole stream so far holds one that the reads before missed.
pub fn getack(data: &[u8]) {
    let (step, data) = chunks(data);
    let mut tail = Vec::new();
    for (i, read) in data.chunks(step).enumerate() {
        let seen = &data[..i * step];
        let so_far = &data[..i * step + read.len()];
        let found = |b: &[u8]| memchr::memmem::find(b, crate::stream::follow::GETACK).is_some();
        let asked = crate::stream::follow::asks_for_ack(&mut tail, read);
        // A request that straddles the reads, or lies in this one.
        let new = found(so_far) && (!found(seen) || found(read));
        if new {
            assert!(asked, "a GETACK across reads is seen");
        }
    }
}

/// A stream log's directory as the agent finds it at start: the input
/// split (at its first two bytes) into a segment file and `history.json`.
/// Opening it never fails on what the files hold: a damaged file is set
/// aside, a torn tail cut; the log it opens reads back whole or refuses a
/// damaged record with an error.
pub fn log_files(data: &[u8]) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static RUN: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kvsync-fuzz-log-{}-{}",
        std::process::id(),
        RUN.fetch_add(1, Ordering::Relaxed)
    ));
    let split = match data {
        [a, b, ..] => usize::from(u16::from_le_bytes([*a, *b])).min(data.len() - 2),
        _ => 0,
    };
    let (segment, history) = data.get(2..).unwrap_or_default().split_at(split);
    std::fs::create_dir_all(&dir).expect("fuzz dir");
    std::fs::write(dir.join("00000000000000001000.kvslog"), segment).expect("segment");
    std::fs::write(dir.join("history.json"), history).expect("history");
    let log = crate::stream::log::Log::open(crate::config::StreamConfig {
        dir: dir.clone(),
        ..Default::default()
    });
    match log {
        Ok(log) => {
            if let (Some(first), Some((_, end))) = (log.first(), log.position()) {
                let mut at = first;
                while at < end {
                    let Ok(plan) = log.plan(at) else { break };
                    match crate::stream::log::read(&plan, 1 << 20) {
                        Ok(records) if !records.is_empty() => {
                            at = records.last().expect("a record").end();
                        }
                        _ => break,
                    }
                }
            }
        }
        Err(e) => panic!("a log directory of damaged files fails to open: {e}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// What a primary tells the stream's follower, as the follower reads it:
/// the input is the offset and length a fetch asks for (8 bytes each), a
/// split (2 bytes), lines read as `resp::read_line` reads them (each taken
/// as the answer to `PSYNC`), and an `INFO replication` text. An answer
/// moves the log only as its words say; `INFO` is read for a promotion
/// and a backlog without overflow, and a fetch is asked only for a range
/// that the backlog, as described, holds.
pub fn primary_replies(data: &[u8]) {
    use crate::stream::policy::{self, LogStep, Promotion, Psync};
    let Some((head, rest)) = data.split_first_chunk::<18>() else {
        return;
    };
    let offset = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
    let len = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
    let split = usize::from(u16::from_le_bytes([head[16], head[17]])).min(rest.len());
    let (lines, text) = rest.split_at(split);
    let info = crate::kv::redis::Info::parse(&String::from_utf8_lossy(text));
    let promoted = Promotion::from_info(&info);
    let asked = (offset & 1 == 1).then(|| ("id".to_string(), offset));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    let mut read = tokio::io::BufReader::new(lines);
    while let Ok(line) = runtime.block_on(crate::kv::resp::read_line(&mut read, 256)) {
        assert!(line.len() <= 256, "a line over its bound");
        let first = line.split_whitespace().next();
        match policy::psync(&line, asked.clone(), promoted.as_ref(), offset & 2 == 2) {
            Psync::FullResync { .. } => assert_eq!(first, Some("+FULLRESYNC")),
            Psync::Continue { now, later } => {
                assert_eq!(first, Some("+CONTINUE"));
                let (id, start) = asked.clone().expect("a continuation of what was asked");
                if let LogStep::Restart(at_id, at) = now {
                    assert_eq!((at_id, at), (id, start), "an empty log starts where asked");
                }
                if let Some((_, at)) = later {
                    assert!(at > start, "a later switch lies past the start");
                }
            }
            Psync::Refused => {}
        }
    }
    if policy::backlog_holds(&info, "id", offset, len).is_ok() {
        let first = u128::from(info.num("repl_backlog_first_byte_offset"));
        let end = first + u128::from(info.num("repl_backlog_histlen"));
        assert!(u128::from(offset) + 1 >= first, "asked before the backlog");
        assert!(
            u128::from(offset) + u128::from(len) <= end,
            "asked past the backlog"
        );
    }
}

/// A log directory's `upstreams.json` as the agent finds it at start: the
/// source it opens with is the configured one, or one kept in the file
/// in the shape a change of source gives it.
pub fn upstreams_file(data: &[u8]) {
    use crate::stream::source::{Source, Upstreams, SOURCE_FILE};
    let dir = tempfile::tempdir().expect("fuzz dir");
    std::fs::write(dir.path().join(SOURCE_FILE), data).expect("upstreams file");
    let configured = Source::Agents(vec!["origin:1".to_string()]);
    let source = Upstreams::open(dir.path(), configured.clone()).source();
    if source != configured {
        match source {
            Source::Primary(addr) => assert!(!addr.is_empty(), "an empty primary kept"),
            Source::Agents(chain) => {
                assert!((1..=crate::stream::source::MAX_CHAIN).contains(&chain.len()));
                assert!(chain.iter().all(|u| crate::rpc::dial::is_agent_addr(u)));
            }
        }
    }
}
