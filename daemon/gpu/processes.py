"""Which processes of a tree hold CUDA state, and in what state each one is.

``cuCheckpointProcessGetState`` answers RUNNING for a process that ran ``cuInit`` and never
held a context (a serving engine's API server or coordinator), and NOT_INITIALIZED or
INVALID_VALUE for one without CUDA state or gone; only ``GetRestoreThreadId`` then tells the
process that has something to checkpoint (NVIDIA's own helper filters the same way; issue 10
§2.4). Locking a process without a context fails with NOT_INITIALIZED, so it must never be
among the frozen.
"""

from __future__ import annotations

import time

from gpusnap.daemon.gpu.cudaerror import NO_CUDA_STATE
from gpusnap.daemon.gpu.worker import CallFailed, GpuWorker
from gpusnap.errors import FailedPrecondition, GpusnapError

NONE = "without CUDA state"
IN_OPERATION = ("CHECKPOINTING", "RESTORING")  # a custom-storage operation is open


class Processes:
    """Per-pid questions to the driver, through the worker."""

    def __init__(self, worker: GpuWorker) -> None:
        self._worker = worker

    def state(self, pid: int) -> str | None:
        """The process's CUDA state, or None when it holds no CUDA state (or is gone)."""
        try:
            return str(self._worker.call("get_state", pid, tolerate=NO_CUDA_STATE))
        except CallFailed:
            return None

    def states(self, pids: list[int]) -> dict[int, str]:
        """Every pid's state in words, never raising (for messages)."""
        states: dict[int, str] = {}
        for pid in pids:
            try:
                states[pid] = self.state(pid) or NONE
            except GpusnapError as err:
                states[pid] = f"unknown ({err})"
        return states

    def where(self, pids: list[int]) -> str:
        """``process 1 is LOCKED, process 2 is RUNNING``: what a message says they are left in."""
        return ", ".join(f"process {pid} is {s}" for pid, s in self.states(pids).items())

    def settle(self, pids: list[int], timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until no process is in a custom-storage operation.

        An operation whose caller died (a worker killed past its deadline) is assumed to be
        abandoned by the driver (checkpoint -> LOCKED, restore -> CHECKPOINTED; unverified
        on hardware); a roll-back can act only once it has been.
        """
        end = time.monotonic() + timeout_s
        while any(s in IN_OPERATION for s in self.states(pids).values()):
            if time.monotonic() > end:
                return
            time.sleep(0.05)

    def has_context(self, pid: int) -> bool:
        """Whether the driver has a restore thread for ``pid``, i.e. state to checkpoint."""
        try:
            self._worker.call("get_restore_thread_id", pid, tolerate=NO_CUDA_STATE)
        except CallFailed:
            return False
        return True

    def to_freeze(self, pids: list[int]) -> list[int]:
        """The pids a freeze must lock: CUDA processes with a context, every one RUNNING."""
        found: list[int] = []
        for pid in pids:
            state = self.state(pid)
            if state is None or (state == "RUNNING" and not self.has_context(pid)):
                continue
            if state == "FAILED":
                raise FailedPrecondition(
                    f"process {pid} is FAILED: the driver gave up on its GPU state "
                    "(an error during an earlier checkpoint or restore); restart it"
                )
            if state != "RUNNING":
                raise FailedPrecondition(
                    f"process {pid} is {state}, not RUNNING: another checkpoint may hold it"
                )
            found.append(pid)
        return found
