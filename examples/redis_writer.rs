//! A steady write load for the Redis seeding benchmark: SETs of `VALUE`-byte
//! values to `writer:<n>` (n cycling through 100 000 keys) at `RATE` bytes of
//! values per second, in pipelines every 10 ms, until killed. Prints the
//! bytes written when it falls behind its rate.
//!
//! Usage: cargo run --release --example redis_writer -- HOST:PORT RATE VALUE

use std::time::{Duration, Instant};

const KEYS: u64 = 100_000;
const TICK: Duration = Duration::from_millis(10);

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [addr, rate, value] = &args[..] else {
        eprintln!("usage: redis_writer HOST:PORT RATE_BYTES_PER_S VALUE_BYTES");
        std::process::exit(2);
    };
    let rate: u64 = rate.parse().expect("RATE in bytes per second");
    let value = "v".repeat(value.parse().expect("VALUE in bytes"));
    let mut con = redis::Client::open(format!("redis://{addr}/"))
        .and_then(|c| c.get_connection())
        .expect("a connection to the primary");
    let start = Instant::now();
    let (mut written, mut n) = (0u64, 0u64);
    loop {
        // Catch up with the rate, then wait for the next tick.
        let due = (start.elapsed().as_secs_f64() * rate as f64) as u64;
        if written < due {
            let mut p = redis::pipe();
            while written < due {
                p.cmd("SET")
                    .arg(format!("writer:{}", n % KEYS))
                    .arg(&value)
                    .ignore();
                written += value.len() as u64;
                n += 1;
            }
            let _: () = p.query(&mut con).expect("SET on the primary");
        }
        if start.elapsed().as_secs_f64() * rate as f64 > (written + rate) as f64 {
            eprintln!("redis_writer: more than a second behind ({written} bytes written)");
        }
        std::thread::sleep(TICK);
    }
}
