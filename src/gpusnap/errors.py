"""The project's error kinds, and the one table that maps them to gRPC codes and exit codes.

The one error vocabulary of gpusnap: storage, daemon, proto and cli all import it, and it
imports nothing of ours. Every layer raises one of these; foreign exceptions are translated
at the boundary (``raise Unavailable(...) from exc``). The gRPC servicer and the CLI read
``ERROR_TABLE`` and nothing else, so a kind means the same thing on the wire, in a script's
``$?`` and in the logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

# Exit codes are a contract that operators' scripts rely on.
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_INTEGRITY = 4
EXIT_DAEMON_UNREACHABLE = 5
EXIT_PERMISSION_DENIED = 6


class GpusnapError(Exception):
    """Base of every error gpusnap reports to a user. ``str(err)`` is one line.

    A kind names itself in its class line, ``class NotFound(GpusnapError, kind="not_found")``
    (and ``retryable=True`` where a retry may help); a subclass that names none is its
    parent's kind."""

    kind: ClassVar[str] = "internal"
    retryable: ClassVar[bool] = False

    def __init_subclass__(
        cls, *, kind: str | None = None, retryable: bool | None = None, **kwargs: Any
    ) -> None:
        super().__init_subclass__(**kwargs)
        if kind is not None:
            cls.kind = kind
        if retryable is not None:
            cls.retryable = retryable

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class NotFound(GpusnapError, kind="not_found"): ...


class AlreadyExists(GpusnapError, kind="already_exists"): ...


class InvalidArgument(GpusnapError, kind="invalid_argument"): ...


class FailedPrecondition(GpusnapError, kind="failed_precondition"): ...


class Incompatible(GpusnapError, kind="incompatible"):
    """The checkpoint's stamp does not match this node; the reasons are in the message."""


class Unavailable(GpusnapError, kind="unavailable", retryable=True):
    """A dependency (store, driver, daemon) could not be reached. Worth retrying."""


class Corrupt(GpusnapError, kind="corrupt"):
    """Data failed an integrity or authenticity check: a hash, a signature, a path."""


class Unsupported(GpusnapError, kind="unsupported"): ...


class PermissionDenied(GpusnapError, kind="permission_denied"):
    """The caller may not do this (docs/operations.md, the authorization table); the message
    says why."""


class Unreachable(Unavailable, kind="unreachable"):
    """The daemon itself cannot be reached (no socket, refused, not ours to open)."""


class DeadlineExceeded(GpusnapError, kind="deadline_exceeded", retryable=True): ...


class Cancelled(GpusnapError, kind="cancelled"): ...


class Internal(GpusnapError, kind="internal"): ...


@dataclass(frozen=True)
class ErrorMapping:
    grpc_code: str  # name of a grpc.StatusCode member; storage does not import grpc
    exit_code: int


ERROR_TABLE: dict[str, ErrorMapping] = {
    "not_found": ErrorMapping("NOT_FOUND", EXIT_NOT_FOUND),
    "already_exists": ErrorMapping("ALREADY_EXISTS", EXIT_FAILURE),
    "invalid_argument": ErrorMapping("INVALID_ARGUMENT", EXIT_USAGE),
    "failed_precondition": ErrorMapping("FAILED_PRECONDITION", EXIT_FAILURE),
    "incompatible": ErrorMapping("FAILED_PRECONDITION", EXIT_FAILURE),
    "unavailable": ErrorMapping("UNAVAILABLE", EXIT_FAILURE),
    "unreachable": ErrorMapping("UNAVAILABLE", EXIT_DAEMON_UNREACHABLE),
    "corrupt": ErrorMapping("DATA_LOSS", EXIT_INTEGRITY),
    "unsupported": ErrorMapping("UNIMPLEMENTED", EXIT_FAILURE),
    "permission_denied": ErrorMapping("PERMISSION_DENIED", EXIT_PERMISSION_DENIED),
    "deadline_exceeded": ErrorMapping("DEADLINE_EXCEEDED", EXIT_FAILURE),
    "cancelled": ErrorMapping("CANCELLED", EXIT_FAILURE),
    "internal": ErrorMapping("INTERNAL", EXIT_FAILURE),
}

KINDS: dict[str, type[GpusnapError]] = {
    cls.kind: cls
    for cls in (
        NotFound,
        AlreadyExists,
        InvalidArgument,
        FailedPrecondition,
        Incompatible,
        Unavailable,
        Unreachable,
        Corrupt,
        Unsupported,
        PermissionDenied,
        DeadlineExceeded,
        Cancelled,
        Internal,
    )
}


def exit_code_for(err: BaseException) -> int:
    """The documented exit code for an error (1 for anything that is not ours)."""
    if isinstance(err, GpusnapError):
        return ERROR_TABLE[err.kind].exit_code
    return EXIT_FAILURE


def error_from_kind(kind: str, message: str) -> GpusnapError:
    """Rebuild an error from its kind name (as carried in gRPC trailing metadata)."""
    return KINDS.get(kind, Internal)(message)


def with_message(err: GpusnapError, message: str) -> GpusnapError:
    """The same kind of error as ``err`` with a new message, to re-raise with more context
    (``raise with_message(err, f"{err}; {what}") from err``).

    ``type(err)(message)`` would raise ``TypeError`` for kinds whose constructor takes other
    arguments; those get the public kind they belong to instead."""
    cls = type(err)
    if cls.__init__ is GpusnapError.__init__:
        return cls(message)
    return error_from_kind(err.kind, message)
