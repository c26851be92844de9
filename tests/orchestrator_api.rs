//! The API as orchestrator authors meet it: reflection in both versions
//! clients speak (v1 and v1alpha) lists the services; every `grpcurl` line
//! of the orchestrator guide (docs/SYNC.md) names a method reflection knows, with fields of its
//! request; and the example client (`examples/orchestrator.rs`) runs its
//! sequences against real agents.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::node::*;
use common::*;
use prost::Message;
use tonic::transport::Channel;
use tonic_reflection::pb::{v1, v1alpha};

async fn channel(node: &Node) -> Channel {
    Channel::from_shared(format!("http://{}", node.grpc()))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// The services reflection v1 lists, and the file descriptors of the
/// `kvsync.v1` package it returns.
async fn reflect_v1(node: &Node) -> (Vec<String>, Vec<prost_types::FileDescriptorProto>) {
    use v1::server_reflection_request::MessageRequest;
    use v1::server_reflection_response::MessageResponse;
    let mut client = v1::server_reflection_client::ServerReflectionClient::new(channel(node).await);
    let ask = |m: MessageRequest| v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(m),
    };
    let requests = vec![
        ask(MessageRequest::ListServices(String::new())),
        ask(MessageRequest::FileContainingSymbol(
            "kvsync.v1.Orchestrator".into(),
        )),
    ];
    let mut answers = client
        .server_reflection_info(futures::stream::iter(requests))
        .await
        .unwrap()
        .into_inner();
    let (mut services, mut files) = (Vec::new(), Vec::new());
    while let Some(answer) = answers.message().await.unwrap() {
        match answer.message_response.unwrap() {
            MessageResponse::ListServicesResponse(l) => {
                services.extend(l.service.into_iter().map(|s| s.name))
            }
            MessageResponse::FileDescriptorResponse(f) => files.extend(
                f.file_descriptor_proto
                    .iter()
                    .map(|b| prost_types::FileDescriptorProto::decode(b.as_slice()).unwrap()),
            ),
            other => panic!("unexpected reflection answer {other:?}"),
        }
    }
    (services, files)
}

/// The services reflection v1alpha lists (what grpcio-reflection asks).
async fn reflect_v1alpha(node: &Node) -> Vec<String> {
    use v1alpha::server_reflection_request::MessageRequest;
    use v1alpha::server_reflection_response::MessageResponse;
    let mut client =
        v1alpha::server_reflection_client::ServerReflectionClient::new(channel(node).await);
    let request = v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = client
        .server_reflection_info(futures::stream::iter(vec![request]))
        .await
        .unwrap()
        .into_inner();
    match answers.message().await.unwrap().unwrap().message_response {
        Some(MessageResponse::ListServicesResponse(l)) => {
            l.service.into_iter().map(|s| s.name).collect()
        }
        other => panic!("unexpected reflection answer {other:?}"),
    }
}

/// The `grpcurl` lines of the guide for orchestrator authors
/// (docs/SYNC.md): (method path, JSON body).
fn readme_grpcurl() -> Vec<(String, serde_json::Value)> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/SYNC.md")).unwrap();
    readme
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("grpcurl "))
        .map(|l| {
            let body = l.split('\'').nth(1).expect("a -d '{…}' body");
            let method = l.rsplit(' ').next().unwrap().to_string();
            (
                method,
                serde_json::from_str(body).expect("the body is JSON"),
            )
        })
        .collect()
}

#[tokio::test]
async fn reflection_speaks_v1_and_v1alpha_and_the_readme_calls_exist() {
    let root = tempfile::tempdir().unwrap();
    let agent = Node::start(root.path(), "agent", "", &[]);
    let (services, files) = reflect_v1(&agent).await;
    let alpha = reflect_v1alpha(&agent).await;
    for s in ["kvsync.v1.Orchestrator", "kvsync.v1.Peer"] {
        assert!(
            services.iter().any(|x| x == s),
            "v1 lists {s}: {services:?}"
        );
        assert!(alpha.iter().any(|x| x == s), "v1alpha lists {s}: {alpha:?}");
    }
    let file = files
        .iter()
        .find(|f| f.package() == "kvsync.v1")
        .expect("the kvsync.v1 file");
    let calls = readme_grpcurl();
    assert!(calls.len() >= 6, "{calls:?}");
    for (path, body) in calls {
        let (service, method) = path.split_once('/').unwrap();
        let service = file
            .service
            .iter()
            .find(|s| format!("kvsync.v1.{}", s.name()) == service)
            .unwrap_or_else(|| panic!("{service} is not served"));
        let method = service
            .method
            .iter()
            .find(|m| m.name() == method)
            .unwrap_or_else(|| panic!("{path} is not a method"));
        let input = method.input_type().trim_start_matches(".kvsync.v1.");
        let message = file
            .message_type
            .iter()
            .find(|m| m.name() == input)
            .unwrap();
        for key in body.as_object().unwrap().keys() {
            assert!(
                message
                    .field
                    .iter()
                    .any(|f| f.name() == key || f.json_name() == key),
                "{path}: {input} has no field {key}"
            );
        }
    }
}

/// The example client, built with the examples (`cargo build --examples`,
/// as scripts/test.sh does before the tests).
fn example() -> Command {
    let bin: PathBuf = PathBuf::from(kvsync_bin())
        .parent()
        .unwrap()
        .join("examples/orchestrator");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build --examples` first",
        bin.display()
    );
    Command::new(bin)
}

/// Runs the example with `args`; its stdout, after checking it succeeded.
fn run_example(args: &[&str]) -> String {
    let out = example().args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "orchestrator {args:?}: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_orchestrator_syncs_fans_out_and_cancels() {
    let root = tempfile::tempdir().unwrap();
    let (source, bytes) = offering_source(root.path(), 4 << 20, 6, &[]).await;
    let replicas: Vec<Node> = (0..3)
        .map(|i| Node::start(root.path(), &format!("r{i}"), "", &[]))
        .collect();

    let out = run_example(&["sync", &replicas[0].grpc(), &source.grpc()]);
    let steps: Vec<&str> = out.lines().map(|l| l.split(':').next().unwrap()).collect();
    assert_eq!(steps.first(), Some(&"StartFullSync"), "{out}");
    assert_eq!(steps.last(), Some(&"GetStatus"), "{out}");
    assert!(out.contains("WatchSync: succeeded"), "{out}");
    assert!(std::fs::read(replicas[0].dir.join("s.kvr1")).unwrap() == bytes);

    let (r1, r2) = (replicas[1].grpc(), replicas[2].grpc());
    let out = run_example(&["fanout", &source.grpc(), &r1, &r2]);
    assert!(out.contains("WatchFanout: 2 succeeded, 0 failed"), "{out}");
    for r in &replicas[1..] {
        assert!(std::fs::read(r.dir.join("s.kvr1")).unwrap() == bytes);
    }

    // A sync held in flight by a stalling source, cancelled.
    let stalling = stalling_source(&root.path().join("stall"), 7).await;
    let out = run_example(&["cancel", &replicas[0].grpc(), &stalling.grpc()]);
    assert!(out.contains("CancelSync: cancelled true"), "{out}");
    assert!(out.contains("WatchSync: cancelled"), "{out}");
}
