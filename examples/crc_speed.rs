//! Benchmark of the piece checksum candidates: CRC32 (IEEE) from crc32fast,
//! and CRC32C (Castagnoli) from the crc crate, over the same 256 MiB of
//! memory, one core each. Prints "name MB/s" lines, best of 5.
//!
//! Usage: cargo run --release --example crc_speed

use std::time::Instant;

const LEN: usize = 256 << 20;

fn best(f: impl Fn(&[u8]) -> u32, buf: &[u8]) -> f64 {
    (0..5)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(f(buf));
            LEN as f64 / t.elapsed().as_secs_f64() / 1e6
        })
        .fold(0.0, f64::max)
}

fn main() {
    let buf: Vec<u8> = (0..LEN)
        .map(|i| (i as u64).wrapping_mul(0x9e37_79b9) as u8)
        .collect();
    let castagnoli = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);
    println!("crc32fast {:.0}", best(crc32fast::hash, &buf));
    println!("crc32c {:.0}", best(|b| castagnoli.checksum(b), &buf));
}
