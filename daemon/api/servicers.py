"""The ``gpusnap.v1`` servicers: requests into ``DaemonServiceAPI`` calls, results into messages.

They decide nothing and check nothing the service checks: a request's fields go to the service
as they came (an empty string as ``None`` where the proto says empty means unset), and every
conversion is ``gpusnap.proto.wire``'s. Each call goes to ``service.for_caller(caller)``, the
service as that caller may use it (``identify`` says who calls: ``daemon/api/callers.py``). A
``GpusnapError`` ends the call with the gRPC status code of ``ERROR_TABLE`` and the kind in the
trailing metadata key ``gpusnap-error-kind``; any other exception is a bug underneath, logged
whole here and sent as ``internal`` in one line.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import NoReturn, TypeVar

import grpc

from gpusnap.daemon.api.callers import Caller
from gpusnap.daemon.api.service_api import DaemonServiceAPI
from gpusnap.errors import GpusnapError, Internal, InvalidArgument
from gpusnap.proto import wire
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2 as pb
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2_grpc as pb_grpc
from gpusnap.proto.wire import JobView

log = logging.getLogger(__name__)

S = TypeVar("S", bound="_Servicer")
Identify = Callable[[grpc.ServicerContext], Caller]
Req = TypeVar("Req")
Resp = TypeVar("Resp")


def _abort(context: grpc.ServicerContext, what: str, err: Exception) -> NoReturn:
    if isinstance(err, GpusnapError):
        log.info("%s: %s: %s", what, err.kind, err)
    else:
        # A bug underneath: log it whole here, tell the client one line.
        log.exception("%s failed", what)
        err = Internal(f"internal error in {what}: {type(err).__name__}: {err}")
    code, metadata = wire.error_status(err)
    context.set_trailing_metadata(metadata)
    context.abort(code, str(err))


def _unary(
    what: str,
) -> Callable[
    [Callable[[S, DaemonServiceAPI, Req], Resp]], Callable[[S, Req, grpc.ServicerContext], Resp]
]:
    """A unary RPC from ``method(self, service, request)``, ``service`` as the caller may use
    it: its errors become the call's status."""

    def wrap(
        method: Callable[[S, DaemonServiceAPI, Req], Resp],
    ) -> Callable[[S, Req, grpc.ServicerContext], Resp]:
        @functools.wraps(method)
        def rpc(self: S, request: Req, context: grpc.ServicerContext) -> Resp:
            try:
                return method(self, self._as_caller(context), request)
            except Exception as err:
                _abort(context, what, err)

        return rpc

    return wrap


def _required_job_id(job_id: str) -> str:
    # Kept here until the service checks job ids itself: it answers an empty one NotFound
    # (exit 3), where a missing argument has always been invalid_argument (exit 2).
    if not job_id:
        raise InvalidArgument("job_id is required")
    return job_id


class _Servicer:
    def __init__(self, service: DaemonServiceAPI, identify: Identify) -> None:
        self._service = service
        self._identify = identify

    def _as_caller(self, context: grpc.ServicerContext) -> DaemonServiceAPI:
        return self._service.for_caller(self._identify(context))


class CheckpointsServicer(_Servicer, pb_grpc.CheckpointsServicer):
    @_unary("checkpoint")
    def Create(self, svc: DaemonServiceAPI, request: pb.CreateCheckpointRequest) -> pb.Job:
        target = request.WhichOneof("target")
        job = svc.checkpoint(
            pid=request.pid if target == "pid" else None,
            workload=request.workload if target == "workload" else None,
            leave_running=request.leave_running,
            trigger=request.trigger or "operator",
            deadline=wire.get_time(request, "deadline"),
            container=request.container if target == "container" else None,
            runtime=request.runtime or None,
        )
        return wire.job_to_pb(job)

    @_unary("preflight")
    def Preflight(
        self, svc: DaemonServiceAPI, request: pb.PreflightRequest
    ) -> pb.PreflightResponse:
        target = request.WhichOneof("target")
        report = svc.preflight(
            pid=request.pid if target == "pid" else None,
            workload=request.workload if target == "workload" else None,
            container=request.container if target == "container" else None,
            runtime=request.runtime or None,
        )
        return wire.to_message(pb.PreflightResponse, report)

    @_unary("list checkpoints")
    def List(
        self, svc: DaemonServiceAPI, request: pb.ListCheckpointsRequest
    ) -> pb.ListCheckpointsResponse:
        items = svc.list_checkpoints(request.workload or None)
        return pb.ListCheckpointsResponse(
            checkpoints=[wire.to_struct(i) for i in items],
            items=[wire.to_message(pb.CheckpointSummary, i) for i in items],
        )

    @_unary("show checkpoint")
    def Show(
        self, svc: DaemonServiceAPI, request: pb.ShowCheckpointRequest
    ) -> pb.ShowCheckpointResponse:
        manifest = svc.show_checkpoint(request.checkpoint_id)
        return pb.ShowCheckpointResponse(
            checkpoint=wire.to_struct(manifest), manifest_json=wire.to_json(manifest)
        )


class RestoresServicer(_Servicer, pb_grpc.RestoresServicer):
    @_unary("restore")
    def Restore(self, svc: DaemonServiceAPI, request: pb.RestoreRequest) -> pb.Job:
        job = svc.restore(
            checkpoint_id=request.checkpoint_id or None,
            workload=request.workload or None,
            latest=request.latest,
            name=request.name or None,
            allow_rollback=request.allow_rollback,
        )
        return wire.job_to_pb(job)

    @_unary("compat")
    def Compat(self, svc: DaemonServiceAPI, request: pb.CompatRequest) -> pb.CompatVerdict:
        return wire.verdict_to_pb(svc.compat(request.checkpoint_id))


class JobsServicer(_Servicer, pb_grpc.JobsServicer):
    @_unary("get job")
    def Get(self, svc: DaemonServiceAPI, request: pb.GetJobRequest) -> pb.Job:
        return wire.job_to_pb(svc.get_job(_required_job_id(request.job_id)))

    @_unary("list jobs")
    def List(self, svc: DaemonServiceAPI, request: pb.ListJobsRequest) -> pb.ListJobsResponse:
        jobs = svc.list_jobs(limit=request.limit)  # 0: the service's default
        return pb.ListJobsResponse(jobs=[wire.job_to_pb(j) for j in jobs])

    @_unary("cancel job")
    def Cancel(self, svc: DaemonServiceAPI, request: pb.CancelJobRequest) -> pb.Job:
        return wire.job_to_pb(svc.cancel_job(_required_job_id(request.job_id)))

    def Watch(self, request: pb.WatchJobRequest, context: grpc.ServicerContext) -> Iterator[pb.Job]:
        updates: Iterator[JobView] | None = None
        try:
            updates = self._as_caller(context).watch_job(_required_job_id(request.job_id))
            for job in updates:
                yield wire.job_to_pb(job)
        except Exception as err:
            _abort(context, "watch job", err)
        finally:
            # The client may go away mid-stream; let the service drop its subscription.
            close = getattr(updates, "close", None)
            if callable(close):
                close()


class WorkloadsServicer(_Servicer, pb_grpc.WorkloadsServicer):
    @_unary("list workloads")
    def List(
        self, svc: DaemonServiceAPI, request: pb.ListWorkloadsRequest
    ) -> pb.ListWorkloadsResponse:
        items = svc.list_workloads()
        return pb.ListWorkloadsResponse(
            workloads=[wire.to_struct(w) for w in items],
            items=[wire.to_message(pb.Workload, w) for w in items],
        )


class DaemonServicer(_Servicer, pb_grpc.DaemonServicer):
    @_unary("status")
    def Status(self, svc: DaemonServiceAPI, request: pb.StatusRequest) -> pb.StatusResponse:
        status = svc.status()
        return pb.StatusResponse(
            status=wire.to_struct(status), daemon=wire.to_message(pb.DaemonStatus, status)
        )

    @_unary("triggers status")
    def TriggersStatus(
        self, svc: DaemonServiceAPI, request: pb.TriggersStatusRequest
    ) -> pb.TriggersStatusResponse:
        return pb.TriggersStatusResponse(triggers=wire.to_struct(svc.triggers_status()))

    @_unary("list migrations")
    def ListMigrations(
        self, svc: DaemonServiceAPI, request: pb.ListMigrationsRequest
    ) -> pb.ListMigrationsResponse:
        migrations = svc.migrations()
        return pb.ListMigrationsResponse(migrations=[wire.to_struct(m) for m in migrations])

    @_unary("withdraw migration")
    def WithdrawMigration(
        self, svc: DaemonServiceAPI, request: pb.WithdrawMigrationRequest
    ) -> pb.WithdrawMigrationResponse:
        migration = svc.withdraw_migration(request.checkpoint_id, request.reason)
        return pb.WithdrawMigrationResponse(migration=wire.to_struct(migration))

    @_unary("drill")
    def Drill(self, svc: DaemonServiceAPI, request: pb.DrillRequest) -> pb.Job:
        deadline = request.deadline_seconds if request.HasField("deadline_seconds") else None
        # Kept here until the service checks it: the reclaim side takes any number.
        if deadline is not None and not deadline > 0:
            raise InvalidArgument(f"drill deadline must be positive, not {deadline}")
        return wire.job_to_pb(svc.drill(deadline))


def add_servicers(server: grpc.Server, service: DaemonServiceAPI, identify: Identify) -> None:
    """Register every ``gpusnap.v1`` service on ``server``, backed by ``service`` as each
    call's caller (``identify``) may use it."""
    pb_grpc.add_CheckpointsServicer_to_server(CheckpointsServicer(service, identify), server)
    pb_grpc.add_RestoresServicer_to_server(RestoresServicer(service, identify), server)
    pb_grpc.add_JobsServicer_to_server(JobsServicer(service, identify), server)
    pb_grpc.add_WorkloadsServicer_to_server(WorkloadsServicer(service, identify), server)
    pb_grpc.add_DaemonServicer_to_server(DaemonServicer(service, identify), server)
