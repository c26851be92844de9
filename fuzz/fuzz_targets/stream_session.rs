//! Fuzz target: see `kvsync::fuzz_targets::stream_session`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsync::fuzz_targets::stream_session(data));
