//! Zero-copy TCP sends from the shared snapshot buffer (`MSG_ZEROCOPY`).
//!
//! Owns the Linux mechanics: enabling `SO_ZEROCOPY`, sending with
//! `MSG_ZEROCOPY` (the kernel pins the pages instead of copying them), and
//! reaping the completion notifications from the socket's error queue, so the
//! caller knows when the kernel no longer references the buffer. On loopback
//! the kernel copies anyway and says so; where the kernel refuses the option
//! every send is a plain `write`. Nothing here knows about BLK3.

use std::io::{self, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// `SO_ZEROCOPY` (asm-generic/socket.h).
const SO_ZEROCOPY: libc::c_int = 60;
/// `SO_EE_ORIGIN_ZEROCOPY` (linux/errqueue.h).
const SO_EE_ORIGIN_ZEROCOPY: u8 = 5;
/// `SO_EE_CODE_ZEROCOPY_COPIED`: the kernel fell back to copying.
const SO_EE_CODE_ZEROCOPY_COPIED: u8 = 1;
/// `IPV6_RECVERR` (linux/in6.h).
const IPV6_RECVERR: libc::c_int = 25;

/// Sends from memory with `MSG_ZEROCOPY` when the socket allows it.
pub struct ZeroCopySender<'a> {
    stream: &'a TcpStream,
    /// The socket's send timeout when the sender was made (read once).
    send_timeout: Option<Duration>,
    enabled: bool,
    /// Zero-copy send calls made (each gets one notification id).
    issued: u32,
    /// Notifications received.
    completed: u32,
    /// The kernel reported copying instead (e.g. on loopback).
    pub copied: bool,
}

impl<'a> ZeroCopySender<'a> {
    /// Enables `SO_ZEROCOPY` on `stream`; plain writes if the kernel refuses.
    pub fn new(stream: &'a TcpStream) -> ZeroCopySender<'a> {
        let one: libc::c_int = 1;
        // SAFETY: setsockopt on a valid fd with an int option value.
        let r = unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_ZEROCOPY,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        ZeroCopySender {
            stream,
            send_timeout: stream.write_timeout().ok().flatten(),
            enabled: r == 0,
            issued: 0,
            completed: 0,
            copied: false,
        }
    }

    /// Whether sends avoid the copy.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Sends some of `buf` (at least one byte) and returns how much, or
    /// `WouldBlock` when the socket's send timeout expires first, also
    /// while it waits for pinned pages to be released (a peer that stopped
    /// reading). The bytes sent must stay unchanged until
    /// [`ZeroCopySender::finish`] returns.
    pub fn send(&mut self, buf: &[u8]) -> io::Result<usize> {
        if !self.enabled {
            let mut s = self.stream;
            return s.write(buf);
        }
        let deadline = self.send_timeout.map(|t| Instant::now() + t);
        loop {
            // SAFETY: `buf` is a valid slice that the caller keeps alive and
            // unchanged until `finish`.
            let n = unsafe {
                libc::send(
                    self.stream.as_raw_fd(),
                    buf.as_ptr().cast(),
                    buf.len(),
                    libc::MSG_ZEROCOPY | libc::MSG_NOSIGNAL,
                )
            };
            if n >= 0 {
                self.issued = self.issued.wrapping_add(1);
                self.reap(Duration::ZERO)?;
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => {}
                // Too much pinned memory outstanding: wait for completions.
                Some(libc::ENOBUFS) => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(io::ErrorKind::WouldBlock.into());
                    }
                    self.reap(Duration::from_millis(100))?
                }
                // The socket's send timeout expired.
                Some(libc::EAGAIN) => return Err(io::ErrorKind::WouldBlock.into()),
                _ => return Err(e),
            }
        }
    }

    /// Waits until the kernel released every page sent so far (the peer
    /// acknowledged all data), up to `timeout`.
    pub fn finish(&mut self, timeout: Duration) -> io::Result<()> {
        let deadline = Instant::now() + timeout;
        while self.completed != self.issued {
            let left = deadline
                .checked_duration_since(Instant::now())
                .ok_or(io::ErrorKind::TimedOut)?;
            self.reap(left)?;
        }
        Ok(())
    }

    /// Reads completion notifications, waiting up to `wait` for the first.
    fn reap(&mut self, wait: Duration) -> io::Result<()> {
        let fd = self.stream.as_raw_fd();
        if !wait.is_zero() {
            let mut pfd = libc::pollfd {
                fd,
                events: 0,
                revents: 0,
            };
            let ms = wait.as_millis().min(i32::MAX as u128) as libc::c_int;
            // SAFETY: one valid pollfd. POLLERR is always reported.
            if unsafe { libc::poll(&mut pfd, 1, ms) } < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
        loop {
            let mut control = [0u64; 16];
            // SAFETY: zeroed msghdr is valid; control points at our buffer.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = std::mem::size_of_val(&control) as _;
            // SAFETY: recvmsg on a valid fd with a valid msghdr.
            let r = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT) };
            if r < 0 {
                let e = io::Error::last_os_error();
                return match e.raw_os_error() {
                    Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(()),
                    _ => Err(e),
                };
            }
            // SAFETY: walking the control messages the kernel filled in.
            let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
            while !cmsg.is_null() {
                // SAFETY: non-null, and inside the control buffer the kernel filled.
                let c = unsafe { &*cmsg };
                let ip = c.cmsg_level == libc::SOL_IP && c.cmsg_type == libc::IP_RECVERR;
                let ip6 = c.cmsg_level == libc::SOL_IPV6 && c.cmsg_type == IPV6_RECVERR;
                if ip || ip6 {
                    // SAFETY: the payload of an IP(V6)_RECVERR message is a
                    // sock_extended_err.
                    let ee = unsafe {
                        std::ptr::read_unaligned(
                            libc::CMSG_DATA(cmsg) as *const libc::sock_extended_err
                        )
                    };
                    if ee.ee_origin == SO_EE_ORIGIN_ZEROCOPY {
                        // Ids ee_info ..= ee_data completed.
                        self.completed = self
                            .completed
                            .wrapping_add(ee.ee_data.wrapping_sub(ee.ee_info).wrapping_add(1));
                        self.copied |= ee.ee_code & SO_EE_CODE_ZEROCOPY_COPIED != 0;
                    } else if ee.ee_errno != 0 {
                        return Err(io::Error::from_raw_os_error(ee.ee_errno as i32));
                    }
                }
                // SAFETY: `cmsg` is a header of `msg`'s control buffer.
                cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
            }
        }
    }
}
