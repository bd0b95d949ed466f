#!/usr/bin/env bash
# Fills .whl/ and .deb/ (repository root) with what tests/gpu/device-check.sh installs on a
# GPU machine that reaches no network: cp312 manylinux x86_64 wheels for gpusnap's
# dependencies that machine lacks (it has Python 3.12, PyTorch, cuda-bindings and grpcio),
# and Debian 13 (trixie) criu with libcompel1 and the libraries it needs.
# Run on a machine with network; needs pip and apt-get (no root: apt runs on a private state).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
mkdir -p .whl .deb

WHEELS=(zstandard blake3 pyfastcdc boto3 botocore s3transfer jmespath python-dateutil six urllib3
  cryptography cffi pycparser "protobuf>=5.26" pytest pluggy iniconfig packaging pytest-timeout)
"$PY" -m pip download --quiet --dest .whl --only-binary=:all: --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none "${WHEELS[@]}"
echo "prepare-carry: $(ls .whl | wc -l) wheels in .whl/"

# The same package closure as scripts/install-criu.sh (Debian 12 path).
PACKAGES=(criu libcompel1 libc6 libgcc-s1 gcc-14-base libbsd0 libmd0 libgnutls30t64 libgmp10
  libhogweed6t64 libnettle8t64 libidn2-0 libunistring5 libp11-kit0 libffi8 libtasn1-6 libnet1
  libnftables1 libjansson4 libmnl0 libnftnl11 libxtables12 libnl-3-200 libprotobuf-c1 libuuid1)
apt_dir=$(mktemp -d /tmp/gpusnap-apt.XXXXXX)
trap 'rm -rf "$apt_dir"' EXIT
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
  >"$apt_dir/sources.list"
APT=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
  -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o "APT::Architecture=amd64"
  -o "Debug::NoLocking=1")
apt-get "${APT[@]}" update -qq
(cd .deb && apt-get "${APT[@]}" download -qq "${PACKAGES[@]}")
echo "prepare-carry: $(ls .deb | wc -l) packages in .deb/"
echo "carry both on the device run: carry=[\".whl\", \".deb\"]"
