//! Counting connections, in total and per peer address, against limits.
//!
//! Owns one rule used by both listeners that anyone on the network can
//! reach: the data plane caps connections still proving their session, the
//! gRPC server caps open connections. A [`Slot`] is one connection's place
//! and is given back when it drops; [`Counted`] carries a slot inside a
//! connection's IO, so the place is held exactly as long as the connection.

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// At most `total` connections, and `per_peer` from one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub total: usize,
    pub per_peer: usize,
}

/// Which limit a refused connection met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Over {
    Total,
    PerPeer,
}

/// The connections counted now, in total and by peer address (`None`:
/// a transport that does not tell the address).
pub struct Counter {
    limits: Limits,
    counts: Mutex<(usize, HashMap<Option<IpAddr>, usize>)>,
}

/// One connection's place; given back on drop.
pub struct Slot {
    counter: Arc<Counter>,
    peer: Option<IpAddr>,
}

impl Counter {
    pub fn new(limits: Limits) -> Arc<Counter> {
        Arc::new(Counter {
            limits,
            counts: Mutex::default(),
        })
    }

    /// A place for a connection from `peer`, or the limit it met. The check
    /// and the count are one step.
    pub fn admit(self: &Arc<Self>, peer: Option<IpAddr>) -> Result<Slot, Over> {
        let mut counts = self.counts.lock().expect("connection counts lock");
        let (total, by_peer) = &mut *counts;
        if *total >= self.limits.total {
            return Err(Over::Total);
        }
        let from_peer = by_peer.entry(peer).or_insert(0);
        if *from_peer >= self.limits.per_peer {
            return Err(Over::PerPeer);
        }
        *from_peer += 1;
        *total += 1;
        Ok(Slot {
            counter: self.clone(),
            peer,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut counts = self.counter.counts.lock().expect("connection counts lock");
        let (total, by_peer) = &mut *counts;
        *total -= 1;
        if let Some(n) = by_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                by_peer.remove(&self.peer);
            }
        }
    }
}

/// A connection's IO holding its [`Slot`].
pub struct Counted<T> {
    io: T,
    _slot: Slot,
}

impl<T> Counted<T> {
    pub fn new(io: T, slot: Slot) -> Counted<T> {
        Counted { io, _slot: slot }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected for Counted<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_in_total_and_per_peer_and_gives_back_on_drop() {
        let c = Counter::new(Limits {
            total: 3,
            per_peer: 2,
        });
        let (a, b) = (
            Some("10.0.0.1".parse().unwrap()),
            Some("10.0.0.2".parse().unwrap()),
        );
        let a1 = c.admit(a).unwrap();
        let _a2 = c.admit(a).unwrap();
        assert_eq!(c.admit(a).err(), Some(Over::PerPeer));
        let _b1 = c.admit(b).unwrap();
        assert_eq!(c.admit(b).err(), Some(Over::Total));
        // A dropped slot gives its place back, in total and for its peer.
        drop(a1);
        let _a3 = c.admit(a).unwrap();
        assert_eq!(c.admit(b).err(), Some(Over::Total));
    }
}
