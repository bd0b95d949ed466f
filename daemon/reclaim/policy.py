"""Per-workload policy: what a notice, a schedule or a rebalance hint starts.

Per workload (keys in its config table: ``config.POLICY_KEYS``, read into a ``WorkloadPolicy``):

- ``on_notice = "checkpoint"`` (default) or ``"none"``: on a reclaim, maintenance or shutdown
  notice, checkpoint in kill mode (the node is going away) against the notice's deadline — or
  leave the workload alone.
- ``checkpoint_interval = <seconds>``: periodic leave-running checkpoints, so that a reclaim
  checkpoint has only a small delta to upload (chunks are content-addressed).
- ``checkpoint_on_rebalance = true``: an early leave-running checkpoint on an advisory
  rebalance recommendation.

Sequencing (decided here, documented in docs/triggers.md): a reclaim that arrives while a
periodic or rebalance checkpoint of the same workload runs **supersedes** it — the running job
is cancelled (the chunks it already uploaded stay in the store and are reused by content
address), and the reclaim starts once it has stopped, or after ``cancel_wait_s`` at most. If
the node cannot cancel (``Unsupported``), the reclaim waits for the job instead, within the
same bound. Waiting would spend the deadline on state that the reclaim dump replaces anyway.

A workload is reclaimed at most once: while its reclaim checkpoint runs or after it committed,
further notices (a repeat, a second source such as logind after AWS) attach to that reclaim
rather than start another. A notice is acknowledged (``Notice.ack``: Azure approval) only
after every checkpoint it waited for has committed; ``Notice.on_done`` runs in any case.

Compression is skipped (``compress=False``) when the job is behind schedule before it even
starts: less than twice this workload's last checkpoint duration left before the deadline, or
less than ``uncompressed_below_s`` left when there is no history.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gpusnap.daemon.jobs.job import Job, JobState
from gpusnap.daemon.reclaim.config import WorkloadPolicy
from gpusnap.daemon.reclaim.node import NodeDaemon
from gpusnap.daemon.reclaim.notice import Notice
from gpusnap.errors import FailedPrecondition, GpusnapError, Unsupported

log = logging.getLogger(__name__)

RECLAIM_KINDS = ("reclaim", "maintenance", "shutdown")


@dataclass
class _Reclaim:
    workload: str
    trigger: str
    done: threading.Event = field(default_factory=threading.Event)
    committed: bool = False
    job_id: str | None = None
    notices: set[tuple[str, str, str]] = field(default_factory=set)  # keys attached

    @property
    def holds(self) -> bool:
        """The workload is this reclaim's: its checkpoint runs, or committed (it left)."""
        return not self.done.is_set() or self.committed


@dataclass
class _Background:
    job_id: str
    purpose: str  # "periodic" | "rebalance"


class PolicyEngine:
    """Turns notices and schedules into checkpoint jobs, per workload policy."""

    def __init__(
        self,
        node: NodeDaemon,
        policies: Iterable[WorkloadPolicy],
        *,
        on_committed: Callable[[Notice, Job], None] | None = None,
        cancel_wait_s: float = 10.0,
        job_wait_slack_s: float = 600.0,
        uncompressed_below_s: float = 60.0,
        tick_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._node = node
        self._policies = {p.workload: p for p in policies}
        self._on_committed = on_committed
        self.cancel_wait_s = cancel_wait_s
        self.job_wait_slack_s = job_wait_slack_s
        self.uncompressed_below_s = uncompressed_below_s
        self._tick_s = tick_s
        self._clock = clock
        self._lock = threading.Lock()
        self._reclaims: dict[str, _Reclaim] = {}
        self._background: dict[str, _Background] = {}
        self._last_periodic: dict[str, float] = {}
        self._last_seconds: dict[str, float] = {}
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the periodic scheduler (only needed when a workload has an interval)."""
        self._spawn(self._schedule_loop, "policy-schedule")

    def stop(self) -> None:
        self._stop.set()

    def reclaim_in_flight(self) -> bool:
        with self._lock:
            return any(not r.done.is_set() for r in self._reclaims.values())

    def state(self) -> list[dict[str, Any]]:
        with self._lock:
            out = []
            for name, p in sorted(self._policies.items()):
                bg = self._background.get(name)
                rc = self._reclaims.get(name)
                out.append(
                    {
                        "workload": name,
                        "on_notice": p.on_notice,
                        "checkpoint_interval": p.checkpoint_interval,
                        "running": bg.purpose if bg else None,
                        "reclaim": None
                        if rc is None
                        else {
                            "trigger": rc.trigger,
                            "job_id": rc.job_id,
                            "done": rc.done.is_set(),
                            "committed": rc.committed,
                        },
                        "last_periodic_at": self._last_periodic.get(name),
                    }
                )
            return out

    # --- notices -----------------------------------------------------------------------------

    def on_notice(self, notice: Notice) -> None:
        """The ``TriggerManager`` handler: returns at once, work runs on threads."""
        if notice.kind in RECLAIM_KINDS:
            self._on_reclaim(notice)
        elif notice.kind == "rebalance":
            for p in self._policies.values():
                if p.on_notice == "checkpoint" and p.checkpoint_on_rebalance:
                    self._start_background(p.workload, "rebalance", notice.trigger)
            notice.on_done()
        else:
            log.warning("ignoring notice of unknown kind %s", notice.kind)
            notice.on_done()

    def _on_reclaim(self, notice: Notice) -> None:
        tasks: list[_Reclaim] = []
        fresh: list[_Reclaim] = []
        with self._lock:
            for p in self._policies.values():
                if p.on_notice != "checkpoint":
                    log.info("%s: on_notice=none; not checkpointing on %s", p.workload, notice.kind)
                    continue
                existing = self._reclaims.get(p.workload)
                if existing is not None and existing.holds:
                    log.info(
                        "%s: already reclaimed by %s; %s attaches to it",
                        p.workload,
                        existing.trigger,
                        notice.trigger,
                    )
                    existing.notices.add(notice.key)
                    tasks.append(existing)
                    continue
                task = _Reclaim(p.workload, notice.trigger, notices={notice.key})
                self._reclaims[p.workload] = task
                tasks.append(task)
                fresh.append(task)
        for task in fresh:
            self._spawn(functools.partial(self._reclaim, task, notice), f"reclaim-{task.workload}")
        self._spawn(lambda: self._finish_notice(notice, tasks), "notice-done")

    def _finish_notice(self, notice: Notice, tasks: list[_Reclaim]) -> None:
        try:
            for t in tasks:
                t.done.wait()
            if tasks and all(t.committed for t in tasks):
                try:
                    notice.ack()
                except GpusnapError as exc:
                    log.warning("acknowledging %s failed: %s", notice.key, exc)
                except Exception:
                    log.exception("acknowledging %s failed", notice.key)
            elif tasks:
                log.warning("not acknowledging %s: a checkpoint did not commit", notice.key)
        finally:
            try:
                notice.on_done()
            except Exception:
                log.exception("finishing %s failed", notice.key)

    def _reclaim(self, task: _Reclaim, notice: Notice) -> None:
        workload = task.workload
        try:
            self._supersede(workload, notice.deadline)
            compress = self._compress_for(workload, notice.deadline)
            trigger = "drill" if notice.provider == "drill" else notice.trigger
            job = self._start_job(
                workload, trigger, reclaim=True, deadline=notice.deadline, compress=compress
            )
            task.job_id = job.id
            log.warning(
                "%s: reclaim checkpoint %s started (%s, compress=%s)",
                workload,
                job.id,
                trigger,
                compress,
            )
            final = self._wait(job.id, notice.deadline)
            task.committed = final.state == JobState.SUCCEEDED
            if task.committed:
                log.warning(
                    "%s: reclaim checkpoint %s committed%s",
                    workload,
                    final.result.get("checkpoint_id", "?"),
                    "" if final.result.get("committed_before_deadline", True) else " LATE",
                )
                if self._on_committed is not None:
                    try:
                        self._on_committed(notice, final)
                    except Exception:
                        log.exception("%s: after-commit hook failed", workload)
            else:
                log.error(
                    "%s: reclaim checkpoint %s ended %s: %s",
                    workload,
                    job.id,
                    final.state,
                    final.error,
                )
        except GpusnapError as exc:
            log.error(  # noqa: TRY400 - one line; ours errors carry their message
                "%s: reclaim checkpoint could not run: %s", workload, exc
            )
        except Exception:
            log.exception("%s: reclaim checkpoint failed", workload)
        finally:
            task.done.set()

    def _start_job(
        self, workload: str, trigger: str, *, reclaim: bool, deadline: float | None, compress: bool
    ) -> Job:
        """Start a checkpoint of ``workload``: a reclaim's (kill mode) or a background one
        (leave running). While another checkpoint of the workload still holds it
        (``FailedPrecondition``: one the policy did not start, or one that did not stop in
        time) a reclaim retries until its deadline; a background one gives up at once."""
        end = 0.0  # a background checkpoint tries once
        if reclaim:
            end = deadline if deadline is not None else self._clock() + self.cancel_wait_s
        while True:
            try:
                return self._node.checkpoint(
                    workload=workload,
                    leave_running=not reclaim,
                    trigger=trigger,
                    deadline=deadline,
                    compress=compress,
                )
            except FailedPrecondition as exc:
                if not reclaim or self._clock() >= end:
                    raise
                log.info("%s: waiting to reclaim: %s", workload, exc)
                time.sleep(0.2)

    def jobs_for(self, notice: Notice, timeout: float = 10.0) -> list[str]:
        """The ids of the reclaim jobs ``notice`` started or attached to, once known."""
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                tasks = [t for t in self._reclaims.values() if notice.key in t.notices]
                ids = [t.job_id for t in tasks if t.job_id is not None]
                waiting = any(t.job_id is None and not t.done.is_set() for t in tasks)
            if not waiting or time.monotonic() >= end:
                return ids
            time.sleep(0.02)

    def _supersede(self, workload: str, deadline: float | None) -> None:
        with self._lock:
            bg = self._background.get(workload)
        if bg is None:
            return
        left = (deadline - self._clock()) if deadline is not None else self.cancel_wait_s * 4
        bound = max(1.0, min(self.cancel_wait_s, left / 4))
        try:
            self._node.cancel_job(bg.job_id)
            log.warning(
                "%s: cancelled %s checkpoint %s for a reclaim", workload, bg.purpose, bg.job_id
            )
        except Unsupported:
            log.warning("%s: cannot cancel %s; waiting for it", workload, bg.job_id)
        except GpusnapError as exc:
            log.info("%s: cancelling %s: %s", workload, bg.job_id, exc)
        job = self._node.wait_job(bg.job_id, bound)
        if not job.state.terminal:
            log.warning(
                "%s: %s still running after %.0f s; reclaiming anyway", workload, bg.job_id, bound
            )

    def _compress_for(self, workload: str, deadline: float | None) -> bool:
        if deadline is None:
            return True
        left = deadline - self._clock()
        last = self._last_seconds.get(workload)
        if last is None:
            return left >= self.uncompressed_below_s
        return left >= 2 * last

    def _wait(self, job_id: str, deadline: float | None) -> Job:
        left = (deadline - self._clock()) if deadline is not None else 0.0
        return self._node.wait_job(job_id, max(0.0, left) + self.job_wait_slack_s)

    # --- background checkpoints ----------------------------------------------------------------

    def tick(self) -> None:
        """Start the periodic checkpoints that are due (called every ``tick_s``)."""
        now = self._clock()
        for p in self._policies.values():
            if p.checkpoint_interval is None:
                continue
            last = self._last_periodic.get(p.workload)
            if last is None or now - last >= p.checkpoint_interval:
                self._start_background(p.workload, "periodic", "schedule")

    def _schedule_loop(self) -> None:
        while not self._stop.wait(self._tick_s):
            try:
                self.tick()
            except Exception:
                log.exception("periodic scheduling failed")

    def _start_background(self, workload: str, purpose: str, trigger: str) -> bool:
        with self._lock:
            reclaim = self._reclaims.get(workload)
            if (reclaim is not None and reclaim.holds) or workload in self._background:
                return False
            if purpose == "periodic":
                self._last_periodic[workload] = self._clock()
            try:
                job = self._start_job(
                    workload, trigger, reclaim=False, deadline=None, compress=True
                )
            except GpusnapError as exc:
                log.warning("%s: %s checkpoint not started: %s", workload, purpose, exc)
                return False
            self._background[workload] = _Background(job.id, purpose)
        log.info("%s: %s checkpoint %s started", workload, purpose, job.id)
        self._spawn(lambda: self._follow_background(workload, job.id), f"follow-{job.id}")
        return True

    def _follow_background(self, workload: str, job_id: str) -> None:
        try:
            job = self._node.wait_job(job_id, self.job_wait_slack_s * 6)
            if job.state == JobState.SUCCEEDED:
                seconds = job.result.get("seconds")
                if isinstance(seconds, int | float):
                    self._last_seconds[workload] = float(seconds)
        except Exception:
            log.exception("%s: following checkpoint %s failed", workload, job_id)
        finally:
            with self._lock:
                bg = self._background.get(workload)
                if bg is not None and bg.job_id == job_id:
                    del self._background[workload]

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
