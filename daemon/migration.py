"""The migration board: reclaimed checkpoints find a new node through the store, exactly once.

Keys, under the store's reserved ``migrations/`` prefix, one folder per checkpoint; every
object is written once (``put(if_absent=True)``) and is a record sealed with the store's
signing key (``CheckpointStore.sign``), so a node acts only on requests a trusted node wrote::

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

``StandbyLoop`` runs on standby nodes: a node whose stamp matches claims at once and
restores; a node that does not match waits until the request is ``cold_start_after_s`` old,
then claims it to cold-start the workload and records why.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Literal, Protocol

from gpusnap.daemon.jobs.job import Job, JobState
from gpusnap.daemon.verdict import CompatVerdict
from gpusnap.errors import (
    AlreadyExists,
    Corrupt,
    FailedPrecondition,
    GpusnapError,
    InvalidArgument,
    NotFound,
)
from gpusnap.storage.backend import Backend
from gpusnap.storage.manifest import check_checkpoint_id

log = logging.getLogger(__name__)

PREFIX = "migrations/"
RECORD_VERSION = 1
ClaimMode = Literal["restore", "cold-start"]


class RecordSigner(Protocol):
    """``CheckpointStore`` satisfies this."""

    def sign(self, payload: bytes) -> bytes: ...

    def open_signed(self, blob: bytes) -> bytes: ...


# --- config -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MigrationConfig:
    standby: bool = False
    poll_interval: float = 5.0  # seconds between looks at the board
    cold_start_after: float = 120.0  # an incompatible node claims a request this old
    claim_timeout: float = 1800.0  # a claim without outcome this old is taken over
    node_id: str = ""  # empty: the host name


def parse_migration_config(data: Mapping[str, Any]) -> MigrationConfig:
    """Validate the ``[migration]`` table strictly (unknown keys are errors)."""
    known = MigrationConfig.__dataclass_fields__
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise InvalidArgument(
                f"[migration] unknown key {key!r}; known keys: {', '.join(sorted(known))}"
            )
        if key == "standby":
            if not isinstance(value, bool):
                raise InvalidArgument("[migration] standby must be true or false")
        elif key == "node_id":
            if not isinstance(value, str) or not value or any(c.isspace() for c in value):
                raise InvalidArgument("[migration] node_id must be a non-empty word")
        elif isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise InvalidArgument(f"[migration] {key} must be a number of seconds > 0")
        values[key] = float(value) if key not in ("standby", "node_id") else value
    return MigrationConfig(**values)


def default_node_id() -> str:
    return socket.gethostname()


# --- records ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MigrationRequest:
    checkpoint_id: str
    workload: str
    source_node: str
    created_at: float
    deadline: float | None = None
    stamp_summary: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MigrationClaim:
    checkpoint_id: str
    node_id: str
    mode: ClaimMode
    attempt: int
    claimed_at: float
    reason: str = ""
    nonce: str = ""


@dataclass(frozen=True)
class MigrationOutcome:
    checkpoint_id: str
    node_id: str
    state: str  # "succeeded" | "failed"
    mode: str  # "restored" | "cold-start" | "" when it failed before knowing
    attempt: int
    finished_at: float
    detail: str = ""
    job_id: str = ""


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
    return f"{PREFIX}{checkpoint_id}/claim-{attempt:04d}"


# At most 18 digits: an attempt number always fits, and a planted name cannot make one huge.
_CLAIM_NAME = re.compile(r"claim-([0-9]{1,18})")
_NUMBER = (int, float)

# The type of every field of each record, as ``_check_record`` checks them.
_REQUEST_FIELDS: dict[str, tuple[type, ...]] = {
    "checkpoint_id": (str,),
    "workload": (str,),
    "source_node": (str,),
    "created_at": _NUMBER,
    "deadline": (*_NUMBER, type(None)),
    "stamp_summary": (dict,),
}
_CLAIM_FIELDS: dict[str, tuple[type, ...]] = {
    "checkpoint_id": (str,),
    "node_id": (str,),
    "mode": (str,),
    "attempt": (int,),
    "claimed_at": _NUMBER,
    "reason": (str,),
    "nonce": (str,),
}
_OUTCOME_FIELDS: dict[str, tuple[type, ...]] = {
    "checkpoint_id": (str,),
    "node_id": (str,),
    "state": (str,),
    "mode": (str,),
    "attempt": (int,),
    "finished_at": _NUMBER,
    "detail": (str,),
    "job_id": (str,),
}
_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "request": _REQUEST_FIELDS,
    "claim": _CLAIM_FIELDS,
    "outcome": _OUTCOME_FIELDS,
}


def _check_record(key: str, kind: str, doc: dict[str, Any], folder: str, cls: type[Any]) -> None:
    """``Corrupt`` unless ``doc`` has the fields of a ``kind`` record (those of ``cls`` without
    a default at least), each of its type, and names the checkpoint of its ``folder``."""
    required = {f.name for f in fields(cls) if f.default is MISSING}
    for name, types in _FIELDS[kind].items():
        if name not in doc:
            if name in required:
                raise Corrupt(f"migration record {key} lacks {name!r}")
            continue
        value = doc[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise Corrupt(f"migration record {key}: {name!r} is not a {types[0].__name__}")
    if doc["checkpoint_id"] != folder:
        raise Corrupt(f"migration record {key} names checkpoint {doc['checkpoint_id']!r}")
    if kind == "claim" and doc["mode"] not in ("restore", "cold-start"):
        raise Corrupt(f"migration record {key}: unknown mode {doc['mode']!r}")
    if kind == "outcome" and doc["state"] not in ("succeeded", "failed"):
        raise Corrupt(f"migration record {key}: unknown state {doc['state']!r}")


class MigrationBoard:
    """Migration requests, claims and outcomes in the store."""

    def __init__(
        self,
        backend: Backend,
        signer: RecordSigner,
        *,
        claim_timeout_s: float = 1800.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.backend = backend
        self.signer = signer
        self.claim_timeout_s = claim_timeout_s
        self._clock = clock

    # --- sealed JSON records ------------------------------------------------------------------

    def _write(self, key: str, kind: str, record: object) -> None:
        doc = {"format": f"gpusnap.migration.{kind}/{RECORD_VERSION}", **asdict(record)}  # type: ignore[call-overload]
        payload = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        self.backend.put(key, self.signer.sign(payload), if_absent=True)

    def _read(self, key: str, kind: str) -> dict[str, Any]:
        payload = self.signer.open_signed(self.backend.get(key))
        try:
            doc = json.loads(payload)
        except ValueError as exc:
            raise Corrupt(f"migration record {key} is not JSON") from exc
        if not isinstance(doc, dict) or doc.pop("format", None) != (
            f"gpusnap.migration.{kind}/{RECORD_VERSION}"
        ):
            raise Corrupt(f"migration record {key} is not a {kind} record")
        return doc

    def _read_as(self, key: str, kind: str, cls: type[Any]) -> Any:
        """The record at ``key``, opened, checked and of the checkpoint of its folder;
        ``Corrupt`` (or ``NotFound``) otherwise."""
        doc = self._read(key, kind)
        folder = key[len(PREFIX) :].partition("/")[0]
        _check_record(key, kind, doc, folder, cls)
        try:
            return cls(**doc)
        except TypeError as exc:
            raise Corrupt(f"migration record {key} has unexpected fields") from exc

    def _write_or_read(self, key: str, kind: str, record: Any) -> Any | None:
        """Write ``record`` once at ``key``. ``None`` when ours landed; else the valid record
        already there. A record there that does not hold is not one of ours: it counts for
        nothing and must not keep ours out (a claim would go stale and the workload be restored
        twice), so it is replaced."""
        try:
            self._write(key, kind, record)
        except AlreadyExists:
            try:
                return self._read_as(key, kind, type(record))
            except Corrupt as exc:
                log.warning("replacing migration record %s, which does not hold: %s", key, exc)
                self.backend.delete(key)
                self._write(key, kind, record)
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
        existing: MigrationRequest | None = self._write_or_read(
            f"{PREFIX}{checkpoint_id}/request", "request", req
        )
        if existing is not None:
            log.info("migration request for %s already published", checkpoint_id)
            return existing
        log.warning("published migration request for %s (%s)", checkpoint_id, workload)
        return req

    def _folders(self) -> dict[str, set[str]]:
        folders: dict[str, set[str]] = {}
        for info in self.backend.list(PREFIX):
            rest = info.key[len(PREFIX) :]
            cid, sep, name = rest.partition("/")
            if sep and "/" not in name:
                folders.setdefault(cid, set()).add(name)
        return folders

    def _status(self, cid: str, names: set[str]) -> MigrationStatus:
        """The migration of ``cid`` as its valid records tell it. ``Corrupt``/``NotFound`` when
        the request itself does not hold; invalid claims and outcomes are ignored (logged)."""
        req: MigrationRequest = self._read_as(f"{PREFIX}{cid}/request", "request", MigrationRequest)
        claim: MigrationClaim | None = None
        for attempt in sorted(_claim_numbers(names), reverse=True):
            key = _claim_key(cid, attempt)
            found = self._valid(key, "claim", MigrationClaim)
            if found is not None and found.attempt != attempt:
                log.warning("ignoring migration record %s: it says attempt %d", key, found.attempt)
                found = None
            if found is not None:
                claim = found
                break
        outcome: MigrationOutcome | None = None
        if "outcome" in names:
            outcome = self._valid(f"{PREFIX}{cid}/outcome", "outcome", MigrationOutcome)
        stale = (
            outcome is None
            and claim is not None
            and self._clock() - claim.claimed_at > self.claim_timeout_s
        )
        return MigrationStatus(req, claim, outcome, stale)

    def _valid(self, key: str, kind: str, cls: type[Any]) -> Any:
        """The record at ``key`` if it holds, else ``None`` (logged: someone without the key
        wrote it, or it is damaged; either way it does not count)."""
        try:
            return self._read_as(key, kind, cls)
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
            self._write(key, "claim", claim)
        except AlreadyExists:
            # A retried put whose first try landed also ends here: the nonce tells.
            try:
                held: MigrationClaim = self._read_as(key, "claim", MigrationClaim)
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
        key = f"{PREFIX}{claim.checkpoint_id}/outcome"
        held: MigrationOutcome | None = self._write_or_read(key, "outcome", outcome)
        if held is None:
            return outcome
        if held.node_id == claim.node_id and held.attempt == claim.attempt:
            return held  # a retried put whose first try landed
        raise AlreadyExists(f"migration record {key} was already written by {held.node_id}")


def _claim_numbers(names: set[str]) -> list[int]:
    """The attempt numbers of the ``claim-N`` names in a folder (valid records or not)."""
    return [int(m.group(1)) for n in names if (m := _CLAIM_NAME.fullmatch(n))]


# --- standby ----------------------------------------------------------------------------------


CompatCheck = Callable[[str], CompatVerdict]
RestoreRun = Callable[[MigrationRequest, MigrationClaim], Job]  # blocks until the job ends


class StandbyLoop:
    """Watches the board and adopts reclaimed workloads (``[migration] standby = true``)."""

    def __init__(
        self,
        board: MigrationBoard,
        node_id: str,
        compat: CompatCheck,
        restore: RestoreRun,
        *,
        cold_start_after_s: float = 120.0,
        poll_interval_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.board = board
        self.node_id = node_id
        self._compat = compat
        self._restore = restore
        self.cold_start_after_s = cold_start_after_s
        self.poll_interval_s = poll_interval_s
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None
        # Outcomes of restores this node ran that the store has not taken yet (unreachable
        # when the job ended): retried first at every tick. Until one lands the claim stays
        # live, and a claim left without its outcome would be taken over after the claim
        # timeout and the workload started a second time.
        self._unrecorded: list[tuple[MigrationClaim, dict[str, Any]]] = []

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="migration-standby", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return  # still in a look at the board: it keeps what it could not record
        # Outcomes still not recorded get one last try; one that does not land leaves its
        # claim live until the claim timeout, after which another node may act on it.
        self._record_unrecorded()
        for claim, _args in self._unrecorded:
            log.error(
                "%s: stopping with its migration outcome unrecorded (the store refused it); "
                "after [migration] claim_timeout another standby may adopt it again",
                claim.checkpoint_id,
            )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
                self.last_error = None
            except GpusnapError as exc:
                self.last_error = str(exc)
                log.warning("migration standby: %s", exc)
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("migration standby failed")
            self._stop.wait(self.poll_interval_s)

    def tick(self) -> list[MigrationOutcome]:
        """One look at the board; returns the outcomes this node recorded."""
        done = self._record_unrecorded()
        for req in self.board.pending():
            if self._stop.is_set():
                break
            if req.source_node == self.node_id:
                continue  # the node going away does not adopt its own workload
            outcome = self._consider(req)
            if outcome is not None:
                done.append(outcome)
        return done

    def _consider(self, req: MigrationRequest) -> MigrationOutcome | None:
        try:
            verdict = self._compat(req.checkpoint_id)
        except GpusnapError as exc:
            log.warning("%s: compatibility check failed: %s", req.checkpoint_id, exc)
            return None
        if verdict.compatible:
            mode: ClaimMode = "restore"
            reason = ""
        else:
            age = self._clock() - req.created_at
            if age < self.cold_start_after_s:
                log.debug("%s: not compatible; waiting for a matching node", req.checkpoint_id)
                return None
            mode = "cold-start"
            why = "; ".join(str(r) for r in verdict.reasons) or "stamp does not match"
            reason = f"no compatible node claimed within {self.cold_start_after_s:g} s; {why}"
        claim = self.board.claim(req.checkpoint_id, self.node_id, mode, reason=reason)
        if claim is None:
            return None
        try:
            job = self._restore(req, claim)
        except GpusnapError as exc:
            return self._record(claim, {"succeeded": False, "mode": "", "detail": str(exc)})
        ok = job.state == JobState.SUCCEEDED
        result_mode = str(job.result.get("mode", "restored" if mode == "restore" else mode))
        detail = reason if ok else (job.error or f"restore job ended {job.state}")
        return self._record(
            claim, {"succeeded": ok, "mode": result_mode, "detail": detail, "job_id": job.id}
        )

    def _record(self, claim: MigrationClaim, args: dict[str, Any]) -> MigrationOutcome | None:
        """Record an outcome; kept for the next tick when the store does not take it now."""
        try:
            return self.board.record_outcome(claim, **args)
        except AlreadyExists:
            raise  # another node's outcome: nothing of ours to keep retrying
        except GpusnapError as exc:
            log.warning(
                "%s: outcome not recorded yet (retried at the next look): %s",
                claim.checkpoint_id,
                exc,
            )
            self._unrecorded.append((claim, args))
            return None

    def _record_unrecorded(self) -> list[MigrationOutcome]:
        pending, self._unrecorded = self._unrecorded, []
        done: list[MigrationOutcome] = []
        for claim, args in pending:
            try:
                outcome = self._record(claim, args)
            except AlreadyExists as exc:
                log.warning("%s: %s", claim.checkpoint_id, exc)
                continue
            if outcome is not None:
                log.warning("%s: outcome recorded on retry", claim.checkpoint_id)
                done.append(outcome)
        return done
