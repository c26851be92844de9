//! Benchmark baseline: a plain single-stream TCP copy of a file
//! (read → socket → file, 4 MiB buffers, fsync at the end like kvsync's
//! install), on loopback. Prints the elapsed seconds of the whole copy.
//!
//! Usage: cargo run --release --example plain_copy -- SRC DEST

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

const BUF: usize = 4 << 20;

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (src, dest) = (args[1].clone(), args[2].clone());
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let started = Instant::now();
    let receiver = std::thread::spawn(move || -> std::io::Result<u64> {
        let (mut sock, _) = listener.accept()?;
        let mut out = std::fs::File::create(&dest)?;
        let mut buf = vec![0u8; BUF];
        let mut total = 0u64;
        loop {
            let n = sock.read(&mut buf)?;
            if n == 0 {
                break;
            }
            out.write_all(&buf[..n])?;
            total += n as u64;
        }
        out.sync_all()?;
        Ok(total)
    });
    let mut sock = TcpStream::connect(addr)?;
    let mut file = std::fs::File::open(&src)?;
    let mut buf = vec![0u8; BUF];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        sock.write_all(&buf[..n])?;
    }
    drop(sock);
    let total = receiver.join().expect("receiver thread")?;
    println!("{:.6} {total}", started.elapsed().as_secs_f64());
    Ok(())
}
