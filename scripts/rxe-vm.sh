#!/usr/bin/env bash
# rxe-vm.sh — run a command inside a small qemu VM that has real RDMA verbs
# through soft-RoCE (rdma_rxe on the VM's virtual NIC), for testing RDMA code
# on machines without an RDMA NIC or kernel RDMA support.
#
# Usage: scripts/rxe-vm.sh [--hosts 2] [--timeout SECONDS] [--env NAME ...] -- COMMAND [ARG ...]
#
# The VM boots Debian's stock kernel (downloaded once with `apt-get download`
# and unpacked, never installed) from a tiny busybox initramfs, mounts the
# host's root read-only over 9p and chroots into it, so every host binary and
# library is available unchanged; /tmp inside is a fresh tmpfs (but the
# top directory of the working directory stays visible when it is in /tmp). eth0 gets
# 10.0.2.15/24 and `rdma link add rxe0 type rxe netdev eth0` brings up rxe0.
# veth and sch_netem are loaded too, for links with a delay between network
# namespaces inside the VM (scripts/bench-rtt.sh).
# COMMAND runs in the current working directory with the named environment
# variables passed through; its output is printed here and its exit status is
# this script's. The VM is always powered off, under a hard time limit, and
# no qemu process is left behind.
#
# --hosts 2: two such VMs, a and b, booted side by side and joined by a
# second virtual link (a qemu datagram socket between them): there eth1 has
# 10.9.0.1/24 in a and 10.9.0.2/24 in b, and rxe0 is on eth1, while eth0
# keeps user-mode NAT (no RDMA). COMMAND runs in both, with KVSYNC_VM_HOST
# (a or b), KVSYNC_VM_ADDR (its own eth1 address) and KVSYNC_VM_PEER (the
# other's) set; a's output is printed, then b's, each after a line
# "=== vm a" / "=== vm b". Both VMs share one time limit, a VM whose
# command fails stops the other at once, and both are always gone at the
# end.
#
# Exit status: the command's (with two hosts: a's if it failed, else b's); 3
# when the harness cannot run here (not root, packages or kernel
# unavailable); 125 when a VM failed to run the command.
#
# One VM job runs at a time on a machine: a job waits for the lock of the one
# before it (guests that share the host's cores outrun their time limits),
# and the time limit counts from its own boot. Each "== SECTION" line the
# command prints is timed on the host's clock; the timings go to stderr
# (and are appended to $KVSYNC_VM_LOG when set), and a VM that hits the time
# limit names the section it was in.
#
# Environment: KVSYNC_VM_CACHE (default /var/cache/kvsync-vm) holds the
# kernel and initramfs; KVSYNC_VM_MEM (default 2G); KVSYNC_VM_ACCEL (tcg, or
# kvm when it works on the machine); KVSYNC_VM_LOG (a file the section
# timings are appended to).
set -euo pipefail

timeout_s=170
hosts=1
pass_env=()
while [ $# -gt 0 ]; do
    case "$1" in
        --timeout) timeout_s=$2; shift 2 ;;
        --hosts) hosts=$2; shift 2 ;;
        --env) pass_env+=("$2"); shift 2 ;;
        --) shift; break ;;
        *) echo "rxe-vm: unknown option $1 (use -- before the command)" >&2; exit 2 ;;
    esac
done
[ $# -gt 0 ] || { echo "usage: rxe-vm.sh [--hosts 2] [--timeout S] [--env NAME] -- COMMAND..." >&2; exit 2; }
case "$hosts" in 1|2) ;; *) echo "rxe-vm: --hosts is 1 or 2" >&2; exit 2 ;; esac
[ "$(id -u)" -eq 0 ] || { echo "rxe-vm: must run as root (it installs packages and shares / into the VM)" >&2; exit 3; }

here=$(cd "$(dirname "$0")" && pwd)
bash "$here/deps.sh" qemu-system-x86 busybox-static cpio kmod rdma-core ibverbs-utils rdmacm-utils perftest iproute2 >&2 ||
    { echo "rxe-vm: cannot install the VM's packages" >&2; exit 3; }

cache=${KVSYNC_VM_CACHE:-/var/cache/kvsync-vm}
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9   # one kernel download / initramfs build at a time

# --- kernel: Debian's stock image, unpacked once -----------------------------
kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
if [ -z "$kpkg" ]; then
    apt-get update -qq >&2
    kpkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
fi
[ -n "$kpkg" ] || { echo "rxe-vm: cannot find Debian's linux-image package" >&2; exit 3; }
kver=${kpkg#linux-image-}
kroot="$cache/kernel-$kver"
if [ ! -f "$kroot/.unpacked" ]; then
    echo "rxe-vm: fetching $kpkg (once)" >&2
    rm -rf "$kroot" "$cache"/*.deb
    (cd "$cache" && apt-get download -qq "$kpkg" >/dev/null 2>&1) || { echo "rxe-vm: cannot download $kpkg" >&2; exit 3; }
    dpkg -x "$cache/${kpkg}"_*.deb "$kroot"
    depmod -b "$kroot" "$kver"
    rm -f "$cache/${kpkg}"_*.deb
    touch "$kroot/.unpacked"
fi

# --- initramfs: busybox + the modules, rebuilt when its inputs change --------
modules="virtio_pci virtio_net 9p 9pnet_virtio crc32_generic crc32-pclmul ib_core ib_uverbs rdma_rxe ib_cm iw_cm rdma_cm rdma_ucm veth sch_netem tls gcm ctr ghash-generic aesni-intel ghash-clmulni-intel"
read -r -d '' init <<'INIT' || true
#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /host
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do /bin/busybox insmod "$m" 2>/dev/null; done
fail() { echo "rxe-vm guest: $*" > /dev/ttyS1; echo "KVSYNC_VM_EXIT=125" > /dev/ttyS1; /bin/busybox poweroff -f; }
/bin/busybox mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144 host /host || fail "cannot mount the host root"
for d in proc sys dev; do /bin/busybox mount --bind /$d /host/$d; done
# /tmp is a fresh tmpfs, except that the directory the command runs in, when
# it lives under the host's /tmp, stays visible (bound from the host).
bind=$(/bin/busybox sed -n 's/.*kvsync_bind=\([^ ]*\).*/\1/p' /proc/cmdline)
if [ -n "$bind" ]; then /bin/busybox mkdir -p /orig; /bin/busybox mount --bind "/host$bind" /orig; fi
/bin/busybox mount -t tmpfs tmpfs /host/tmp
if [ -n "$bind" ]; then /bin/busybox mkdir -p "/host$bind"; /bin/busybox mount --bind /orig "/host$bind"; fi
/bin/busybox mount -t tmpfs tmpfs /host/run
/bin/busybox mount -t tmpfs tmpfs /host/var/tmp
/bin/busybox ip link set lo up
/bin/busybox ip link set eth0 up
/bin/busybox ip addr add 10.0.2.15/24 dev eth0
/bin/busybox ip route add default via 10.0.2.2
# Two hosts: eth1 is the link between them, and carries rxe0.
rxe_on=eth0
link_ip=$(/bin/busybox sed -n 's/.*kvsync_ip=\([^ ]*\).*/\1/p' /proc/cmdline)
if [ -n "$link_ip" ]; then
    /bin/busybox ip link set eth1 up
    /bin/busybox ip addr add "$link_ip" dev eth1
    rxe_on=eth1
fi
job=$(/bin/busybox sed -n 's/.*kvsync_job=\([^ ]*\).*/\1/p' /proc/cmdline)
/bin/busybox chroot /host /usr/bin/rdma link add rxe0 type rxe netdev $rxe_on > /dev/ttyS0 2>&1 || fail "rdma link add failed"
/bin/busybox chroot /host /bin/bash "$job" > /dev/ttyS1 2>&1
echo "KVSYNC_VM_EXIT=$?" > /dev/ttyS1
/bin/busybox sync
/bin/busybox poweroff -f
INIT
key=$(printf '%s\n%s\n%s\n' "$kver" "$modules" "$init" | cat - /bin/busybox | sha256sum | cut -c1-16)
initrd="$cache/initrd-$key.cpio.gz"
if [ ! -f "$initrd" ]; then
    echo "rxe-vm: building initramfs" >&2
    build=$(mktemp -d)
    mkdir -p "$build/bin" "$build/mods"
    cp /bin/busybox "$build/bin/busybox"
    printf '%s\n' "$init" > "$build/init"
    chmod +x "$build/init"
    : > "$build/modules.order"
    for m in $modules; do
        modprobe -d "$kroot" -S "$kver" --show-depends "$m" | awk '$1 == "insmod" {print $2}'
    done | awk '!seen[$0]++' | while read -r ko; do
        cp "$ko" "$build/mods/"
        echo "/mods/$(basename "$ko")" >> "$build/modules.order"
    done
    (cd "$build" && find . | cpio -o -H newc --quiet | gzip -1) > "$initrd.tmp"
    mv "$initrd.tmp" "$initrd"
    rm -rf "$build"
    find "$cache" -maxdepth 1 -name 'initrd-*.cpio.gz' ! -name "$(basename "$initrd")" -delete
fi
flock -u 9

# --- the job: cwd, environment, command --------------------------------------
jobdir=$(mktemp -d "$cache/job.XXXXXX")
qemu_pids=()
watchers=()
cleanup() {
    for p in "${qemu_pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${watchers[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    rm -rf "$jobdir"
}
trap cleanup EXIT
# job NAME [VAR=VALUE ...]: the script the VM NAME runs.
job() {
    local name=$1; shift
    {
        echo "#!/bin/bash"
        echo "export PATH=$(printf '%q' "$PATH") HOME=/tmp"
        for name_var in "${pass_env[@]}"; do
            [ -n "${!name_var+x}" ] && echo "export $name_var=$(printf '%q' "${!name_var}")"
        done
        for kv in "$@"; do echo "export $(printf '%q' "$kv")"; done
        echo "cd $(printf '%q' "$PWD") || exit 126"
        printf 'exec'
        printf ' %q' "${cmd[@]}"
        echo
    } > "$jobdir/$name.sh"
    chmod 0755 "$jobdir/$name.sh"
}
cmd=("$@")
chmod 0755 "$jobdir"

# Keep the working directory visible when it is under /tmp (tmpfs inside).
bind=""
case "$PWD" in
    /tmp/*) top=${PWD#/tmp/}; top=/tmp/${top%%/*}; case "$top" in *" "*) ;; *) bind=$top ;; esac ;;
esac

accel=${KVSYNC_VM_ACCEL:-tcg}
case "$accel" in
    kvm) accel_args=(-accel kvm -cpu host) ;;
    *) accel_args=(-accel tcg,thread=multi -cpu max) ;;
esac
# boot NAME APPEND [QEMU ARG ...]: starts the VM NAME running NAME.sh.
boot() {
    local name=$1 append=$2; shift 2
    : > "$jobdir/$name.out"
    timeout --kill-after=5 "$timeout_s" qemu-system-x86_64 \
        "${accel_args[@]}" -smp 2 -m "${KVSYNC_VM_MEM:-2G}" \
        -kernel "$kroot/boot/vmlinuz-$kver" -initrd "$initrd" \
        -append "console=ttyS0 quiet panic=-1 kvsync_job=$jobdir/$name.sh${bind:+ kvsync_bind=$bind}$append" \
        -nographic -no-reboot -nodefaults \
        -serial "file:$jobdir/$name.console" -serial "file:$jobdir/$name.out" \
        -netdev user,id=n0 -device virtio-net-pci,netdev=n0 \
        "$@" \
        -virtfs local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap \
        </dev/null >/dev/null 2>"$jobdir/$name.qemu.err" &
    qemu_pids+=($!)
    # Host-clock time of each "== SECTION" line, as the guest prints it.
    echo "$(date +%s.%N) (boot)" > "$jobdir/$name.sections"
    tail --pid=$! -s 0.2 -n +1 -F "$jobdir/$name.out" 2>/dev/null | while IFS= read -r line; do
        line=${line%$'\r'}
        case "$line" in "== "*) echo "$(date +%s.%N) ${line#== }" >> "$jobdir/$name.sections" ;; esac
    done &
    watchers+=($!)
}
# sections NAME: one line naming VM NAME's sections in order, each with its
# seconds (the last one up to now).
sections() {
    awk -v now="$(date +%s.%N)" -v vm="$1" '
        { t[NR] = $1; $1 = ""; n[NR] = substr($0, 2) }
        END {
            line = "rxe-vm: VM " vm " sections (s):"
            for (i = 1; i <= NR; i++) line = line sprintf(" %s %.1f;", n[i], (i < NR ? t[i + 1] : now) - t[i])
            printf "%s total %.1f\n", line, now - t[1]
        }' "$jobdir/$1.sections"
}
# last_section NAME: the section VM NAME was in last.
last_section() { tail -n 1 "$jobdir/$1.sections" | cut -d' ' -f2-; }

# One VM job at a time on this machine (see the header).
exec 8>"$cache/.vm.lock"
if ! flock -n 8; then
    waited=$(date +%s)
    echo "rxe-vm: waiting for the VM job before this one to finish" >&2
    flock 8
    echo "rxe-vm: waited $(( $(date +%s) - waited )) s for the VM lock" >&2
fi
# link SELF OTHER MAC: qemu arguments for the second NIC, a datagram socket
# to the other VM's.
link() {
    link_args=(-netdev "dgram,id=n1,local.type=unix,local.path=$jobdir/$1.sock,remote.type=unix,remote.path=$jobdir/$2.sock"
        -device "virtio-net-pci,netdev=n1,mac=$3")
}
if [ "$hosts" = 1 ]; then
    names=(vm)
    job vm
    boot vm ""
else
    names=(a b)
    job a KVSYNC_VM_HOST=a KVSYNC_VM_ADDR=10.9.0.1 KVSYNC_VM_PEER=10.9.0.2
    job b KVSYNC_VM_HOST=b KVSYNC_VM_ADDR=10.9.0.2 KVSYNC_VM_PEER=10.9.0.1
    link a b 52:54:00:00:09:01
    boot a " kvsync_ip=10.9.0.1/24" "${link_args[@]}"
    link b a 52:54:00:00:09:02
    boot b " kvsync_ip=10.9.0.2/24" "${link_args[@]}"
fi

# report NAME QEMU_STATUS: prints the VM's output; returns the command's status.
report() {
    local name=$1 qemu_rc=$2 code
    code=$(sed -n 's/^KVSYNC_VM_EXIT=\([0-9]*\).*/\1/p' "$jobdir/$name.out" | tail -n 1)
    sed '/^KVSYNC_VM_EXIT=/d' "$jobdir/$name.out" | tr -d '\r'
    if [ -z "$code" ]; then
        if [ "$qemu_rc" -eq 124 ] || [ "$qemu_rc" -eq 137 ]; then
            echo "rxe-vm: VM $name hit the ${timeout_s}s time limit in section '$(last_section "$name")' and was killed" >&2
        else
            echo "rxe-vm: VM $name ended without running the command (qemu exit $qemu_rc)" >&2
        fi
        tail -n 30 "$jobdir/$name.console" "$jobdir/$name.qemu.err" >&2 2>/dev/null || true
        return 125
    fi
    return "$code"
}
# Wait for the VMs; with two, one that fails stops the other at once
# (the other would only wait for it until the time limit).
declare -A rc_of stopped
set +e
live=("${qemu_pids[@]}")
while [ "${#live[@]}" -gt 0 ]; do
    ended=""
    wait -n -p ended "${live[@]}"
    rc=$?
    [ -n "$ended" ] || break
    for i in "${!names[@]}"; do
        [ "${qemu_pids[$i]}" = "$ended" ] || continue
        rc_of[$i]=$rc
        grep -q '^KVSYNC_VM_EXIT=0' "$jobdir/${names[$i]}.out" && continue
        for j in "${!names[@]}"; do
            [ -z "${rc_of[$j]+x}" ] && [ -z "${stopped[$j]+x}" ] || continue
            stopped[$j]=${names[$i]}
            kill -TERM "${qemu_pids[$j]}" 2>/dev/null
        done
    done
    rest=()
    for p in "${live[@]}"; do [ "$p" = "$ended" ] || rest+=("$p"); done
    live=("${rest[@]}")
done
qemu_pids=()
# The watchers end with their VM (after reading its last lines).
wait "${watchers[@]}" 2>/dev/null
watchers=()
for name in "${names[@]}"; do
    sections "$name" >&2
    [ -z "${KVSYNC_VM_LOG:-}" ] || sections "$name" >> "$KVSYNC_VM_LOG"
done
status=0
for i in "${!names[@]}"; do
    [ "$hosts" = 2 ] && echo "=== vm ${names[$i]}"
    if [ -n "${stopped[$i]+x}" ]; then
        sed '/^KVSYNC_VM_EXIT=/d' "$jobdir/${names[$i]}.out" | tr -d '\r'
        echo "rxe-vm: VM ${names[$i]} was stopped: VM ${stopped[$i]} failed" >&2
        continue
    fi
    report "${names[$i]}" "${rc_of[$i]}"
    rc=$?
    [ "$status" = 0 ] && status=$rc
done
exit "$status"
