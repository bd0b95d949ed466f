"""gc, retention and the locks that keep a push's chunks safe from a concurrent gc.

Key layout (docs/design.md)::

    locks/push-<ckpt id>            a push in flight (refreshed while it runs)
    locks/gc-<gc id>                a gc run: started, swept, then its finish time

A gc: (1) records itself under ``locks/gc-<id>``; (2) looks for push locks, and a fresh one
means no chunk is deleted in this run; (3) only then reads the manifests; (4) deletes
unreferenced chunks older than the grace period; (5) records its finish. A push that started
after (2) sees the record before committing and re-checks its chunks
(``sync_index_if_gc_ran``). On a full disk (1) spends the store's space reserve, which the
gc puts back after its sweep. The functions here work on a ``GcHost`` (the
``CheckpointStore``), which reads manifests and rebuilds the index.
"""

from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from gpusnap.errors import (
    Corrupt,
    FailedPrecondition,
    GpusnapError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from gpusnap.storage.backend import (
    Backend,
    ObjectInfo,
    release_space_reserve,
    restore_space_reserve,
)
from gpusnap.storage.index import ChunkIndex
from gpusnap.storage.manifest import (
    MANIFEST_PREFIX,
    Manifest,
    new_checkpoint_id,
    split_manifest_key,
)
from gpusnap.storage.pipeline import CHUNK_PREFIX, chunk_id_of_key

log = logging.getLogger(__name__)

LOCK_PREFIX = "locks/"
# A lock not refreshed for this long belongs to a dead process.
LOCK_STALE_SECONDS = 900.0
LOCK_REFRESH_SECONDS = 120.0
# Allowance for clocks of different hosts (and the store) disagreeing.
CLOCK_MARGIN_SECONDS = 300.0
# gc records are kept this long; an index older than this is rebuilt before use.
GC_RECORD_KEEP_SECONDS = 7 * 86400.0


@dataclass
class GcReport:
    dry_run: bool = False
    manifests_deleted: list[str] = field(default_factory=list)
    chunks_deleted: int = 0
    bytes_freed: int = 0
    chunks_kept_in_grace: int = 0
    chunks_referenced: int = 0
    blocked_by: list[str] = field(default_factory=list)
    stale_locks_removed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    # The store's disk was full: gc released its space reserve to record itself.
    reserve_released: bool = False
    # After this gc the store has no space reserve (no room to recreate it yet).
    reserve_missing: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GcRecord:
    key: str
    started_at: float
    finished_at: float | None
    mtime: float
    swept: bool


class LockHolder:
    """Writes a lock object and rewrites it every ``interval`` seconds until stopped."""

    def __init__(self, backend: Backend, key: str, body: dict[str, Any], interval: float) -> None:
        self._backend = backend
        self.key = key
        self.body = body
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, name=f"lock {key}", daemon=True)

    def start(self) -> None:
        self.write()
        self._thread.start()

    def write(self) -> None:
        self.body["refreshed_at"] = time.time()
        self._backend.put(self.key, json.dumps(self.body).encode())

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


class GcHost(Protocol):
    """What gc needs of a store (``CheckpointStore`` is one)."""

    backend: Backend
    index: ChunkIndex
    lock_stale_seconds: float
    lock_refresh_seconds: float

    def rebuild_index(self) -> int: ...

    def _read_manifest(self, key: str, *, verify: bool | None = None) -> Manifest: ...


def gc_records(backend: Backend) -> builtins.list[GcRecord]:
    """Every gc record in the store; an unreadable one reads as a gc running now."""
    records = []
    for info in backend.list(f"{LOCK_PREFIX}gc-"):
        try:
            body = json.loads(backend.get(info.key))
            started = float(body["started_at"])
            finished = body.get("finished_at")
            records.append(
                GcRecord(
                    info.key,
                    started,
                    None if finished is None else float(finished),
                    info.mtime,
                    bool(body.get("swept", True)),
                )
            )
        except NotFound:
            continue
        except (ValueError, KeyError, TypeError):
            # An unreadable record: assume the worst (a gc that is running now).
            records.append(GcRecord(info.key, time.time(), None, time.time(), True))
    return records


def sync_index_if_gc_ran(host: GcHost, *, wait_for_running: bool = False) -> bool:
    """Rebuild the index when a gc may have deleted chunks since it was last listed.

    A gc record is dangerous to an index listed at ``T`` if that gc had not finished
    before ``T`` (less a clock margin). With ``wait_for_running``, gc runs still in
    progress are waited for first, so the LIST sees everything they deleted.
    """
    synced = host.index.synced_at
    now = time.time()
    if synced is None or synced < now - GC_RECORD_KEEP_SECONDS + CLOCK_MARGIN_SECONDS:
        host.rebuild_index()
        return True
    deadline = time.monotonic() + host.lock_stale_seconds
    while True:
        records = gc_records(host.backend)
        risky = [
            r
            for r in records
            if r.finished_at is None or (r.swept and r.finished_at >= synced - CLOCK_MARGIN_SECONDS)
        ]
        if not risky:
            return False
        running = [
            r
            for r in risky
            if r.finished_at is None and r.mtime >= time.time() - host.lock_stale_seconds
        ]
        if not (wait_for_running and running):
            break
        if time.monotonic() > deadline:
            raise Unavailable(f"gc {running[0].key} is still running; push not committed")
        time.sleep(0.2)
    host.rebuild_index()
    return True


def collect(
    host: GcHost, *, keep_last: int | None, grace_seconds: float, dry_run: bool
) -> GcReport:
    """Apply retention, then delete chunks no manifest references and older than grace.

    Order matters: (1) record this gc under ``locks/gc-<id>``; (2) look for push locks —
    a fresh one means no chunk is deleted in this run; (3) only then read the manifests;
    (4) delete unreferenced chunks older than the grace period; (5) record the finish.
    A push that starts after (2) sees this gc's record before committing and re-checks
    its chunks (``_sync_index_if_gc_ran``).
    """
    if keep_last is not None and keep_last < 1:
        raise InvalidArgument("keep_last must be at least 1")
    if grace_seconds < 0:
        raise InvalidArgument("grace must not be negative")
    report = GcReport(dry_run=dry_run)
    now = time.time()
    holder: LockHolder | None = None
    if not dry_run:
        holder = LockHolder(
            host.backend,
            f"{LOCK_PREFIX}gc-{new_checkpoint_id(now)}",
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started_at": now,
                "finished_at": None,
                "swept": False,
            },
            host.lock_refresh_seconds,
        )
        report.reserve_released = _start_record(host.backend, holder)
    try:
        _gc_locks(host, report, dry_run)
        if keep_last is not None:
            _gc_retention(host, report, keep_last, dry_run)
        if not report.blocked_by:
            if holder is not None:
                # Pushes that overlap a sweeping gc re-check their chunks; say so first.
                holder.body["swept"] = True
                holder.write()
            _gc_sweep(host, report, grace_seconds, dry_run)
    finally:
        if holder is not None:
            holder.stop()
            holder.body["finished_at"] = time.time()
            holder.write()
    if not dry_run:
        _gc_old_records(host.backend, holder.key if holder else None)
        report.reserve_missing = not _restore_reserve(host.backend)
    return report


def _start_record(backend: Backend, holder: LockHolder) -> bool:
    """Write this gc's record; on a full disk, spend the store's space reserve on it.

    Without its record a gc could delete chunks a concurrent push is about to name, so a
    gc that cannot write it does not run. A full disk is when operators run gc, so the
    first full-disk failure releases the reserve (``file://``) and the write is tried once
    more; only gc does that, never a push. ``True`` when the reserve was released.
    """
    try:
        holder.start()
        return False
    except FailedPrecondition as exc:
        if not (_disk_full(exc) and release_space_reserve(backend)):
            raise _cannot_record(exc) from exc
    try:
        holder.start()
    except FailedPrecondition as exc:
        raise _cannot_record(exc) from exc
    return True


def _disk_full(exc: GpusnapError) -> bool:
    cause = exc.__cause__  # backends translate an OSError ``from`` it
    return isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)


def _cannot_record(exc: GpusnapError) -> FailedPrecondition:
    hint = ""
    if _disk_full(exc):
        hint = (
            "; the store is full and its space reserve is used up: free a little space "
            "beside it (or delete old manifests under manifests/) and run gc again; "
            "`gc --dry-run` shows what it would delete"
        )
    return FailedPrecondition(f"gc cannot record itself in the store ({exc}){hint}")


def _restore_reserve(backend: Backend) -> bool:
    """Put back the space reserve after a sweep; best effort, never failing the gc.

    ``False`` when the store is left without one."""
    try:
        restored = restore_space_reserve(backend)
    except GpusnapError as exc:
        log.warning("gc: cannot recreate the store's space reserve: %s", exc)
        return False
    if not restored:
        log.warning("gc: the store is still too full to recreate its space reserve")
    return restored


def _gc_locks(host: GcHost, report: GcReport, dry_run: bool) -> None:
    now = time.time()
    for info in host.backend.list(f"{LOCK_PREFIX}push-"):
        if info.mtime >= now - host.lock_stale_seconds:
            report.blocked_by.append(info.key)
        else:
            report.stale_locks_removed.append(info.key)
            if not dry_run:
                host.backend.delete(info.key)
    if report.blocked_by:
        log.info("gc: pushes in flight (%s); no chunk is deleted", ", ".join(report.blocked_by))


def _gc_retention(host: GcHost, report: GcReport, keep_last: int, dry_run: bool) -> None:
    by_workload: dict[str, builtins.list[tuple[float, str, str]]] = {}
    for info in host.backend.list(MANIFEST_PREFIX):
        parts = split_manifest_key(info.key)
        if parts is None:
            continue
        try:
            created = host._read_manifest(info.key).created_at
        except (Corrupt, NotFound, FailedPrecondition) as exc:
            report.problems.append(f"{info.key}: {exc} (kept)")
            continue
        by_workload.setdefault(parts[0], []).append((created, parts[1], info.key))
    for entries in by_workload.values():
        entries.sort(reverse=True)
        for _created, checkpoint_id, key in entries[keep_last:]:
            report.manifests_deleted.append(checkpoint_id)
            if not dry_run:
                host.backend.delete(key)


def _gc_sweep(host: GcHost, report: GcReport, grace_seconds: float, dry_run: bool) -> None:
    referenced: set[str] = set()
    deleted_manifests = set(report.manifests_deleted) if not dry_run else set()
    pretend_deleted = set(report.manifests_deleted) if dry_run else set()
    for info in host.backend.list(MANIFEST_PREFIX):
        parts = split_manifest_key(info.key)
        if parts is None:
            # Not a manifest: no reader ever opens it, so it keeps no chunk alive.
            report.problems.append(
                f"stray object {info.key!r} under {MANIFEST_PREFIX} is not a manifest "
                "(ignored; remove it)"
            )
            continue
        if parts[1] in deleted_manifests or parts[1] in pretend_deleted:
            continue
        try:
            # Authenticity does not matter for marking: keeping more is always safe.
            manifest = host._read_manifest(info.key, verify=False)
        except (Corrupt, FailedPrecondition) as exc:
            report.problems.append(f"{info.key}: {exc}; no chunk deleted")
            return
        except NotFound:
            continue
        referenced |= manifest.chunk_ids()
    report.chunks_referenced = len(referenced)
    cutoff = time.time() - grace_seconds
    doomed: builtins.list[ObjectInfo] = []
    for info in host.backend.list(CHUNK_PREFIX):
        chunk_id = chunk_id_of_key(info.key)
        if chunk_id is None or chunk_id in referenced:
            continue
        if info.mtime > cutoff:
            report.chunks_kept_in_grace += 1
            continue
        doomed.append(info)
    for info in doomed:
        if not dry_run:
            host.backend.delete(info.key)
        report.chunks_deleted += 1
        report.bytes_freed += info.size
    if not dry_run:
        host.index.discard(cid for i in doomed if (cid := chunk_id_of_key(i.key)))


def _gc_old_records(backend: Backend, own_key: str | None) -> None:
    cutoff = time.time() - GC_RECORD_KEEP_SECONDS
    for record in gc_records(backend):
        if record.key == own_key:
            continue
        end = record.finished_at if record.finished_at is not None else record.mtime
        if end < cutoff:
            backend.delete(record.key)
