//! Operating-system helpers with no knowledge of kvsync's protocol.
//!
//! [`buf`] allocates page-aligned buffers; [`pem`] reads and checks PEM
//! files; [`splice`] moves socket bytes into a file inside the kernel;
//! [`zerocopy`] sends with `MSG_ZEROCOPY`; [`fs`] holds the file-system
//! steps (directory sync, atomic writes, free space).

pub mod buf;
pub mod fs;
pub mod pem;
pub mod splice;
pub mod zerocopy;
