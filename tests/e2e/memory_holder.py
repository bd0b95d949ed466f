"""A process holding N MiB of mixed data, like a serving process: bf16-like weights, a mostly
zero KV cache, and random (incompressible) state. Writes ``ready`` once filled, then sleeps.

    python tests/e2e/memory_holder.py --mib 2048 --ready /tmp/ready

or ``start(mib, ready)`` from Python.

On SIGUSR1 it overwrites ``--change`` (a fraction, default 0.05) of its memory (its resident
anonymous memory, what a checkpoint of it holds), in one contiguous run of its random state,
with new random bytes, and writes ``<ready>.changed``
(how many times so far); on SIGUSR2 it writes ``<ready>.digest``, the BLAKE2b of everything
it holds (the same after a faithful restore). Both files are written whole, then renamed.

Used by the end-to-end tests (a checkpoint that takes a while; a standby that prefetched)
and bench/e2e_bench.py, bench/reclaim_bench.py, bench/standby_bench.py.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
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


def _resident_anonymous() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=2048)
    p.add_argument("--ready", required=True)
    p.add_argument("--change", type=float, default=0.05)
    args = p.parse_args()
    held = fill(args.mib)
    changes = 0

    def change(signum: int, frame: FrameType | None) -> None:
        nonlocal changes
        noise = held[2]
        n = min(noise.size, int(args.change * _resident_anonymous()))
        start = (noise.size - n) // 2
        rng = np.random.default_rng(1000 + changes)
        noise[start : start + n] = rng.integers(0, 256, n, dtype=np.uint8)
        changes += 1
        _write(f"{args.ready}.changed", f"{changes}\n")

    def digest(signum: int, frame: FrameType | None) -> None:
        h = hashlib.blake2b()
        for a in held:
            h.update(a.data)
        _write(f"{args.ready}.digest", h.hexdigest() + "\n")

    signal.signal(signal.SIGUSR1, change)
    signal.signal(signal.SIGUSR2, digest)
    with open(args.ready, "w") as f:
        f.write(f"{sum(a.nbytes for a in held)}\n")
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
