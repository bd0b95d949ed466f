"""``DaemonService``: what gpusnapd does, behind the gRPC API (``daemon/api/``).

The service decides; the servicer only translates. Checkpoint and restore requests become
jobs (``daemon/jobs/``) whose bodies are ``checkpoint.run_checkpoint`` and
``restore.run_restore``; they get the node (``node.Node``), never the service. Everything else
(compat, checkpoints, workloads, status) answers at once.

Concurrency: two checkpoints of one workload at once are refused — a second request while
one is queued or running fails with ``FailedPrecondition`` "workload X already has checkpoint
job J running" — because a second dump of a tree that is being dumped (or was just killed by
a kill-mode dump) can only fail or capture the same state again. A caller that wants to wait
(e.g. a reclaim notice arriving during a periodic checkpoint) can look at
``active_checkpoint(workload)`` and watch that job instead.

Reclaim (triggers, policy, migration: ``daemon/reclaim/``) attaches its ``ReclaimRuntime``
through ``attach_reclaim``; the service is the ``NodeDaemon`` it drives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Unpack

from gpusnap.daemon.api.callers import Caller
from gpusnap.daemon.api.service_api import CheckpointArgs, DaemonServiceAPI
from gpusnap.daemon.authz import Authorizer, CallerView
from gpusnap.daemon.config.file import Config, WorkloadConfig
from gpusnap.daemon.containers import RuntimeSet
from gpusnap.daemon.gate.verdict import CompatVerdict
from gpusnap.daemon.gpu.adapter import GpuAdapter, open_gpu
from gpusnap.daemon.host import preflight, proctree
from gpusnap.daemon.host.criu import Criu
from gpusnap.daemon.host.reaper import Reaper
from gpusnap.daemon.host.target import pid_root, workload_root
from gpusnap.daemon.infra.metrics import METRICS
from gpusnap.daemon.infra.statedir import StateDirLock, StateDirs
from gpusnap.daemon.jobs.executor import JobContext, JobExecutor
from gpusnap.daemon.jobs.job import Job, JobKind
from gpusnap.daemon.jobs.journal import Journal
from gpusnap.daemon.node import status as status_report
from gpusnap.daemon.node.node import HostFacts, Node, StoreHandle
from gpusnap.daemon.node.storecheck import STATE_FILE, StoreChecker
from gpusnap.daemon.pipelines import recovery
from gpusnap.daemon.pipelines.checkpoint import CheckpointPlan, run_checkpoint
from gpusnap.daemon.pipelines.container_checkpoint import (
    check_container_name,
    container_plan,
    run_container_checkpoint,
)
from gpusnap.daemon.pipelines.restore import RestorePlan, run_restore
from gpusnap.daemon.reclaim.runtime import ReclaimRuntime
from gpusnap.errors import (
    FailedPrecondition,
    GpusnapError,
    InvalidArgument,
    NotFound,
    Unsupported,
)
from gpusnap.storage.manifest import check_checkpoint_id, check_workload

log = logging.getLogger(__name__)


class DaemonService:
    """The node daemon's core. Thread-safe; one instance per daemon."""

    def __init__(
        self,
        config: Config,
        *,
        criu: Criu | None = None,
        gpu: GpuAdapter | None = None,
        open_store_now: bool = True,
        state_lock: StateDirLock | None = None,
    ) -> None:
        self.config = config
        dirs = StateDirs.of(config.daemon.state_dir, config.daemon.staging_dir)
        # First of all, before the journal's recovery or the staging cleanup can touch
        # anything: this state dir is ours alone, or we stop here (see daemon/infra/statedir.py).
        self.state_lock = state_lock or StateDirLock.acquire(dirs.state, config.daemon.staging_dir)
        dirs.prepare()
        if not config.store.verify:
            log.warning(
                "[store] verify = false: manifest signatures are NOT checked. This daemon will "
                "checkpoint, but it refuses to restore, cold-start or adopt a migration from "
                "this store, since anyone who can write to it could make it run their code"
            )
        self.started_at = time.time()
        criu = criu or Criu()
        gpu = gpu or open_gpu(
            driver=config.gpu.driver,
            call_timeout_s=config.gpu.call_timeout_s,
            lock_timeout_s=config.gpu.lock_timeout_s,
            copy_rate_gbps=config.gpu.copy_rate_gbps,
            nvidia_version_file=str(config.gpu.nvidia_version_file),
        )
        self.journal = Journal(dirs.state / "jobs.sqlite")
        self.store = StoreHandle(config)
        reaper = Reaper()
        reaper.start()
        self.node = Node(
            config=config,
            criu=criu,
            gpu=gpu,
            store=self.store,
            dirs=dirs,
            host=HostFacts(criu, config.daemon.node_id),
            reaper=reaper,
            containers=RuntimeSet(
                config.containers.options,
                detect=config.containers.detect,
                criu=lambda: criu.path,
            ),
        )
        # A dead daemon's jobs: interrupted, and what they left in staging settled (a
        # kill-mode dump's images restored) before any new job runs (daemon/pipelines/recovery.py).
        self.interrupted = recovery.recover(self.node, self.journal)
        self.executor = JobExecutor(
            self.journal, max_jobs=config.daemon.max_jobs, on_finish=self._job_finished
        )
        # The background store check; its schedule is started by daemon/main.py.
        self.store_check = StoreChecker(
            self.store,
            interval=config.store.check_interval,
            state_file=dirs.state / STATE_FILE,
            store_url=config.store.url,
        )
        self.on_shutdown: list[Callable[[], None]] = []
        self.reclaim: ReclaimRuntime | None = None
        self.authz = Authorizer(config)
        if open_store_now:
            try:
                self.store.get()
            except GpusnapError as err:
                log.warning(
                    "store %s is not reachable now (%s); serving anyway", config.store.url, err
                )

    # --- callers ----------------------------------------------------------------------------

    def for_caller(self, caller: Caller) -> DaemonServiceAPI:
        """The service itself for an administrator, else what ``caller`` may do of it."""
        who = self.authz.principal(caller)
        if who.admin:
            return self
        return CallerView(self, who, self.authz, store=self.store, containers=self.node.containers)

    def checkpoint_as(self, run_as: int | None, **request: Unpack[CheckpointArgs]) -> Job:
        return self.checkpoint(**request, run_as=run_as)

    # --- checkpoint -----------------------------------------------------------------------

    def checkpoint(
        self,
        *,
        pid: int | None = None,
        workload: str | None = None,
        leave_running: bool = False,
        trigger: str = "operator",
        deadline: float | None = None,
        compress: bool | None = None,
        container: str | None = None,
        runtime: str | None = None,
        run_as: int | None = None,
    ) -> Job:
        """Queue a checkpoint; returns at once. ``compress`` None: the config decides.
        ``run_as``: the job refuses a tree with a process that does not run as this uid."""
        wcfg, container, runtime = self._target(pid, workload, container, runtime)
        if container is not None:
            return self._checkpoint_container(
                container,
                runtime=runtime,
                workload=wcfg,
                leave_running=leave_running,
                trigger=trigger,
                deadline=deadline,
                compress=compress,
            )
        if wcfg is not None:
            root = workload_root(wcfg)
            name = wcfg.name
        else:
            assert pid is not None
            root = pid_root(pid)
            # A stable name for an ad-hoc --pid checkpoint: the script's name for an
            # interpreter running a script (python3 tinylm.py -> tinylm), else the comm.
            name = proctree.workload_name(pid)
            wcfg = self.config.workload(name)
        plan = CheckpointPlan(
            root_pid=root,
            workload=name,
            config=wcfg,
            leave_running=leave_running,
            compress=self.config.store.compress if compress is None else compress,
            store_check=self.store_check,
            run_as=run_as,
        )
        node = self.node
        return self._submit_checkpoint(
            name, lambda ctx: run_checkpoint(node, ctx, plan), trigger, deadline
        )

    def _target(
        self, pid: int | None, workload: str | None, container: str | None, runtime: str | None
    ) -> tuple[WorkloadConfig | None, str | None, str | None]:
        """A checkpoint's (or a preflight's) target checked: the workload's config, and the
        container and runtime (a configured container workload's)."""
        if [pid, workload, container].count(None) != 2:
            raise InvalidArgument("give exactly one of a pid, a workload name or a container")
        if runtime is not None and container is None:
            raise InvalidArgument("a runtime goes with a container (--container NAME --runtime)")
        wcfg: WorkloadConfig | None = None
        if workload is not None:
            wcfg = self.config.workload(workload)
            if wcfg is None:
                known = ", ".join(w.name for w in self.config.workloads) or "none"
                raise NotFound(f"no workload {workload!r} in the config (configured: {known})")
        if wcfg is not None and wcfg.container is not None:
            container, runtime = wcfg.container, wcfg.runtime
        return wcfg, container, runtime

    def preflight(
        self,
        *,
        pid: int | None = None,
        workload: str | None = None,
        container: str | None = None,
        runtime: str | None = None,
    ) -> dict[str, Any]:
        """Every reason the target cannot be checkpointed now (``host/preflight.py``), found
        the way a checkpoint finds it; nothing is frozen. The ``gpusnap preflight`` document."""
        wcfg, container, runtime = self._target(pid, workload, container, runtime)
        if container is not None:
            rt, info = self.node.containers.find(container, runtime)
            if not info.running:
                raise FailedPrecondition(f"{rt.name}: container {info.name!r} is not running")
            tree = proctree.tree_pids(info.pids[0])
            return preflight.check_for(self.node.criu, tree, tmpfs=False).to_json()
        if wcfg is not None:
            root = workload_root(wcfg)
        else:
            assert pid is not None
            root = pid_root(pid)
        return preflight.check_for(self.node.criu, proctree.tree_pids(root)).to_json()

    def _checkpoint_container(
        self,
        ref: str,
        *,
        runtime: str | None,
        workload: WorkloadConfig | None,
        leave_running: bool,
        trigger: str,
        deadline: float | None,
        compress: bool | None,
    ) -> Job:
        plan = container_plan(
            self.node.containers,
            self.config,
            ref=ref,
            runtime=runtime,
            workload=workload,
            leave_running=leave_running,
            compress=self.config.store.compress if compress is None else compress,
            store_check=self.store_check,
        )
        node = self.node
        return self._submit_checkpoint(
            plan.workload, lambda ctx: run_container_checkpoint(node, ctx, plan), trigger, deadline
        )

    def _submit_checkpoint(
        self,
        name: str,
        body: Callable[[JobContext], None],
        trigger: str,
        deadline: float | None,
    ) -> Job:
        """Queue checkpoint job ``body`` of workload ``name``: one at a time per workload."""
        return self.executor.submit(
            JobKind.CHECKPOINT,
            name,
            body,
            trigger=trigger,
            deadline=deadline,
            exclusive=f"checkpoint:{name}",
            exclusive_message=lambda j: (
                f"workload {name} already has checkpoint job {j.id} {j.state.value}"
            ),
        )

    def active_checkpoint(self, workload: str) -> Job | None:
        jobs = self.executor.active(kind=JobKind.CHECKPOINT, workload=workload)
        return jobs[0] if jobs else None

    # --- restore --------------------------------------------------------------------------

    def restore(
        self,
        *,
        checkpoint_id: str | None = None,
        workload: str | None = None,
        latest: bool = False,
        name: str | None = None,
        allow_rollback: bool = False,
    ) -> Job:
        if name is not None:
            check_container_name(name)
        if checkpoint_id:
            check_checkpoint_id(checkpoint_id)
            if workload or latest:
                raise InvalidArgument("give a checkpoint id, or --workload NAME --latest, not both")
        elif workload:
            check_workload(workload)
            if not latest:
                raise InvalidArgument(
                    "restore by workload needs --latest (or give a checkpoint id)"
                )
        else:
            raise InvalidArgument("give a checkpoint id, or --workload NAME --latest")
        self.node.require_verified("restore")
        if allow_rollback and not latest:
            raise InvalidArgument("--allow-rollback goes with --workload NAME --latest")
        plan = RestorePlan(
            checkpoint_id=checkpoint_id or None,
            workload=workload or None,
            name=name,
            allow_rollback=allow_rollback,
        )
        node = self.node
        return self.executor.submit(
            JobKind.RESTORE,
            workload or "",
            lambda ctx: run_restore(node, ctx, plan),
        )

    def compat(self, checkpoint_id: str) -> CompatVerdict:
        check_checkpoint_id(checkpoint_id)
        self.node.require_verified("judge a checkpoint for restore")
        manifest = self.store.get().manifest(checkpoint_id)
        reasons = self.node.reasons(manifest)
        return CompatVerdict(checkpoint_id, not reasons, tuple(reasons))

    # --- jobs -----------------------------------------------------------------------------

    def get_job(self, job_id: str) -> Job:
        return self.executor.get(job_id)

    def list_jobs(self, limit: int = 50) -> list[Job]:
        if limit < 0:
            raise InvalidArgument(f"limit must not be negative, not {limit}")
        return self.executor.recent(limit or 50)

    def cancel_job(self, job_id: str) -> Job:
        return self.executor.cancel(job_id)

    def watch_job(self, job_id: str) -> Iterator[Job]:
        return self.executor.watch(job_id)

    def wait_job(self, job_id: str, timeout: float) -> Job:
        """The job once terminal, or as it stands after ``timeout`` seconds."""
        return self.executor.wait_terminal(job_id, timeout)

    # --- checkpoints, workloads, status -----------------------------------------------------

    def list_checkpoints(self, workload: str | None = None) -> list[dict[str, Any]]:
        if workload:
            check_workload(workload)
        return [s.as_dict() for s in self.store.get().list(workload or None)]

    def show_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        check_checkpoint_id(checkpoint_id)
        manifest = self.store.get().manifest(checkpoint_id)
        data = manifest.to_dict()
        # The chunk lists are for the store; an operator wants each file's size, mode and
        # how many chunks it is.
        data["files"] = [
            {"path": f.path, "size": f.size, "mode": f.mode, "chunk_count": len(f.chunks)}
            for f in manifest.files
        ]
        data["bytes_total"] = manifest.bytes_total
        return data

    def list_workloads(self) -> list[dict[str, Any]]:
        return status_report.workloads(self.node, self.active_checkpoint)

    def status(self) -> dict[str, Any]:
        daemon = status_report.DaemonFacts(
            started_at=self.started_at,
            jobs_running=self.executor.running(),
            interrupted_at_start=[j.id for j in self.interrupted],
            # Attached is not watching: with provider "none" no notice can come.
            triggers=self.reclaim is not None and self.reclaim.provider() != "none",
            trigger_provider=self.reclaim.provider() if self.reclaim is not None else "none",
            store_check=self.store_check.status(),
        )
        return status_report.daemon_status(self.node, daemon)

    # --- reclaim ---------------------------------------------------------------------------

    def attach_reclaim(self, runtime: ReclaimRuntime) -> None:
        self.reclaim = runtime

    def triggers_status(self) -> dict[str, Any]:
        if self.reclaim is None:
            return {"provider": "none", "running": False}
        state = self.reclaim.status()
        for w in state.get("workloads") or []:  # whether each runs, and as which pid
            wcfg = self.config.workload(str(w.get("workload")))
            try:
                w["pid"] = workload_root(wcfg) if wcfg is not None else None
            except GpusnapError:
                w["pid"] = None
        return state

    def migrations(self) -> list[dict[str, Any]]:
        return [] if self.reclaim is None else self.reclaim.migrations()

    def withdraw_migration(self, checkpoint_id: str, reason: str = "") -> dict[str, Any]:
        check_checkpoint_id(checkpoint_id)
        if self.reclaim is None:
            raise Unsupported("withdrawing a migration needs the reclaim runtime, not running")
        return self.reclaim.withdraw(checkpoint_id, reason)

    def _job_finished(self, job: Job) -> None:
        _job_finished(job)
        if self.reclaim is not None:
            self.reclaim.on_job_finished(job)  # a migration it makes stale is superseded

    def drill(self, deadline_s: float | None) -> Job:
        if self.reclaim is None:
            raise Unsupported("reclaim drills need the trigger manager, which is not running")
        return self.reclaim.drill(deadline_s)

    # --- shutdown -------------------------------------------------------------------------------

    def close(self, *, timeout: float | None = 30.0) -> None:
        """Stop: shutdown hooks, then running jobs get ``timeout`` seconds, then close."""
        for hook in list(self.on_shutdown):
            try:
                hook()
            except Exception:
                log.exception("shutdown hook %r failed", hook)
        if self.reclaim is not None:
            try:
                self.reclaim.stop()
            except Exception:
                log.exception("stopping the trigger manager failed")
        self.store_check.stop()
        if not self.executor.shutdown(timeout=timeout):
            log.warning("jobs still running at shutdown; they will show as interrupted")
        self.node.reaper.stop()
        self.store.close()
        self.node.gpu.close()
        self.journal.close()
        self.state_lock.release()


def _job_finished(job: Job) -> None:
    seconds = (job.finished_at or 0.0) - (job.started_at or job.created_at)
    METRICS.observe_job(
        job.kind.value,
        job.state.value,
        max(0.0, seconds),
        bytes_uploaded=int(job.result.get("bytes_uploaded", 0) or 0),
        bytes_total=int(job.result.get("bytes_total", 0) or 0),
    )
