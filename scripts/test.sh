#!/usr/bin/env bash
# The whole test suite: lint, format check, type check (the package strict, the tests with
# untyped defs allowed but every body checked), the import contracts, then pytest.
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
echo "== mypy (tests: bodies checked, annotations optional)"
mypy tests
echo "== import contracts (pyproject.toml [tool.importlinter])"
# The checkout's own src/, whichever checkout the venv was installed from.
PYTHONPATH="$(pwd)/src${PYTHONPATH:+:$PYTHONPATH}" lint-imports --no-cache --no-logo
echo "== pytest"
# Two workers side by side; tests that share a fixed resource carry one xdist_group.
exec pytest -p no:cacheprovider -n 2 --dist loadgroup "$@"
