//! The replication stream's round trip as a client sees it, for the stream
//! benchmark: `SET` then `WAIT 1 5000` on one connection to the primary, again
//! and again for `SECS` seconds, each timed from the SET's send to WAIT's
//! answer (so a sample is one write applied and acknowledged by a replica
//! server). Prints `n=<samples> p50_ms=<..> p99_ms=<..> p999_ms=<..>
//! max_ms=<..>`; exits non-zero if a WAIT counted no replica within 5 s.
//!
//! Usage: cargo run --release --example wait_latency -- HOST:PORT SECS

use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [addr, secs] = &args[..] else {
        eprintln!("usage: wait_latency HOST:PORT SECS");
        std::process::exit(2);
    };
    let secs: u64 = secs.parse().expect("SECS in seconds");
    let mut con = redis::Client::open(format!("redis://{addr}/"))
        .and_then(|c| c.get_connection())
        .expect("a connection to the primary");
    let (start, mut samples) = (Instant::now(), Vec::new());
    while start.elapsed() < Duration::from_secs(secs) {
        let t = Instant::now();
        let acked: i64 = redis::pipe()
            .cmd("SET")
            .arg("wait-latency:probe")
            .arg(samples.len())
            .ignore()
            .cmd("WAIT")
            .arg(1)
            .arg(5000)
            .query::<(i64,)>(&mut con)
            .expect("SET and WAIT on the primary")
            .0;
        samples.push(t.elapsed());
        if acked < 1 {
            eprintln!("WAIT counted no replica");
            std::process::exit(1);
        }
    }
    samples.sort();
    let at = |q: f64| {
        let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
        samples[i].as_secs_f64() * 1e3
    };
    println!(
        "n={} p50_ms={:.3} p99_ms={:.3} p999_ms={:.3} max_ms={:.3}",
        samples.len(),
        at(0.50),
        at(0.99),
        at(0.999),
        at(1.0)
    );
}
