"""``NodeDaemon``: everything reclaim needs from the node daemon, in one Protocol.

The policy starts, waits for and cancels checkpoint jobs; the standby loop judges and restores
checkpoints; the runtime reads stamps and opens the migration board through the store.
``gpusnap.daemon.service.DaemonService`` satisfies this structurally (nothing here imports
it, so reclaim never depends on the service); tests pass a fake node with the same methods.
"""

from __future__ import annotations

from typing import Protocol, TypedDict, Unpack

from gpusnap.daemon.jobs.job import Job
from gpusnap.daemon.reclaim.standby import Verdict
from gpusnap.storage.store import CheckpointStore


class CheckpointOrder(TypedDict):
    """What reclaim asks of a checkpoint, every key given (the keywords of ``checkpoint``)."""

    workload: str  # a configured workload
    leave_running: bool  # False: kill mode, the reclaim; True: a background checkpoint
    trigger: str  # recorded in the job: "reclaim:aws", "periodic", ...
    deadline: float | None  # epoch seconds by which it must commit; None: none
    compress: bool


class StoreAccess(Protocol):
    """The daemon's handle on its store: opened lazily, ``Unavailable`` while unreachable."""

    def get(self) -> CheckpointStore: ...


class NodeDaemon(Protocol):
    """The node daemon, as reclaim uses it."""

    @property
    def store(self) -> StoreAccess: ...

    def checkpoint(self, **order: Unpack[CheckpointOrder]) -> Job:
        """Queue a checkpoint job of a configured workload and return it at once;
        ``FailedPrecondition`` while another checkpoint of it runs."""
        ...

    def restore(self, *, checkpoint_id: str) -> Job:
        """Queue a restore (or, on a mismatch, a cold start) of a checkpoint."""
        ...

    def compat(self, checkpoint_id: str) -> Verdict:
        """Whether this node matches a checkpoint's stamp, and every reason it does not."""
        ...

    def get_job(self, job_id: str) -> Job: ...

    def wait_job(self, job_id: str, timeout: float) -> Job:
        """The job once terminal, or as it stands after ``timeout`` seconds."""
        ...

    def cancel_job(self, job_id: str) -> Job:
        """Ask a running job to stop; may raise ``Unsupported``."""
        ...
