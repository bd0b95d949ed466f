#!/usr/bin/env bash
# Installs everything gpusnap and its tests need on a fresh Debian 12/13 machine (as root):
# system packages (gcc and make build the tests' fake libcuda.so.1), CRIU >= 4
# (scripts/install-criu.sh), and a virtualenv in .venv with the package installed editable plus
# its dev tools. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

need_apt=()
for bin in zstd systemd-analyze ip dbus-daemon gcc make; do
  command -v "$bin" >/dev/null 2>&1 || need_apt+=("$bin")
done
if ((${#need_apt[@]})); then
  pkgs=()
  for b in "${need_apt[@]}"; do
    case "$b" in
      zstd) pkgs+=(zstd) ;;
      systemd-analyze) pkgs+=(systemd) ;;
      ip) pkgs+=(iproute2) ;;
      dbus-daemon) pkgs+=(dbus) ;;
      gcc) pkgs+=(gcc) ;;
      make) pkgs+=(make) ;;
    esac
  done
  echo "bootstrap: installing ${pkgs[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" >/dev/null
fi

# The systemd tests (tests/systemd/test_nspawn.py) boot a Debian rootfs, built by debootstrap,
# with systemd-nspawn. systemd-container at the installed systemd's version where the archive
# still has it, so that installing it never upgrades systemd itself as a side effect.
nspawn_pkgs=()
command -v debootstrap >/dev/null 2>&1 || nspawn_pkgs+=(debootstrap)
command -v systemd-nspawn >/dev/null 2>&1 || nspawn_pkgs+=(systemd-container)
if ((${#nspawn_pkgs[@]})); then
  echo "bootstrap: installing ${nspawn_pkgs[*]}" >&2
  apt-get update -qq
  pinned=("${nspawn_pkgs[@]/#systemd-container/systemd-container=$(dpkg-query -W -f='${Version}' systemd 2>/dev/null)}")
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pinned[@]}" >/dev/null 2>&1 \
    || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${nspawn_pkgs[@]}" >/dev/null
fi

bash scripts/install-criu.sh
bash scripts/install-containers.sh

py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=.venv/.gpusnap-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "bootstrap: installing Python packages into .venv" >&2
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -m pip install -q -e "$root[dev]" 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -c "import gpusnap.storage, grpc, zstandard, boto3, moto" >/dev/null
  touch "$stamp"
fi

# vLLM's CPU build in a venv of its own, for tests/engines/vllm (a few minutes and ~2.5 GB the
# first time; a second run only checks its stamp).
bash scripts/install-vllm.sh
