#!/usr/bin/env bash
# Fills .whl/ and .deb/ (repository root, both git-ignored) with what tests/gpu/device-check.sh
# installs on the lent GPU machine, which reaches no network. That machine (docs: the device
# tool's KINDS.md) has Python 3.12 with PyTorch, cuda-bindings, grpcio, protobuf, pytest and
# pytest-timeout, typing-extensions, numpy; x86-64, glibc >= 2.35. Carried:
#
#   .whl/*.whl          always installed (pip --no-index --no-deps --target): gpusnap's runtime
#                       imports that machine lacks (zstandard, blake3, pyfastcdc, cryptography
#                       with cffi and pycparser, jeepney), and the ones whose version we pin above
#                       whatever it has: protobuf (the generated gpusnap_pb2.py validates runtime
#                       >= 7.35.1), grpcio (gpusnap_pb2_grpc.py needs >= 1.85.1), cuda-bindings
#                       13.5 with cuda-pathfinder (the custom-storage names driver.py uses).
#   .whl/ifmissing/     installed only where the machine lacks that distribution: pytest and
#                       pytest-timeout with their needs (listed there, but not read off a machine).
#   .deb/*.deb          Debian unstable criu 4.2 and its library closure (Debian 13), from
#                       scripts/install-criu.sh --download-debs (its list; one place).
#
# Not carried: boto3/botocore/s3transfer/jmespath (imported only for s3:// stores; the GPU tests
# and a file:// daemon never import them), numpy and torch (there), typing-extensions (there).
# Versions are those of this repository's .venv (what the CPU suite runs), for cp312
# manylinux x86_64. Run on a machine with network; needs pip and apt-get, no root.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}

ALWAYS=(zstandard==0.25.0 blake3==1.0.11 pyfastcdc==0.3.1 cryptography==50.0.2 cffi==2.1.1
  pycparser==3.12 jeepney==0.9.0 protobuf==7.36.2 grpcio==1.85.3 cuda-bindings==13.5.0
  cuda-pathfinder==1.9.1)
IFMISSING=(pytest==9.2.0 pytest-timeout==2.4.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4
  pygments==2.21.0)

# pip matches each manylinux_2_N tag exactly; these are glibc <= 2.35 (the machine has more).
PLATFORMS=()
for p in manylinux1 manylinux2010 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_26 \
  manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  PLATFORMS+=(--platform "${p}_x86_64")
done
fetch() {
  local dest=$1
  shift
  mkdir -p "$dest"
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$dest" "${PLATFORMS[@]}" \
    --platform any --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    "$@"
}

rm -rf .whl .deb
fetch .whl "${ALWAYS[@]}"
fetch .whl/ifmissing "${IFMISSING[@]}"
echo "prepare-carry: $(ls .whl/*.whl | wc -l) wheels in .whl/, $(ls .whl/ifmissing/*.whl | wc -l) in .whl/ifmissing/"

# The set must install as a whole for cp312 (one version of each distribution, tags that fit)
# and every requirement must be carried or already on that machine.
"$PY" - .whl .whl/ifmissing <<'PY'
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

# On that machine already (KINDS.md's package list); pyfastcdc and grpcio need the first.
THERE = {"typing-extensions", "numpy", "torch"}
plats = ["manylinux_2_35_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(34, 4, -1)),
         "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
ok_tags = set(cpython_tags((3, 12), platforms=plats)) | set(
    compatible_tags((3, 12), "cp312", platforms=plats))
env = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.3",
                               "implementation_name": "cpython", "sys_platform": "linux",
                               "platform_machine": "x86_64", "platform_python_implementation": "CPython"}
carried: dict[str, tuple[str, Path]] = {}
errors: list[str] = []
for folder in sys.argv[1:]:
    for whl in sorted(Path(folder).glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(whl.name)
        if name in carried:
            errors.append(f"two versions of {name}: {carried[name][1].name}, {whl.name}")
        carried[name] = (str(version), whl)
        if not tags & ok_tags:
            errors.append(f"{whl.name}: no tag for cp312 manylinux x86_64")
for name, (_, whl) in carried.items():
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    for line in msg.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker and not req.marker.evaluate(env | {"extra": ""}):
            continue
        dep = canonicalize_name(req.name)
        if dep in carried:
            if not req.specifier.contains(carried[dep][0], prereleases=True):
                errors.append(f"{name} needs {req}, carried {dep} {carried[dep][0]}")
        elif dep not in THERE:
            errors.append(f"{name} needs {req}: neither carried nor on that machine")
for e in errors:
    print(f"prepare-carry: ERROR {e}")
if errors:
    sys.exit(1)
print(f"prepare-carry: {len(carried)} wheels checked: one version each, cp312 tags, requirements met")
PY

bash scripts/install-criu.sh --download-debs .deb
echo "prepare-carry: $(ls .deb/*.deb | wc -l) packages in .deb/"

# What travels: tracked and untracked-not-ignored files plus the carried folders (limit 64 MiB).
tree_bytes=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null \
  | awk '{s += $1} END {print s + 0}')
carried_bytes=$(du -sb .whl .deb | awk '{s += $1} END {print s}')
awk -v t="$tree_bytes" -v c="$carried_bytes" 'BEGIN {
  printf "prepare-carry: working tree %.1f MiB + .whl/.deb %.1f MiB = %.1f MiB (device limit 64 MiB)\n",
    t / 2^20, c / 2^20, (t + c) / 2^20 }'
echo 'prepare-carry: carry both on the device run: carry=[".whl", ".deb"]'
