"""A fake node daemon (``NodeDaemon``) that records calls and lets a test decide when jobs end."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Unpack

from gpusnap.daemon.gate.verdict import CompatVerdict
from gpusnap.daemon.jobs.job import Job, JobKind, JobState
from gpusnap.daemon.reclaim.node import CheckpointOrder, StoreAccess
from gpusnap.errors import FailedPrecondition, Unavailable, Unsupported
from gpusnap.storage.manifest import new_checkpoint_id
from gpusnap.storage.store import CheckpointStore


@dataclass
class Call:
    at: float  # monotonic
    workload: str
    leave_running: bool
    trigger: str
    deadline: float | None
    compress: bool
    job_id: str


@dataclass
class FakeStore:
    """The node's store handle: the given store, or ``Unavailable`` when there is none."""

    store: CheckpointStore | None = None

    def get(self) -> CheckpointStore:
        if self.store is None:
            raise Unavailable("this fake node has no store")
        return self.store


@dataclass
class FakeNode:
    """Checkpoint jobs end when the test calls ``finish`` — or at once, when ``auto`` says so.

    A restore is refused (not a standby node) and every checkpoint is compatible.
    """

    auto: dict[str, JobState] = field(default_factory=dict)  # purpose "kill"/"keep" -> end state
    can_cancel: bool = True
    exclusive: bool = True  # like the service: one checkpoint of a workload at a time
    store_handle: FakeStore = field(default_factory=FakeStore)
    calls: list[Call] = field(default_factory=list)
    cancels: list[tuple[str, float]] = field(default_factory=list)
    jobs: dict[str, Job] = field(default_factory=dict)
    done: dict[str, threading.Event] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    commit_times: dict[str, float] = field(default_factory=dict)

    @property
    def store(self) -> StoreAccess:
        return self.store_handle

    def checkpoint(self, **order: Unpack[CheckpointOrder]) -> Job:
        workload, leave_running = order["workload"], order["leave_running"]
        with self.lock:
            busy = [
                j
                for j in self.jobs.values()
                if j.workload == workload and not j.state.terminal and self.exclusive
            ]
            if busy:
                raise FailedPrecondition(f"workload {workload} already has job {busy[0].id}")
            jid = f"job-{next(self._ids)}"
            job = Job(jid, JobKind.CHECKPOINT, workload, state=JobState.RUNNING)
            job.trigger, job.deadline = order["trigger"], order["deadline"]
            self.jobs[jid] = job
            self.done[jid] = threading.Event()
            self.calls.append(Call(at=time.monotonic(), job_id=jid, **order))
        end = self.auto.get("keep" if leave_running else "kill")
        if end is not None:
            self.finish(jid, end)
        return job

    def finish(self, job_id: str, state: JobState = JobState.SUCCEEDED) -> None:
        with self.lock:
            job = self.jobs[job_id]
            if job.state.terminal:
                return
            job.state = state
            if state == JobState.SUCCEEDED:
                job.result = {
                    "checkpoint_id": new_checkpoint_id(),
                    "seconds": 1.0,
                    "committed_before_deadline": True,
                }
                self.commit_times[job_id] = time.monotonic()
            else:
                job.error = "it failed"
        self.done[job_id].set()

    def restore(self, *, checkpoint_id: str) -> Job:
        raise AssertionError(f"not a standby node: asked to restore {checkpoint_id}")

    def compat(self, checkpoint_id: str) -> CompatVerdict:
        return CompatVerdict(checkpoint_id, True)

    def get_job(self, job_id: str) -> Job:
        return self.jobs[job_id]

    def wait_job(self, job_id: str, timeout: float) -> Job:
        self.done[job_id].wait(timeout)
        return self.jobs[job_id]

    def cancel_job(self, job_id: str) -> Job:
        if not self.can_cancel:
            raise Unsupported("cancel is not supported")
        self.cancels.append((job_id, time.monotonic()))
        self.finish(job_id, JobState.CANCELLED)
        return self.jobs[job_id]

    def wait_calls(self, n: int, timeout: float = 10) -> list[Call]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if len(self.calls) >= n:
                    return list(self.calls)
            time.sleep(0.01)
        with self.lock:
            return list(self.calls)
