"""Retry with exponential backoff and full jitter, wrapped around any backend.

Only errors that say they are worth retrying (``retryable = True``: ``Unavailable``,
``DeadlineExceeded``) are retried. ``NotFound``, ``AlreadyExists``, ``Corrupt`` and every
other kind are final on the first attempt. When the attempts (or the deadline) run out, the
last error is raised again with the number of attempts added to its message. Inside
``job_deadline`` (a checkpoint job's deadline, epoch seconds) no retry starts, and no sleep
runs, past that deadline either: the call fails with ``DeadlineExceeded`` instead.

Conditional puts and ambiguous failures: a put whose connection dies after the store has
applied it looks like a failure, so the retry of an ``if_absent`` put may find its *own*
object and get ``AlreadyExists``. ``RetryingBackend`` resolves this by reading the object
back: identical bytes mean the earlier attempt landed, and the put succeeds. Hence:

- content-addressed puts (chunks, whose key is the hash of the bytes) should *not* use
  ``if_absent``: a plain put of the same bytes is idempotent and costs no extra read;
- manifest and claim/lease puts *should* use ``if_absent``, and a claim's bytes must carry
  something unique to its writer (an owner id, a nonce), so that "identical content" can only
  mean "this writer's earlier attempt" and never "another writer with the same bytes".
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

from gpusnap.errors import (
    AlreadyExists,
    DeadlineExceeded,
    GpusnapError,
    InvalidArgument,
    with_message,
)
from gpusnap.storage.backend import Backend, ObjectInfo

log = logging.getLogger(__name__)

T = TypeVar("T")

# The deadline (epoch seconds) of the job whose store calls run in this context; the store's
# worker pools run their tasks in the submitter's context (``parallel.Outstanding``).
_JOB_DEADLINE: ContextVar[float | None] = ContextVar("gpusnap_job_deadline", default=None)


@contextmanager
def job_deadline(deadline: float | None) -> Iterator[None]:
    """Bound every retry of the store calls made in the body by ``deadline`` (epoch seconds;
    ``None``: no bound beyond the backend's own)."""
    token = _JOB_DEADLINE.set(deadline)
    try:
        yield
    finally:
        _JOB_DEADLINE.reset(token)


class RetryingBackend:
    """A ``Backend`` that retries the retryable failures of ``inner``.

    ``attempts`` counts the first try. The sleep before retry ``n`` (1-based) is drawn
    uniformly from ``[0, min(max_delay, base_delay * 2 ** (n - 1))]`` ("full jitter"). With
    ``deadline`` (seconds), no retry starts once that much time has passed since the call
    began, and no sleep runs past it.
    """

    def __init__(
        self,
        inner: Backend,
        attempts: int = 6,
        base_delay: float = 0.2,
        max_delay: float = 10.0,
        deadline: float | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if attempts < 1:
            raise InvalidArgument(f"retry attempts must be at least 1, got {attempts}")
        if base_delay < 0 or max_delay < 0:
            raise InvalidArgument("retry delays must not be negative")
        if deadline is not None and deadline <= 0:
            raise InvalidArgument(f"retry deadline must be positive, got {deadline}")
        self.inner = inner
        self.url = inner.url
        self.attempts = attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.deadline = deadline
        self._sleep = sleep
        self._clock = clock
        self._rng = rng or random.Random()

    # -- the Backend protocol -------------------------------------------------------------

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        if not if_absent:
            self._call("put", key, lambda: self.inner.put(key, data))
            return
        ambiguous = False

        def attempt() -> None:
            nonlocal ambiguous
            try:
                self.inner.put(key, data, if_absent=True)
            except AlreadyExists:
                if ambiguous and self._holds(key, data):
                    log.info("put %s: an earlier attempt had landed; the object matches", key)
                    return
                raise
            except GpusnapError as exc:
                # A retryable failure may have happened after the store applied the write.
                ambiguous = ambiguous or exc.retryable
                raise

        self._call("put", key, attempt)

    def put_unsynced(self, key: str, data: bytes) -> None:
        """``put_unsynced`` of ``inner`` (its durable ``put`` when it has none), retried."""
        unsynced = getattr(self.inner, "put_unsynced", None)
        if unsynced is None:
            self._call("put", key, lambda: self.inner.put(key, data))
        else:
            self._call("put", key, lambda: unsynced(key, data))

    def sync(self, keys: Iterable[str] | None = None) -> None:
        """``sync`` of ``inner`` (nothing when its puts are durable), retried."""
        sync = getattr(self.inner, "sync", None)
        if sync is not None:
            listed = None if keys is None else list(keys)
            self._call("sync", "", lambda: sync(listed))

    def get(self, key: str, *, offset: int = 0, length: int | None = None) -> bytes:
        return self._call("get", key, lambda: self.inner.get(key, offset=offset, length=length))

    def stat(self, key: str) -> ObjectInfo | None:
        return self._call("stat", key, lambda: self.inner.stat(key))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """List ``prefix``; a listing that fails part-way resumes after the last key yielded."""
        last: str | None = None
        failures = 0
        started = self._clock()
        while True:
            try:
                for info in self.inner.list(prefix):
                    if last is not None and info.key <= last:
                        continue
                    last = info.key
                    if failures:  # progress: the next failure starts a fresh budget
                        failures = 0
                        started = self._clock()
                    yield info
            except GpusnapError as exc:
                failures += 1
                self._before_retry("list", prefix, exc, failures, started)
                continue
            return

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda: self.inner.delete(key))

    def close(self) -> None:
        self.inner.close()

    # -- internals ------------------------------------------------------------------------

    def _holds(self, key: str, data: bytes) -> bool:
        """Whether ``key`` holds exactly ``data`` (itself retried like any other call)."""
        info = self._call("stat", key, lambda: self.inner.stat(key))
        if info is None or info.size != len(data):
            return False
        return self._call("get", key, lambda: self.inner.get(key)) == data

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        failures = 0
        started = self._clock()
        while True:
            try:
                return fn()
            except GpusnapError as exc:
                failures += 1
                self._before_retry(op, key, exc, failures, started)

    def _before_retry(
        self, op: str, key: str, exc: GpusnapError, failures: int, started: float
    ) -> None:
        """Sleep before the next attempt, or raise when ``exc`` is final."""
        if not exc.retryable:
            raise exc
        elapsed = self._clock() - started
        delay = self._rng.uniform(0, min(self.max_delay, self.base_delay * 2 ** (failures - 1)))
        out_of_time = self.deadline is not None and elapsed + delay >= self.deadline
        job_end = _JOB_DEADLINE.get()
        if failures < self.attempts and job_end is not None and time.time() + delay >= job_end:
            raise DeadlineExceeded(
                f"{exc} (the job's deadline came after {failures} "
                f"attempt{'s' if failures > 1 else ''} in {elapsed:.1f}s)"
            ) from exc
        if failures >= self.attempts or out_of_time:
            why = "deadline reached" if out_of_time and failures < self.attempts else "gave up"
            raise with_message(
                exc,
                f"{exc} ({why} after {failures} attempt{'s' if failures > 1 else ''} "
                f"in {elapsed:.1f}s)",
            ) from exc
        log.warning(
            "%s %s failed (attempt %d of %d), retrying in %.2fs: %s",
            op,
            key,
            failures,
            self.attempts,
            delay,
            exc,
        )
        self._sleep(delay)
