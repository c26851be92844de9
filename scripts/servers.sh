# Sourced by the scripts that start daemonized redis/valkey servers, each
# with its pidfile at DIR/NAME/redis.pid.
#
# stop_servers DIR: stops every such server under DIR and waits (at most 10 s
# each) until it has exited. A server writes its log and removes its
# pidfile as it exits, so a directory removed before then can come back
# non-empty.
stop_servers() {
    local f pid
    for f in "$1"/*/redis.pid; do
        [ -f "$f" ] || continue
        pid=$(cat "$f")
        kill "$pid" 2>/dev/null && timeout 10 tail --pid="$pid" -f /dev/null || true
    done
}

# SERVER_TLS=1: every replication link over TLS. server_tls_setup DIR makes
# a CA and certificates in DIR for the servers and the agents, and sets
# server_tls (a server's TLS arguments but its port: tls-auth-clients and
# tls-replication on) and redis_tls (the agents' [redis] lines). kv_port
# PORT is where replication and the agents reach the server on PORT: its
# TLS port, PORT+1000, under SERVER_TLS.
server_tls=() redis_tls=""
server_tls_setup() {
    [ -n "${SERVER_TLS:-}" ] || return 0
    local tls=$1 who
    mkdir -p "$tls"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=bench-ca \
        -keyout "$tls/ca.key" -out "$tls/ca.crt" 2>/dev/null
    for who in server agent; do
        openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$who" \
            -keyout "$tls/$who.key" -out "$tls/$who.csr" 2>/dev/null
        openssl x509 -req -in "$tls/$who.csr" -CA "$tls/ca.crt" -CAkey "$tls/ca.key" -CAcreateserial \
            -days 2 -extfile <(printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n') -out "$tls/$who.crt" 2>/dev/null
    done
    server_tls=(--tls-cert-file "$tls/server.crt" --tls-key-file "$tls/server.key" --tls-ca-cert-file "$tls/ca.crt"
        --tls-auth-clients yes --tls-replication yes)
    redis_tls="tls = true
tls_ca_file = \"$tls/ca.crt\"
tls_cert_file = \"$tls/agent.crt\"
tls_key_file = \"$tls/agent.key\""
}
kv_port() { if [ -n "${SERVER_TLS:-}" ]; then echo $(($1 + 1000)); else echo "$1"; fi; }
# tls_args PORT: the TLS arguments of the server on PORT (none without
# SERVER_TLS).
tls_args() { [ -n "${SERVER_TLS:-}" ] && printf '%s\n' "${server_tls[@]}" --tls-port "$(kv_port "$1")"; return 0; }

# agent NAME CONFIG (with $work and $bin set): starts `kvsync agent` with
# CONFIG in $work/NAME.toml (its output in $work/NAME.out and .log),
# records its pid in $work/agents, and prints its gRPC address once it is
# ready. agent_listen: the [grpc], [data] and [metrics] lines of an agent
# on loopback ports the kernel picks.
agent() {
    local name=$1
    printf '%s\n' "$2" >"$work/$name.toml"
    KVSYNC_LOG=warn "$bin" agent --config "$work/$name.toml" >"$work/$name.out" 2>"$work/$name.log" &
    echo $! >>"$work/agents"
    for _ in $(seq 200); do grep -q ready "$work/$name.out" 2>/dev/null && break; sleep 0.05; done
    grep -o 'grpc=[^ ]*' "$work/$name.out" | cut -d= -f2
}
agent_listen='[grpc]
listen = "127.0.0.1:0"
[data]
tcp_listen = "127.0.0.1:0"
rdma_port = 0
[metrics]
listen = ""'
