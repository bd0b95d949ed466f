"""``gpusnap.v1`` on the wire: the one hand-written translation between the API's messages and
plain values, used by the daemon's servicers (``daemon/api/``) and the CLI's client alike.

- times: epoch seconds (``float``, ``None`` when unknown) <-> ``google.protobuf.Timestamp``;
- enums: the daemon's names (``"freeze-gpu"``) <-> enum numbers (``PHASE_FREEZE_GPU``);
- ``Struct``: JSON-ready dicts <-> ``google.protobuf.Struct`` (whole numbers come back as ints);
- typed messages: a dict whose keys are the message's field names <-> the message
  (``to_message``/``from_message``: summaries, workloads, the daemon's status, verdicts);
- jobs and verdicts: the daemon's objects (anything shaped as ``JobView``/``VerdictView``)
  -> messages -> the dicts the CLI prints;
- errors: an error kind <-> a gRPC status code and the ``gpusnap-error-kind`` trailing
  metadata, through ``gpusnap.errors.ERROR_TABLE`` and nothing else;
- ``redact_env``: a manifest with its environments' values hidden, the one shape both the
  daemon (for a caller who may not see them) and the CLI (without ``--show-env``) send.

Imports nothing of ours but ``gpusnap.errors`` and the generated code.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

import grpc
from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from gpusnap.errors import ERROR_TABLE, GpusnapError, error_from_kind
from gpusnap.proto.gpusnap.v1 import ERROR_KIND_METADATA_KEY
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2 as pb

if TYPE_CHECKING:
    from google.protobuf.internal.enum_type_wrapper import _EnumTypeWrapper

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
V = TypeVar("V", bound=int)

_TIMESTAMP = Timestamp.DESCRIPTOR.full_name
_STRUCT = struct_pb2.Struct.DESCRIPTOR.full_name

# --- times -----------------------------------------------------------------------------------


def set_time(field: Timestamp, epoch: float | None) -> None:
    """Write ``epoch`` seconds into ``field``; ``None`` leaves it unset."""
    if epoch is not None:
        # Split before scaling: epoch * 1e9 would lose sub-microsecond digits to rounding.
        seconds = math.floor(epoch)
        field.seconds = seconds
        field.nanos = min(999_999_999, round((epoch - seconds) * 1e9))


def get_time(msg: Message, name: str) -> float | None:
    """The Timestamp field ``name`` of ``msg`` as epoch seconds; ``None`` when unset."""
    if not msg.HasField(name):
        return None
    ts = cast("Timestamp", getattr(msg, name))
    return ts.seconds + ts.nanos / 1e9


# --- enums -----------------------------------------------------------------------------------


class WireEnum(Generic[V]):
    """A proto enum whose value names are the daemon's names upper-cased, ``-`` -> ``_``,
    behind a prefix (``"freeze-gpu"`` <-> ``PHASE_FREEZE_GPU``)."""

    def __init__(self, enum_type: _EnumTypeWrapper[V], prefix: str) -> None:
        self._type = enum_type
        self._prefix = prefix

    def number(self, name: str) -> V:
        """An unknown name travels as UNSPECIFIED (0), with a warning to grow the proto."""
        full = self._prefix + name.upper().replace("-", "_")
        try:
            return self._type.Value(full)
        except ValueError:
            log.warning("gpusnap.v1 has no %s; sent as unspecified (add it to the proto)", full)
            return self._type.Value(self._prefix + "UNSPECIFIED")

    def name(self, number: int) -> str:
        try:
            full = self._type.Name(number)  # type: ignore[arg-type]  # any int off the wire
        except ValueError:
            return "unspecified"
        return full.removeprefix(self._prefix).lower().replace("_", "-")


JOB_KIND = WireEnum(pb.JobKind, "JOB_KIND_")
JOB_STATE = WireEnum(pb.JobState, "JOB_STATE_")
PHASE = WireEnum(pb.Phase, "PHASE_")

# --- Struct ----------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    # Struct holds JSON values only; tuples, paths, enums and the like become JSON first.
    return json.loads(json.dumps(value, default=str))


def _integral(value: Any) -> Any:
    # Struct numbers are doubles; give back ints where the sender had whole numbers.
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


def to_struct(value: Mapping[str, Any]) -> struct_pb2.Struct:
    msg = struct_pb2.Struct()
    msg.update(_jsonable(dict(value)))
    return msg


def from_struct(msg: struct_pb2.Struct) -> dict[str, Any]:
    result: dict[str, Any] = _integral(MessageToDict(msg))
    return result


def to_json(value: Mapping[str, Any]) -> str:
    """``value`` as JSON text: a document whose integers must stay exact (a Struct would carry
    them as doubles)."""
    return json.dumps(dict(value), default=str, sort_keys=True)


def from_json(text: str) -> dict[str, Any]:
    """The JSON object ``to_json`` made; anything else is a broken reply (``Internal``)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        why = f"the daemon sent JSON that does not parse: {exc}"
        raise error_from_kind("internal", why) from exc
    if not isinstance(value, dict):
        raise error_from_kind("internal", "the daemon sent JSON that is not an object")
    return value


# --- typed messages <-> dicts ----------------------------------------------------------------

# (message, key) pairs already warned about: a status polled every second warns once.
_warned: set[tuple[str, str]] = set()


def to_message(cls: type[M], data: Mapping[str, Any]) -> M:
    """The message ``cls`` with the fields ``data`` names (keys are field names). ``None``
    leaves a field unset; a key the message lacks is dropped with a warning, once."""
    msg = cls()
    _fill(msg, data)
    return msg


def _fill(msg: Message, data: Mapping[str, Any]) -> None:
    fields = msg.DESCRIPTOR.fields_by_name
    for key, value in data.items():
        field = fields.get(key)
        if field is None:
            where = (msg.DESCRIPTOR.full_name, key)
            if where not in _warned:
                _warned.add(where)
                log.warning("%s has no field %r; not sent (add it to the proto)", *where)
            continue
        if value is None:
            continue
        target = getattr(msg, key)
        kind = _kind(field)
        if kind == "time":
            set_time(target, float(value))
        elif kind == "struct":
            target.update(_jsonable(value))
        elif kind == "map":
            target.update({str(k): str(v) for k, v in value.items()})
        elif kind == "messages":
            for item in value:
                _fill(target.add(), item)
        elif kind == "message":
            _fill(target, value)
        elif kind == "scalars":
            target.extend(value)
        else:
            setattr(msg, key, value)


def from_message(msg: Message) -> dict[str, Any]:
    """Every field of ``msg`` by name: unset optional fields and messages as ``None``, times as
    epoch seconds, Structs and maps as dicts. The inverse of ``to_message``."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        name = field.name
        value = getattr(msg, name)
        kind = _kind(field)
        if kind == "map":
            out[name] = dict(sorted(value.items()))
        elif kind == "messages":
            out[name] = [from_message(v) for v in value]
        elif kind == "scalars":
            out[name] = list(value)
        elif field.has_presence and not msg.HasField(name):
            out[name] = None
        elif kind == "time":
            out[name] = get_time(msg, name)
        elif kind == "struct":
            out[name] = from_struct(value)
        elif kind == "message":
            out[name] = from_message(value)
        else:
            out[name] = value
    return out


def _kind(field: Any) -> str:
    # ``field``: a FieldDescriptor, pure-Python or upb's (typed apart in the stubs).
    message = field.message_type
    if message is None:
        return "scalars" if field.is_repeated else "scalar"
    if message.GetOptions().map_entry:
        return "map"
    if field.is_repeated:
        return "messages"
    if message.full_name == _TIMESTAMP:
        return "time"
    if message.full_name == _STRUCT:
        return "struct"
    return "message"


def typed_or_struct(typed: Sequence[Message], structs: Sequence[struct_pb2.Struct]) -> list[Any]:
    """A list response read by a client: the typed items, or — from a daemon older than them,
    which filled only the Struct copy — the Structs, whose keys are the same."""
    if typed or not structs:
        return [from_message(m) for m in typed]
    return [from_struct(s) for s in structs]


# --- jobs and verdicts -----------------------------------------------------------------------


class ProgressView(Protocol):
    @property
    def bytes_done(self) -> int: ...
    @property
    def bytes_total(self) -> int: ...
    @property
    def rate_bytes_per_s(self) -> float: ...


class JobView(Protocol):
    """What the wire needs of a job: ``daemon``'s ``Job`` has this shape."""

    @property
    def id(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def workload(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def phase(self) -> str: ...
    @property
    def progress(self) -> ProgressView: ...
    @property
    def created_at(self) -> float: ...
    @property
    def started_at(self) -> float | None: ...
    @property
    def finished_at(self) -> float | None: ...
    @property
    def trigger(self) -> str: ...
    @property
    def deadline(self) -> float | None: ...
    @property
    def error(self) -> str | None: ...
    @property
    def error_kind(self) -> str | None: ...
    @property
    def result(self) -> Mapping[str, Any]: ...


class ReasonView(Protocol):
    @property
    def field(self) -> str: ...
    @property
    def expected(self) -> str: ...
    @property
    def actual(self) -> str: ...
    @property
    def message(self) -> str: ...


class VerdictView(Protocol):
    """What the wire needs of the compatibility gate's verdict (``daemon``'s ``CompatVerdict``)."""

    @property
    def checkpoint_id(self) -> str: ...
    @property
    def compatible(self) -> bool: ...
    @property
    def reasons(self) -> Sequence[ReasonView]: ...


def job_to_pb(job: JobView) -> pb.Job:
    msg = pb.Job(
        id=job.id,
        kind=JOB_KIND.number(job.kind),
        workload=job.workload,
        state=JOB_STATE.number(job.state),
        phase=PHASE.number(job.phase),
        bytes_done=max(0, job.progress.bytes_done),
        bytes_total=max(0, job.progress.bytes_total),
        rate_bytes_per_s=job.progress.rate_bytes_per_s,
        trigger=job.trigger,
        error=job.error or "",
        error_kind=job.error_kind or "",
    )
    set_time(msg.created_at, job.created_at or None)
    set_time(msg.started_at, job.started_at)
    set_time(msg.finished_at, job.finished_at)
    set_time(msg.deadline, job.deadline)
    msg.result.update(_jsonable(dict(job.result)))
    return msg


def job_from_pb(job: pb.Job) -> dict[str, Any]:
    """A job as the CLI prints it (``--json``; keys in docs/api.md)."""
    return {
        "id": job.id,
        "kind": JOB_KIND.name(job.kind),
        "workload": job.workload,
        "state": JOB_STATE.name(job.state),
        "phase": PHASE.name(job.phase),
        "bytes_done": job.bytes_done,
        "bytes_total": job.bytes_total,
        "rate_bytes_per_s": job.rate_bytes_per_s,
        "created_at": get_time(job, "created_at"),
        "started_at": get_time(job, "started_at"),
        "finished_at": get_time(job, "finished_at"),
        "trigger": job.trigger,
        "deadline": get_time(job, "deadline"),
        "error": job.error or None,
        "error_kind": job.error_kind or None,
        "result": from_struct(job.result),
    }


def verdict_to_pb(verdict: VerdictView) -> pb.CompatVerdict:
    reasons = [
        {"field": r.field, "expected": r.expected, "actual": r.actual, "message": r.message}
        for r in verdict.reasons
    ]
    return to_message(
        pb.CompatVerdict,
        {
            "checkpoint_id": verdict.checkpoint_id,
            "compatible": verdict.compatible,
            "reasons": reasons,
        },
    )


# --- errors ----------------------------------------------------------------------------------


def error_status(err: GpusnapError) -> tuple[grpc.StatusCode, tuple[tuple[str, str]]]:
    """The status code ``ERROR_TABLE`` gives ``err``'s kind, and the trailing metadata that
    carries the kind itself (an unknown kind travels as ``internal``)."""
    kind = err.kind if err.kind in ERROR_TABLE else "internal"
    code: grpc.StatusCode = getattr(grpc.StatusCode, ERROR_TABLE[kind].grpc_code)
    return code, ((ERROR_KIND_METADATA_KEY, kind),)


def error_from_status(
    details: str, metadata: Iterable[tuple[str, str | bytes]]
) -> GpusnapError | None:
    """The error kind a servicer sent, rebuilt with its message; ``None`` when the metadata
    carries no kind (the call never reached a servicer: the caller decides what that means)."""
    for key, value in metadata:
        if key == ERROR_KIND_METADATA_KEY:
            kind = value if isinstance(value, str) else value.decode()
            return error_from_kind(kind, details)
    return None


def redact_env(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``manifest`` whose launch environments (in the stamp and the spec) keep their
    names only (values ``null``), marked ``env_hidden: true``."""
    out = copy.deepcopy(dict(manifest))
    for part in ("stamp", "spec"):
        launch = (out.get(part) or {}).get("launch")
        if isinstance(launch, dict) and isinstance(launch.get("env"), dict):
            launch["env"] = dict.fromkeys(sorted(launch["env"]))
            launch["env_hidden"] = True
    return out
