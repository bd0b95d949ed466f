"""The CLI's gRPC client for gpusnapd: calls in, plain JSON-ready dicts out.

Each method mirrors one ``gpusnap.v1`` RPC (and one ``DaemonServiceAPI`` method); messages
become plain values through ``gpusnap.proto.wire``, the module the daemon's servicers use too.
A failed call raises the error kind the daemon decided — read from the ``gpusnap-error-kind``
trailing metadata by ``wire.error_from_status`` — so the CLI exits with the code the service
chose. When the daemon cannot be reached at all, ``DaemonUnreachable`` says so in one
line with the socket path or TCP address; the CLI exits 5 for it.

``connect(args)`` picks the way in: the unix socket (``--socket``, the default), or
gpusnapd's mutual-TLS TCP listener (``--address`` with ``--tls-ca``/``--tls-cert``/``--tls-key``,
checked by ``cli/_tls.py``). A command-line option beats an environment variable; there is no
plaintext TCP.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypedDict, TypeVar, Unpack, cast

# gRPC's C core logs to stderr on its own (e.g. "E1130 ... parse_address.cc:69] ..."), which
# would break the CLI's promise of one line per error. It reads these at import, so they are
# set before ``import grpc``; GPUSNAP_DEBUG=1 leaves them to the caller.
if os.environ.get("GPUSNAP_DEBUG", "") in ("", "0"):
    os.environ["GRPC_VERBOSITY"] = "NONE"
    os.environ.pop("GRPC_TRACE", None)

import grpc  # after the logging switch above

from gpusnap.cli._output import emit
from gpusnap.cli._tls import ClientTls, explain_unreachable, load_client_tls, parse_address
from gpusnap.errors import (
    DeadlineExceeded,
    GpusnapError,
    Internal,
    InvalidArgument,
    Unavailable,
    Unreachable,
    error_from_kind,
)
from gpusnap.proto import wire
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2 as pb
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2_grpc as pb_grpc

DEFAULT_SOCKET = Path("/run/gpusnap/gpusnapd.sock")
# sun_path holds 108 bytes with its NUL; gRPC cannot even form a channel to a longer path.
MAX_SOCKET_PATH_BYTES = 107
SOCKET_ENV = "GPUSNAP_SOCKET"
ADDRESS_ENV = "GPUSNAP_ADDRESS"
# (argparse dest, option, environment variable) of the client's mutual-TLS settings.
TLS_SETTINGS = (
    ("tls_ca", "--tls-ca", "GPUSNAP_TLS_CA"),
    ("tls_cert", "--tls-cert", "GPUSNAP_TLS_CERT"),
    ("tls_key", "--tls-key", "GPUSNAP_TLS_KEY"),
    ("tls_server_name", "--tls-server-name", "GPUSNAP_TLS_SERVER_NAME"),
)
# Generous for unary calls (they only queue work or read state); Watch has no deadline.
DEFAULT_TIMEOUT_S = 60.0
# Manifests of large process trees list many files; as the daemon's listener allows.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

Req = TypeVar("Req")
Resp = TypeVar("Resp")
T = TypeVar("T")


class CheckpointRequest(TypedDict, total=False):
    """``DaemonClient.checkpoint``'s keywords: the fields of a ``CreateCheckpointRequest``. One
    of ``pid``, ``workload``, ``container`` (the daemon checks); None is the same as left out."""

    pid: int | None
    workload: str | None
    container: str | None
    runtime: str | None  # with a container; none: the runtime that has it
    leave_running: bool
    trigger: str  # none: the daemon's "operator"


class RestoreRequest(TypedDict, total=False):
    """``DaemonClient.restore``'s keywords: the fields of a ``RestoreRequest`` (which go together
    is the daemon's to check); None is the same as left out."""

    checkpoint_id: str | None
    workload: str | None
    latest: bool
    name: str | None
    allow_rollback: bool


def _given(request: Mapping[str, object]) -> dict[str, Any]:
    """The keywords that are not None: a protobuf message takes no None, and a field left out is
    unset (a ``oneof`` too)."""
    return {key: value for key, value in request.items() if value is not None}


class DaemonUnreachable(Unreachable):
    """No gpusnapd answers at the socket (missing, refused, or not ours to open) or at the TCP
    address (refused, or the TLS handshake failed either way): exit 5."""

    def __init__(self, target: str, why: str) -> None:
        super().__init__(f"cannot reach gpusnapd at {target}: {why}")
        self.target = target
        self.why = why


def socket_path(args: argparse.Namespace | None = None) -> Path:
    """``--socket``, else ``$GPUSNAP_SOCKET``, else /run/gpusnap/gpusnapd.sock."""
    given = getattr(args, "socket", None) if args is not None else None
    return Path(given or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET)


# --- errors ----------------------------------------------------------------------------------


def _probe_why(path: Path) -> str | None:
    """Why a plain connect to the socket fails (``No such file or directory``), or None."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(5.0)
    try:
        probe.connect(str(path))
    except OSError as exc:
        return exc.strerror or os.strerror(exc.errno or errno.EIO)
    finally:
        probe.close()
    return None


class DaemonClient(AbstractContextManager["DaemonClient"]):
    """A connection to gpusnapd. Use as a context manager, or call ``close()``.

    Each call sends its arguments as they are: the daemon checks them (and the CLI exits with
    the code of the kind it answers). Results are plain JSON-ready values, converted by
    ``gpusnap.proto.wire``.
    """

    def __init__(
        self,
        target: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        socket_file: Path | None = None,
        server_name: str | None = None,
    ) -> None:
        self.target = target
        self._socket_file = socket_file
        self._secure = credentials is not None
        self._timeout = timeout
        options: list[tuple[str, str | int]] = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)
        ]
        if server_name is not None:
            options.append(("grpc.ssl_target_name_override", server_name))
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=options)
        self._checkpoints = pb_grpc.CheckpointsStub(self._channel)
        self._restores = pb_grpc.RestoresStub(self._channel)
        self._jobs = pb_grpc.JobsStub(self._channel)
        self._workloads = pb_grpc.WorkloadsStub(self._channel)
        self._daemon = pb_grpc.DaemonStub(self._channel)

    @classmethod
    def for_socket(cls, path: Path, *, timeout: float = DEFAULT_TIMEOUT_S) -> DaemonClient:
        """A client for the daemon at the unix socket ``path``; ``InvalidArgument`` (exit 2)
        for a path no unix socket can have."""
        length = len(os.fsencode(str(path)))
        if length > MAX_SOCKET_PATH_BYTES:
            raise InvalidArgument(
                f"socket path too long ({length} > {MAX_SOCKET_PATH_BYTES} bytes): {path}"
            )
        if "\0" in str(path):
            raise InvalidArgument(f"socket path contains a NUL byte: {path!r}")
        return cls(f"unix:{path}", timeout=timeout, socket_file=path)

    @classmethod
    def for_address(
        cls, address: str, tls: ClientTls, *, timeout: float = DEFAULT_TIMEOUT_S
    ) -> DaemonClient:
        """A client for gpusnapd's mutual-TLS listener at ``host:port``."""
        credentials = grpc.ssl_channel_credentials(
            root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
        )
        return cls(
            parse_address(address),
            credentials=credentials,
            timeout=timeout,
            server_name=tls.server_name,
        )

    def close(self) -> None:
        self._channel.close()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _error(self, err: grpc.RpcError) -> GpusnapError:
        """The error kind the daemon sent, or why the daemon could not be reached."""
        code = err.code()
        details = err.details() or code.name
        metadata = cast("Iterable[tuple[str, str | bytes]]", err.trailing_metadata() or ())
        sent = wire.error_from_status(details, metadata)
        if sent is not None:
            return sent
        # No kind: the call never reached our servicer.
        if code == grpc.StatusCode.UNAVAILABLE:
            if self._secure:
                return DaemonUnreachable(self.target, explain_unreachable(details))
            why = _probe_why(self._socket_file) if self._socket_file is not None else None
            return DaemonUnreachable(self.target, why or details)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return DeadlineExceeded(f"gpusnapd at {self.target} did not answer in time")
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return Unavailable(
                f"gpusnapd at {self.target} does not offer this call (older daemon?): {details}"
            )
        if code == grpc.StatusCode.CANCELLED:
            return error_from_kind("cancelled", details)
        return Internal(f"gpusnapd at {self.target}: {code.name}: {details}")

    def _unary(self, rpc: grpc.UnaryUnaryMultiCallable[Req, Resp], request: Req) -> Resp:
        """Call ``rpc``; a failure raises the error kind of ``_error``."""
        try:
            return rpc(request, timeout=self._timeout)
        except grpc.RpcError as err:
            raise self._error(err) from None

    # --- calls ------------------------------------------------------------------------------

    def checkpoint(self, **request: Unpack[CheckpointRequest]) -> dict[str, Any]:
        """Queue a checkpoint (``CreateCheckpointRequest``); its job as it stands."""
        message = pb.CreateCheckpointRequest(**_given(request))
        return wire.job_from_pb(self._unary(self._checkpoints.Create, message))

    def restore(self, **request: Unpack[RestoreRequest]) -> dict[str, Any]:
        """Queue a restore (``RestoreRequest``); its job as it stands."""
        message = pb.RestoreRequest(**_given(request))
        return wire.job_from_pb(self._unary(self._restores.Restore, message))

    def preflight(
        self,
        *,
        pid: int | None = None,
        workload: str | None = None,
        container: str | None = None,
        runtime: str | None = None,
    ) -> dict[str, Any]:
        """``Checkpoints.Preflight``: ``checkpointable``, ``blockers`` (``kind``, ``pid``,
        ``detail``, ``fix``) and ``notes`` (``kind``, ``pid``, ``detail``)."""
        target = {"pid": pid, "workload": workload, "container": container, "runtime": runtime}
        message = pb.PreflightRequest(**_given(target))
        return wire.from_message(self._unary(self._checkpoints.Preflight, message))

    def compat(self, checkpoint_id: str) -> dict[str, Any]:
        request = pb.CompatRequest(checkpoint_id=checkpoint_id)
        return wire.from_message(self._unary(self._restores.Compat, request))

    def get_job(self, job_id: str) -> dict[str, Any]:
        return wire.job_from_pb(self._unary(self._jobs.Get, pb.GetJobRequest(job_id=job_id)))

    def list_jobs(self, limit: int = 0) -> list[dict[str, Any]]:
        """The newest ``limit`` jobs; 0: as many as the daemon lists by default."""
        reply = self._unary(self._jobs.List, pb.ListJobsRequest(limit=limit))
        return [wire.job_from_pb(j) for j in reply.jobs]

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return wire.job_from_pb(self._unary(self._jobs.Cancel, pb.CancelJobRequest(job_id=job_id)))

    def watch_job(self, job_id: str) -> Iterator[dict[str, Any]]:
        """Snapshots of the job as it changes; ends after its terminal state."""
        stream = self._jobs.Watch(pb.WatchJobRequest(job_id=job_id))
        try:
            for job in stream:
                yield wire.job_from_pb(job)
        except grpc.RpcError as err:
            raise self._error(err) from None
        finally:
            cancel = getattr(stream, "cancel", None)  # ends the call if we stop early
            if callable(cancel):
                cancel()

    def list_checkpoints(self, workload: str | None = None) -> list[dict[str, Any]]:
        request = pb.ListCheckpointsRequest(workload=workload or "")
        reply = self._unary(self._checkpoints.List, request)
        return wire.typed_or_struct(reply.items, reply.checkpoints)

    def show_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        request = pb.ShowCheckpointRequest(checkpoint_id=checkpoint_id)
        reply = self._unary(self._checkpoints.Show, request)
        if reply.manifest_json:  # exact integers; an older daemon sends the Struct only
            return wire.from_json(reply.manifest_json)
        return wire.from_struct(reply.checkpoint)

    def list_workloads(self) -> list[dict[str, Any]]:
        reply = self._unary(self._workloads.List, pb.ListWorkloadsRequest())
        return wire.typed_or_struct(reply.items, reply.workloads)

    def status(self) -> dict[str, Any]:
        reply = self._unary(self._daemon.Status, pb.StatusRequest())
        if not reply.HasField("daemon"):  # a daemon older than the typed status
            return wire.from_struct(reply.status)
        return wire.from_message(reply.daemon)

    def triggers_status(self) -> dict[str, Any]:
        reply = self._unary(self._daemon.TriggersStatus, pb.TriggersStatusRequest())
        return wire.from_struct(reply.triggers)

    def migrations(self) -> list[dict[str, Any]]:
        reply = self._unary(self._daemon.ListMigrations, pb.ListMigrationsRequest())
        return [wire.from_struct(m) for m in reply.migrations]

    def withdraw_migration(self, checkpoint_id: str, reason: str = "") -> dict[str, Any]:
        request = pb.WithdrawMigrationRequest(checkpoint_id=checkpoint_id, reason=reason)
        return wire.from_struct(self._unary(self._daemon.WithdrawMigration, request).migration)

    def drill(self, deadline_s: float | None = None) -> dict[str, Any]:
        request = pb.DrillRequest()
        if deadline_s is not None:
            request.deadline_seconds = deadline_s
        return wire.job_from_pb(self._unary(self._daemon.Drill, request))


def _address(args: argparse.Namespace | None) -> tuple[str, str] | None:
    """(address, the option or variable that gave it), or None for the unix socket."""
    socket_flag = getattr(args, "socket", None)
    address_flag = getattr(args, "address", None)
    if socket_flag is not None and address_flag is not None:
        raise InvalidArgument(
            "give --socket or --address, not both (the unix socket, or the mutual-TLS listener)"
        )
    if address_flag is not None:
        return address_flag, "--address"
    if socket_flag is not None:
        return None
    from_env = os.environ.get(ADDRESS_ENV)
    if not from_env:
        return None
    if os.environ.get(SOCKET_ENV):
        raise InvalidArgument(
            f"both {SOCKET_ENV} and {ADDRESS_ENV} are set; unset one, or choose with "
            "--socket or --address"
        )
    return from_env, ADDRESS_ENV


def client_tls(args: argparse.Namespace | None, *, needed_by: str = "--address") -> ClientTls:
    """The TLS files the options (else the environment) name, read and checked; all three
    files are required (``needed_by`` names what asked for TLS in the error)."""
    given: dict[str, tuple[str, str]] = {}
    for dest, option, env in TLS_SETTINGS:
        flag = getattr(args, dest, None)
        if flag is not None:
            given[dest] = (flag, option)
        elif os.environ.get(env):
            given[dest] = (os.environ[env], env)
    missing = [
        f"{option} (or {env})"
        for dest, option, env in TLS_SETTINGS[:3]
        if not given.get(dest, ("", ""))[0]
    ]
    if missing:
        raise InvalidArgument(
            f"{needed_by} needs mutual TLS (never plaintext TCP); missing {', '.join(missing)}"
        )

    def file(dest: str) -> tuple[Path, str]:
        value, source = given[dest]
        return Path(value), source

    name = given.get("tls_server_name")
    return load_client_tls(
        ca=file("tls_ca"),
        cert=file("tls_cert"),
        key=file("tls_key"),
        server_name=name[0] if name is not None else None,
    )


def connect(args: argparse.Namespace | None = None) -> DaemonClient:
    """A client for the daemon the CLI options name: the unix socket (see ``socket_path``), or
    the mutual-TLS listener at ``--address``/``$GPUSNAP_ADDRESS``. ``InvalidArgument`` (exit 2)
    for options that do not fit together or TLS files that cannot be used."""
    address = _address(args)
    if address is None:
        for dest, option, _env in TLS_SETTINGS:
            if getattr(args, dest, None) is not None:
                raise InvalidArgument(
                    f"{option} needs --address (or {ADDRESS_ENV}); the unix socket takes no TLS"
                )
        return DaemonClient.for_socket(socket_path(args))
    value, source = address
    parse_address(value, source=source)
    return DaemonClient.for_address(value, client_tls(args, needed_by=source))


def query(
    args: argparse.Namespace,
    call: Callable[[DaemonClient], T],
    human: Callable[[T], str],
    *,
    key: str | None = None,
) -> int:
    """A command that is one call: connect as ``args`` say, ``call``, and print the answer
    (as JSON with ``--json``, under ``key`` when given; else ``human(answer)``). Exit 0."""
    with connect(args) as client:
        answer = call(client)
    return emit(args.json, answer if key is None else {key: answer}, lambda: human(answer))
