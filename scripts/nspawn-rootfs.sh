#!/usr/bin/env bash
# Builds the Debian 12 root filesystem the systemd tests boot with systemd-nspawn
# (tests/systemd/nspawn.py), once, cached as a tar.zst under the repository's ignored .cache/.
#
#   scripts/nspawn-rootfs.sh            prints the path of the cached tar.zst, building it first
#                                       when there is none for this version of the script
#   scripts/nspawn-rootfs.sh --rebuild  builds it even when cached
#
# Run as root (debootstrap); needs network to the Debian archive for the build only (the
# container itself runs without network). What it holds, and why:
#   - debootstrap --variant=minbase with systemd, systemd-sysv, dbus, python3, python3-venv,
#     procps, iproute2: an init, the bus systemd-run talks over, and a Python for the venv;
#   - gpusnap-criu-sysctl.service: a oneshot that mounts a fresh proc and binds ns_last_pid,
#     sem_next_id, msg_next_id and shm_next_id from it over the read-only /proc/sys that
#     nspawn gives the container (CRIU writes them; `criu check` fails without);
#   - the CRIU packages (scripts/install-criu.sh's) in /var/cache/gpusnap/criu-debs, for
#     `scripts/install.sh --criu-debs` inside the container (no network there);
#   - getty and apt's timers masked: nothing in the container starts on its own but systemd.
# The cache key hashes this script and install-criu.sh (whose package list lands inside), so
# editing either rebuilds; older tarballs are removed. GPUSNAP_DEBIAN_MIRROR picks the mirror.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

SUITE=bookworm
MIRROR=${GPUSNAP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
INCLUDE=systemd,systemd-sysv,dbus,python3,python3-venv,procps,iproute2
CACHE=$repo/.cache/nspawn

log() { echo "nspawn-rootfs: $*" >&2; }
die() {
  log "error: $*"
  exit 1
}

rebuild=0
case "${1:-}" in
  "") ;;
  --rebuild) rebuild=1 ;;
  *) die "usage: $0 [--rebuild]" ;;
esac

key=$(cat scripts/nspawn-rootfs.sh scripts/install-criu.sh | sha256sum | cut -c1-16)
out=$CACHE/rootfs-$SUITE-$key.tar.zst
if [ "$rebuild" = 0 ] && [ -s "$out" ]; then
  echo "$out"
  exit 0
fi

[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap)"
for bin in debootstrap zstd tar; do
  command -v "$bin" >/dev/null || die "$bin is missing (scripts/bootstrap.sh installs it)"
done
mkdir -p "$CACHE"
# One build at a time: a second caller waits, then finds the tarball.
exec 9>"$CACHE/.lock"
flock 9
if [ "$rebuild" = 0 ] && [ -s "$out" ]; then
  echo "$out"
  exit 0
fi

build=$(mktemp -d "$CACHE/build.XXXXXX")
trap 'rm -rf "$build"' EXIT
root=$build/root
start=$SECONDS
log "debootstrap $SUITE into $root (from $MIRROR)"
debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$root" "$MIRROR" \
  >"$build/debootstrap.log" 2>&1 || {
  tail -n 20 "$build/debootstrap.log" >&2
  die "debootstrap failed (log above)"
}

log "downloading the CRIU packages into /var/cache/gpusnap/criu-debs"
bash scripts/install-criu.sh --download-debs "$root/var/cache/gpusnap/criu-debs"

cat >"$root/etc/systemd/system/gpusnap-criu-sysctl.service" <<'EOF'
# Added by gpusnap scripts/nspawn-rootfs.sh. systemd-nspawn mounts /proc/sys read-only; CRIU
# writes kernel/ns_last_pid (and the IPC id counters) to restore pids and IPC ids. A proc
# mounted afresh inside the container is writable for these (they belong to the container's
# own pid and IPC namespaces), so bind just those four files from it.
[Unit]
Description=Writable ns_last_pid and IPC id counters for CRIU
DefaultDependencies=no
Before=sysinit.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -ec 'mkdir -p /run/gpusnap-proc; mount -t proc proc /run/gpusnap-proc; for f in ns_last_pid sem_next_id msg_next_id shm_next_id; do mount --bind /run/gpusnap-proc/sys/kernel/$f /proc/sys/kernel/$f; done'

[Install]
WantedBy=sysinit.target
EOF
mkdir -p "$root/etc/systemd/system/sysinit.target.wants"
ln -sf ../gpusnap-criu-sysctl.service "$root/etc/systemd/system/sysinit.target.wants/"
for unit in console-getty.service getty@.service apt-daily.timer apt-daily-upgrade.timer \
  apt-daily.service apt-daily-upgrade.service; do
  ln -sf /dev/null "$root/etc/systemd/system/$unit"
done
echo gpusnap-test >"$root/etc/hostname"
# systemd makes a fresh machine id at every boot when this is empty.
: >"$root/etc/machine-id"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb

log "packing $(du -sh "$root" | cut -f1) into $out"
tar --numeric-owner --xattrs -C "$root" -cf - . | zstd -q -T0 -3 -o "$build/rootfs.tar.zst"
rm -f "$CACHE"/rootfs-"$SUITE"-*.tar.zst
mv "$build/rootfs.tar.zst" "$out"
log "built in $((SECONDS - start))s: $(du -h "$out" | cut -f1)"
echo "$out"
