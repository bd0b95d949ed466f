#!/usr/bin/env bash
# Installs the container runtimes gpusnap checkpoints (run as root; scripts/bootstrap.sh calls it):
# podman, runc and containerd from the distribution (Debian 12: podman 4.3.1, runc 1.1.5,
# containerd 1.6.20), without recommends, so that neither crun (it cannot checkpoint on hybrid
# cgroups: "crun: cgroups in hybrid mode not supported") nor Debian 12's criu 3.17 (it cannot
# run on current kernels) comes along: CRIU is scripts/install-criu.sh's, at /usr/local/sbin/criu.
#
# Nothing global is configured: no /etc/containers or /etc/containerd file is written or changed.
# gpusnap passes what it needs on each call (daemon/containers/, docs/containers.md): the OCI
# runtime (runc), the cgroup manager, CRIU first on PATH; the tests add their own storage roots,
# ulimits and --network none. containerd's package does not start a daemon here (no systemd as
# PID 1); the tests start their own with their own root, state dir and socket. debootstrap is
# for the tests' image (tests/containers/image.py builds it from Debian packages, no registry).
#
# Idempotent: when every binary is there and new enough it only checks and exits.
set -euo pipefail

log() { echo "install-containers: $*" >&2; }
die() {
  log "error: $*"
  exit 1
}

# MAJOR.MINOR[.PATCH] from a version line, or nothing.
version_of() {
  "$@" 2>/dev/null | sed -n 's/[^0-9]*\([0-9][0-9]*\.[0-9][0-9]*\(\.[0-9][0-9]*\)\{0,1\}\).*/\1/p' | head -n1
}

# True when version $1 >= $2 (dotted numbers).
at_least() {
  [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]
}

# True when binary $1 is on PATH and the version printed by the command after $2 is >= $2.
check() {
  local bin=$1 min=$2 ver
  shift 2
  command -v "$bin" >/dev/null 2>&1 || return 1
  ver=$(version_of "$@")
  [ -n "$ver" ] && at_least "$ver" "$min"
}

all_there() {
  check podman 4.0 podman --version \
    && check runc 1.1 runc --version \
    && check containerd 1.6 containerd --version \
    && check ctr 1.6 ctr --version \
    && command -v conmon >/dev/null 2>&1 \
    && command -v debootstrap >/dev/null 2>&1
}

if ! all_there; then
  [ "$(id -u)" -eq 0 ] || die "run as root to install podman, runc and containerd"
  command -v apt-get >/dev/null || die "needs apt-get (Debian 12 or 13)"
  log "installing podman runc containerd debootstrap (no recommends)"
  apt-get update -qq -o DPkg::Lock::Timeout=600
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 \
    --no-install-recommends podman runc containerd conmon debootstrap >/dev/null
  all_there || die "podman >= 4.0, runc >= 1.1, containerd >= 1.6 still missing after apt-get"
fi

# The runtimes find CRIU on PATH; gpusnap puts /usr/local/sbin first for them, and that CRIU
# must be the 4.x one. A Debian criu package (3.17) elsewhere on PATH is harmless but noted.
criu=$(command -v criu || true)
[ -n "$criu" ] || log "warning: no criu on PATH; run scripts/install-criu.sh"
if [ -x /usr/sbin/criu ] && [ "$criu" != /usr/sbin/criu ]; then
  log "note: /usr/sbin/criu ($(version_of /usr/sbin/criu --version)) is shadowed by $criu"
fi
log "podman $(version_of podman --version), runc $(version_of runc --version)," \
  "containerd $(version_of containerd --version), criu $(version_of "${criu:-criu}" --version)"
