"""A process holding N MiB of mixed data, like a serving process: bf16-like weights, a mostly
zero KV cache, and random (incompressible) state. Writes ``ready`` once filled, then sleeps.

    python tests/e2e/memory_holder.py --mib 2048 --ready /tmp/ready

or ``start(mib, ready)`` from Python. Used by the end-to-end tests (a checkpoint that takes a
while) and the benchmarks (bench/e2e_bench.py, bench/reclaim_bench.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import numpy as np


def fill(mib: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    third = mib * 1024 * 1024 // 3
    # bf16-like: the upper halves of normal float32s (exponents repeat, mantissas do not)
    weights = (rng.standard_normal(third // 2, dtype=np.float32).view(np.uint32) >> 16).astype(
        np.uint16
    )
    kv = np.zeros(third, dtype=np.uint8)  # a KV cache mostly not yet written
    used = third // 20
    kv[:used] = rng.integers(0, 256, used, dtype=np.uint8)
    noise = rng.integers(0, 256, mib * 1024 * 1024 - 2 * third, dtype=np.uint8)
    return [weights, kv, noise]


def start(
    mib: int, ready: Path, *, stderr: int | IO[bytes] = subprocess.DEVNULL, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """This script in a new process (and session) filling ``mib`` MiB; it writes ``ready``
    once full. Returns at once; stdout goes nowhere, stderr to ``stderr``."""
    return subprocess.Popen(
        [sys.executable, __file__, "--mib", str(mib), "--ready", str(ready)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=True,
        cwd=cwd,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=2048)
    p.add_argument("--ready", required=True)
    args = p.parse_args()
    held = fill(args.mib)
    with open(args.ready, "w") as f:
        f.write(f"{sum(a.nbytes for a in held)}\n")
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
