#!/usr/bin/env bash
# rxe-vm.sh — run a command inside a small qemu VM that has real RDMA verbs
# through soft-RoCE (rdma_rxe on the VM's virtual NIC), for testing RDMA code
# on machines without an RDMA NIC or kernel RDMA support.
#
# Usage: scripts/rxe-vm.sh [--timeout SECONDS] [--env NAME ...] -- COMMAND [ARG ...]
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
# Exit status: the command's; 3 when the harness cannot run here (not root,
# packages or kernel unavailable); 125 when the VM failed to run the command.
#
# Environment: KVSYNC_VM_CACHE (default /var/cache/kvsync-vm) holds the
# kernel and initramfs; KVSYNC_VM_MEM (default 2G); KVSYNC_VM_ACCEL (tcg, or
# kvm when it works on the machine).
set -euo pipefail

timeout_s=170
pass_env=()
while [ $# -gt 0 ]; do
    case "$1" in
        --timeout) timeout_s=$2; shift 2 ;;
        --env) pass_env+=("$2"); shift 2 ;;
        --) shift; break ;;
        *) echo "rxe-vm: unknown option $1 (use -- before the command)" >&2; exit 2 ;;
    esac
done
[ $# -gt 0 ] || { echo "usage: rxe-vm.sh [--timeout S] [--env NAME] -- COMMAND..." >&2; exit 2; }
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
modules="virtio_pci virtio_net 9p 9pnet_virtio crc32_generic crc32-pclmul ib_core ib_uverbs rdma_rxe ib_cm iw_cm rdma_cm rdma_ucm veth sch_netem"
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
job=$(/bin/busybox sed -n 's/.*kvsync_job=\([^ ]*\).*/\1/p' /proc/cmdline)
/bin/busybox chroot /host /usr/bin/rdma link add rxe0 type rxe netdev eth0 > /dev/ttyS0 2>&1 || fail "rdma link add failed"
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
qemu_pid=""
cleanup() {
    [ -n "$qemu_pid" ] && kill -9 "$qemu_pid" 2>/dev/null || true
    rm -rf "$jobdir"
}
trap cleanup EXIT
{
    echo "#!/bin/bash"
    echo "export PATH=$(printf '%q' "$PATH") HOME=/tmp"
    for name in "${pass_env[@]}"; do
        [ -n "${!name+x}" ] && echo "export $name=$(printf '%q' "${!name}")"
    done
    echo "cd $(printf '%q' "$PWD") || exit 126"
    printf 'exec'
    printf ' %q' "$@"
    echo
} > "$jobdir/job.sh"
chmod 0755 "$jobdir" "$jobdir/job.sh"

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
: > "$jobdir/out"
timeout --kill-after=5 "$timeout_s" qemu-system-x86_64 \
    "${accel_args[@]}" -smp 2 -m "${KVSYNC_VM_MEM:-2G}" \
    -kernel "$kroot/boot/vmlinuz-$kver" -initrd "$initrd" \
    -append "console=ttyS0 quiet panic=-1 kvsync_job=$jobdir/job.sh${bind:+ kvsync_bind=$bind}" \
    -nographic -no-reboot -nodefaults \
    -serial "file:$jobdir/console" -serial "file:$jobdir/out" \
    -netdev user,id=n0 -device virtio-net-pci,netdev=n0 \
    -virtfs local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap \
    </dev/null >/dev/null 2>"$jobdir/qemu.err" &
qemu_pid=$!
set +e
wait "$qemu_pid"
qemu_rc=$?
set -e
qemu_pid=""

code=$(sed -n 's/^KVSYNC_VM_EXIT=\([0-9]*\).*/\1/p' "$jobdir/out" | tail -n 1)
sed '/^KVSYNC_VM_EXIT=/d' "$jobdir/out" | tr -d '\r'
if [ -z "$code" ]; then
    if [ "$qemu_rc" -eq 124 ] || [ "$qemu_rc" -eq 137 ]; then
        echo "rxe-vm: the VM hit the ${timeout_s}s time limit and was killed" >&2
    else
        echo "rxe-vm: the VM ended without running the command (qemu exit $qemu_rc)" >&2
    fi
    tail -n 30 "$jobdir/console" "$jobdir/qemu.err" >&2 2>/dev/null || true
    exit 125
fi
exit "$code"
