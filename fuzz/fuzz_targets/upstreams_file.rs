//! Fuzz target: see `kvsync::fuzz_targets::upstreams_file`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsync::fuzz_targets::upstreams_file(data));
