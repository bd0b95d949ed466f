"""gc and retention: delete what no checkpoint needs, without racing a push.

A gc: (1) records itself under ``locks/gc-<id>``; (2) looks for push locks, and a fresh one
means no chunk is deleted in this run; (3) applies retention (the newest N manifests of each
workload are kept); (4) says it sweeps, then reads the manifests and deletes unreferenced
chunks older than the grace period; (5) records its finish. The protocol between a gc and a
push (the lock, the record and what a push does when it sees one) is ``storage/locks.py``. On
a full disk (1) spends the store's space reserve, which the gc puts back after its sweep.
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from gpusnap.errors import Corrupt, FailedPrecondition, GpusnapError, InvalidArgument, NotFound
from gpusnap.storage.backend import ObjectInfo, release_space_reserve, restore_space_reserve
from gpusnap.storage.catalog import read_manifest
from gpusnap.storage.context import StoreContext
from gpusnap.storage.heads import prune_heads
from gpusnap.storage.keys import UntrustedSigner
from gpusnap.storage.layout import (
    CHUNK_PREFIX,
    MANIFEST_PREFIX,
    chunk_id_of_key,
    split_manifest_key,
)
from gpusnap.storage.locks import GcRecord, push_locks, remove_old_gc_records

log = logging.getLogger(__name__)


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
    # Manifests signed by a key this node does not trust: never deleted by it, their chunks
    # kept, and not counted by retention (an untrusted checkpoint may not push out a trusted
    # one; a node that does not trust a signer has no say over that signer's checkpoints).
    untrusted: list[str] = field(default_factory=list)
    # The store's disk was full: gc released its space reserve to record itself.
    reserve_released: bool = False
    # After this gc the store has no space reserve (no room to recreate it yet).
    reserve_missing: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def collect(
    ctx: StoreContext, *, keep_last: int | None, grace_seconds: float, dry_run: bool
) -> GcReport:
    """Apply retention, then delete chunks no manifest references and older than grace.

    Order matters: (1) record this gc under ``locks/gc-<id>``; (2) look for push locks —
    a fresh one means no chunk is deleted in this run; (3) only then read the manifests;
    (4) delete unreferenced chunks older than the grace period; (5) record the finish.
    A push that starts after (2) sees this gc's record before committing and re-checks
    its chunks (``locks.sync_index_if_gc_ran``).
    """
    if keep_last is not None and keep_last < 1:
        raise InvalidArgument("keep_last must be at least 1")
    if grace_seconds < 0:
        raise InvalidArgument("grace must not be negative")
    report = GcReport(dry_run=dry_run)
    record: GcRecord | None = None
    if not dry_run:
        record = GcRecord(ctx, time.time())
        report.reserve_released = _start_record(ctx, record)
    try:
        _gc_locks(ctx, report, dry_run)
        if keep_last is not None:
            _gc_retention(ctx, report, keep_last, dry_run)
        pruned = prune_heads(ctx, dry_run=dry_run)  # the newest heads are all a reader uses
        if pruned:
            log.info("gc: %d old head record(s) %s", pruned, "to prune" if dry_run else "pruned")
        if not report.blocked_by:
            if record is not None:
                # Pushes that overlap a sweeping gc re-check their chunks; say so first.
                record.mark_swept()
            _gc_sweep(ctx, report, grace_seconds, dry_run)
    finally:
        if record is not None:
            record.finish()
    if not dry_run:
        remove_old_gc_records(ctx, record.key if record else None)
        report.reserve_missing = not _restore_reserve(ctx)
    return report


def _start_record(ctx: StoreContext, record: GcRecord) -> bool:
    """Write this gc's record; on a full disk, spend the store's space reserve on it.

    Without its record a gc could delete chunks a concurrent push is about to name, so a
    gc that cannot write it does not run. A full disk is when operators run gc, so the
    first full-disk failure releases the reserve (``file://``) and the write is tried once
    more; only gc does that, never a push. ``True`` when the reserve was released.
    """
    try:
        record.start()
        return False
    except FailedPrecondition as exc:
        if not (_disk_full(exc) and release_space_reserve(ctx.backend)):
            raise _cannot_record(exc) from exc
    try:
        record.start()
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


def _restore_reserve(ctx: StoreContext) -> bool:
    """Put back the space reserve after a sweep; best effort, never failing the gc.

    ``False`` when the store is left without one."""
    try:
        restored = restore_space_reserve(ctx.backend)
    except GpusnapError as exc:
        log.warning("gc: cannot recreate the store's space reserve: %s", exc)
        return False
    if not restored:
        log.warning("gc: the store is still too full to recreate its space reserve")
    return restored


def _gc_locks(ctx: StoreContext, report: GcReport, dry_run: bool) -> None:
    fresh, stale = push_locks(ctx)
    report.blocked_by.extend(fresh)
    for info in stale:
        report.stale_locks_removed.append(info.key)
        if not dry_run:
            ctx.backend.delete(info.key)
    if report.blocked_by:
        log.info("gc: pushes in flight (%s); no chunk is deleted", ", ".join(report.blocked_by))


def _gc_retention(ctx: StoreContext, report: GcReport, keep_last: int, dry_run: bool) -> None:
    by_workload: dict[str, list[tuple[float, str, str]]] = {}
    for info in ctx.backend.list(MANIFEST_PREFIX):
        parts = split_manifest_key(info.key)
        if parts is None:
            continue
        try:
            created = read_manifest(ctx, info.key).created_at
        except UntrustedSigner as exc:
            report.untrusted.append(f"{info.key}: signed by key {exc.key_id} (kept)")
            continue
        except (Corrupt, NotFound, FailedPrecondition) as exc:
            report.problems.append(f"{info.key}: {exc} (kept)")
            continue
        by_workload.setdefault(parts[0], []).append((created, parts[1], info.key))
    for entries in by_workload.values():
        entries.sort(reverse=True)
        for _created, checkpoint_id, key in entries[keep_last:]:
            report.manifests_deleted.append(checkpoint_id)
            if not dry_run:
                ctx.backend.delete(key)


def _gc_sweep(ctx: StoreContext, report: GcReport, grace_seconds: float, dry_run: bool) -> None:
    referenced: set[str] = set()
    deleted_manifests = set(report.manifests_deleted) if not dry_run else set()
    pretend_deleted = set(report.manifests_deleted) if dry_run else set()
    for info in ctx.backend.list(MANIFEST_PREFIX):
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
            manifest = read_manifest(ctx, info.key, verify=False)
        except (Corrupt, FailedPrecondition) as exc:
            report.problems.append(f"{info.key}: {exc}; no chunk deleted")
            return
        except NotFound:
            continue
        referenced |= manifest.chunk_ids()
    report.chunks_referenced = len(referenced)
    cutoff = time.time() - grace_seconds
    doomed: list[ObjectInfo] = []
    for info in ctx.backend.list(CHUNK_PREFIX):
        chunk_id = chunk_id_of_key(info.key)
        if chunk_id is None or chunk_id in referenced:
            continue
        if info.mtime > cutoff:
            report.chunks_kept_in_grace += 1
            continue
        doomed.append(info)
    for info in doomed:
        if not dry_run:
            ctx.backend.delete(info.key)
        report.chunks_deleted += 1
        report.bytes_freed += info.size
    if not dry_run:
        ctx.index.discard(cid for i in doomed if (cid := chunk_id_of_key(i.key)))
