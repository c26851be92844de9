//! Fuzz target: see `kvsync::fuzz_targets::blk3_token`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsync::fuzz_targets::blk3_token(data));
