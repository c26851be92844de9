//! The two ends of a data session, whatever the transport: a replica's
//! [`DataLink`] to the source's data endpoint, and a source's
//! [`Accepted`] connection, each one type over TCP, the emulated fabric and
//! verbs, so the layers above write every step once.
//!
//! Owns dialing (with dead-peer detection, and TLS when the offer asks for
//! it), reading a connection's session proof on the runtime (TCP's first
//! frame, after its TLS handshake when it opens one; the RDMA connect's
//! private data) before anything else is set up for it ([`Proved`]),
//! refusing it, and handing a proved connection to the transport's BLK3
//! driver. What the replica does with the bytes is its [`Sink`]'s business;
//! which session a proof opens is the caller's.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::info;

use super::emulated::EmuQp;
use super::fabric::{Fabric, FabricError};
use super::pace::MinRate;
use super::rdma::{self, RdmaError};
use super::ring;
use super::tcp::{self, CancelHandle, Link, TcpError};
use super::{blocking_data_socket, faults, Serve, Sink, TransportKind, CONNECT_TIMEOUT};
use crate::blk3::token::SESSION_TOKEN_LEN;
use crate::blk3::{Blk3Error, Outcome};
use crate::config::RdmaProvider;

/// A data session's failure below the protocol, on either transport.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The TCP connection failed.
    #[error("data transfer failed: {0}")]
    Tcp(#[from] TcpError),
    /// The RDMA session failed (fabric call or completion).
    #[error("rdma transfer failed: {0}")]
    Rdma(#[from] RdmaError),
}

impl LinkError {
    /// The session was cancelled locally.
    pub fn is_cancelled(&self) -> bool {
        matches!(
            self,
            LinkError::Tcp(TcpError::Cancelled) | LinkError::Rdma(RdmaError::Cancelled)
        )
    }
}

/// Why a data connection could not be set up, on either end.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    /// The TCP socket: connect, its options.
    #[error(transparent)]
    Socket(#[from] std::io::Error),
    /// The TLS handshake.
    #[error(transparent)]
    Tls(#[from] TcpError),
    /// The RDMA connection.
    #[error(transparent)]
    Fabric(#[from] FabricError),
}

/// A session's end: the link's failure, or the protocol's verdict.
pub type SessionResult = Result<Result<Outcome, Blk3Error>, LinkError>;

/// How a replica reaches the source's data endpoint.
pub struct DialSpec {
    /// The endpoint from the offer (RDMA: already mapped off loopback).
    pub endpoint: SocketAddr,
    /// `None` for TCP; the RDMA provider otherwise.
    pub rdma: Option<RdmaProvider>,
    /// How long a silent peer may take before the connection fails.
    pub peer_timeout: Duration,
    /// The floor the bulk must keep (TCP).
    pub min_rate: MinRate,
    /// The local RDMA address (verbs binds it).
    pub local: Option<IpAddr>,
    /// The local RDMA device is a soft device.
    pub soft: bool,
    /// TCP under TLS.
    pub tls: Option<ClientTls>,
}

/// A replica's TLS for one data connection.
#[derive(Clone)]
pub struct ClientTls {
    pub config: Arc<rustls::ClientConfig>,
    /// The name the source's certificate must carry.
    pub name: String,
    /// The records go through the kernel after the handshake.
    pub kernel: bool,
}

/// A replica's connection to the source's data endpoint, not yet running.
pub enum DataLink {
    Tcp(Link),
    Emulated(EmuQp, RdmaSide),
    #[cfg(feature = "rdma")]
    Verbs(super::verbs::VerbsQp, RdmaSide),
}

/// What an RDMA replica session has besides its queue pair.
pub struct RdmaSide {
    cancel: CancellationToken,
    /// How long the source may be silent.
    peer_timeout: Duration,
    min_rate: MinRate,
}

/// Stops a running session from another thread.
#[derive(Clone)]
pub enum Canceller {
    Socket(CancelHandle),
    Token(CancellationToken),
}

impl Canceller {
    pub fn cancel(&self) {
        match self {
            Canceller::Socket(h) => h.cancel(),
            Canceller::Token(t) => t.cancel(),
        }
    }
}

impl DataLink {
    /// Connects to the endpoint (blocking, bounded by the connect timeout).
    pub fn dial(spec: &DialSpec) -> Result<DataLink, DialError> {
        let side = || RdmaSide {
            cancel: CancellationToken::new(),
            peer_timeout: spec.peer_timeout,
            min_rate: spec.min_rate,
        };
        match spec.rdma {
            None => {
                let started = Instant::now();
                let s = std::net::TcpStream::connect_timeout(&spec.endpoint, CONNECT_TIMEOUT)?;
                let handshake = match faults::active().handshake_ms {
                    Some(ms) => Duration::from_millis(ms),
                    None => started.elapsed(),
                };
                super::detect_dead_peer(&s, spec.peer_timeout)?;
                let tls = match &spec.tls {
                    Some(t) => Some((
                        super::tls::connect(&t.config, &t.name, &s, spec.peer_timeout)?,
                        t.kernel,
                    )),
                    None => None,
                };
                let mut link = Link::new(s, spec.min_rate)?;
                link.handshake = Some(handshake);
                Ok(DataLink::Tcp(match tls {
                    Some((conn, kernel)) => link.with_tls(conn, kernel)?,
                    None => link,
                }))
            }
            Some(RdmaProvider::Emulated) => {
                let qp = EmuQp::dial(spec.endpoint, CONNECT_TIMEOUT, faults::active().emu.clone())?;
                qp.set_peer_timeout(spec.peer_timeout)?;
                Ok(DataLink::Emulated(qp, side()))
            }
            #[cfg(feature = "rdma")]
            Some(RdmaProvider::Verbs) => {
                let qp = super::verbs::VerbsQp::dial(spec.endpoint, spec.local, spec.soft)?;
                Ok(DataLink::Verbs(qp, side()))
            }
            #[cfg(not(feature = "rdma"))]
            Some(RdmaProvider::Verbs) => Err(FabricError::NoVerbs.into()),
        }
    }

    /// The round trip its TCP handshake took (connect to accepted), the
    /// path's length before any queue fills: `None` for RDMA.
    pub fn handshake(&self) -> Option<Duration> {
        match self {
            DataLink::Tcp(link) => link.handshake,
            _ => None,
        }
    }

    /// A handle that stops [`DataLink::run`] from another thread.
    pub fn canceller(&self) -> Canceller {
        match self {
            DataLink::Tcp(link) => Canceller::Socket(link.cancel_handle()),
            DataLink::Emulated(_, side) => Canceller::Token(side.cancel.clone()),
            #[cfg(feature = "rdma")]
            DataLink::Verbs(_, side) => Canceller::Token(side.cancel.clone()),
        }
    }

    /// Runs the replica side of BLK3: proves the session with `token` and
    /// receives `offered_len` bytes into `sink`. Also returns which receive
    /// memory RDMA used.
    pub fn run(
        self,
        token: [u8; SESSION_TOKEN_LEN],
        offered_len: u64,
        sink: &mut dyn Sink,
    ) -> (SessionResult, Option<&'static str>) {
        let rdma = |run: rdma::ReplicaRun| (run.result.map_err(LinkError::from), run.memory);
        match self {
            DataLink::Tcp(mut link) => (
                tcp::run_replica(&mut link, token, offered_len, sink).map_err(LinkError::from),
                None,
            ),
            DataLink::Emulated(qp, side) => rdma(rdma::run_replica(
                qp,
                token,
                offered_len,
                sink,
                &faults::active().rdma,
                side.cancel,
                |piece_size| side.min_rate.piece_wait(side.peer_timeout, piece_size),
            )),
            #[cfg(feature = "rdma")]
            DataLink::Verbs(qp, side) => rdma(rdma::run_replica(
                qp,
                token,
                offered_len,
                sink,
                &faults::active().rdma,
                side.cancel,
                |piece_size| side.min_rate.piece_wait(side.peer_timeout, piece_size),
            )),
        }
    }
}

/// A data connection a source accepted, before anything was read from it.
pub enum Accepted {
    Tcp(tokio::net::TcpStream),
    Emulated(tokio::net::TcpStream),
    #[cfg(feature = "rdma")]
    Verbs(Box<super::verbs::VerbsQp>),
}

/// A connection whose session proof was read (on the runtime: no thread,
/// no registered memory, no queue pair yet).
pub struct Proved {
    proof: Vec<u8>,
    conn: ProvedConn,
}

enum ProvedConn {
    /// With the bytes read past the proof.
    Tcp(tokio::net::TcpStream, Vec<u8>),
    Tls(Box<super::tls::ServerStream>, Vec<u8>),
    Emulated(tokio::net::TcpStream),
    #[cfg(feature = "rdma")]
    Verbs(Box<super::verbs::VerbsQp>),
}

/// A session proof that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ProofError {
    #[error(transparent)]
    Tcp(#[from] TcpError),
    #[error(transparent)]
    Fabric(#[from] FabricError),
}

/// An accepted connection whose session is being served.
pub enum SourceLink {
    Tcp(Link),
    Emulated(EmuQp),
    #[cfg(feature = "rdma")]
    Verbs(super::verbs::VerbsQp),
}

impl Accepted {
    /// The transport this connection's session proof must be valid on.
    pub fn kind(&self) -> TransportKind {
        match self {
            Accepted::Tcp(_) => TransportKind::Tcp,
            _ => TransportKind::Rdma,
        }
    }

    /// The peer's address, where the transport tells it.
    pub fn peer_ip(&self) -> Option<IpAddr> {
        match self {
            Accepted::Tcp(s) | Accepted::Emulated(s) => s.peer_addr().ok().map(|a| a.ip()),
            #[cfg(feature = "rdma")]
            Accepted::Verbs(_) => None,
        }
    }

    /// Reads the session proof on the runtime: TCP's first frame (after
    /// the TLS handshake, when the peer opens one and `tls` is set), the
    /// emulated connect request's private data, or the rdma_cm request's.
    /// The caller bounds the wait.
    pub async fn prove(
        self,
        tls: Option<&Arc<rustls::ServerConfig>>,
    ) -> Result<Proved, ProofError> {
        Ok(match self {
            Accepted::Tcp(s) => {
                let io = |source| TcpError::Io {
                    op: "TLS handshake",
                    source,
                };
                match tls {
                    Some(config) if super::tls::opens_with_tls(&s).await.map_err(io)? => {
                        let mut t = super::tls::accept(config, s).await.map_err(io)?;
                        let (token, read_ahead) = tcp::read_hello(&mut t).await?;
                        Proved {
                            proof: token.to_vec(),
                            conn: ProvedConn::Tls(Box::new(t), read_ahead),
                        }
                    }
                    _ => {
                        let mut s = s;
                        let (token, read_ahead) = tcp::read_hello(&mut s).await?;
                        Proved {
                            proof: token.to_vec(),
                            conn: ProvedConn::Tcp(s, read_ahead),
                        }
                    }
                }
            }
            Accepted::Emulated(mut s) => Proved {
                proof: super::emulated::read_request(&mut s).await?,
                conn: ProvedConn::Emulated(s),
            },
            #[cfg(feature = "rdma")]
            Accepted::Verbs(qp) => Proved {
                proof: qp.private_data().to_vec(),
                conn: ProvedConn::Verbs(qp),
            },
        })
    }
}

impl Proved {
    /// The session proof the peer presented.
    pub fn proof(&self) -> &[u8] {
        &self.proof
    }

    /// Whether the connection is encrypted (TLS).
    pub fn encrypted(&self) -> bool {
        matches!(self.conn, ProvedConn::Tls(..))
    }

    /// Refuses the connection with a reason the replica will show.
    pub async fn refuse(self, reason: &str) {
        match self.conn {
            ProvedConn::Tcp(mut s, _) => tcp::refuse(&mut s, reason).await,
            ProvedConn::Tls(mut t, _) => tcp::refuse(&mut *t, reason).await,
            ProvedConn::Emulated(mut s) => super::emulated::reject_request(&mut s, reason).await,
            #[cfg(feature = "rdma")]
            ProvedConn::Verbs(mut qp) => qp.reject(reason),
        }
    }

    /// A proved TCP connection (plain or TLS) as a stream session's end, on
    /// the runtime, failing within `peer_timeout` once the peer is gone;
    /// an RDMA connection is given back.
    pub fn into_stream(
        self,
        peer_timeout: Duration,
    ) -> Result<Result<super::stream::StreamLink, std::io::Error>, Proved> {
        use super::stream::StreamLink;
        Ok(match self.conn {
            ProvedConn::Tcp(s, read_ahead) => super::stream_socket(&s, peer_timeout)
                .map(|()| StreamLink::new(Box::new(s), read_ahead)),
            ProvedConn::Tls(t, read_ahead) => {
                super::stream_socket(t.get_ref().0.get_ref(), peer_timeout)
                    .map(|()| StreamLink::new(t, read_ahead))
            }
            conn => {
                return Err(Proved {
                    proof: self.proof,
                    conn,
                })
            }
        })
    }

    /// Sets up the proved connection for its session on a blocking thread:
    /// the socket (its TLS records in the kernel when `kernel_tls`), the
    /// emulated QP's threads, or the verbs resources.
    pub fn open(
        self,
        peer_timeout: Duration,
        min_rate: MinRate,
        kernel_tls: bool,
    ) -> Result<SourceLink, DialError> {
        Ok(match self.conn {
            ProvedConn::Tcp(s, read_ahead) => {
                let link = Link::new(blocking_data_socket(s, peer_timeout)?, min_rate)?;
                SourceLink::Tcp(link.with_read_ahead(read_ahead))
            }
            ProvedConn::Tls(t, read_ahead) => {
                let (s, conn) = t.into_inner();
                let link = Link::new(
                    blocking_data_socket(s.into_inner(), peer_timeout)?,
                    min_rate,
                )?;
                SourceLink::Tcp(link.with_tls(conn, kernel_tls)?.with_read_ahead(read_ahead))
            }
            ProvedConn::Emulated(s) => SourceLink::Emulated(EmuQp::accepted(
                blocking_data_socket(s, peer_timeout)?,
                self.proof,
                faults::active().emu.clone(),
            )?),
            #[cfg(feature = "rdma")]
            ProvedConn::Verbs(mut qp) => {
                qp.create_resources()?;
                SourceLink::Verbs(*qp)
            }
        })
    }
}

impl SourceLink {
    /// How the link is encrypted: `kernel`, `rustls` or `off`.
    pub fn tls(&self) -> &'static str {
        match self {
            SourceLink::Tcp(link) if link.kernel_tls() => "kernel",
            SourceLink::Tcp(link) if link.user_space_tls() => "rustls",
            _ => "off",
        }
    }

    /// A handle that stops a TCP session from another thread (RDMA
    /// sessions watch [`Serve::cancel`]).
    pub fn canceller(&self) -> Option<Canceller> {
        match self {
            SourceLink::Tcp(link) => Some(Canceller::Socket(link.cancel_handle())),
            _ => None,
        }
    }

    /// Runs the source side of BLK3 for a proved session.
    pub fn serve(self, s: Serve) -> SessionResult {
        match self {
            SourceLink::Tcp(mut link) => Ok(tcp::run_source(&mut link, &s)?),
            SourceLink::Emulated(qp) => serve_rdma(qp, s),
            #[cfg(feature = "rdma")]
            SourceLink::Verbs(qp) => serve_rdma(qp, s),
        }
    }
}

impl SourceLink {
    /// Serves a stream session over an RDMA ring (`None`: this link is
    /// TCP, which a ring session cannot run on); `waker` is handed the
    /// queue pair's waker before the session starts. Returns where the
    /// stream stood.
    pub fn serve_ring<L: std::fmt::Display>(
        self,
        s: ring::RingSource,
        feed: &mut dyn ring::RingFeed<Error = L>,
        waker: impl FnOnce(ring::Waker),
    ) -> Option<(u64, Result<(), ring::RingRunError<L>>)> {
        fn run<F: Fabric, L: std::fmt::Display>(
            mut qp: F,
            s: ring::RingSource,
            feed: &mut dyn ring::RingFeed<Error = L>,
            waker: impl FnOnce(ring::Waker),
        ) -> (u64, Result<(), ring::RingRunError<L>>) {
            match qp.waker() {
                Ok(w) => waker(w),
                Err(e) => return (s.from, Err(e.into())),
            }
            ring::run_source(qp, s, feed)
        }
        match self {
            SourceLink::Tcp(_) => None,
            SourceLink::Emulated(qp) => Some(run(qp, s, feed, waker)),
            #[cfg(feature = "rdma")]
            SourceLink::Verbs(qp) => Some(run(qp, s, feed, waker)),
        }
    }
}

impl DataLink {
    /// Follows a stream session through an RDMA ring (`None`: this link
    /// is TCP); `waker` is handed the queue pair's waker first.
    pub fn run_ring<L: std::fmt::Display>(
        self,
        r: ring::RingReplica,
        sink: &mut dyn ring::RingSink<Error = L>,
        waker: impl FnOnce(ring::Waker),
    ) -> Option<Result<(), ring::RingRunError<L>>> {
        fn run<F: Fabric, L: std::fmt::Display>(
            mut qp: F,
            r: ring::RingReplica,
            sink: &mut dyn ring::RingSink<Error = L>,
            waker: impl FnOnce(ring::Waker),
        ) -> Result<(), ring::RingRunError<L>> {
            waker(qp.waker()?);
            ring::run_replica(qp, r, sink)
        }
        match self {
            DataLink::Tcp(_) => None,
            DataLink::Emulated(qp, _) => Some(run(qp, r, sink, waker)),
            #[cfg(feature = "rdma")]
            DataLink::Verbs(qp, _) => Some(run(qp, r, sink, waker)),
        }
    }
}

fn serve_rdma<F: Fabric>(qp: F, s: Serve) -> SessionResult {
    let provider = qp.provider();
    let bytes = s.snapshot.len();
    let run = rdma::run_source(qp, s);
    info!(
        writes = run.stats.posted,
        signaled = run.stats.signaled,
        bulk_mb_s = run.stats.bulk_mb_s(bytes),
        provider,
        "rdma bulk done"
    );
    Ok(run.result?)
}
