//! Benchmark of the checksums a snapshot's bytes pass through, one core
//! each over the same 256 MiB of memory: the piece hash candidates
//! (BLAKE3 from the blake3 crate, SHA-256 from ring, which uses the CPU's
//! SHA extensions when it has them) and the CRCs the formats' trailers use
//! (CRC32 from crc32fast; Redis's CRC-64 by the crc crate's slice-by-16
//! tables, which kvsync used before, and by crc-fast's carry-less multiply).
//! Prints "name MB/s" lines, best of 5.
//!
//! Usage: cargo run --release --example hash_speed

use std::time::Instant;

const LEN: usize = 256 << 20;

fn best(f: impl Fn(&[u8]) -> u64, buf: &[u8]) -> f64 {
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
    let first = |d: &[u8]| u64::from(d[0]);
    println!(
        "blake3 {:.0}",
        best(|b| first(blake3::hash(b).as_bytes()), &buf)
    );
    println!(
        "sha256 {:.0}",
        best(
            |b| first(ring::digest::digest(&ring::digest::SHA256, b).as_ref()),
            &buf
        )
    );
    println!("crc32 {:.0}", best(|b| u64::from(crc32fast::hash(b)), &buf));
    let table = crc::Crc::<u64, crc::Table<16>>::new(&crc::CRC_64_REDIS);
    println!("crc64-redis-table {:.0}", best(|b| table.checksum(b), &buf));
    println!(
        "crc64-redis-clmul {:.0}",
        best(kvsync::snapshot::rdb::crc64, &buf)
    );
}
