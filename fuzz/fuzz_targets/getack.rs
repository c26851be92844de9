//! Fuzz target: see `kvsync::fuzz_targets::getack`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsync::fuzz_targets::getack(data));
