#!/bin/sh
# Installs the kvsync agent as a systemd service, as docs/OPERATIONS.md
# says: the binary, the unit, a config only root writes and the
# agent's group reads, and the directories the example config names,
# owned by the agent's user. Run from the source tree after
# `cargo build --release`:
#     sudo deploy/install.sh
# then edit /etc/kvsync/kvsync.toml and `systemctl enable --now kvsync`.
# An existing config is left as it is.
#   DESTDIR       install under this root (a package build); no user is
#                 created and systemd is not told
#   KVSYNC_USER   the agent's user and group (default kvsync), created as a
#                 system user when missing
#   KVSYNC_BIN    the binary (default target/release/kvsync)
set -eu
root="${DESTDIR:-}"
user="${KVSYNC_USER:-kvsync}"
bin="${KVSYNC_BIN:-target/release/kvsync}"
here="$(dirname "$0")"

if [ -z "$root" ] && ! id "$user" >/dev/null 2>&1; then
    useradd --system --user-group --no-create-home --shell /usr/sbin/nologin "$user"
fi
install -D -m 755 "$bin" "$root/usr/local/bin/kvsync"
install -D -m 644 "$here/kvsync.service" "$root/etc/systemd/system/kvsync.service"
install -d -m 755 "$root/etc/kvsync"
if [ ! -e "$root/etc/kvsync/kvsync.toml" ]; then
    install -m 640 -o root -g "$user" "$here/kvsync.toml" "$root/etc/kvsync/kvsync.toml"
fi
# The example config's snapshot_dir, and the state directory the unit
# gives the agent (its stream log and backlog record live there).
install -d -m 750 -o "$user" -g "$user" \
    "$root/var/lib/kvstore/snapshots" "$root/var/lib/kvsync" \
    "$root/var/lib/kvsync/snapshots" "$root/var/lib/kvsync/stream"
if [ -z "$root" ]; then
    systemctl daemon-reload
    echo "installed: edit /etc/kvsync/kvsync.toml, then systemctl enable --now kvsync"
fi
