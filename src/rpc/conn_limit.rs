//! Counting connections, in total and per peer address, against limits,
//! and closing those that do not prove themselves.
//!
//! Owns one rule used by both listeners that anyone on the network can
//! reach: the data plane caps connections still proving their session, the
//! gRPC server caps open connections. A [`Slot`] is one connection's place
//! and is given back when it drops; [`Counted`] carries a slot inside a
//! connection's IO, so the place is held exactly as long as the connection.
//! A gRPC connection must also prove itself (an authenticated request)
//! within a deadline, and at a limit the oldest that has not is closed for
//! a newcomer ([`Counter::admit_evicting`]).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

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
/// a transport that does not tell the address), and which of them have
/// not yet proved themselves (oldest first).
pub struct Counter {
    limits: Limits,
    state: Mutex<State>,
    /// Called with the number of unproved connections when it changes.
    on_unproved: Option<Box<dyn Fn(usize) + Send + Sync>>,
}

#[derive(Default)]
struct State {
    total: usize,
    by_peer: HashMap<Option<IpAddr>, usize>,
    /// Counted slots: id → peer.
    live: HashMap<u64, Option<IpAddr>>,
    /// Slots not yet proved, by id (ids grow, so the first is the oldest).
    unproved: BTreeMap<u64, Unproved>,
    /// A counted connection's id by its address, to prove it later.
    by_addr: HashMap<SocketAddr, u64>,
    next: u64,
}

struct Unproved {
    peer: Option<IpAddr>,
    evict: CancellationToken,
    proved: Arc<AtomicBool>,
}

/// One connection's place; given back on drop.
pub struct Slot {
    counter: Arc<Counter>,
    id: u64,
    addr: Option<SocketAddr>,
    evicted: CancellationToken,
    proved: Arc<AtomicBool>,
}

impl Counter {
    pub fn new(limits: Limits) -> Arc<Counter> {
        Arc::new(Counter {
            limits,
            state: Mutex::default(),
            on_unproved: None,
        })
    }

    /// A counter that reports how many connections are unproved.
    pub fn reporting(
        limits: Limits,
        on_unproved: impl Fn(usize) + Send + Sync + 'static,
    ) -> Arc<Counter> {
        Arc::new(Counter {
            limits,
            state: Mutex::default(),
            on_unproved: Some(Box::new(on_unproved)),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("connection counts lock")
    }

    /// A place for a connection from `peer`, or the limit it met. The check
    /// and the count are one step.
    pub fn admit(self: &Arc<Self>, peer: Option<IpAddr>) -> Result<Slot, Over> {
        let mut st = self.lock();
        self.check(&st, peer)?;
        Ok(self.count(&mut st, peer, None))
    }

    /// A place for a connection from `peer` while fewer than `most` from it
    /// are counted (a per-peer limit that varies), or [`Over::PerPeer`].
    pub fn admit_within(self: &Arc<Self>, peer: Option<IpAddr>, most: usize) -> Result<Slot, Over> {
        let mut st = self.lock();
        if st.by_peer.get(&peer).copied().unwrap_or(0) >= most {
            return Err(Over::PerPeer);
        }
        self.check(&st, peer)?;
        Ok(self.count(&mut st, peer, None))
    }

    /// A place for the connection at `addr` that must prove itself later
    /// ([`Counter::prove`]): at a limit, the oldest connection that has
    /// not (of the same peer, for the per-peer limit) is closed to make
    /// room, so connections that never prove anything cannot keep a real
    /// peer out. Refused only when every counted connection proved itself.
    pub fn admit_evicting(self: &Arc<Self>, addr: SocketAddr) -> Result<Slot, Over> {
        let peer = Some(addr.ip());
        let mut st = self.lock();
        while let Err(over) = self.check(&st, peer) {
            let victim = st
                .unproved
                .iter()
                .find(|(_, u)| over == Over::Total || u.peer == peer)
                .map(|(id, _)| *id)
                .ok_or(over)?;
            self.release(&mut st, victim);
        }
        let slot = self.count(&mut st, peer, Some(addr));
        self.report(&st);
        Ok(slot)
    }

    /// The connection at `addr` proved itself (an authenticated request):
    /// it is no longer closed for a newcomer nor at its deadline.
    pub fn prove(&self, addr: SocketAddr) {
        let mut st = self.lock();
        if let Some(id) = st.by_addr.get(&addr).copied() {
            if let Some(u) = st.unproved.remove(&id) {
                u.proved.store(true, Ordering::SeqCst);
                self.report(&st);
            }
        }
    }

    fn check(&self, st: &State, peer: Option<IpAddr>) -> Result<(), Over> {
        if st.total >= self.limits.total {
            return Err(Over::Total);
        }
        if st.by_peer.get(&peer).copied().unwrap_or(0) >= self.limits.per_peer {
            return Err(Over::PerPeer);
        }
        Ok(())
    }

    fn count(
        self: &Arc<Self>,
        st: &mut State,
        peer: Option<IpAddr>,
        addr: Option<SocketAddr>,
    ) -> Slot {
        *st.by_peer.entry(peer).or_insert(0) += 1;
        st.total += 1;
        let id = st.next;
        st.next += 1;
        st.live.insert(id, peer);
        let (evicted, proved) = (
            CancellationToken::new(),
            Arc::new(AtomicBool::new(addr.is_none())),
        );
        if let Some(addr) = addr {
            st.by_addr.insert(addr, id);
            st.unproved.insert(
                id,
                Unproved {
                    peer,
                    evict: evicted.clone(),
                    proved: proved.clone(),
                },
            );
        }
        Slot {
            counter: self.clone(),
            id,
            addr,
            evicted,
            proved,
        }
    }

    /// Gives slot `id`'s place back (once) and closes it if unproved.
    fn release(&self, st: &mut State, id: u64) {
        let Some(peer) = st.live.remove(&id) else {
            return;
        };
        st.total -= 1;
        if let Some(n) = st.by_peer.get_mut(&peer) {
            *n -= 1;
            if *n == 0 {
                st.by_peer.remove(&peer);
            }
        }
        if let Some(u) = st.unproved.remove(&id) {
            u.evict.cancel();
        }
    }

    fn report(&self, st: &State) {
        if let Some(f) = &self.on_unproved {
            f(st.unproved.len());
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut st = self.counter.lock();
        self.counter.release(&mut st, self.id);
        if let Some(addr) = self.addr {
            if st.by_addr.get(&addr) == Some(&self.id) {
                st.by_addr.remove(&addr);
            }
        }
        self.counter.report(&st);
    }
}

/// Why a counted connection was closed by its own IO.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// A newcomer needed its place before it proved itself.
    Evicted,
    /// It did not prove itself in time.
    Deadline,
}

/// A connection's IO holding its [`Slot`]. When the slot must prove
/// itself ([`Counter::admit_evicting`]), reads and writes fail once it is
/// evicted or its deadline passes unproved, which closes the connection.
pub struct Counted<T> {
    io: T,
    slot: Slot,
    evicted: Pin<Box<WaitForCancellationFutureOwned>>,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    on_close: Option<Arc<dyn Fn(Closed) + Send + Sync>>,
}

impl<T> Counted<T> {
    pub fn new(io: T, slot: Slot) -> Counted<T> {
        let evicted = Box::pin(slot.evicted.clone().cancelled_owned());
        Counted {
            io,
            slot,
            evicted,
            deadline: None,
            on_close: None,
        }
    }

    /// Closes the connection if it has not proved itself within `limit`;
    /// `on_close` learns why a connection was closed.
    pub fn proving_within(
        mut self,
        limit: Duration,
        on_close: Arc<dyn Fn(Closed) + Send + Sync>,
    ) -> Counted<T> {
        self.deadline = Some(Box::pin(tokio::time::sleep(limit)));
        self.on_close = Some(on_close);
        self
    }

    /// An error when the connection must close now.
    fn closing(&mut self, cx: &mut Context<'_>) -> Option<std::io::Error> {
        let why = if self.evicted.as_mut().poll(cx).is_ready() {
            Closed::Evicted
        } else if self.slot.proved.load(Ordering::SeqCst) {
            self.deadline = None;
            return None;
        } else if self
            .deadline
            .as_mut()
            .is_some_and(|d| d.as_mut().poll(cx).is_ready())
        {
            self.deadline = None;
            Closed::Deadline
        } else {
            return None;
        };
        if let Some(f) = self.on_close.take() {
            f(why);
        }
        Some(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            match why {
                Closed::Evicted => "closed unproved for a newcomer at the connection limit",
                Closed::Deadline => "no authenticated request within the handshake deadline",
            },
        ))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if let Some(e) = self.closing(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if let Some(e) = self.closing(cx) {
            return Poll::Ready(Err(e));
        }
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
        if let Some(e) = self.closing(cx) {
            return Poll::Ready(Err(e));
        }
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

    #[test]
    fn an_unproved_connection_makes_room_for_a_newcomer_and_a_proved_one_does_not() {
        let c = Counter::new(Limits {
            total: 2,
            per_peer: 2,
        });
        let at = |port| SocketAddr::from(([10, 0, 0, 1], port));
        let old = c.admit_evicting(at(1)).unwrap();
        let young = c.admit_evicting(at(2)).unwrap();
        c.prove(at(2));
        let _new = c.admit_evicting(at(3)).unwrap();
        assert!(old.evicted.is_cancelled() && !young.evicted.is_cancelled());
        c.prove(at(3));
        assert_eq!(
            c.admit_evicting(at(4)).err(),
            Some(Over::Total),
            "all proved"
        );
        // The evicted slot's place was given back once, not again on drop.
        drop(old);
        assert_eq!(c.admit_evicting(at(5)).err(), Some(Over::Total));
    }
}
