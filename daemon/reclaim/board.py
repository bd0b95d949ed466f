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
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from typing import Any, Protocol, TypeVar

from gpusnap.daemon.reclaim.board_records import (
    RECORD_VERSION,
    SUPERSEDED,
    WITHDRAWN,
    ClaimMode,
    MigrationClaim,
    MigrationOutcome,
    MigrationRequest,
    MigrationStatus,
    OutcomeState,
    Record,
    check_record,
    claim_key,
    claim_numbers,
)
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

_R = TypeVar("_R", bound=Record)
__all__ = [  # the records' names, for the board's users
    "SUPERSEDED",
    "WITHDRAWN",
    "BoardRecords",
    "ClaimMode",
    "MigrationBoard",
    "MigrationClaim",
    "MigrationOutcome",
    "MigrationRequest",
    "MigrationStatus",
    "OutcomeState",
    "StoreRecords",
]

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


class MigrationBoard:
    """Migration requests, claims and outcomes in the store."""

    def __init__(
        self,
        records: BoardRecords,
        *,
        claim_timeout_s: float = 1800.0,
        request_ttl_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.records = records
        self.claim_timeout_s = claim_timeout_s
        self.request_ttl_s = request_ttl_s
        self._clock = clock

    # --- sealed JSON records ------------------------------------------------------------------

    def _write(self, key: str, record: Record) -> None:
        fmt = f"gpusnap.migration.{record.KIND}/{RECORD_VERSION}"
        self.records.create(key, {"format": fmt, **asdict(record)})

    def _read_as(self, key: str, cls: type[_R]) -> _R:
        """The record at ``key``, opened, checked and of the checkpoint of its folder;
        ``Corrupt`` (or ``NotFound``) otherwise."""
        doc = self.records.read(key)
        where = self.records.key(key)
        if doc.pop("format", None) != f"gpusnap.migration.{cls.KIND}/{RECORD_VERSION}":
            raise Corrupt(f"migration record {where} is not a {cls.KIND} record")
        check_record(where, doc, key.partition("/")[0], cls)
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
        for attempt in sorted(claim_numbers(names), reverse=True):
            key = claim_key(cid, attempt)
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
        now = self._clock()
        stale = (
            outcome is None and claim is not None and now - claim.claimed_at > self.claim_timeout_s
        )
        expires = None if self.request_ttl_s is None else req.created_at + self.request_ttl_s
        return MigrationStatus(
            req, claim, outcome, stale, expires, expires is not None and now > expires
        )

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
        folders = self._folders()
        names = folders.get(checkpoint_id)
        if not names or "request" not in names:
            raise NotFound(f"no migration request for checkpoint {checkpoint_id}")
        st = self._status(checkpoint_id, names)  # Corrupt when its request does not hold
        if st.status != "pending":
            return st
        return self._superseded(st, self._statuses(folders))

    def statuses(self) -> list[MigrationStatus]:
        """Every migration whose request holds; one that fails its check is skipped. Of a
        workload's requests, only the newest is ever pending: an older one is superseded
        (its workload was checkpointed again after it, so it ran somewhere since)."""
        out = self._statuses(self._folders())
        return [self._superseded(st, out) for st in out]

    def _statuses(self, folders: dict[str, set[str]]) -> list[MigrationStatus]:
        out: list[MigrationStatus] = []
        for cid, names in sorted(folders.items()):
            if "request" not in names:
                continue
            try:
                check_checkpoint_id(cid)
                out.append(self._status(cid, names))
            except (Corrupt, NotFound, InvalidArgument, FailedPrecondition) as exc:
                log.warning("skipping migration %s: %s", cid, exc)
        return out

    @staticmethod
    def _superseded(st: MigrationStatus, every: list[MigrationStatus]) -> MigrationStatus:
        newer = [
            o.request
            for o in every
            if o.request.workload == st.request.workload
            and o.request.created_at > st.request.created_at
        ]
        if not newer:
            return st
        return replace(st, superseded_by=max(newer, key=lambda r: r.created_at).checkpoint_id)

    def pending(self) -> list[MigrationRequest]:
        """Requests nobody has (live) claimed, with no valid outcome, not expired and not
        superseded, oldest first."""
        out = [st.request for st in self.statuses() if st.status == "pending"]
        return sorted(out, key=lambda r: r.created_at)

    def withdraw(self, checkpoint_id: str, node_id: str, reason: str = "") -> MigrationStatus:
        """End a request no node has taken (pending or expired): no standby acts on it after.
        ``FailedPrecondition`` once a node has claimed it (or it ended)."""
        names = self._folders().get(checkpoint_id, set())  # before the status: see claim()
        st = self.get(checkpoint_id)
        if st.status not in ("pending", "expired", SUPERSEDED):
            who = f" by {st.claim.node_id}" if st.claim is not None else ""
            raise FailedPrecondition(
                f"the migration of {checkpoint_id} is {st.status}{who}: only a request no "
                "node has claimed can be withdrawn"
            )
        why = reason or f"withdrawn by {node_id}"
        if self._end(st, names, node_id, WITHDRAWN, why) is None:
            raise FailedPrecondition(
                f"{checkpoint_id} was claimed by another node just now: see `gpusnap migrations`"
            )
        return self.get(checkpoint_id)

    def supersede(
        self, workload: str, node_id: str, reason: str, *, keep: str | None = None
    ) -> list[str]:
        """End every pending request of ``workload`` (but ``keep``'s): something newer of it
        happened (a checkpoint, a restore), and adopting one would start a stale copy.
        Returns the checkpoint ids it ended; a store that refuses is logged, not raised."""
        ended: list[str] = []
        try:
            folders = self._folders()  # before the statuses: see claim()
            statuses = self.statuses()
        except GpusnapError as exc:
            log.warning("pending migrations of %s not superseded: %s", workload, exc)
            return ended
        for st in statuses:
            cid = st.request.checkpoint_id
            if st.request.workload != workload or cid == keep or st.status != "pending":
                continue
            try:
                if self._end(st, folders.get(cid, set()), node_id, SUPERSEDED, reason):
                    log.warning("migration of %s superseded: %s", cid, reason)
                    ended.append(cid)
            except GpusnapError as exc:
                log.warning("migration of %s not superseded: %s", cid, exc)
        return ended

    def _end(
        self, st: MigrationStatus, names: set[str], node_id: str, mode: str, detail: str
    ) -> MigrationOutcome | None:
        """A withdraw claim and its outcome; ``None`` when another node's claim won."""
        claim = self._claim(st.request.checkpoint_id, names, node_id, "withdraw", detail)
        if claim is None:
            return None
        return self.record_outcome(claim, succeeded=False, mode=mode, detail=detail)

    def claim(
        self, checkpoint_id: str, node_id: str, mode: ClaimMode, *, reason: str = ""
    ) -> MigrationClaim | None:
        """Claim a pending request; ``None`` when another node holds it or won the race."""
        if mode == "withdraw":
            raise InvalidArgument("a request is withdrawn with withdraw(), not claimed")
        # The names first, then the status: a claim that lands between the two makes ours
        # collide with it on the same attempt number, and exactly one of them wins.
        names = self._folders().get(checkpoint_id, set())
        if self.get(checkpoint_id).status != "pending":
            return None
        return self._claim(checkpoint_id, names, node_id, mode, reason)

    def _claim(
        self, checkpoint_id: str, names: set[str], node_id: str, mode: ClaimMode, reason: str
    ) -> MigrationClaim | None:
        # After every claim name present, valid or not: a planted claim-N cannot block us.
        taken = claim_numbers(names)
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
        key = claim_key(checkpoint_id, attempt)
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
