//! The RDB payload a master sends its replica in a full resync: `$<len>\r\n`
//! and the RDB's bytes, from an installed file or from a snapshot that
//! still arrives.
//!
//! An arriving snapshot goes out piece by piece in file order, each piece
//! once the receiver verified it against the origin's manifest, so the
//! server loads while the rest still moves. Its last piece goes only once
//! the job accepted the whole snapshot (verified end to end and installed):
//! a server cannot finish loading an RDB without its end (the EOF opcode
//! and checksum), so it never loads bytes kvsync did not accept. A failure
//! before then ends the payload short; the server drops what it buffered
//! and keeps its data (its `repl-diskless-load` rules). Until the first
//! piece is ready the server gets a newline a second, the keepalive a
//! master sends before a payload. The length is the manifest's, known
//! before any byte arrives, so the EOF-marker form is never needed.
//!
//! A payload is cheap to clone and each clone sends the whole: the stream
//! feed serves the same arriving snapshot to each full resync its server
//! asks for, and [`Payload::refused`] tells it when one never will be whole.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};

use crate::snapshot::manifest::Manifest;
use crate::store::arrivals::Arrivals;

/// Bytes per read of an arriving snapshot, and per write to the server.
const BLOCK: u64 = 1 << 20;
/// Blocks read ahead of the server.
const AHEAD: usize = 4;
/// A newline this often until the payload starts.
const KEEPALIVE: Duration = Duration::from_secs(1);

/// What a full resync sends.
#[derive(Clone)]
pub enum Payload {
    /// An installed RDB.
    File(PathBuf),
    /// A snapshot being received.
    Arriving(Arriving),
}

/// A snapshot being received: its staging file, manifest and arrivals,
/// and the job's verdict on the whole.
#[derive(Clone)]
pub struct Arriving {
    /// The staging file (a clone of the receiver's: it stays readable when
    /// the install renames it).
    pub file: Arc<std::fs::File>,
    pub manifest: Arc<Manifest>,
    pub arrivals: Arc<Arrivals>,
    pub accepted: Accepted,
}

impl Arriving {
    /// The snapshot arriving in `file` per `manifest` and `arrivals`, and
    /// the verdict the job gives on it.
    pub fn new(
        file: std::fs::File,
        manifest: Arc<Manifest>,
        arrivals: Arc<Arrivals>,
    ) -> (Arriving, Verdict) {
        let (verdict, accepted) = Verdict::new();
        let file = Arc::new(file);
        (
            Arriving {
                file,
                manifest,
                arrivals,
                accepted,
            },
            verdict,
        )
    }
}

/// The job's verdict on an arriving snapshot, given once: `Ok` when the
/// whole is accepted, `Err` with why when it never will be.
pub struct Verdict(watch::Sender<Option<Result<(), String>>>);

/// Where the verdict is awaited; a verdict dropped ungiven is a refusal.
#[derive(Clone)]
pub struct Accepted(watch::Receiver<Option<Result<(), String>>>);

impl Verdict {
    fn new() -> (Verdict, Accepted) {
        let (tx, rx) = watch::channel(None);
        (Verdict(tx), Accepted(rx))
    }

    pub fn give(&self, verdict: Result<(), String>) {
        self.0.send_replace(Some(verdict));
    }

    /// Another place to await it.
    pub fn accepted(&self) -> Accepted {
        Accepted(self.0.subscribe())
    }
}

impl Accepted {
    /// Waits for the verdict.
    pub async fn wait(&mut self) -> Result<(), String> {
        match self.0.wait_for(Option::is_some).await {
            Ok(v) => v.clone().expect("a given verdict"),
            Err(_) => Err("the sync ended".into()),
        }
    }

    /// Whether the snapshot is refused, or its verdict dropped ungiven.
    pub fn refused(&self) -> bool {
        match &*self.0.borrow() {
            Some(v) => v.is_err(),
            None => self.0.has_changed().is_err(),
        }
    }
}

/// Why a payload was not sent whole.
#[derive(Debug, thiserror::Error)]
pub enum PayloadError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The snapshot will not be accepted, or a piece will not arrive.
    #[error("the snapshot was not accepted: {0}")]
    NotAccepted(String),
}

impl Payload {
    /// Whether this payload will never be sent whole: an arriving snapshot
    /// that was refused, or whose sync ended without a verdict.
    pub fn refused(&self) -> bool {
        match self {
            Payload::File(_) => false,
            Payload::Arriving(a) => a.accepted.refused(),
        }
    }

    /// Sends `$<len>\r\n` and the bytes; returns the bytes sent.
    pub async fn send<W: AsyncWrite + Unpin>(self, write: &mut W) -> Result<u64, PayloadError> {
        match self {
            Payload::File(path) => {
                let mut file = tokio::fs::File::from_std(crate::sys::fs::open_read(&path)?);
                let len = file.metadata().await?.len();
                write.write_all(format!("${len}\r\n").as_bytes()).await?;
                tokio::io::copy(&mut file, write).await?;
                write.flush().await?;
                Ok(len)
            }
            Payload::Arriving(arriving) => send_arriving(arriving, write).await,
        }
    }
}

async fn send_arriving<W: AsyncWrite + Unpin>(
    arriving: Arriving,
    write: &mut W,
) -> Result<u64, PayloadError> {
    let len = arriving.manifest.info.size;
    let (tx, mut rx) = mpsc::channel(AHEAD);
    // Ends when the channel closes (this future dropped) or a wait fails.
    let runtime = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || read_in_order(arriving, &runtime, tx));
    let mut keepalive =
        tokio::time::interval_at(tokio::time::Instant::now() + KEEPALIVE, KEEPALIVE);
    let first = loop {
        tokio::select! {
            block = rx.recv() => break block,
            _ = keepalive.tick() => write.write_all(b"\n").await?,
        }
    };
    write.write_all(format!("${len}\r\n").as_bytes()).await?;
    let mut next = first;
    let mut sent = 0;
    while let Some(block) = next {
        let block = block?;
        write.write_all(&block).await?;
        sent += block.len() as u64;
        next = rx.recv().await;
    }
    write.flush().await?;
    debug_assert_eq!(sent, len, "read_in_order sends every piece or an error");
    Ok(sent)
}

/// Reads the verified pieces in order, in blocks, into `tx`; the last
/// piece once the snapshot is accepted. Stops at the first error (sent
/// on) or when nobody reads.
fn read_in_order(
    a: Arriving,
    runtime: &tokio::runtime::Handle,
    tx: mpsc::Sender<Result<Vec<u8>, PayloadError>>,
) {
    use std::os::unix::fs::FileExt;
    let Arriving {
        file,
        manifest,
        arrivals,
        mut accepted,
    } = a;
    let last = manifest.pieces().saturating_sub(1);
    for index in 0..manifest.pieces() {
        let ready = arrivals
            .wait(index)
            .map_err(|e| PayloadError::NotAccepted(e.to_string()))
            .and_then(|()| match index == last {
                true => runtime
                    .block_on(accepted.wait())
                    .map_err(PayloadError::NotAccepted),
                false => Ok(()),
            });
        if let Err(e) = ready {
            let _ = tx.blocking_send(Err(e));
            return;
        }
        let (offset, len) = manifest.range(index);
        let mut at = 0;
        while at < len {
            let mut block = vec![0u8; BLOCK.min(len - at) as usize];
            let read = file
                .read_exact_at(&mut block, offset + at)
                .map(|()| block)
                .map_err(PayloadError::from);
            let failed = read.is_err();
            if tx.blocking_send(read).is_err() || failed {
                return;
            }
            at += BLOCK;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::manifest::PieceHasher;
    use crate::snapshot::{Format, SnapshotInfo};
    use std::io::Write;
    use tokio::io::AsyncReadExt;

    const PIECE: u64 = 1 << 20;

    /// What the job holds of an arriving snapshot: its arrivals and the
    /// verdict to give.
    type Job = (Arc<Arrivals>, Verdict);

    /// A 3.5-piece snapshot in a file, its manifest and fresh arrivals.
    fn arriving() -> (Vec<u8>, Arriving, Job) {
        let bytes: Vec<u8> = (0..(3 * PIECE + PIECE / 2))
            .map(|i| (i % 251) as u8)
            .collect();
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&bytes).unwrap();
        let mut hasher = PieceHasher::new(PIECE);
        hasher.update(&bytes);
        let manifest = Arc::new(hasher.finish(SnapshotInfo {
            format: Format::RedisRdb,
            size: bytes.len() as u64,
            seq: 7,
            checksum: 0,
            records: 0,
            created_ms: 0,
            repl_id: None,
        }));
        let arrivals = Arc::new(Arrivals::new(vec![false; 4]));
        let (a, verdict) = Arriving::new(file, manifest, arrivals.clone());
        (bytes, a, (arrivals, verdict))
    }

    /// Reads what the server got until `want` bytes or the end.
    async fn got(read: &mut tokio::io::DuplexStream, want: usize) -> Vec<u8> {
        let mut out = vec![0u8; want];
        let mut n = 0;
        while n < want {
            match tokio::time::timeout(Duration::from_secs(10), read.read(&mut out[n..])).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(k)) => n += k,
                Err(_) => panic!("nothing more arrived after {n} bytes"),
            }
        }
        out.truncate(n);
        out
    }

    /// Verified pieces go out in order as they verify, a later one waits
    /// for the one before, and the last waits for the verdict.
    #[tokio::test]
    async fn pieces_go_out_in_order_as_they_verify_and_the_last_once_accepted() {
        let (bytes, a, (arrivals, accept)) = arriving();
        let (mut write, mut read) = tokio::io::duplex(8 << 20);
        let sending = tokio::spawn(async move { Payload::Arriving(a).send(&mut write).await });
        arrivals.mark(1);
        arrivals.mark(0);
        let header = format!("${}\r\n", bytes.len());
        let first = got(&mut read, header.len() + 2 * PIECE as usize).await;
        assert_eq!(&first[..header.len()], header.as_bytes());
        assert_eq!(&first[header.len()..], &bytes[..2 * PIECE as usize]);
        arrivals.mark(3);
        arrivals.mark(2);
        let third = got(&mut read, PIECE as usize).await;
        assert_eq!(third, &bytes[2 * PIECE as usize..3 * PIECE as usize]);
        // The last piece is verified, and still held.
        let held = tokio::time::timeout(Duration::from_millis(200), read.read(&mut [0u8; 1])).await;
        assert!(held.is_err(), "the last piece went out before the verdict");
        accept.give(Ok(()));
        let rest = got(&mut read, PIECE as usize).await;
        assert_eq!(rest, &bytes[3 * PIECE as usize..]);
        assert_eq!(sending.await.unwrap().unwrap(), bytes.len() as u64);
    }

    /// Every clone of an arriving payload sends the whole, and tells when
    /// it never will: refused, or its verdict dropped ungiven.
    #[tokio::test]
    async fn each_clone_sends_the_whole_and_a_dropped_verdict_is_a_refusal() {
        let (bytes, a, (arrivals, accept)) = arriving();
        let (first, second) = (Payload::Arriving(a.clone()), Payload::Arriving(a));
        assert!(!first.refused());
        (0..4).for_each(|i| arrivals.mark(i));
        accept.give(Ok(()));
        for payload in [first, second] {
            let (mut write, mut read) = tokio::io::duplex(8 << 20);
            let sent = payload.send(&mut write).await.unwrap();
            drop(write);
            let header = format!("${}\r\n", bytes.len());
            let got = got(&mut read, header.len() + bytes.len() + 1).await;
            assert_eq!(
                (sent, &got[header.len()..]),
                (bytes.len() as u64, &bytes[..])
            );
        }

        let (_, a, (_arrivals, accept)) = arriving();
        let payload = Payload::Arriving(a);
        drop(accept);
        assert!(payload.refused());
        let (_, a, (_arrivals, accept)) = arriving();
        accept.give(Err("the check failed".into()));
        assert!(Payload::Arriving(a).refused());
    }

    /// A snapshot that is not accepted ends the payload short of its last
    /// piece; one whose receive ends does so at the missing piece.
    #[tokio::test]
    async fn a_refused_or_ended_snapshot_ends_the_payload_short() {
        let (bytes, a, (arrivals, accept)) = arriving();
        let (mut write, mut read) = tokio::io::duplex(8 << 20);
        let sending = tokio::spawn(async move { Payload::Arriving(a).send(&mut write).await });
        (0..4).for_each(|i| arrivals.mark(i));
        accept.give(Err("the installed file differs".into()));
        let err = sending.await.unwrap().unwrap_err();
        assert!(
            err.to_string().contains("the installed file differs"),
            "{err}"
        );
        let sent = got(&mut read, bytes.len() + 16).await;
        assert_eq!(
            sent.len(),
            format!("${}\r\n", bytes.len()).len() + 3 * PIECE as usize
        );

        let (_, a, (arrivals, _accept)) = arriving();
        let (mut write, _read) = tokio::io::duplex(8 << 20);
        let sending = tokio::spawn(async move { Payload::Arriving(a).send(&mut write).await });
        arrivals.mark(0);
        arrivals.end("the source went away");
        let err = sending.await.unwrap().unwrap_err();
        assert!(err.to_string().contains("the source went away"), "{err}");
    }

    /// Before the first piece the server hears a newline a second, and
    /// nothing of the payload.
    #[tokio::test]
    async fn the_server_hears_keepalives_until_the_first_piece() {
        let (_, a, (arrivals, _accept)) = arriving();
        let (mut write, mut read) = tokio::io::duplex(8 << 20);
        tokio::spawn(async move { Payload::Arriving(a).send(&mut write).await });
        assert_eq!(read.read_u8().await.unwrap(), b'\n');
        arrivals.mark(0);
        loop {
            match read.read_u8().await.unwrap() {
                b'$' => break,
                b => assert_eq!(b, b'\n', "only newlines before the payload"),
            }
        }
        // The reader thread stops waiting for piece 1.
        arrivals.end("the test is over");
    }
}
