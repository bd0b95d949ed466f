"""The job journal and executor: states, recovery after a crash, refusal of a second job."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gpusnap.daemon.jobs.executor import JobContext, JobExecutor
from gpusnap.daemon.jobs.job import Job, JobKind, JobState, Phase
from gpusnap.daemon.jobs.journal import INTERRUPTED_MESSAGE, Journal
from gpusnap.errors import FailedPrecondition, NotFound, Unavailable


def test_jobs_left_running_by_a_dead_daemon_are_marked_interrupted(tmp_path: Path) -> None:
    j = Journal(tmp_path / "jobs.sqlite")
    j.save(Job(id="a", kind=JobKind.CHECKPOINT, workload="w", state=JobState.RUNNING))
    j.save(Job(id="b", kind=JobKind.RESTORE, workload="w", state=JobState.SUCCEEDED))
    j.close()
    again = Journal(tmp_path / "jobs.sqlite")
    assert [x.id for x in again.recover()] == ["a"]
    a = again.get("a")
    assert a is not None and a.state is JobState.INTERRUPTED and a.error == INTERRUPTED_MESSAGE
    b = again.get("b")
    assert b is not None and b.state is JobState.SUCCEEDED
    assert [x.id for x in again.recent()] == ["b", "a"]


def test_a_job_runs_to_success_with_phases_progress_and_result(tmp_path: Path) -> None:
    ex = JobExecutor(Journal(tmp_path / "j.sqlite"))

    def body(ctx: JobContext) -> None:
        ctx.phase(Phase.UPLOAD)
        ctx.progress(50, 100)
        ctx.result(checkpoint_id="x")

    job = ex.submit(JobKind.CHECKPOINT, "w", body)
    seen = list(ex.watch(job.id))
    assert seen[-1].state is JobState.SUCCEEDED
    assert seen[-1].result == {"checkpoint_id": "x"}
    assert Phase.UPLOAD in {s.phase for s in seen} or seen[-1].phase is Phase.DONE
    assert ex.get(job.id).progress.bytes_done == 50


def test_rapid_progress_wakes_watchers_at_most_every_interval_but_get_sees_it_all(
    tmp_path: Path,
) -> None:
    ex = JobExecutor(Journal(tmp_path / "j.sqlite"))
    reported = threading.Event()
    release = threading.Event()

    def body(ctx: JobContext) -> None:
        ctx.phase(Phase.UPLOAD)
        for i in range(1, 2000):
            ctx.progress(i, 2000)  # far more often than once per notify interval
        reported.set()
        release.wait(30)

    job = ex.submit(JobKind.CHECKPOINT, "w", body)
    snapshots: list[Job] = []

    def watch() -> None:
        snapshots.extend(ex.watch(job.id))

    watcher = threading.Thread(target=watch)
    watcher.start()
    assert reported.wait(30)
    # Quiet updates still land: a get sees the latest figures, not the last notified ones.
    assert ex.get(job.id).progress.bytes_done == 1999
    release.set()
    watcher.join(30)
    uploads = [s for s in snapshots if s.phase is Phase.UPLOAD]
    assert len(uploads) < 100
    assert snapshots[-1].state is JobState.SUCCEEDED


def test_wait_terminal_returns_a_job_that_ended_before_the_wait_at_once(tmp_path: Path) -> None:
    # The race a "wait for the next change" had: a job that ends between a caller's look
    # and its wait had no next change, and the wait ran out its whole timeout (half an hour
    # for a standby's restore). Waiting on the state itself cannot miss it.
    ex = JobExecutor(Journal(tmp_path / "j.sqlite"))
    job = ex.submit(JobKind.RESTORE, "w", lambda ctx: None)
    assert list(ex.watch(job.id))[-1].state is JobState.SUCCEEDED
    got: list[Job] = []
    waiter = threading.Thread(target=lambda: got.append(ex.wait_terminal(job.id, 3600)))
    waiter.start()
    waiter.join(30)  # a hang guard: it returns at once
    assert not waiter.is_alive()
    assert got[0].state is JobState.SUCCEEDED


def test_wait_terminal_waits_for_the_end_or_returns_the_job_as_it_stands(tmp_path: Path) -> None:
    ex = JobExecutor(Journal(tmp_path / "j.sqlite"))
    release = threading.Event()

    def body(ctx: JobContext) -> None:
        release.wait(30)
        ctx.phase(Phase.FETCH)

    job = ex.submit(JobKind.RESTORE, "w", body)
    assert ex.wait_terminal(job.id, 0.05).state in (JobState.QUEUED, JobState.RUNNING)
    threading.Timer(0.05, release.set).start()
    assert ex.wait_terminal(job.id, 60).state is JobState.SUCCEEDED
    with pytest.raises(NotFound):
        ex.wait_terminal("nope", 1)


def test_errors_become_failed_jobs_with_their_kind(tmp_path: Path) -> None:
    ex = JobExecutor(Journal(tmp_path / "j.sqlite"))

    def body(ctx: JobContext) -> None:
        raise Unavailable("store down")

    job = ex.submit(JobKind.CHECKPOINT, "w", body)
    last = list(ex.watch(job.id))[-1]
    assert (last.state, last.error_kind, last.error) == (
        JobState.FAILED,
        "unavailable",
        "store down",
    )


def test_a_second_exclusive_job_is_refused_and_cancel_stops_the_first(tmp_path: Path) -> None:
    ex = JobExecutor(Journal(tmp_path / "j.sqlite"))
    entered = threading.Event()

    def body(ctx: JobContext) -> None:
        entered.set()
        while True:
            ctx.progress(1, 2)  # raises Cancelled once cancel is requested
            ctx.cancel_requested.wait(0.01)

    first = ex.submit(JobKind.CHECKPOINT, "w", body, exclusive="checkpoint:w")
    entered.wait(30)
    with pytest.raises(FailedPrecondition, match=first.id):
        ex.submit(JobKind.CHECKPOINT, "w", body, exclusive="checkpoint:w")
    ex.cancel(first.id)
    assert list(ex.watch(first.id))[-1].state is JobState.CANCELLED
    with pytest.raises(NotFound):
        ex.get("nope")
