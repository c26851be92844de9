//! What a client sees of a Redis/Valkey server while it is re-seeded: reads
//! `GET <KEY>` in a loop (a fresh connection after any failure) until the
//! file `STOP` exists, then prints `unavailable_s=<s> errors=<n> reads=<n>`:
//! the time from each failed read (an error reply such as `-LOADING`, or no
//! connection) to the next good one, summed.
//!
//! Usage: cargo run --release --example redis_poller -- HOST:PORT KEY STOP

use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [addr, key, stop] = &args[..] else {
        eprintln!("usage: redis_poller HOST:PORT KEY STOPFILE");
        std::process::exit(2);
    };
    let stop = std::path::Path::new(stop);
    let client = redis::Client::open(format!("redis://{addr}/")).expect("a server address");
    let mut con = None;
    let (mut reads, mut errors) = (0u64, 0u64);
    let (mut unavailable, mut down_since) = (Duration::ZERO, None::<Instant>);
    while !stop.exists() {
        let read = match con.as_mut() {
            Some(c) => redis::cmd("GET").arg(key).query::<Option<String>>(c),
            None => client
                .get_connection_with_timeout(Duration::from_millis(200))
                .and_then(|mut c| {
                    let r = redis::cmd("GET").arg(key).query::<Option<String>>(&mut c);
                    con = Some(c);
                    r
                }),
        };
        match read {
            Ok(_) => {
                reads += 1;
                if let Some(since) = down_since.take() {
                    unavailable += since.elapsed();
                }
            }
            Err(e) => {
                errors += 1;
                down_since.get_or_insert_with(Instant::now);
                if e.is_io_error() || e.is_connection_dropped() {
                    con = None;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    if let Some(since) = down_since {
        unavailable += since.elapsed();
    }
    println!(
        "unavailable_s={:.2} errors={errors} reads={reads}",
        unavailable.as_secs_f64()
    );
}
