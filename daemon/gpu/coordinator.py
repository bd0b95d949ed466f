"""GPU checkpoint policy for a process tree: find, lock all, checkpoint each, roll back.

The driver calls themselves run in the GPU worker process (``worker.GpuWorker``); this module
decides which to make and in what order:

- freeze: find which pids hold CUDA state to checkpoint (``processes.Processes``), lock every
  one before checkpointing any, then checkpoint each, measuring what each released on each
  GPU. On any failure, roll back by state (restore what is CHECKPOINTED, unlock what is
  LOCKED) so the workload runs on, and say so.
- thaw (leave-running): restore all, then unlock all.
- restore (after CRIU restore): check free memory, restore each with GPU UUID pairs, unlock all.
  A restore that fails is no roll-back: the driver offers no retry after one
  (NVIDIA/cuda-checkpoint#44), so the error says the processes are lost.

Where the driver offers custom storage and the caller hands ``freeze`` a ``CustomStorage``,
each process's device memory is copied by the daemon into its sink (``custom_storage``) instead
of being staged in the process's host memory; ``restore`` then fills it back from a source.
The sink and the source are the caller's: this layer never sees the store.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gpusnap.daemon.gate.verdict import Reason
from gpusnap.daemon.gpu.compat import gpu_compat_reasons, target_devices
from gpusnap.daemon.gpu.custom_storage import (
    CustomStorage,
    MemorySource,
    checkpoint_process,
    restore_process,
)
from gpusnap.daemon.gpu.freeze import CUSTOM_STORAGE, HOST_STAGED, GpuFreeze, process_bytes
from gpusnap.daemon.gpu.inventory import (
    NVRM_VERSION_FILE,
    build_stamp,
    cuda_version_text,
    probe_capabilities,
)
from gpusnap.daemon.gpu.processes import NONE, Processes
from gpusnap.daemon.gpu.ring import HostRing
from gpusnap.daemon.gpu.worker import GpuWorker
from gpusnap.errors import (
    FailedPrecondition,
    GpusnapError,
    Unavailable,
    Unsupported,
    with_message,
)

log = logging.getLogger(__name__)

# The ring of pinned host buffers for custom storage: 8 slots of 32 MiB, i.e. 4 copies of
# 32 MiB in flight on 4 streams while the daemon works through the other 4 (see the
# throughput notes in docs/gpu.md).
RING_SLOTS = 8
RING_SLOT_BYTES = 32 * 1024 * 1024
LOST = "a failed GPU restore cannot be retried (NVIDIA/cuda-checkpoint#44): the process is lost"


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
        nvidia_version_file: str = NVRM_VERSION_FILE,
    ) -> None:
        self._worker = worker
        self._procs = Processes(worker)
        self.lock_timeout_ms = lock_timeout_ms
        self.custom_storage = custom_storage  # use it where the driver offers it
        self.ring_slots = ring_slots
        self.ring_slot_bytes = ring_slot_bytes
        self.nvidia_version_file = nvidia_version_file
        self._caps: dict[str, Any] | None = None

    @classmethod
    def create(
        cls,
        *,
        call_timeout_s: float = 30.0,
        copy_rate_gbps: float = 1.0,
        lock_timeout_ms: int = 10000,
        custom_storage: bool = True,
        ring_slots: int = RING_SLOTS,
        ring_slot_bytes: int = RING_SLOT_BYTES,
        nvidia_version_file: str = NVRM_VERSION_FILE,
    ) -> GpuCoordinator:
        """A coordinator with its own worker (started at the first call)."""
        return cls(
            GpuWorker(call_timeout_s, copy_rate_gbps),
            lock_timeout_ms=lock_timeout_ms,
            custom_storage=custom_storage,
            ring_slots=ring_slots,
            ring_slot_bytes=ring_slot_bytes,
            nvidia_version_file=nvidia_version_file,
        )

    def close(self) -> None:
        self._worker.close()

    # -- capabilities and stamp ---------------------------------------------------------

    def capabilities(self) -> dict[str, Any]:
        """Probed once, lazily. Without a driver: ``driver_present`` False and one-line message."""
        if self._caps is None:
            self._caps = probe_capabilities(self._worker, self.nvidia_version_file)
        return dict(self._caps)

    def stamp(self) -> dict[str, Any]:
        return build_stamp(self.capabilities())

    def _memory(self) -> dict[str, dict[str, int]]:
        info = self._worker.call("memory_info")
        return {str(k): {"free": int(v["free"]), "total": int(v["total"])} for k, v in info.items()}

    def _free_by_uuid(self) -> dict[str, int]:
        return {uuid: m["free"] for uuid, m in self._memory().items()}

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
        cuda_pids = self._procs.to_freeze(pids)
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
            memory = self._memory()
            # No process holds more than what is in use on the node: its checkpoint's bound.
            in_use = sum(m["total"] - m["free"] for m in memory.values())
            started = time.monotonic()
            for pid in cuda_pids:
                self._worker.call(
                    "lock", pid, timeout_ms, timeout_s=self._lock_call_timeout(timeout_ms)
                )
            locked = time.monotonic()
            if custom:
                assert custom_storage is not None
                self._checkpoint_to_sink(freeze, custom_storage)
            else:
                free = {uuid: m["free"] for uuid, m in memory.items()}
                for pid in cuda_pids:
                    self._worker.call("checkpoint", pid, **self._worker.for_bytes(in_use))
                    # What this checkpoint released on each GPU is what the process held.
                    now = self._free_by_uuid()
                    freeze.per_process[pid] = {
                        uuid: gained for uuid, f in free.items() if (gained := now[uuid] - f) > 0
                    }
                    free = now
            done = time.monotonic()
        except GpusnapError as err:
            outcome = self._roll_back(cuda_pids, freeze)
            raise with_message(err, f"GPU freeze failed: {err}; {outcome}") from err
        freeze.lock_seconds = locked - started
        freeze.checkpoint_seconds = done - locked
        return freeze

    def _checkpoint_to_sink(self, freeze: GpuFreeze, custom_storage: CustomStorage) -> None:
        with HostRing(self.ring_slots, self.ring_slot_bytes) as ring:
            try:
                for pid in freeze.cuda_pids:
                    freeze.memory_files += checkpoint_process(
                        self._worker, ring, pid, custom_storage.sink
                    )
            finally:
                self._detach(ring)
        for m in freeze.memory_files:
            used = freeze.per_process.setdefault(int(m["pid"]), {})
            used[m["uuid"]] = used.get(m["uuid"], 0) + int(m["size"])

    def _detach(self, ring: HostRing) -> None:
        try:
            self._worker.call("ring_detach", ring.name)
        except GpusnapError as err:
            log.info("could not detach ring %s from the GPU worker: %s", ring.name, err)

    def _roll_back(self, pids: list[int], freeze: GpuFreeze) -> str:
        """Put every process back to RUNNING by its current state; say how that went.

        Each round restores what is CHECKPOINTED and unlocks what is LOCKED, as it finds them
        then: a call that missed its deadline may still land in the driver after the first
        look (a checkpoint that was in flight ends CHECKPOINTED after we saw LOCKED).
        """
        problems: list[str] = []
        self._procs.settle(pids, self._worker.call_timeout_s)
        copied = {int(m["pid"]) for m in freeze.memory_files}
        if copied:
            # Their device memory exists only in the sink now: put it back from there.
            try:
                self._thaw_from_source(freeze, [p for p in pids if p in copied])
            except GpusnapError as err:
                problems.append(str(err))
        lost: set[int] = set()  # a restore failed: the driver offers no second one
        for _round in range(3):
            states = self._procs.states(pids)
            if all(states[p] not in ("CHECKPOINTED", "LOCKED") or p in lost for p in pids):
                break
            for pid in pids:
                if states[pid] == "CHECKPOINTED" and pid not in copied | lost:
                    try:
                        deadline = self._restore_deadline(freeze, pid)
                        self._worker.call("restore", pid, None, **deadline)
                    except GpusnapError as err:
                        lost.add(pid)
                        problems.append(f"{err} ({LOST})")
            for pid in pids:
                if pid not in lost and self._procs.state(pid) == "LOCKED":
                    try:
                        self._worker.call("unlock", pid)
                    except GpusnapError as err:
                        problems.append(str(err))
        final = self._procs.states(pids)
        stuck = {pid: s for pid, s in final.items() if s not in ("RUNNING", NONE)}
        if not stuck:
            return f"rolled back: processes {_pids(pids)} are RUNNING, the workload runs on"
        where = ", ".join(f"process {pid} is {s}" for pid, s in stuck.items())
        detail = f" ({'; '.join(problems)})" if problems else ""
        log.error("GPU rollback incomplete: %s%s", where, detail)
        return f"rollback incomplete: {where}{detail}"

    def _restore_deadline(self, frozen: GpuFreeze | dict[str, Any], pid: int) -> dict[str, Any]:
        stamp = frozen.to_stamp() if isinstance(frozen, GpuFreeze) else frozen
        return self._worker.for_bytes(process_bytes(stamp, pid))

    def thaw(self, freeze: GpuFreeze) -> None:
        """Leave-running: restore every frozen process, then unlock every one."""
        if freeze.memory_copy == CUSTOM_STORAGE and freeze.memory_files:
            try:
                self._thaw_from_source(freeze, freeze.cuda_pids)
            except GpusnapError as err:
                where = self._procs.where(freeze.cuda_pids)
                raise with_message(err, f"GPU thaw failed: {err}; {where}") from err
        self._resume(freeze.cuda_pids, None, freeze.to_stamp(), "thaw")

    def _thaw_from_source(self, freeze: GpuFreeze, pids: list[int]) -> None:
        """Custom storage put the memory in its sink only: fill it back from the source."""
        if freeze.custom_storage is None:
            raise FailedPrecondition("the frozen GPU memory is in no store; cannot thaw")
        self._refill(pids, freeze.memory_files, None, freeze.custom_storage.source)

    def _resume(
        self, pids: list[int], pairs: list[list[str]] | None, stamp: dict[str, Any], what: str
    ) -> None:
        states = {pid: self._procs.state(pid) for pid in pids}
        try:
            for pid in pids:
                if states[pid] == "CHECKPOINTED":
                    deadline = self._restore_deadline(stamp, pid)
                    self._worker.call("restore", pid, pairs, **deadline)
            for pid in pids:
                if states[pid] in ("CHECKPOINTED", "LOCKED"):
                    self._worker.call("unlock", pid)
        except GpusnapError as err:
            where = self._procs.where(pids)
            raise with_message(err, f"GPU {what} failed: {err}; {where}; {LOST}") from err

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
        is read from there straight into the memory the driver maps for the restore. Any
        failure leaves processes that cannot be brought back: the caller must kill them.
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
                "GPU restore refused before asking the driver: "
                + "; ".join(r.message for r in memory)
            )
        cuda_pids = [pid for pid in pids if self._procs.state(pid) is not None]
        if gpu_stamp.get("memory_copy") == CUSTOM_STORAGE:
            files = list(gpu_stamp.get("memory_files") or [])
            self._refill(cuda_pids, files, pairs, source)
        self._resume(cuda_pids, pairs, gpu_stamp, "restore")

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
                "needs a source to read it from"
            )
        if not self.capabilities()["custom_storage"]:
            raise Unsupported(
                "the checkpoint's GPU memory was copied with custom storage; this node's "
                "driver has none"
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
                    if self._procs.state(pid) != "CHECKPOINTED":
                        continue
                    restore_process(
                        self._worker, ring, pid, files=files, pairs=pairs, source=source
                    )
            except GpusnapError as err:
                where = self._procs.where(pids)
                raise with_message(err, f"GPU restore failed: {err}; {where}") from err
            finally:
                self._detach(ring)


def _pids(pids: list[int]) -> str:
    return ", ".join(str(p) for p in pids)
