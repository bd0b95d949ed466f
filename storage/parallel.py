"""What the push and pull data paths share: a byte budget, a run's first error, its counts.

Both run chunks through thread pools; zstandard, blake3, AES-GCM and file/socket I/O release
the GIL, so the stages overlap across cores. Memory is bounded by a byte budget on the chunks
in flight (``ByteBudget``), whatever the size of the input. The first error of any worker wins
and stops every other (``Run``); foreign exceptions become one of our kinds at this boundary
(``translate_error``).
"""

from __future__ import annotations

import contextvars
import errno
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

from gpusnap.errors import FailedPrecondition, GpusnapError, Internal, InvalidArgument

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes in all)


class ByteBudget:
    """Blocks the producer while more than ``limit`` bytes are in flight (one item always fits)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int, abort: threading.Event) -> None:
        with self._cond:
            while self._used and self._used + n > self._limit and not abort.is_set():
                self._cond.wait(0.5)
            self._used += n

    def release(self, n: int) -> None:
        with self._cond:
            self._used -= n
            self._cond.notify_all()


class Outstanding:
    """Tasks submitted to a pool and not yet finished, counted rather than kept.

    A push or pull of a large image runs a task per chunk; holding each one's ``Future``
    until the end would cost memory in proportion to the image (a ``Future`` and its
    condition, per chunk). A task's errors are the task's to report (into its ``Run``); its
    result is dropped. Once ``wait`` returns, nothing submitted through this is running.
    """

    def __init__(self) -> None:
        self._count = 0
        self._cond = threading.Condition()

    def submit(self, pool: Executor, fn: Callable[..., object], *args: Any) -> None:
        with self._cond:
            self._count += 1
        try:
            # In the submitter's context: a job's deadline (``retry.job_deadline``) holds there.
            future = pool.submit(contextvars.copy_context().run, fn, *args)
        except BaseException:
            self._finished(None)
            raise
        future.add_done_callback(self._finished)

    def _finished(self, _future: Future[object] | None) -> None:
        with self._cond:
            self._count -= 1
            if self._count == 0:
                self._cond.notify_all()

    def wait(self, tick: Callable[[], None] | None = None) -> None:
        """Until every task submitted so far has finished; ``tick`` is called now and then
        meanwhile (progress)."""
        while True:
            with self._cond:
                if not self._count:
                    return
                self._cond.wait(0.2)
            if tick is not None:  # outside the lock: finishing tasks never wait on it
                tick()


class Run:
    """Shared state of one pipeline run: first error wins, everyone stops."""

    def __init__(self) -> None:
        self.abort = threading.Event()
        self.error: GpusnapError | None = None
        self._lock = threading.Lock()

    def fail(self, err: GpusnapError) -> None:
        with self._lock:
            if self.error is None:
                self.error = err
        self.abort.set()

    def raise_if_aborted(self) -> None:
        if self.abort.is_set():
            raise self.error or Internal("aborted")

    def check(self) -> None:
        if self.error is not None:
            raise self.error


@dataclass
class Tally:
    """The counts of one push or pull, updated by its workers under ``lock``."""

    bytes_total: int = 0
    chunks_total: int = 0
    bytes_done: int = 0  # of ``bytes_total``, for progress
    lock: threading.Lock = field(default_factory=threading.Lock)

    def report(self, progress: ProgressFn | None) -> None:
        if progress is not None:
            progress(self.bytes_done, self.bytes_total)


# What an OSError says about the arguments given (a file where a directory should be, a
# name too long); any other errno is about the machine (a full or read-only disk), not usage.
_BAD_ARGUMENT_ERRNOS = frozenset(
    {errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP}
)


def translate_error(exc: BaseException, what: str) -> GpusnapError:
    """``exc`` as one of our kinds, its message prefixed by ``what`` (ours pass unchanged)."""
    if isinstance(exc, GpusnapError):
        return exc
    if isinstance(exc, OSError):
        reason = exc.strerror or str(exc)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return FailedPrecondition(f"{what}: disk full ({reason})")
        if exc.errno in _BAD_ARGUMENT_ERRNOS:
            return InvalidArgument(f"{what}: {reason}")
        return FailedPrecondition(f"{what}: {reason}")
    if isinstance(exc, MemoryError):
        return Internal(f"{what}: out of memory")
    return Internal(f"{what}: {type(exc).__name__}: {exc}")
