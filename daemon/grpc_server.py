"""gpusnapd's gRPC front: servicers that translate ``gpusnap.v1`` to ``DaemonServiceAPI``.

The servicers decide nothing. They turn requests into service calls and results into
messages, and a ``GpusnapError`` into the gRPC status code of ``ERROR_TABLE`` with the kind in
the trailing metadata key ``gpusnap-error-kind`` (clients rebuild the same kind from it).

Access control is the socket file: ``start_server`` binds ``unix:PATH`` with mode 0660, owner
root, group ``gpusnap``. gRPC Python does not expose the peer's ``SO_PEERCRED``, so the file
permissions (and the 0750 runtime directory around it) are the whole check; see
docs/operations.md. Remote access is an optional TCP listener with mutual TLS.
"""

from __future__ import annotations

import grp
import json
import logging
import math
import os
import socket
import stat
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf import struct_pb2
from google.protobuf.timestamp_pb2 import Timestamp

from gpusnap.daemon.api import DaemonServiceAPI
from gpusnap.daemon.jobs.job import Job
from gpusnap.daemon.verdict import CompatVerdict
from gpusnap.errors import (
    ERROR_TABLE,
    AlreadyExists,
    FailedPrecondition,
    GpusnapError,
    Internal,
    InvalidArgument,
    Unavailable,
)
from gpusnap.proto.gpusnap.v1 import ERROR_KIND_METADATA_KEY
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2 as pb
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

SOCKET_MODE = 0o660
DEFAULT_SOCKET_GROUP = "gpusnap"
# Manifests of large process trees list many files; keep well above gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class TcpListenerConfig:
    """An optional remote listener; always mutual TLS (clients must present a cert)."""

    address: str  # "host:port", e.g. "0.0.0.0:7443" or "[::]:7443"
    cert_file: Path  # server certificate chain (PEM)
    key_file: Path  # its private key (PEM)
    client_ca_file: Path  # CA that signs client certificates (PEM)


# --- model -> protobuf ---------------------------------------------------------------------


def _enum_value(enum_type: Any, prefix: str, value: str) -> int:
    """``"freeze-gpu"`` -> ``PHASE_FREEZE_GPU``; an unknown name is sent as UNSPECIFIED."""
    name = prefix + value.upper().replace("-", "_")
    try:
        number: int = enum_type.Value(name)
    except ValueError:
        log.warning("gpusnap.v1 has no %s; sent as unspecified (add it to the proto)", name)
        return 0
    return number


def _set_time(field: Timestamp, epoch: float | None) -> None:
    if epoch is not None:
        # Split before scaling: epoch * 1e9 would lose sub-microsecond digits to rounding.
        seconds = math.floor(epoch)
        nanos = min(999_999_999, round((epoch - seconds) * 1e9))
        field.seconds, field.nanos = seconds, nanos


def _jsonable(value: Any) -> Any:
    # Struct holds JSON values only; tuples, paths, enums and the like become JSON first.
    return json.loads(json.dumps(value, default=str))


def to_struct(value: dict[str, Any]) -> struct_pb2.Struct:
    msg = struct_pb2.Struct()
    msg.update(_jsonable(value))
    return msg


def job_to_pb(job: Job) -> pb.Job:
    msg = pb.Job(
        id=job.id,
        kind=_enum_value(pb.JobKind, "JOB_KIND_", job.kind.value),  # type: ignore[arg-type]
        workload=job.workload,
        state=_enum_value(pb.JobState, "JOB_STATE_", job.state.value),  # type: ignore[arg-type]
        phase=_enum_value(pb.Phase, "PHASE_", job.phase.value),  # type: ignore[arg-type]
        bytes_done=max(0, job.progress.bytes_done),
        bytes_total=max(0, job.progress.bytes_total),
        rate_bytes_per_s=job.progress.rate_bytes_per_s,
        trigger=job.trigger,
        error=job.error or "",
        error_kind=job.error_kind or "",
    )
    _set_time(msg.created_at, job.created_at or None)
    _set_time(msg.started_at, job.started_at)
    _set_time(msg.finished_at, job.finished_at)
    _set_time(msg.deadline, job.deadline)
    msg.result.update(_jsonable(job.result))
    return msg


def verdict_to_pb(verdict: CompatVerdict) -> pb.CompatVerdict:
    return pb.CompatVerdict(
        checkpoint_id=verdict.checkpoint_id,
        compatible=verdict.compatible,
        reasons=[
            pb.Reason(field=r.field, expected=r.expected, actual=r.actual, message=r.message)
            for r in verdict.reasons
        ],
    )


# --- errors ----------------------------------------------------------------------------------


def _abort(context: grpc.ServicerContext, err: GpusnapError) -> NoReturn:
    mapping = ERROR_TABLE.get(err.kind, ERROR_TABLE["internal"])
    context.set_trailing_metadata(((ERROR_KIND_METADATA_KEY, err.kind),))
    context.abort(getattr(grpc.StatusCode, mapping.grpc_code), str(err))


def _translate(context: grpc.ServicerContext, what: str, call: Callable[[], T]) -> T:
    try:
        return call()
    except GpusnapError as err:
        log.info("%s: %s: %s", what, err.kind, err)
        _abort(context, err)
    except Exception as err:
        # A bug underneath: log it whole here, tell the client one line.
        log.exception("%s failed", what)
        _abort(context, Internal(f"internal error in {what}: {type(err).__name__}: {err}"))


def _required(value: str, name: str) -> str:
    if not value:
        raise InvalidArgument(f"{name} is required")
    return value


def _time_or_none(msg: Any, field: str) -> float | None:
    if not msg.HasField(field):
        return None
    ts: Timestamp = getattr(msg, field)
    return ts.seconds + ts.nanos / 1e9


# --- servicers -------------------------------------------------------------------------------


class CheckpointsServicer(pb_grpc.CheckpointsServicer):
    def __init__(self, service: DaemonServiceAPI) -> None:
        self._service = service

    def Create(self, request: pb.CreateCheckpointRequest, context: grpc.ServicerContext) -> pb.Job:
        def call() -> pb.Job:
            target = request.WhichOneof("target")
            if target is None:
                raise InvalidArgument("give a pid or a workload to checkpoint")
            job = self._service.checkpoint(
                pid=request.pid if target == "pid" else None,
                workload=request.workload if target == "workload" else None,
                leave_running=request.leave_running,
                trigger=request.trigger or "operator",
                deadline=_time_or_none(request, "deadline"),
            )
            return job_to_pb(job)

        return _translate(context, "checkpoint", call)

    def List(
        self, request: pb.ListCheckpointsRequest, context: grpc.ServicerContext
    ) -> pb.ListCheckpointsResponse:
        def call() -> pb.ListCheckpointsResponse:
            items = self._service.list_checkpoints(request.workload or None)
            return pb.ListCheckpointsResponse(checkpoints=[to_struct(i) for i in items])

        return _translate(context, "list checkpoints", call)

    def Show(
        self, request: pb.ShowCheckpointRequest, context: grpc.ServicerContext
    ) -> pb.ShowCheckpointResponse:
        def call() -> pb.ShowCheckpointResponse:
            cid = _required(request.checkpoint_id, "checkpoint_id")
            return pb.ShowCheckpointResponse(
                checkpoint=to_struct(self._service.show_checkpoint(cid))
            )

        return _translate(context, "show checkpoint", call)


class RestoresServicer(pb_grpc.RestoresServicer):
    def __init__(self, service: DaemonServiceAPI) -> None:
        self._service = service

    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> pb.Job:
        def call() -> pb.Job:
            if not request.checkpoint_id and not (request.workload and request.latest):
                raise InvalidArgument("give a checkpoint id, or a workload with latest")
            job = self._service.restore(
                checkpoint_id=request.checkpoint_id or None,
                workload=request.workload or None,
                latest=request.latest,
            )
            return job_to_pb(job)

        return _translate(context, "restore", call)

    def Compat(self, request: pb.CompatRequest, context: grpc.ServicerContext) -> pb.CompatVerdict:
        def call() -> pb.CompatVerdict:
            cid = _required(request.checkpoint_id, "checkpoint_id")
            return verdict_to_pb(self._service.compat(cid))

        return _translate(context, "compat", call)


class JobsServicer(pb_grpc.JobsServicer):
    def __init__(self, service: DaemonServiceAPI) -> None:
        self._service = service

    def Get(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> pb.Job:
        return _translate(
            context,
            "get job",
            lambda: job_to_pb(self._service.get_job(_required(request.job_id, "job_id"))),
        )

    def List(
        self, request: pb.ListJobsRequest, context: grpc.ServicerContext
    ) -> pb.ListJobsResponse:
        def call() -> pb.ListJobsResponse:
            jobs = self._service.list_jobs(limit=request.limit or 50)
            return pb.ListJobsResponse(jobs=[job_to_pb(j) for j in jobs])

        return _translate(context, "list jobs", call)

    def Cancel(self, request: pb.CancelJobRequest, context: grpc.ServicerContext) -> pb.Job:
        return _translate(
            context,
            "cancel job",
            lambda: job_to_pb(self._service.cancel_job(_required(request.job_id, "job_id"))),
        )

    def Watch(self, request: pb.WatchJobRequest, context: grpc.ServicerContext) -> Iterator[pb.Job]:
        updates: Iterator[Job] | None = None
        try:
            updates = self._service.watch_job(_required(request.job_id, "job_id"))
            for job in updates:
                yield job_to_pb(job)
        except GpusnapError as err:
            log.info("watch job: %s: %s", err.kind, err)
            _abort(context, err)
        except Exception as err:
            log.exception("watch job failed")
            _abort(context, Internal(f"internal error in watch job: {type(err).__name__}: {err}"))
        finally:
            # The client may go away mid-stream; let the service drop its subscription.
            close = getattr(updates, "close", None)
            if callable(close):
                close()


class WorkloadsServicer(pb_grpc.WorkloadsServicer):
    def __init__(self, service: DaemonServiceAPI) -> None:
        self._service = service

    def List(
        self, request: pb.ListWorkloadsRequest, context: grpc.ServicerContext
    ) -> pb.ListWorkloadsResponse:
        return _translate(
            context,
            "list workloads",
            lambda: pb.ListWorkloadsResponse(
                workloads=[to_struct(w) for w in self._service.list_workloads()]
            ),
        )


class DaemonServicer(pb_grpc.DaemonServicer):
    def __init__(self, service: DaemonServiceAPI) -> None:
        self._service = service

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        return _translate(
            context, "status", lambda: pb.StatusResponse(status=to_struct(self._service.status()))
        )

    def TriggersStatus(
        self, request: pb.TriggersStatusRequest, context: grpc.ServicerContext
    ) -> pb.TriggersStatusResponse:
        return _translate(
            context,
            "triggers status",
            lambda: pb.TriggersStatusResponse(triggers=to_struct(self._service.triggers_status())),
        )

    def ListMigrations(
        self, request: pb.ListMigrationsRequest, context: grpc.ServicerContext
    ) -> pb.ListMigrationsResponse:
        return _translate(
            context,
            "list migrations",
            lambda: pb.ListMigrationsResponse(
                migrations=[to_struct(m) for m in self._service.migrations()]
            ),
        )

    def Drill(self, request: pb.DrillRequest, context: grpc.ServicerContext) -> pb.Job:
        def call() -> pb.Job:
            deadline = request.deadline_seconds if request.HasField("deadline_seconds") else None
            if deadline is not None and deadline <= 0:
                raise InvalidArgument(f"drill deadline must be positive, not {deadline}")
            return job_to_pb(self._service.drill(deadline))

        return _translate(context, "drill", call)


def add_servicers(server: grpc.Server, service: DaemonServiceAPI) -> None:
    """Register every ``gpusnap.v1`` service on ``server``, backed by ``service``."""
    pb_grpc.add_CheckpointsServicer_to_server(CheckpointsServicer(service), server)
    pb_grpc.add_RestoresServicer_to_server(RestoresServicer(service), server)
    pb_grpc.add_JobsServicer_to_server(JobsServicer(service), server)
    pb_grpc.add_WorkloadsServicer_to_server(WorkloadsServicer(service), server)
    pb_grpc.add_DaemonServicer_to_server(DaemonServicer(service), server)


# --- the socket ------------------------------------------------------------------------------


def _check_socket_dir(directory: Path) -> None:
    """Refuse a directory where someone else could swap our socket for theirs."""
    try:
        st = directory.stat()
    except FileNotFoundError:
        directory.mkdir(mode=0o750, parents=True)
        st = directory.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise FailedPrecondition(f"socket directory {directory} is not a directory")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise FailedPrecondition(
            f"socket directory {directory} is world-writable without the sticky bit; "
            "use a private directory such as /run/gpusnap"
        )


def _remove_stale_socket(path: Path) -> None:
    """Remove a socket left by a dead daemon; refuse when something still listens on it."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FailedPrecondition(f"{path} exists and is not a socket; not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        log.info("removing stale socket %s (nothing listens on it)", path)
        path.unlink()
        return
    except OSError as exc:
        raise FailedPrecondition(f"cannot tell whether {path} is in use: {exc}") from exc
    finally:
        probe.close()
    raise AlreadyExists(f"another process (a running gpusnapd?) already listens on {path}")


def _group_id(name: str) -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def _secure_socket(path: Path, group: str | None) -> None:
    os.chmod(path, SOCKET_MODE)
    if group is None:
        return
    gid = _group_id(group)
    if gid is None:
        log.warning(
            "group %r does not exist; %s stays mode 0660 with the daemon's own group, so only "
            "root can use the API (install systemd/gpusnap.sysusers.conf to create the group)",
            group,
            path,
        )
        return
    try:
        os.chown(path, -1, gid)  # the owner is the daemon's user: root under systemd
    except PermissionError as exc:
        log.warning("cannot give %s to group %r: %s", path, group, exc)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise FailedPrecondition(f"cannot read TLS file {path}: {exc.strerror}") from exc


def start_server(
    service: DaemonServiceAPI,
    *,
    socket_path: Path,
    socket_group: str | None = DEFAULT_SOCKET_GROUP,
    tcp: TcpListenerConfig | None = None,
    max_workers: int = 16,
) -> grpc.Server:
    """Serve ``service`` on ``unix:socket_path`` (0660, group ``socket_group``), and on a
    mutual-TLS TCP listener when ``tcp`` is given. Returns the started server.

    Raises ``FailedPrecondition`` for an unsafe socket directory or a path that is not a
    socket, ``AlreadyExists`` when another process listens on the socket, and
    ``Unavailable`` when an address cannot be bound.
    """
    socket_path = Path(socket_path)
    _check_socket_dir(socket_path.parent)
    _remove_stale_socket(socket_path)

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    add_servicers(server, service)

    # The socket is created by bind() inside gRPC with the process umask; a umask of 0117
    # makes it 0660 from the first instant, before the chmod/chown below.
    old_umask = os.umask(0o117)
    try:
        server.add_insecure_port(f"unix:{socket_path}")
    except RuntimeError as exc:
        raise Unavailable(f"cannot listen on unix:{socket_path}: {exc}") from exc
    finally:
        os.umask(old_umask)
    _secure_socket(socket_path, socket_group)

    if tcp is not None:
        credentials = grpc.ssl_server_credentials(
            [(_read(tcp.key_file), _read(tcp.cert_file))],
            root_certificates=_read(tcp.client_ca_file),
            require_client_auth=True,
        )
        try:
            server.add_secure_port(tcp.address, credentials)
        except RuntimeError as exc:
            raise Unavailable(f"cannot listen on {tcp.address}: {exc}") from exc
        log.info("listening on %s (mutual TLS)", tcp.address)

    server.start()
    log.info("serving the gpusnap API on unix:%s", socket_path)
    return server


def stop_server(server: grpc.Server, socket_path: Path, *, grace: float | None = 5.0) -> None:
    """Stop serving (in-flight calls get ``grace`` seconds) and remove the socket file."""
    server.stop(grace).wait()
    try:
        socket_path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove %s: %s", socket_path, exc)
