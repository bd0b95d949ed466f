#!/usr/bin/env bash
# Every GPU check in one command, on a bare GPU machine that reaches no network.
#
#   tests/gpu/device-check.sh            (from the repository root, as root)
#
# Installs what the machine lacks from carried files, never from a network:
#   .whl/*.whl  Python wheels (cp312 manylinux x86_64), pip --no-index --target .deps
#   .deb/*.deb  Debian 13 criu, libcompel1 and their libraries, dpkg -x into a private prefix
# (tests/gpu/prepare-carry.sh fills both on a machine with network.) Then runs tests/gpu and
# prints the figures. On a machine without a GPU every test skips and the script exits 0.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-$(mktemp -d /tmp/gpusnap-device.XXXXXX)}
mkdir -p "$OUT_DIR"
say() { echo "device-check: $*"; }

say "python: $("$PY" --version 2>&1) at $(command -v "$PY")"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader
[ -r /proc/driver/nvidia/version ] && head -n1 /proc/driver/nvidia/version

# -- Python dependencies from carried wheels --------------------------------------------------
DEPS=$ROOT/.deps
if compgen -G ".whl/*.whl" >/dev/null; then
  say "installing $(ls .whl/*.whl | wc -l) carried wheels into $DEPS"
  "$PY" -m pip install --quiet --no-index --find-links .whl --target "$DEPS" --upgrade \
    .whl/*.whl || { say "pip install from .whl failed"; exit 1; }
fi
export PYTHONPATH=$ROOT/src:$DEPS:$ROOT${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import pytest, gpusnap.daemon.gpu" || { say "pytest or gpusnap not importable"; exit 1; }

# -- CRIU >= 4 from carried .deb files --------------------------------------------------------
if compgen -G ".deb/*.deb" >/dev/null; then
  PREFIX=${GPUSNAP_CRIU_PREFIX:-/tmp/gpusnap-criu}
  rm -rf "$PREFIX" && mkdir -p "$PREFIX"
  for deb in .deb/*.deb; do dpkg -x "$deb" "$PREFIX"; done
  L=$PREFIX/usr/lib/x86_64-linux-gnu
  cat >"$PREFIX/criu" <<WRAP
#!/bin/sh
exec "$L/ld-linux-x86-64.so.2" --library-path "$L" --argv0 criu "$PREFIX/usr/sbin/criu" "\$@"
WRAP
  chmod 755 "$PREFIX/criu"
  export GPUSNAP_CRIU=$PREFIX/criu
  say "criu: $("$GPUSNAP_CRIU" --version 2>&1 | head -n1); check: $("$GPUSNAP_CRIU" check 2>&1 | tail -n1)"
elif command -v criu >/dev/null; then
  say "criu: system $(criu --version 2>&1 | head -n1)"
else
  say "no CRIU carried or installed: the kill-and-restore tests will skip"
fi

# -- the checks ---------------------------------------------------------------------------------
export GPUSNAP_FIGURES=$OUT_DIR/figures.jsonl
: >"$GPUSNAP_FIGURES"
timeout "${GPUSNAP_DEVICE_TIMEOUT:-540}" "$PY" -m pytest tests/gpu -v -s -p no:cacheprovider \
  -W "ignore::DeprecationWarning" -W "ignore::UserWarning" -o addopts="-ra --strict-markers" \
  2>&1 | tee "$OUT_DIR/pytest.log"
rc=${PIPESTATUS[0]}

say "figures:"
if [ -s "$GPUSNAP_FIGURES" ]; then cat "$GPUSNAP_FIGURES"; else say "(none: no GPU test ran)"; fi
say "pytest exit status $rc; log and figures in $OUT_DIR"
exit "$rc"
