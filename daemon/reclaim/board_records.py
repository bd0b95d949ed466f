"""The migration board's records: what each of ``request``, ``claim-NNNN`` and ``outcome``
holds, how a record read from the store is checked against its annotations, and the status a
migration's records add up to (``board.py`` reads and writes them).
"""

from __future__ import annotations

import re
import types
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar, Literal, Union, get_args, get_origin
from typing import get_type_hints as _hints

from gpusnap.errors import Corrupt

RECORD_VERSION = 1
# "withdraw": not a restore, the claim that ends a request nobody is to act on (withdrawn by an
# operator, superseded by a later checkpoint or restore of its workload); its outcome follows.
ClaimMode = Literal["restore", "cold-start", "withdraw"]
OutcomeState = Literal["succeeded", "failed"]
WITHDRAWN, SUPERSEDED = "withdrawn", "superseded"  # the outcome modes of a withdraw claim


# --- records ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    KIND: ClassVar[str]  # "request" | "claim" | "outcome": the record's format name
    checkpoint_id: str  # every record is about one checkpoint: the one of its folder


@dataclass(frozen=True)
class MigrationRequest(Record):
    KIND = "request"
    workload: str
    source_node: str
    created_at: float
    deadline: float | None = None
    stamp_summary: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MigrationClaim(Record):
    KIND = "claim"
    node_id: str
    mode: ClaimMode
    attempt: int
    claimed_at: float
    reason: str = ""
    nonce: str = ""


@dataclass(frozen=True)
class MigrationOutcome(Record):
    KIND = "outcome"
    node_id: str
    state: OutcomeState
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
    expires_at: float | None = None  # the request's created_at + ``request_ttl``
    expired: bool = False  # past ``expires_at``, never claimed: no node acts on it
    superseded_by: str | None = None  # a newer request of the same workload

    @property
    def status(self) -> str:
        if self.outcome is not None:
            if self.outcome.mode in (WITHDRAWN, SUPERSEDED):
                return self.outcome.mode
            return "restored" if self.outcome.state == "succeeded" else "failed"
        if self.claim is not None and self.claim.mode == "withdraw":
            return WITHDRAWN  # its outcome did not land (yet); never taken over either way
        if self.claim is not None and not self.stale_claim:
            return "claimed"
        if self.superseded_by is not None:
            return SUPERSEDED
        if self.expired:
            return "expired"
        return "pending"

    def to_dict(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.request.checkpoint_id,
            "status": self.status,
            "request": asdict(self.request),
            "claim": asdict(self.claim) if self.claim else None,
            "stale_claim": self.stale_claim,
            "outcome": asdict(self.outcome) if self.outcome else None,
            "expires_at": self.expires_at,
            "superseded_by": self.superseded_by,
        }


def claim_key(checkpoint_id: str, attempt: int) -> str:
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


def check_record(key: str, doc: dict[str, Any], folder: str, cls: type[Record]) -> None:
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


def claim_numbers(names: set[str]) -> list[int]:
    """The attempt numbers of the ``claim-N`` names in a folder (valid records or not)."""
    return [int(m.group(1)) for n in names if (m := _CLAIM_NAME.fullmatch(n))]
