//! A fake Redis server or Sentinel for the attack tests: a RESP listener on
//! 127.0.0.1 port 0 that answers as a primary (`INFO` with `role:master`
//! and the run_id and replication id it is given, `PSYNC` with
//! `+FULLRESYNC` and an RDB of any announced length) or as a Sentinel
//! (`SENTINEL MASTER` naming any address under any epoch, `SUBSCRIBE`),
//! and records every command it receives: a test asserts that nothing,
//! not even `AUTH`, reached it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

/// What the fake says.
#[derive(Debug, Clone)]
pub struct Script {
    pub run_id: String,
    pub replid: String,
    pub offset: u64,
    /// The RDB length `PSYNC`'s answer announces, and the bytes sent (an
    /// empty RDB when the two agree, nothing past the length line else).
    pub rdb_len: u64,
    /// `SENTINEL MASTER`'s answer: the master's address and epoch.
    pub sentinel_master: Option<(String, u16, u64)>,
    /// After `SUBSCRIBE`: this message, published on the channel again and
    /// again at this pace.
    pub publish: Option<(String, std::time::Duration)>,
}

impl Default for Script {
    fn default() -> Self {
        Script {
            run_id: "f".repeat(40),
            replid: "e".repeat(40),
            offset: 1000,
            rdb_len: EMPTY_RDB.len() as u64,
            sentinel_master: None,
            publish: None,
        }
    }
}

/// An RDB with no keys and its checksum off.
pub const EMPTY_RDB: &[u8] = b"REDIS0009\xff\0\0\0\0\0\0\0\0";

/// A running fake; it stops taking connections when dropped.
pub struct Fake {
    pub port: u16,
    seen: Arc<Mutex<Vec<Vec<String>>>>,
    listener: TcpListener,
}

impl Fake {
    pub fn start(script: Script) -> Fake {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (accepting, log) = (listener.try_clone().unwrap(), seen.clone());
        std::thread::spawn(move || {
            for con in accepting.incoming() {
                let Ok(con) = con else { return };
                let (script, log) = (script.clone(), log.clone());
                std::thread::spawn(move || serve(con, &script, &log));
            }
        });
        Fake {
            port,
            seen,
            listener,
        }
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Every command received so far, each as its words.
    pub fn seen(&self) -> Vec<Vec<String>> {
        self.seen.lock().unwrap().clone()
    }

    /// The names of the commands received so far, upper-cased.
    pub fn commands(&self) -> Vec<String> {
        self.seen()
            .iter()
            .map(|c| c.first().cloned().unwrap_or_default().to_uppercase())
            .collect()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        // The accept loop ends on its next connection's error.
        let _ = self.listener.set_nonblocking(true);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn serve(con: TcpStream, script: &Script, log: &Mutex<Vec<Vec<String>>>) {
    let mut out = con.try_clone().unwrap();
    let mut read = BufReader::new(con);
    while let Some(words) = command(&mut read) {
        log.lock().unwrap().push(words.clone());
        let name = words.first().map(|w| w.to_uppercase()).unwrap_or_default();
        let arg = |i: usize| words.get(i).map(|w| w.to_uppercase()).unwrap_or_default();
        let reply: Vec<u8> = match name.as_str() {
            "AUTH" | "REPLCONF" | "CLIENT" | "SELECT" => b"+OK\r\n".to_vec(),
            "PING" => b"+PONG\r\n".to_vec(),
            "INFO" => bulk(&format!(
                "# Server\r\nrun_id:{}\r\n# Replication\r\nrole:master\r\nconnected_slaves:0\r\nmaster_replid:{}\r\nmaster_replid2:0000000000000000000000000000000000000000\r\nmaster_repl_offset:{}\r\nsecond_repl_offset:-1\r\nrepl_backlog_active:1\r\nrepl_backlog_first_byte_offset:1\r\n# Stats\r\nsync_full:0\r\nsync_partial_ok:0\r\n",
                script.run_id, script.replid, script.offset
            )),
            "PSYNC" | "SYNC" => {
                let mut r = format!(
                    "+FULLRESYNC {} {}\r\n${}\r\n",
                    script.replid, script.offset, script.rdb_len
                )
                .into_bytes();
                if script.rdb_len == EMPTY_RDB.len() as u64 {
                    r.extend_from_slice(EMPTY_RDB);
                }
                r
            }
            "SENTINEL" if arg(1) == "MASTER" => match &script.sentinel_master {
                Some((ip, port, epoch)) => array(&[
                    "name",
                    &words[2],
                    "ip",
                    ip,
                    "port",
                    &port.to_string(),
                    "flags",
                    "master",
                    "config-epoch",
                    &epoch.to_string(),
                ]),
                None => b"-ERR No such master with that name\r\n".to_vec(),
            },
            "SUBSCRIBE" => {
                if let Some((message, every)) = script.publish.clone() {
                    let (mut out, channel) = (out.try_clone().unwrap(), words[1].clone());
                    std::thread::spawn(move || loop {
                        std::thread::sleep(every);
                        let frame = [bulk("message"), bulk(&channel), bulk(&message)].concat();
                        let mut m = b"*3\r\n".to_vec();
                        m.extend(frame);
                        if out.write_all(&m).is_err() {
                            return;
                        }
                    });
                }
                format!(
                    "*3\r\n$9\r\nsubscribe\r\n${}\r\n{}\r\n:1\r\n",
                    words[1].len(),
                    words[1]
                )
                .into_bytes()
            }
            _ => format!("-ERR unknown command '{name}'\r\n").into_bytes(),
        };
        if out.write_all(&reply).is_err() {
            return;
        }
    }
}

fn bulk(s: &str) -> Vec<u8> {
    format!("${}\r\n{s}\r\n", s.len()).into_bytes()
}

fn array(items: &[&str]) -> Vec<u8> {
    let mut r = format!("*{}\r\n", items.len()).into_bytes();
    for i in items {
        r.extend(bulk(i));
    }
    r
}

/// The next command: a RESP array of bulk strings, or an inline line.
fn command(read: &mut BufReader<TcpStream>) -> Option<Vec<String>> {
    let mut line = String::new();
    if read.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let line = line.trim_end();
    let Some(n) = line.strip_prefix('*') else {
        return Some(line.split_whitespace().map(str::to_string).collect());
    };
    let n: usize = n.parse().ok()?;
    let mut words = Vec::with_capacity(n);
    for _ in 0..n {
        let mut head = String::new();
        read.read_line(&mut head).ok()?;
        let len: usize = head.trim_end().strip_prefix('$')?.parse().ok()?;
        let mut word = vec![0; len + 2];
        read.read_exact(&mut word).ok()?;
        word.truncate(len);
        words.push(String::from_utf8_lossy(&word).into_owned());
    }
    Some(words)
}
