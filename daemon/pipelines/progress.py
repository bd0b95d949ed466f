"""What a checkpoint job's progress says in each phase: true totals, never a part for the whole.

- ``dump``: the bytes CRIU has written into staging so far, of about the tree's memory that
  CRIU dumps (its anonymous and shared pages, read from /proc before CRIU starts; CRIU may
  write a little more or less). Measured from staging every ``TICK_S`` while CRIU runs.
- ``upload``: the whole checkpoint, every image file and every GPU memory stream: what the
  page streamer and the GPU sink already put in the store counts as done from the start, and
  the push's own progress (only the files it still reads) is added to it. Before this, the
  push's total was the files it still read, often a few KiB of a 1 GiB checkpoint.

A phase without bytes (freeze, commit, restore) reports none; the CLI shows its time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from gpusnap.daemon.host import proctree
from gpusnap.daemon.jobs.executor import JobContext
from gpusnap.errors import Cancelled

log = logging.getLogger(__name__)

TICK_S = 0.25  # between looks at staging while CRIU writes


def dump_total(pids: list[int]) -> int:
    """About what CRIU writes of the tree: each process's anonymous and shared memory."""
    return sum(proctree.memory_to_dump(pid) for pid in pids)


def staged_bytes(images: Path) -> int:
    """What CRIU has written into ``images`` so far."""
    total = 0
    with contextlib.suppress(OSError), os.scandir(images) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    return total


class Ticker:
    """Calls ``ctx.progress(*measure())`` every ``interval`` seconds on a thread, while the
    ``with`` block runs (and once at its end)."""

    def __init__(
        self,
        ctx: JobContext,
        measure: Callable[[], tuple[int, int]],
        interval: float = TICK_S,
        *,
        last: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        self._ctx = ctx
        self._measure = measure
        self._interval = interval
        self._last = last or measure  # the figures at the end of the block
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="job-progress", daemon=True)

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._report(self._measure)
        self._report(self._last)

    def _report(self, measure: Callable[[], tuple[int, int]]) -> None:
        try:
            done, total = measure()
            self._ctx.progress(min(done, total) if total else done, max(total, done))
        except Cancelled:
            pass  # the job's own thread sees the cancel at its next step
        except Exception:  # a look at /proc or staging that failed: the next one may not
            log.debug("progress of job %s not measured", self._ctx.job_id, exc_info=True)


def dumping(ctx: JobContext, images: Path, pids: list[int]) -> Ticker:
    """The ``dump`` phase's progress, while CRIU writes ``images``; at its end, what CRIU did
    write is the total (the memory read before was an estimate)."""
    total = dump_total(pids)

    def written() -> tuple[int, int]:
        done = staged_bytes(images)
        return done, done

    return Ticker(ctx, lambda: (staged_bytes(images), total), last=written)


@contextlib.contextmanager
def uploading(ctx: JobContext, total: int, done: Callable[[], int]) -> Iterator[None]:
    """The ``upload`` phase's figures while the page streamer finishes (``done``: what it and
    the GPU sink have put in the store so far, of the checkpoint's ``total`` bytes)."""
    with Ticker(ctx, lambda: (done(), total)):
        yield


def push_progress(ctx: JobContext, total: int, streamed: int) -> Callable[[int, int], None]:
    """The push's progress callback, as a part of the whole: ``streamed`` bytes of the
    checkpoint's ``total`` were in the store before the push began."""

    def progress(done: int, of: int) -> None:
        if of >= total:  # the push's last word counts the streams itself
            ctx.progress(min(done, of), of)
        else:
            ctx.progress(min(total, streamed + done), total)

    return progress
