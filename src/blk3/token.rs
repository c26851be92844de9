//! BLK3 control tokens and their wire encoding.
//!
//! A token is a 4-byte ASCII magic and its payload; integers are in network
//! byte order. Over RDMA one Send carries one token; over TCP a token travels
//! in a frame (`u32` length, then the token). Decoding is a pure function:
//! "not enough bytes yet" is `Ok(None)`, never an error.

/// Largest encoded token (RDFL reasons are truncated to fit).
pub const MAX_TOKEN_LEN: usize = 512;
/// Length of the session proof the replica presents first.
pub const SESSION_TOKEN_LEN: usize = 32;
/// Bytes of the TCP frame header.
pub const FRAME_HEADER_LEN: usize = 4;

/// The kind of a token, for expectations and error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Sess,
    Srdy,
    Crea,
    Rdpr,
    Rdgo,
    Blk3,
    Mrin,
    Bdon,
    Rdok,
    Rdfl,
    Replmeta,
    Need,
    Pdon,
    Pack,
    Preq,
    Strm,
    Sepo,
    Sack,
    Sapp,
    Rack,
}

impl Kind {
    /// The 4-byte magic.
    pub fn magic(self) -> &'static [u8; 4] {
        match self {
            Kind::Sess => b"SESS",
            Kind::Srdy => b"SRDY",
            Kind::Crea => b"CREA",
            Kind::Rdpr => b"RDPR",
            Kind::Rdgo => b"RDGO",
            Kind::Blk3 => b"BLK3",
            Kind::Mrin => b"MRIN",
            Kind::Bdon => b"BDON",
            Kind::Rdok => b"RDOK",
            Kind::Rdfl => b"RDFL",
            Kind::Replmeta => b"REPL",
            Kind::Need => b"NEED",
            Kind::Pdon => b"PDON",
            Kind::Pack => b"PACK",
            Kind::Preq => b"PREQ",
            Kind::Strm => b"STRM",
            Kind::Sepo => b"SEPO",
            Kind::Sack => b"SACK",
            Kind::Sapp => b"SAPP",
            Kind::Rack => b"RACK",
        }
    }

    fn from_magic(m: &[u8]) -> Option<Kind> {
        const ALL: [Kind; 20] = [
            Kind::Sess,
            Kind::Srdy,
            Kind::Crea,
            Kind::Rdpr,
            Kind::Rdgo,
            Kind::Blk3,
            Kind::Mrin,
            Kind::Bdon,
            Kind::Rdok,
            Kind::Rdfl,
            Kind::Replmeta,
            Kind::Need,
            Kind::Pdon,
            Kind::Pack,
            Kind::Preq,
            Kind::Strm,
            Kind::Sepo,
            Kind::Sack,
            Kind::Sapp,
            Kind::Rack,
        ];
        ALL.into_iter().find(|k| k.magic() == m)
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kind::Replmeta => f.write_str("REPLMETA"),
            Kind::Mrin => f.write_str("MRINFO"),
            k => f.write_str(std::str::from_utf8(k.magic()).expect("ascii magic")),
        }
    }
}

/// A BLK3 control token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Token {
    /// Replica → source, first: proves the session (TCP first frame; RDMA
    /// connect private data).
    Sess { token: [u8; SESSION_TOKEN_LEN] },
    /// Source → replica: ready.
    Srdy,
    /// Replica → source: connection established.
    Crea,
    /// Replica → source: replica ready for the transfer.
    Rdpr,
    /// Source → replica: go.
    Rdgo,
    /// Source → replica: snapshot length, before the source registers it.
    Blk3 { len: u64 },
    /// Replica → source: where to write (RDMA), or "ready" with addr/rkey 0 (TCP).
    Mrin { addr: u64, rkey: u32, len: u64 },
    /// Source → replica: every byte written.
    Bdon,
    /// Replica → source: checksum verified.
    Rdok,
    /// Replica → source (or a refusing source → replica): failure, with reason.
    Rdfl { reason: String },
    /// Source → replica: the snapshot's sequence number M.
    Replmeta { seq: u64 },
    /// Replica → source, after MRINFO: the pieces to send, as ranges of
    /// `(first, count)` in ascending order (at most [`MAX_NEED_RANGES`]).
    Need { ranges: Vec<(u32, u32)> },
    /// Source → replica: piece `index` is in your memory (RDMA: sent
    /// after its writes, which RC delivers first) or follows (TCP).
    Pdon { index: u32 },
    /// Replica → source: piece `index` matched the manifest (one credit back).
    Pack { index: u32 },
    /// Replica → source: piece `index` did not; send it again (one credit back).
    Preq { index: u32 },
    /// Stream source → replica: `len` bytes of the replication stream from
    /// `offset` follow (TCP), under the session's MAC (`blk3::stream`).
    Strm {
        offset: u64,
        len: u32,
        mac: [u8; 32],
    },
    /// Stream source → replica: from `offset` on, the stream is of
    /// replication id `replid` (the primary restarted or was promoted).
    Sepo {
        offset: u64,
        replid: [u8; REPLID_LEN],
        mac: [u8; 32],
    },
    /// Stream replica → source: the replica's log holds the stream up to
    /// `offset` (credits back), under the session's MAC.
    Sack { offset: u64, mac: [u8; 32] },
    /// Stream replica → source: the servers fed from the replica's log
    /// (its own server, and those of the agents it serves) have applied
    /// the stream up to `offset`, the lowest of their acknowledgements,
    /// under the session's MAC.
    Sapp { offset: u64, mac: [u8; 32] },
    /// Replica → source over an RDMA ring: the answer to one message, with
    /// what the log holds (credit) and what the servers fed from it applied.
    Rack { acked: u64, applied: u64 },
}

/// Bytes of a Redis replication id.
pub const REPLID_LEN: usize = 40;

/// Most ranges one NEED carries (more are merged, asking for a few
/// verified pieces again).
pub const MAX_NEED_RANGES: usize = 60;

/// Why bytes are not a token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// The first four bytes are no BLK3 magic.
    #[error("unknown token magic {0:?}")]
    UnknownMagic(String),
    /// The payload has the wrong length for the token.
    #[error("{kind} token has {got} payload bytes, expected {expected}")]
    BadLength {
        kind: Kind,
        got: usize,
        expected: usize,
    },
    /// The REPLMETA line is malformed.
    #[error("malformed REPLMETA line {0:?}")]
    BadReplmeta(String),
    /// A frame longer than any token.
    #[error("frame of {0} bytes exceeds the {MAX_TOKEN_LEN}-byte limit")]
    FrameTooLong(usize),
}

impl Token {
    pub fn kind(&self) -> Kind {
        match self {
            Token::Sess { .. } => Kind::Sess,
            Token::Srdy => Kind::Srdy,
            Token::Crea => Kind::Crea,
            Token::Rdpr => Kind::Rdpr,
            Token::Rdgo => Kind::Rdgo,
            Token::Blk3 { .. } => Kind::Blk3,
            Token::Mrin { .. } => Kind::Mrin,
            Token::Bdon => Kind::Bdon,
            Token::Rdok => Kind::Rdok,
            Token::Rdfl { .. } => Kind::Rdfl,
            Token::Replmeta { .. } => Kind::Replmeta,
            Token::Need { .. } => Kind::Need,
            Token::Pdon { .. } => Kind::Pdon,
            Token::Pack { .. } => Kind::Pack,
            Token::Preq { .. } => Kind::Preq,
            Token::Strm { .. } => Kind::Strm,
            Token::Sepo { .. } => Kind::Sepo,
            Token::Sack { .. } => Kind::Sack,
            Token::Sapp { .. } => Kind::Sapp,
            Token::Rack { .. } => Kind::Rack,
        }
    }

    /// Encodes the token (one RDMA Send payload).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(24);
        match self {
            Token::Replmeta { seq } => {
                out.extend_from_slice(format!("REPLMETA {seq}\n").as_bytes());
                return out;
            }
            t => out.extend_from_slice(t.kind().magic()),
        }
        match self {
            Token::Sess { token } => out.extend_from_slice(token),
            Token::Blk3 { len } => out.extend_from_slice(&len.to_be_bytes()),
            Token::Mrin { addr, rkey, len } => {
                out.extend_from_slice(&addr.to_be_bytes());
                out.extend_from_slice(&rkey.to_be_bytes());
                out.extend_from_slice(&len.to_be_bytes());
            }
            Token::Rdfl { reason } => {
                let mut end = reason.len().min(MAX_TOKEN_LEN - 4);
                while !reason.is_char_boundary(end) {
                    end -= 1;
                }
                out.extend_from_slice(&reason.as_bytes()[..end]);
            }
            Token::Need { ranges } => {
                for (first, count) in ranges.iter().take(MAX_NEED_RANGES) {
                    out.extend_from_slice(&first.to_be_bytes());
                    out.extend_from_slice(&count.to_be_bytes());
                }
            }
            Token::Pdon { index } | Token::Pack { index } | Token::Preq { index } => {
                out.extend_from_slice(&index.to_be_bytes())
            }
            Token::Strm { offset, len, mac } => {
                out.extend_from_slice(&offset.to_be_bytes());
                out.extend_from_slice(&len.to_be_bytes());
                out.extend_from_slice(mac);
            }
            Token::Sepo {
                offset,
                replid,
                mac,
            } => {
                out.extend_from_slice(&offset.to_be_bytes());
                out.extend_from_slice(replid);
                out.extend_from_slice(mac);
            }
            Token::Sack { offset, mac } | Token::Sapp { offset, mac } => {
                out.extend_from_slice(&offset.to_be_bytes());
                out.extend_from_slice(mac);
            }
            Token::Rack { acked, applied } => {
                out.extend_from_slice(&acked.to_be_bytes());
                out.extend_from_slice(&applied.to_be_bytes());
            }
            _ => {}
        }
        out
    }

    /// Decodes exactly one token (an RDMA receive, or a frame's body).
    pub fn decode(b: &[u8]) -> Result<Token, TokenError> {
        if b.len() < 4 {
            return Err(TokenError::UnknownMagic(
                String::from_utf8_lossy(b).into_owned(),
            ));
        }
        let kind = Kind::from_magic(&b[..4]).ok_or_else(|| {
            TokenError::UnknownMagic(String::from_utf8_lossy(&b[..4]).into_owned())
        })?;
        let p = &b[4..];
        let exact = |n: usize| {
            if p.len() == n {
                Ok(())
            } else {
                Err(TokenError::BadLength {
                    kind,
                    got: p.len(),
                    expected: n,
                })
            }
        };
        let be64 = |s: &[u8]| u64::from_be_bytes(s.try_into().expect("8 bytes"));
        let be32 = |s: &[u8]| u32::from_be_bytes(s.try_into().expect("4 bytes"));
        Ok(match kind {
            Kind::Sess => {
                exact(SESSION_TOKEN_LEN)?;
                Token::Sess {
                    token: p.try_into().expect("checked length"),
                }
            }
            Kind::Srdy => exact(0).map(|_| Token::Srdy)?,
            Kind::Crea => exact(0).map(|_| Token::Crea)?,
            Kind::Rdpr => exact(0).map(|_| Token::Rdpr)?,
            Kind::Rdgo => exact(0).map(|_| Token::Rdgo)?,
            Kind::Bdon => exact(0).map(|_| Token::Bdon)?,
            Kind::Rdok => exact(0).map(|_| Token::Rdok)?,
            Kind::Blk3 => {
                exact(8)?;
                Token::Blk3 { len: be64(p) }
            }
            Kind::Mrin => {
                exact(20)?;
                Token::Mrin {
                    addr: be64(&p[..8]),
                    rkey: u32::from_be_bytes(p[8..12].try_into().expect("4 bytes")),
                    len: be64(&p[12..20]),
                }
            }
            Kind::Need => {
                if !p.len().is_multiple_of(8) || p.len() / 8 > MAX_NEED_RANGES {
                    return Err(TokenError::BadLength {
                        kind,
                        got: p.len(),
                        expected: 8 * (p.len() / 8).min(MAX_NEED_RANGES),
                    });
                }
                Token::Need {
                    ranges: p
                        .chunks_exact(8)
                        .map(|r| (be32(&r[..4]), be32(&r[4..])))
                        .collect(),
                }
            }
            Kind::Pdon | Kind::Pack | Kind::Preq => {
                exact(4)?;
                let index = be32(p);
                match kind {
                    Kind::Pdon => Token::Pdon { index },
                    Kind::Pack => Token::Pack { index },
                    _ => Token::Preq { index },
                }
            }
            Kind::Strm => {
                exact(44)?;
                Token::Strm {
                    offset: be64(&p[..8]),
                    len: be32(&p[8..12]),
                    mac: p[12..].try_into().expect("checked length"),
                }
            }
            Kind::Sepo => {
                exact(8 + REPLID_LEN + 32)?;
                Token::Sepo {
                    offset: be64(&p[..8]),
                    replid: p[8..8 + REPLID_LEN].try_into().expect("checked length"),
                    mac: p[8 + REPLID_LEN..].try_into().expect("checked length"),
                }
            }
            Kind::Sack | Kind::Sapp => {
                exact(8 + 32)?;
                let offset = be64(&p[..8]);
                let mac = p[8..].try_into().expect("checked length");
                match kind {
                    Kind::Sack => Token::Sack { offset, mac },
                    _ => Token::Sapp { offset, mac },
                }
            }
            Kind::Rack => {
                exact(16)?;
                Token::Rack {
                    acked: be64(&p[..8]),
                    applied: be64(&p[8..]),
                }
            }
            Kind::Rdfl => Token::Rdfl {
                reason: String::from_utf8_lossy(p).into_owned(),
            },
            Kind::Replmeta => {
                let line = std::str::from_utf8(b)
                    .map_err(|_| TokenError::BadReplmeta(format!("{b:?}")))?;
                let bad = || TokenError::BadReplmeta(line.to_string());
                let rest = line.strip_prefix("REPLMETA ").ok_or_else(bad)?;
                let digits = rest.strip_suffix('\n').ok_or_else(bad)?;
                if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_digit()) {
                    return Err(bad());
                }
                Token::Replmeta {
                    seq: digits.parse().map_err(|_| bad())?,
                }
            }
        })
    }

    /// Encodes the token as a TCP frame.
    pub fn encode_frame(&self) -> Vec<u8> {
        let body = self.encode();
        let mut out = Vec::with_capacity(FRAME_HEADER_LEN + body.len());
        out.extend_from_slice(&(body.len() as u32).to_be_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// Decodes one frame from the front of `buf`: `Ok(None)` when more bytes
    /// are needed, else the token and the bytes it used.
    pub fn decode_frame(buf: &[u8]) -> Result<Option<(Token, usize)>, TokenError> {
        if buf.len() < FRAME_HEADER_LEN {
            return Ok(None);
        }
        let len = u32::from_be_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
        if len > MAX_TOKEN_LEN {
            return Err(TokenError::FrameTooLong(len));
        }
        if buf.len() < FRAME_HEADER_LEN + len {
            return Ok(None);
        }
        let token = Token::decode(&buf[FRAME_HEADER_LEN..FRAME_HEADER_LEN + len])?;
        Ok(Some((token, FRAME_HEADER_LEN + len)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn all_tokens() -> Vec<Token> {
        vec![
            Token::Sess {
                token: [7; SESSION_TOKEN_LEN],
            },
            Token::Srdy,
            Token::Crea,
            Token::Rdpr,
            Token::Rdgo,
            Token::Blk3 { len: 5 << 32 },
            Token::Mrin {
                addr: 0xdead_beef_0000,
                rkey: 0x1234,
                len: 1 << 33,
            },
            Token::Bdon,
            Token::Rdok,
            Token::Rdfl {
                reason: "checksum mismatch".into(),
            },
            Token::Replmeta { seq: u64::MAX },
            Token::Need {
                ranges: vec![(0, 3), (9, u32::MAX - 9)],
            },
            Token::Need { ranges: vec![] },
            Token::Pdon { index: 7 },
            Token::Pack { index: u32::MAX },
            Token::Preq { index: 0 },
            Token::Strm {
                offset: u64::MAX,
                len: 7,
                mac: [3; 32],
            },
            Token::Sepo {
                offset: 9,
                replid: [b'a'; REPLID_LEN],
                mac: [4; 32],
            },
            Token::Sack {
                offset: 1 << 40,
                mac: [4; 32],
            },
            Token::Sapp {
                offset: 3,
                mac: [5; 32],
            },
            Token::Rack {
                acked: 9,
                applied: 4,
            },
        ]
    }

    #[test]
    fn round_trip_every_token() {
        for t in all_tokens() {
            assert_eq!(Token::decode(&t.encode()).unwrap(), t);
            let frame = t.encode_frame();
            assert_eq!(
                Token::decode_frame(&frame).unwrap(),
                Some((t.clone(), frame.len()))
            );
            // Every strict prefix of a frame asks for more bytes.
            for cut in 0..frame.len() {
                assert_eq!(Token::decode_frame(&frame[..cut]).unwrap(), None);
            }
        }
    }

    #[test]
    fn wire_layout_is_network_byte_order() {
        let m = Token::Mrin {
            addr: 1,
            rkey: 2,
            len: 3,
        }
        .encode();
        assert_eq!(&m[..4], b"MRIN");
        assert_eq!(&m[4..12], &[0, 0, 0, 0, 0, 0, 0, 1]);
        assert_eq!(&m[12..16], &[0, 0, 0, 2]);
        assert_eq!(&m[16..24], &[0, 0, 0, 0, 0, 0, 0, 3]);
        assert_eq!(Token::Replmeta { seq: 42 }.encode(), b"REPLMETA 42\n");
    }

    #[test]
    fn corruption_is_rejected() {
        assert!(matches!(
            Token::decode(b"XXXX"),
            Err(TokenError::UnknownMagic(_))
        ));
        assert!(matches!(
            Token::decode(b"BL"),
            Err(TokenError::UnknownMagic(_))
        ));
        assert!(matches!(
            Token::decode(b"BLK3\0\0\0"),
            Err(TokenError::BadLength { .. })
        ));
        assert!(matches!(
            Token::decode(b"SRDYx"),
            Err(TokenError::BadLength { .. })
        ));
        assert!(matches!(
            Token::decode(b"MRIN\0"),
            Err(TokenError::BadLength { .. })
        ));
        assert!(matches!(
            Token::decode(b"NEED\0\0\0\0\0\0\0"),
            Err(TokenError::BadLength { .. })
        ));
        let mut long = b"NEED".to_vec();
        long.resize(4 + 8 * (MAX_NEED_RANGES + 1), 0);
        assert!(matches!(
            Token::decode(&long),
            Err(TokenError::BadLength { .. })
        ));
        assert!(matches!(
            Token::decode(b"PDON\0\0\0"),
            Err(TokenError::BadLength { .. })
        ));
        for bad in [
            &b"REPLMETA \n"[..],
            b"REPLMETA 12",
            b"REPLMETA -1\n",
            b"REPLMETA 99999999999999999999999\n",
            b"REPLxx 1\n",
        ] {
            assert!(
                matches!(Token::decode(bad), Err(TokenError::BadReplmeta(_))),
                "{bad:?}"
            );
        }
        let mut frame = vec![0xff, 0xff, 0, 0];
        frame.extend_from_slice(b"SRDY");
        assert!(matches!(
            Token::decode_frame(&frame),
            Err(TokenError::FrameTooLong(_))
        ));
    }

    #[test]
    fn long_rdfl_reason_is_truncated_to_fit() {
        let t = Token::Rdfl {
            reason: "é".repeat(600),
        };
        let enc = t.encode();
        assert!(enc.len() <= MAX_TOKEN_LEN);
        assert!(
            matches!(Token::decode(&enc).unwrap(), Token::Rdfl { reason } if reason.starts_with('é'))
        );
    }

    proptest! {
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Token::decode(&bytes);
            let _ = Token::decode_frame(&bytes);
        }

        #[test]
        fn numeric_tokens_round_trip(addr in any::<u64>(), rkey in any::<u32>(), len in any::<u64>(), seq in any::<u64>()) {
            for t in [Token::Mrin { addr, rkey, len }, Token::Blk3 { len }, Token::Replmeta { seq }] {
                prop_assert_eq!(Token::decode(&t.encode()).unwrap(), t);
            }
        }
    }
}
