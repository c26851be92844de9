//! Whether kvsync's logins hold the rights their roles need on their
//! servers and Sentinels (the `ACL SETUSER` lines of docs/REDIS.md), for
//! `kvsync check-config --live` and the agent's start (a warning). Each
//! right is tried with a probe that the server checks against the user's
//! ACL before it runs it and that changes nothing when it does run: a
//! reply of `NOPERM` names the missing right, any other reply (an error
//! about the probe's arguments included) shows the right is there.

use redis::Value;
use tracing::{debug, warn};

use crate::config::{Config, HandoffMode, ServerAuth};
use crate::kv::redis::{connect, server_err, RedisError};

/// What kvsync does with a server, and so the rights its login needs there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The primary the agent checks before offering its snapshots
    /// (`[redis] primary_addr`); `follows`: it also follows it into the
    /// stream log; `grows`: `[redis] grow_backlog`.
    Primary { follows: bool, grows: bool },
    /// The server a replica's agent seeds, feeds or re-attaches; `logs`:
    /// the agent keeps a stream log (and so watches a cluster node's role).
    Replica { logs: bool },
    /// The primary a seeded server continues from (`[redis] primary`):
    /// its counters confirm the partial resync, and a shard primary's
    /// table makes a cluster node its replica.
    Continued,
    /// A Sentinel the agent asks, for the master it names.
    Sentinel,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Primary { follows: true, .. } => "the primary this agent follows",
            Role::Primary { .. } => "the primary this agent offers snapshots of",
            Role::Replica { .. } => "the server this agent seeds",
            Role::Continued => "the primary the seeded server continues from",
            Role::Sentinel => "a Sentinel this agent asks",
        })
    }
}

/// One server to check: its address, its role, how kvsync logs in there.
#[derive(Clone, Debug)]
pub struct Login {
    pub addr: String,
    pub role: Role,
    pub auth: ServerAuth,
}

/// The logins one instance's configuration makes (its `for_instance`
/// configuration), in the order docs/REDIS.md gives the roles.
pub fn logins(config: &Config) -> Vec<Login> {
    let (r, st) = (&config.redis, &config.stream);
    let mut logins = Vec::new();
    if !r.primary_addr.is_empty() {
        let role = Role::Primary {
            follows: st.enabled(),
            grows: r.grow_backlog,
        };
        logins.push(Login {
            addr: r.primary_addr.clone(),
            role,
            auth: r.auth(),
        });
    }
    let seeds = matches!(
        config.handoff.mode,
        HandoffMode::Redis | HandoffMode::RedisReplicate | HandoffMode::RedisStream
    );
    if seeds && !r.server_addr.is_empty() {
        logins.push(Login {
            addr: r.server_addr.clone(),
            role: Role::Replica { logs: st.enabled() },
            auth: r.auth(),
        });
    }
    if seeds && !r.primary.is_empty() {
        logins.push(Login {
            addr: r.primary.clone(),
            role: Role::Continued,
            auth: r.auth(),
        });
    }
    for sentinel in &st.sentinels {
        logins.push(Login {
            addr: sentinel.clone(),
            role: Role::Sentinel,
            auth: config.sentinel_auth(),
        });
    }
    logins
}

/// The rights `login`'s role needs that its user lacks there (as
/// `ACL SETUSER` writes them: `+psync`, `&+switch-master`); empty when
/// it has them all. `master` is the name the Sentinels know the primary by.
pub async fn missing(login: &Login, master: &str) -> Result<Vec<String>, RedisError> {
    tokio::time::timeout(CHECK_TIMEOUT, probe_all(login, master))
        .await
        .map_err(|_| server_err(&login.addr, format!("no answers within {CHECK_TIMEOUT:?}")))?
}

/// A server's answers to every probe of one login must come by then.
const CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

async fn probe_all(login: &Login, master: &str) -> Result<Vec<String>, RedisError> {
    let addr = login.addr.as_str();
    let mut con = connect(addr, &login.auth).await?;
    let mut missing = Vec::new();
    let mut probe = |right: &str, denied: Option<Denied>| match denied {
        Some(Denied::Acl(why)) if why.contains("channel") => {
            missing.push("&+switch-master".to_string())
        }
        Some(Denied::Acl(_)) => missing.push(right.to_string()),
        Some(Denied::NoCommand) => missing.push(format!(
            "{right} (the command is renamed or disabled there: kvsync needs it under its own name)"
        )),
        None => {}
    };
    let one = |args: &[&str]| {
        let mut cmd = redis::cmd(args[0]);
        cmd.arg(&args[1..]);
        cmd
    };
    let probes: Vec<(&str, Vec<&str>)> = match login.role {
        Role::Primary { follows, grows } => {
            let mut p = vec![
                ("+info", vec!["INFO", "server"]),
                ("+config|get", vec!["CONFIG", "GET", "repl-backlog-size"]),
            ];
            if follows {
                p.push(("+replconf", vec!["REPLCONF", "listening-port", "0"]));
            }
            if grows {
                p.push(("+config|set", vec!["CONFIG", "SET", PROBE_PARAMETER, "0"]));
            }
            p
        }
        Role::Replica { .. } => vec![
            ("+info", vec!["INFO", "server"]),
            ("+config|get", vec!["CONFIG", "GET", "masterauth"]),
            ("+config|set", vec!["CONFIG", "SET", PROBE_PARAMETER, "0"]),
            // Not a port: refused after the ACL check, before it acts.
            (
                "+replicaof",
                vec!["REPLICAOF", "kvsync-probe", "not-a-port"],
            ),
        ],
        Role::Continued => vec![("+info", vec!["INFO", "server"])],
        Role::Sentinel => vec![("+sentinel|master", vec!["SENTINEL", "MASTER", master])],
    };
    for (right, args) in probes {
        let reply = one(&args).query_async::<Value>(&mut con).await;
        probe(right, denied(addr, reply)?);
    }
    if in_cluster_mode(&mut con).await {
        for (right, args) in cluster_probes(login.role) {
            let reply = one(&args).query_async::<Value>(&mut con).await;
            match denied(addr, reply)? {
                // Redis 7.0 has no shard ids: nothing to ask there.
                Some(Denied::NoCommand) if right == "+cluster|myshardid" => {}
                denied => probe(right, denied),
            }
        }
    }
    match login.role {
        Role::Primary { follows: true, .. } => probe("+psync", psync_denied(login).await?),
        Role::Sentinel => probe("+subscribe", subscribe_denied(login).await?),
        _ => {}
    }
    Ok(missing)
}

/// Whether the server answers `INFO cluster` with `cluster_enabled:1`
/// (a login without `+info` is named by its own probe).
async fn in_cluster_mode(con: &mut redis::aio::MultiplexedConnection) -> bool {
    redis::cmd("INFO")
        .arg("cluster")
        .query_async::<String>(con)
        .await
        .is_ok_and(|i| i.lines().any(|l| l.trim() == "cluster_enabled:1"))
}

/// The further probes of a cluster node's login: an agent with a stream
/// log reads its node's role and table to follow the shard's failovers,
/// a seeded node is asked its table and sent `CLUSTER MEET` (to a port
/// that is not one here), and its shard primary is asked its table, its
/// cluster info, its shard id and who the agent's connection is.
fn cluster_probes(role: Role) -> Vec<(&'static str, Vec<&'static str>)> {
    let (role_probe, table, meet) = (
        ("+role", vec!["ROLE"]),
        ("+cluster|nodes", vec!["CLUSTER", "NODES"]),
        (
            "+cluster|meet",
            vec!["CLUSTER", "MEET", "kvsync-probe", "not-a-port"],
        ),
    );
    match role {
        Role::Primary { follows: true, .. } => vec![role_probe, table],
        Role::Replica { logs: true } => vec![role_probe, table, meet],
        Role::Replica { logs: false } => vec![table, meet],
        Role::Continued => vec![
            table,
            ("+cluster|info", vec!["CLUSTER", "INFO"]),
            ("+cluster|myshardid", vec!["CLUSTER", "MYSHARDID"]),
            ("+client|info", vec!["CLIENT", "INFO"]),
        ],
        Role::Primary { follows: false, .. } | Role::Sentinel => Vec::new(),
    }
}

/// Checks every login of an instance's configuration once, as the agent
/// starts, and says in its log which rights a login lacks, before the
/// first action that needs one fails. A server not reachable yet is left
/// to the health poll.
pub async fn warn_missing(instance: String, config: Config) {
    for login in logins(&config) {
        match missing(&login, &config.stream.master_name).await {
            Ok(m) if m.is_empty() => {}
            Ok(m) => warn!(
                instance,
                server = login.addr,
                role = %login.role,
                login = %login.auth,
                missing = m.join(" "),
                "a login lacks rights its role needs (docs/REDIS.md); what needs them will fail"
            ),
            Err(e) => debug!(instance, error = %e, "the rights of a login could not be checked"),
        }
    }
}

/// A `CONFIG SET` parameter no server has: the server checks the right,
/// then refuses the name.
const PROBE_PARAMETER: &str = "kvsync-rights-probe";

/// Why a probe's command cannot be used.
enum Denied {
    /// The server's `NOPERM`, with its text.
    Acl(String),
    /// The server knows no such command (renamed away, or disabled).
    NoCommand,
}

/// Why `reply` shows its command cannot be used, if it does; an error
/// when the connection failed. Any other reply, an error about the
/// probe's arguments included, shows the command ran past the checks.
fn denied(addr: &str, reply: redis::RedisResult<Value>) -> Result<Option<Denied>, RedisError> {
    let (code, detail) = match &reply {
        Ok(Value::ServerError(e)) => (e.code(), e.details().unwrap_or_default()),
        Ok(_) => return Ok(None),
        Err(e) if e.is_io_error() || e.is_unrecoverable_error() => return Err(server_err(addr, e)),
        Err(e) => (e.code().unwrap_or_default(), e.detail().unwrap_or_default()),
    };
    let detail = detail.to_ascii_lowercase();
    Ok(match code {
        "NOPERM" => Some(Denied::Acl(detail)),
        "ERR"
            if detail.starts_with("unknown command")
                || detail.starts_with("unknown subcommand") =>
        {
            Some(Denied::NoCommand)
        }
        _ => None,
    })
}

/// `PSYNC` cannot be tried alone: it would start a full resync. It goes
/// in one write right behind an `INFO`, so the server holds the `INFO`'s
/// reply when it reaches the `PSYNC`: past the ACL check, a server
/// refuses a sync with replies pending, and nothing starts. Any reply but
/// that refusal or `NOPERM` ends the connection at once.
async fn psync_denied(login: &Login) -> Result<Option<Denied>, RedisError> {
    let addr = login.addr.as_str();
    let mut con = connect(addr, &login.auth).await?;
    let mut pipe = redis::pipe();
    pipe.cmd("INFO").arg("server");
    pipe.cmd("PSYNC").arg("?").arg("-1");
    let replies: Vec<redis::RedisResult<Value>> = pipe
        .ignore_errors()
        .query_async(&mut con)
        .await
        .map_err(|e| server_err(addr, e))?;
    match replies.into_iter().nth(1) {
        Some(reply) => denied(addr, reply),
        None => Err(server_err(addr, "no reply to the PSYNC probe")),
    }
}

/// `SUBSCRIBE +switch-master` on a connection of its own, dropped after
/// the answer: the Sentinel checks the command, then the channel.
async fn subscribe_denied(login: &Login) -> Result<Option<Denied>, RedisError> {
    let addr = login.addr.as_str();
    let mut con = connect(addr, &login.auth).await?;
    let reply = redis::cmd("SUBSCRIBE")
        .arg("+switch-master")
        .query_async::<Value>(&mut con)
        .await;
    denied(addr, reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_role_of_a_configuration_is_checked_where_it_acts() {
        let mut config = Config::default();
        config.redis.primary_addr = "127.0.0.1:6379".into();
        config.redis.server_addr = "127.0.0.1:6380".into();
        config.handoff.mode = HandoffMode::RedisReplicate;
        config.stream.sentinels = vec!["127.0.0.1:26379".into()];
        let roles: Vec<_> = logins(&config)
            .into_iter()
            .map(|l| (l.addr, l.role))
            .collect();
        let follows = config.stream.enabled();
        assert_eq!(
            roles,
            [
                (
                    "127.0.0.1:6379".to_string(),
                    Role::Primary {
                        follows,
                        grows: false
                    }
                ),
                (
                    "127.0.0.1:6380".to_string(),
                    Role::Replica { logs: follows }
                ),
                ("127.0.0.1:26379".to_string(), Role::Sentinel),
            ]
        );
        config.handoff.mode = HandoffMode::File;
        assert_eq!(logins(&config).len(), 2, "a file handoff seeds no server");
    }
}
