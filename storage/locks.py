"""The push-lock protocol: what keeps the chunks a push names alive while a gc runs.

Keys (``layout.py``)::

    locks/push-<ckpt id>            a push in flight (refreshed while it runs)
    locks/gc-<gc id>                a gc run: started, swept, then its finish time

Both sides, in order (docs/design.md, "Why a push never loses a chunk to gc"):

- a gc (1) records itself (``GcRecord.start``); (2) looks for push locks (``push_locks``),
  and a fresh one means no chunk is deleted in this run; (3) says it sweeps
  (``GcRecord.mark_swept``) before it reads the manifests and deletes; (4) records its
  finish (``GcRecord.finish``);
- a push holds its lock while it runs (``push_lock``) and, before it cuts and again before it
  commits, rebuilds its index when a gc may have swept since the index was listed
  (``sync_index_if_gc_ran``); the second time it waits for running gcs first.

A gc record is an envelope of format ``gpusnap.gc-record/1`` sealed with the node's signing
key (``keys.seal``, like manifests and head records). Its claims (running, swept, finished)
count only when its signature is one this node accepts; any other record (unsigned, an
older gpusnap's plain JSON, signed by a key not trusted here, garbage) is judged by its
object's age alone, so nobody without a trusted key can hold a push waiting.

Every wait here ends by the job's deadline when the push has one (``DeadlineExceeded``).

Retention and the sweep themselves are ``gc.py``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from gpusnap.errors import (
    Corrupt,
    DeadlineExceeded,
    FailedPrecondition,
    GpusnapError,
    NotFound,
    Unavailable,
)
from gpusnap.storage.backend import Backend, ObjectInfo
from gpusnap.storage.context import StoreContext
from gpusnap.storage.index import rebuild_index
from gpusnap.storage.keys import seal
from gpusnap.storage.layout import (
    GC_RECORD_PREFIX,
    PUSH_LOCK_PREFIX,
    gc_record_key,
    push_lock_key,
)
from gpusnap.storage.manifest import new_checkpoint_id
from gpusnap.storage.untrusted import MAX_RECORD_BYTES, load_json, read_capped

log = logging.getLogger(__name__)

# Allowance for clocks of different hosts (and the store) disagreeing.
CLOCK_MARGIN_SECONDS = 300.0
GC_RECORD_FORMAT = "gpusnap.gc-record/1"
# gc records are kept this long; an index older than this is rebuilt before use.
GC_RECORD_KEEP_SECONDS = 7 * 86400.0


def _owner(started_at: float) -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started_at": started_at}


class LockHolder:
    """Writes a lock object and rewrites it every ``interval`` seconds until stopped."""

    def __init__(
        self,
        backend: Backend,
        key: str,
        body: dict[str, Any],
        interval: float,
        seal: Callable[[bytes], bytes] | None = None,
    ) -> None:
        self._backend = backend
        self.key = key
        self.body = body
        self._seal = seal
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, name=f"lock {key}", daemon=True)

    def start(self) -> None:
        self.write()
        self._thread.start()

    def write(self) -> None:
        self.body["refreshed_at"] = time.time()
        data = json.dumps(self.body, sort_keys=True).encode()
        self._backend.put(self.key, data if self._seal is None else self._seal(data))

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.write()
            except GpusnapError as exc:
                log.warning("could not refresh lock %s: %s", self.key, exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


# --- the push's side ---------------------------------------------------------------------


@contextmanager
def push_lock(ctx: StoreContext, checkpoint_id: str, started_at: float) -> Iterator[None]:
    """Hold ``locks/push-<checkpoint id>`` (refreshed) for the body; removed after it."""
    lock = LockHolder(
        ctx.backend,
        push_lock_key(checkpoint_id),
        _owner(started_at),
        ctx.options.lock_refresh_seconds,
    )
    lock.start()
    try:
        yield
    finally:
        lock.stop()
        try:
            ctx.backend.delete(lock.key)
        except GpusnapError as exc:
            log.warning("could not remove lock %s: %s", lock.key, exc)


@dataclass(frozen=True)
class GcRun:
    """What a gc record says of one gc run."""

    key: str
    started_at: float
    finished_at: float | None
    mtime: float
    swept: bool


def gc_runs(ctx: StoreContext) -> list[GcRun]:
    """Every gc record in the store.

    Anyone who can write to the store can write a record, so what one says counts only when
    it authenticates (signed by a key this node accepts; with verification off, any sealed
    record). Any other is none a gc of this node's trust wrote: it is judged by its object's
    age alone, as a gc that swept and finished when the object was written. That makes an
    index listed before then be rebuilt (safe) and holds no push waiting.
    """
    records = []
    for info in ctx.backend.list(GC_RECORD_PREFIX):
        try:
            records.append(_read_gc_run(ctx, info))
        except NotFound:
            continue
        except (Corrupt, FailedPrecondition) as exc:
            log.warning("gc record %s is not authentic (%s); judged by its age", info.key, exc)
            records.append(GcRun(info.key, info.mtime, info.mtime, info.mtime, True))
    return records


def _read_gc_run(ctx: StoreContext, info: ObjectInfo) -> GcRun:
    what = f"gc record {info.key}"
    blob = read_capped(ctx.backend, info.key, MAX_RECORD_BYTES, what)
    body = load_json(ctx.keys.unseal(blob, GC_RECORD_FORMAT, what=what), what)
    if not isinstance(body, dict):
        raise Corrupt(f"{what} is not a JSON object")
    finished = body.get("finished_at")
    swept = body.get("swept")
    if not isinstance(swept, bool):
        raise Corrupt(f"{what} has an invalid field")
    # A genuine record replayed (copied back under a fresh mtime) says no more than its
    # signed refresh time: it is running only while that is recent too.
    refreshed = _time(body.get("refreshed_at"), what)
    return GcRun(
        info.key,
        _time(body.get("started_at"), what),
        None if finished is None else _time(finished, what),
        min(info.mtime, refreshed + CLOCK_MARGIN_SECONDS),
        swept,
    )


def _time(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 2**40:
        raise Corrupt(f"{what} holds a time that is not one")
    return float(value)


def sync_index_if_gc_ran(
    ctx: StoreContext, *, wait_for_running: bool = False, deadline: float | None = None
) -> bool:
    """Rebuild the index when a gc may have deleted chunks since it was last listed.

    A gc record is dangerous to an index listed at ``T`` if that gc had not finished
    before ``T`` (less a clock margin). With ``wait_for_running``, gc runs still in
    progress are waited for first, so the LIST sees everything they deleted: at most the
    lock staleness (``Unavailable``), and never past ``deadline`` (epoch seconds, the job's:
    ``DeadlineExceeded``).
    """
    synced = ctx.index.synced_at
    now = time.time()
    stale_after = ctx.options.lock_stale_seconds
    if synced is None or synced < now - GC_RECORD_KEEP_SECONDS + CLOCK_MARGIN_SECONDS:
        rebuild_index(ctx.backend, ctx.index)
        return True
    wait_until = time.monotonic() + stale_after
    while True:
        risky = [
            r
            for r in gc_runs(ctx)
            if r.finished_at is None or (r.swept and r.finished_at >= synced - CLOCK_MARGIN_SECONDS)
        ]
        if not risky:
            return False
        running = [
            r for r in risky if r.finished_at is None and r.mtime >= time.time() - stale_after
        ]
        if not (wait_for_running and running):
            break
        if time.monotonic() > wait_until:
            raise Unavailable(f"gc {running[0].key} is still running; push not committed")
        if deadline is not None and time.time() >= deadline:
            raise DeadlineExceeded(
                f"gc {running[0].key} is still running at the job's deadline; push not committed"
            )
        time.sleep(0.2 if deadline is None else max(0.0, min(0.2, deadline - time.time())))
    rebuild_index(ctx.backend, ctx.index)
    return True


# --- the gc's side -----------------------------------------------------------------------


def _seal_record(ctx: StoreContext, payload: bytes) -> bytes:
    """The record sealed with the node's key; unsigned where it has only a public key (a gc
    of such a node still records itself; no reader trusts what its record claims)."""
    signer = ctx.keys.signer
    if signer is not None and signer.private_key is None:
        signer = None
    return seal(GC_RECORD_FORMAT, payload, signer=signer, encryption=ctx.keys.encryption)


class GcRecord:
    """This gc run's record, ``locks/gc-<id>``: started, swept, finished (refreshed)."""

    def __init__(self, ctx: StoreContext, now: float) -> None:
        body = {**_owner(now), "finished_at": None, "swept": False}
        self._holder = LockHolder(
            ctx.backend,
            gc_record_key(new_checkpoint_id(now)),
            body,
            ctx.options.lock_refresh_seconds,
            seal=lambda payload: _seal_record(ctx, payload),
        )
        self.key = self._holder.key

    def start(self) -> None:
        """Write the record (a gc that cannot write it must not delete anything)."""
        self._holder.start()

    def mark_swept(self) -> None:
        """Say, before deleting anything, that this run sweeps: overlapping pushes re-check."""
        self._holder.body["swept"] = True
        self._holder.write()

    def finish(self) -> None:
        self._holder.stop()
        self._holder.body["finished_at"] = time.time()
        self._holder.write()


def push_locks(ctx: StoreContext) -> tuple[list[str], list[ObjectInfo]]:
    """The keys of fresh push locks (pushes in flight), and the stale ones (dead pushes)."""
    now = time.time()
    fresh: list[str] = []
    stale: list[ObjectInfo] = []
    for info in ctx.backend.list(PUSH_LOCK_PREFIX):
        if info.mtime >= now - ctx.options.lock_stale_seconds:
            fresh.append(info.key)
        else:
            stale.append(info)
    return fresh, stale


def remove_old_gc_records(ctx: StoreContext, own_key: str | None) -> None:
    """Delete the records of gc runs that ended more than ``GC_RECORD_KEEP_SECONDS`` ago."""
    cutoff = time.time() - GC_RECORD_KEEP_SECONDS
    for record in gc_runs(ctx):
        if record.key == own_key:
            continue
        end = record.finished_at if record.finished_at is not None else record.mtime
        if end < cutoff:
            ctx.backend.delete(record.key)
