//! The `redis-replicate` handoff: the replica's agent acts as a one-shot
//! master, so a running Redis/Valkey server takes the verified RDB over the
//! replication protocol, without a restart and without a file placed in its
//! directory, and then continues from M+1 with the real primary
//! (docs/ARCHITECTURE.md, "Handoff").
//!
//! The steps: listen on `[redis] seed_listen` (loopback, a fresh port);
//! `REPLICAOF` the seed address on the local server; accept exactly one
//! connection, from the server's own address; answer its handshake (`PING`,
//! `AUTH`, `REPLCONF`) as a master would and its `PSYNC` with `+FULLRESYNC
//! <repl-id> <M>` and the RDB as one bulk payload; wait until the server has
//! loaded it and reports the RDB's replication id and offset; then
//! `REPLICAOF` the primary and confirm the partial resync as the `redis`
//! handoff does. Any other connection to the seed port is answered with an
//! error and closed. A failure puts the server's replication back as it was
//! (its old master, or none).

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tracing::{info, warn};

use crate::config::{HostPort, RedisConfig};
use crate::kv::redis::{
    confirm_partial, connect, info, infos, server_err, until, Info, RedisError,
};
use crate::snapshot::SnapshotInfo;

/// Most arguments, and bytes per argument, of a command the seed accepts.
const MAX_ARGS: usize = 16;
const MAX_ARG: usize = 1024;

/// Seeds the local server from the verified RDB `rdb` saved at `snapshot`
/// over the replication protocol, then points it at the primary.
pub async fn replicate(
    cfg: &RedisConfig,
    timeout: Duration,
    rdb: &Path,
    snapshot: &SnapshotInfo,
) -> Result<String, RedisError> {
    let repl_id = snapshot
        .repl_id
        .as_deref()
        .ok_or_else(|| RedisError::Precondition("the RDB carries no replication id".into()))?;
    let before = info(&cfg.primary, &cfg.password, "stats").await?;
    let (server, password) = (&cfg.server_addr, &cfg.password);
    let was = info(server, password, "replication").await?;
    let listener = TcpListener::bind(&cfg.seed_listen)
        .await
        .map_err(|e| RedisError::Seed(format!("cannot listen on {}: {e}", cfg.seed_listen)))?;
    let seed = listener
        .local_addr()
        .map_err(|e| RedisError::Seed(e.to_string()))?;
    let mut con = connect(server, password).await?;
    replicaof(&mut con, server, &seed.ip().to_string(), seed.port()).await?;
    info!(%seed, seq = snapshot.seq, "serving the RDB to the local server as its master");
    let seeded = async {
        let stream = accept_one(&listener, server_ip(server).await?, timeout).await?;
        let mut serving = tokio::spawn(serve(
            stream,
            rdb.to_owned(),
            repl_id.to_string(),
            snapshot.seq,
        ));
        let loaded = tokio::select! {
            r = loaded(cfg, timeout, repl_id, snapshot.seq, seed.port()) => r,
            r = &mut serving => Err(match r {
                Ok(Ok(())) => RedisError::Seed(
                    "the local server closed the seed connection before it had loaded the RDB (its log says why: a failed load?)".into(),
                ),
                Ok(Err(e)) => e,
                Err(e) => RedisError::Seed(format!("the seed task: {e}")),
            }),
            // Any other connection meanwhile is turned away.
            _ = turn_away(&listener) => unreachable!("turn_away never returns"),
        };
        // The seed connection stays open until the server leaves it for
        // the primary, so it never tries to reconnect to the seed.
        let serving = serving.abort_handle();
        if loaded.is_err() {
            serving.abort();
        }
        loaded.map(|()| serving)
    }
    .await;
    drop(listener);
    let primary: HostPort = cfg
        .primary
        .parse()
        .map_err(|e| server_err(&cfg.primary, e))?;
    let followed = match seeded {
        Ok(serving) => {
            let followed = replicaof(&mut con, server, &primary.host, primary.port).await;
            serving.abort();
            followed
        }
        Err(e) => Err(e),
    };
    if let Err(e) = followed {
        restore_role(&mut con, server, &was).await;
        return Err(e);
    }
    confirm_partial(cfg, timeout, &before, snapshot).await
}

/// `REPLICAOF host port` on the local server.
async fn replicaof(
    con: &mut redis::aio::MultiplexedConnection,
    server: &str,
    host: &str,
    port: u16,
) -> Result<(), RedisError> {
    redis::cmd("REPLICAOF")
        .arg(host)
        .arg(port)
        .query_async::<()>(con)
        .await
        .map_err(|e| {
            RedisError::Seed(format!(
                "the local server {server} refused REPLICAOF {host} {port}: {e} (it must accept REPLICAOF from kvsync; a renamed or ACL-denied command cannot be used)"
            ))
        })
}

/// Puts the server's replication back as it was before the handoff.
async fn restore_role(con: &mut redis::aio::MultiplexedConnection, server: &str, was: &Info) {
    let back = match (
        was.get("role"),
        was.get("master_host"),
        was.get("master_port"),
    ) {
        (Some("slave"), Some(host), Some(port)) => {
            redis::cmd("REPLICAOF").arg(host).arg(port).clone()
        }
        _ => redis::cmd("REPLICAOF").arg("NO").arg("ONE").clone(),
    };
    if let Err(e) = back.query_async::<()>(con).await {
        warn!(server, error = %e, "cannot put the server's replication back as it was");
    }
}

/// The address the local server connects from.
async fn server_ip(server: &str) -> Result<std::net::IpAddr, RedisError> {
    let addr = tokio::net::lookup_host(server)
        .await
        .map_err(|e| server_err(server, e))?
        .next()
        .ok_or_else(|| server_err(server, "no address"))?;
    Ok(addr.ip())
}

/// The first connection from `peer`; others before it are turned away.
async fn accept_one(
    listener: &TcpListener,
    peer: std::net::IpAddr,
    timeout: Duration,
) -> Result<TcpStream, RedisError> {
    let accept = async {
        loop {
            let (stream, from) = listener
                .accept()
                .await
                .map_err(|e| RedisError::Seed(e.to_string()))?;
            if from.ip() == peer {
                return Ok(stream);
            }
            refuse(stream, from).await;
        }
    };
    tokio::time::timeout(timeout, accept)
        .await
        .map_err(|_| RedisError::Timeout {
            what: "the local server to connect to the seed".into(),
            after: timeout,
        })?
}

/// Answers every further connection with an error and closes it.
async fn turn_away(listener: &TcpListener) {
    loop {
        if let Ok((stream, from)) = listener.accept().await {
            refuse(stream, from).await;
        }
    }
}

async fn refuse(mut stream: TcpStream, from: SocketAddr) {
    warn!(%from, "refused a connection to the seed port: it serves one server once");
    let _ = stream
        .write_all(b"-ERR this kvsync seed serves one replica, once\r\n")
        .await;
}

/// The master's side of one replica's handshake and full resync.
async fn serve(
    stream: TcpStream,
    rdb: std::path::PathBuf,
    repl_id: String,
    seq: u64,
) -> Result<(), RedisError> {
    let err = |e: std::io::Error| RedisError::Seed(format!("the seed connection: {e}"));
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    loop {
        let args = read_command(&mut read).await?;
        let name = args
            .first()
            .map(|a| a.to_ascii_uppercase())
            .unwrap_or_default();
        match name.as_str() {
            "PING" => write.write_all(b"+PONG\r\n").await.map_err(err)?,
            "AUTH" | "REPLCONF" => write.write_all(b"+OK\r\n").await.map_err(err)?,
            "PSYNC" | "SYNC" => {
                if name == "PSYNC" {
                    let line = format!("+FULLRESYNC {repl_id} {seq}\r\n");
                    write.write_all(line.as_bytes()).await.map_err(err)?;
                }
                let mut file =
                    tokio::fs::File::from_std(crate::sys::fs::open_read(&rdb).map_err(err)?);
                let len = file.metadata().await.map_err(err)?.len();
                write
                    .write_all(format!("${len}\r\n").as_bytes())
                    .await
                    .map_err(err)?;
                tokio::io::copy(&mut file, &mut write).await.map_err(err)?;
                write.flush().await.map_err(err)?;
                info!(bytes = len, "RDB sent to the local server");
                // Its acknowledgements follow; nothing more is sent, so its
                // offset stays M.
                let mut sink = [0u8; 4096];
                while read.read(&mut sink).await.map_err(err)? > 0 {}
                return Ok(());
            }
            _ => {
                return Err(RedisError::Seed(format!(
                    "the local server sent {name:?} in its replication handshake"
                )))
            }
        }
    }
}

/// One command: a RESP array of bulk strings, or an inline line.
async fn read_command<R: tokio::io::AsyncBufRead + Unpin>(
    read: &mut R,
) -> Result<Vec<String>, RedisError> {
    let bad = |what: &str| RedisError::Seed(format!("the local server sent {what}"));
    let line = read_line(read).await?;
    let Some(count) = line.strip_prefix('*') else {
        let args: Vec<String> = line.split_whitespace().map(str::to_string).collect();
        if args.is_empty() || args.len() > MAX_ARGS {
            return Err(bad("an empty or overlong inline command"));
        }
        return Ok(args);
    };
    let count: usize = count.parse().map_err(|_| bad("a malformed array"))?;
    if count == 0 || count > MAX_ARGS {
        return Err(bad("a command with too many arguments"));
    }
    let mut args = Vec::with_capacity(count);
    for _ in 0..count {
        let len: usize = read_line(read)
            .await?
            .strip_prefix('$')
            .and_then(|l| l.parse().ok())
            .filter(|l| *l <= MAX_ARG)
            .ok_or_else(|| bad("a malformed or overlong argument"))?;
        let mut arg = vec![0u8; len + 2];
        read.read_exact(&mut arg)
            .await
            .map_err(|e| RedisError::Seed(e.to_string()))?;
        arg.truncate(len);
        args.push(String::from_utf8(arg).map_err(|_| bad("a non-UTF-8 argument"))?);
    }
    Ok(args)
}

/// One CRLF-terminated line of at most `MAX_ARG` bytes.
async fn read_line<R: tokio::io::AsyncBufRead + Unpin>(read: &mut R) -> Result<String, RedisError> {
    let mut line = Vec::new();
    let n = read
        .take(MAX_ARG as u64 + 2)
        .read_until(b'\n', &mut line)
        .await
        .map_err(|e| RedisError::Seed(e.to_string()))?;
    if n == 0 || !line.ends_with(b"\n") {
        return Err(RedisError::Seed(
            "the local server closed the seed connection, or sent an overlong line".into(),
        ));
    }
    String::from_utf8(line)
        .map(|l| l.trim_end().to_string())
        .map_err(|_| RedisError::Seed("the local server sent a non-UTF-8 line".into()))
}

/// Waits until the server has loaded the RDB from the seed: linked to it,
/// not loading, with the RDB's replication id and offset.
async fn loaded(
    cfg: &RedisConfig,
    timeout: Duration,
    repl_id: &str,
    seq: u64,
    seed_port: u16,
) -> Result<(), RedisError> {
    let (server, password) = (&cfg.server_addr, &cfg.password);
    let seed_port = seed_port.to_string();
    let done = until(
        "the local server to load the RDB from the seed",
        timeout,
        || async {
            let i = infos(server, password, &["replication", "persistence"])
                .await
                .ok()?;
            let linked = i.get("master_link_status") == Some("up")
                && i.get("master_port") == Some(seed_port.as_str())
                && i.get("loading") == Some("0");
            linked.then_some(i)
        },
    )
    .await?;
    let (id, offset) = (
        done.get("master_replid").unwrap_or(""),
        done.num("master_repl_offset"),
    );
    if id != repl_id || offset != seq {
        return Err(RedisError::Seed(format!(
            "after loading, the local server reports replication id {id} offset {offset}, not the RDB's {repl_id} {seq}"
        )));
    }
    info!(seq, "the local server loaded the RDB from the seed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn parse(bytes: &[u8]) -> Result<Vec<String>, RedisError> {
        read_command(&mut BufReader::new(bytes)).await
    }

    #[tokio::test]
    async fn the_seed_takes_only_the_servers_connection_and_turns_others_away() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let seed = listener.local_addr().unwrap();
        // A peer at another address knocks first.
        let stranger = tokio::net::TcpSocket::new_v4().unwrap();
        stranger.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut stranger = stranger.connect(seed).await.unwrap();
        let server = TcpStream::connect(seed).await.unwrap();
        let ip = "127.0.0.1".parse().unwrap();
        let taken = accept_one(&listener, ip, Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(taken.peer_addr().unwrap(), server.local_addr().unwrap());
        let mut answer = String::new();
        stranger.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("-ERR"), "{answer:?}");
    }

    #[tokio::test]
    async fn commands_are_read_in_both_forms_and_bounded() {
        assert_eq!(
            parse(b"*3\r\n$5\r\nPSYNC\r\n$1\r\n?\r\n$2\r\n-1\r\n")
                .await
                .unwrap(),
            ["PSYNC", "?", "-1"]
        );
        assert_eq!(parse(b"PING\r\n").await.unwrap(), ["PING"]);
        assert!(parse(b"*99\r\n").await.is_err());
        assert!(parse(b"*1\r\n$99999\r\n").await.is_err());
        assert!(parse(b"*1\r\n$4\r\nPI").await.is_err());
        assert!(parse(&[b'x'; 2000]).await.is_err());
        assert!(parse(b"").await.is_err());
    }
}
