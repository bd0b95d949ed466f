#!/usr/bin/env bash
# The demo (README's first command): set everything up on a fresh machine, then checkpoint a
# small numpy language model mid-generation, kill it, restore it and show that its tokens are
# identical to an uninterrupted run. Options go to demo/run_demo.py (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python demo/run_demo.py "$@"
