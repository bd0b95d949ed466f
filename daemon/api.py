"""The service surface the gRPC servicer translates to: what gpusnapd can be asked to do.

``DaemonServiceAPI`` is a structural type: ``daemon/service.py``'s ``DaemonService`` satisfies
it, and so does any test double. The servicer (``daemon/grpc_server.py``) only converts
protobuf messages to these calls and the results back; every decision is made behind this
interface. Methods raise the error kinds of ``gpusnap.errors``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from gpusnap.daemon.jobs.job import Job
from gpusnap.daemon.verdict import CompatVerdict


class DaemonServiceAPI(Protocol):
    """What ``DaemonService`` offers its API; mirrored one-to-one by ``gpusnap.v1`` RPCs."""

    def checkpoint(
        self,
        *,
        pid: int | None = None,
        workload: str | None = None,
        leave_running: bool = False,
        trigger: str = "operator",
        deadline: float | None = None,
    ) -> Job:
        """Queue a checkpoint of ``pid``'s tree or of a configured workload; returns at once."""
        ...

    def restore(
        self,
        *,
        checkpoint_id: str | None = None,
        workload: str | None = None,
        latest: bool = False,
    ) -> Job:
        """Queue a restore of a checkpoint (or a workload's latest); returns at once."""
        ...

    def compat(self, checkpoint_id: str) -> CompatVerdict:
        """The compatibility gate's verdict for this node, without acting on it."""
        ...

    def get_job(self, job_id: str) -> Job: ...

    def list_jobs(self, limit: int = 50) -> list[Job]: ...

    def cancel_job(self, job_id: str) -> Job: ...

    def watch_job(self, job_id: str) -> Iterator[Job]:
        """A snapshot now and on each change; ends after a terminal state."""
        ...

    def list_checkpoints(self, workload: str | None = None) -> list[dict[str, Any]]: ...

    def show_checkpoint(self, checkpoint_id: str) -> dict[str, Any]: ...

    def list_workloads(self) -> list[dict[str, Any]]: ...

    def status(self) -> dict[str, Any]: ...

    def triggers_status(self) -> dict[str, Any]: ...

    def migrations(self) -> list[dict[str, Any]]: ...

    def drill(self, deadline_s: float | None) -> Job:
        """Rehearse a reclaim: checkpoint as if a notice had arrived now."""
        ...
