"""``DaemonService``: what gpusnapd does, behind the gRPC API (``daemon/api.py``).

The service decides; the servicer only translates. Checkpoint and restore requests become
jobs (``daemon/jobs.py``) whose bodies live in ``daemon/flows.py``; everything else (compat,
checkpoints, workloads, status) answers at once.

Concurrency: two checkpoints of one workload at once are refused — a second request while
one is queued or running fails with ``FailedPrecondition`` "workload X already has checkpoint
job J running" — because a second dump of a tree that is being dumped (or was just killed by
a kill-mode dump) can only fail or capture the same state again. A caller that wants to wait
(e.g. a reclaim notice arriving during a periodic checkpoint) can look at
``active_checkpoint(workload)`` and watch that job instead.

Triggers and migration (issue 5) plug in through ``attach_triggers`` and ``on_shutdown``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import gpusnap
from gpusnap.daemon.checkpoint import CheckpointRequest, RestoreRequest, run_checkpoint, run_restore
from gpusnap.daemon.config import Config, WorkloadConfig
from gpusnap.daemon.gpu.adapter import GpuAdapter, open_gpu
from gpusnap.daemon.host import proctree
from gpusnap.daemon.host.criu import Criu
from gpusnap.daemon.jobs.executor import JobExecutor
from gpusnap.daemon.jobs.job import Job, JobKind
from gpusnap.daemon.jobs.journal import Journal
from gpusnap.daemon.metrics import METRICS
from gpusnap.daemon.stamp import NodeFacts, check_compat, gpusnap_stamp, host_stamp
from gpusnap.daemon.statedir import StateDirLock, prepare_dir
from gpusnap.daemon.verdict import CompatVerdict
from gpusnap.errors import (
    FailedPrecondition,
    GpusnapError,
    InvalidArgument,
    NotFound,
    Unsupported,
)
from gpusnap.storage import CheckpointStore, open_store
from gpusnap.storage.manifest import Manifest, check_checkpoint_id, check_workload

log = logging.getLogger(__name__)

_JOB_ID = re.compile(r"\d{8}T\d{6}-[0-9a-f]{6}")  # jobs.new_job_id()


class TriggerManager(Protocol):
    """What the trigger/migration code (issue 5) offers the service; all optional but start/stop."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


class StoreHandle:
    """Opens the store lazily and again after a failure: an unreachable store at start is a
    warning, and each job that needs it fails with ``Unavailable`` until it is back."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._store: CheckpointStore | None = None
        self._lock = threading.Lock()
        self.last_error: str | None = None

    def get(self) -> CheckpointStore:
        with self._lock:
            if self._store is None:
                s = self._config.store
                try:
                    self._store = open_store(
                        s.url,
                        key_file=s.key_file,
                        encryption_key_file=s.encryption_key_file,
                        options=s.options,
                        verify=s.verify,
                        cache_dir=s.cache_dir or (self._config.daemon.state_dir / "cache"),
                        workers=s.workers,
                    )
                except GpusnapError as err:
                    self.last_error = str(err)
                    raise
                self.last_error = None
            return self._store

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None


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
        self.state_dir = config.daemon.state_dir
        self.staging_root = config.daemon.staging_dir or self.state_dir / "staging"
        self.logs_dir = self.state_dir / "logs"
        # First of all, before the journal's recovery or the staging cleanup can touch
        # anything: this state dir is ours alone, or we stop here (see daemon/statedir.py).
        self.state_lock = state_lock or StateDirLock.acquire(
            self.state_dir, config.daemon.staging_dir
        )
        # Images hold the workload's memory: only root may read them (mode 0700).
        prepare_dir(self.state_dir, "state_dir")
        prepare_dir(self.staging_root, "staging_dir" if config.daemon.staging_dir else "state_dir")
        prepare_dir(self.logs_dir, "state_dir", mode=0o755)
        if not config.store.verify:
            log.warning(
                "[store] verify = false: manifest signatures are NOT checked. This daemon will "
                "checkpoint, but it refuses to restore, cold-start or adopt a migration from "
                "this store, since anyone who can write to it could make it run their code"
            )
        self.started_at = time.time()
        self.criu = criu or Criu()
        self.gpu = gpu or open_gpu(config.gpu)
        self.journal = Journal(self.state_dir / "jobs.sqlite")
        self.interrupted = self.journal.recover()
        self._clean_staging()
        self.executor = JobExecutor(
            self.journal, max_jobs=config.daemon.max_jobs, on_finish=self._job_finished
        )
        self.store = StoreHandle(config)
        self._children: dict[int, subprocess.Popen[bytes] | None] = {}
        self._children_lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="reaper", daemon=True)
        self._reaper.start()
        self.on_shutdown: list[Callable[[], None]] = []
        self.triggers: TriggerManager | None = None
        self._host: dict[str, Any] | None = None
        if open_store_now:
            try:
                self.store.get()
            except GpusnapError as err:
                log.warning(
                    "store %s is not reachable now (%s); serving anyway", config.store.url, err
                )

    # --- node facts ---------------------------------------------------------------------

    def host(self) -> dict[str, Any]:
        if self._host is None:
            major, minor, patch = self.criu.version()
            self._host = host_stamp(
                criu_version=f"{major}.{minor}.{patch}", node_id=self.config.daemon.node_id
            )
        return self._host

    def node_facts(self, workload: str | None) -> NodeFacts:
        return NodeFacts(
            host=self.host(),
            gpusnap=gpusnap_stamp(),
            workload=self.config.workload(workload) if workload else None,
        )

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
    ) -> Job:
        """Queue a checkpoint; returns at once. ``compress`` None: the config decides."""
        if (pid is None) == (workload is None):
            raise InvalidArgument("give exactly one of a pid or a workload name")
        wcfg: WorkloadConfig | None = None
        if workload is not None:
            wcfg = self.config.workload(workload)
            if wcfg is None:
                known = ", ".join(w.name for w in self.config.workloads) or "none"
                raise NotFound(f"no workload {workload!r} in the config (configured: {known})")
            root = self._find_workload_pid(wcfg)
            name = wcfg.name
        else:
            assert pid is not None
            if not 0 < pid <= proctree.PID_MAX_LIMIT:
                raise InvalidArgument(f"not a process id: {pid} (1 to {proctree.PID_MAX_LIMIT})")
            if pid == os.getpid():
                raise InvalidArgument("gpusnapd cannot checkpoint itself")
            if not proctree.exists(pid):
                raise NotFound(f"no such process: {pid}")
            _check_checkpointable(pid)
            root = pid
            name = self._adhoc_name(pid)
            wcfg = self.config.workload(name)
        request = CheckpointRequest(
            root_pid=root,
            workload=name,
            config=wcfg,
            leave_running=leave_running,
            compress=self.config.store.compress if compress is None else compress,
        )
        return self.executor.submit(
            JobKind.CHECKPOINT,
            name,
            lambda ctx: run_checkpoint(self, ctx, request),
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

    def _find_workload_pid(self, w: WorkloadConfig) -> int:
        if w.pid_file is None and w.systemd_unit is None and w.match is None:
            raise FailedPrecondition(
                f"workload {w.name} has no pid_file, systemd_unit or match in the config; "
                "checkpoint it with --pid"
            )
        pids = proctree.find_pids(
            pid_file=str(w.pid_file) if w.pid_file else None,
            systemd_unit=w.systemd_unit,
            match=w.match,
        )
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            raise NotFound(f"workload {w.name} is not running (no process found)")
        _check_checkpointable(pids[0], workload=w.name)
        return pids[0]

    def _adhoc_name(self, pid: int) -> str:
        """A stable name for an ad-hoc ``--pid`` checkpoint: the script's name for an
        interpreter running a script (``python3 tinylm.py`` -> ``tinylm``), else the comm."""
        return proctree.workload_name(pid)

    # --- restore --------------------------------------------------------------------------

    def restore(
        self,
        *,
        checkpoint_id: str | None = None,
        workload: str | None = None,
        latest: bool = False,
    ) -> Job:
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
        self.require_verified("restore")
        request = RestoreRequest(checkpoint_id=checkpoint_id or None, workload=workload or None)
        return self.executor.submit(
            JobKind.RESTORE,
            workload or "",
            lambda ctx: run_restore(self, ctx, request),
        )

    def require_verified(self, what: str) -> None:
        """Refuse to act on a manifest this daemon cannot authenticate: a restore runs the
        checkpointed tree, a cold start runs the manifest's launch spec (as root), so neither
        may come from a store read with ``[store] verify = false``."""
        if not self.config.store.verify:
            raise FailedPrecondition(
                f"refusing to {what}: manifest authenticity is not verified "
                "([store] verify = false)"
            )

    def compat(self, checkpoint_id: str) -> CompatVerdict:
        check_checkpoint_id(checkpoint_id)
        self.require_verified("judge a checkpoint for restore")
        manifest = self.store.get().manifest(checkpoint_id)
        reasons = self.reasons(manifest)
        return CompatVerdict(checkpoint_id, not reasons, tuple(reasons))

    def reasons(self, manifest: Manifest) -> list[Any]:
        """Every reason ``manifest`` cannot be restored here (empty: compatible)."""
        stamp = manifest.stamp
        reasons = check_compat(stamp, self.node_facts(manifest.workload))
        gpu_stamp = stamp.get("gpu")
        reasons += self.gpu.compat_reasons(gpu_stamp if isinstance(gpu_stamp, dict) else {})
        return reasons

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

    # --- checkpoints and workloads ----------------------------------------------------------

    def list_checkpoints(self, workload: str | None = None) -> list[dict[str, Any]]:
        if workload:
            check_workload(workload)
        return [s.as_dict() for s in self.store.get().list(workload or None)]

    def show_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        check_checkpoint_id(checkpoint_id)
        manifest = self.store.get().manifest(checkpoint_id)
        data = manifest.to_dict()
        # The chunk lists are for the store; an operator wants the files and their sizes.
        data["files"] = [{"path": f.path, "size": f.size} for f in manifest.files]
        data["bytes_total"] = manifest.bytes_total
        return data

    def last_checkpoints(self) -> tuple[dict[str, dict[str, Any]], str | None]:
        """Each configured workload's latest committed checkpoint in the store: ``{name:
        {last_checkpoint_id, last_checkpoint_at, last_checkpoint_age_seconds}}`` (None when it
        has none), and the store's error when it could not be asked."""
        names = [w.name for w in self.config.workloads]
        empty: dict[str, Any] = {
            "last_checkpoint_id": None,
            "last_checkpoint_at": None,
            "last_checkpoint_age_seconds": None,
        }
        out = {n: dict(empty) for n in names}
        if not names:
            return out, None
        now = time.time()
        try:
            store = self.store.get()
            for name in names:
                summary = store.latest(name)
                if summary is not None:
                    out[name].update(
                        last_checkpoint_id=summary.checkpoint_id,
                        last_checkpoint_at=summary.created_at,
                        last_checkpoint_age_seconds=round(max(0.0, now - summary.created_at), 3),
                    )
        except GpusnapError as err:
            return out, str(err)
        return out, None

    def list_workloads(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        last, store_error = self.last_checkpoints()
        for w in self.config.workloads:
            pid: int | None
            try:
                pid = self._find_workload_pid(w)
            except GpusnapError:
                pid = None
            active = self.active_checkpoint(w.name)
            out.append(
                {
                    "name": w.name,
                    "running": pid is not None,
                    "pid": pid,
                    "finder": (
                        f"pid_file {w.pid_file}"
                        if w.pid_file
                        else f"systemd_unit {w.systemd_unit}"
                        if w.systemd_unit
                        else f"match {w.match}"
                        if w.match
                        else "none"
                    ),
                    "engine": (
                        "probed"
                        if w.engine_probed
                        else f"{w.engine.name} {w.engine.version}"
                        if w.engine
                        else None
                    ),
                    "model": f"{w.model.name}@{w.model.revision}" if w.model else None,
                    "active_job": active.id if active else None,
                    **last[w.name],
                    "store_error": store_error,
                }
            )
        return out

    def status(self) -> dict[str, Any]:
        store_ok = True
        store_error: str | None = None
        try:
            self.store.get()
        except GpusnapError as err:
            store_ok, store_error = False, str(err)
        try:
            host: dict[str, Any] = self.host()
        except GpusnapError as err:
            host = {"error": str(err)}
        gpu = self.gpu.capabilities()
        last, list_error = self.last_checkpoints()
        if store_ok and list_error is not None:
            store_ok, store_error = False, list_error
        return {
            "version": gpusnap.__version__,
            "node_id": host.get("node_id"),
            "pid": os.getpid(),
            "uptime_seconds": round(time.time() - self.started_at, 3),
            "socket": str(self.config.daemon.socket),
            "state_dir": str(self.state_dir),
            "staging_dir": str(self.staging_root),
            "store": {"url": self.config.store.url, "reachable": store_ok, "error": store_error},
            "host": host,
            "gpu": gpu,
            "capabilities": {
                "criu": self._criu_line(),
                "gpu": str(
                    gpu.get("message") or ("present" if gpu.get("driver_present") else "none")
                ),
                "store": "reachable" if store_ok else f"unreachable: {store_error}",
            },
            "jobs_running": self.executor.running(),
            "workloads": [{"name": name, **info} for name, info in last.items()],
            "interrupted_at_start": [j.id for j in self.interrupted],
            "triggers": self.triggers is not None,
        }

    def _criu_line(self) -> str:
        try:
            major, minor, patch = self.criu.version()
            return f"criu {major}.{minor}.{patch} at {self.criu.path}"
        except GpusnapError as err:
            return f"unavailable: {err}"

    # --- issue 5 plug points -----------------------------------------------------------------

    def attach_triggers(self, manager: TriggerManager) -> None:
        self.triggers = manager

    def triggers_status(self) -> dict[str, Any]:
        status = getattr(self.triggers, "status", None)
        if callable(status):
            result: dict[str, Any] = status()
            return result
        return {"provider": "none", "running": False}

    def migrations(self) -> list[dict[str, Any]]:
        fn = getattr(self.triggers, "migrations", None)
        if callable(fn):
            result: list[dict[str, Any]] = fn()
            return result
        return []

    def drill(self, deadline_s: float | None) -> Job:
        fn = getattr(self.triggers, "drill", None)
        if callable(fn):
            job: Job = fn(deadline_s)
            return job
        raise Unsupported("reclaim drills need the trigger manager, which is not running")

    # --- metrics ----------------------------------------------------------------------------

    def checkpoint_committed(self, workload: str, epoch: float) -> None:
        METRICS.set_last_checkpoint(workload, epoch)

    def _job_finished(self, job: Job) -> None:
        seconds = (job.finished_at or 0.0) - (job.started_at or job.created_at)
        METRICS.observe_job(
            job.kind.value,
            job.state.value,
            max(0.0, seconds),
            bytes_uploaded=int(job.result.get("bytes_uploaded", 0) or 0),
            bytes_total=int(job.result.get("bytes_total", 0) or 0),
        )

    # --- children, staging, shutdown ------------------------------------------------------------

    def adopt(self, pid: int, proc: subprocess.Popen[bytes] | None = None) -> None:
        """Reap ``pid`` when it exits (a restored root made our child, or a cold start)."""
        with self._children_lock:
            self._children[pid] = proc

    def _reap_loop(self) -> None:
        # A pid that is not (yet) our child stays watched while it exists: a restored tree's
        # processes become ours only when their parent dies and we are the child subreaper.
        while not self._stop.wait(0.2):
            with self._children_lock:
                items = list(self._children.items())
            for pid, proc in items:
                if proc is not None:
                    done = proc.poll() is not None
                else:
                    try:
                        wpid, _ = os.waitpid(pid, os.WNOHANG)
                        done = wpid == pid
                    except ChildProcessError:
                        done = not Path(f"/proc/{pid}").exists()
                if done:
                    log.info("workload process %d exited", pid)
                    with self._children_lock:
                        self._children.pop(pid, None)

    def staging_dir(self, job_id: str) -> Path:
        return self.staging_root / job_id

    def _clean_staging(self) -> None:
        """At start no job runs, so every job's directory under staging is a leftover. Only
        entries named like a job id are touched: a configured ``staging_dir`` may be shared."""
        for entry in self.staging_root.iterdir():
            if not _JOB_ID.fullmatch(entry.name):
                continue
            log.info("removing leftover staging %s", entry)
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def close(self, *, timeout: float | None = 30.0) -> None:
        """Stop: shutdown hooks, then running jobs get ``timeout`` seconds, then close."""
        for hook in list(self.on_shutdown):
            try:
                hook()
            except Exception:
                log.exception("shutdown hook %r failed", hook)
        if self.triggers is not None:
            try:
                self.triggers.stop()
            except Exception:
                log.exception("stopping the trigger manager failed")
        if not self.executor.shutdown(timeout=timeout):
            log.warning("jobs still running at shutdown; they will show as interrupted")
        self._stop.set()
        self.store.close()
        self.gpu.close()
        self.journal.close()
        self.state_lock.release()


def _check_checkpointable(pid: int, *, workload: str | None = None) -> None:
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
