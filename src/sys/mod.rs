//! Operating-system helpers with no knowledge of kvsync's protocol.
//!
//! [`buf`] allocates page-aligned buffers; [`pem`] reads and checks PEM
//! files; [`splice`] moves socket bytes into a file inside the kernel;
//! [`zerocopy`] sends with `MSG_ZEROCOPY`; [`fs`] holds the file-system
//! steps (directory sync, atomic writes, opening files without following
//! links, free space); [`raise_open_files`] lifts the descriptor limit.

pub mod buf;
pub mod fs;
pub mod pem;
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
