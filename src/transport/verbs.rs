//! The verbs fabric: real RDMA through libibverbs and librdmacm (`rdma-sys`),
//! behind the cargo feature `rdma`.
//!
//! Owns the rdma_cm connection life cycle — a listener bound to the chosen
//! interface address (each incoming request migrated to its own event
//! channel), address and route resolution and connect with the session
//! token as private data — and one RC queue pair per connection: protection
//! domain, completion channel and queue, registered token buffers for
//! receives and sends, memory registration, linked chains of RDMA Writes,
//! and completion polling that spins briefly (longer on soft devices, whose
//! completions come from a kernel thread) before it waits on the completion
//! channel. Every verbs failure is a typed error naming the call and errno;
//! rdma_cm's DEVICE_REMOVAL ends the listener and every session on the
//! device with `FabricError::DeviceRemoved`.
//! Teardown happens once, in `Drop`, in the order the verbs require.

use std::collections::HashMap;
use std::ffi::c_void;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd};
use std::ptr::{null_mut, NonNull};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys::*;

use super::fabric::{
    Completion, Fabric, FabricError, MemoryRegion, WcStatus, WorkKind, RECV_BUF_LEN,
};
use crate::blk3::WriteOp;
use crate::sys::buf::AlignedBuf;

/// Receive and send token buffers per QP.
const SLOTS: usize = 16;
/// Send-queue depth: the largest pipeline plus the token sends.
const SQ_DEPTH: u32 = 1024 + SLOTS as u32;
/// RNR retries before `RNR_RETRY_EXC_ERR` (7 would mean forever).
const RNR_RETRY: u8 = 6;
/// Transport retries before `RETRY_EXC_ERR`.
const RETRY: u8 = 7;
/// Address and route resolution timeout (ms).
const RESOLVE_MS: i32 = 2000;

fn cm_event_name(e: rdma_cm_event_type::Type) -> String {
    use rdma_cm_event_type::*;
    match e {
        RDMA_CM_EVENT_ADDR_RESOLVED => "ADDR_RESOLVED".into(),
        RDMA_CM_EVENT_ADDR_ERROR => "ADDR_ERROR".into(),
        RDMA_CM_EVENT_ROUTE_RESOLVED => "ROUTE_RESOLVED".into(),
        RDMA_CM_EVENT_ROUTE_ERROR => "ROUTE_ERROR".into(),
        RDMA_CM_EVENT_CONNECT_REQUEST => "CONNECT_REQUEST".into(),
        RDMA_CM_EVENT_CONNECT_ERROR => "CONNECT_ERROR".into(),
        RDMA_CM_EVENT_UNREACHABLE => "UNREACHABLE".into(),
        RDMA_CM_EVENT_REJECTED => "REJECTED".into(),
        RDMA_CM_EVENT_ESTABLISHED => "ESTABLISHED".into(),
        RDMA_CM_EVENT_DISCONNECTED => "DISCONNECTED".into(),
        RDMA_CM_EVENT_DEVICE_REMOVAL => "DEVICE_REMOVAL".into(),
        RDMA_CM_EVENT_TIMEWAIT_EXIT => "TIMEWAIT_EXIT".into(),
        other => format!("event {other}"),
    }
}

/// Connection parameters both sides use: one RDMA read in flight (none is
/// used), and the retry counts.
fn conn_param() -> rdma_conn_param {
    // SAFETY: an all-zero conn_param is valid; fields set below.
    let mut param: rdma_conn_param = unsafe { std::mem::zeroed() };
    param.responder_resources = 1;
    param.initiator_depth = 1;
    param.retry_count = RETRY;
    param.rnr_retry_count = RNR_RETRY;
    param
}

/// `sockaddr` storage for an address.
fn sockaddr(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: an all-zero sockaddr_storage is valid; we fill one variant.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in sockaddr_storage.
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in, sin) };
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_in6 fits in sockaddr_storage.
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in6, sin6) };
        }
    }
    ss
}

fn check(call: &'static str, rc: i32) -> Result<(), FabricError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(FabricError::last_os(call))
    }
}

fn set_nonblocking(fd: i32, call: &'static str) -> Result<(), FabricError> {
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        check(call, (flags < 0) as i32)?;
        check(
            call,
            libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK),
        )
    }
}

/// Waits until `fds` are readable or `timeout` passes; returns which are.
fn wait_readable(fds: &[i32], timeout: Duration) -> Result<Vec<bool>, FabricError> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: pfds is a valid array of pollfd.
    let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(vec![false; fds.len()]);
        }
        return Err(FabricError::Call {
            call: "poll",
            source: e,
        });
    }
    Ok(pfds.iter().map(|p| p.revents != 0).collect())
}

/// An rdma_cm event channel (owned).
struct Channel(NonNull<rdma_event_channel>);

impl Channel {
    fn new() -> Result<Channel, FabricError> {
        // SAFETY: plain constructor; checked for NULL.
        let ch = NonNull::new(unsafe { rdma_create_event_channel() })
            .ok_or_else(|| FabricError::last_os("rdma_create_event_channel"))?;
        let ch = Channel(ch);
        set_nonblocking(ch.fd(), "fcntl(rdma_cm channel)")?;
        Ok(ch)
    }

    /// A new TCP-port-space id on this channel (destroyed by its owner).
    fn create_id(&self) -> Result<*mut rdma_cm_id, FabricError> {
        let mut id = null_mut();
        // SAFETY: valid channel and out pointer.
        check("rdma_create_id", unsafe {
            rdma_create_id(
                self.0.as_ptr(),
                &mut id,
                null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        })?;
        Ok(id)
    }

    fn fd(&self) -> i32 {
        // SAFETY: the channel is valid while self lives.
        unsafe { self.0.as_ref().fd }
    }

    /// The next event (copied, then acknowledged), waiting up to `timeout`.
    fn next(&self, timeout: Duration) -> Result<Option<CmEvent>, FabricError> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut ev: *mut rdma_cm_event = null_mut();
            // SAFETY: non-blocking read of one event from a valid channel.
            if unsafe { rdma_get_cm_event(self.0.as_ptr(), &mut ev) } == 0 {
                // SAFETY: ev is valid until acknowledged.
                let e = unsafe {
                    let conn = (*ev).param.conn;
                    let private = if conn.private_data.is_null() {
                        Vec::new()
                    } else {
                        std::slice::from_raw_parts(
                            conn.private_data as *const u8,
                            conn.private_data_len as usize,
                        )
                        .to_vec()
                    };
                    let e = CmEvent {
                        kind: (*ev).event,
                        status: (*ev).status,
                        id: (*ev).id,
                        private,
                    };
                    rdma_ack_cm_event(ev);
                    e
                };
                return Ok(Some(e));
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::WouldBlock {
                return Err(FabricError::Call {
                    call: "rdma_get_cm_event",
                    source: err,
                });
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Ok(None);
            };
            wait_readable(&[self.fd()], left)?;
        }
    }

    /// Waits for event `want` on this channel; any other event is an error.
    fn expect(
        &self,
        want: rdma_cm_event_type::Type,
        waiting_for: &'static str,
        timeout: Duration,
    ) -> Result<CmEvent, FabricError> {
        match self.next(timeout)? {
            Some(e) if e.kind == want => Ok(e),
            Some(e) if e.kind == rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                Err(FabricError::DeviceRemoved)
            }
            Some(e) if e.kind == rdma_cm_event_type::RDMA_CM_EVENT_REJECTED => {
                let reason = String::from_utf8_lossy(&e.private)
                    .trim_end_matches('\0')
                    .to_string();
                Err(FabricError::Rejected(if reason.is_empty() {
                    format!("no reason given (status {})", e.status)
                } else {
                    reason
                }))
            }
            Some(e) => Err(FabricError::CmEvent {
                waiting_for,
                event: cm_event_name(e.kind),
                status: e.status,
            }),
            None => Err(FabricError::Timeout(timeout, waiting_for)),
        }
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: every id on the channel is destroyed before (field order).
        unsafe { rdma_destroy_event_channel(self.0.as_ptr()) };
    }
}

struct CmEvent {
    kind: rdma_cm_event_type::Type,
    status: i32,
    id: *mut rdma_cm_id,
    private: Vec<u8>,
}

/// A listening rdma_cm id on one interface address.
pub struct VerbsListener {
    id: *mut rdma_cm_id,
    channel: Channel,
    local: SocketAddr,
}

// SAFETY: the listener is used from one thread at a time.
unsafe impl Send for VerbsListener {}

impl VerbsListener {
    /// Listens on `addr` (a real interface address; port 0 picks one).
    pub fn bind(addr: SocketAddr) -> Result<VerbsListener, FabricError> {
        let channel = Channel::new()?;
        let id = channel.create_id()?;
        let mut l = VerbsListener {
            id,
            channel,
            local: addr,
        };
        let mut sa = sockaddr(addr);
        // SAFETY: valid id and address.
        check("rdma_bind_addr", unsafe {
            rdma_bind_addr(l.id, &mut sa as *mut _ as *mut libc::sockaddr)
        })?;
        // SAFETY: valid, bound id.
        check("rdma_listen", unsafe { rdma_listen(l.id, 16) })?;
        // SAFETY: valid id.
        let port = u16::from_be(unsafe { rdma_get_src_port(l.id) });
        l.local = SocketAddr::new(addr.ip(), port);
        Ok(l)
    }

    /// The bound address (with the picked port).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The next connection request, waiting up to `timeout` (`Ok(None)`
    /// then). Nothing is allocated for it yet: check its private data (the
    /// session proof) and [`Fabric::reject`] it, or call
    /// [`VerbsQp::create_resources`] and then [`Fabric::accept`].
    pub fn accept(&self, timeout: Duration, soft: bool) -> Result<Option<VerbsQp>, FabricError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(e) = self.channel.next(left)? else {
                return Ok(None);
            };
            if e.kind == rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL {
                // The kernel waits for this id to go before the device can.
                return Err(FabricError::DeviceRemoved);
            }
            if e.kind != rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
                tracing::debug!(event = %cm_event_name(e.kind), "rdma listener: ignoring event");
                continue;
            }
            // Give the connection its own channel, so its events never mix
            // with the listener's or another connection's.
            let channel = Channel::new()?;
            // SAFETY: e.id is the new connection's id; the channel is valid.
            if unsafe { rdma_migrate_id(e.id, channel.0.as_ptr()) } != 0 {
                let err = FabricError::last_os("rdma_migrate_id");
                // SAFETY: the id is ours to refuse and destroy.
                unsafe {
                    rdma_reject(e.id, null_mut(), 0);
                    rdma_destroy_id(e.id);
                }
                return Err(err);
            }
            let mut qp = VerbsQp::empty(e.id, channel, soft);
            qp.private = e.private;
            return Ok(Some(qp));
        }
    }
}

impl Drop for VerbsListener {
    fn drop(&mut self) {
        // SAFETY: the id is valid and destroyed once.
        unsafe { rdma_destroy_id(self.id) };
    }
}

/// Registered token buffers: one slot per outstanding receive or send.
struct Slots {
    buf: AlignedBuf,
    mr: *mut ibv_mr,
    free: Vec<usize>,
    used: HashMap<u64, usize>,
}

impl Slots {
    fn ptr(&self, slot: usize) -> *mut u8 {
        // SAFETY: slot < SLOTS, inside the buffer.
        unsafe { (self.buf.as_ptr() as *mut u8).add(slot * RECV_BUF_LEN) }
    }
}

/// One RC queue pair on an rdma_cm id.
pub struct VerbsQp {
    // Field order is drop order for the owned handles below `Drop`.
    id: *mut rdma_cm_id,
    channel: Channel,
    pd: *mut ibv_pd,
    comp: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
    has_qp: bool,
    mrs: Vec<*mut ibv_mr>,
    recvs: Option<Slots>,
    sends: Option<Slots>,
    private: Vec<u8>,
    soft: bool,
    connected: bool,
    disconnected: bool,
    /// rdma_cm said DEVICE_REMOVAL: the device under this id is going.
    device_removed: bool,
    /// Wakes a waiting poll, once a waker was asked for.
    wake: Option<Arc<Wake>>,
    /// The longest a poll spins before it blocks ([`Fabric::cap_spin`]).
    spin_cap: Duration,
}

/// What a [`Fabric::waker`] sets: a flag, and an eventfd a waiting poll
/// watches besides its completion channel.
struct Wake {
    flag: std::sync::atomic::AtomicBool,
    fd: std::os::fd::OwnedFd,
}

impl Wake {
    fn new() -> Result<Wake, FabricError> {
        // SAFETY: plain constructor; checked below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(FabricError::last_os("eventfd"));
        }
        Ok(Wake {
            flag: Default::default(),
            // SAFETY: a new descriptor this value owns from here.
            fd: unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) },
        })
    }

    fn wake(&self) {
        self.flag.store(true, std::sync::atomic::Ordering::SeqCst);
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a valid buffer; a full counter is
        // already a wake-up.
        unsafe { libc::write(self.fd.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Whether a wake-up came since the last call.
    fn take(&self) -> bool {
        let woken = self.flag.swap(false, std::sync::atomic::Ordering::SeqCst);
        if woken {
            let mut n = [0u8; 8];
            // SAFETY: reads at most 8 bytes into a valid buffer; a
            // non-blocking eventfd with nothing to read just fails.
            unsafe { libc::read(self.fd.as_raw_fd(), n.as_mut_ptr().cast(), 8) };
        }
        woken
    }
}

// SAFETY: a QP is driven by one thread at a time; verbs objects may be used
// from any thread.
unsafe impl Send for VerbsQp {}

impl VerbsQp {
    fn empty(id: *mut rdma_cm_id, channel: Channel, soft: bool) -> VerbsQp {
        VerbsQp {
            id,
            channel,
            pd: null_mut(),
            comp: null_mut(),
            cq: null_mut(),
            has_qp: false,
            mrs: Vec::new(),
            recvs: None,
            sends: None,
            private: Vec::new(),
            soft,
            connected: false,
            disconnected: false,
            device_removed: false,
            wake: None,
            spin_cap: Duration::MAX,
        }
    }

    /// Replica side: resolves `dest` (from `local` when given) and creates
    /// the QP; receives may be posted before [`Fabric::connect`].
    pub fn dial(
        dest: SocketAddr,
        local: Option<IpAddr>,
        soft: bool,
    ) -> Result<VerbsQp, FabricError> {
        let channel = Channel::new()?;
        let id = channel.create_id()?;
        let mut qp = VerbsQp::empty(id, channel, soft);
        let mut src = local.map(|ip| sockaddr(SocketAddr::new(ip, 0)));
        let mut dst = sockaddr(dest);
        let src_ptr = src
            .as_mut()
            .map_or(null_mut(), |s| s as *mut _ as *mut libc::sockaddr);
        // SAFETY: valid id and addresses.
        check("rdma_resolve_addr", unsafe {
            rdma_resolve_addr(
                qp.id,
                src_ptr,
                &mut dst as *mut _ as *mut libc::sockaddr,
                RESOLVE_MS,
            )
        })?;
        let t = Duration::from_millis(RESOLVE_MS as u64 + 1000);
        qp.expect(
            rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED,
            "address resolution",
            t,
        )?;
        // SAFETY: valid, resolved id.
        check("rdma_resolve_route", unsafe {
            rdma_resolve_route(qp.id, RESOLVE_MS)
        })?;
        qp.expect(
            rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED,
            "route resolution",
            t,
        )?;
        qp.create_resources()?;
        Ok(qp)
    }

    /// PD, completion channel and queue, the RC QP, and the token buffers.
    pub fn create_resources(&mut self) -> Result<(), FabricError> {
        // SAFETY: every handle is checked; Drop releases what was created.
        unsafe {
            let ctx = (*self.id).verbs;
            if ctx.is_null() {
                return Err(FabricError::Call {
                    call: "rdma_cm (no device bound to this address)",
                    source: std::io::Error::from_raw_os_error(libc::ENODEV),
                });
            }
            self.pd = ibv_alloc_pd(ctx);
            if self.pd.is_null() {
                return Err(FabricError::last_os("ibv_alloc_pd"));
            }
            self.comp = ibv_create_comp_channel(ctx);
            if self.comp.is_null() {
                return Err(FabricError::last_os("ibv_create_comp_channel"));
            }
            set_nonblocking((*self.comp).fd, "fcntl(completion channel)")?;
            let cqe = (SQ_DEPTH as usize + SLOTS + 16) as i32;
            self.cq = ibv_create_cq(ctx, cqe, null_mut(), self.comp, 0);
            if self.cq.is_null() {
                return Err(FabricError::last_os("ibv_create_cq"));
            }
            let mut attr: ibv_qp_init_attr = std::mem::zeroed();
            attr.send_cq = self.cq;
            attr.recv_cq = self.cq;
            attr.cap.max_send_wr = SQ_DEPTH;
            attr.cap.max_recv_wr = SLOTS as u32;
            attr.cap.max_send_sge = 1;
            attr.cap.max_recv_sge = 1;
            attr.qp_type = ibv_qp_type::IBV_QPT_RC;
            attr.sq_sig_all = 0;
            check(
                "rdma_create_qp",
                rdma_create_qp(self.id, self.pd, &mut attr),
            )?;
            self.has_qp = true;
            self.recvs = Some(self.slots()?);
            self.sends = Some(self.slots()?);
        }
        Ok(())
    }

    fn slots(&mut self) -> Result<Slots, FabricError> {
        let mut buf =
            AlignedBuf::new(SLOTS * RECV_BUF_LEN).map_err(|source| FabricError::Call {
                call: "allocate token buffers",
                source,
            })?;
        // SAFETY: the buffer lives in the Slots, deregistered in Drop first.
        let mr = unsafe {
            ibv_reg_mr(
                self.pd,
                buf.as_mut_ptr() as *mut c_void,
                buf.len(),
                ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32,
            )
        };
        if mr.is_null() {
            return Err(FabricError::last_os("ibv_reg_mr (token buffers)"));
        }
        Ok(Slots {
            buf,
            mr,
            free: (0..SLOTS).rev().collect(),
            used: HashMap::new(),
        })
    }

    fn qp(&self) -> *mut ibv_qp {
        // SAFETY: id is valid; its qp was created by create_resources.
        unsafe { (*self.id).qp }
    }

    fn translate(&mut self, wc: &ibv_wc) -> Completion {
        use ibv_wc_status::*;
        let status = match wc.status {
            IBV_WC_SUCCESS => Ok(()),
            IBV_WC_RNR_RETRY_EXC_ERR => Err(WcStatus::RnrRetryExceeded),
            IBV_WC_REM_ACCESS_ERR => Err(WcStatus::RemoteAccess),
            IBV_WC_RETRY_EXC_ERR => Err(WcStatus::RetryExceeded),
            IBV_WC_WR_FLUSH_ERR => Err(WcStatus::Flushed),
            IBV_WC_LOC_LEN_ERR | IBV_WC_LOC_PROT_ERR | IBV_WC_LOC_QP_OP_ERR => {
                Err(WcStatus::LocalError)
            }
            other => Err(WcStatus::Other(other)),
        };
        // The opcode is undefined for failed completions: the slot maps say
        // what the WR was.
        let recvs = self.recvs.as_mut().expect("token buffers");
        if let Some(slot) = recvs.used.remove(&wc.wr_id) {
            recvs.free.push(slot);
            let len = (wc.byte_len as usize).min(RECV_BUF_LEN);
            let data = if status.is_ok() {
                // SAFETY: the slot holds `len` received bytes.
                unsafe { std::slice::from_raw_parts(recvs.ptr(slot), len) }.to_vec()
            } else {
                Vec::new()
            };
            return Completion {
                wr_id: wc.wr_id,
                kind: WorkKind::Recv,
                status,
                data,
            };
        }
        let sends = self.sends.as_mut().expect("token buffers");
        let kind = match sends.used.remove(&wc.wr_id) {
            Some(slot) => {
                sends.free.push(slot);
                WorkKind::Send
            }
            None => WorkKind::Write,
        };
        Completion {
            wr_id: wc.wr_id,
            kind,
            status,
            data: Vec::new(),
        }
    }

    /// [`Channel::expect`] on this connection's channel, noting a device
    /// removal for `Drop`.
    fn expect(
        &mut self,
        want: rdma_cm_event_type::Type,
        waiting_for: &'static str,
        timeout: Duration,
    ) -> Result<CmEvent, FabricError> {
        let r = self.channel.expect(want, waiting_for, timeout);
        self.device_removed |= matches!(r, Err(FabricError::DeviceRemoved));
        r
    }

    /// Waits for ESTABLISHED after connect or accept.
    fn established(&mut self, timeout: Duration) -> Result<(), FabricError> {
        self.expect(
            rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED,
            "connection establishment",
            timeout,
        )?;
        self.connected = true;
        Ok(())
    }

    /// Handles rdma_cm events that arrive during the session.
    fn drain_cm_events(&mut self) -> Result<(), FabricError> {
        while let Some(e) = self.channel.next(Duration::ZERO)? {
            use rdma_cm_event_type::*;
            match e.kind {
                RDMA_CM_EVENT_DISCONNECTED => {
                    tracing::debug!("rdma connection ended");
                    self.disconnected = true;
                }
                RDMA_CM_EVENT_DEVICE_REMOVAL => {
                    tracing::warn!("the rdma device under this connection was removed");
                    self.device_removed = true;
                }
                other => tracing::debug!(event = %cm_event_name(other), "rdma_cm event"),
            }
        }
        Ok(())
    }
}

impl Fabric for VerbsQp {
    fn provider(&self) -> &'static str {
        "verbs"
    }

    unsafe fn register(
        &mut self,
        addr: *mut u8,
        len: usize,
        remote_write: bool,
    ) -> Result<MemoryRegion, FabricError> {
        let access = if remote_write {
            ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
        } else {
            0
        };
        // SAFETY: the caller keeps the memory valid while registered.
        let mr = unsafe { ibv_reg_mr(self.pd, addr as *mut c_void, len, access as i32) };
        if mr.is_null() {
            return Err(FabricError::last_os("ibv_reg_mr"));
        }
        self.mrs.push(mr);
        // SAFETY: mr is valid.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(MemoryRegion {
            addr: addr as u64,
            len: len as u64,
            rkey,
            lkey,
        })
    }

    fn revoke(&mut self, region: &MemoryRegion) -> Result<(), FabricError> {
        // SAFETY: every pointer in `mrs` is a live registration.
        let Some(i) = self
            .mrs
            .iter()
            .position(|&mr| unsafe { (*mr).rkey } == region.rkey)
        else {
            return Ok(());
        };
        let mr = self.mrs.swap_remove(i);
        // SAFETY: `mr` is registered and no longer listed, so it is freed once.
        if unsafe { ibv_dereg_mr(mr) } != 0 {
            return Err(FabricError::last_os("ibv_dereg_mr"));
        }
        Ok(())
    }

    fn post_recv(&mut self, wr_id: u64) -> Result<(), FabricError> {
        let qp = self.qp();
        let slots = self.recvs.as_mut().expect("token buffers");
        let slot = slots
            .free
            .pop()
            .ok_or(FabricError::QueueFull { depth: SLOTS })?;
        let mut sge = ibv_sge {
            addr: slots.ptr(slot) as u64,
            length: RECV_BUF_LEN as u32,
            // SAFETY: mr is valid.
            lkey: unsafe { (*slots.mr).lkey },
        };
        let mut wr = ibv_recv_wr {
            wr_id,
            next: null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad = null_mut();
        // SAFETY: valid QP, WR and SGE for the duration of the call.
        let rc = unsafe { ibv_post_recv(qp, &mut wr, &mut bad) };
        if rc != 0 {
            slots.free.push(slot);
            return Err(FabricError::Call {
                call: "ibv_post_recv",
                source: std::io::Error::from_raw_os_error(rc),
            });
        }
        slots.used.insert(wr_id, slot);
        Ok(())
    }

    fn post_send(&mut self, wr_id: u64, msg: &[u8]) -> Result<(), FabricError> {
        let qp = self.qp();
        let slots = self.sends.as_mut().expect("token buffers");
        if msg.len() > RECV_BUF_LEN {
            return Err(FabricError::Call {
                call: "ibv_post_send (message longer than a token buffer)",
                source: std::io::Error::from_raw_os_error(libc::EMSGSIZE),
            });
        }
        let slot = slots
            .free
            .pop()
            .ok_or(FabricError::QueueFull { depth: SLOTS })?;
        // SAFETY: the slot has room for RECV_BUF_LEN bytes.
        unsafe { std::ptr::copy_nonoverlapping(msg.as_ptr(), slots.ptr(slot), msg.len()) };
        let mut sge = ibv_sge {
            addr: slots.ptr(slot) as u64,
            length: msg.len() as u32,
            // SAFETY: mr is valid.
            lkey: unsafe { (*slots.mr).lkey },
        };
        // SAFETY: an all-zero send WR is valid; fields set below.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad = null_mut();
        // SAFETY: valid QP, WR and SGE for the duration of the call.
        let rc = unsafe { ibv_post_send(qp, &mut wr, &mut bad) };
        if rc != 0 {
            slots.free.push(slot);
            return Err(FabricError::Call {
                call: "ibv_post_send",
                source: std::io::Error::from_raw_os_error(rc),
            });
        }
        slots.used.insert(wr_id, slot);
        Ok(())
    }

    fn post_writes(
        &mut self,
        local: &MemoryRegion,
        remote_addr: u64,
        rkey: u32,
        writes: &[WriteOp],
    ) -> Result<(), FabricError> {
        if writes.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<ibv_sge> = writes
            .iter()
            .map(|w| ibv_sge {
                addr: local.addr + w.offset,
                length: w.len as u32,
                lkey: local.lkey,
            })
            .collect();
        // SAFETY: all-zero send WRs are valid; fields set below.
        let mut wrs: Vec<ibv_send_wr> = (0..writes.len())
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        let base = wrs.as_mut_ptr();
        for (i, w) in writes.iter().enumerate() {
            let wr = &mut wrs[i];
            wr.wr_id = w.id;
            wr.sg_list = &mut sges[i];
            wr.num_sge = 1;
            wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            wr.send_flags = if w.signaled {
                ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            wr.wr.rdma = rdma_t {
                remote_addr: remote_addr + w.offset,
                rkey,
            };
            wr.next = if i + 1 < writes.len() {
                // SAFETY: i + 1 is inside the vector (or the chain ends).
                unsafe { base.add(i + 1) }
            } else {
                null_mut()
            };
        }
        let mut bad = null_mut();
        // SAFETY: the chain and its SGEs stay valid for the call.
        let rc = unsafe { ibv_post_send(self.qp(), base, &mut bad) };
        if rc != 0 {
            return Err(FabricError::Call {
                call: "ibv_post_send (RDMA Write chain)",
                source: std::io::Error::from_raw_os_error(rc),
            });
        }
        Ok(())
    }

    fn poll(&mut self, timeout: Duration) -> Result<Option<Completion>, FabricError> {
        let deadline = Instant::now() + timeout;
        let spin = if self.soft {
            Duration::from_micros(200)
        } else {
            Duration::from_micros(20)
        }
        .min(self.spin_cap);
        let spin_until = Instant::now() + spin;
        let mut armed = false;
        loop {
            // SAFETY: an all-zero wc is valid output storage.
            let mut wc: ibv_wc = unsafe { std::mem::zeroed() };
            // SAFETY: valid CQ.
            let n = unsafe { ibv_poll_cq(self.cq, 1, &mut wc) };
            if n < 0 {
                return Err(FabricError::Call {
                    call: "ibv_poll_cq",
                    source: std::io::Error::from_raw_os_error(-n),
                });
            }
            if n == 1 {
                return Ok(Some(self.translate(&wc)));
            }
            if self.device_removed {
                return Err(FabricError::DeviceRemoved);
            }
            if self.disconnected {
                return Err(FabricError::Disconnected);
            }
            if self.wake.as_ref().is_some_and(|w| w.take()) {
                return Ok(None);
            }
            let now = Instant::now();
            if now < spin_until {
                std::hint::spin_loop();
                if self.soft {
                    std::thread::yield_now();
                }
                continue;
            }
            if !armed {
                // Arm, then poll once more: a completion may have landed in between.
                // SAFETY: valid CQ.
                check("ibv_req_notify_cq", unsafe {
                    ibv_req_notify_cq(self.cq, 0)
                })?;
                armed = true;
                continue;
            }
            let Some(left) = deadline.checked_duration_since(now) else {
                return Ok(None);
            };
            // SAFETY: valid completion channel.
            let comp_fd = unsafe { (*self.comp).fd };
            let mut fds = vec![comp_fd, self.channel.fd()];
            fds.extend(self.wake.as_ref().map(|w| w.fd.as_raw_fd()));
            let ready = wait_readable(&fds, left)?;
            if ready[0] {
                let mut cq = null_mut();
                let mut ctx = null_mut();
                // SAFETY: non-blocking channel; the event is acknowledged at once.
                if unsafe { ibv_get_cq_event(self.comp, &mut cq, &mut ctx) } == 0 {
                    // SAFETY: `cq` is the queue the event just came from.
                    unsafe { ibv_ack_cq_events(cq, 1) };
                }
                armed = false;
            }
            if ready[1] {
                self.drain_cm_events()?;
            }
        }
    }

    fn cap_spin(&mut self, cap: Duration) {
        self.spin_cap = cap;
    }

    fn waker(&mut self) -> Result<super::fabric::Waker, FabricError> {
        let wake = match &self.wake {
            Some(w) => w.clone(),
            None => self.wake.insert(Arc::new(Wake::new()?)).clone(),
        };
        Ok(Arc::new(move || wake.wake()))
    }

    fn connect(&mut self, private_data: &[u8], timeout: Duration) -> Result<(), FabricError> {
        let mut param = conn_param();
        param.private_data = private_data.as_ptr() as *const c_void;
        param.private_data_len = private_data.len() as u8;
        // SAFETY: valid id with a QP; param valid for the call.
        check("rdma_connect", unsafe { rdma_connect(self.id, &mut param) })?;
        self.established(timeout)
    }

    fn private_data(&self) -> &[u8] {
        &self.private
    }

    fn accept(&mut self, timeout: Duration) -> Result<(), FabricError> {
        let mut param = conn_param();
        // SAFETY: valid id with a QP; param valid for the call.
        check("rdma_accept", unsafe { rdma_accept(self.id, &mut param) })?;
        self.established(timeout)
    }

    fn reject(&mut self, reason: &str) {
        let len = reason.len().min(56);
        // SAFETY: valid id; reason valid for the call.
        unsafe { rdma_reject(self.id, reason.as_ptr() as *const c_void, len as u8) };
    }

    fn disconnect(&mut self) {
        if self.connected {
            self.connected = false;
            // SAFETY: valid, connected id.
            unsafe { rdma_disconnect(self.id) };
        }
    }

    fn check_link(&mut self) -> Result<(), FabricError> {
        self.drain_cm_events()?;
        if self.device_removed {
            return Err(FabricError::DeviceRemoved);
        }
        if self.disconnected {
            return Err(FabricError::Disconnected);
        }
        Ok(())
    }
}

impl Drop for VerbsQp {
    fn drop(&mut self) {
        self.disconnect();
        // SAFETY: each handle is released once, in dependency order: memory
        // regions, the QP, the CQ, its channel, the PD, then the id (whose
        // events are all acknowledged); the event channel goes with `channel`.
        unsafe {
            for mr in self.mrs.drain(..) {
                ibv_dereg_mr(mr);
            }
            for slots in [self.recvs.take(), self.sends.take()].into_iter().flatten() {
                ibv_dereg_mr(slots.mr);
            }
            if self.has_qp {
                rdma_destroy_qp(self.id);
                self.has_qp = false;
            }
            if !self.cq.is_null() {
                ibv_destroy_cq(std::mem::replace(&mut self.cq, null_mut()));
            }
            if !self.comp.is_null() {
                ibv_destroy_comp_channel(std::mem::replace(&mut self.comp, null_mut()));
            }
            if !self.pd.is_null() {
                ibv_dealloc_pd(std::mem::replace(&mut self.pd, null_mut()));
            }
            rdma_destroy_id(self.id);
        }
        if self.device_removed {
            release_removed_devices();
        }
    }
}

/// Lets librdmacm close its context of a removed device once no id uses
/// it: a device without hot-unplug support in the kernel (rxe) cannot
/// finish going away while a process holds that context open. librdmacm
/// notices removed devices when it lists them.
pub fn release_removed_devices() {
    let mut n = 0;
    // SAFETY: the list is librdmacm's, freed at once; a null list (no
    // devices or an error) is not freed.
    unsafe {
        let list = rdma_get_devices(&mut n);
        if !list.is_null() {
            rdma_free_devices(list);
        }
    }
}

/// Smoke test of the probe: can rdma_cm resolve `ip` to an RDMA device?
/// Returns the device name it bound to.
pub fn resolve_smoke_test(ip: IpAddr) -> Result<String, FabricError> {
    let channel = Channel::new()?;
    let id = channel.create_id()?;
    let result = (|| {
        let mut dst = sockaddr(SocketAddr::new(ip, 0));
        // SAFETY: valid id and address.
        check("rdma_resolve_addr", unsafe {
            rdma_resolve_addr(
                id,
                null_mut(),
                &mut dst as *mut _ as *mut libc::sockaddr,
                RESOLVE_MS,
            )
        })?;
        channel.expect(
            rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED,
            "address resolution",
            Duration::from_millis(RESOLVE_MS as u64 + 1000),
        )?;
        // SAFETY: a resolved id has its device context.
        unsafe {
            let ctx = (*id).verbs;
            if ctx.is_null() {
                return Err(FabricError::Call {
                    call: "rdma_resolve_addr (no device)",
                    source: std::io::Error::from_raw_os_error(libc::ENODEV),
                });
            }
            Ok(std::ffi::CStr::from_ptr(ibv_get_device_name((*ctx).device))
                .to_string_lossy()
                .into_owned())
        }
    })();
    // SAFETY: the id is valid and destroyed once.
    unsafe { rdma_destroy_id(id) };
    result
}
