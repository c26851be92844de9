//! The few pieces of RESP that kvsync speaks on raw replication
//! connections (the seed's master side, the stream follower's replica
//! side), where the `redis` client does not reach: one command encoded as
//! an array of bulk strings, and one CRLF-terminated line read with a bound.

use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt};

/// `args` as a RESP array of bulk strings.
pub fn command(args: &[&str]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// One CRLF- (or LF-) terminated line of at most `max` bytes, without its
/// terminator. A closed connection is `UnexpectedEof`; an overlong or
/// non-UTF-8 line is `InvalidData`.
pub async fn read_line<R: AsyncBufRead + Unpin>(
    read: &mut R,
    max: usize,
) -> std::io::Result<String> {
    let mut line = Vec::new();
    let n = read
        .take(max as u64 + 2)
        .read_until(b'\n', &mut line)
        .await?;
    if n == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    let body = line
        .strip_suffix(b"\n")
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    let Some(body) = body.filter(|b| b.len() <= max) else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a line longer than {max} bytes"),
        ));
    };
    std::str::from_utf8(body)
        .map(|l| l.trim_end().to_string())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "a non-UTF-8 line"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn commands_encode_and_lines_are_bounded() {
        assert_eq!(
            command(&["PSYNC", "?", "-1"]),
            b"*3\r\n$5\r\nPSYNC\r\n$1\r\n?\r\n$2\r\n-1\r\n"
        );
        let mut r = tokio::io::BufReader::new(&b"+OK\r\n\nlong-line\r\n"[..]);
        assert_eq!(read_line(&mut r, 16).await.unwrap(), "+OK");
        assert_eq!(read_line(&mut r, 16).await.unwrap(), "");
        assert_eq!(
            read_line(&mut r, 4).await.unwrap_err().kind(),
            std::io::ErrorKind::InvalidData
        );
        // One byte over the bound, with a bare LF: refused as well.
        let mut r = tokio::io::BufReader::new(&b"12345\n"[..]);
        assert_eq!(
            read_line(&mut r, 4).await.unwrap_err().kind(),
            std::io::ErrorKind::InvalidData
        );
        let mut r = tokio::io::BufReader::new(&b"1234\n1234\r\n"[..]);
        assert_eq!(read_line(&mut r, 4).await.unwrap(), "1234");
        assert_eq!(read_line(&mut r, 4).await.unwrap(), "1234");
        let mut r = tokio::io::BufReader::new(&b""[..]);
        assert_eq!(
            read_line(&mut r, 4).await.unwrap_err().kind(),
            std::io::ErrorKind::UnexpectedEof
        );
    }
}
