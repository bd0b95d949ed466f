"""A CUDA process for the fake driver's tests: ``python target.py WORKDIR SPEC``.

SPEC is JSON: ``{"allocs": [[ordinal, bytes], ...], "seed": N, "contexts": [ordinal, ...]}``.
It runs cuInit, retains the primary contexts, allocates, fills each allocation with bytes
derived from the seed, writes ``ready.json`` and then answers commands: it polls WORKDIR for
``cmd-N.json`` and writes ``res-N.json`` (files only, so CRIU can dump and restore it with
its test far away). Run as a script, never imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from cuda.bindings import driver as cu


# Kept in each script (not imported from tests.fakes): a hook or a CRIU-restored process
# runs the script by its path, where the tests package is not importable.
class CudaError(Exception):
    """A driver call failed; the message is the CUresult's name (``CUDA_ERROR_...``)."""


def check(result: Any) -> Any:
    """The value(s) of a successful call: None, one value, or a tuple of them."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(cu.CUresult(err).name)
    return values[0] if len(values) == 1 else tuple(values) if values else None


BLOCK = 64 * 2**20  # randbytes cannot make much more at once


def content(seed: int, index: int, size: int) -> bytes:
    if size <= BLOCK:
        return random.Random(f"{seed}-{index}").randbytes(size)
    blocks = (size + BLOCK - 1) // BLOCK
    made = b"".join(random.Random(f"{seed}-{index}-{k}").randbytes(BLOCK) for k in range(blocks))
    return made[:size]


class Target:
    def __init__(self, spec: dict[str, Any]) -> None:
        check(cu.cuInit(0))
        self.seed = int(spec["seed"])
        allocs = [(int(o), int(n)) for o, n in spec["allocs"]]
        wanted = spec.get("contexts")
        ordinals = sorted({o for o, _ in allocs}) if wanted is None else [int(o) for o in wanted]
        self.ctx = {
            o: check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(o)))) for o in ordinals
        }
        self.allocs: list[tuple[int, int, int]] = []  # (ordinal, pointer, size)
        for i, (o, n) in enumerate(allocs):
            check(cu.cuCtxSetCurrent(self.ctx[o]))
            ptr = int(check(cu.cuMemAlloc(n)))
            check(cu.cuMemcpyHtoD(ptr, content(self.seed, i, n), n))
            self.allocs.append((o, ptr, n))
        self.streams: dict[int, Any] = {}
        self.keep: list[bytes] = []  # host buffers of async copies still in flight

    def uuid(self, ordinal: int) -> str:
        raw = bytes(check(cu.cuDeviceGetUuid(check(cu.cuDeviceGet(ordinal)))).bytes)
        h = raw.hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def digest(self) -> dict[str, Any]:
        """sha256 of each allocation as it reads now, and whether it is what was written."""
        out = []
        for i, (o, ptr, n) in enumerate(self.allocs):
            check(cu.cuCtxSetCurrent(self.ctx[o]))
            buf = bytearray(n)
            check(cu.cuMemcpyDtoH(buf, ptr, n))
            out.append(
                {
                    "ordinal": o,
                    "sha256": hashlib.sha256(buf).hexdigest(),
                    "intact": bytes(buf) == content(self.seed, i, n),
                    "uuid": self.uuid(o),
                }
            )
        return {"allocs": out}

    def async_copy(self, ordinal: int, size: int) -> None:
        """Enqueue a host-to-device copy of ``size`` bytes on a stream and return at once."""
        check(cu.cuCtxSetCurrent(self.ctx[ordinal]))
        stream = self.streams.get(ordinal)
        if stream is None:
            stream = self.streams[ordinal] = check(cu.cuStreamCreate(0))
        ptr = int(check(cu.cuMemAlloc(size)))
        data = bytes(size)
        self.keep.append(data)
        check(cu.cuMemcpyHtoDAsync(ptr, data, size, stream))

    def mem_info(self, ordinal: int) -> dict[str, int]:
        check(cu.cuCtxSetCurrent(self.ctx[ordinal]))
        free, total = check(cu.cuMemGetInfo())
        return {"free": int(free), "total": int(total)}

    def run(self, command: list[Any]) -> Any:
        name, *args = command
        if name == "digest":
            return self.digest()
        if name == "async_copy":
            return self.async_copy(int(args[0]), int(args[1]))
        if name == "synchronize":
            for o in self.ctx:
                check(cu.cuCtxSetCurrent(self.ctx[o]))
                check(cu.cuCtxSynchronize())
            return None
        if name == "mem_info":
            return self.mem_info(int(args[0]))
        if name == "uuids":
            return {str(o): self.uuid(o) for o in self.ctx}
        if name == "fork":
            child = os.fork()
            if child == 0:  # a fork child holds no CUDA state of its own; it just waits
                while True:
                    time.sleep(1)
            return child
        raise ValueError(f"unknown command {name!r}")


def main() -> int:
    workdir = Path(sys.argv[1])
    target = Target(json.loads(sys.argv[2]))
    info = {"pid": os.getpid(), "pointers": [p for _, p, _ in target.allocs]}
    (workdir / "ready.tmp").write_text(json.dumps(info))
    (workdir / "ready.tmp").rename(workdir / "ready.json")
    seq = 0
    while True:
        cmd = workdir / f"cmd-{seq + 1}.json"
        if not cmd.exists():
            time.sleep(0.01)
            continue
        seq += 1
        try:
            res: dict[str, Any] = {"ok": target.run(json.loads(cmd.read_text()))}
        except CudaError as exc:
            res = {"error": str(exc)}
        tmp = workdir / f"res-{seq}.tmp"
        tmp.write_text(json.dumps(res))
        tmp.rename(workdir / f"res-{seq}.json")


if __name__ == "__main__":
    sys.exit(main())
