"""Prefetch: fetching into the node's chunk cache what it lacks of a checkpoint, gently.

A standby (``[migration] prefetch = true``) follows the latest checkpoint of each workload
it stands by for: after each one, ``prefetch`` fetches the chunks its cache lacks, on one or
a few threads of lowered CPU priority and within a bandwidth cap (``TokenBucket``), so that
a reclaim-time restore fetches only the delta. Chunks are verified before they are cached
(``pull.fetch_chunk``), so a bad store object is reported now and not cached. The chunks the
cache already holds are marked used first, so that this checkpoint is the last the cache
evicts, and no more is fetched than the budget holds beside them. ``warm_bytes`` says,
cheaply (one index query, nothing fetched), how much of a checkpoint is here.

"How much" counts what a restore would fetch: each distinct chunk once, all-zero chunks not
at all (a pull knows them from their id).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

from gpusnap.errors import Corrupt, FailedPrecondition
from gpusnap.storage.catalog import fetch_manifest
from gpusnap.storage.chunker import MAX_SIZE
from gpusnap.storage.context import StoreContext
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.parallel import ProgressFn
from gpusnap.storage.pull import chunks_to_fetch, fetch_chunk

log = logging.getLogger(__name__)

# Prefetch threads run at this nice value (not SCHED_IDLE: a thread that never gets the CPU
# while it holds the GIL would stall every thread of the daemon).
PREFETCH_NICE = 10
_MAX_PROBLEMS = 10
# What a chunk object holds beyond the chunk's bytes, at most (header, nonce, GCM tag):
# counted so that what a prefetch plans to keep fits the budget as objects.
_OBJECT_OVERHEAD = 64


# Tokens are bytes: a millionth of one is rounding, not debt (without this a refill that
# lands a hair short of ``need`` would wait ever smaller delays).
_ROUNDING = 1e-6


class TokenBucket:
    """At most ``rate`` bytes per second on average, and ``burst`` bytes at once.

    Over any time ``t`` since it was made, what was taken is at most ``burst + rate * t``
    (plus what ``settle`` added after a take). Thread-safe; takers wait their turn. ``clock``
    and ``sleep`` are injectable so that tests need no real time.
    """

    def __init__(
        self,
        rate: float,
        burst: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        if rate <= 0:
            raise ValueError("a bandwidth cap must be positive")
        self.rate = float(rate)
        # At least one chunk, so that any take can be met from a full bucket.
        self.burst = float(burst if burst is not None else max(rate, MAX_SIZE))
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.burst
        self._at = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def take(self, n: int, stop: threading.Event | None = None) -> bool:
        """Wait until ``n`` bytes may go, and count them; ``False`` if ``stop`` was set first."""
        with self._lock:
            while True:
                self._refill()
                need = min(float(n), self.burst)
                if self._tokens >= need - _ROUNDING:
                    self._tokens -= n
                    return True
                delay = (need - self._tokens) / self.rate
                if self._sleep is not None:
                    self._sleep(delay)
                elif stop is not None:
                    if stop.wait(delay):
                        return False
                else:
                    time.sleep(delay)
                if stop is not None and stop.is_set():
                    return False

    def settle(self, n: int) -> None:
        """Count ``n`` more bytes than were taken (fewer, when negative) after the fact."""
        with self._lock:
            self._tokens = min(self.burst, self._tokens - n)


class PrefetchOptions(TypedDict, total=False):
    """The keyword options of ``prefetch`` (``Store.prefetch`` passes them on as given)."""

    bandwidth: float | None
    bucket: TokenBucket | None
    threads: int
    stop: threading.Event | None
    progress: ProgressFn | None


@dataclass
class PrefetchResult:
    """What one ``prefetch`` did; ``bytes_total``/``bytes_warm`` as in ``warm_bytes``."""

    checkpoint_id: str
    bytes_total: int
    bytes_warm: int
    bytes_fetched: int  # object bytes read from the store by this prefetch
    chunks_fetched: int
    chunks_left: int  # distinct chunks still not here (no room, stopped, or failed)
    stopped: bool
    seconds: float
    problems: list[str] = field(default_factory=list)

    @property
    def warm_fraction(self) -> float:
        return self.bytes_warm / self.bytes_total if self.bytes_total else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "warm_fraction": self.warm_fraction}


def warm_bytes(ctx: StoreContext, checkpoint: str | Manifest) -> tuple[int, int]:
    """``(bytes here, bytes a restore would fetch)`` of a checkpoint; ``(0, n)`` without a
    cache. One query of the cache's index; nothing is fetched or read."""
    manifest = _manifest(ctx, checkpoint)
    needed = chunks_to_fetch(ctx, manifest.files)
    total = sum(needed.values())
    if ctx.cache is None:
        return 0, total
    present = ctx.cache.present(needed)
    return sum(needed[chunk_id] for chunk_id in present), total


def warm_fraction(ctx: StoreContext, checkpoint: str | Manifest) -> float:
    """The fraction of what a restore would fetch that the node's cache holds (1.0: all)."""
    warm, total = warm_bytes(ctx, checkpoint)
    return warm / total if total else 1.0


def prefetch(
    ctx: StoreContext,
    checkpoint: str | Manifest,
    *,
    bandwidth: float | None = None,
    bucket: TokenBucket | None = None,
    threads: int = 1,
    stop: threading.Event | None = None,
    progress: ProgressFn | None = None,
) -> PrefetchResult:
    """Fetch into the node's chunk cache the chunks of ``checkpoint`` it lacks.

    ``bandwidth`` caps the store bytes per second (or give a shared ``bucket``, e.g. one per
    node for every workload a standby follows); ``threads`` fetch at once, at lowered CPU
    priority. Setting ``stop`` ends it early (the result says ``stopped``). A chunk the
    store holds corrupt is not cached and is listed in ``problems``; any other error (an
    unreachable store) is raised. ``FailedPrecondition`` when the store has no cache.
    """
    started = time.monotonic()
    cache = ctx.cache
    if cache is None:
        raise FailedPrecondition("prefetch needs a chunk cache; this store was opened without one")
    if threads < 1:
        raise ValueError("threads must be at least 1")
    manifest = _manifest(ctx, checkpoint)
    if bucket is None and bandwidth is not None:
        bucket = TokenBucket(bandwidth)
    stop = stop or threading.Event()
    needed = chunks_to_fetch(ctx, manifest.files)
    present = cache.present(needed)
    cache.touch(present)  # this checkpoint is the last the cache should give up
    room = cache.max_bytes - sum(present.values())
    missing = [(cid, size) for cid, size in needed.items() if cid not in present]
    to_fetch = sum(size for _cid, size in missing)
    result = PrefetchResult(manifest.checkpoint_id, sum(needed.values()), 0, 0, 0, 0, False, 0.0)
    lock = threading.Lock()
    done = 0

    def one(chunk_id: str, size: int) -> None:
        nonlocal done
        if bucket is not None and not bucket.take(size, stop):
            return
        try:
            _value, obj_len, cached = fetch_chunk(
                ctx, chunk_id, lambda obj: ctx.codec.decode(chunk_id, obj, size)
            )
        except Corrupt as exc:
            with lock:
                if len(result.problems) < _MAX_PROBLEMS:
                    result.problems.append(str(exc))
            return
        if bucket is not None:
            bucket.settle(-size if cached else obj_len - size)
        with lock:
            done += size
            if not cached:
                result.bytes_fetched += obj_len
                result.chunks_fetched += 1
        if progress is not None:
            progress(done, to_fetch)

    planned = 0
    in_flight: set[Future[None]] = set()
    pool = ThreadPoolExecutor(
        threads, thread_name_prefix="gpusnap-prefetch", initializer=_lower_priority
    )
    try:
        for chunk_id, size in missing:
            if stop.is_set() or planned + size + _OBJECT_OVERHEAD > room:
                break
            planned += size + _OBJECT_OVERHEAD
            while len(in_flight) >= 2 * threads:  # a few ahead: memory stays bounded
                finished, in_flight = _wait_one(in_flight)
                for fut in finished:
                    fut.result()
            in_flight.add(pool.submit(one, chunk_id, size))
        for fut in list(in_flight):
            fut.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    result.stopped = stop.is_set()
    result.bytes_warm, _total = warm_bytes(ctx, manifest)
    result.chunks_left = len(needed) - len(cache.present(needed))
    result.seconds = time.monotonic() - started
    log.info(
        "prefetched %s: %d bytes fetched, %.0f%% warm in %.1fs",
        manifest.checkpoint_id,
        result.bytes_fetched,
        100 * result.warm_fraction,
        result.seconds,
    )
    return result


def _wait_one(futures: set[Future[None]]) -> tuple[set[Future[None]], set[Future[None]]]:
    finished, pending = wait(futures, return_when=FIRST_COMPLETED)
    return set(finished), set(pending)


def _manifest(ctx: StoreContext, checkpoint: str | Manifest) -> Manifest:
    return fetch_manifest(ctx, checkpoint) if isinstance(checkpoint, str) else checkpoint


def _lower_priority() -> None:
    # On Linux a thread id names one thread: only this prefetch thread gets the higher nice.
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREFETCH_NICE)
    except OSError as exc:
        log.debug("prefetch thread keeps its priority: %s", exc)
