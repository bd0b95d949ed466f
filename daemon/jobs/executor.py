"""The job executor: runs checkpoint and restore jobs on threads, journals them, streams changes.

A job's body is a function of a ``JobContext``; it reports its phase, progress and result
through the context, and checks for cancellation where stopping is safe. The executor turns
its outcome into a terminal state: a ``GpusnapError`` fails the job with that kind and its
one-line message, ``Cancelled`` cancels it, anything else fails it as ``internal`` (with the
traceback in the log, never in the job).

At most ``max_jobs`` run at once; the rest wait in QUEUED. A submit may name an exclusive key
(e.g. ``checkpoint:<workload>``): while a job holding the key is queued or running, another
submit with the same key is refused with ``FailedPrecondition``.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from gpusnap.daemon.jobs.job import Job, JobKind, JobState, Phase, new_job_id
from gpusnap.daemon.jobs.journal import Journal
from gpusnap.errors import Cancelled, FailedPrecondition, GpusnapError, NotFound

log = logging.getLogger(__name__)

PROGRESS_SAVE_INTERVAL = 0.5  # seconds between journal writes of mere progress
# Seconds between wake-ups of a job's watchers for mere progress. The store reports it about
# three times per chunk (~2,000 calls for 1.4 GB); each wake-up costs the daemon a deep copy
# and a gRPC message, and the watching CLI a parse, on the cores the push itself needs.
PROGRESS_NOTIFY_INTERVAL = 0.1


class JobContext:
    """What a running job's body sees of its job."""

    def __init__(self, executor: JobExecutor, job: Job) -> None:
        self._executor = executor
        self._job = job
        self.cancel_requested = threading.Event()
        # Set False at a point of no return (e.g. a kill-mode dump is done: cancelling the
        # upload would lose the workload); cancel requests are then refused.
        self.cancellable = True
        self._phase_started = time.monotonic()
        # The phase's first report: its rate counts the bytes moved since (an upload that
        # starts with most of the checkpoint already in the store is not that fast).
        self._baseline: tuple[float, int] | None = None
        self.last_progress: tuple[int, int] | None = None  # the last report with a total
        self._last_save = 0.0
        self._last_notify = 0.0

    @property
    def job_id(self) -> str:
        return self._job.id

    @property
    def workload(self) -> str:
        return self._job.workload

    @property
    def created_at(self) -> float:
        """When the request arrived (epoch seconds): the start of trigger-to-commit."""
        return self._job.created_at

    @property
    def deadline(self) -> float | None:
        return self._job.deadline

    @property
    def trigger(self) -> str:
        """What asked for the job: ``operator``, ``schedule``, ``reclaim:aws``, ``drill``..."""
        return self._job.trigger

    def set_workload(self, name: str) -> None:
        """A ``--pid`` checkpoint learns its workload name only once it looks at the process."""
        self._executor._update(self._job, lambda j: setattr(j, "workload", name))

    def phase(self, phase: Phase) -> None:
        self.check_cancelled()
        self._phase_started = time.monotonic()
        self._baseline = None

        def apply(j: Job) -> None:
            j.phase = phase
            j.progress.bytes_done = 0
            j.progress.bytes_total = 0
            j.progress.rate_bytes_per_s = 0.0

        self._executor._update(self._job, apply)

    def progress(self, bytes_done: int, bytes_total: int) -> None:
        """Progress callback for the store; raises ``Cancelled`` to stop a cancellable job."""
        self.check_cancelled()
        now = time.monotonic()
        if self._baseline is None:
            self._baseline = (now, bytes_done)
        since, base = self._baseline
        rate = (bytes_done - base) / (now - since) if now > since else 0.0
        if bytes_total > 0:
            self.last_progress = (bytes_done, bytes_total)
        done = bytes_done >= bytes_total
        save = done or now - self._last_save >= PROGRESS_SAVE_INTERVAL
        notify = save or now - self._last_notify >= PROGRESS_NOTIFY_INTERVAL
        if save:
            self._last_save = now
        if notify:
            self._last_notify = now

        def apply(j: Job) -> None:
            j.progress.bytes_done = bytes_done
            j.progress.bytes_total = bytes_total
            j.progress.rate_bytes_per_s = max(0.0, rate)

        # Between notifications the figures are still updated (a get sees them), quietly.
        self._executor._update(self._job, apply, persist=save, notify=notify)

    def result(self, **values: Any) -> None:
        self._executor._update(self._job, lambda j: j.result.update(values))

    def check_cancelled(self) -> None:
        if self.cancel_requested.is_set() and self.cancellable:
            raise Cancelled(f"job {self._job.id} was cancelled")


Body = Callable[[JobContext], None]


class JobExecutor:
    """Runs job bodies on threads; the live jobs are in memory, every job is in the journal."""

    def __init__(
        self,
        journal: Journal,
        *,
        max_jobs: int = 4,
        on_finish: Callable[[Job], None] | None = None,
    ) -> None:
        self._journal = journal
        self._on_finish = on_finish
        self._slots = threading.BoundedSemaphore(max_jobs)
        self._cond = threading.Condition()
        self._live: dict[str, tuple[Job, JobContext, threading.Thread]] = {}
        self._versions: dict[str, int] = {}
        self._exclusive: dict[str, str] = {}  # key -> job id holding it
        self._closing = False

    # --- submit and run ---------------------------------------------------------------

    def submit(
        self,
        kind: JobKind,
        workload: str,
        body: Body,
        *,
        trigger: str = "operator",
        deadline: float | None = None,
        exclusive: str | None = None,
        exclusive_message: Callable[[Job], str] | None = None,
    ) -> Job:
        job = Job(
            id=new_job_id(),
            kind=kind,
            workload=workload,
            created_at=time.time(),
            trigger=trigger,
            deadline=deadline,
        )
        with self._cond:
            if self._closing:
                raise FailedPrecondition("the daemon is stopping; no new jobs")
            if exclusive is not None and exclusive in self._exclusive:
                holder = self._live[self._exclusive[exclusive]][0]
                msg = (
                    exclusive_message(holder)
                    if exclusive_message
                    else f"job {holder.id} ({exclusive}) is already {holder.state.value}"
                )
                raise FailedPrecondition(msg)
            ctx = JobContext(self, job)
            thread = threading.Thread(
                target=self._run, args=(job, ctx, body, exclusive), name=f"job-{job.id}"
            )
            self._live[job.id] = (job, ctx, thread)
            self._versions[job.id] = 0
            if exclusive is not None:
                self._exclusive[exclusive] = job.id
            self._journal.save(job)
            snapshot = copy.deepcopy(job)
        thread.start()
        log.info("job %s: %s of %s queued (trigger %s)", job.id, kind.value, workload, trigger)
        return snapshot

    def _acquire_slot(self, ctx: JobContext) -> bool:
        """Wait for a free slot; False when the job is cancelled while it waits (queued)."""
        with self._cond:
            while True:
                if ctx.cancel_requested.is_set():
                    return False
                if self._slots.acquire(blocking=False):
                    return True
                self._cond.wait(1.0)

    def _run(self, job: Job, ctx: JobContext, body: Body, exclusive: str | None) -> None:
        if not self._acquire_slot(ctx):
            # Cancelled while queued: it ends now, not when some other job frees a slot.
            self._finish(job, JobState.CANCELLED, Cancelled(f"job {job.id} was cancelled"))
            with self._cond:
                if exclusive is not None and self._exclusive.get(exclusive) == job.id:
                    del self._exclusive[exclusive]
            return
        try:
            try:
                ctx.check_cancelled()

                def start(j: Job) -> None:
                    j.state = JobState.RUNNING
                    j.started_at = time.time()

                self._update(job, start)
                body(ctx)
            except Cancelled as err:
                self._finish(job, JobState.CANCELLED, err)
            except GpusnapError as err:
                log.warning("job %s failed: %s", job.id, err)
                self._finish(job, JobState.FAILED, err)
            except Exception as exc:
                log.exception("job %s: internal error", job.id)
                self._finish(job, JobState.FAILED, exc)
            else:
                self._finish(job, JobState.SUCCEEDED, None, ctx)
            finally:
                with self._cond:
                    if exclusive is not None and self._exclusive.get(exclusive) == job.id:
                        del self._exclusive[exclusive]
        finally:
            with self._cond:
                self._slots.release()
                self._cond.notify_all()  # a queued job waits for this slot

    def _finish(
        self,
        job: Job,
        state: JobState,
        err: BaseException | None,
        ctx: JobContext | None = None,
    ) -> None:
        moved = ctx.last_progress if ctx is not None else None

        def apply(j: Job) -> None:
            j.state = state
            j.finished_at = time.time()
            if state is JobState.SUCCEEDED:
                j.phase = Phase.DONE
                if moved is not None and j.progress.bytes_total == 0:
                    # A last phase without bytes (commit) must not leave "0 of 0": the job
                    # shows what its last phase with bytes did, done.
                    j.progress.bytes_done = j.progress.bytes_total = moved[1]
            if err is not None:
                if isinstance(err, GpusnapError):
                    j.error, j.error_kind = str(err), err.kind
                else:
                    j.error = " ".join(f"internal error: {type(err).__name__}: {err}".split())
                    j.error_kind = "internal"

        self._update(job, apply)
        log.info(
            "job %s: %s%s", job.id, state.value, f" ({job.error})" if job.error is not None else ""
        )
        if self._on_finish is not None:
            try:
                self._on_finish(copy.deepcopy(job))
            except Exception:
                log.exception("job %s: finish hook failed", job.id)

    def _update(
        self,
        job: Job,
        apply: Callable[[Job], None],
        *,
        persist: bool = True,
        notify: bool = True,
    ) -> None:
        with self._cond:
            apply(job)
            if persist:
                self._journal.save(job)
            if notify:
                self._versions[job.id] = self._versions.get(job.id, 0) + 1
                self._cond.notify_all()

    # --- queries ----------------------------------------------------------------------

    def get(self, job_id: str) -> Job:
        with self._cond:
            live = self._live.get(job_id)
            if live is not None:
                return copy.deepcopy(live[0])
        job = self._journal.get(job_id)
        if job is None:
            raise NotFound(f"no job {job_id!r}")
        return job

    def recent(self, limit: int = 50) -> list[Job]:
        with self._cond:
            live = {jid: copy.deepcopy(t[0]) for jid, t in self._live.items()}
        return [live.get(j.id, j) for j in self._journal.recent(limit)]

    def active(self, *, kind: JobKind | None = None, workload: str | None = None) -> list[Job]:
        with self._cond:
            return [
                copy.deepcopy(j)
                for j, _, _ in self._live.values()
                if not j.state.terminal
                and (kind is None or j.kind is kind)
                and (workload is None or j.workload == workload)
            ]

    def cancel(self, job_id: str) -> Job:
        with self._cond:
            live = self._live.get(job_id)
            if live is None:
                job = self._journal.get(job_id)
                if job is None:
                    raise NotFound(f"no job {job_id!r}")
                raise FailedPrecondition(f"job {job_id} is already {job.state.value}")
            job, ctx, _ = live
            if job.state.terminal:
                raise FailedPrecondition(f"job {job_id} is already {job.state.value}")
            if not ctx.cancellable:
                raise FailedPrecondition(
                    f"job {job_id} cannot be cancelled in phase {job.phase.value}: "
                    "the workload is already stopped and cancelling would lose it"
                )
            ctx.cancel_requested.set()
            self._cond.notify_all()
            log.info("job %s: cancel requested", job_id)
            return copy.deepcopy(job)

    def watch(self, job_id: str, *, poll: float = 1.0) -> Iterator[Job]:
        """A snapshot now and one per change; ends after the job is terminal."""
        with self._cond:
            live = self._live.get(job_id)
        if live is None:
            yield self.get(job_id)
            return
        job = live[0]
        seen = -1
        while True:
            with self._cond:
                while self._versions.get(job_id, 0) == seen and not self._closing:
                    self._cond.wait(poll)
                seen = self._versions.get(job_id, 0)
                snapshot = copy.deepcopy(job)
            yield snapshot
            if snapshot.state.terminal:
                return
            if self._closing and not snapshot.state.terminal:
                # The daemon stops: end the stream; the job is journaled for the next one.
                return

    def wait_terminal(self, job_id: str, timeout: float) -> Job:
        """The job once it has ended, or as it stands after ``timeout`` seconds.

        Waits on the job's state itself, not on "the next change": a job that ends between a
        caller's look and this call is returned at once (waiting for a change after it ended
        would wait out the whole timeout).
        """
        with self._cond:
            live = self._live.get(job_id)
            if live is None:
                return self.get(job_id)
            job = live[0]
            self._cond.wait_for(lambda: job.state.terminal, timeout)
            return copy.deepcopy(job)

    # --- shutdown ---------------------------------------------------------------------

    def running(self) -> int:
        with self._cond:
            return sum(1 for j, _, _ in self._live.values() if not j.state.terminal)

    def shutdown(self, *, timeout: float | None = None) -> bool:
        """Refuse new jobs and wait up to ``timeout`` for running ones; True when all ended."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            threads = [t for _, _, t in self._live.values()]
        end = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
        return all(not t.is_alive() for t in threads)

    def prune(self, keep: int = 200) -> None:
        """Forget finished jobs beyond the newest ``keep`` (they stay in the journal)."""
        with self._cond:
            done = [
                (j.finished_at or 0.0, jid)
                for jid, (j, _, _) in self._live.items()
                if j.state.terminal
            ]
            done.sort()
            for _, jid in done[: max(0, len(done) - keep)]:
                self._live.pop(jid, None)
                self._versions.pop(jid, None)
