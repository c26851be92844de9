//! The emulated RDMA fabric: an **emulation** of a reliable-connected queue
//! pair over a TCP stream (in one process or between two), for fault tests and
//! hosts without RDMA hardware; logs and `kvsync probe` say it is one.
//!
//! It enforces what hardware enforces (docs/ARCHITECTURE.md, "Transports"):
//! RNR without a posted receive (no retry window, stricter than a NIC),
//! remote access errors on a bad rkey or bounds, in-order completions for
//! signalled WRs only, the send-queue depth, flush after an error. Each
//! endpoint has a reader thread (applies the peer's messages) and a writer
//! thread (sends this side's in order). Faults: [`EmuFaults`].

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::fabric::{
    Completion, Fabric, FabricError, MemoryRegion, WcStatus, WorkKind, RECV_BUF_LEN,
};
use crate::blk3::plan::MAX_CHUNK;
use crate::blk3::WriteOp;

/// Default send-queue depth (the verbs fabric sizes its QP the same way).
pub const DEFAULT_SQ_DEPTH: usize = 1024 + 64;
/// How long a disconnect waits for queued messages to go out.
const LINGER: Duration = Duration::from_secs(2);
/// Largest connection private data (as for an RC connect).
const MAX_PRIVATE_DATA: usize = 56;

/// Faults the emulation injects on the sending side of an endpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EmuFaults {
    /// Lose the n-th Send (1-based): the connection breaks there, as after
    /// exhausted retransmissions, and the oldest outstanding WR fails with
    /// `RETRY_EXC_ERR`.
    pub drop_send: Option<u32>,
    /// Hold the n-th Send back this long before it goes out.
    pub delay_send: Option<(u32, Duration)>,
    /// Flip the low bit of the byte at this offset of the written data, once.
    pub corrupt_at: Option<u64>,
    /// Cut the connection once this many bytes have been written.
    pub cut_after: Option<u64>,
}

// Wire messages between two emulated endpoints: a 25-byte header (type,
// wr_id, addr, key-or-status, payload length) then the payload.
const CONNECT: u8 = 1;
const ACCEPT: u8 = 2;
const REJECT: u8 = 3;
const SEND: u8 = 4;
const WRITE: u8 = 5;
const ACK: u8 = 6;
const NAK: u8 = 7;
const HEADER: usize = 25;

#[derive(Debug, Clone, Copy)]
struct Header {
    kind: u8,
    wr_id: u64,
    addr: u64,
    key: u32,
    len: u32,
}

impl Header {
    fn encode(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[0] = self.kind;
        b[1..9].copy_from_slice(&self.wr_id.to_be_bytes());
        b[9..17].copy_from_slice(&self.addr.to_be_bytes());
        b[17..21].copy_from_slice(&self.key.to_be_bytes());
        b[21..25].copy_from_slice(&self.len.to_be_bytes());
        b
    }

    fn decode(b: &[u8; HEADER]) -> Header {
        Header {
            kind: b[0],
            wr_id: u64::from_be_bytes(b[1..9].try_into().expect("8 bytes")),
            addr: u64::from_be_bytes(b[9..17].try_into().expect("8 bytes")),
            key: u32::from_be_bytes(b[17..21].try_into().expect("4 bytes")),
            len: u32::from_be_bytes(b[21..25].try_into().expect("4 bytes")),
        }
    }

    fn simple(kind: u8, wr_id: u64, key: u32, len: usize) -> Header {
        Header {
            kind,
            wr_id,
            addr: 0,
            key,
            len: len as u32,
        }
    }
}

fn status_code(s: WcStatus) -> u32 {
    match s {
        WcStatus::RnrRetryExceeded => 13,
        WcStatus::RemoteAccess => 10,
        WcStatus::RetryExceeded => 12,
        WcStatus::Flushed => 5,
        WcStatus::LocalError => 1,
        WcStatus::Other(n) => n,
    }
}

fn status_of(code: u32) -> WcStatus {
    match code {
        13 => WcStatus::RnrRetryExceeded,
        10 => WcStatus::RemoteAccess,
        12 => WcStatus::RetryExceeded,
        5 => WcStatus::Flushed,
        1 => WcStatus::LocalError,
        n => WcStatus::Other(n),
    }
}

/// A message for the writer thread.
enum Out {
    Frame(Header, Vec<u8>),
    /// An RDMA Write: the payload is read from registered local memory.
    Write {
        header: Header,
        local: usize,
        offset: u64,
    },
    /// Disconnect once everything queued before is sent (as a NIC still
    /// delivers its acknowledgements and NAKs).
    Close,
}

// SAFETY: `local` is the address of registered memory, which the owner of
// the fabric keeps valid until the fabric (and so the writer thread) is gone.
unsafe impl Send for Out {}

/// A sent WR waiting for the peer's acknowledgement.
struct Outstanding {
    wr_id: u64,
    kind: WorkKind,
    signaled: bool,
}

#[derive(Default)]
struct Queues {
    recvs: VecDeque<u64>,
    cq: VecDeque<Completion>,
    outstanding: VecDeque<Outstanding>,
    /// Acknowledged unsignalled WRs still holding send-queue slots.
    retired_unsignaled: usize,
    /// The QP is in error: everything flushes.
    error: bool,
    /// The connection is gone (reported once the queue is drained).
    disconnected: bool,
    /// The writer thread has stopped.
    writer_done: bool,
    /// A waker was called since the last poll returned.
    woken: bool,
}

impl Queues {
    fn complete(&mut self, wr_id: u64, kind: WorkKind, status: Result<(), WcStatus>) {
        self.cq.push_back(Completion {
            wr_id,
            kind,
            status,
            data: Vec::new(),
        });
    }

    /// Moves the QP to error: outstanding WRs fail (the oldest with
    /// `first`), posted receives flush.
    fn fail(&mut self, first: WcStatus) {
        if self.error {
            return;
        }
        self.error = true;
        let mut status = first;
        while let Some(o) = self.outstanding.pop_front() {
            self.complete(o.wr_id, o.kind, Err(status));
            status = WcStatus::Flushed;
        }
        while let Some(id) = self.recvs.pop_front() {
            self.complete(id, WorkKind::Recv, Err(WcStatus::Flushed));
        }
        self.retired_unsignaled = 0;
    }
}

/// A registered region: base, length, remote-writable.
type Regions = HashMap<u32, (u64, u64, bool)>;

struct Inner {
    state: Mutex<Queues>,
    changed: Condvar,
    regions: RwLock<Regions>,
    stream: TcpStream,
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.state.lock().expect("emulated QP state lock")
    }

    fn with_state<T>(&self, f: impl FnOnce(&mut Queues) -> T) -> T {
        let r = f(&mut self.lock());
        self.changed.notify_all();
        r
    }
}

/// One emulated queue pair.
pub struct EmuQp {
    inner: Arc<Inner>,
    out: Option<mpsc::Sender<Out>>,
    threads: Vec<JoinHandle<()>>,
    private: Vec<u8>,
    next_key: u32,
    sq_depth: usize,
    faults: EmuFaults,
}

impl EmuQp {
    fn new(stream: TcpStream, private: Vec<u8>, faults: EmuFaults) -> std::io::Result<EmuQp> {
        stream.set_nodelay(true)?;
        Ok(EmuQp {
            inner: Arc::new(Inner {
                state: Mutex::new(Queues::default()),
                changed: Condvar::new(),
                regions: RwLock::new(HashMap::new()),
                stream,
            }),
            out: None,
            threads: Vec::new(),
            private,
            next_key: 0x1000,
            sq_depth: DEFAULT_SQ_DEPTH,
            faults,
        })
    }

    /// Replica side: reaches the listener at `addr`; receives may be posted
    /// before [`Fabric::connect`].
    pub fn dial(
        addr: SocketAddr,
        timeout: Duration,
        faults: EmuFaults,
    ) -> Result<EmuQp, FabricError> {
        let stream =
            TcpStream::connect_timeout(&addr, timeout).map_err(|source| FabricError::Call {
                call: "connect (emulated fabric)",
                source,
            })?;
        EmuQp::new(stream, Vec::new(), faults).map_err(|source| FabricError::Call {
            call: "configure socket (emulated fabric)",
            source,
        })
    }

    /// Source side: reads the connection request from an accepted stream.
    pub fn incoming(
        stream: TcpStream,
        timeout: Duration,
        faults: EmuFaults,
    ) -> Result<EmuQp, FabricError> {
        stream
            .set_read_timeout(Some(timeout))
            .map_err(request_err)?;
        let (h, private) = read_frame(&mut &stream).map_err(request_err)?;
        check_request(&h)?;
        stream.set_read_timeout(None).map_err(request_err)?;
        EmuQp::accepted(stream, private, faults).map_err(request_err)
    }

    /// Source side: a connection whose request (with `private` data) was
    /// read by [`read_request`] and accepted by the caller.
    pub fn accepted(
        stream: TcpStream,
        private: Vec<u8>,
        faults: EmuFaults,
    ) -> std::io::Result<EmuQp> {
        EmuQp::new(stream, private, faults)
    }

    /// Sets the send-queue depth (default [`DEFAULT_SQ_DEPTH`]).
    pub fn set_sq_depth(&mut self, depth: usize) {
        self.sq_depth = depth;
    }

    /// Sets how long a silent peer takes to become `RETRY_EXC_ERR` (the
    /// transport retry timeout of a hardware QP).
    pub fn set_peer_timeout(&self, timeout: Duration) -> Result<(), FabricError> {
        super::detect_dead_peer(&self.inner.stream, timeout).map_err(|source| FabricError::Call {
            call: "configure socket (emulated fabric)",
            source,
        })
    }

    /// Starts the reader and writer threads (the connection is established).
    fn establish(&mut self) -> Result<(), FabricError> {
        let (tx, rx) = mpsc::channel();
        let spawn_err = |source| FabricError::Call {
            call: "spawn emulated fabric thread",
            source,
        };
        let reader = {
            let inner = self.inner.clone();
            let tx = tx.clone();
            std::thread::Builder::new()
                .name("kvsync-emu-rx".into())
                .spawn(move || read_loop(&inner, &tx))
                .map_err(spawn_err)?
        };
        let writer = {
            let inner = self.inner.clone();
            let faults = self.faults.clone();
            std::thread::Builder::new()
                .name("kvsync-emu-tx".into())
                .spawn(move || write_loop(&inner, rx, faults))
                .map_err(spawn_err)?
        };
        self.threads = vec![reader, writer];
        self.out = Some(tx);
        Ok(())
    }

    fn send_out(&self, msg: Out) {
        if let Some(out) = &self.out {
            // A closed channel means the writer stopped on a broken
            // connection; the reader has already failed the QP.
            let _ = out.send(msg);
        }
    }

    /// Reserves send-queue slots for `n` WRs, or says why not.
    fn reserve(&self, st: &Queues, n: usize) -> Result<(), FabricError> {
        if st.outstanding.len() + st.retired_unsignaled + n > self.sq_depth {
            return Err(FabricError::QueueFull {
                depth: self.sq_depth,
            });
        }
        Ok(())
    }
}

/// Reads one frame (header + payload up to one token) from `r`.
fn request_err(source: std::io::Error) -> FabricError {
    FabricError::Call {
        call: "read connection request (emulated fabric)",
        source,
    }
}

/// A connection request is CONNECT with at most [`MAX_PRIVATE_DATA`] bytes.
fn check_request(h: &Header) -> Result<(), FabricError> {
    if h.kind != CONNECT || h.len as usize > MAX_PRIVATE_DATA {
        return Err(FabricError::Emulation(format!(
            "expected a connection request, got message type {} with {} bytes",
            h.kind, h.len
        )));
    }
    Ok(())
}

/// Source side, on the runtime without a thread: reads an accepted
/// stream's connection request and returns its private data (the session
/// proof). Nothing else is set up until the caller accepts it.
pub async fn read_request(stream: &mut tokio::net::TcpStream) -> Result<Vec<u8>, FabricError> {
    use tokio::io::AsyncReadExt;
    let mut h = [0u8; HEADER];
    stream.read_exact(&mut h).await.map_err(request_err)?;
    let h = Header::decode(&h);
    check_request(&h)?;
    let mut private = vec![0u8; h.len as usize];
    stream.read_exact(&mut private).await.map_err(request_err)?;
    Ok(private)
}

/// The REJECT message carrying `reason` (cut to the private-data size).
fn reject_message(reason: &str) -> Vec<u8> {
    let reason = &reason.as_bytes()[..reason.len().min(MAX_PRIVATE_DATA)];
    let mut m = Header::simple(REJECT, 0, 0, reason.len()).encode().to_vec();
    m.extend_from_slice(reason);
    m
}

/// Source side: refuses a connection request read by [`read_request`].
pub async fn reject_request(stream: &mut tokio::net::TcpStream, reason: &str) {
    use tokio::io::AsyncWriteExt;
    let _ = stream.write_all(&reject_message(reason)).await;
    let _ = stream.shutdown().await;
}

fn read_frame(r: &mut impl Read) -> std::io::Result<(Header, Vec<u8>)> {
    let mut h = [0u8; HEADER];
    r.read_exact(&mut h)?;
    let h = Header::decode(&h);
    if h.len as usize > RECV_BUF_LEN.max(MAX_PRIVATE_DATA) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("control message of {} bytes", h.len),
        ));
    }
    let mut payload = vec![0u8; h.len as usize];
    r.read_exact(&mut payload)?;
    Ok((h, payload))
}

/// Applies the peer's messages until the connection ends. One match over
/// the message kinds, kept whole so the queue pair's rules (RNR, access
/// checks, ordering) read in one place.
fn read_loop(inner: &Inner, out: &mpsc::Sender<Out>) {
    let mut stream = &inner.stream;
    loop {
        let mut hb = [0u8; HEADER];
        if stream.read_exact(&mut hb).is_err() {
            break;
        }
        let h = Header::decode(&hb);
        match h.kind {
            SEND => {
                if h.len as usize > RECV_BUF_LEN {
                    break; // a message larger than any receive buffer: protocol bug
                }
                let mut data = vec![0u8; h.len as usize];
                if stream.read_exact(&mut data).is_err() {
                    break;
                }
                let taken = inner.with_state(|st| {
                    let id = st.recvs.pop_front()?;
                    st.cq.push_back(Completion {
                        wr_id: id,
                        kind: WorkKind::Recv,
                        status: Ok(()),
                        data,
                    });
                    Some(id)
                });
                let reply = match taken {
                    Some(_) => Header::simple(ACK, h.wr_id, 0, 0),
                    None => {
                        tracing::debug!(
                            "emulated fabric: Send arrived with no receive posted (RNR)"
                        );
                        Header::simple(NAK, h.wr_id, status_code(WcStatus::RnrRetryExceeded), 0)
                    }
                };
                let _ = out.send(Out::Frame(reply, Vec::new()));
            }
            WRITE => {
                if h.len as u64 > MAX_CHUNK {
                    break; // larger than any write the protocol makes
                }
                let regions = inner.regions.read().expect("regions lock");
                let target = regions.get(&h.key).and_then(|&(base, len, writable)| {
                    let end = h.addr.checked_add(h.len as u64)?;
                    (writable && h.addr >= base && end <= base + len).then_some(h.addr)
                });
                let ok = match target {
                    // SAFETY: the range lies inside a region registered for
                    // remote write, which stays valid while registered.
                    Some(addr) => stream
                        .read_exact(unsafe {
                            std::slice::from_raw_parts_mut(addr as *mut u8, h.len as usize)
                        })
                        .is_ok(),
                    None => {
                        // Discarded through a small fixed buffer.
                        let len = h.len as u64;
                        if std::io::copy(&mut stream.take(len), &mut std::io::sink()).ok()
                            != Some(len)
                        {
                            break;
                        }
                        drop(regions);
                        let nak =
                            Header::simple(NAK, h.wr_id, status_code(WcStatus::RemoteAccess), 0);
                        let _ = out.send(Out::Frame(nak, Vec::new()));
                        // A remote access error puts the responder in error too.
                        inner.with_state(|st| st.fail(WcStatus::Flushed));
                        continue;
                    }
                };
                if !ok {
                    break;
                }
                let _ = out.send(Out::Frame(Header::simple(ACK, h.wr_id, 0, 0), Vec::new()));
            }
            ACK => inner.with_state(|st| {
                let Some(o) = st.outstanding.pop_front() else {
                    return;
                };
                debug_assert_eq!(o.wr_id, h.wr_id, "acknowledgements arrive in order");
                if o.signaled {
                    st.complete(o.wr_id, o.kind, Ok(()));
                    st.retired_unsignaled = 0;
                } else {
                    st.retired_unsignaled += 1;
                }
            }),
            NAK => {
                inner.with_state(|st| st.fail(status_of(h.key)));
                let _ = inner.stream.shutdown(Shutdown::Both);
            }
            _ => break,
        }
    }
    // The connection is gone: outstanding WRs fail, receives flush.
    inner.with_state(|st| {
        st.fail(WcStatus::RetryExceeded);
        st.disconnected = true;
    });
}

/// Sends this side's messages in order, applying the injected faults.
fn write_loop(inner: &Inner, rx: mpsc::Receiver<Out>, mut faults: EmuFaults) {
    let mut stream = &inner.stream;
    let mut written: u64 = 0;
    let mut sends = 0u32;
    let cut = |what: &str| {
        tracing::warn!("emulated fabric fault: {what}");
        let _ = inner.stream.shutdown(Shutdown::Both);
    };
    for msg in rx {
        let ok = match msg {
            Out::Close => break,
            Out::Frame(h, payload) => {
                if h.kind == SEND {
                    sends += 1;
                    if faults.drop_send == Some(sends) {
                        // Retransmissions of a lost message run out: the
                        // connection breaks, outstanding WRs fail.
                        cut("losing a Send");
                        break;
                    }
                    if let Some((nth, delay)) = faults.delay_send {
                        if nth == sends {
                            tracing::warn!(?delay, "emulated fabric fault: delaying a Send");
                            std::thread::sleep(delay);
                        }
                    }
                }
                stream
                    .write_all(&h.encode())
                    .and_then(|_| stream.write_all(&payload))
                    .is_ok()
            }
            Out::Write {
                header,
                local,
                offset,
            } => {
                // SAFETY: registered local memory (see `Out`).
                let data =
                    unsafe { std::slice::from_raw_parts(local as *const u8, header.len as usize) };
                let end = offset + data.len() as u64;
                let keep = match faults.cut_after {
                    Some(c) if c < written + data.len() as u64 => (c - written.min(c)) as usize,
                    _ => data.len(),
                };
                let mut r = stream.write_all(&header.encode());
                match faults.corrupt_at {
                    Some(at) if (offset..end).contains(&at) => {
                        // Once: the piece written again arrives intact.
                        faults.corrupt_at = None;
                        tracing::warn!(at, "emulated fabric fault: corrupting a written chunk");
                        let mut copy = data[..keep].to_vec();
                        if let Some(b) = copy.get_mut((at - offset) as usize) {
                            *b ^= 0x01;
                        }
                        r = r.and_then(|_| stream.write_all(&copy));
                    }
                    _ => r = r.and_then(|_| stream.write_all(&data[..keep])),
                }
                written += keep as u64;
                if keep < data.len() {
                    cut(&format!(
                        "cutting the connection after {written} written bytes"
                    ));
                    break;
                }
                r.is_ok()
            }
        };
        if !ok {
            break;
        }
    }
    let _ = inner.stream.shutdown(Shutdown::Both);
    inner.with_state(|st| st.writer_done = true);
}

impl Fabric for EmuQp {
    fn provider(&self) -> &'static str {
        "emulated"
    }

    unsafe fn register(
        &mut self,
        addr: *mut u8,
        len: usize,
        remote_write: bool,
    ) -> Result<MemoryRegion, FabricError> {
        let key = self.next_key;
        self.next_key += 0x101;
        self.inner
            .regions
            .write()
            .expect("regions lock")
            .insert(key, (addr as u64, len as u64, remote_write));
        Ok(MemoryRegion {
            addr: addr as u64,
            len: len as u64,
            rkey: key,
            lkey: key,
        })
    }

    fn revoke(&mut self, region: &MemoryRegion) -> Result<(), FabricError> {
        // The write lock waits for a write that holds the read lock.
        self.inner
            .regions
            .write()
            .expect("regions lock")
            .remove(&region.rkey);
        Ok(())
    }

    fn post_recv(&mut self, wr_id: u64) -> Result<(), FabricError> {
        self.inner.with_state(|st| {
            if st.error {
                st.complete(wr_id, WorkKind::Recv, Err(WcStatus::Flushed));
            } else {
                st.recvs.push_back(wr_id);
            }
        });
        Ok(())
    }

    fn post_send(&mut self, wr_id: u64, msg: &[u8]) -> Result<(), FabricError> {
        if msg.len() > RECV_BUF_LEN {
            return Err(FabricError::Emulation(format!(
                "a Send of {} bytes exceeds the {RECV_BUF_LEN}-byte receive buffers",
                msg.len()
            )));
        }
        let mut st = self.inner.lock();
        if st.error {
            st.complete(wr_id, WorkKind::Send, Err(WcStatus::Flushed));
            drop(st);
            self.inner.changed.notify_all();
            return Ok(());
        }
        self.reserve(&st, 1)?;
        st.outstanding.push_back(Outstanding {
            wr_id,
            kind: WorkKind::Send,
            signaled: true,
        });
        drop(st);
        self.send_out(Out::Frame(
            Header::simple(SEND, wr_id, 0, msg.len()),
            msg.to_vec(),
        ));
        Ok(())
    }

    fn post_writes(
        &mut self,
        local: &MemoryRegion,
        remote_addr: u64,
        rkey: u32,
        writes: &[WriteOp],
    ) -> Result<(), FabricError> {
        let mut st = self.inner.lock();
        if st.error {
            for w in writes {
                st.complete(w.id, WorkKind::Write, Err(WcStatus::Flushed));
            }
            drop(st);
            self.inner.changed.notify_all();
            return Ok(());
        }
        self.reserve(&st, writes.len())?;
        for w in writes {
            if w.offset + w.len > local.len {
                return Err(FabricError::Emulation(format!(
                    "write {} reads past the local region ({} + {} > {})",
                    w.id, w.offset, w.len, local.len
                )));
            }
        }
        for w in writes {
            st.outstanding.push_back(Outstanding {
                wr_id: w.id,
                kind: WorkKind::Write,
                signaled: w.signaled,
            });
        }
        drop(st);
        for w in writes {
            self.send_out(Out::Write {
                header: Header {
                    kind: WRITE,
                    wr_id: w.id,
                    addr: remote_addr + w.offset,
                    key: rkey,
                    len: w.len as u32,
                },
                local: (local.addr + w.offset) as usize,
                offset: w.offset,
            });
        }
        Ok(())
    }

    fn poll(&mut self, timeout: Duration) -> Result<Option<Completion>, FabricError> {
        let deadline = Instant::now() + timeout;
        let mut st = self.inner.lock();
        loop {
            if let Some(c) = st.cq.pop_front() {
                return Ok(Some(c));
            }
            if st.disconnected {
                return Err(FabricError::Disconnected);
            }
            let now = Instant::now();
            if std::mem::take(&mut st.woken) || now >= deadline {
                return Ok(None);
            }
            st = self
                .inner
                .changed
                .wait_timeout(st, deadline - now)
                .expect("emulated QP state lock")
                .0;
        }
    }

    fn waker(&mut self) -> Result<super::fabric::Waker, FabricError> {
        let inner = self.inner.clone();
        Ok(Arc::new(move || inner.with_state(|q| q.woken = true)))
    }

    fn check_link(&mut self) -> Result<(), FabricError> {
        if self.inner.lock().disconnected {
            return Err(FabricError::Disconnected);
        }
        Ok(())
    }

    fn connect(&mut self, private_data: &[u8], timeout: Duration) -> Result<(), FabricError> {
        if private_data.len() > MAX_PRIVATE_DATA {
            return Err(FabricError::Emulation(format!(
                "private data of {} bytes (at most {MAX_PRIVATE_DATA})",
                private_data.len()
            )));
        }
        let call = |source| FabricError::Call {
            call: "connect (emulated fabric)",
            source,
        };
        let mut stream = &self.inner.stream;
        stream
            .write_all(&Header::simple(CONNECT, 0, 0, private_data.len()).encode())
            .and_then(|_| stream.write_all(private_data))
            .map_err(call)?;
        stream.set_read_timeout(Some(timeout)).map_err(call)?;
        let (h, reason) = read_frame(&mut stream).map_err(call)?;
        stream.set_read_timeout(None).map_err(call)?;
        match h.kind {
            ACCEPT => self.establish(),
            REJECT => Err(FabricError::Rejected(
                String::from_utf8_lossy(&reason).into_owned(),
            )),
            k => Err(FabricError::Emulation(format!(
                "expected an answer to the connection request, got message type {k}"
            ))),
        }
    }

    fn private_data(&self) -> &[u8] {
        &self.private
    }

    fn accept(&mut self, _timeout: Duration) -> Result<(), FabricError> {
        (&self.inner.stream)
            .write_all(&Header::simple(ACCEPT, 0, 0, 0).encode())
            .map_err(|source| FabricError::Call {
                call: "accept (emulated fabric)",
                source,
            })?;
        self.establish()
    }

    fn reject(&mut self, reason: &str) {
        let _ = (&self.inner.stream).write_all(&reject_message(reason));
        let _ = self.inner.stream.shutdown(Shutdown::Both);
    }

    fn disconnect(&mut self) {
        if let Some(out) = self.out.take() {
            // Queued acknowledgements and NAKs still go out first.
            let _ = out.send(Out::Close);
            let deadline = Instant::now() + LINGER;
            let mut st = self.inner.lock();
            while !st.writer_done {
                let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                    break;
                };
                st = self
                    .inner
                    .changed
                    .wait_timeout(st, left)
                    .expect("emulated QP state lock")
                    .0;
            }
        }
        let _ = self.inner.stream.shutdown(Shutdown::Both);
    }
}

impl Drop for EmuQp {
    fn drop(&mut self) {
        // Stop both threads before the registered memory can go away.
        self.disconnect();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    const T: Duration = Duration::from_secs(10);

    /// A connected pair (replica-like `a` dials, source-like `b` accepts),
    /// with receives posted on `a` before connecting.
    fn pair(a_recvs: &[u64], faults: EmuFaults) -> (EmuQp, EmuQp) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let mut a = EmuQp::dial(addr, T, EmuFaults::default()).unwrap();
        for &id in a_recvs {
            a.post_recv(id).unwrap();
        }
        let acceptor = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut b = EmuQp::incoming(s, T, faults).unwrap();
            assert_eq!(b.private_data(), b"hello");
            b.accept(T).unwrap();
            b
        });
        a.connect(b"hello", T).unwrap();
        (a, acceptor.join().unwrap())
    }

    fn next(q: &mut EmuQp) -> Completion {
        q.poll(T)
            .unwrap()
            .expect("a completion within the deadline")
    }

    fn writes(ids: std::ops::Range<u64>, chunk: u64, signal_every: u64) -> Vec<WriteOp> {
        ids.map(|id| WriteOp {
            id,
            offset: id * chunk,
            len: chunk,
            signaled: (id + 1) % signal_every == 0,
        })
        .collect()
    }

    #[test]
    fn send_lands_in_a_posted_receive() {
        let (mut a, mut b) = pair(&[7], EmuFaults::default());
        b.post_send(1, b"SRDY").unwrap();
        let c = next(&mut a);
        assert_eq!(
            (c.wr_id, c.kind, c.status, c.data.as_slice()),
            (7, WorkKind::Recv, Ok(()), &b"SRDY"[..])
        );
        assert_eq!(
            next(&mut b),
            Completion {
                wr_id: 1,
                kind: WorkKind::Send,
                status: Ok(()),
                data: vec![]
            }
        );
    }

    #[test]
    fn send_without_a_posted_receive_is_rnr_and_the_qp_goes_to_error() {
        let (mut a, mut b) = pair(&[], EmuFaults::default());
        a.post_recv(9).unwrap();
        b.post_send(1, b"SRDY").unwrap();
        assert_eq!(next(&mut b).status, Ok(()));
        b.post_send(2, b"RDGO").unwrap(); // no receive left on `a`
        b.post_send(3, b"BLK3").unwrap();
        assert_eq!(next(&mut b).status, Err(WcStatus::RnrRetryExceeded));
        assert_eq!(next(&mut b).status, Err(WcStatus::Flushed));
        // Later work flushes too.
        b.post_recv(4).unwrap();
        assert_eq!(
            next(&mut b),
            Completion {
                wr_id: 4,
                kind: WorkKind::Recv,
                status: Err(WcStatus::Flushed),
                data: vec![]
            }
        );
        assert_eq!(next(&mut a).data, b"SRDY");
        // `b` dropped the connection: `a` learns it.
        assert!(matches!(a.poll(T), Err(FabricError::Disconnected)));
    }

    #[test]
    fn writes_into_a_revoked_region_are_remote_access_errors() {
        let (mut a, mut b) = pair(&[], EmuFaults::default());
        let mut dst = vec![0u8; 16];
        let mut src = vec![7u8; 16];
        // SAFETY: the buffer outlives the queue pair in this test.
        let remote = unsafe { a.register(dst.as_mut_ptr(), dst.len(), true) }.unwrap();
        // SAFETY: the buffer outlives the queue pair in this test.
        let local = unsafe { b.register(src.as_mut_ptr(), src.len(), false) }.unwrap();
        let write = |id| WriteOp {
            id,
            offset: 0,
            len: 16,
            signaled: true,
        };
        b.post_writes(&local, remote.addr, remote.rkey, &[write(1)])
            .unwrap();
        assert_eq!(next(&mut b).wr_id, 1);
        a.revoke(&remote).unwrap();
        src.fill(9);
        b.post_writes(&local, remote.addr, remote.rkey, &[write(2)])
            .unwrap();
        let c = b.poll(T).unwrap().expect("a completion");
        assert_eq!(c.status, Err(WcStatus::RemoteAccess));
        assert_eq!(dst, vec![7u8; 16], "the verified bytes stay as they were");
    }

    #[test]
    fn writes_complete_in_order_and_only_when_signalled() {
        let (mut a, mut b) = pair(&[], EmuFaults::default());
        let mut dst = vec![0u8; 64];
        let mut src: Vec<u8> = (0..64).collect();
        // SAFETY: the buffer outlives the queue pair in this test.
        let remote = unsafe { a.register(dst.as_mut_ptr(), dst.len(), true) }.unwrap();
        // SAFETY: the buffer outlives the queue pair in this test.
        let local = unsafe { b.register(src.as_mut_ptr(), src.len(), false) }.unwrap();
        b.post_writes(&local, remote.addr, remote.rkey, &writes(0..8, 8, 3))
            .unwrap();
        let ids: Vec<u64> = (0..2).map(|_| next(&mut b).wr_id).collect();
        assert_eq!(
            ids,
            vec![2, 5],
            "writes 7 (unsignalled) and the rest never complete"
        );
        assert_eq!(b.poll(Duration::from_millis(50)).unwrap(), None);
        // Wait for write 7 to land: a signalled write after it completes.
        b.post_writes(
            &local,
            remote.addr,
            remote.rkey,
            &[WriteOp {
                id: 8,
                offset: 0,
                len: 8,
                signaled: true,
            }],
        )
        .unwrap();
        assert_eq!(next(&mut b).wr_id, 8);
        assert_eq!(dst, src);
    }

    #[test]
    fn wrong_rkey_or_out_of_bounds_write_is_a_remote_access_error() {
        for (rkey_delta, addr_delta) in [(1u32, 0u64), (0, 1)] {
            let (mut a, mut b) = pair(&[1], EmuFaults::default());
            let mut dst = vec![0u8; 16];
            let mut src = vec![1u8; 16];
            // SAFETY: the buffer outlives the queue pair in this test.
            let remote = unsafe { a.register(dst.as_mut_ptr(), 16, true) }.unwrap();
            // SAFETY: the buffer outlives the queue pair in this test.
            let local = unsafe { b.register(src.as_mut_ptr(), 16, false) }.unwrap();
            let w = [
                WriteOp {
                    id: 0,
                    offset: 0,
                    len: 16,
                    signaled: false,
                },
                WriteOp {
                    id: 1,
                    offset: 0,
                    len: 16,
                    signaled: true,
                },
            ];
            b.post_writes(
                &local,
                remote.addr + addr_delta,
                remote.rkey + rkey_delta,
                &w,
            )
            .unwrap();
            assert_eq!(
                next(&mut b).status,
                Err(WcStatus::RemoteAccess),
                "unsignalled WRs report errors"
            );
            assert_eq!(next(&mut b).status, Err(WcStatus::Flushed));
            assert_eq!(dst, vec![0u8; 16], "nothing written");
            // The responder is in error as well: its receive flushes.
            assert_eq!(next(&mut a).status, Err(WcStatus::Flushed));
        }
    }

    /// A peer's WRITE header declaring 4 GiB for a key nobody registered:
    /// the endpoint refuses it at the header (no write is ever larger than
    /// the largest chunk) instead of allocating room to discard it.
    #[test]
    fn a_write_header_larger_than_any_chunk_is_refused_before_anything_is_allocated() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let mut a = EmuQp::dial(addr, T, EmuFaults::default()).unwrap();
        a.post_recv(9).unwrap();
        let peer = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let (h, _) = read_frame(&mut s).unwrap();
            assert_eq!(h.kind, CONNECT);
            s.write_all(&Header::simple(ACCEPT, 0, 0, 0).encode())
                .unwrap();
            let forged = Header {
                kind: WRITE,
                wr_id: 1,
                addr: 0,
                key: 0xdead,
                len: u32::MAX,
            };
            s.write_all(&forged.encode()).unwrap();
            s // kept open: only the header decides
        });
        a.connect(b"", T).unwrap();
        let _peer = peer.join().unwrap();
        let c = next(&mut a);
        assert_eq!((c.wr_id, c.status), (9, Err(WcStatus::Flushed)));
        assert!(matches!(a.check_link(), Err(FabricError::Disconnected)));
    }

    #[test]
    fn read_only_region_refuses_remote_writes() {
        let (mut a, mut b) = pair(&[], EmuFaults::default());
        let mut dst = vec![0u8; 8];
        let mut src = vec![1u8; 8];
        // SAFETY: the buffer outlives the queue pair in this test.
        let remote = unsafe { a.register(dst.as_mut_ptr(), 8, false) }.unwrap();
        // SAFETY: the buffer outlives the queue pair in this test.
        let local = unsafe { b.register(src.as_mut_ptr(), 8, false) }.unwrap();
        b.post_writes(&local, remote.addr, remote.rkey, &writes(0..1, 8, 1))
            .unwrap();
        assert_eq!(next(&mut b).status, Err(WcStatus::RemoteAccess));
    }

    #[test]
    fn send_queue_depth_is_enforced_until_a_signalled_completion() {
        let (mut a, mut b) = pair(&[], EmuFaults::default());
        b.set_sq_depth(4);
        let mut dst = vec![0u8; 64];
        let mut src = vec![3u8; 64];
        // SAFETY: the buffer outlives the queue pair in this test.
        let remote = unsafe { a.register(dst.as_mut_ptr(), 64, true) }.unwrap();
        // SAFETY: the buffer outlives the queue pair in this test.
        let local = unsafe { b.register(src.as_mut_ptr(), 64, false) }.unwrap();
        b.post_writes(&local, remote.addr, remote.rkey, &writes(0..3, 8, 100))
            .unwrap();
        let full = b.post_writes(&local, remote.addr, remote.rkey, &writes(3..5, 8, 100));
        assert!(
            matches!(full, Err(FabricError::QueueFull { depth: 4 })),
            "{full:?}"
        );
        b.post_writes(
            &local,
            remote.addr,
            remote.rkey,
            &[WriteOp {
                id: 3,
                offset: 24,
                len: 8,
                signaled: true,
            }],
        )
        .unwrap();
        assert_eq!(next(&mut b).wr_id, 3);
        // Every slot is free again.
        b.post_writes(&local, remote.addr, remote.rkey, &writes(4..8, 8, 4))
            .unwrap();
        assert_eq!(next(&mut b).wr_id, 7);
    }

    #[test]
    fn faults_corrupt_a_chunk_and_cut_the_connection() {
        let faults = EmuFaults {
            corrupt_at: Some(10),
            ..Default::default()
        };
        let (mut a, mut b) = pair(&[], faults);
        let mut dst = vec![0u8; 32];
        let mut src = vec![0u8; 32];
        // SAFETY: the buffer outlives the queue pair in this test.
        let remote = unsafe { a.register(dst.as_mut_ptr(), 32, true) }.unwrap();
        // SAFETY: the buffer outlives the queue pair in this test.
        let local = unsafe { b.register(src.as_mut_ptr(), 32, false) }.unwrap();
        b.post_writes(&local, remote.addr, remote.rkey, &writes(0..4, 8, 4))
            .unwrap();
        assert_eq!(next(&mut b).status, Ok(()));
        assert_eq!(dst[10], 1);
        assert_eq!(dst.iter().filter(|&&x| x != 0).count(), 1);

        let faults = EmuFaults {
            cut_after: Some(12),
            ..Default::default()
        };
        let (mut a, mut b) = pair(&[5], faults);
        // SAFETY: the buffer outlives the queue pair in this test.
        let remote = unsafe { a.register(dst.as_mut_ptr(), 32, true) }.unwrap();
        // SAFETY: the buffer outlives the queue pair in this test.
        let local = unsafe { b.register(src.as_mut_ptr(), 32, false) }.unwrap();
        b.post_writes(&local, remote.addr, remote.rkey, &writes(0..4, 8, 4))
            .unwrap();
        let done = drain(&mut b);
        assert_eq!(done[0].status, Err(WcStatus::RetryExceeded));
        assert!(done[1..].iter().all(|c| c.status == Err(WcStatus::Flushed)));
        assert_eq!(drain(&mut a)[0].status, Err(WcStatus::Flushed));
    }

    /// Every completion until the disconnection is reported.
    fn drain(q: &mut EmuQp) -> Vec<Completion> {
        let mut all = Vec::new();
        loop {
            match q.poll(T) {
                Ok(Some(c)) => all.push(c),
                Ok(None) => panic!("no disconnection within {T:?}"),
                Err(FabricError::Disconnected) => return all,
                Err(e) => panic!("{e}"),
            }
        }
    }

    #[test]
    fn a_lost_send_fails_with_retry_exceeded() {
        let faults = EmuFaults {
            drop_send: Some(2),
            ..Default::default()
        };
        let (mut a, mut b) = pair(&[1, 2], faults);
        b.post_send(10, b"SRDY").unwrap();
        b.post_send(11, b"RDGO").unwrap();
        let done = drain(&mut b);
        let last = done.iter().find(|c| c.wr_id == 11).expect("RDGO completes");
        assert!(last.status.is_err(), "{done:?}");
        assert_eq!(
            done.iter()
                .filter(|c| c.status == Err(WcStatus::RetryExceeded))
                .count(),
            1
        );
        let got = drain(&mut a);
        assert_eq!(got[0].data, b"SRDY");
        assert_eq!(got[1].status, Err(WcStatus::Flushed), "RDGO never arrived");
    }

    #[test]
    fn rejected_connection_carries_the_reason() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut b = EmuQp::incoming(s, T, EmuFaults::default()).unwrap();
            b.reject("unknown session");
        });
        let mut a = EmuQp::dial(addr, T, EmuFaults::default()).unwrap();
        let e = a.connect(&[0u8; 32], T).unwrap_err();
        assert!(e.to_string().contains("unknown session"), "{e}");
        t.join().unwrap();
    }
}
