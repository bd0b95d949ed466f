"""The GPU side of a process tree, for the checkpoint and restore bodies.

- What the stamp records per CUDA process: its device memory per GPU (``GpuFreeze``) and the
  NCCL it maps (``host/nccl.py``), probed before the freeze while the tree still runs.
- A tree whose GPU restore failed can never run again: the driver offers no second restore
  (NVIDIA/cuda-checkpoint#44), and the process sits CHECKPOINTED holding what it holds.
  ``give_up`` kills it and says why, for the restore body to cold-start the workload.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterable
from typing import Any

from gpusnap.daemon.gate.verdict import Reason
from gpusnap.daemon.host import proctree
from gpusnap.daemon.host.nccl import nccl_of
from gpusnap.errors import GpusnapError

log = logging.getLogger(__name__)

KILL_WAIT_S = 30.0  # a hang guard on the killed tree's exit


def nccl_by_pid(pids: Iterable[int]) -> dict[int, dict[str, str | None]]:
    """The NCCL each process maps, for those that map one."""
    return {pid: found for pid in pids if (found := nccl_of(pid)) is not None}


def with_processes(freeze_stamp: dict[str, Any], nccl: dict[int, Any]) -> dict[str, Any]:
    """``GpuFreeze.to_stamp()`` with each CUDA process's NCCL (``nccl``) added where known."""
    out = dict(freeze_stamp)
    out["processes"] = [
        {**p, "nccl": nccl[p["pid"]]} if p.get("pid") in nccl else dict(p)
        for p in freeze_stamp.get("processes") or []
    ]
    return out


def give_up(err: GpusnapError, pids: Iterable[int]) -> Reason:
    """Kill the restored tree whose GPU state could not be restored; the reason to cold-start."""
    tree = sorted(set(pids))
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + KILL_WAIT_S
    while any(proctree.exists(p) for p in tree) and time.monotonic() < end:
        time.sleep(0.05)
    log.error("GPU restore failed, restored processes %s killed: %s", tree, err)
    return Reason(
        "gpu.restore",
        "restored",
        "lost",
        f"{err}; the restored processes {', '.join(map(str, tree))} were killed, and the "
        "workload cold-started instead",
    )
