//! The CLI's gRPC client commands (`sync`, `fanout`, also over a cluster's
//! shards, `status`, `snapshots`, `cancel`)
//! and `demo`, which runs two agents in this process and syncs between them.
//!
//! Owns how progress and results are shown: a progress bar with bytes, rate
//! and ETA on a terminal, plain lines otherwise, and the JSON summaries.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use super::{DemoArgs, FanoutArgs, StatusArgs, SyncArgs, TransportArg};
use crate::agent::RunningAgent;
use crate::config::{Config, TransportMode};
use crate::rpc::dial::CONNECT_TIMEOUT;
use crate::rpc::{self, is_terminal, pb, phase_name, transport_name};
use crate::snapshot::kvr1::GenSpec;

type Client = pb::orchestrator_client::OrchestratorClient<rpc::AgentChannel>;

/// How client commands reach agents (from the global options), and whether
/// a client certificate was given (for the advice on a broken connection).
static DIALER: std::sync::OnceLock<(rpc::Dialer, bool)> = std::sync::OnceLock::new();

/// Sets how client commands reach agents.
pub fn set_dialer(dialer: rpc::Dialer, client_cert: bool) {
    let _ = DIALER.set((dialer, client_cert));
}

async fn client(agent: &str) -> anyhow::Result<Client> {
    let (dialer, _) = DIALER.get().context("client options not set")?;
    if dialer.token_in_clear_to(agent) {
        eprintln!("warning: sending the bearer token to {agent} in clear text, readable on the path; give --tls-ca (the agent needs [tls]) or run the command on the agent's host");
    }
    let channel = dialer
        .connect(agent, CONNECT_TIMEOUT)
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach agent {agent}: {e}"))?;
    Ok(pb::orchestrator_client::OrchestratorClient::new(channel))
}

fn status_err(what: &str, s: tonic::Status) -> anyhow::Error {
    // Agents answer with deliberate codes; these mean the connection broke,
    // which is how a TLS mismatch shows.
    use tonic::Code;
    let broken = matches!(s.code(), Code::Unknown | Code::Internal | Code::Cancelled);
    let hint = match DIALER.get().map(|(d, cert)| (d.tls.is_some(), *cert)) {
        Some((false, _)) if broken => {
            "; if the agent serves TLS ([tls] in its config), pass --tls-ca"
        }
        Some((true, false)) if broken => {
            "; if the agent requires client certificates ([tls] client_auth), pass --tls-cert and --tls-key signed by its CA"
        }
        Some((true, true)) if broken => {
            "; the agent may have refused this client certificate: it must be signed by the CA in the agent's [tls] ca_file"
        }
        _ => "",
    };
    anyhow::anyhow!("{what}: {} ({:?}){hint}", s.message(), s.code())
}

fn preference(t: TransportArg) -> pb::TransportPreference {
    match t {
        TransportArg::Auto => pb::TransportPreference::Auto,
        TransportArg::Tcp => pb::TransportPreference::Tcp,
        TransportArg::Rdma => pb::TransportPreference::Rdma,
    }
}

/// `kvsync sync`.
pub async fn sync(args: SyncArgs) -> anyhow::Result<ExitCode> {
    let mut c = client(&args.agent).await?;
    let transport = preference(args.run.transport);
    let started = c
        .start_full_sync(pb::StartFullSyncRequest {
            source: args.source.clone(),
            transport: transport as i32,
            snapshot: args.snapshot.map(|d| pb::SnapshotId {
                manifest_digest: d.as_bytes().to_vec(),
                ..Default::default()
            }),
            instance: args.instance.wire(),
            source_instance: args.source_instance.clone().unwrap_or_default(),
            ..Default::default()
        })
        .await
        .map_err(|s| status_err("sync refused", s))?
        .into_inner();
    if !args.run.wait {
        if args.run.json {
            println!(
                "{}",
                json!({ "sync_id": started.sync_id, "created": started.created })
            );
        } else {
            let note = if started.created {
                "started"
            } else {
                "already running"
            };
            println!(
                "sync {} {note}; follow it with `kvsync status --agent {}`",
                started.sync_id, args.agent
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    let last = follow(&mut c, &started.sync_id, !args.run.json).await?;
    print_summary(&last, args.run.json);
    Ok(exit_code(&last))
}

/// Follows a sync to its end, showing progress on stderr.
async fn follow(c: &mut Client, id: &str, show: bool) -> anyhow::Result<pb::SyncProgress> {
    let mut stream = c
        .watch_sync(pb::WatchSyncRequest {
            sync_id: id.to_string(),
        })
        .await
        .map_err(|s| status_err("cannot watch sync", s))?
        .into_inner();
    let tty = show && std::io::stderr().is_terminal();
    let bar = tty.then(|| {
        let b = ProgressBar::new(0);
        b.set_style(
            ProgressStyle::with_template(
                "{msg:>12} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        b
    });
    let mut last_phase = -1;
    let mut last = None;
    while let Some(item) = stream.next().await {
        let p = item.map_err(|s| status_err("lost the sync's progress stream", s))?;
        if let Some(b) = &bar {
            b.set_length(p.bytes_total);
            b.set_position(p.bytes_done);
            b.set_message(phase_name(p.phase));
        } else if show && p.phase != last_phase {
            eprintln!(
                "{}: {} ({} of {} bytes)",
                p.sync_id,
                phase_name(p.phase),
                p.bytes_done,
                p.bytes_total
            );
        }
        last_phase = p.phase;
        let end = is_terminal(p.phase);
        last = Some(p);
        if end {
            break;
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    last.context("the agent ended the progress stream before the sync finished")
}

fn exit_code(p: &pb::SyncProgress) -> ExitCode {
    if p.phase == pb::Phase::Succeeded as i32 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// A sync's progress as JSON.
pub fn progress_json(p: &pb::SyncProgress) -> serde_json::Value {
    json!({
        "sync_id": p.sync_id,
        "instance": p.instance,
        "source": p.source,
        "status": phase_name(p.phase),
        "result": p.result,
        "bytes": p.bytes_done,
        "bytes_total": p.bytes_total,
        "seq": p.seq,
        "format": p.format,
        "transport": transport_name(p.transport),
        "duration_ms": p.duration_ms,
        "throughput_bps": p.throughput_bps,
        "installed_path": p.installed_path,
        "handoff": p.handoff,
        "detail": p.detail,
        "fallback_reason": p.fallback_reason,
        "resumed_bytes": p.resumed_bytes,
        "pieces_refetched": p.pieces_refetched,
        "check": p.check,
        "attempts": p.attempts,
        "abandoned_sources": p.abandoned_sources,
        "error": p.error,
    })
}

fn print_summary(p: &pb::SyncProgress, as_json: bool) {
    if as_json {
        println!("{}", progress_json(p));
        return;
    }
    let secs = p.duration_ms as f64 / 1000.0;
    let mb_s = p.throughput_bps / 1e6;
    if p.phase == pb::Phase::Succeeded as i32 {
        println!(
            "sync {} succeeded: {} bytes in {secs:.2} s ({mb_s:.0} MB/s bulk) over {}, seq {}",
            p.sync_id,
            p.bytes_done,
            transport_name(p.transport),
            p.seq
        );
        if p.resumed_bytes > 0 || p.pieces_refetched > 0 {
            println!(
                "resumed:   {} bytes already verified in place; {} piece(s) fetched again",
                p.resumed_bytes, p.pieces_refetched
            );
        }
        println!("verified:  {}", p.check);
        println!("installed: {}", p.installed_path);
        println!("handoff:   {}", p.handoff);
    } else {
        eprintln!("sync {} {}: {}", p.sync_id, phase_name(p.phase), p.error);
    }
}

/// `kvsync fanout`.
pub async fn fanout(args: FanoutArgs) -> anyhow::Result<ExitCode> {
    let shards = match (args.cluster, args.sources.as_slice()) {
        (true, _) => cluster_shards(&args).await?,
        (false, [source]) => vec![(source.clone(), args.replicas.clone())],
        (false, _) => bail!("give one --source (several only with --cluster, one per shard)"),
    };
    // Every fan-out is started before any is followed.
    let mut started = Vec::new();
    for (source, replicas) in &shards {
        let mut c = client(source).await?;
        let request = pb::StartFanoutRequest {
            origin: source.clone(),
            replicas: replicas.clone(),
            degree: args.degree,
            transport: preference(args.run.transport) as i32,
            instance: args.instance.wire(),
            stream: args.stream,
        };
        let id = match c.start_fanout(request).await {
            Ok(r) => r.into_inner().fanout_id,
            Err(s) if started.is_empty() => return Err(status_err("fan-out refused", s)),
            Err(s) => {
                let running: Vec<String> = started
                    .iter()
                    .map(|(source, _, id): &(String, Client, String)| format!("{id} from {source}"))
                    .collect();
                return Err(status_err(
                    &format!(
                        "the fan-out from {source} was refused (those started run on: {})",
                        running.join(", ")
                    ),
                    s,
                ));
            }
        };
        started.push((source.clone(), c, id));
    }
    if !args.run.wait {
        for (source, _, id) in &started {
            match args.run.json {
                true => println!("{}", json!({ "fanout_id": id, "origin": source })),
                false => println!("fan-out {id} started from {source}"),
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    let show = !args.run.json;
    let ended = futures::future::join_all(
        started
            .into_iter()
            .map(|(_, c, id)| follow_fanout(c, id, show)),
    )
    .await;
    let ended = ended.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    match (args.run.json, args.cluster) {
        (true, false) => println!("{}", fanout_json(&ended[0])),
        (true, true) => println!(
            "{}",
            json!({ "shards": ended.iter().map(fanout_json).collect::<Vec<_>>() })
        ),
        (false, _) => ended.iter().for_each(print_fanout),
    }
    let all = ended.iter().all(|s| s.succeeded as usize == s.nodes.len());
    Ok(if all {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Follows fan-out `id` on its origin to its end, saying each replica's
/// new phase on stderr (`show`).
async fn follow_fanout(mut c: Client, id: String, show: bool) -> anyhow::Result<pb::FanoutStatus> {
    let mut stream = c
        .watch_fanout(pb::WatchFanoutRequest {
            fanout_id: id.clone(),
        })
        .await
        .map_err(|s| status_err("cannot watch the fan-out", s))?
        .into_inner();
    let mut last: Option<pb::FanoutStatus> = None;
    let mut shown = std::collections::HashMap::new();
    while let Some(item) = stream.next().await {
        let s = item.map_err(|s| status_err("lost the fan-out's progress stream", s))?;
        if show {
            for n in &s.nodes {
                let phase = n.progress.as_ref().map_or(0, |p| p.phase);
                if shown.insert(n.replica.clone(), phase) != Some(phase) && phase != 0 {
                    eprintln!("{}: {} (from {})", n.replica, phase_name(phase), n.parent);
                }
            }
        }
        let done = s.done;
        last = Some(s);
        if done {
            break;
        }
    }
    last.with_context(|| format!("the agent ended fan-out {id}'s stream before it finished"))
}

/// `fanout --cluster`: each source with the replicas of its shard, from
/// what every agent's instance names ([`super::shards::pair`]).
async fn cluster_shards(args: &FanoutArgs) -> anyhow::Result<Vec<(String, Vec<String>)>> {
    use super::shards::{pair, resolve};
    let wanted = args.instance.wire();
    let sources = named_by(
        &args.sources,
        &wanted,
        |i| i.primary_addr,
        "has no [redis] primary_addr: it sits beside no shard primary",
    )
    .await?;
    let replicas = named_by(
        &args.replicas,
        &wanted,
        |i| i.primary,
        "has no [redis] primary: it names no shard to replicate",
    )
    .await?;
    let all = sources.iter().chain(&replicas).map(|n| n.primary.as_str());
    let resolved = resolve(all).await;
    Ok(pair(&sources, &replicas, &resolved)?)
}

/// Each of `agents` with the primary `primary_of` reads from its instance
/// `instance`; one without says that it `lacks` it.
async fn named_by(
    agents: &[String],
    instance: &str,
    primary_of: fn(pb::InstanceStatus) -> String,
    lacks: &str,
) -> anyhow::Result<Vec<super::shards::Named>> {
    let mut named = Vec::new();
    for agent in agents {
        let i = instance_of(agent, instance).await?;
        let name = i.name.clone();
        let primary = primary_of(i);
        if primary.is_empty() {
            bail!("the agent {agent}'s instance {name} {lacks}");
        }
        named.push(super::shards::Named {
            agent: agent.clone(),
            primary,
        });
    }
    Ok(named)
}

/// The instance `name` of the agent at `agent` (empty: its only one).
async fn instance_of(agent: &str, name: &str) -> anyhow::Result<pb::InstanceStatus> {
    let mut c = client(agent).await?;
    let s = c
        .get_status(pb::GetStatusRequest::default())
        .await
        .map_err(|s| status_err(&format!("cannot ask {agent} its status"), s))?
        .into_inner();
    let mut found = s
        .instances
        .into_iter()
        .filter(|i| name.is_empty() || i.name == name);
    match (found.next(), found.next()) {
        (Some(i), None) => Ok(i),
        (None, _) => bail!("{agent} has no instance {name:?}"),
        (Some(_), Some(_)) => bail!("{agent} serves several instances: give --instance"),
    }
}

/// A fan-out's status as JSON: its tree, each replica's sync and the sums.
pub fn fanout_json(s: &pb::FanoutStatus) -> serde_json::Value {
    let snapshot = s.snapshot.clone().unwrap_or_default();
    json!({
        "fanout_id": s.fanout_id,
        "origin": s.origin,
        "instance": s.instance,
        "snapshot": { "size": snapshot.size, "seq": snapshot.seq, "checksum": snapshot.checksum },
        "degree": s.degree,
        "done": s.done,
        "succeeded": s.succeeded,
        "failed": s.failed,
        "origin_bytes_sent": s.origin_bytes_sent,
        "duration_ms": s.duration_ms,
        "nodes": s.nodes.iter().map(|n| json!({
            "replica": n.replica,
            "parent": n.parent,
            "depth": n.depth,
            "role": n.role,
            "sync_id": n.sync_id,
            "relay_bytes": n.relay_bytes,
            "error": n.error,
            "sync": n.progress.as_ref().map(progress_json),
        })).collect::<Vec<_>>(),
    })
}

fn print_fanout(s: &pb::FanoutStatus) {
    let seq = s.snapshot.as_ref().map_or(0, |i| i.seq);
    println!(
        "fan-out {} of seq {seq} from {} (degree {}): {} of {} replicas succeeded in {:.2} s; the origin sent {} bytes",
        s.fanout_id,
        s.origin,
        s.degree,
        s.succeeded,
        s.nodes.len(),
        s.duration_ms as f64 / 1000.0,
        s.origin_bytes_sent
    );
    for n in &s.nodes {
        let (phase, error) = match &n.progress {
            Some(p) => (phase_name(p.phase), p.error.as_str()),
            None => ("not started", n.error.as_str()),
        };
        let error = if n.error.is_empty() { error } else { &n.error };
        println!(
            "  {:indent$}{:<22} {:<5} {:<10} from {:<22} relayed {:>12} bytes  {error}",
            "",
            n.replica,
            n.role,
            phase,
            n.parent,
            n.relay_bytes,
            indent = 2 * (n.depth.saturating_sub(1) as usize)
        );
    }
}

/// `kvsync status`.
pub async fn status(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let mut c = client(&args.agent).await?;
    let s = c
        .get_status(pb::GetStatusRequest {
            instance: args.instance.wire(),
        })
        .await
        .map_err(|s| status_err("status", s))?
        .into_inner();
    if args.json {
        let v = json!({
            "node_id": s.node_id,
            "version": s.version,
            "latest_snapshots": s.latest_snapshots.iter().map(snapshot_json).collect::<Vec<_>>(),
            "running": s.running.iter().map(progress_json).collect::<Vec<_>>(),
            "recent": s.recent.iter().map(progress_json).collect::<Vec<_>>(),
            "serving_sessions": s.serving_sessions,
            "admitted_sessions": s.admitted_sessions,
            "transports": s.transports,
            "rdma_available": s.rdma_available,
            "rdma_detail": s.rdma_detail,
            "data_tcp_endpoint": s.data_tcp_endpoint,
            "data_tls": s.data_tls,
            "relay_bytes": s.relay_bytes,
            "relaying": s.relaying.iter().map(relay_json).collect::<Vec<_>>(),
            "warnings": s.warnings,
            "instances": s.instances.iter().map(|i| json!({
                "name": i.name,
                "snapshot_dir": i.snapshot_dir,
                "format": i.format,
                "handoff": i.handoff,
                "latest_snapshots": i.latest_snapshots.iter().map(snapshot_json).collect::<Vec<_>>(),
                "running": i.running.iter().map(progress_json).collect::<Vec<_>>(),
                "recent": i.recent.iter().map(progress_json).collect::<Vec<_>>(),
                "relay_bytes": i.relay_bytes,
                "relaying": i.relaying.iter().map(relay_json).collect::<Vec<_>>(),
                "warnings": i.warnings,
                "health": i.health,
                "health_reason": i.health_reason,
                "stream": i.stream.as_ref().map(stream_json),
            })).collect::<Vec<_>>(),
        });
        println!("{v}");
        return Ok(ExitCode::SUCCESS);
    }
    println!("agent {} (kvsync {})", s.node_id, s.version);
    println!(
        "transports: {}  (rdma: {})",
        s.transports.join(", "),
        s.rdma_detail
    );
    println!(
        "serving {} session(s) as a source ({} admitted); data endpoint {} (TLS: {})",
        s.serving_sessions, s.admitted_sessions, s.data_tcp_endpoint, s.data_tls
    );
    for i in &s.instances {
        print_instance(i);
    }
    Ok(ExitCode::SUCCESS)
}

/// One instance of `kvsync status`.
fn print_instance(i: &pb::InstanceStatus) {
    println!(
        "\ninstance {}: {} snapshots in {}, handoff {}",
        i.name, i.format, i.snapshot_dir, i.handoff
    );
    println!("  health: {} ({})", i.health, i.health_reason);
    for r in &i.relaying {
        let id = r.snapshot.clone().unwrap_or_default();
        println!(
            "  relaying seq {} ({} bytes) of {} ({}); {} bytes relayed so far",
            id.seq, id.size, r.origin_node_id, r.state, i.relay_bytes
        );
    }
    for w in &i.warnings {
        println!("  WARNING: {w}");
    }
    if let Some(st) = &i.stream {
        println!(
            "  stream log from {}: {}\n    {} offsets {}..{} ({} synced), {} bytes on disk, serving {} replica agent(s)",
            st.source, st.state, st.replid, st.first_offset, st.end_offset, st.synced_offset, st.log_bytes, st.serving
        );
        if st.upstreams.len() > 1 {
            println!("    upstreams, nearest first: {}", st.upstreams.join(", "));
        }
        if st.reconnects > 0 {
            println!("    reconnected {} time(s)", st.reconnects);
        }
        if !st.write_safety.is_empty() {
            println!("    the primary's write safety: {}", st.write_safety);
        }
        if !st.diverged.is_empty() {
            println!("    WARNING: diverged at a failover: {}", st.diverged);
        }
        if !st.sentinels.is_empty() {
            println!("    Sentinels: {}", st.sentinels);
        }
        if !st.cluster.is_empty() {
            println!("    cluster: {}", st.cluster);
        }
        println!("    integrity: {}", st.integrity);
        if !st.ack.is_empty() {
            println!(
                "    acknowledges to the primary: {} (ack = \"{}\")",
                st.acked_offset, st.ack
            );
        } else if st.acked_offset > 0 {
            println!("    reports upstream as applied: {}", st.acked_offset);
        }
        if !st.ack.is_empty() && !st.downstreams.is_empty() {
            println!(
                "    the slowest downstream is {:.3} s behind the primary",
                st.behind_seconds
            );
        }
        for d in &st.downstreams {
            println!(
                "    downstream {}: acknowledges offset {} ({} bytes behind the log)",
                d.name,
                d.offset,
                st.end_offset.saturating_sub(d.offset)
            );
        }
        for name in &st.lagging {
            println!("    lagging: {name} has left its whole credit window unacknowledged past [stream] stall_timeout; the log keeps the stream for it");
        }
        for path in &st.set_aside {
            println!("    WARNING: a damaged file of the log was set aside: {path} (check the disk, then remove it)");
        }
        for range in &st.mending {
            println!("    mending: a damaged record ({range}) is fetched again from upstream; readers wait before it");
        }
        if st.damaged > 0 {
            println!(
                "    {} damaged record(s) found on reading: never served, fetched again",
                st.damaged
            );
        }
    }
    println!("  latest snapshots:");
    if i.latest_snapshots.is_empty() {
        println!("    (none)");
    }
    for e in &i.latest_snapshots {
        println!(
            "    {:<10} seq {:<12} {:>14} bytes  {}",
            e.format, e.seq, e.size, e.path
        );
    }
    for (title, list) in [("running syncs", &i.running), ("recent syncs", &i.recent)] {
        println!("  {title}:");
        if list.is_empty() {
            println!("    (none)");
        }
        for p in list.iter() {
            let mut what = if p.error.is_empty() {
                p.installed_path.clone()
            } else {
                p.error.clone()
            };
            if p.resumed_bytes > 0 || p.pieces_refetched > 0 {
                what = format!(
                    "(resumed {} bytes, {} piece(s) fetched again) {what}",
                    p.resumed_bytes, p.pieces_refetched
                );
            }
            println!(
                "    {}  {:<12} {:>14}/{:<14} {:<4} from {}  {}",
                p.sync_id,
                phase_name(p.phase),
                p.bytes_done,
                p.bytes_total,
                transport_name(p.transport),
                p.source,
                what
            );
        }
    }
}

fn stream_json(st: &pb::StreamStatus) -> serde_json::Value {
    let downstreams: Vec<_> = st
        .downstreams
        .iter()
        .map(|d| json!({ "name": d.name, "offset": d.offset }))
        .collect();
    json!({
        "source": st.source,
        "state": st.state,
        "replid": st.replid,
        "first_offset": st.first_offset,
        "end_offset": st.end_offset,
        "synced_offset": st.synced_offset,
        "log_bytes": st.log_bytes,
        "serving": st.serving,
        "fed_offset": st.fed_offset,
        "downstreams": downstreams,
        "lagging": st.lagging,
        "ack": st.ack,
        "acked_offset": st.acked_offset,
        "damaged": st.damaged,
        "upstreams": st.upstreams,
        "reconnects": st.reconnects,
        "write_safety": st.write_safety,
        "diverged": st.diverged,
        "sentinels": st.sentinels,
        "cluster": st.cluster,
        "integrity": st.integrity,
        "behind_seconds": st.behind_seconds,
        "set_aside": st.set_aside,
        "mending": st.mending,
    })
}

fn relay_json(r: &pb::RelayEntry) -> serde_json::Value {
    let id = r.snapshot.clone().unwrap_or_default();
    json!({ "seq": id.seq, "size": id.size, "checksum": id.checksum, "origin_node_id": r.origin_node_id, "state": r.state, "instance": r.instance })
}

fn snapshot_json(e: &pb::SnapshotEntry) -> serde_json::Value {
    json!({ "path": e.path, "format": e.format, "size": e.size, "seq": e.seq, "mtime_unix_ms": e.mtime_unix_ms, "checksum": e.checksum, "manifest_digest": hex(&e.manifest_digest), "instance": e.instance })
}

/// A digest as `kvsync sync --snapshot` takes it.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `kvsync snapshots`.
pub async fn snapshots(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let mut c = client(&args.agent).await?;
    let listed = c
        .list_snapshots(pb::ListSnapshotsRequest {
            instance: args.instance.wire(),
        })
        .await
        .map_err(|s| status_err("list snapshots", s))?
        .into_inner();
    // Rejected files go to stderr: stdout stays the offered snapshots,
    // which scripts read.
    for r in &listed.rejected {
        eprintln!("rejected  {}: {}", r.path, r.reason);
    }
    let list = listed.snapshots;
    if args.json {
        println!(
            "{}",
            serde_json::Value::from(list.iter().map(snapshot_json).collect::<Vec<_>>())
        );
    } else {
        for e in &list {
            println!(
                "{:<10} seq {:<12} {:>14} bytes  {}  {}",
                e.format,
                e.seq,
                e.size,
                hex(&e.manifest_digest),
                e.path
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `kvsync cancel`.
pub async fn cancel(args: super::CancelArgs) -> anyhow::Result<ExitCode> {
    let mut c = client(&args.agent).await?;
    let r = c
        .cancel_sync(pb::CancelSyncRequest {
            sync_id: args.sync_id.clone(),
        })
        .await
        .map_err(|s| status_err("cancel", s))?
        .into_inner();
    println!(
        "{}",
        if r.cancelled {
            "cancelled"
        } else {
            "already finished"
        }
    );
    Ok(ExitCode::SUCCESS)
}

/// `kvsync stream release|attach|upstream|follow`: prints where the
/// server or the log follows now.
pub async fn stream(command: super::StreamCommand) -> anyhow::Result<ExitCode> {
    use super::StreamCommand::*;
    let (agent, what, req) = match &command {
        Release(a) => (&a.agent, "release", (a.instance.wire(), a.primary.clone())),
        Attach(a) => (&a.agent, "attach", (a.instance.wire(), None)),
        Upstream(a) => {
            let mut c = client(&a.agent).await?;
            c.set_stream_upstream(pb::SetStreamUpstreamRequest {
                instance: a.instance.wire(),
                upstreams: a.upstreams.clone(),
            })
            .await
            .map_err(|s| status_err("upstream", s))?;
            println!("the stream log follows {}", a.upstreams.join(", then "));
            return Ok(ExitCode::SUCCESS);
        }
        Follow(a) => {
            let mut c = client(&a.agent).await?;
            let r = c
                .follow_primary(pb::FollowPrimaryRequest {
                    instance: a.instance.wire(),
                    primary: a.primary.clone(),
                    peers: a.peers.clone(),
                })
                .await
                .map_err(|s| status_err("follow", s))?
                .into_inner();
            println!("the stream log follows {}", r.source);
            if !r.local_server.is_empty() {
                println!("{}", r.local_server);
            }
            return Ok(ExitCode::SUCCESS);
        }
    };
    let req = pb::HandStreamRequest {
        instance: req.0,
        primary: req.1.unwrap_or_default(),
    };
    let mut c = client(agent).await?;
    let r = match command {
        Release(_) => c.release_stream(req).await,
        _ => c.attach_stream(req).await,
    }
    .map_err(|s| status_err(what, s))?
    .into_inner();
    println!("{}", r.message);
    Ok(ExitCode::SUCCESS)
}

/// `kvsync demo`: a source and a replica on loopback, one full sync.
pub async fn demo(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let root = tempfile::Builder::new()
        .prefix("kvsync-demo-")
        .tempdir()
        .context("temp dir")?;
    let agent_config = |name: &str| {
        let mut c = Config {
            node_id: name.to_string(),
            snapshot_dir: root.path().join(name),
            create_dirs: true,
            ..Default::default()
        };
        c.grpc.listen = "127.0.0.1:0".into();
        c.data.tcp_listen = "127.0.0.1:0".into();
        c.metrics.listen = String::new();
        c.transport.mode = TransportMode::Tcp;
        c
    };
    let source = RunningAgent::start(agent_config("source")).await?;
    let replica = RunningAgent::start(agent_config("replica")).await?;
    let show = !args.json;
    if show {
        eprintln!(
            "source agent  grpc {}  data {}",
            source.grpc_addr,
            source.data_addr()
        );
        eprintln!(
            "replica agent grpc {}  data {}",
            replica.grpc_addr,
            replica.data_addr()
        );
    }

    offer_generated(&source, &args, show).await?;
    let mut c = client(&replica.grpc_addr.to_string()).await?;
    let started = c
        .start_full_sync(pb::StartFullSyncRequest {
            source: source.grpc_addr.to_string(),
            transport: pb::TransportPreference::Tcp as i32,
            ..Default::default()
        })
        .await
        .map_err(|s| status_err("sync refused", s))?
        .into_inner();
    let last = follow(&mut c, &started.sync_id, show).await?;
    print_summary(&last, args.json);
    if show && !last.installed_path.is_empty() {
        let record = format!("{}.replmeta", last.installed_path);
        match std::fs::read_to_string(&record) {
            Ok(text) => println!("\nhandoff record {record}:\n{}", text.trim_end()),
            Err(e) => println!("no handoff record at {record}: {e}"),
        }
    }
    replica.stop().await;
    source.stop().await;
    drop(root);
    if last.phase != pb::Phase::Succeeded as i32 {
        bail!("demo sync did not succeed: {}", last.error);
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes the demo snapshot into the source's directory and waits until its
/// watcher offers it.
async fn offer_generated(source: &RunningAgent, args: &DemoArgs, show: bool) -> anyhow::Result<()> {
    let seq = 1_000_042;
    let path = source
        .config()
        .snapshot_dir
        .join(format!("snapshot-{seq}.kvr1"));
    let spec = GenSpec {
        size: args.size.as_u64(),
        seq,
        created_ms: 0,
        seed: seq,
    };
    spec.check()?;
    if show {
        eprintln!(
            "generating a {} snapshot (seq {seq}) at {}",
            args.size,
            path.display()
        );
    }
    let p = path.clone();
    tokio::task::spawn_blocking(move || spec.write_file(&p)).await??;

    // Wait until the source's watcher offers it.
    let catalog = source
        .catalog("")
        .context("the demo source serves one instance")?;
    let mut changes = catalog.subscribe();
    tokio::time::timeout(Duration::from_secs(120), async {
        while catalog.get(&path).is_none() {
            changes.changed().await.expect("catalog lives");
        }
    })
    .await
    .context("the source agent did not pick up the generated snapshot")?;

    Ok(())
}
