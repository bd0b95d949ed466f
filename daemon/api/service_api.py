"""The service surface the gRPC servicers translate to: what gpusnapd can be asked to do.

``DaemonServiceAPI`` is a structural type: ``daemon/service.py``'s ``DaemonService`` satisfies
it, and so does any test double. The servicers (``daemon/api/servicers.py``) only convert
protobuf messages to these calls and the results back; every decision, every check of an
argument included, is made behind this interface. Methods raise the error kinds of
``gpusnap.errors``. Jobs and verdicts are typed by the shape the wire needs of them
(``gpusnap.proto.wire.JobView``/``VerdictView``), so this package imports nothing of the daemon's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, TypedDict, Unpack

from gpusnap.daemon.api.callers import Caller
from gpusnap.proto.wire import JobView, VerdictView


class CheckpointArgs(TypedDict):
    """``checkpoint``'s keywords, every one given: what a ``CreateCheckpointRequest`` carries.
    Exactly one of ``pid``, ``workload`` and ``container`` is not None (the service checks)."""

    pid: int | None
    workload: str | None
    leave_running: bool
    trigger: str  # "operator" when the request names none
    deadline: float | None  # epoch seconds by which it must commit; None: none
    container: str | None
    runtime: str | None  # with a container only; None: the runtime that has it


class RestoreArgs(TypedDict):
    """``restore``'s keywords, every one given: what a ``RestoreRequest`` carries. Which of
    ``checkpoint_id``, ``workload`` and ``latest`` go together is the service's to check."""

    checkpoint_id: str | None
    workload: str | None
    latest: bool
    name: str | None  # restore a container checkpoint as this container
    allow_rollback: bool  # with latest: accept what the store holds (storage/heads.py)


class DaemonServiceAPI(Protocol):
    """What ``DaemonService`` offers its API; mirrored one-to-one by ``gpusnap.v1`` RPCs."""

    def for_caller(self, caller: Caller) -> DaemonServiceAPI:
        """The service as ``caller`` may use it: every call it may not make raises
        ``PermissionDenied`` saying why (``daemon/authz.py``); itself for an administrator."""
        ...

    def checkpoint(self, **request: Unpack[CheckpointArgs]) -> JobView:
        """Queue a checkpoint of ``pid``'s tree, a configured workload or a container (in
        ``runtime``, or the one that has it); returns at once."""
        ...

    def restore(self, **request: Unpack[RestoreArgs]) -> JobView:
        """Queue a restore of a checkpoint (or a workload's latest); returns at once. ``name``:
        a container checkpoint restored as that container."""
        ...

    def preflight(
        self,
        *,
        pid: int | None = None,
        workload: str | None = None,
        container: str | None = None,
        runtime: str | None = None,
    ) -> Mapping[str, Any]:
        """Why the target cannot be checkpointed now: ``checkpointable``, ``blockers``,
        ``notes`` (``PreflightResponse``'s fields)."""
        ...

    def compat(self, checkpoint_id: str) -> VerdictView:
        """The compatibility gate's verdict for this node, without acting on it."""
        ...

    def get_job(self, job_id: str) -> JobView: ...

    def list_jobs(self, limit: int = 50) -> Sequence[JobView]: ...

    def cancel_job(self, job_id: str) -> JobView: ...

    def watch_job(self, job_id: str) -> Iterator[JobView]:
        """A snapshot now and on each change; ends after a terminal state."""
        ...

    def list_checkpoints(self, workload: str | None = None) -> Sequence[Mapping[str, Any]]:
        """Summaries, newest first; keys are ``CheckpointSummary``'s fields."""
        ...

    def show_checkpoint(self, checkpoint_id: str) -> Mapping[str, Any]:
        """The manifest (free-form), stamp included."""
        ...

    def list_workloads(self) -> Sequence[Mapping[str, Any]]:
        """Keys are ``Workload``'s fields."""
        ...

    def status(self) -> Mapping[str, Any]:
        """Keys are ``DaemonStatus``'s fields."""
        ...

    def triggers_status(self) -> Mapping[str, Any]: ...

    def migrations(self) -> Sequence[Mapping[str, Any]]: ...

    def withdraw_migration(self, checkpoint_id: str, reason: str) -> Mapping[str, Any]:
        """End a migration request no node has claimed; the migration as ``migrations``
        shows it."""
        ...

    def drill(self, deadline_s: float | None) -> JobView:
        """Rehearse a reclaim: checkpoint as if a notice had arrived now."""
        ...
