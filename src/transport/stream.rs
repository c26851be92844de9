//! A stream session's connection: BLK3 tokens in frames (`u32` length, then
//! the token) over plain or TLS TCP, driven by the runtime (a session lives
//! as long as the replica follows and is mostly idle, so it holds no
//! thread), with a `STRM` frame's bytes right after its token. The replica
//! dials and proves its session (`SESS` first, as for snapshots); the
//! source's end comes from the one serve loop once proved
//! (`session::Proved::into_stream`). What the frames mean is
//! `blk3::stream`'s.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::blk3::token::{FRAME_HEADER_LEN, SESSION_TOKEN_LEN};
use crate::blk3::{Token, TokenError};
use crate::rpc::dial::CONNECT_TIMEOUT;

/// What a stream session runs over: a TCP connection, or TLS over one.
pub trait ByteStream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> ByteStream for T {}

/// Why a stream connection failed.
#[derive(Debug, thiserror::Error)]
pub enum StreamLinkError {
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        source: std::io::Error,
    },
    #[error("bad frame from peer: {0}")]
    Frame(#[from] TokenError),
    #[error("the peer closed the connection")]
    Closed,
    #[error("TLS with the source's data endpoint: {0}")]
    Tls(String),
}

fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> StreamLinkError {
    move |source| StreamLinkError::Io { op, source }
}

/// One end of a stream session's connection.
pub struct StreamLink {
    io: Box<dyn ByteStream>,
    /// Bytes read and not yet taken.
    buf: Vec<u8>,
}

/// TLS of a replica's stream connection: the agent's client settings and
/// the name the source's certificate must carry.
pub struct StreamTls {
    pub config: Arc<rustls::ClientConfig>,
    pub name: String,
}

impl StreamLink {
    /// An end over `io`, which already read `read_ahead` past the proof.
    pub fn new(io: Box<dyn ByteStream>, read_ahead: Vec<u8>) -> StreamLink {
        StreamLink {
            io,
            buf: read_ahead,
        }
    }

    /// The replica's end: connects to the source's data endpoint (TLS when
    /// `tls`), makes a dead source fail within `peer_timeout`, and proves
    /// the session with `token`.
    pub async fn dial(
        endpoint: SocketAddr,
        tls: Option<&StreamTls>,
        token: &[u8; SESSION_TOKEN_LEN],
        peer_timeout: Duration,
    ) -> Result<StreamLink, StreamLinkError> {
        let tcp = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(endpoint))
            .await
            .map_err(|_| io("connect")(std::io::ErrorKind::TimedOut.into()))?
            .map_err(io("connect"))?;
        super::stream_socket(&tcp, peer_timeout).map_err(io("connect"))?;
        let io: Box<dyn ByteStream> = match tls {
            None => Box::new(tcp),
            Some(t) => {
                let name = ServerName::try_from(t.name.clone()).map_err(|_| {
                    StreamLinkError::Tls(format!("{:?} is not a valid server name", t.name))
                })?;
                let connect = tokio_rustls::TlsConnector::from(t.config.clone()).connect(name, tcp);
                let stream = tokio::time::timeout(peer_timeout, connect)
                    .await
                    .map_err(|_| io("TLS handshake")(std::io::ErrorKind::TimedOut.into()))?
                    .map_err(|e| match e.kind() {
                        std::io::ErrorKind::InvalidData => StreamLinkError::Tls(e.to_string()),
                        _ => io("TLS handshake")(e),
                    })?;
                Box::new(stream)
            }
        };
        let mut link = StreamLink::new(io, Vec::new());
        link.send(&Token::Sess { token: *token }).await?;
        Ok(link)
    }

    /// Sends one token.
    pub async fn send(&mut self, t: &Token) -> Result<(), StreamLinkError> {
        self.send_with(t, &[]).await
    }

    /// Sends a token and the bytes that follow it (a `STRM` frame's).
    pub async fn send_with(&mut self, t: &Token, bytes: &[u8]) -> Result<(), StreamLinkError> {
        let frame = t.encode_frame();
        self.io.write_all(&frame).await.map_err(io("send"))?;
        if !bytes.is_empty() {
            self.io.write_all(bytes).await.map_err(io("send"))?;
        }
        self.io.flush().await.map_err(io("send"))
    }

    /// The next token. Cancel-safe: what a cancelled call read stays for
    /// the next one.
    pub async fn next_token(&mut self) -> Result<Token, StreamLinkError> {
        loop {
            if let Some((t, used)) = Token::decode_frame(&self.buf)? {
                self.buf.drain(..used);
                return Ok(t);
            }
            self.fill().await?;
        }
    }

    /// The `n` bytes after a token (not cancel-safe).
    pub async fn read_bytes(&mut self, n: usize) -> Result<Vec<u8>, StreamLinkError> {
        while self.buf.len() < n {
            self.fill().await?;
        }
        let rest = self.buf.split_off(n);
        Ok(std::mem::replace(&mut self.buf, rest))
    }

    async fn fill(&mut self) -> Result<(), StreamLinkError> {
        self.buf.reserve(FRAME_HEADER_LEN.max(64 << 10));
        match self.io.read_buf(&mut self.buf).await.map_err(io("read"))? {
            0 => Err(StreamLinkError::Closed),
            _ => Ok(()),
        }
    }

    /// Refuses or ends the session with a reason the peer will show.
    pub async fn fail(mut self, reason: &str) {
        let _ = self
            .send(&Token::Rdfl {
                reason: reason.to_string(),
            })
            .await;
        let _ = self.io.shutdown().await;
    }
}
