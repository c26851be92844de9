//! Hosts for tests: network namespaces on one bridge, each with an `eth0`
//! carrying a real address. Test code (and the processes it
//! starts) runs inside one of them with [`Hosts::run_in`].

use std::os::fd::AsRawFd;
use std::process::Command;

/// The addresses of host 0 and host 1 on their `eth0`.
pub const IPS: [&str; 2] = ["10.77.0.1", "10.77.0.2"];

/// Hosts on one bridge, each in its own network namespace.
pub struct Hosts {
    names: Vec<String>,
    bridge: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Hosts {
    /// Creates the two hosts; `None`, with the reason printed, when this
    /// process may not create network namespaces.
    pub fn create(test: &str) -> Option<Hosts> {
        Hosts::create_n(test, 2)
    }

    /// Creates `n` hosts (at most 250) on one bridge, host `i` at
    /// [`Hosts::ip`]`(i)`; `None`, with the reason printed, when this
    /// process may not create network namespaces.
    pub fn create_n(test: &str, n: usize) -> Option<Hosts> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let id = format!(
            "{}x{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let bridge = format!("kvb{id}");
        if let Err(e) = ip(&["link", "add", &bridge, "type", "bridge"]) {
            super::skip(
                "network namespaces",
                &format!(
                    "{test}: cannot create a bridge and network namespaces ({e}); run as root"
                ),
            );
            return None;
        }
        let hosts = Hosts {
            names: (0..n).map(|i| format!("kvsync-{id}-{i}")).collect(),
            bridge,
        };
        ip(&["link", "set", &hosts.bridge, "up"]).unwrap();
        for (i, ns) in hosts.names.iter().enumerate() {
            let (host_end, bridge_end) = (format!("kv{id}h{i}"), format!("kv{id}p{i}"));
            let cidr = format!("{}/24", hosts.ip(i));
            let steps: Vec<Vec<&str>> = vec![
                vec!["netns", "add", ns],
                vec![
                    "link",
                    "add",
                    &host_end,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &bridge_end,
                ],
                vec!["link", "set", &host_end, "netns", ns],
                vec!["-n", ns, "link", "set", &host_end, "name", "eth0"],
                vec!["-n", ns, "addr", "add", &cidr, "dev", "eth0"],
                vec!["-n", ns, "link", "set", "eth0", "up"],
                vec!["-n", ns, "link", "set", "lo", "up"],
                vec!["link", "set", &bridge_end, "master", &hosts.bridge],
                vec!["link", "set", &bridge_end, "up"],
            ];
            for step in steps {
                ip(&step).unwrap_or_else(|e| panic!("{e}"));
            }
        }
        Some(hosts)
    }

    /// Host `i`'s address on its `eth0`.
    pub fn ip(&self, i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    /// Runs `f` on a thread inside host `host`'s network namespace; sockets
    /// it opens and processes it starts live there.
    pub fn run_in<T: Send>(&self, host: usize, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/run/netns/{}", self.names[host]);
        std::thread::scope(|s| {
            let t = s.spawn(move || {
                enter(&path);
                f()
            });
            t.join().unwrap_or_else(|e| std::panic::resume_unwind(e))
        })
    }

    /// Starts `f` on a thread of its own inside host `host`'s network
    /// namespace, for as long as it runs.
    pub fn spawn_in<T: Send + 'static>(
        &self,
        host: usize,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let path = format!("/run/netns/{}", self.names[host]);
        std::thread::spawn(move || {
            enter(&path);
            f()
        })
    }

    /// Takes host `host`'s link down or up (a cable cut: no FIN, no RST).
    /// Back up, both hosts forget the neighbours they failed to reach
    /// meanwhile, as they would after their entries time out, so the
    /// first connection does not meet a stale "host unreachable".
    pub fn set_link(&self, host: usize, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.names[host], "link", "set", "eth0", state]).unwrap();
        if up {
            for ns in &self.names {
                ip(&["-n", ns, "neigh", "flush", "dev", "eth0"]).unwrap();
            }
        }
    }
}

/// Moves this thread into the network namespace at `path`.
fn enter(path: &str) {
    let ns = std::fs::File::open(path).unwrap();
    // SAFETY: setns on this thread only, with an open netns fd.
    let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in &self.names {
            let _ = ip(&["netns", "del", ns]);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

/// A runtime for async helpers on a namespace thread.
pub fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}
