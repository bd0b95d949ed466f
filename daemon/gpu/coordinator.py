"""GPU checkpoint policy for a process tree: find, lock all, checkpoint each, roll back.

The driver calls themselves run in the GPU worker process (``worker.GpuWorker``); this module
decides which to make and in what order:

- freeze: find which pids hold CUDA state (``cuCheckpointProcessGetState``), lock every one
  before checkpointing any, then checkpoint each. On any failure, roll back by state (restore
  what is CHECKPOINTED, unlock what is LOCKED) so the workload runs on, and say so.
- thaw (leave-running): restore all, then unlock all.
- restore (after CRIU restore): check free memory, restore each with GPU UUID pairs, unlock all.

Where the driver offers custom storage and the caller hands ``freeze`` a ``CustomStorage``,
each process's device memory is copied by the daemon into its sink (``custom_storage``) instead
of being staged in the process's host memory; ``restore`` then fills it back from a source.
The sink and the source are the caller's: this layer never sees the store.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from gpusnap.daemon.gpu.compat import gpu_compat_reasons, target_devices
from gpusnap.daemon.gpu.custom_storage import (
    CustomStorage,
    MemorySource,
    checkpoint_process,
    restore_process,
)
from gpusnap.daemon.gpu.inventory import build_stamp, cuda_version_text, probe_capabilities
from gpusnap.daemon.gpu.ring import HostRing
from gpusnap.daemon.gpu.worker import CallFailed, GpuWorker
from gpusnap.daemon.verdict import Reason
from gpusnap.errors import (
    FailedPrecondition,
    GpusnapError,
    InvalidArgument,
    Unavailable,
    Unsupported,
    with_message,
)

log = logging.getLogger(__name__)

DRIVER_ENV = "GPUSNAP_GPU_DRIVER"
NO_CUDA_STATE = "CUDA_ERROR_NOT_INITIALIZED"
HOST_STAGED = "host-staged"
CUSTOM_STORAGE = "custom-storage"
# The ring of pinned host buffers for custom storage: 8 slots of 32 MiB, i.e. 4 copies of
# 32 MiB in flight on 4 streams while the daemon works through the other 4 (see the
# throughput notes in docs/gpu.md).
RING_SLOTS = 8
RING_SLOT_BYTES = 32 * 1024 * 1024


@dataclass
class GpuFreeze:
    """What ``freeze`` did: the CUDA processes it checkpointed and what it cost."""

    cuda_pids: list[int]
    bytes_per_device: dict[str, int] = field(default_factory=dict)
    lock_seconds: float = 0.0
    checkpoint_seconds: float = 0.0
    memory_copy: str = HOST_STAGED
    # Custom storage: one entry per process and device ({pid, position, uuid, path, size}),
    # and where they went (a thaw or a roll-back reads them back from its source).
    memory_files: list[dict[str, Any]] = field(default_factory=list)
    custom_storage: CustomStorage | None = field(default=None, repr=False)

    def to_stamp(self) -> dict[str, Any]:
        """Fields merged into the stamp's ``gpu`` section (none collide with ``stamp()``)."""
        out: dict[str, Any] = {
            "cuda_pids": list(self.cuda_pids),
            "bytes_per_device": dict(self.bytes_per_device),
            "bytes_total": sum(self.bytes_per_device.values()),
            "lock_seconds": self.lock_seconds,
            "checkpoint_seconds": self.checkpoint_seconds,
            "memory_copy": self.memory_copy,
        }
        if self.memory_files:
            out["memory_files"] = [dict(m) for m in self.memory_files]
        return out


class GpuCoordinator:
    """The daemon's one entry point to GPU state. Thread-safe: calls are serialised."""

    def __init__(
        self,
        worker: GpuWorker,
        *,
        lock_timeout_ms: int = 10000,
        custom_storage: bool = True,
        ring_slots: int = RING_SLOTS,
        ring_slot_bytes: int = RING_SLOT_BYTES,
    ) -> None:
        self._worker = worker
        self.lock_timeout_ms = lock_timeout_ms
        self.custom_storage = custom_storage  # use it where the driver offers it
        self.ring_slots = ring_slots
        self.ring_slot_bytes = ring_slot_bytes
        self._caps: dict[str, Any] | None = None

    @classmethod
    def create(
        cls,
        *,
        driver: str = "cuda",
        call_timeout_s: float = 30.0,
        lock_timeout_ms: int = 10000,
        custom_storage: bool = True,
        ring_slots: int = RING_SLOTS,
        ring_slot_bytes: int = RING_SLOT_BYTES,
    ) -> GpuCoordinator:
        """``driver`` is "cuda" or "module:<import path>"; $GPUSNAP_GPU_DRIVER overrides "cuda"."""
        if driver == "cuda":
            driver = os.environ.get(DRIVER_ENV, "") or "cuda"
        if driver != "cuda" and not driver.startswith("module:"):
            raise InvalidArgument(f"unknown GPU driver {driver!r}: use 'cuda' or 'module:<path>'")
        return cls(
            GpuWorker(driver, call_timeout_s),
            lock_timeout_ms=lock_timeout_ms,
            custom_storage=custom_storage,
            ring_slots=ring_slots,
            ring_slot_bytes=ring_slot_bytes,
        )

    def close(self) -> None:
        self._worker.close()

    # -- capabilities and stamp ---------------------------------------------------------

    def capabilities(self) -> dict[str, Any]:
        """Probed once, lazily. Without a driver: ``driver_present`` False and one-line message."""
        if self._caps is None:
            self._caps = probe_capabilities(self._worker)
        return dict(self._caps)

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
        reasons = gpu_compat_reasons(gpu_stamp, here, self._free_by_uuid(), gpu_map)
        if gpu_stamp.get("memory_copy") == CUSTOM_STORAGE and not here.get("custom_storage"):
            reasons.append(
                Reason(
                    "gpu.custom_storage",
                    "true",
                    "false",
                    "the checkpoint's GPU memory was copied with custom storage and only a "
                    "driver with custom storage can put it back; this node's driver has none",
                )
            )
        return reasons

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

    def uses_custom_storage(self) -> bool:
        """Whether a freeze given a ``CustomStorage`` copies device memory itself."""
        return self.custom_storage and bool(self.capabilities()["custom_storage"])

    def freeze(
        self,
        pids: list[int],
        *,
        lock_timeout_ms: int | None = None,
        custom_storage: CustomStorage | None = None,
    ) -> GpuFreeze:
        """Lock every CUDA process among ``pids``, then checkpoint each. Rolls back on failure.

        Given ``custom_storage`` and a driver that offers it, each process's device memory is
        copied into its sink rather than staged by the driver in the process's host memory.
        """
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
        custom = custom_storage is not None and self.uses_custom_storage()
        log.info(
            "freezing GPU state of processes %s (%s)",
            cuda_pids,
            CUSTOM_STORAGE if custom else HOST_STAGED,
        )
        freeze = GpuFreeze(
            cuda_pids=cuda_pids,
            memory_copy=CUSTOM_STORAGE if custom else HOST_STAGED,
            custom_storage=custom_storage if custom else None,
        )
        try:
            before = self._free_by_uuid()
            started = time.monotonic()
            for pid in cuda_pids:
                self._worker.call(
                    "lock", pid, timeout_ms, timeout_s=self._lock_call_timeout(timeout_ms)
                )
            locked = time.monotonic()
            if custom:
                assert custom_storage is not None
                with HostRing(self.ring_slots, self.ring_slot_bytes) as ring:
                    try:
                        for pid in cuda_pids:
                            freeze.memory_files += checkpoint_process(
                                self._worker, ring, pid, custom_storage.sink
                            )
                    finally:
                        self._detach(ring)
            else:
                for pid in cuda_pids:
                    self._worker.call("checkpoint", pid)
            done = time.monotonic()
            after = self._free_by_uuid()
        except GpusnapError as err:
            outcome = self._roll_back(cuda_pids, freeze)
            raise with_message(err, f"GPU freeze failed: {err}; {outcome}") from err
        if custom:
            per_device: dict[str, int] = {}
            for m in freeze.memory_files:
                per_device[m["uuid"]] = per_device.get(m["uuid"], 0) + int(m["size"])
        else:
            # The driver reports no sizes on the host-staged path: what the checkpoint
            # released on each GPU is what it holds.
            per_device = {uuid: max(0, after.get(uuid, 0) - free) for uuid, free in before.items()}
        freeze.bytes_per_device = per_device
        freeze.lock_seconds = locked - started
        freeze.checkpoint_seconds = done - locked
        return freeze

    def _detach(self, ring: HostRing) -> None:
        try:
            self._worker.call("ring_detach", ring.name)
        except GpusnapError as err:
            log.info("could not detach ring %s from the GPU worker: %s", ring.name, err)

    def _roll_back(self, pids: list[int], freeze: GpuFreeze | None = None) -> str:
        """Put every process back to RUNNING by its current state; say how that went."""
        problems: list[str] = []
        states = self._states(pids)
        copied = {int(m["pid"]) for m in freeze.memory_files} if freeze is not None else set()
        if copied and freeze is not None:
            # Their device memory exists only in the sink now: put it back from there.
            try:
                self._thaw_from_source(freeze, [p for p in pids if p in copied])
            except GpusnapError as err:
                problems.append(str(err))
        for pid in pids:
            if states[pid] == "CHECKPOINTED" and pid not in copied:
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
        if freeze.memory_copy == CUSTOM_STORAGE and freeze.memory_files:
            try:
                self._thaw_from_source(freeze, freeze.cuda_pids)
            except GpusnapError as err:
                now = self._states(freeze.cuda_pids)
                where = ", ".join(f"process {pid} is {s}" for pid, s in now.items())
                raise with_message(err, f"GPU thaw failed: {err}; {where}") from err
        self._resume(freeze.cuda_pids, None, "thaw")

    def _thaw_from_source(self, freeze: GpuFreeze, pids: list[int]) -> None:
        """Custom storage put the memory in its sink only: fill it back from the source."""
        if freeze.custom_storage is None:
            raise FailedPrecondition("the frozen GPU memory is in no store; cannot thaw")
        self._refill(pids, freeze.memory_files, None, freeze.custom_storage.source)

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
            raise with_message(err, f"GPU {what} failed: {err}; {where}") from err

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
        self,
        pids: list[int],
        gpu_stamp: dict[str, Any],
        *,
        gpu_map: dict[str, str] | None = None,
        source: MemorySource | None = None,
    ) -> None:
        """After CRIU restore: put the processes' GPU state back (UUID-remapped), then unlock.

        A checkpoint taken with custom storage needs the ``source`` of its device memory: it
        is read from there straight into the memory the driver maps for the restore.
        """
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
        if gpu_stamp.get("memory_copy") == CUSTOM_STORAGE:
            files = list(gpu_stamp.get("memory_files") or [])
            self._refill(cuda_pids, files, pairs, source)
        self._resume(cuda_pids, pairs, "restore")

    def _refill(
        self,
        pids: list[int],
        memory_files: list[dict[str, Any]],
        pairs: list[list[str]] | None,
        source: MemorySource | None,
    ) -> None:
        """Custom storage: restore each process with its memory mapped here, fill it, complete.

        Leaves every process LOCKED for ``_resume`` to unlock.
        """
        if source is None:
            raise FailedPrecondition(
                "the checkpoint's GPU memory is in the store (custom storage); the restore "
                "needs a source to read it from; processes stay CHECKPOINTED"
            )
        if not self.capabilities()["custom_storage"]:
            raise Unsupported(
                "the checkpoint's GPU memory was copied with custom storage; this node's "
                "driver has none; processes stay CHECKPOINTED"
            )
        mapping = {old: new for old, new in pairs} if pairs else {}
        files: dict[tuple[int, str], dict[str, Any]] = {}
        for m in memory_files:
            new_uuid = mapping.get(str(m["uuid"]), str(m["uuid"]))
            files[(int(m["pid"]), new_uuid)] = m
        with HostRing(self.ring_slots, self.ring_slot_bytes) as ring:
            try:
                self._worker.call("ring_attach", ring.name, ring.size)
                for pid in pids:
                    if self._state(pid) != "CHECKPOINTED":
                        continue
                    restore_process(
                        self._worker, ring, pid, files=files, pairs=pairs, source=source
                    )
            except GpusnapError as err:
                now = self._states(pids)
                where = ", ".join(f"process {pid} is {s}" for pid, s in now.items())
                raise with_message(err, f"GPU restore failed: {err}; {where}") from err
            finally:
                self._detach(ring)


def _pids(pids: list[int]) -> str:
    return ", ".join(str(p) for p in pids)
