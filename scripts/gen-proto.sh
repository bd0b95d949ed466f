#!/usr/bin/env bash
# Regenerates the gRPC/protobuf Python code for proto/gpusnap/v1/*.proto, in place, and
# rewrites the generated imports so the modules import as gpusnap.proto.gpusnap.v1.*.
# The generated files are committed; run this after every .proto change, then commit both.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
# protoc finds the protoc-gen-mypy plugins on PATH; they live next to the interpreter.
export PATH="$(cd "$(dirname "$py")" && pwd):$PATH"
out=proto/gpusnap/v1
"$py" -m grpc_tools.protoc \
  -I proto \
  --python_out=proto \
  --grpc_python_out=proto \
  --mypy_out=proto \
  --mypy_grpc_out=proto \
  proto/gpusnap/v1/gpusnap.proto
# protoc writes `from gpusnap.v1 import gpusnap_pb2`; our package path is gpusnap.proto.gpusnap.v1.
sed -i -E 's/^from gpusnap\.v1 import /from gpusnap.proto.gpusnap.v1 import /' \
  "$out"/gpusnap_pb2_grpc.py "$out"/gpusnap_pb2.py "$out"/gpusnap_pb2.pyi "$out"/gpusnap_pb2_grpc.pyi
sed -i -E 's/^import gpusnap\.v1\.gpusnap_pb2\b/import gpusnap.proto.gpusnap.v1.gpusnap_pb2/' \
  "$out"/gpusnap_pb2.pyi "$out"/gpusnap_pb2_grpc.pyi
echo "gen-proto: regenerated $out" >&2
