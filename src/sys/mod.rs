//! Operating-system helpers with no knowledge of kvsync's protocol.
//!
//! [`buf`] allocates page-aligned buffers; [`pem`] reads and checks PEM
//! files; [`splice`] moves socket bytes into a file inside the kernel;
//! [`zerocopy`] sends with `MSG_ZEROCOPY`; [`fs`] holds the file-system
//! steps (directory sync, atomic writes, opening files without following
//! links, free space); [`ratelimit`] is the token bucket the data plane
//! and the backlog guard draw from; [`raise_open_files`] lifts the
//! descriptor limit;
//! [`numeric_ip`] reads an IP address as the C library does.

pub mod buf;
pub mod fs;
pub mod pem;
pub mod ratelimit;
pub mod splice;
pub mod zerocopy;

/// Raises this process's soft limit on open descriptors to its hard limit
/// (the unit's `LimitNOFILE`), so the connection caps, not the default soft
/// limit of 1024, decide how many idle connections the agent can hold.
pub fn raise_open_files() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid struct for the kernel to fill, then to read.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

extern "C" {
    /// glibc's (and every libc's) `inet_aton(3)`.
    fn inet_aton(cp: *const libc::c_char, inp: *mut libc::in_addr) -> libc::c_int;
}

/// `host` as an IP address, in any form the C library's resolver reads as
/// one without asking a name server (`127.1`, `2130706433`, `0`, as well
/// as what Rust parses).
pub fn numeric_ip(host: &str) -> Option<std::net::IpAddr> {
    if let Ok(ip) = host.parse() {
        return Some(ip);
    }
    let c = std::ffi::CString::new(host).ok()?;
    let mut a = libc::in_addr { s_addr: 0 };
    // SAFETY: `c` is NUL-terminated and `a` a valid in_addr that
    // inet_aton only writes to.
    let ok = unsafe { inet_aton(c.as_ptr(), &mut a) } != 0;
    ok.then(|| std::net::Ipv4Addr::from(u32::from_be(a.s_addr)).into())
}
