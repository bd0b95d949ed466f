"""Which process tree a checkpoint takes, and the trees no checkpoint can capture.

A configured workload is found by its ``pid_file``, ``systemd_unit`` or ``match`` (a unit's
tree that a restore moved into ``gpusnap-<workload>-<job>.scope`` is found there); a ``--pid``
names its root itself. Either way init and kernel threads are refused with the reason, and the
daemon never finds itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from gpusnap.daemon.host import owners, proctree, scopes
from gpusnap.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied


class WorkloadFacts(Protocol):
    """What finding a workload's tree needs of its configuration (the daemon config's
    ``WorkloadConfig`` has these): its name and how it is found."""

    @property
    def name(self) -> str: ...
    @property
    def pid_file(self) -> Path | None: ...
    @property
    def systemd_unit(self) -> str | None: ...
    @property
    def match(self) -> str | None: ...
    @property
    def user(self) -> str | None: ...


def workload_root(w: WorkloadFacts) -> int:
    """The root pid of the configured workload ``w``'s running tree."""
    if w.pid_file is None and w.systemd_unit is None and w.match is None:
        raise FailedPrecondition(
            f"workload {w.name} has no pid_file, systemd_unit or match in the config; "
            "checkpoint it with --pid"
        )
    try:
        pids = proctree.find_pids(
            pid_file=str(w.pid_file) if w.pid_file else None,
            systemd_unit=w.systemd_unit,
            match=w.match,
            user=w.user,
        )
    except NotFound:
        # A restore moved a unit's tree into a scope of its own: it is the workload still.
        restored = scopes.restored_root(w.name) if w.systemd_unit else None
        if restored is None:
            raise
        pids = proctree.tree_pids(restored)
    pids = [p for p in pids if p != os.getpid()]
    if not pids:
        raise NotFound(f"workload {w.name} is not running (no process found)")
    if w.user is not None:
        # Whoever may write the pid file (the workload's user) may name only their own tree.
        reasons = owners.tree_reasons(pids, owners.user_uid(w.user))
        if reasons:
            raise PermissionDenied(f"workload {w.name} (user {w.user}): {reasons[0]}")
    check_checkpointable(pids[0], workload=w.name)
    return pids[0]


def workload_reasons(w: WorkloadFacts) -> list[str]:
    """Why the config's way of finding workload ``w`` would be refused, without looking for
    its processes: a pid file gpusnapd cannot trust, a ``user`` that does not exist. Empty
    when there is nothing to refuse (``gpusnap preflight`` shows these; the job raises them)."""
    reasons = []
    if w.user is not None:
        try:
            owners.user_uid(w.user)
        except InvalidArgument as err:
            reasons.append(f"workload {w.name}: user: {err}")
    if w.pid_file is not None:
        reasons += [
            f"workload {w.name}: {r}" for r in owners.pid_file_reasons(Path(w.pid_file), w.user)
        ]
    return reasons


def pid_root(pid: int) -> int:
    """``pid`` itself, once it is known to be a live process a checkpoint can take."""
    if not 0 < pid <= proctree.PID_MAX_LIMIT:
        raise InvalidArgument(f"not a process id: {pid} (1 to {proctree.PID_MAX_LIMIT})")
    if pid == os.getpid():
        raise InvalidArgument("gpusnapd cannot checkpoint itself")
    if not proctree.exists(pid):
        raise NotFound(f"no such process: {pid}")
    check_checkpointable(pid)
    return pid


def check_checkpointable(pid: int, *, workload: str | None = None) -> None:
    """Refuse, with the reason, a process no checkpoint can capture."""
    what = f"workload {workload}: pid {pid}" if workload else f"pid {pid}"
    if pid == 1:
        raise InvalidArgument(
            f"{what} is init: gpusnapd does not checkpoint PID 1 (a kill-mode dump would "
            "stop the whole system or container, and it could be restored only as the init "
            "of a new one)"
        )
    if proctree.is_kernel_thread(pid):
        raise InvalidArgument(
            f"{what} ({proctree.comm(pid)}) is a kernel thread: it has no user memory "
            "and cannot be checkpointed"
        )
