//! Fuzz target: see `kvsync::fuzz_targets::log_files`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsync::fuzz_targets::log_files(data));
