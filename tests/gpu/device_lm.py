"""A tiny language model whose state lives in device memory: ``python device_lm.py OUT ...``.

Only cuda-bindings (no torch), so the same program runs on a real GPU and on the fake
``libcuda.so.1``. Each worker holds a weight shard (random bytes from a fixed seed) and a KV
pool in device memory; every step reads a slice of the weights picked by the last token and
the whole KV written so far back from the device, hashes them with the token into the next
token, and appends that step's KV entry to the pool on the device. The host keeps only the
step and the last token, so a restore that lost or changed any of that device memory writes
other tokens than an uninterrupted run.

- ``--tp 1`` (default): one process, the model on GPU 0.
- ``--tp N``: a parent that never loads CUDA runs N workers (``--worker I``, each on GPU I,
  talking to the parent over pipes) and combines their hashes: a tensor-parallel tree.
  ``--engine-core`` adds a child that ran cuInit and holds no context (a serving engine's
  coordinator); ``--nccl LIB`` makes each worker map LIB (as NCCL would be mapped).

OUT gets one ``%08d %05d`` line per step (step, token) and ``done``; like tests/support/
workloads.py it keeps its own idea of the file's length, so a process restored from an older
checkpoint rewrites what the original wrote after it. Run as a script, never imported.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import itertools
import os
import random
import subprocess
import sys
import time
from typing import Any

VOCAB = 50_000
ENTRY = 64  # bytes of KV per step
SLICE = 4096  # bytes of weights a step reads
MIB = 2**20


class Out:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        self.length = 0
        os.ftruncate(self.fd, 0)

    def write(self, data: bytes) -> None:
        os.ftruncate(self.fd, self.length)
        os.pwrite(self.fd, data, self.length)
        self.length += len(data)


class Shard:
    """One worker's model state on GPU ``ordinal``: weights and a KV pool, on the device."""

    def __init__(self, ordinal: int, rank: int, weights_mib: float, kv_mib: float) -> None:
        from cuda.bindings import driver as cu  # noqa: PLC0415 - only workers load CUDA

        self.cu = cu
        self._ok(cu.cuInit(0))
        self.ctx = self._ok(cu.cuDevicePrimaryCtxRetain(self._ok(cu.cuDeviceGet(ordinal))))
        self._ok(cu.cuCtxSetCurrent(self.ctx))
        self.wbytes = int(weights_mib * MIB)
        self.kvbytes = int(kv_mib * MIB)
        self.weights = int(self._ok(cu.cuMemAlloc(self.wbytes)))
        self.kv = int(self._ok(cu.cuMemAlloc(self.kvbytes)))
        data = random.Random(f"device-lm-{rank}").randbytes(self.wbytes)
        self._ok(cu.cuMemcpyHtoD(self.weights, data, self.wbytes))
        self._ok(cu.cuMemsetD8(self.kv, 0, self.kvbytes))

    def _ok(self, result: Any) -> Any:
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA call failed: {self.cu.CUresult(err).name}")
        return values[0] if len(values) == 1 else tuple(values) if values else None

    def step(self, step: int, token: int) -> bytes:
        """This shard's hash for ``step`` given the last ``token``; appends its KV entry."""
        cu = self.cu
        self._ok(cu.cuCtxSetCurrent(self.ctx))
        at = (token * SLICE) % (self.wbytes - SLICE)
        w = bytearray(SLICE)
        self._ok(cu.cuMemcpyDtoH(w, self.weights + at, SLICE))
        used = min(step - 1, self.kvbytes // ENTRY) * ENTRY
        kv = bytearray(used)
        if used:
            self._ok(cu.cuMemcpyDtoH(kv, self.kv, used))
        h = hashlib.sha256(bytes(w) + bytes(kv) + token.to_bytes(4, "little")).digest()
        if used + ENTRY <= self.kvbytes:
            entry = h + hashlib.sha256(h).digest()
            self._ok(cu.cuMemcpyHtoD(self.kv + used, entry, ENTRY))
        return h


def next_token(parts: list[bytes]) -> int:
    return int.from_bytes(hashlib.sha256(b"".join(parts)).digest()[:4], "little") % VOCAB


def worker(args: argparse.Namespace) -> int:
    """``--worker I``: a shard on GPU I answering the parent: 8-byte requests, 32-byte hashes."""
    if args.nccl:
        ctypes.CDLL(args.nccl)  # mapped as a worker maps NCCL
    shard = Shard(args.worker, args.worker, args.weights_mib, args.kv_mib)
    os.write(1, b"R")  # ready
    while True:
        msg = b""
        while len(msg) < 8:
            chunk = os.read(0, 8 - len(msg))
            if not chunk:
                return 0
            msg += chunk
        step, token = int.from_bytes(msg[:4], "little"), int.from_bytes(msg[4:], "little")
        out = shard.step(step, token)
        os.write(1, out)


def read_exact(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("a worker went away")
        data += chunk
    return data


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--steps", type=int, default=100, help="0: for ever")
    ap.add_argument("--interval", type=float, default=0.0)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--weights-mib", type=float, default=4.0)
    ap.add_argument("--kv-mib", type=float, default=1.0)
    ap.add_argument("--engine-core", action="store_true")
    ap.add_argument("--nccl")
    ap.add_argument("--worker", type=int)
    args = ap.parse_args()
    if args.worker is not None:
        return worker(args)
    out = Out(args.out)
    shards: list[Shard] = []
    workers: list[subprocess.Popen[bytes]] = []
    if args.tp == 1:
        if args.nccl:
            ctypes.CDLL(args.nccl)
        shards.append(Shard(0, 0, args.weights_mib, args.kv_mib))
    else:
        common = ["--weights-mib", str(args.weights_mib), "--kv-mib", str(args.kv_mib)]
        common += ["--nccl", args.nccl] if args.nccl else []
        for i in range(args.tp):
            cmd = [sys.executable, __file__, "--worker", str(i), *common]
            workers.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        for w in workers:
            assert w.stdout is not None
            read_exact(w.stdout.fileno(), 1)
    if args.engine_core:
        # cuInit and nothing else, then waits for its parent to go (the end of its stdin):
        # GetState says RUNNING, and there is nothing to lock.
        code = "import sys\nfrom cuda.bindings import driver as cu\ncu.cuInit(0)\nsys.stdin.read()"
        workers.append(subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE))
    token = 1
    for step in range(1, args.steps + 1) if args.steps > 0 else itertools.count(1):
        if shards:
            parts = [s.step(step, token) for s in shards]
        else:
            shard_workers = workers[: args.tp]
            request = step.to_bytes(4, "little") + token.to_bytes(4, "little")
            for w in shard_workers:
                assert w.stdin is not None
                os.write(w.stdin.fileno(), request)
            parts = []
            for w in shard_workers:
                assert w.stdout is not None
                parts.append(read_exact(w.stdout.fileno(), 32))
        token = next_token(parts)
        out.write(b"%08d %05d\n" % (step, token))
        if args.interval:
            time.sleep(args.interval)
    out.write(b"done\n")
    for w in workers:
        w.kill()
        w.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
