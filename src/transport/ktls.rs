//! Kernel TLS for the TCP data path: hands a finished rustls handshake's
//! traffic keys to the kernel (`TCP_ULP` "tls", `TLS_TX`/`TLS_RX`), so an
//! encrypted link sends with `sendfile` and receives with the kernel
//! decrypting into the replica's buffer; tests once whether this kernel can;
//! and reads the handshake record by record, so rustls never holds part of a
//! record the kernel must decrypt. The kernel renews no keys, so a session
//! uses it only below [`MAX_BYTES`] (both ends apply the rule to the offer).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};

use rustls::{CipherSuite, ConnectionTrafficSecrets};

/// The most bytes one session moves with its keys in the kernel: half of
/// AES-128-GCM's limit of 2^24 records of at most 16 KiB under one key.
pub const MAX_BYTES: u64 = 128 << 30;

/// The length of a TLS record header (type, version, length).
const RECORD_HEADER: usize = 5;

/// Why this kernel cannot carry TLS records, or `Ok`.
pub fn available() -> Result<(), &'static str> {
    // The self-test's error, once: why not, in words.
    static WHY_NOT: OnceLock<Option<String>> = OnceLock::new();
    match WHY_NOT.get_or_init(|| self_test().err().map(|e| e.to_string())) {
        Some(why) => Err(why),
        None => Ok(()),
    }
}

/// Whether a session of `bytes` moves its records in the kernel, with
/// `[data] kernel_tls` set to `enabled`.
pub fn use_kernel(enabled: bool, bytes: u64) -> bool {
    enabled && bytes <= MAX_BYTES && available().is_ok()
}

/// How the data plane's TLS is done here, for the status and the logs.
pub fn describe(enabled: bool) -> String {
    if !enabled {
        return "rustls in user space (kernel TLS off: [data] kernel_tls = false)".into();
    }
    match available() {
        Ok(()) => "kernel TLS (rustls handshake, AES-128-GCM records in the kernel)".into(),
        Err(why) => format!("rustls in user space (kernel TLS unavailable: {why})"),
    }
}

/// Why the keys could not be handed to the kernel.
#[derive(Debug, thiserror::Error)]
pub enum KtlsError {
    /// The kernel cannot take this connection (another cipher than the
    /// self-test proved, records still to send, or a socket that refuses
    /// the `tls` protocol): the connection is unchanged and rustls carries
    /// on in user space.
    #[error("TLS stays in user space on this connection: {0}")]
    Refused(String, Box<rustls::Connection>),
    /// rustls could not give up the connection's keys, or the kernel took
    /// the protocol but not the keys: the connection cannot be used.
    #[error("kernel TLS setup failed after the handshake: {0}")]
    Failed(String),
}

/// Moves `conn`'s record protection onto `stream`: from now on the kernel
/// encrypts what is written to the socket and decrypts what is read.
/// Returns the plaintext rustls had already decrypted, which comes first.
/// rustls must have read through a [`RecordReader`] and stopped at the end
/// of a record, and have nothing left to send: the source hands over after
/// the session proof (a read that returns plaintext has just finished a
/// record); the replica right after its handshake (the source sends
/// nothing until it has the proof). Only AES-128-GCM, the data plane's
/// first choice and what [`available`] proved, goes to the kernel.
pub fn offload(stream: &TcpStream, mut conn: rustls::Connection) -> Result<Vec<u8>, KtlsError> {
    let fd = stream.as_raw_fd();
    let suite = conn.negotiated_cipher_suite().map(|s| s.suite());
    if suite != Some(CipherSuite::TLS13_AES_128_GCM_SHA256) {
        let why = format!("the kernel takes only AES-128-GCM here, not {suite:?}");
        return Err(KtlsError::Refused(why, Box::new(conn)));
    }
    if conn.wants_write() {
        let why = "rustls still has records to send".to_string();
        return Err(KtlsError::Refused(why, Box::new(conn)));
    }
    if let Err(e) = setsockopt(fd, libc::SOL_TCP, libc::TCP_ULP, b"tls") {
        let why = format!("the socket refused the tls protocol: {e}");
        return Err(KtlsError::Refused(why, Box::new(conn)));
    }
    let mut early = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match conn.reader().read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => early.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(KtlsError::Failed(e.to_string())),
        }
    }
    let secrets = conn
        .dangerous_extract_secrets()
        .map_err(|e| KtlsError::Failed(e.to_string()))?;
    for (dir, (seq, keys)) in [(libc::TLS_TX, secrets.tx), (libc::TLS_RX, secrets.rx)] {
        let ConnectionTrafficSecrets::Aes128Gcm { key, iv } = keys else {
            return Err(KtlsError::Failed(
                "rustls gave keys of another cipher".into(),
            ));
        };
        let info = aes_128_gcm(seq, key.as_ref(), iv.as_ref())
            .ok_or_else(|| KtlsError::Failed("AES-128-GCM keys of the wrong size".into()))?;
        setsockopt(fd, libc::SOL_TLS, dir, &info).map_err(|e| KtlsError::Failed(e.to_string()))?;
    }
    // Lets the kernel decrypt into the reader's buffer (kernels from 6.0;
    // older ones decrypt, then copy). A padded record is still read right.
    let _ = setsockopt(fd, libc::SOL_TLS, libc::TLS_RX_EXPECT_NO_PAD, &1u32);
    Ok(early)
}

/// What a socket error means when the kernel opens the records: its
/// errno alone would not say.
pub fn explain(e: &std::io::Error) -> Option<&'static str> {
    match e.raw_os_error()? {
        libc::EBADMSG => Some("a TLS record failed its integrity check (changed on the path?)"),
        libc::EIO => Some("the peer sent a TLS record that is not data (an alert?)"),
        libc::EMSGSIZE => Some("the peer sent an oversized TLS record"),
        _ => None,
    }
}

/// Sets socket option `name` to the bytes of `value`.
fn setsockopt<T>(fd: i32, level: i32, name: i32, value: &T) -> std::io::Result<()> {
    let len = size_of::<T>() as libc::socklen_t;
    // SAFETY: `value` is a live `T` of `len` bytes for the call; the kernel
    // only copies them.
    let rc = unsafe { libc::setsockopt(fd, level, name, (value as *const T).cast(), len) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// One direction's TLS 1.3 AES-128-GCM keys in the kernel's layout, with
/// record sequence `seq`: the 12-byte nonce base is a 4-byte salt and an
/// 8-byte IV. `None` for keys of other sizes.
fn aes_128_gcm(seq: u64, key: &[u8], nonce: &[u8]) -> Option<libc::tls12_crypto_info_aes_gcm_128> {
    let (salt, iv) = nonce.split_at_checked(4)?;
    Some(libc::tls12_crypto_info_aes_gcm_128 {
        info: libc::tls_crypto_info {
            version: libc::TLS_1_3_VERSION,
            cipher_type: libc::TLS_CIPHER_AES_GCM_128,
        },
        iv: iv.try_into().ok()?,
        key: key.try_into().ok()?,
        salt: salt.try_into().ok()?,
        rec_seq: seq.to_be_bytes(),
    })
}

/// Sends a record sealed by the kernel over loopback and opens it on the
/// other end, with a fixed test key: proves the `tls` module, TLS 1.3 and
/// AES-128-GCM in both directions.
fn self_test() -> std::io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let tx = TcpStream::connect(listener.local_addr()?)?;
    let (rx, _) = listener.accept()?;
    let key = aes_128_gcm(0, &[7; 16], &[9; 12]).expect("sizes of AES-128-GCM");
    for (s, dir) in [(&tx, libc::TLS_TX), (&rx, libc::TLS_RX)] {
        setsockopt(s.as_raw_fd(), libc::SOL_TCP, libc::TCP_ULP, b"tls")
            .map_err(|e| with_context(e, "the tls module (tcp_ulp)"))?;
        setsockopt(s.as_raw_fd(), libc::SOL_TLS, dir, &key)
            .map_err(|e| with_context(e, "TLS 1.3 AES-128-GCM keys"))?;
    }
    (&tx).write_all(b"kvsync")?;
    rx.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    let mut got = [0u8; 6];
    (&rx).read_exact(&mut got)?;
    if &got == b"kvsync" {
        Ok(())
    } else {
        Err(std::io::Error::other("the kernel's record did not open"))
    }
}

fn with_context(e: std::io::Error, what: &str) -> std::io::Error {
    let why = match e.raw_os_error() {
        Some(libc::ENOENT) => "not in this kernel".to_string(),
        _ => e.to_string(),
    };
    std::io::Error::new(e.kind(), format!("{what}: {why}"))
}

/// A stream whose reads end at TLS record boundaries: a read returns at
/// most the rest of the current record (or of its header), so when rustls
/// finishes a record it holds no byte of the next one, which stays in the
/// socket for the kernel. Writes pass through.
pub struct RecordReader<S> {
    inner: S,
    header: [u8; RECORD_HEADER],
    /// Header bytes of the next record read so far.
    have: usize,
    /// Body bytes of the current record still to read.
    body: usize,
}

impl<S> RecordReader<S> {
    pub fn new(inner: S) -> Self {
        RecordReader {
            inner,
            header: [0; RECORD_HEADER],
            have: 0,
            body: 0,
        }
    }

    pub fn into_inner(self) -> S {
        self.inner
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// How many bytes the next read may take.
    fn limit(&self, want: usize) -> usize {
        want.min(if self.body > 0 {
            self.body
        } else {
            RECORD_HEADER - self.have
        })
    }

    /// Accounts for `got`, the bytes just read.
    fn advance(&mut self, got: &[u8]) {
        if self.body > 0 {
            self.body -= got.len();
            return;
        }
        self.header[self.have..self.have + got.len()].copy_from_slice(got);
        self.have += got.len();
        if self.have == RECORD_HEADER {
            self.have = 0;
            self.body = u16::from_be_bytes([self.header[3], self.header[4]]) as usize;
        }
    }
}

impl<S: Read> Read for RecordReader<S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.limit(buf.len());
        let got = self.inner.read(&mut buf[..n])?;
        self.advance(&buf[..got]);
        Ok(got)
    }
}

impl<S: Write> Write for RecordReader<S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.inner.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for RecordReader<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let n = this.limit(buf.remaining());
        let mut limited = buf.take(n);
        let at = limited.filled().as_ptr();
        std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, &mut limited))?;
        assert_eq!(
            limited.filled().as_ptr(),
            at,
            "the reader swapped its buffer"
        );
        let got = limited.filled().len();
        // SAFETY: `limited` is `buf`'s unfilled part (checked above), of
        // which the read initialised the first `got` bytes.
        unsafe { buf.assume_init(got) };
        let start = buf.filled().len();
        buf.advance(got);
        this.advance(&buf.filled()[start..]);
        Poll::Ready(Ok(()))
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for RecordReader<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record-exact reader never hands over bytes past the record it is
    /// in, whatever the caller asks for.
    #[test]
    fn reads_stop_at_record_boundaries() {
        let mut wire = Vec::new();
        for body in [3usize, 0, 300] {
            wire.extend_from_slice(&[0x17, 3, 3]);
            wire.extend_from_slice(&(body as u16).to_be_bytes());
            wire.extend(std::iter::repeat_n(0xab, body));
        }
        let mut r = RecordReader::new(&wire[..]);
        let mut sizes = Vec::new();
        let mut buf = [0u8; 1024];
        loop {
            let n = r.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            sizes.push(n);
        }
        assert_eq!(sizes, vec![5, 3, 5, 5, 300]);
    }

    /// The kernel's AES-128-GCM layout: salt, then IV, from rustls's
    /// 12-byte nonce base; the sequence number big-endian.
    #[test]
    fn aes_128_gcm_keys_in_the_kernels_layout() {
        let nonce: Vec<u8> = (0..12).collect();
        let info = aes_128_gcm(0x0102, &[5; 16], &nonce).unwrap();
        assert_eq!(info.salt, [0, 1, 2, 3]);
        assert_eq!(info.iv, [4, 5, 6, 7, 8, 9, 10, 11]);
        assert_eq!(info.rec_seq, [0, 0, 0, 0, 0, 0, 1, 2]);
        assert_eq!(info.key, [5; 16]);
        assert_eq!(
            (info.info.version, info.info.cipher_type),
            (0x0304, libc::TLS_CIPHER_AES_GCM_128)
        );
        assert!(aes_128_gcm(0, &[5; 32], &nonce).is_none(), "an AES-256 key");
        assert!(aes_128_gcm(0, &[5; 16], &nonce[..8]).is_none());
    }

    /// The kernel's TLS errors are named; others are left as they are.
    #[test]
    fn kernel_tls_errors_are_explained() {
        let e = |n| std::io::Error::from_raw_os_error(n);
        assert!(explain(&e(libc::EBADMSG)).unwrap().contains("integrity"));
        assert!(explain(&e(libc::EIO)).unwrap().contains("not data"));
        assert_eq!(explain(&e(libc::ECONNRESET)), None);
    }

    /// On a kernel without the tls module (this build host's), the
    /// self-test says so, and nothing uses the kernel.
    #[test]
    fn availability_is_reported_either_way() {
        match available() {
            Ok(()) => assert!(use_kernel(true, 1 << 20)),
            Err(why) => {
                assert!(why.contains("tls"), "{why}");
                assert!(!use_kernel(true, 1 << 20));
                assert!(describe(true).contains("kernel TLS unavailable"));
            }
        }
        assert!(!use_kernel(true, MAX_BYTES + 1));
        assert!(!use_kernel(false, 1));
    }
}
