"""The prefetch follower: a standby keeps each workload's latest checkpoint in its chunk cache.

With ``[migration] prefetch = true`` a node follows the latest checkpoint of every workload it
stands by for (``prefetch_workloads``, else every ``[[workload]]`` of its config): every
``poll_interval`` it lists each workload's checkpoint ids (one LIST per workload; no manifest
is read unless the newest id is new), and for a new one reads the manifest (authenticated)
and fetches into the node's chunk cache the chunks it lacks (``CheckpointStore.prefetch``):
on one thread of lowered priority, within one bandwidth cap shared by every workload
(``prefetch_bandwidth``, a ``TokenBucket`` per node). A reclaim-time restore on this node
then fetches only what changed since (the chunks are verified when they are cached and again
when the restore reads them).

A checkpoint whose manifest cannot be authenticated (a forged or damaged object) is skipped
and the next older one is followed. A failed prefetch (the store unreachable) is tried again
at the next poll; one that ran out of cache budget is not (it would fetch nothing more).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gpusnap.daemon.infra.metrics import METRICS
from gpusnap.daemon.reclaim.node import StoreAccess
from gpusnap.daemon.reclaim.polling import poll_until_stopped
from gpusnap.errors import Corrupt, GpusnapError
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.prefetch import PrefetchResult, TokenBucket
from gpusnap.storage.store import CheckpointStore

log = logging.getLogger(__name__)

# The time part of a checkpoint id (``YYYYMMDDTHHMMSSZ``): ids of one second sort by chance.
_ID_SECOND = 16


@dataclass
class Followed:
    """Where the follower stands with one workload (``gpusnap triggers``'s ``prefetch``)."""

    workload: str
    checkpoint_id: str | None = None  # the checkpoint followed last
    bytes_warm: int = 0  # of what a restore of it would fetch, held here after the prefetch
    bytes_total: int = 0
    bytes_fetched: int = 0  # by the last prefetch
    prefetched_at: float | None = None  # when the last prefetch ended
    seconds: float = 0.0
    complete: bool = False  # nothing more to do for this checkpoint
    last_error: str | None = None

    @property
    def warm_fraction(self) -> float | None:
        if self.checkpoint_id is None:
            return None
        return self.bytes_warm / self.bytes_total if self.bytes_total else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "warm_fraction": self.warm_fraction}


class PrefetchFollower:
    """Follows ``workloads``' latest checkpoints into the node's chunk cache; see the module."""

    def __init__(
        self,
        store: StoreAccess,
        workloads: Sequence[str],
        *,
        bandwidth: float,
        poll_interval_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self.workloads = tuple(dict.fromkeys(workloads))
        self.bandwidth = bandwidth
        self.poll_interval_s = poll_interval_s
        self._bucket = TokenBucket(bandwidth)  # one per node: every workload shares the cap
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._state = {w: Followed(w) for w in self.workloads}
        self._unreadable: set[str] = set()  # ids whose manifest failed authentication
        self.last_error: str | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="prefetch-follower", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop following; a prefetch in flight ends at its next chunk (``stop`` event)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def state(self) -> dict[str, Any]:
        with self._lock:
            followed = [s.as_dict() for s in self._state.values()]
        return {
            "enabled": True,
            "bandwidth_bytes_per_s": self.bandwidth,
            "workloads": followed,
            "last_error": self.last_error,
        }

    def _run(self) -> None:
        poll_until_stopped(
            self.tick, self._stop, lambda: self.poll_interval_s, self._set_error, "prefetch"
        )

    def _set_error(self, error: str | None) -> None:
        self.last_error = error

    def tick(self) -> list[PrefetchResult]:
        """One look at every followed workload; the prefetches it ran. ``Unavailable`` when
        the store cannot be reached (nothing is changed then)."""
        store = self._store.get()
        done: list[PrefetchResult] = []
        for workload in self.workloads:
            if self._stop.is_set():
                break
            result = self._follow(store, workload)
            if result is not None:
                done.append(result)
        return done

    def _follow(self, store: CheckpointStore, workload: str) -> PrefetchResult | None:
        with self._lock:
            followed = self._state[workload]
        try:
            manifest = self._newest(store, workload, followed)
            if manifest is None:
                return None
            result = store.prefetch(manifest, bucket=self._bucket, threads=1, stop=self._stop)
        except GpusnapError as exc:
            with self._lock:
                followed.last_error = str(exc)
            log.warning("prefetch of %s: %s", workload, exc)
            return None
        METRICS.observe_fetch("prefetch", fetched=result.bytes_fetched, cached=0)
        METRICS.set_warm_fraction(workload, result.warm_fraction)
        with self._lock:
            followed.checkpoint_id = result.checkpoint_id
            followed.bytes_warm = result.bytes_warm
            followed.bytes_total = result.bytes_total
            followed.bytes_fetched = result.bytes_fetched
            followed.seconds = round(result.seconds, 3)
            followed.prefetched_at = self._clock()
            # Stopped: the daemon stops. Problems (corrupt store chunks): tried again with
            # the next checkpoint, which may hold them anew. Out of budget: nothing more fits.
            followed.complete = not result.stopped
            followed.last_error = "; ".join(result.problems) or None
        return result

    def _newest(self, store: CheckpointStore, workload: str, followed: Followed) -> Manifest | None:
        """The newest checkpoint of ``workload`` whose manifest authenticates, or ``None``
        when it is the one already followed to the end (no manifest read then)."""
        ids = store.checkpoint_ids(workload)
        listed = set(ids)
        self._unreadable &= listed  # forget what the store no longer holds
        ids = [i for i in ids if i not in self._unreadable]
        if not ids:
            return None
        second = ids[0][:_ID_SECOND]
        tied = [i for i in ids if i[:_ID_SECOND] == second]
        if tied == [followed.checkpoint_id] and followed.complete:
            return None
        # Ids of one second do not order by time: read them all and take the newest, as
        # ``CheckpointStore.list`` orders; older ones only if none of them authenticates.
        found = [m for m in (self._read(store, i) for i in tied) if m is not None]
        newest: Manifest | None
        if found:
            newest = max(found, key=lambda m: (m.created_at, m.checkpoint_id))
        else:
            newest = next(
                (m for m in (self._read(store, i) for i in ids[len(tied) :]) if m is not None),
                None,
            )
        if newest is None:
            return None
        if newest.checkpoint_id == followed.checkpoint_id and followed.complete:
            return None
        return newest

    def _read(self, store: CheckpointStore, checkpoint_id: str) -> Manifest | None:
        try:
            return store.manifest(checkpoint_id)
        except Corrupt as exc:
            log.warning("prefetch: skipping checkpoint %s: %s", checkpoint_id, exc)
            self._unreadable.add(checkpoint_id)
            return None
