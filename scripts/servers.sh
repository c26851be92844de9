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
