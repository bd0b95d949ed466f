"""Head records: a signed, per-workload, ever-rising pointer to the newest checkpoint.

Every commit writes one after its manifest (docs/design.md, "Freshness and binding"):
``heads/<workload>/<sequence>`` (``layout.head_key``), an envelope of format
``gpusnap.head/1`` sealed like a manifest, whose payload names the workload, the sequence,
the checkpoint, the store id and the signing key id. Head objects are created only if
absent and never rewritten: the next sequence is one more than the highest the store lists
and the pushing node has seen, and a writer that loses the race for a name takes the next,
so two nodes committing one workload at once never write the same sequence and the newest
head is always the highest key. Old heads are pruned by gc.

``latest_checked`` is ``latest`` with freshness: it refuses (``RollbackRefused``, exit 4)
when the newest head names a checkpoint the store no longer has, when it is older than the
node's high-water mark (``highwater.py``), or when there is none although the node has seen
one; ``allow_rollback`` accepts what the store has (and lowers the mark to it). A workload
with no head and no mark (a store written before head records) gets the newest manifest,
with one note.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from gpusnap.errors import AlreadyExists, Corrupt, FailedPrecondition, GpusnapError, NotFound
from gpusnap.storage.binding import check_store_binding, note_once
from gpusnap.storage.catalog import list_manifests
from gpusnap.storage.context import StoreContext
from gpusnap.storage.highwater import Mark
from gpusnap.storage.layout import (
    HEAD_PREFIX,
    HEAD_SEQUENCE_DIGITS,
    head_key,
    head_prefix,
    head_sequence_of_key,
)
from gpusnap.storage.manifest import (
    Manifest,
    ManifestSummary,
    is_checkpoint_id,
    is_store_id,
    is_workload,
)
from gpusnap.storage.untrusted import MAX_RECORD_BYTES, read_capped

log = logging.getLogger(__name__)

HEAD_FORMAT = "gpusnap.head/1"
# Heads read (newest first) before giving up on finding an authentic one, and names tried
# when another writer took the sequence first.
MAX_HEAD_TRIES = 16
# Heads gc keeps per workload (the newest); older ones only cost a LIST entry each.
HEADS_KEPT = 8
_MAX_SEQUENCE = 10**HEAD_SEQUENCE_DIGITS - 1


class RollbackRefused(Corrupt):
    """The store's newest checkpoint of a workload is not what its head records promise."""


@dataclass(frozen=True)
class HeadRecord:
    workload: str
    sequence: int
    checkpoint_id: str
    store_id: str | None
    key_id: str | None
    checkpoint_created_at: float  # the manifest's created_at

    def payload(self) -> bytes:
        body: dict[str, Any] = {
            "workload": self.workload,
            "sequence": self.sequence,
            "checkpoint_id": self.checkpoint_id,
            "store_id": self.store_id,
            "key_id": self.key_id,
            "checkpoint_created_at": self.checkpoint_created_at,
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, payload: bytes, what: str) -> HeadRecord:
        try:
            body = json.loads(payload)
            head = cls(
                body["workload"],
                body["sequence"],
                body["checkpoint_id"],
                body["store_id"],
                body["key_id"],
                body["checkpoint_created_at"],
            )
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise Corrupt(f"{what} is not a readable head record") from exc
        if not (
            isinstance(head.sequence, int)
            and not isinstance(head.sequence, bool)
            and 0 < head.sequence <= _MAX_SEQUENCE
            and isinstance(head.checkpoint_id, str)
            and is_checkpoint_id(head.checkpoint_id)
            and (head.store_id is None or is_store_id(head.store_id))
            and (head.key_id is None or isinstance(head.key_id, str))
            and isinstance(head.checkpoint_created_at, int | float)
            and not isinstance(head.checkpoint_created_at, bool)
        ):
            raise Corrupt(f"{what} has an invalid field")
        return head

    @property
    def mark(self) -> Mark:
        return Mark(self.sequence, self.checkpoint_id)


def marks_key(ctx: StoreContext) -> str:
    """What the node's marks know this store by: its id, or its URL while the id is unknown."""
    identity = ctx.store_identity
    return identity.store_id if identity is not None else f"url:{ctx.backend.url}"


def _listed_heads(ctx: StoreContext, workload: str) -> list[tuple[int, str]]:
    """``(sequence, key)`` of every head object of ``workload``, highest first."""
    found = [
        (seq, info.key)
        for info in ctx.backend.list(head_prefix(workload))
        if (seq := head_sequence_of_key(info.key, workload)) is not None
    ]
    return sorted(found, reverse=True)


def _open_head(ctx: StoreContext, key: str, workload: str, sequence: int) -> HeadRecord:
    what = f"head record {key}"
    blob = read_capped(ctx.backend, key, MAX_RECORD_BYTES, what)
    head = HeadRecord.parse(ctx.keys.unseal(blob, HEAD_FORMAT, what=what), what)
    if head.workload != workload or head.sequence != sequence:
        raise Corrupt(f"{what} describes {head.workload} sequence {head.sequence}")
    check_store_binding(ctx, head.store_id, what)
    ctx.keys.check_scope(blob, workload, None, what)
    return head


def read_head(ctx: StoreContext, workload: str) -> HeadRecord | None:
    """The newest authentic head of ``workload``; ``None`` if it has none. ``Corrupt`` when
    heads exist and none of the newest ``MAX_HEAD_TRIES`` passes its checks."""
    listed = _listed_heads(ctx, workload)
    problems: list[str] = []
    for sequence, key in listed[:MAX_HEAD_TRIES]:
        try:
            return _open_head(ctx, key, workload, sequence)
        except NotFound:
            continue  # pruned while we listed
        except (Corrupt, FailedPrecondition) as exc:
            log.warning("skipping %s: %s", key, exc)
            problems.append(str(exc))
    if problems:
        raise Corrupt(f"no head record of {workload} passes its checks (newest: {problems[0]})")
    return None


def write_head(ctx: StoreContext, manifest: Manifest) -> HeadRecord | None:
    """After ``manifest`` is committed, create its head record (see the module docstring).

    Best effort: the checkpoint exists whatever happens here, so a failure is logged and
    ``None`` returned; ``latest`` still finds the checkpoint (the older head names one the
    store has).
    """
    workload = manifest.workload
    try:
        listed = _listed_heads(ctx, workload)
        mark = ctx.marks.get(marks_key(ctx), workload) if ctx.marks is not None else None
        sequence = max([listed[0][0] if listed else 0, mark.sequence if mark else 0]) + 1
        signer = ctx.keys.signer
        for _ in range(MAX_HEAD_TRIES):
            if sequence > _MAX_SEQUENCE:
                raise Corrupt(f"head sequences of {workload} are exhausted (planted names?)")
            head = HeadRecord(
                workload,
                sequence,
                manifest.checkpoint_id,
                manifest.store_id,
                signer.key_id if signer is not None else None,
                manifest.created_at,
            )
            try:
                ctx.backend.put(
                    head_key(workload, sequence),
                    ctx.keys.seal(HEAD_FORMAT, head.payload()),
                    if_absent=True,
                )
            except AlreadyExists:
                sequence += 1  # another commit took this one
                continue
            if ctx.marks is not None:
                ctx.marks.raise_to(marks_key(ctx), workload, head.mark)
            return head
        raise Corrupt(f"{MAX_HEAD_TRIES} head sequences of {workload} in a row were taken")
    except GpusnapError as exc:
        log.warning(
            "checkpoint %s is committed, but its head record was not written: %s",
            manifest.checkpoint_id,
            exc,
        )
        return None


@dataclass(frozen=True)
class Latest:
    """What ``latest_checked`` found: the checkpoint (``None``: the workload has none), and
    a note for a person when it is not vouched for by a head record (legacy, or accepted)."""

    summary: ManifestSummary | None
    note: str | None = None


def latest_checked(ctx: StoreContext, workload: str, *, allow_rollback: bool = False) -> Latest:
    """The newest checkpoint of ``workload``, if the store's heads vouch for it; see the
    module docstring."""
    listed, skipped = list_manifests(ctx, workload)
    store = marks_key(ctx)
    mark = ctx.marks.get(store, workload) if ctx.marks is not None else None
    problems: list[str] = []
    note: str | None = None
    head: HeadRecord | None = None
    try:
        head = read_head(ctx, workload)
    except Corrupt as exc:
        problems.append(str(exc))
    if head is None and not problems:
        if mark is not None:
            problems.append(
                f"the store has no head record of {workload}, but this node has seen sequence "
                f"{mark.sequence} (checkpoint {mark.checkpoint_id})"
            )
        else:
            note = (
                f"workload {workload} has no head record (written before head records "
                "existed): its latest checkpoint is its newest manifest, without rollback "
                "protection until its next checkpoint"
            )
            note_once(ctx, f"no-head {workload}", note)
    if head is not None:
        if mark is not None and head.sequence < mark.sequence:
            problems.append(
                f"the head of {workload} is sequence {head.sequence} (checkpoint "
                f"{head.checkpoint_id}), older than sequence {mark.sequence} (checkpoint "
                f"{mark.checkpoint_id}) this node has seen"
            )
        # The head's checkpoint may be gone and the answer still not older: a newer one
        # exists (two commits racing: a head may name a checkpoint created before another's).
        if head.checkpoint_id not in {s.checkpoint_id for s in listed} and not (
            listed and listed[0].created_at > head.checkpoint_created_at
        ):
            unreadable = any(key.endswith("/" + head.checkpoint_id) for key, _ in skipped)
            problems.append(
                f"the head of {workload} (sequence {head.sequence}) names checkpoint "
                f"{head.checkpoint_id}, which the store "
                + ("holds but cannot be read" if unreadable else "no longer has")
            )
    if problems:
        text = "; ".join(problems)
        if not allow_rollback:
            raise RollbackRefused(
                f"{text}: refusing an older checkpoint as the latest (rolled back or frozen "
                "store?); --allow-rollback accepts what the store holds"
            )
        note = f"{text}; accepted (--allow-rollback)"
        log.warning("%s", note)
        if ctx.marks is not None:
            ctx.marks.reset(store, workload, head.mark if head is not None else None)
    elif head is not None and ctx.marks is not None:
        ctx.marks.raise_to(store, workload, head.mark)
    return Latest(listed[0] if listed else None, note)


def prune_heads(ctx: StoreContext, *, dry_run: bool = False) -> int:
    """Delete all but the newest ``HEADS_KEPT`` head objects of every workload (gc); how
    many. A listed name that is not a head is left alone."""
    by_workload: dict[str, list[str]] = {}
    for info in ctx.backend.list(HEAD_PREFIX):
        workload = info.key.removeprefix(HEAD_PREFIX).partition("/")[0]
        if is_workload(workload) and head_sequence_of_key(info.key, workload) is not None:
            by_workload.setdefault(workload, []).append(info.key)
    old = [key for keys in by_workload.values() for key in sorted(keys)[:-HEADS_KEPT]]
    if not dry_run:
        for key in old:
            ctx.backend.delete(key)
    return len(old)
