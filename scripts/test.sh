#!/usr/bin/env bash
# The whole test suite: lint, format check, strict type check, then pytest.
# Sets up what it needs first (scripts/bootstrap.sh), so it runs on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PATH="$(pwd)/.venv/bin:$PATH"
echo "== ruff"
ruff check .
ruff format --check .
echo "== mypy (strict)"
mypy -p gpusnap
echo "== pytest"
exec pytest -p no:cacheprovider "$@"
