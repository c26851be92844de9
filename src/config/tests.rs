use super::*;

#[test]
fn addresses_are_host_and_port_and_print_back() {
    for (text, host, port) in [
        ("localhost:6379", "localhost", 6379),
        ("10.0.0.1:7000", "10.0.0.1", 7000),
        ("[fd00::1]:7000", "fd00::1", 7000),
    ] {
        let a: HostPort = text.parse().unwrap();
        assert_eq!((a.host.as_str(), a.port), (host, port));
        assert_eq!(a.to_string(), text);
    }
    for bad in [
        "",
        "host",
        ":7000",
        "host:",
        "host:x",
        "fd00::1:7000",
        "[fd00::1:7000",
    ] {
        assert!(bad.parse::<HostPort>().is_err(), "{bad:?}");
    }
}

#[test]
fn defaults_are_valid() {
    let c = Config {
        node_id: "n".into(),
        ..Default::default()
    };
    c.validate().unwrap();
}

#[test]
fn reference_config_parses_and_validates() {
    let text = include_str!("../../deploy/kvsync.toml");
    let c = Config::parse(text).unwrap();
    c.validate().unwrap();
    assert_eq!(c.node_id, "primary-1");
    assert_eq!(c.cache.memory_budget, ByteSize::gib(8));
    assert_eq!(c.transport.mode, TransportMode::Auto);
}

#[test]
fn a_file_without_instance_tables_is_one_instance_named_default() {
    let c = Config::parse("snapshot_dir = \"/srv/kv\"\n[handoff]\nmode = \"file\"\n").unwrap();
    let all = c.instances();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].name, DEFAULT_INSTANCE);
    assert_eq!(all[0].snapshot_dir, PathBuf::from("/srv/kv"));
    let view = c.for_instance(&all[0]);
    assert_eq!(view.snapshot_dir, c.snapshot_dir);
    assert!(view.instance.is_empty());
}

#[test]
fn instances_get_their_own_sections_and_share_the_agents() {
    let c = Config::parse(
        "node_id = \"n\"\n[data]\ntcp_streams = 3\n[[instance]]\nname = \"a\"\nsnapshot_dir = \"/kv/a\"\nsnapshot_format = \"redis-rdb\"\n[instance.redis]\nprimary_addr = \"127.0.0.1:7001\"\n[[instance]]\nname = \"b\"\nsnapshot_dir = \"/kv/b\"\n",
    )
    .unwrap();
    c.validate().unwrap();
    let all = c.instances();
    let (a, b) = (c.for_instance(&all[0]), c.for_instance(&all[1]));
    assert_eq!(a.redis.primary_addr, "127.0.0.1:7001");
    assert_eq!(a.snapshot_format, Format::RedisRdb);
    assert_eq!(b.redis.primary_addr, "");
    assert_eq!(b.snapshot_format, Format::Kvr1);
    assert_eq!(
        (a.data.tcp_streams, b.data.tcp_streams),
        (TcpStreams::Fixed(3), TcpStreams::Fixed(3))
    );
}

#[test]
fn instances_may_not_share_a_name_a_redis_server_or_a_seed_port() {
    let table = |name: &str, dir: &str, extra: &str| {
        format!("[[instance]]\nname = \"{name}\"\nsnapshot_dir = \"{dir}\"\nsnapshot_format = \"redis-rdb\"\n{extra}")
    };
    let replicate = |port: u16, seed: &str| {
        format!("[instance.handoff]\nmode = \"redis-replicate\"\n[instance.redis]\nserver_addr = \"127.0.0.1:{port}\"\nprimary = \"10.0.0.1:6379\"\nseed_listen = \"{seed}\"\n")
    };
    let problems = |text: String| {
        let c = Config::parse(&text).unwrap();
        c.validate().unwrap_err()
    };
    let p = problems(table("a", "/kv/a", "") + &table("a", "/kv/b", ""));
    assert_eq!(p.len(), 1, "{p:?}");
    assert!(
        p[0].message.contains("\"a\" and \"a\" share the name"),
        "{p:?}"
    );
    let p = problems(
        table("a", "/kv/a", &replicate(7001, "127.0.0.1:7100"))
            + &table("b", "/kv/b", &replicate(7001, "127.0.0.1:7100")),
    );
    let text: Vec<_> = p.iter().map(|p| p.to_string()).collect();
    assert_eq!(text.len(), 2, "{text:?}");
    assert!(
        text[0].contains("share the Redis server 127.0.0.1:7001"),
        "{text:?}"
    );
    assert!(
        text[1].contains("share the seed port 127.0.0.1:7100"),
        "{text:?}"
    );
    // Port 0 is a fresh port per seeding: not shared.
    let c = Config::parse(
        &(table("a", "/kv/a", &replicate(7001, "127.0.0.1:0"))
            + &table("b", "/kv/b", &replicate(7002, "127.0.0.1:0"))),
    )
    .unwrap();
    c.validate().unwrap();
    let p = problems(table("bad name", "/kv/a", ""));
    assert_eq!(p[0].key, "instance[0].name", "{p:?}");
}

#[test]
fn the_state_dir_is_the_agents_own_absolute_directory() {
    let problems = |text: &str| Config::parse(text).unwrap().validate().unwrap_err();
    let p = problems("snapshot_dir = \"/kv\"\nstate_dir = \"/kv/\"\n");
    assert_eq!(p[0].key, "state_dir", "{p:?}");
    assert!(p[0].message.contains("\"default\"'s snapshot_dir"), "{p:?}");
    let p = problems("snapshot_dir = \"/kv\"\nstate_dir = \"/kv/state\"\n");
    assert_eq!(p[0].key, "state_dir", "inside it: {p:?}");
    let p = problems(
        "snapshot_dir = \"/kv\"\nstate_dir = \"/var/lib/kvsync/stream\"\n[stream]\ndir = \"/var/lib/kvsync/stream\"\nupstream = \"10.0.0.1:35101\"\n",
    );
    assert!(p[0].message.contains("stream log dir"), "{p:?}");
    let p = problems("state_dir = \"kvsync\"\n");
    assert!(p[0].message.contains("absolute"), "{p:?}");
    let c = Config::parse("snapshot_dir = \"/kv\"\nstate_dir = \"/var/lib/kvsync\"\n").unwrap();
    c.validate().unwrap();
}

#[test]
fn the_reference_configs_instance_example_parses_and_validates() {
    let text = include_str!("../../deploy/kvsync.toml");
    let example: String = text[text.find("# [[instance]]").expect("the example")..]
        .lines()
        .map(|l| l.strip_prefix("# ").unwrap_or(l.trim_start_matches('#')))
        .map(|l| format!("{l}\n"))
        .collect();
    let c = Config::parse(&example).unwrap();
    c.validate().unwrap();
    let names: Vec<_> = c.instances().into_iter().map(|i| i.name).collect();
    assert_eq!(names, ["shard-1", "shard-2"]);
}

#[test]
fn unknown_keys_are_rejected() {
    let err = Config::parse("[grpc]\nlisten = \"127.0.0.1:1\"\nlisen = 3\n").unwrap_err();
    assert!(err.contains("lisen"), "{err}");
    let err = Config::parse("nodeid = \"x\"").unwrap_err();
    assert!(err.contains("nodeid"), "{err}");
}

#[test]
fn every_unknown_key_is_reported_at_once_in_line_order() {
    let text = "nodeid = \"x\"\n[grpc]\nlisen = 3\n[[instance]]\nname = \"a\"\n[instance.stream]\nupstrem = \"h:1\"\n";
    let err = Config::parse(text).unwrap_err();
    let at = |k: &str| err.find(k).unwrap_or_else(|| panic!("{k} missing: {err}"));
    assert!(at("line 1: `nodeid`") < at("line 3: `grpc.lisen`"), "{err}");
    assert!(
        at("line 3: `grpc.lisen`") < at("line 7: `instance.0.stream.upstrem`"),
        "{err}"
    );
}

#[test]
fn human_sizes_and_durations() {
    let c = Config::parse(
        "[cache]\nmemory_budget = \"256MiB\"\nacquire_timeout = \"2m 30s\"\n[watch]\ndebounce = \"250ms\"",
    )
    .unwrap();
    assert_eq!(c.cache.memory_budget.as_u64(), 256 << 20);
    assert_eq!(c.cache.acquire_timeout, Duration::from_secs(150));
    assert_eq!(c.watch.debounce, Duration::from_millis(250));
}

#[test]
fn validate_reports_every_problem_with_its_key() {
    let c = Config::parse(
        r#"
node_id = ""
snapshot_dir = "relative/dir"
[grpc]
listen = "nowhere"
[transport]
chunk_mb = 64
pipeline = 4
signal_batch = 8
[handoff]
mode = "command"
[cache]
memory_budget = 0
[redis]
backlog_safety = 0.5
expected_transfer_rate = "0"
"#,
    )
    .unwrap();
    let problems = c.validate().unwrap_err();
    let keys: Vec<&str> = problems.iter().map(|p| p.key.as_str()).collect();
    for key in [
        "node_id",
        "snapshot_dir",
        "grpc.listen",
        "transport.chunk_mb",
        "transport.signal_batch",
        "handoff.command_addr",
        "cache.memory_budget",
        "redis.backlog_safety",
        "redis.expected_transfer_rate",
    ] {
        assert!(keys.contains(&key), "{key} missing from {keys:?}");
    }
    assert_eq!(problems.len(), 9, "{problems:?}");
}

fn valid() -> Config {
    Config {
        node_id: "n".into(),
        ..Default::default()
    }
}

#[test]
fn a_wildcard_metrics_address_and_an_open_fanout_are_warned_about() {
    let mut c = Config::default();
    assert!(c.warnings().is_empty());
    c.metrics.listen = "0.0.0.0:9464".into();
    c.grpc.listen = "10.0.0.1:35101".into();
    let w = c.warnings();
    assert!(w[0].starts_with("metrics.listen 0.0.0.0:9464"), "{w:?}");
    assert!(w[1].starts_with("fanout.allowed_replicas"), "{w:?}");
    c.metrics.listen = "10.0.0.1:9464".into();
    c.fanout.allowed_replicas = vec!["10.0.0.2:35101".into()];
    assert!(c.warnings().is_empty());
}

fn problem_keys(c: &Config) -> Vec<String> {
    c.validate()
        .err()
        .unwrap_or_default()
        .into_iter()
        .map(|p| p.key)
        .collect()
}

#[test]
fn stream_sessions_end_after_their_stall_and_are_capped_per_host_within_the_whole() {
    let mut c = valid();
    c.stream.dir = "/var/lib/kvsync/stream".into();
    c.redis.primary_addr = "127.0.0.1:6379".into();
    c.validate().unwrap();
    c.stream.stall_end = c.stream.stall_timeout;
    c.stream.max_sessions_per_host = 0;
    assert_eq!(
        problem_keys(&c),
        ["stream.stall_end", "stream.max_sessions_per_host"]
    );
    c.stream.stall_end = std::time::Duration::from_secs(30);
    c.stream.max_sessions_per_host = crate::config::MAX_STREAM_SESSIONS + 1;
    assert_eq!(problem_keys(&c), ["stream.max_sessions_per_host"]);
}

#[test]
fn a_stream_log_needs_one_source_and_a_directory_of_its_own() {
    let mut c = valid();
    c.stream.dir = c.snapshot_dir.clone();
    c.stream.segment_size = ByteSize::kib(4);
    c.stream.rdma_ring = ByteSize::mib(3);
    assert_eq!(
        problem_keys(&c),
        [
            "stream.dir",
            "stream.dir",
            "stream.segment_size",
            "stream.rdma_ring"
        ]
    );
    c.stream.rdma_ring = ByteSize::b(0);
    c.stream.dir = "/var/lib/kvsync/stream".into();
    c.stream.segment_size = ByteSize::mib(64);
    c.redis.primary_addr = "127.0.0.1:6379".into();
    c.validate().unwrap();
    c.stream.upstream = "agent-a:7400".into();
    assert_eq!(problem_keys(&c), ["stream.upstream"], "one source, not two");
    c.redis.primary_addr.clear();
    c.validate().unwrap();
    c.stream.ack = StreamAck::Replicas;
    assert_eq!(problem_keys(&c), ["stream.ack"], "only the primary's agent");
    c.stream.ack = StreamAck::Log;
    c.stream.reseed = true;
    c.validate().unwrap();
    c.stream.upstream.clear();
    c.redis.primary_addr = "127.0.0.1:6379".into();
    c.validate()
        .expect("the primary's agent follows agents after a failover");
    c.redis.primary_addr.clear();
    c.stream.reseed = false;
    c.stream.upstream = "agent-a".into();
    assert_eq!(problem_keys(&c), ["stream.upstream"]);
    // The stream handoff feeds its server from the log: no primary.
    c.stream.upstream = "agent-a:7400".into();
    c.snapshot_format = Format::RedisRdb;
    c.handoff.mode = HandoffMode::RedisStream;
    c.redis.server_addr = "127.0.0.1:6380".into();
    c.validate().unwrap();
    c.stream.dir = PathBuf::new();
    assert_eq!(problem_keys(&c), ["handoff.mode"]);
    let text = "node_id = \"n\"\n[[instance]]\nname = \"a\"\nsnapshot_dir = \"/kv/a\"\n[instance.redis]\nprimary_addr = \"127.0.0.1:7001\"\n[instance.stream]\ndir = \"/log\"\n[[instance]]\nname = \"b\"\nsnapshot_dir = \"/kv/b\"\n[instance.redis]\nprimary_addr = \"127.0.0.1:7002\"\n[instance.stream]\ndir = \"/log\"\n";
    let c = Config::parse(text).unwrap();
    let problems = c.validate().unwrap_err();
    assert!(
        problems
            .iter()
            .any(|p| p.message.contains("share the stream log dir")),
        "{problems:?}"
    );
}

#[test]
fn sentinels_come_with_a_master_name_and_peers() {
    let mut c = valid();
    c.stream.dir = "/var/lib/kvsync/stream".into();
    c.redis.primary_addr = "127.0.0.1:6379".into();
    c.stream.sentinels = vec!["10.0.0.9:26379".into(), "sentinel-b".into()];
    assert_eq!(
        problem_keys(&c),
        ["stream.sentinels", "stream.peers", "stream.master_name"]
    );
    c.stream.sentinels.pop();
    c.stream.master_name = "mymaster".into();
    c.stream.peers = vec!["agent-b:7400".into()];
    c.validate().unwrap();
    // One Sentinel under several spellings is one vote, not a majority.
    for twice in ["10.0.0.9:26379", "10.0.0.9:026379"] {
        c.stream.sentinels = vec!["10.0.0.9:26379".into(), twice.into()];
        assert_eq!(problem_keys(&c), ["stream.sentinels"], "{twice}");
    }
    c.stream.sentinels = vec![
        "127.0.0.1:26379".into(),
        "localhost:26379".into(),
        "[::1]:26379".into(),
    ];
    assert_eq!(problem_keys(&c), ["stream.sentinels"]);
    c.stream.sentinels = vec!["Sentinel-A:26379".into(), "sentinel-a:26379".into()];
    assert_eq!(problem_keys(&c), ["stream.sentinels"]);
    for twice in [
        "127.1:26379",
        "0.0.0.0:26379",
        "[::ffff:127.0.0.1]:26379",
        "0:26379",
        "2130706433:26379",
    ] {
        c.stream.sentinels = vec!["127.0.0.1:26379".into(), twice.into()];
        assert_eq!(problem_keys(&c), ["stream.sentinels"], "{twice}");
    }
    c.stream.sentinels = vec!["10.1:26379".into(), "10.0.0.1:26379".into()];
    assert_eq!(problem_keys(&c), ["stream.sentinels"]);
    c.stream.sentinels = vec!["127.0.0.1:26379".into(), "127.0.0.1:26380".into()];
    c.validate().unwrap();
    c.stream.sentinels.clear();
    assert_eq!(problem_keys(&c), ["stream.master_name"]);
}

#[test]
fn piece_size_and_retries_are_bounded() {
    let mut c = valid();
    c.data.piece_size = ByteSize::mib(3);
    c.data.piece_retries = 9;
    assert_eq!(problem_keys(&c), ["data.piece_size", "data.piece_retries"]);
    c.data.piece_size = ByteSize::mib(1);
    c.data.piece_retries = 8;
    c.validate().unwrap();
}

#[test]
fn tcp_streams_is_a_count_or_auto() {
    let streams = |v: &str| Config::parse(&format!("node_id = \"n\"\n[data]\ntcp_streams = {v}\n"));
    assert_eq!(streams("3").unwrap().data.tcp_streams, TcpStreams::Fixed(3));
    let auto = streams("\"auto\"").unwrap();
    assert_eq!(auto.data.tcp_streams, TcpStreams::AUTO);
    assert_eq!(auto.data.tcp_streams.most(), AUTO_TCP_STREAMS);
    auto.validate().unwrap();
    assert!(streams("\"many\"").is_err());
    assert_eq!(problem_keys(&streams("0").unwrap()), ["data.tcp_streams"]);
}

#[test]
fn the_streams_a_source_may_serve_at_once_are_bounded() {
    let mut c = valid();
    c.data.tcp_streams = TcpStreams::Fixed(MAX_TCP_STREAMS);
    c.sync.max_outgoing_syncs = MAX_SERVED_STREAMS / MAX_TCP_STREAMS as usize;
    c.validate().unwrap();
    c.sync.max_outgoing_syncs += 1;
    assert_eq!(problem_keys(&c), ["sync.max_outgoing_syncs"]);
}

#[test]
fn grpc_reachable_from_other_hosts_needs_tls_or_explicit_plaintext() {
    let mut c = valid();
    c.grpc.listen = "0.0.0.0:35101".into();
    let problems = c.validate().unwrap_err();
    assert!(
        problems[0].key == "grpc.listen" && problems[0].message.contains("plaintext = true"),
        "{problems:?}"
    );
    c.grpc.plaintext = true;
    c.auth.token_file = Some("/etc/kvsync/tokens".into());
    c.validate().unwrap();
}

#[test]
fn exposed_grpc_must_authenticate_callers() {
    let mut c = valid();
    c.grpc.listen = "0.0.0.0:35101".into();
    c.grpc.plaintext = true;
    let problems = c.validate().unwrap_err();
    assert!(
        problems.len() == 1
            && problems[0].key == "grpc.listen"
            && problems[0].message.contains("token_file")
            && problems[0].message.contains("client_auth"),
        "{problems:?}"
    );
    c.grpc.listen = "127.0.0.1:35101".into();
    c.validate().unwrap();
}

#[test]
fn peer_facing_names_are_plain() {
    let mut c = valid();
    c.node_id = "node 1\r\n".into();
    c.sync.allowed_sources = vec!["10.0.0.1:35101".into(), "a b:1".into()];
    assert_eq!(problem_keys(&c), ["node_id", "sync.allowed_sources"]);
}

#[test]
fn a_name_in_allowed_sources_needs_a_certificate_to_prove_it() {
    let mut c = valid();
    c.sync.allowed_sources = vec!["primary-1".into()];
    let problems = c.validate().unwrap_err();
    assert!(
        problems[0]
            .message
            .contains("only a certificate proves one"),
        "{problems:?}"
    );
    c.tls.ca_file = Some("/ca.pem".into());
    assert!(c.tls_proves_names());
    // One name for every agent proves no host.
    c.tls.server_name = "fleet".into();
    assert!(!c.tls_proves_names());
}

#[test]
fn tls_needs_three_usable_pem_files() {
    let dir = tempfile::tempdir().unwrap();
    let made = rcgen::generate_simple_self_signed(vec!["agent".into()]).unwrap();
    let (cert, key, junk) = (
        dir.path().join("c.pem"),
        dir.path().join("k.pem"),
        dir.path().join("junk.pem"),
    );
    std::fs::write(&cert, made.cert.pem()).unwrap();
    std::fs::write(&key, made.signing_key.serialize_pem()).unwrap();
    std::fs::write(&junk, "not pem").unwrap();

    let mut c = valid();
    c.tls.cert_file = Some(cert.clone());
    c.tls.client_auth = true;
    assert_eq!(problem_keys(&c), ["tls.key_file", "tls.ca_file"]);
    c.tls.key_file = Some(cert.clone());
    c.tls.ca_file = Some(dir.path().join("missing.pem"));
    let problems = c.validate().unwrap_err();
    assert!(
        problems[0].message.contains("no usable PEM private key"),
        "{problems:?}"
    );
    assert!(problems[1].message.contains("cannot read"), "{problems:?}");
    c.tls.key_file = Some(key);
    c.tls.ca_file = Some(junk);
    assert_eq!(problem_keys(&c), ["tls.ca_file"]);
    c.tls.ca_file = Some(cert);
    c.validate().unwrap();
    c.grpc.plaintext = true;
    assert_eq!(problem_keys(&c), ["grpc.plaintext"]);
    // Without TLS, client_auth has nothing to work with.
    let mut c = valid();
    c.tls.client_auth = true;
    assert_eq!(problem_keys(&c), ["tls.client_auth"]);
}

#[test]
fn a_password_is_kept_in_a_file_that_holds_one_and_an_inline_one_is_warned_of() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("redis.pass");
    let mut c = valid();
    c.redis.password_file = file.clone();
    let problems = c.validate().unwrap_err();
    assert!(
        problems[0].key == "redis.password_file" && problems[0].message.contains("redis.pass"),
        "a missing file: {problems:?}"
    );
    std::fs::write(&file, "s3cret\n").unwrap();
    c.validate().unwrap();
    assert!(c.warnings().iter().all(|w| !w.contains("password")));
    c.redis.password = "hunter2-value".into();
    assert_eq!(problem_keys(&c), ["redis.password_file"]);
    c.redis.password_file = PathBuf::new();
    c.validate().unwrap();
    let warned = c.warnings();
    assert!(
        warned
            .iter()
            .any(|w| w.starts_with("redis.password ") && w.contains("password_file")),
        "{warned:?}"
    );
    assert!(
        warned.iter().all(|w| !w.contains("hunter2")),
        "never the password itself"
    );
    c.stream.sentinel_password_file = dir.path().join("none");
    assert_eq!(problem_keys(&c), ["stream.sentinel_password_file"]);
}

#[test]
fn tls_to_the_servers_needs_a_ca_and_a_client_certificate_with_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let (ca, crt, pem_key) = (
        dir.path().join("ca.pem"),
        dir.path().join("client.pem"),
        dir.path().join("client.key"),
    );
    std::fs::write(&ca, cert.pem()).unwrap();
    std::fs::write(&crt, cert.pem()).unwrap();
    std::fs::write(&pem_key, key.serialize_pem()).unwrap();
    let mut c = valid();
    c.redis.tls = true;
    assert_eq!(problem_keys(&c), ["redis.tls_ca_file"]);
    c.redis.tls_ca_file = dir.path().join("missing.pem");
    assert_eq!(
        problem_keys(&c),
        ["redis.tls_ca_file"],
        "a CA file that is not there"
    );
    c.redis.tls_ca_file = pem_key.clone();
    assert_eq!(
        problem_keys(&c),
        ["redis.tls_ca_file"],
        "a key given as the CA"
    );
    c.redis.tls_ca_file = ca.clone();
    c.validate().unwrap();
    c.redis.tls_cert_file = crt;
    assert_eq!(problem_keys(&c), ["redis.tls_cert_file"]);
    c.redis.tls_key_file = pem_key;
    c.validate().unwrap();
    assert_eq!(c.redis.auth().tls().unwrap().ca, ca);
    c.redis.tls = false;
    c.stream.sentinel_tls = true;
    assert!(c.redis.auth().tls().is_none() && c.sentinel_auth().tls().is_some());
}
