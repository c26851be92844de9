//! TLS handshakes of the TCP data plane.
//!
//! Owns telling an encrypted connection from a plain one on the source (a
//! TLS ClientHello starts with a handshake record, 0x16; a BLK3 frame with
//! its length's high byte, 0 for every token), the source's handshake on
//! the runtime (inside the connection's `hello_timeout`, before any thread
//! is spent on it), and the replica's blocking handshake, which checks the
//! source's certificate against the agent's CA and the expected name. The
//! settings themselves are built from the agent's `[tls]` files by
//! `rpc::tls`. Both handshakes read through a [`RecordReader`], so that
//! their keys can go to the kernel afterwards (`transport::ktls`). After
//! the handshake the session's bytes go through `tcp::Link`.

use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::ServerName;

use super::ktls::RecordReader;
use super::tcp::TcpError;

/// The first byte of a TLS record carrying a handshake message.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// Whether the peer on `stream` opened with a TLS handshake (waits for its
/// first byte without consuming it).
pub async fn opens_with_tls(stream: &tokio::net::TcpStream) -> std::io::Result<bool> {
    let mut first = [0u8; 1];
    let n = stream.peek(&mut first).await?;
    Ok(n == 1 && first[0] == TLS_HANDSHAKE_RECORD)
}

/// A source's encrypted connection, as its handshake left it.
pub type ServerStream = tokio_rustls::server::TlsStream<RecordReader<tokio::net::TcpStream>>;

/// The source's side of the handshake, on the runtime.
pub async fn accept(
    config: &Arc<rustls::ServerConfig>,
    stream: tokio::net::TcpStream,
) -> std::io::Result<ServerStream> {
    tokio_rustls::TlsAcceptor::from(config.clone())
        .accept(RecordReader::new(stream))
        .await
}

/// The replica's side of the handshake on a connected blocking socket:
/// the source must present a certificate for `name` that chains to the
/// CA in `config`. Fails within `timeout` of silence.
pub fn connect(
    config: &Arc<rustls::ClientConfig>,
    name: &str,
    stream: &TcpStream,
    timeout: Duration,
) -> Result<rustls::ClientConnection, TcpError> {
    let fail = |what: String| TcpError::Tls(format!("TLS with the source's data endpoint: {what}"));
    let server = ServerName::try_from(name.to_string())
        .map_err(|_| fail(format!("{name:?} is not a valid server name")))?;
    let mut conn =
        rustls::ClientConnection::new(config.clone(), server).map_err(|e| fail(e.to_string()))?;
    let io = |e: std::io::Error| TcpError::Io {
        op: "TLS handshake",
        source: e,
    };
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream.set_write_timeout(Some(timeout)).map_err(io)?;
    let mut sock = RecordReader::new(stream);
    while conn.is_handshaking() {
        conn.complete_io(&mut sock).map_err(|e| {
            // A certificate the agent does not trust shows as InvalidData
            // wrapping rustls's reason.
            if e.kind() == std::io::ErrorKind::InvalidData {
                fail(e.to_string())
            } else {
                io(e)
            }
        })?;
    }
    stream.set_write_timeout(None).map_err(io)?;
    Ok(conn)
}
