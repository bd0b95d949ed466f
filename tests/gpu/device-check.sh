#!/usr/bin/env bash
# Every GPU check in one command, on a bare GPU machine that reaches no network.
#
#   tests/gpu/device-check.sh            (from the repository root, as root)
#
# Installs what the machine lacks from carried files (tests/gpu/prepare-carry.sh fills them on
# a machine with network), never from a network, and nothing into /:
#   .whl/*.whl            pip --no-index --no-deps --target $WORK/site (always)
#   .whl/ifmissing/*.whl  the same, each only where the machine lacks that distribution (pytest)
#   .deb/*.deb            scripts/install-criu.sh --from-debs: Debian unstable criu in $WORK/criu
# then prints the machine (date, GPU, driver, kernel, versions) and the driver's capabilities as
# gpusnap's worker sees them, runs `pytest tests/gpu` (the coordinator with PyTorch workloads,
# the real gpusnapd with tests/gpu/device_lm.py), then `bench/gpu_bench.py --real` (the
# checkpoint paths' copy throughput against pinned cuMemcpy), and prints the figures. On a
# machine without a GPU every test skips, the bench is not run, and the script exits 0.
#
# Everything it prints goes to $OUT/device-check.log as well ($OUT: the device tool's folder
# that comes back; a temporary folder when unset), with $OUT/figures.jsonl, $OUT/capabilities.json
# and $OUT/logs.tar.gz (CRIU and workload logs of the run, CRIU images left out).
#
# Time: the whole script stops within GPUSNAP_DEVICE_BUDGET seconds (default 540, for a run
# with timeout_s=600): the bench gets at most GPUSNAP_DEVICE_BENCH_S (120 s) at the end, pytest
# what is left after setup less that and 20 s, each test at most GPUSNAP_DEVICE_TEST_TIMEOUT
# (120 s). GPUSNAP_DEVICE_BENCH_S=0 leaves the bench out (a rerun of some tests).
# GPUSNAP_DEVICE_PYTEST_ARGS adds pytest arguments (a rerun of some tests: "-k kill").
# GPUSNAP_DEVICE_WHEELS=skip uses the interpreter's own packages (a dry run on another Python).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
BUDGET=${GPUSNAP_DEVICE_BUDGET:-540}
TEST_TIMEOUT=${GPUSNAP_DEVICE_TEST_TIMEOUT:-120}
BENCH_S=${GPUSNAP_DEVICE_BENCH_S:-120}
WORK=${GPUSNAP_DEVICE_WORK:-/tmp/gpusnap-device}
OUT_DIR=${OUT:-$WORK-out}
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT_DIR" || exit 1

say() { echo "device-check: $*"; }

# The package imports through src/gpusnap/<package> -> ../../<package> links; a copy of the tree
# that dropped links (an archive, a file sync) has none: make them again.
relink() {
  local pkg
  for pkg in cli daemon proto storage; do
    if [ ! -e "src/gpusnap/$pkg" ] && [ -d "$pkg" ]; then
      ln -sfn "../../$pkg" "src/gpusnap/$pkg" && say "relinked src/gpusnap/$pkg -> ../../$pkg"
    fi
  done
}
elapsed() { echo $((SECONDS - START)); }

machine() {
  say "=== gpusnap device check, $(date -u +%Y-%m-%dT%H:%M:%SZ) ==="
  say "host $(hostname 2>/dev/null || echo '?'), kernel $(uname -r) $(uname -m)$([ "$(uname -r)" = 4.4.0 ] && echo ' (gVisor)')"
  say "tree: git $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' + uncommitted changes')"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,uuid --format=csv,noheader \
      | sed 's/^/device-check: gpu: /'
  else
    say "gpu: no nvidia-smi"
  fi
  [ -r /proc/driver/nvidia/version ] && say "driver: $(head -n1 /proc/driver/nvidia/version)"
  say "python: $("$PY" --version 2>&1) at $(command -v "$PY")"
  # The machine's own versions, before anything carried shadows them (to trim the carry).
  "$PY" - <<'PY' 2>&1 | sed 's/^/device-check: /'
import importlib.metadata as m
names = ["torch", "cuda-bindings", "cuda-pathfinder", "grpcio", "protobuf", "pytest",
         "pytest-timeout", "typing-extensions", "numpy", "cryptography", "zstandard"]
have = []
for n in names:
    try:
        have.append(f"{n} {m.version(n)}")
    except m.PackageNotFoundError:
        have.append(f"{n} -")
print("machine's packages: " + ", ".join(have))
PY
}

install_wheels() {
  SITE=$WORK/site
  if [ "${GPUSNAP_DEVICE_WHEELS:-install}" = skip ]; then
    say "wheels: not installed (GPUSNAP_DEVICE_WHEELS=skip): using $PY's own packages"
    return 0
  fi
  compgen -G ".whl/*.whl" >/dev/null || {
    say "wheels: none carried in .whl/ (run tests/gpu/prepare-carry.sh and carry .whl)"
    return 0
  }
  local wheels=(.whl/*.whl) w dist
  for w in .whl/ifmissing/*.whl; do
    [ -e "$w" ] || continue
    dist=$(basename "$w")
    dist=${dist%%-*}
    "$PY" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" 2>/dev/null \
      || wheels+=("$w")
  done
  say "wheels: installing ${#wheels[@]} into $SITE: $(for w in "${wheels[@]}"; do basename "$w" | cut -d- -f1-2; done | tr '\n' ' ')"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --disable-pip-version-check --target "$SITE" "${wheels[@]}" \
    || { say "FAILED: pip install of the carried wheels"; return 1; }
}

install_criu() {
  if ! compgen -G ".deb/*.deb" >/dev/null; then
    say "criu: no .deb/ carried; trying this machine's own"
  else
    GPUSNAP_CRIU_PREFIX=$WORK/criu GPUSNAP_CRIU_WRAPPER=$WORK/criu-wrapper \
      timeout 120 bash scripts/install-criu.sh --from-debs .deb 2>&1 | sed 's/^/device-check: /'
  fi
  if [ -x "$WORK/criu-wrapper" ]; then
    export GPUSNAP_CRIU=$WORK/criu-wrapper
  elif command -v criu >/dev/null; then
    export GPUSNAP_CRIU
    GPUSNAP_CRIU=$(command -v criu)
  else
    say "criu: none: the kill-and-restore tests will skip"
    return 0
  fi
  say "criu: $GPUSNAP_CRIU, $("$GPUSNAP_CRIU" --version 2>&1 | head -n1)"
  say "criu check (full output):"
  timeout 60 "$GPUSNAP_CRIU" check 2>&1 | sed 's/^/device-check:   /'
  [ -d /usr/lib/criu ] && say "criu plugins on this machine (/usr/lib/criu): $(ls /usr/lib/criu | tr '\n' ' ')"
  return 0
}

capabilities() {
  # The real driver through gpusnap's own worker: what the tests will find.
  timeout 90 "$PY" - "$OUT_DIR/capabilities.json" <<'PY' 2>&1 | sed 's/^/device-check: /'
import json, sys
from gpusnap.daemon.gpu import GpuCoordinator
c = GpuCoordinator.create(call_timeout_s=60.0)
try:
    caps = c.capabilities()
finally:
    c.close()
with open(sys.argv[1], "w") as f:
    json.dump(caps, f, indent=1, default=str)
devices = caps.pop("devices", [])
print("capabilities: " + json.dumps(caps, default=str))
for d in devices:
    print("capabilities: device " + json.dumps(d, default=str))
PY
}

bench() {
  say "=== bench/gpu_bench.py --real (at most ${BENCH_S} s) ==="
  if ! command -v nvidia-smi >/dev/null; then
    say "bench: not run (no GPU)"
    return 0
  fi
  if [ "$BENCH_S" -le 0 ]; then
    say "bench: not run (GPUSNAP_DEVICE_BENCH_S=$BENCH_S)"
    return 0
  fi
  # 4 GiB of device memory, one round: the custom-storage and host-staged paths against pinned
  # cuMemcpy of the same bytes, in this run (custom storage only where the driver has it).
  timeout -k 10 "$BENCH_S" "$PY" bench/gpu_bench.py --real --size-mib 4096 --rounds 1 \
    --json-out "$OUT_DIR/gpu_bench.json" 2>&1 | sed 's/^/device-check: bench: /'
  local status=${PIPESTATUS[0]}
  [ "$status" -eq 0 ] || say "bench FAILED or STOPPED (status $status)"
}

print_figures() {
  say "=== figures ($GPUSNAP_FIGURES) ==="
  if [ ! -s "$GPUSNAP_FIGURES" ]; then
    say "(none: no GPU test got that far)"
    return
  fi
  "$PY" - "$GPUSNAP_FIGURES" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    fig = json.loads(line)
    name = fig.pop("figure")
    vals = ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in fig.items())
    print(f"device-check: FIGURE {name}: {vals}")
PY
}

main() {
  START=$SECONDS
  machine

  say "=== setup ==="
  relink
  install_wheels || return 1
  export PYTHONPATH=$ROOT/src:${SITE:-$WORK/site}:$ROOT${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
  "$PY" - <<'PY' 2>&1 | sed 's/^/device-check: /'
import importlib.metadata as m
import gpusnap, gpusnap.storage, gpusnap.daemon.host.criu, gpusnap.daemon.gpu, pytest, pytest_timeout
names = ["zstandard", "blake3", "pyfastcdc", "cryptography", "cffi", "protobuf", "grpcio",
         "cuda-bindings", "jeepney", "pytest", "pytest-timeout"]
print("imports ok: gpusnap from " + gpusnap.__path__[0] + "; "
      + ", ".join(f"{n} {m.version(n)}" for n in names))
PY
  [ "${PIPESTATUS[0]}" -eq 0 ] || { say "FAILED: gpusnap or pytest not importable"; return 1; }
  "$PY" -c "import gpusnap.daemon.main, gpusnap.cli.main" 2>&1 | tail -n1 | sed 's/^/device-check: daemon import: /'
  [ "${PIPESTATUS[0]}" -eq 0 ] && say "daemon and cli import ok (gRPC, protobuf gencode)"
  install_criu
  capabilities
  say "setup took $(elapsed) s"

  say "=== pytest tests/gpu ==="
  export GPUSNAP_FIGURES=$OUT_DIR/figures.jsonl
  : >"$GPUSNAP_FIGURES"
  local left=$((BUDGET - $(elapsed) - BENCH_S - 20)) rc
  [ "$left" -ge 30 ] || left=30
  say "pytest budget ${left} s, ${TEST_TIMEOUT} s a test"
  # Only pytest-timeout as a plugin: none of the machine's others (xdist, cov, benchmark, ...).
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout -k 10 "$left" "$PY" -m pytest tests/gpu -v -s \
    -p pytest_timeout -p no:cacheprovider --basetemp="$WORK/pytest" --timeout="$TEST_TIMEOUT" \
    -o addopts="-ra --strict-markers" \
    -W "ignore::DeprecationWarning" -W "ignore::UserWarning" ${GPUSNAP_DEVICE_PYTEST_ARGS:-} 2>&1
  rc=$?
  [ "$rc" -eq 124 ] && say "pytest STOPPED at the ${left} s budget"

  bench

  print_figures
  if [ -d "$WORK/pytest" ]; then
    (cd "$WORK/pytest" && find . -name '*.log' -size -20M -print0 \
      | tar --null -czf "$OUT_DIR/logs.tar.gz" -T - 2>/dev/null)
    # The device tool brings back files of at most 16 MiB.
    if [ "$(stat -c %s "$OUT_DIR/logs.tar.gz" 2>/dev/null || echo 0)" -gt $((15 * 2 ** 20)) ]; then
      say "logs.tar.gz over 15 MiB: left out"
      rm -f "$OUT_DIR/logs.tar.gz"
    fi
  fi
  say "=== done: pytest exit status $rc after $(elapsed) s; files in $OUT_DIR: $(ls "$OUT_DIR" | tr '\n' ' ') ==="
  return "$rc"
}

main 2>&1 | tee "$OUT_DIR/device-check.log"
exit "${PIPESTATUS[0]}"
