"""The migration board: reclaimed checkpoints find a new node through the store, exactly once.

Keys, under the store's reserved ``migrations/`` prefix, one folder per checkpoint; every
object is written once (if absent) and is a JSON record sealed with the store's signing key,
so a node acts only on requests a trusted node wrote::

    migrations/<checkpoint id>/request          the reclaimed node asks for a new home
    migrations/<checkpoint id>/claim-0000       the node that won the claim (attempt 0)
    migrations/<checkpoint id>/claim-0001       a takeover after claim 0 went silent
    migrations/<checkpoint id>/outcome          how it ended: restored, cold-started, failed

A claim is a conditional create: ``If-None-Match: *`` on S3, ``link(2)`` onto a new name on
``file://``. Either way exactly one writer of ``claim-NNNN`` succeeds; the others get
``AlreadyExists`` and stand down.

Only records that open with the store's key, are well formed and name the checkpoint of their
folder count; anything else under ``migrations/`` (a planted ``claim-9999``, a garbage
``outcome``) is ignored and logged, so whoever can write to the store but lacks the key cannot
stall a migration: a new claim takes the attempt number after every ``claim-N`` name present,
valid or not, and an outcome whose name is taken by garbage replaces it.

A claim with no outcome after ``claim_timeout_s`` is stale (its node died mid-restore); the
request is then pending again and the next claim uses the next attempt number — this is the
only way two nodes can both act on one checkpoint, and it needs the first to have gone silent
for the whole timeout.

The board reaches the store through one small seam, ``BoardRecords`` (create-if-absent, read,
list and delete of signed records), implemented by ``StoreRecords`` over the store's signed
records under ``layout.MIGRATION_PREFIX`` (``storage/records.py``): no raw backend keys.
Standby nodes read the board in ``reclaim/standby.py``.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar, Literal, Protocol, TypeVar, Union, get_args, get_origin
from typing import get_type_hints as _hints

from gpusnap.errors import (
    AlreadyExists,
    Corrupt,
    FailedPrecondition,
    GpusnapError,
    InvalidArgument,
    NotFound,
)
from gpusnap.storage.layout import MIGRATION_PREFIX
from gpusnap.storage.manifest import check_checkpoint_id
from gpusnap.storage.records import SignedRecords
from gpusnap.storage.store import CheckpointStore

log = logging.getLogger(__name__)

RECORD_VERSION = 1
ClaimMode = Literal["restore", "cold-start"]
OutcomeState = Literal["succeeded", "failed"]


# --- the seam to the store ----------------------------------------------------------------------


class BoardRecords(Protocol):
    """The board's whole use of the store: the signed records under the store's migration
    prefix (``storage/records.py``'s ``SignedRecords`` has this shape), by name
    (``<checkpoint id>/request``, ``<checkpoint id>/claim-NNNN``, ``<checkpoint id>/outcome``)."""

    def key(self, name: str) -> str:
        """The store key of record ``name`` (for messages)."""
        ...

    def create(self, name: str, record: Mapping[str, Any]) -> None:
        """Write ``record`` once; ``AlreadyExists`` if anything is there."""
        ...

    def read(self, name: str) -> dict[str, Any]:
        """The record, authenticated: ``NotFound``, or ``Corrupt`` when it does not open with
        the store's key or is not a JSON object."""
        ...

    def names(self, under: str = "") -> list[str]:
        """The names of the records (valid or not)."""
        ...

    def delete(self, name: str) -> None: ...


class StoreRecords:
    """``BoardRecords`` over the daemon's store handle: ``store`` opens the store (at once, or
    ``Unavailable`` while it is unreachable), so a board exists before its store answers and
    each call finds it again. The one place the board touches the store."""

    def __init__(self, store: Callable[[], CheckpointStore]) -> None:
        self._store = store

    def _records(self) -> SignedRecords:
        return self._store().records(MIGRATION_PREFIX)

    def key(self, name: str) -> str:
        return f"{MIGRATION_PREFIX}{name}"

    def create(self, name: str, record: Mapping[str, Any]) -> None:
        self._records().create(name, record)

    def read(self, name: str) -> dict[str, Any]:
        return self._records().read(name)

    def names(self, under: str = "") -> list[str]:
        return self._records().names(under)

    def delete(self, name: str) -> None:
        self._records().delete(name)


# --- records ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Record:
    KIND: ClassVar[str]  # "request" | "claim" | "outcome": the record's format name
    checkpoint_id: str  # every record is about one checkpoint: the one of its folder


@dataclass(frozen=True)
class MigrationRequest(_Record):
    KIND = "request"
    workload: str
    source_node: str
    created_at: float
    deadline: float | None = None
    stamp_summary: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MigrationClaim(_Record):
    KIND = "claim"
    node_id: str
    mode: ClaimMode
    attempt: int
    claimed_at: float
    reason: str = ""
    nonce: str = ""


@dataclass(frozen=True)
class MigrationOutcome(_Record):
    KIND = "outcome"
    node_id: str
    state: OutcomeState
    mode: str  # "restored" | "cold-start" | "" when it failed before knowing
    attempt: int
    finished_at: float
    detail: str = ""
    job_id: str = ""


_R = TypeVar("_R", bound=_Record)


@dataclass(frozen=True)
class MigrationStatus:
    request: MigrationRequest
    claim: MigrationClaim | None
    outcome: MigrationOutcome | None
    stale_claim: bool = False

    @property
    def status(self) -> str:
        if self.outcome is not None:
            return "restored" if self.outcome.state == "succeeded" else "failed"
        if self.claim is not None and not self.stale_claim:
            return "claimed"
        return "pending"

    def to_dict(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.request.checkpoint_id,
            "status": self.status,
            "request": asdict(self.request),
            "claim": asdict(self.claim) if self.claim else None,
            "stale_claim": self.stale_claim,
            "outcome": asdict(self.outcome) if self.outcome else None,
        }


def _claim_key(checkpoint_id: str, attempt: int) -> str:
    return f"{checkpoint_id}/claim-{attempt:04d}"


# At most 18 digits: an attempt number always fits, and a planted name cannot make one huge.
_CLAIM_NAME = re.compile(r"claim-([0-9]{1,18})")


def _json_types(hint: object) -> tuple[type, ...]:
    """The JSON value types a record field annotated ``hint`` may hold (a number may be
    written as an int)."""
    origin = get_origin(hint)
    if origin is Literal:
        return (str,)
    if origin in (Union, types.UnionType):
        return tuple(t for arg in get_args(hint) for t in _json_types(arg))
    if hint is float:
        return (int, float)
    return (origin or hint,)  # type: ignore[return-value]


def _check_record(key: str, doc: dict[str, Any], folder: str, cls: type[_Record]) -> None:
    """``Corrupt`` unless ``doc`` has the fields of a ``cls`` record (those without a default
    at least), each of its annotated type and value, and names the checkpoint of ``folder``."""
    hints = _hints(cls)
    for f in fields(cls):
        if f.name not in doc:
            if f.default is MISSING:
                raise Corrupt(f"migration record {key} lacks {f.name!r}")
            continue
        value, allowed = doc[f.name], _json_types(hints[f.name])
        if isinstance(value, bool) or not isinstance(value, allowed):
            raise Corrupt(f"migration record {key}: {f.name!r} is not a {allowed[0].__name__}")
        if get_origin(hints[f.name]) is Literal and value not in get_args(hints[f.name]):
            raise Corrupt(f"migration record {key}: unknown {f.name} {value!r}")
    if doc["checkpoint_id"] != folder:
        raise Corrupt(f"migration record {key} names checkpoint {doc['checkpoint_id']!r}")


class MigrationBoard:
    """Migration requests, claims and outcomes in the store."""

    def __init__(
        self,
        records: BoardRecords,
        *,
        claim_timeout_s: float = 1800.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.records = records
        self.claim_timeout_s = claim_timeout_s
        self._clock = clock

    # --- sealed JSON records ------------------------------------------------------------------

    def _write(self, key: str, record: _Record) -> None:
        fmt = f"gpusnap.migration.{record.KIND}/{RECORD_VERSION}"
        self.records.create(key, {"format": fmt, **asdict(record)})

    def _read_as(self, key: str, cls: type[_R]) -> _R:
        """The record at ``key``, opened, checked and of the checkpoint of its folder;
        ``Corrupt`` (or ``NotFound``) otherwise."""
        doc = self.records.read(key)
        where = self.records.key(key)
        if doc.pop("format", None) != f"gpusnap.migration.{cls.KIND}/{RECORD_VERSION}":
            raise Corrupt(f"migration record {where} is not a {cls.KIND} record")
        _check_record(where, doc, key.partition("/")[0], cls)
        try:
            return cls(**doc)
        except TypeError as exc:
            raise Corrupt(f"migration record {where} has unexpected fields") from exc

    def _write_or_read(self, key: str, record: _R) -> _R | None:
        """Write ``record`` once at ``key``. ``None`` when ours landed; else the valid record
        already there. A record there that does not hold is not one of ours: it counts for
        nothing and must not keep ours out (a claim would go stale and the workload be restored
        twice), so it is replaced."""
        try:
            self._write(key, record)
        except AlreadyExists:
            try:
                return self._read_as(key, type(record))
            except Corrupt as exc:
                log.warning(
                    "replacing migration record %s, which does not hold: %s",
                    self.records.key(key),
                    exc,
                )
                self.records.delete(key)
                self._write(key, record)
        return None

    # --- API ----------------------------------------------------------------------------------

    def publish(
        self,
        checkpoint_id: str,
        workload: str,
        source_node: str,
        stamp_summary: Mapping[str, Any] | None = None,
        *,
        deadline: float | None = None,
    ) -> MigrationRequest:
        """Ask for a new home for a committed checkpoint; publishing twice is harmless."""
        check_checkpoint_id(checkpoint_id)
        req = MigrationRequest(
            checkpoint_id,
            workload,
            source_node,
            self._clock(),
            deadline,
            dict(stamp_summary or {}),
        )
        existing = self._write_or_read(f"{checkpoint_id}/request", req)
        if existing is not None:
            log.info("migration request for %s already published", checkpoint_id)
            return existing
        log.warning("published migration request for %s (%s)", checkpoint_id, workload)
        return req

    def _folders(self) -> dict[str, set[str]]:
        folders: dict[str, set[str]] = {}
        for rest in self.records.names():
            cid, sep, name = rest.partition("/")
            if sep and "/" not in name:
                folders.setdefault(cid, set()).add(name)
        return folders

    def _status(self, cid: str, names: set[str]) -> MigrationStatus:
        """The migration of ``cid`` as its valid records tell it. ``Corrupt``/``NotFound`` when
        the request itself does not hold; invalid claims and outcomes are ignored (logged)."""
        req = self._read_as(f"{cid}/request", MigrationRequest)
        claim: MigrationClaim | None = None
        for attempt in sorted(_claim_numbers(names), reverse=True):
            key = _claim_key(cid, attempt)
            found = self._valid(key, MigrationClaim)
            if found is not None and found.attempt != attempt:
                log.warning("ignoring migration record %s: it says attempt %d", key, found.attempt)
                found = None
            if found is not None:
                claim = found
                break
        outcome: MigrationOutcome | None = None
        if "outcome" in names:
            outcome = self._valid(f"{cid}/outcome", MigrationOutcome)
        stale = (
            outcome is None
            and claim is not None
            and self._clock() - claim.claimed_at > self.claim_timeout_s
        )
        return MigrationStatus(req, claim, outcome, stale)

    def _valid(self, key: str, cls: type[_R]) -> _R | None:
        """The record at ``key`` if it holds, else ``None`` (logged: someone without the key
        wrote it, or it is damaged; either way it does not count)."""
        try:
            return self._read_as(key, cls)
        except NotFound:
            return None
        except (Corrupt, FailedPrecondition) as exc:
            log.warning("ignoring migration record %s: %s", key, exc)
            return None

    def get(self, checkpoint_id: str) -> MigrationStatus:
        check_checkpoint_id(checkpoint_id)
        names = self._folders().get(checkpoint_id)
        if not names or "request" not in names:
            raise NotFound(f"no migration request for checkpoint {checkpoint_id}")
        return self._status(checkpoint_id, names)

    def statuses(self) -> list[MigrationStatus]:
        """Every migration whose request holds; one that fails its check is skipped."""
        out: list[MigrationStatus] = []
        for cid, names in sorted(self._folders().items()):
            if "request" not in names:
                continue
            try:
                check_checkpoint_id(cid)
                out.append(self._status(cid, names))
            except (Corrupt, NotFound, InvalidArgument, FailedPrecondition) as exc:
                log.warning("skipping migration %s: %s", cid, exc)
        return out

    def pending(self) -> list[MigrationRequest]:
        """Requests nobody has (live) claimed and that have no valid outcome, oldest first."""
        out = [st.request for st in self.statuses() if st.status == "pending"]
        return sorted(out, key=lambda r: r.created_at)

    def claim(
        self, checkpoint_id: str, node_id: str, mode: ClaimMode, *, reason: str = ""
    ) -> MigrationClaim | None:
        """Claim a pending request; ``None`` when another node holds it or won the race."""
        names = self._folders().get(checkpoint_id, set())
        st = self.get(checkpoint_id)
        if st.status != "pending":
            return None
        # After every claim name present, valid or not: a planted claim-N cannot block us.
        taken = _claim_numbers(names)
        attempt = max(taken) + 1 if taken else 0
        claim = MigrationClaim(
            checkpoint_id,
            node_id,
            mode,
            attempt,
            self._clock(),
            reason,
            secrets.token_hex(8),
        )
        key = _claim_key(checkpoint_id, attempt)
        try:
            self._write(key, claim)
        except AlreadyExists:
            # A retried put whose first try landed also ends here: the nonce tells.
            try:
                held = self._read_as(key, MigrationClaim)
            except GpusnapError:
                return None
            if held.nonce == claim.nonce:
                return claim
            log.info("%s: %s claimed it first", checkpoint_id, held.node_id)
            return None
        if attempt:
            log.warning("%s: took over a stale claim (attempt %d)", checkpoint_id, attempt)
        log.warning("%s: claimed by %s to %s", checkpoint_id, node_id, mode)
        return claim

    def record_outcome(
        self,
        claim: MigrationClaim,
        *,
        succeeded: bool,
        mode: str,
        detail: str = "",
        job_id: str = "",
    ) -> MigrationOutcome:
        outcome = MigrationOutcome(
            claim.checkpoint_id,
            claim.node_id,
            "succeeded" if succeeded else "failed",
            mode,
            claim.attempt,
            self._clock(),
            " ".join(detail.split()),
            job_id,
        )
        key = f"{claim.checkpoint_id}/outcome"
        held = self._write_or_read(key, outcome)
        if held is None:
            return outcome
        if held.node_id == claim.node_id and held.attempt == claim.attempt:
            return held  # a retried put whose first try landed
        raise AlreadyExists(
            f"migration record {self.records.key(key)} was already written by {held.node_id}"
        )


def _claim_numbers(names: set[str]) -> list[int]:
    """The attempt numbers of the ``claim-N`` names in a folder (valid records or not)."""
    return [int(m.group(1)) for n in names if (m := _CLAIM_NAME.fullmatch(n))]
