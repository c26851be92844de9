//! A minimal orchestrator: the gRPC calls an orchestrator makes against
//! kvsync agents, in order.
//!
//! ```text
//! orchestrator sync   REPLICA SOURCE          # StartFullSync → WatchSync → GetStatus
//! orchestrator fanout ORIGIN REPLICA…         # StartFanout → WatchFanout
//! orchestrator cancel REPLICA SOURCE          # StartFullSync → CancelSync → WatchSync
//! ```
//!
//! Addresses are agents' gRPC `host:port`. A token is read from
//! `KVSYNC_TOKEN` when the agents require one (plaintext gRPC here; use
//! TLS off a trusted network). Prints one line per step and exits 0 when
//! the sync or fan-out succeeded (for `cancel`: when it was cancelled).

use futures::StreamExt;
use kvsync::rpc::auth::ClientAuth;
use kvsync::rpc::pb;
use kvsync::rpc::pb::orchestrator_client::OrchestratorClient;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

type Client = OrchestratorClient<InterceptedService<Channel, ClientAuth>>;

async fn connect(addr: &str) -> Result<Client, Box<dyn std::error::Error>> {
    let channel = Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let token = std::env::var("KVSYNC_TOKEN").ok();
    Ok(OrchestratorClient::new(InterceptedService::new(
        channel,
        ClientAuth::new(token),
    )))
}

/// StartFullSync on `replica`, pulling from `source`.
async fn start(c: &mut Client, source: &str) -> Result<String, tonic::Status> {
    let started = c
        .start_full_sync(pb::StartFullSyncRequest {
            source: source.to_string(),
            transport: pb::TransportPreference::Auto as i32,
            ..Default::default()
        })
        .await?
        .into_inner();
    println!(
        "StartFullSync: sync {} (created {})",
        started.sync_id, started.created
    );
    Ok(started.sync_id)
}

/// WatchSync to the end; returns the final state.
async fn watch(c: &mut Client, sync_id: &str) -> Result<pb::SyncProgress, tonic::Status> {
    let mut stream = c
        .watch_sync(pb::WatchSyncRequest {
            sync_id: sync_id.to_string(),
        })
        .await?
        .into_inner();
    let mut last = pb::SyncProgress::default();
    while let Some(p) = stream.next().await {
        last = p?;
        println!(
            "WatchSync: {} {}/{} bytes",
            kvsync::rpc::phase_name(last.phase),
            last.bytes_done,
            last.bytes_total
        );
    }
    Ok(last)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<std::process::ExitCode, Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let ok = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["sync", replica, source] => {
            let mut c = connect(replica).await?;
            let id = start(&mut c, source).await?;
            let last = watch(&mut c, &id).await?;
            let status = c
                .get_status(pb::GetStatusRequest::default())
                .await?
                .into_inner();
            println!(
                "GetStatus: node {} has {} recent sync(s); installed {}",
                status.node_id,
                status.recent.len(),
                last.installed_path
            );
            last.phase == pb::Phase::Succeeded as i32
        }
        ["fanout", origin, ref replicas @ ..] if !replicas.is_empty() => {
            let mut c = connect(origin).await?;
            let started = c
                .start_fanout(pb::StartFanoutRequest {
                    origin: origin.to_string(),
                    replicas: replicas.iter().map(|r| r.to_string()).collect(),
                    degree: 2,
                    transport: pb::TransportPreference::Auto as i32,
                    ..Default::default()
                })
                .await?
                .into_inner();
            println!("StartFanout: fan-out {}", started.fanout_id);
            let mut stream = c
                .watch_fanout(pb::WatchFanoutRequest {
                    fanout_id: started.fanout_id,
                })
                .await?
                .into_inner();
            let mut last = pb::FanoutStatus::default();
            while let Some(s) = stream.next().await {
                last = s?;
            }
            println!(
                "WatchFanout: {} succeeded, {} failed; the origin sent {} bytes",
                last.succeeded, last.failed, last.origin_bytes_sent
            );
            last.done && last.failed == 0
        }
        ["cancel", replica, source] => {
            let mut c = connect(replica).await?;
            let id = start(&mut c, source).await?;
            let cancelled = c
                .cancel_sync(pb::CancelSyncRequest {
                    sync_id: id.clone(),
                })
                .await?
                .into_inner()
                .cancelled;
            println!("CancelSync: cancelled {cancelled}");
            let last = watch(&mut c, &id).await?;
            last.phase == pb::Phase::Cancelled as i32
        }
        _ => {
            eprintln!("usage: orchestrator sync REPLICA SOURCE | fanout ORIGIN REPLICA… | cancel REPLICA SOURCE");
            return Ok(std::process::ExitCode::from(2));
        }
    };
    Ok(if ok {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    })
}
