"""GPU checkpoint policy for a process tree: find, lock all, checkpoint each, roll back.

The driver calls themselves run in the GPU worker process (``worker.GpuWorker``); this module
decides which to make and in what order:

- freeze: find which pids hold CUDA state (``cuCheckpointProcessGetState``), lock every one
  before checkpointing any, then checkpoint each. On any failure, roll back by state (restore
  what is CHECKPOINTED, unlock what is LOCKED) so the workload runs on, and say so.
- thaw (leave-running): restore all, then unlock all.
- restore (after CRIU restore): check free memory, restore each with GPU UUID pairs, unlock all.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from gpusnap.daemon.gpu.compat import gpu_compat_reasons, target_devices
from gpusnap.daemon.gpu.inventory import (
    CHECKPOINT_API_MIN,
    GPU_REMAP_MIN,
    build_stamp,
    cuda_version_text,
    parse_nvrm_version,
)
from gpusnap.daemon.gpu.worker import CallFailed, GpuWorker
from gpusnap.daemon.model import Reason
from gpusnap.storage.errors import (
    FailedPrecondition,
    GpusnapError,
    InvalidArgument,
    Unavailable,
    Unsupported,
)

log = logging.getLogger(__name__)

DRIVER_ENV = "GPUSNAP_GPU_DRIVER"
NO_CUDA_STATE = "CUDA_ERROR_NOT_INITIALIZED"


@dataclass
class GpuFreeze:
    """What ``freeze`` did: the CUDA processes it checkpointed and what it cost."""

    cuda_pids: list[int]
    bytes_per_device: dict[str, int] = field(default_factory=dict)
    lock_seconds: float = 0.0
    checkpoint_seconds: float = 0.0

    def to_stamp(self) -> dict[str, Any]:
        """Fields merged into the stamp's ``gpu`` section (none collide with ``stamp()``)."""
        return {
            "cuda_pids": list(self.cuda_pids),
            "bytes_per_device": dict(self.bytes_per_device),
            "bytes_total": sum(self.bytes_per_device.values()),
            "lock_seconds": self.lock_seconds,
            "checkpoint_seconds": self.checkpoint_seconds,
        }


class GpuCoordinator:
    """The daemon's one entry point to GPU state. Thread-safe: calls are serialised."""

    def __init__(self, worker: GpuWorker, *, lock_timeout_ms: int = 10000) -> None:
        self._worker = worker
        self.lock_timeout_ms = lock_timeout_ms
        self._caps: dict[str, Any] | None = None

    @classmethod
    def create(
        cls, *, driver: str = "cuda", call_timeout_s: float = 30.0, lock_timeout_ms: int = 10000
    ) -> GpuCoordinator:
        """``driver`` is "cuda" or "module:<import path>"; $GPUSNAP_GPU_DRIVER overrides "cuda"."""
        if driver == "cuda":
            driver = os.environ.get(DRIVER_ENV, "") or "cuda"
        if driver != "cuda" and not driver.startswith("module:"):
            raise InvalidArgument(f"unknown GPU driver {driver!r}: use 'cuda' or 'module:<path>'")
        return cls(GpuWorker(driver, call_timeout_s), lock_timeout_ms=lock_timeout_ms)

    def close(self) -> None:
        self._worker.close()

    # -- capabilities and stamp ---------------------------------------------------------

    def capabilities(self) -> dict[str, Any]:
        """Probed once, lazily. Without a driver: ``driver_present`` False and one-line message."""
        if self._caps is None:
            self._caps = self._probe()
        return dict(self._caps)

    def _probe(self) -> dict[str, Any]:
        caps: dict[str, Any] = {
            "driver_present": False,
            "message": "",
            "driver_version": None,
            "driver_version_line": None,
            "cuda_driver_version": None,
            "checkpoint_api": False,
            "gpu_remap": False,
            "custom_storage": False,
            "devices": [],
        }
        try:
            self._worker.call("init")
            version = int(self._worker.call("driver_version"))
            line = self._worker.call("driver_version_string")
            caps["devices"] = list(self._worker.call("devices"))
            caps["custom_storage"] = bool(self._worker.call("custom_storage_supported"))
        except GpusnapError as err:
            caps["message"] = f"GPU checkpointing unavailable: {err}"
            log.info("%s", caps["message"])
            return caps
        caps.update(
            driver_present=True,
            driver_version=parse_nvrm_version(line),
            driver_version_line=line,
            cuda_driver_version=version,
            checkpoint_api=version >= CHECKPOINT_API_MIN,
            gpu_remap=version >= GPU_REMAP_MIN,
        )

        def yes(flag: str) -> str:
            return "yes" if caps[flag] else "no"

        caps["message"] = (
            f"NVIDIA driver {caps['driver_version'] or 'unknown'} "
            f"(CUDA {cuda_version_text(version)}), {len(caps['devices'])} GPU(s); "
            f"checkpoint API {yes('checkpoint_api')}, GPU remap {yes('gpu_remap')}, "
            f"custom storage {yes('custom_storage')}"
        )
        log.info("%s", caps["message"])
        return caps

    def stamp(self) -> dict[str, Any]:
        return build_stamp(self.capabilities())

    def _free_by_uuid(self) -> dict[str, int]:
        info = self._worker.call("memory_info")
        return {str(k): int(v["free"]) for k, v in dict(info).items()}

    def compat_reasons(
        self, gpu_stamp: dict[str, Any], *, gpu_map: dict[str, str] | None = None
    ) -> list[Reason]:
        """Why this node cannot take the checkpoint's GPU state; empty when it can."""
        here = self.stamp()
        if not gpu_stamp.get("present") or not here.get("present"):
            return gpu_compat_reasons(gpu_stamp, here, {}, gpu_map)
        return gpu_compat_reasons(gpu_stamp, here, self._free_by_uuid(), gpu_map)

    # -- per-pid helpers --------------------------------------------------------------

    def _state(self, pid: int) -> str | None:
        """The process's CUDA state, or None when it holds no CUDA state."""
        try:
            return str(self._worker.call("get_state", pid, tolerate=(NO_CUDA_STATE,)))
        except CallFailed:
            return None

    def _states(self, pids: list[int]) -> dict[int, str]:
        states: dict[int, str] = {}
        for pid in pids:
            try:
                states[pid] = self._state(pid) or "without CUDA state"
            except GpusnapError as err:
                states[pid] = f"unknown ({err})"
        return states

    def _lock_call_timeout(self, lock_timeout_ms: int) -> float:
        return self._worker.call_timeout_s + lock_timeout_ms / 1000.0

    # -- freeze / thaw ------------------------------------------------------------------

    def freeze(self, pids: list[int], *, lock_timeout_ms: int | None = None) -> GpuFreeze:
        """Lock every CUDA process among ``pids``, then checkpoint each. Rolls back on failure."""
        caps = self.capabilities()
        if not caps["driver_present"]:
            return GpuFreeze(cuda_pids=[])
        if not caps["checkpoint_api"]:
            raise Unsupported(
                f"driver CUDA version {cuda_version_text(caps['cuda_driver_version'])} has no "
                "checkpoint API (needs 12.8, driver r570 or later)"
            )
        timeout_ms = self.lock_timeout_ms if lock_timeout_ms is None else lock_timeout_ms
        cuda_pids: list[int] = []
        for pid in pids:
            state = self._state(pid)
            if state is None:
                continue
            if state != "RUNNING":
                raise FailedPrecondition(
                    f"process {pid} is {state}, not RUNNING: another checkpoint may hold it"
                )
            cuda_pids.append(pid)
        if not cuda_pids:
            return GpuFreeze(cuda_pids=[])
        log.info("freezing GPU state of processes %s", cuda_pids)
        try:
            before = self._free_by_uuid()
            started = time.monotonic()
            for pid in cuda_pids:
                self._worker.call(
                    "lock", pid, timeout_ms, timeout_s=self._lock_call_timeout(timeout_ms)
                )
            locked = time.monotonic()
            for pid in cuda_pids:
                self._worker.call("checkpoint", pid)
            done = time.monotonic()
            after = self._free_by_uuid()
        except GpusnapError as err:
            outcome = self._roll_back(cuda_pids)
            raise type(err)(f"GPU freeze failed: {err}; {outcome}") from err
        # The driver reports no sizes on the host-staged path: what the checkpoint released
        # on each GPU is what it holds.
        per_device = {uuid: max(0, after.get(uuid, 0) - free) for uuid, free in before.items()}
        return GpuFreeze(
            cuda_pids=cuda_pids,
            bytes_per_device=per_device,
            lock_seconds=locked - started,
            checkpoint_seconds=done - locked,
        )

    def _roll_back(self, pids: list[int]) -> str:
        """Put every process back to RUNNING by its current state; say how that went."""
        problems: list[str] = []
        states = self._states(pids)
        for pid in pids:
            if states[pid] == "CHECKPOINTED":
                try:
                    self._worker.call("restore", pid, None)
                except GpusnapError as err:
                    problems.append(str(err))
        for pid in pids:
            if self._states([pid])[pid] == "LOCKED":
                try:
                    self._worker.call("unlock", pid)
                except GpusnapError as err:
                    problems.append(str(err))
        final = self._states(pids)
        stuck = {pid: s for pid, s in final.items() if s not in ("RUNNING", "without CUDA state")}
        if not stuck:
            return f"rolled back: processes {_pids(pids)} are RUNNING, the workload runs on"
        where = ", ".join(f"process {pid} is {s}" for pid, s in stuck.items())
        detail = f" ({'; '.join(problems)})" if problems else ""
        log.error("GPU rollback incomplete: %s%s", where, detail)
        return f"rollback incomplete: {where}{detail}"

    def thaw(self, freeze: GpuFreeze) -> None:
        """Leave-running: restore every frozen process, then unlock every one."""
        self._resume(freeze.cuda_pids, None, "thaw")

    def _resume(self, pids: list[int], pairs: list[list[str]] | None, what: str) -> None:
        states = {pid: self._state(pid) for pid in pids}
        try:
            for pid in pids:
                if states[pid] == "CHECKPOINTED":
                    self._worker.call("restore", pid, pairs)
            for pid in pids:
                if states[pid] in ("CHECKPOINTED", "LOCKED"):
                    self._worker.call("unlock", pid)
        except GpusnapError as err:
            now = self._states(pids)
            where = ", ".join(f"process {pid} is {s}" for pid, s in now.items())
            raise type(err)(f"GPU {what} failed: {err}; {where}") from err

    # -- restore ------------------------------------------------------------------------

    def _gpu_pairs(
        self, gpu_stamp: dict[str, Any], gpu_map: dict[str, str] | None
    ) -> list[list[str]] | None:
        caps = self.capabilities()
        here = caps["devices"]
        pairs: list[list[str]] = []
        for old, new in target_devices(gpu_stamp, here, gpu_map):
            if new is None:
                raise FailedPrecondition(
                    f"no GPU on this node to take checkpointed GPU {old.get('uuid')}"
                    + (" (not in the GPU map)" if gpu_map is not None else "")
                )
            pairs.append([str(old["uuid"]), str(new["uuid"])])
        identity = all(old == new for old, new in pairs)
        if not caps["gpu_remap"]:
            if identity and gpu_map is None:
                return None
            raise Unsupported(
                f"driver CUDA version {cuda_version_text(caps['cuda_driver_version'])} cannot "
                "remap GPUs (needs a CUDA 13 driver, r580 or later)"
            )
        if identity and gpu_map is None:
            return None
        return pairs

    def restore(
        self, pids: list[int], gpu_stamp: dict[str, Any], *, gpu_map: dict[str, str] | None = None
    ) -> None:
        """After CRIU restore: put the processes' GPU state back (UUID-remapped), then unlock."""
        caps = self.capabilities()
        if not gpu_stamp.get("present"):
            return
        if not caps["driver_present"]:
            raise Unavailable(f"cannot restore GPU state: {caps['message']}")
        pairs = self._gpu_pairs(gpu_stamp, gpu_map)
        # A restore that runs out of memory wedges the process for good: check first.
        memory = [
            r
            for r in gpu_compat_reasons(gpu_stamp, self.stamp(), self._free_by_uuid(), gpu_map)
            if r.field.endswith(".free_memory")
        ]
        if memory:
            raise FailedPrecondition(
                "GPU restore refused, processes stay CHECKPOINTED: "
                + "; ".join(r.message for r in memory)
            )
        cuda_pids = [pid for pid in pids if self._state(pid) is not None]
        self._resume(cuda_pids, pairs, "restore")


def _pids(pids: list[int]) -> str:
    return ", ".join(str(p) for p in pids)
