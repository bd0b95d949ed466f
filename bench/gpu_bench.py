"""GPU bench: device-memory copy throughput of gpusnap's checkpoint paths against a plain
page-locked ``cuMemcpy`` of the same bytes, measured in the same run (ratios).

    .venv/bin/python bench/gpu_bench.py                    # the fake libcuda, built here
    .venv/bin/python bench/gpu_bench.py --size-mib 1024 --copy-gbps 4 --json-out /tmp/g.json
    python bench/gpu_bench.py --real --size-mib 4096       # a GPU (tests/gpu/device-check.sh)

A CUDA process (``tests/fakes/libcuda/target.py``: cuda-bindings only, so it runs on either)
holds ``--size-mib`` of device memory. gpusnap's GPU layer (``GpuCoordinator``, its worker, the
real ``driver.py``) then freezes and thaws it:

- custom storage (CUDA 13.4 drivers, and the fake with ``custom_storage``): the worker copies
  the mapped device memory through the shared ring into a sink that only takes the buffers
  (the copy path alone, no store), and back on the thaw;
- host-staged: the driver's own ``cuCheckpointProcessCheckpoint`` / ``Restore``.

Baseline, in the same run, in a process of its own: ``cuMemcpyDtoH`` and ``cuMemcpyHtoD`` of
the same size between device memory and host memory page-locked with ``cuMemHostRegister``.
On the fake that is the fake's own copy rate (``copy_gbps``, a model: the ratios say what
gpusnap's path costs on top of the driver's copies, not what a GPU does); on a GPU it is
pinned PCIe bandwidth. Figures are decimal GB/s of device bytes. A table, then one JSON
object (``--json-out`` writes it too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.fakes.libcuda: the fake, its node, its CUDA processes

from gpusnap.daemon.gpu import GpuCoordinator  # noqa: E402
from gpusnap.daemon.gpu.custom_storage import CustomStorage  # noqa: E402
from tests.fakes import libcuda  # noqa: E402

MIB = 2**20

MEMCPY = r"""
import ctypes, json, mmap, sys, time
from cuda.bindings import driver as cu

def ok(r):
    err, *v = r if isinstance(r, tuple) else (r,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"memcpy baseline: {cu.CUresult(err).name}")
    return v[0] if len(v) == 1 else v

n = int(sys.argv[1])
ok(cu.cuInit(0))
ok(cu.cuCtxSetCurrent(ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))))
dev = int(ok(cu.cuMemAlloc(n)))
host = mmap.mmap(-1, n)
addr = ctypes.addressof(ctypes.c_char.from_buffer(host))
ok(cu.cuMemHostRegister(addr, n, cu.CU_MEMHOSTREGISTER_PORTABLE))
ok(cu.cuMemsetD8(dev, 7, n))
ok(cu.cuCtxSynchronize())
out = {}
for name, copy in (("d2h", lambda: cu.cuMemcpyDtoH(addr, dev, n)),
                   ("h2d", lambda: cu.cuMemcpyHtoD(dev, addr, n))):
    t = time.perf_counter()
    ok(copy())
    ok(cu.cuCtxSynchronize())
    out[name] = n / (time.perf_counter() - t) / 1e9
print(json.dumps(out))
"""


def _taken(memory: Any) -> None:
    """The sink: takes every buffer as the store's pipeline would, and keeps nothing (the
    copy path alone is measured, not a store)."""
    for m in memory:
        for view in m.buffers:
            _ = view.nbytes


def _zeros(size: int) -> Any:
    """The source of the thaw: zeros in ring-slot pieces (nothing was kept)."""

    def source(path: str) -> Any:
        piece = bytes(32 * MIB)
        for at in range(0, size, len(piece)):
            yield at, memoryview(piece)[: min(len(piece), size - at)]

    return source


def memcpy_baseline(env: dict[str, str], nbytes: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", MEMCPY, str(nbytes)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    result: dict[str, float] = json.loads(out)
    return result


def gpusnap_paths(
    env: dict[str, str], workdir: Path, nbytes: int, version_file: str
) -> dict[str, Any]:
    """Freeze and thaw a process holding ``nbytes``, with custom storage where offered."""
    os.environ.update({k: env[k] for k in ("LD_LIBRARY_PATH", libcuda.ROOT_ENV) if k in env})
    proc = libcuda.CudaProcess.start(workdir / "target", env, [(0, nbytes)], seed=3)
    coordinator = GpuCoordinator.create(
        call_timeout_s=300.0, copy_rate_gbps=0.1, nvidia_version_file=version_file
    )
    figures: dict[str, Any] = {}
    try:
        caps = coordinator.capabilities()
        figures["capabilities"] = {k: v for k, v in caps.items() if k != "devices"}
        if caps["custom_storage"]:
            storage = CustomStorage(_taken, _zeros(nbytes))
            freeze = coordinator.freeze([proc.pid], custom_storage=storage)
            figures["custom_storage_d2h"] = nbytes / freeze.checkpoint_seconds / 1e9
            t = time.perf_counter()
            coordinator.thaw(freeze)  # the memory is zeros from here on
            figures["custom_storage_h2d"] = nbytes / (time.perf_counter() - t) / 1e9
        before = proc.command("digest")
        freeze = coordinator.freeze([proc.pid])
        figures["host_staged_d2h"] = nbytes / freeze.checkpoint_seconds / 1e9
        t = time.perf_counter()
        coordinator.thaw(freeze)
        figures["host_staged_h2d"] = nbytes / (time.perf_counter() - t) / 1e9
        assert proc.command("digest") == before, "the host-staged round trip changed the bytes"
    finally:
        coordinator.close()
        proc.kill()
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--real", action="store_true", help="NVIDIA's libcuda: run on a GPU")
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--copy-gbps", type=float, default=2.0, help="the fake's copy rate")
    ap.add_argument("--rounds", type=int, default=3, help="baseline and gpusnap, N times")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    nbytes = args.size_mib * MIB
    with tempfile.TemporaryDirectory(prefix="gpusnap-gpu-bench-") as tmp:
        work = Path(tmp)
        if args.real:
            env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
            version_file = "/proc/driver/nvidia/version"
            where = "a GPU (NVIDIA's libcuda)"
        else:
            lib = libcuda.build(work / "lib")
            gpu = libcuda.gpu(0)
            node = libcuda.write_node(
                work / "node",
                [gpu],
                custom_storage=True,
                driver_version=13040,
                copy_gbps=args.copy_gbps,
            )
            env = libcuda.env(lib, node)
            version_file = str(node / libcuda.VERSION_FILE)
            where = f"the fake libcuda at copy_gbps {args.copy_gbps:g}"
        rounds = []
        for _ in range(args.rounds):  # each gpusnap figure next to a baseline of its round
            figures = gpusnap_paths(env, work, nbytes, version_file)
            rounds.append((memcpy_baseline(env, nbytes), figures))
    paths = ("custom_storage_d2h", "custom_storage_h2d", "host_staged_d2h", "host_staged_h2d")
    per_round = [
        {name: o[name] / b[name.rsplit("_", 1)[1]] for name in paths if name in o}
        for b, o in rounds
    ]
    ratios = {name: statistics.median(r[name] for r in per_round) for name in per_round[0]}
    baseline = {d: statistics.median(b[d] for b, _ in rounds) for d in ("d2h", "h2d")}
    ours: dict[str, Any] = {name: statistics.median(o[name] for _, o in rounds) for name in ratios}
    ours["capabilities"] = rounds[0][1]["capabilities"]
    print(f"GPU bench on {where}: {args.size_mib} MiB of device memory, median of {args.rounds}")
    print(f"{'path':<26}{'GB/s':>10}{'x memcpy':>12}")
    for d in ("d2h", "h2d"):
        print(f"{'cuMemcpy pinned ' + d:<26}{baseline[d]:>10.3f}{1.0:>12.2f}")
    for name, ratio in ratios.items():
        print(f"{name:<26}{ours[name]:>10.3f}{ratio:>12.2f}")
    if "custom_storage_d2h" not in ours:
        print("custom storage: not offered here (" + ours["capabilities"]["message"] + ")")
    report = {
        "bench": "gpu",
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "where": where,
        "bytes": nbytes,
        "baseline_memcpy_gbps": baseline,
        "gpusnap_gbps": {k: v for k, v in ours.items() if k != "capabilities"},
        "ratios": ratios,  # medians of the same-round ratios
        "ratios_per_round": per_round,
        "capabilities": ours["capabilities"],
    }
    print(json.dumps(report))
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
