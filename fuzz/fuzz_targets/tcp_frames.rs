//! Fuzz target: see `kvsync::fuzz_targets::tcp_frames`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsync::fuzz_targets::tcp_frames(data));
