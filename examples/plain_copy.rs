//! Benchmark baseline: a plain single-stream TCP copy of a file on
//! loopback, as fast as one stream simply gets: `sendfile` from the file
//! into the socket, `recv` into a 4 MiB buffer, `write` to the destination,
//! `fsync` at the end like kvsync's install. Prints the elapsed seconds of
//! the whole copy, the bytes, and the CPU seconds both ends used together.
//!
//! Usage: cargo run --release --example plain_copy -- SRC DEST

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Instant;

const BUF: usize = 4 << 20;

/// User plus system CPU seconds of this process (both threads).
fn cpu_secs() -> f64 {
    // SAFETY: getrusage writes into the zeroed struct we own.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (src, dest) = (args[1].clone(), args[2].clone());
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let started = Instant::now();
    let cpu = cpu_secs();
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
    let sock = TcpStream::connect(addr)?;
    let file = std::fs::File::open(&src)?;
    let len = file.metadata()?.len();
    let mut offset: libc::off_t = 0;
    while (offset as u64) < len {
        let want = (len - offset as u64).min(1 << 30) as usize;
        // SAFETY: both descriptors are open for the call; `offset` is ours.
        let n = unsafe { libc::sendfile(sock.as_raw_fd(), file.as_raw_fd(), &mut offset, want) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        } else if n == 0 {
            break;
        }
    }
    drop(sock);
    let total = receiver.join().expect("receiver thread")?;
    println!(
        "{:.6} {total} {:.3}",
        started.elapsed().as_secs_f64(),
        cpu_secs() - cpu
    );
    Ok(())
}
