//! Fuzz target: see `kvsync::fuzz_targets::primary_replies`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsync::fuzz_targets::primary_replies(data));
