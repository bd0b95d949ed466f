"""Who may do what through the API: the roles, and the service as a caller who is not an
administrator sees it.

An administrator (uid 0, a member of ``[daemon] admin_group``, or a certificate
``[daemon.tcp.clients]`` maps to ``"admin"``; every certificate when there is no such table)
gets the service itself. Anyone else is a local user (a socket peer's uid, or the user a
certificate maps to) and gets a ``CallerView``: they may checkpoint and restore the configured
workloads whose ``allow_users``/``allow_groups`` name them, and ``--pid``/``--container`` trees
that run entirely as their own uid (and checkpoints recorded so); they may cancel the jobs they
started; they read jobs, checkpoints, workloads and status, with environment values hidden;
drills and migrations are an administrator's. A refusal is ``PermissionDenied`` saying why.
docs/operations.md has the table.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Unpack

from gpusnap.daemon.api.callers import Caller
from gpusnap.daemon.api.service_api import CheckpointArgs, DaemonServiceAPI, RestoreArgs
from gpusnap.daemon.config.file import Config, WorkloadConfig
from gpusnap.daemon.host import owners, proctree
from gpusnap.daemon.host.target import pid_root
from gpusnap.errors import PermissionDenied
from gpusnap.proto.wire import JobView, VerdictView, redact_env
from gpusnap.storage.manifest import check_checkpoint_id

if TYPE_CHECKING:
    from gpusnap.daemon.containers import RuntimeSet
    from gpusnap.daemon.node.node import StoreHandle

log = logging.getLogger(__name__)

ADMIN = "admin"  # the [daemon.tcp.clients] value that makes a certificate an administrator
_JOB_OWNERS_KEPT = 10_000  # whose jobs a member may cancel: the most recent this many


@dataclass(frozen=True)
class Principal:
    """A caller as the rules see it: a local user, or an administrator."""

    uid: int
    name: str
    groups: frozenset[str]
    admin: bool

    def describe(self) -> str:
        return f"{self.name} (uid {self.uid})"


class Authorizer:
    """The roles of ``config``, and whose the jobs started through the API are."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._job_owners: dict[str, int] = {}
        self._lock = threading.Lock()

    def principal(self, caller: Caller) -> Principal:
        """The rules' view of ``caller``; ``PermissionDenied`` for a certificate the
        configured clients do not name."""
        if caller.uid == 0:
            return Principal(0, "root", frozenset(), admin=True)
        if caller.uid is not None:
            gids = {*caller.groups, *([] if caller.gid is None else [caller.gid])}
            return self._local(caller.uid, _group_names(gids))
        tcp = self.config.daemon.tcp
        clients = tcp.clients if tcp is not None else None
        first = caller.cert_names[0] if caller.cert_names else "(no name)"
        if clients is None:
            return Principal(0, f"certificate {first}", frozenset(), admin=True)
        for name in caller.cert_names:
            role = clients.get(name)
            if role == ADMIN:
                return Principal(0, f"certificate {name}", frozenset(), admin=True)
            if role is not None:
                try:
                    user = pwd.getpwnam(role)
                except KeyError:
                    raise PermissionDenied(
                        f"certificate {name} maps to user {role!r}, who does not exist here"
                    ) from None
                groups = os.getgrouplist(user.pw_name, user.pw_gid)
                return self._local(user.pw_uid, _group_names(groups))
        raise PermissionDenied(
            f"certificate {first} is not in [daemon.tcp.clients]: it may do nothing here"
        )

    def _local(self, uid: int, groups: frozenset[str]) -> Principal:
        admin_group = self.config.daemon.admin_group
        admin = uid == 0 or (admin_group is not None and admin_group in groups)
        return Principal(uid, owners.user_name(uid), groups, admin)

    def allows(self, workload: WorkloadConfig, who: Principal) -> bool:
        """True when ``workload``'s ``allow_users``/``allow_groups`` name ``who``."""
        return (
            who.admin
            or who.name in workload.allow_users
            or str(who.uid) in workload.allow_users
            or bool(who.groups & set(workload.allow_groups))
        )

    def started(self, job_id: str, who: Principal) -> None:
        with self._lock:
            self._job_owners[job_id] = who.uid
            if len(self._job_owners) > _JOB_OWNERS_KEPT:  # the oldest first (insertion order)
                del self._job_owners[next(iter(self._job_owners))]

    def started_by(self, job_id: str, who: Principal) -> bool:
        with self._lock:
            return self._job_owners.get(job_id) == who.uid


def _group_names(gids: Iterable[int]) -> frozenset[str]:
    names = set()
    for gid in gids:
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            names.add(str(gid))
    return frozenset(names)


class AuthorizedService(DaemonServiceAPI, Protocol):
    """What a ``CallerView`` needs of the service besides its API."""

    def checkpoint_as(self, run_as: int | None, **request: Unpack[CheckpointArgs]) -> JobView:
        """``checkpoint``, whose job refuses the tree unless every process in it runs as
        ``run_as`` when it looks (None: no such check)."""
        ...


class CallerView:
    """``DaemonServiceAPI`` for a caller who is not an administrator: each call the rules
    allow goes to ``service``; any other raises ``PermissionDenied`` saying why."""

    def __init__(
        self,
        service: AuthorizedService,
        who: Principal,
        rules: Authorizer,
        *,
        store: StoreHandle,
        containers: RuntimeSet,
    ) -> None:
        self._service = service
        self._who = who
        self._rules = rules
        self._store = store
        self._containers = containers

    def for_caller(self, caller: Caller) -> DaemonServiceAPI:
        return self._service.for_caller(caller)

    # --- what acts on processes -----------------------------------------------------------

    def checkpoint(self, **request: Unpack[CheckpointArgs]) -> JobView:
        self._check_target(
            request["pid"], request["workload"], request["container"], request["runtime"]
        )
        # A workload the caller is allowed is the operator's grant, whoever it runs as; an
        # ad-hoc tree must still be the caller's own when the job looks at it.
        run_as = None if request["workload"] is not None else self._who.uid
        return self._started(self._service.checkpoint_as(run_as, **request))

    def preflight(
        self,
        *,
        pid: int | None = None,
        workload: str | None = None,
        container: str | None = None,
        runtime: str | None = None,
    ) -> Mapping[str, Any]:
        # What preflight reads of a tree (its sockets, files, locks) is the caller's only
        # where the tree is one the caller may checkpoint.
        self._check_target(pid, workload, container, runtime)
        return self._service.preflight(
            pid=pid, workload=workload, container=container, runtime=runtime
        )

    def _check_target(
        self, pid: int | None, workload: str | None, container: str | None, runtime: str | None
    ) -> None:
        """The caller may checkpoint this target: a workload that allows them, or a tree (a
        pid's, a container's) that runs entirely as them."""
        if workload is not None:
            self._check_workload(workload, "checkpoint")
        elif pid is not None:
            root = pid_root(pid)
            self._check_named(proctree.workload_name(root))
            self._check_tree(proctree.tree_pids(root), f"pid {root}")
        elif container is not None:
            _, info = self._containers.find(container, runtime)
            for w in self._rules.config.workloads:
                if w.container in (container, info.name, info.id):
                    self._check_workload(w.name, "checkpoint")
                    break
            else:
                self._check_named(info.name)
            pids = [p for pid in info.pids for p in proctree.tree_pids(pid)]
            self._check_tree(pids, f"container {info.name}")

    def restore(self, **request: Unpack[RestoreArgs]) -> JobView:
        checkpoint_id = request["checkpoint_id"]
        if checkpoint_id is None and request["workload"] and request["latest"]:
            wcfg = self._rules.config.workload(request["workload"])
            if wcfg is not None and self._rules.allows(wcfg, self._who):
                return self._started(self._service.restore(**request))
            latest = self._store.get().latest(request["workload"])
            if latest is None:
                return self._service.restore(**request)  # its own "no checkpoint" error
            # The one judged here is the one restored, whatever is committed meanwhile.
            checkpoint_id = latest.checkpoint_id
            request = {**request, "checkpoint_id": checkpoint_id, "workload": None, "latest": False}
        if checkpoint_id is not None:
            check_checkpoint_id(checkpoint_id)
            manifest = self._store.get().manifest(checkpoint_id)
            self._check_restorable(checkpoint_id, manifest.workload, manifest.stamp)
        return self._started(self._service.restore(**request))

    def _started(self, job: JobView) -> JobView:
        self._rules.started(job.id, self._who)
        return job

    def _check_restorable(
        self, checkpoint_id: str, workload: str, stamp: Mapping[str, Any]
    ) -> None:
        wcfg = self._rules.config.workload(workload)
        if wcfg is not None:
            self._check_workload(workload, "restore")
            return
        process = stamp.get("process") or {}
        uids = process.get("uids") if isinstance(process, dict) else None
        if not isinstance(uids, list) or not uids:
            raise PermissionDenied(
                f"{self._who.describe()} may not restore {checkpoint_id}: it records no owner "
                "of its processes (an administrator's checkpoint)"
            )
        others = sorted({u for u in uids if u != self._who.uid})
        if others:
            raise PermissionDenied(
                f"{self._who.describe()} may not restore {checkpoint_id}: its processes ran "
                f"as uid {', '.join(str(u) for u in others)}, not only as you"
            )

    def _check_workload(self, name: str, what: str) -> None:
        wcfg = self._rules.config.workload(name)
        if wcfg is None:
            return  # the service says it does not exist
        if not self._rules.allows(wcfg, self._who):
            raise PermissionDenied(
                f"{self._who.describe()} may not {what} workload {name}: its allow_users and "
                "allow_groups do not name you"
            )

    def _check_named(self, name: str) -> None:
        """An ad-hoc checkpoint is stored under its tree's name: never as a configured
        workload the caller is not allowed (it would become that workload's latest)."""
        if self._rules.config.workload(name) is not None:
            self._check_workload(name, "checkpoint as")

    def _check_tree(self, pids: Sequence[int], what: str) -> None:
        reasons = owners.tree_reasons(pids, self._who.uid)
        if reasons:
            more = f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""
            raise PermissionDenied(
                f"{self._who.describe()} may not checkpoint {what}: {reasons[0]}{more}"
            )

    def cancel_job(self, job_id: str) -> JobView:
        if not self._rules.started_by(job_id, self._who):
            self._service.get_job(job_id)  # a job that does not exist is not_found
            raise PermissionDenied(
                f"{self._who.describe()} may not cancel job {job_id}: you did not start it"
            )
        return self._service.cancel_job(job_id)

    def drill(self, deadline_s: float | None) -> JobView:
        raise self._admin_only("run a reclaim drill")

    def withdraw_migration(self, checkpoint_id: str, reason: str) -> Mapping[str, Any]:
        raise self._admin_only("withdraw a migration")

    def _admin_only(self, what: str) -> PermissionDenied:
        return PermissionDenied(f"{self._who.describe()} may not {what}: it needs an administrator")

    # --- what only reads --------------------------------------------------------------------

    def show_checkpoint(self, checkpoint_id: str) -> Mapping[str, Any]:
        return redact_env(self._service.show_checkpoint(checkpoint_id))

    def compat(self, checkpoint_id: str) -> VerdictView:
        return self._service.compat(checkpoint_id)

    def get_job(self, job_id: str) -> JobView:
        return self._service.get_job(job_id)

    def list_jobs(self, limit: int = 50) -> Sequence[JobView]:
        return self._service.list_jobs(limit)

    def watch_job(self, job_id: str) -> Iterator[JobView]:
        return self._service.watch_job(job_id)

    def list_checkpoints(self, workload: str | None = None) -> Sequence[Mapping[str, Any]]:
        return self._service.list_checkpoints(workload)

    def list_workloads(self) -> Sequence[Mapping[str, Any]]:
        return self._service.list_workloads()

    def status(self) -> Mapping[str, Any]:
        return self._service.status()

    def triggers_status(self) -> Mapping[str, Any]:
        return self._service.triggers_status()

    def migrations(self) -> Sequence[Mapping[str, Any]]:
        return self._service.migrations()
