"""The real ``DaemonService`` behind the real servicers: the service checks every argument
(the CLI and the servicers pass them on), and the typed answers carry every key it reports."""

from __future__ import annotations

import json
import logging
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpusnap.cli._client import DaemonClient
from gpusnap.daemon.service import DaemonService
from gpusnap.errors import EXIT_FAILURE, EXIT_USAGE
from gpusnap.proto import wire
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2 as pb
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2_grpc as pb_grpc
from tests.api.fake_service import run_cli
from tests.cli._cli import write_tree

A_CHECKPOINT_ID = "20261130T083000Z-0123456789"  # well formed, in no store


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


# (argv, a piece of the error): usage errors (exit 2) that the daemon decides, in one line.
REFUSED_BY_THE_SERVICE = [
    (("restore",), "give a checkpoint id, or --workload NAME --latest"),
    (("restore", "--latest"), "give a checkpoint id, or --workload NAME --latest"),
    (("restore", "--workload", "svc"), "needs --latest"),
    (("restore", A_CHECKPOINT_ID, "--workload", "svc", "--latest"), "not both"),
    (("restore", "not-an-id"), "not a checkpoint id"),
    (("checkpoint", "--pid", "0"), "not a process id: 0 (1 to 4194304)"),
    (("checkpoint", "--pid", "-3"), "not a process id: -3"),
    (("checkpoint", "--pid", "4194305"), "not a process id: 4194305 (1 to 4194304)"),
    (("show", "not-an-id"), "not a checkpoint id"),
    (("compat", "not-an-id"), "not a checkpoint id"),
    (("ls", "--workload", "no spaces"), "not a workload name"),
    (("job", ""), "job_id is required"),
]
# Usage errors the CLI's parser must give before any call: these cannot be sent as given.
REFUSED_BY_THE_PARSER = [
    (("checkpoint", "--pid", "99999999999"), "the API carries pids up to 2147483647"),
    (("checkpoint", "--pid", "abc"), "not a process id: 'abc'"),
    (("checkpoint", "--pid", "1", "--workload", "svc"), "not allowed with argument"),
]


def test_the_service_refuses_bad_arguments_with_one_line_and_exit_2(
    real_server: tuple[Path, DaemonService],
) -> None:
    sock, service = real_server
    for argv, expected in REFUSED_BY_THE_SERVICE:
        proc = run_cli(sock, *argv)
        assert proc.returncode == EXIT_USAGE, (argv, proc.stderr)
        assert proc.stderr.startswith("gpusnap: error: "), (argv, proc.stderr)
        assert expected in proc.stderr, (argv, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, (argv, proc.stderr)
    for argv, expected in REFUSED_BY_THE_PARSER:
        proc = run_cli(sock, *argv)
        assert proc.returncode == EXIT_USAGE, (argv, proc.stderr)
        assert expected in proc.stderr.strip().splitlines()[-1], (argv, proc.stderr)
    assert service.list_jobs() == [], "a refused request queued a job"


def test_requests_the_cli_never_sends_are_refused_by_the_service(
    real_server: tuple[Path, DaemonService],
) -> None:
    sock, _service = real_server
    with grpc.insecure_channel(f"unix:{sock}") as channel:
        for call, request in [
            (pb_grpc.CheckpointsStub(channel).Create, pb.CreateCheckpointRequest()),
            (pb_grpc.RestoresStub(channel).Restore, pb.RestoreRequest(workload="svc")),
            (pb_grpc.RestoresStub(channel).Compat, pb.CompatRequest()),
            (pb_grpc.DaemonStub(channel).Drill, pb.DrillRequest(deadline_seconds=-1.0)),
            (pb_grpc.DaemonStub(channel).Drill, pb.DrillRequest(deadline_seconds=float("nan"))),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=30)  # type: ignore[operator]
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
    # Without a trigger manager there is nothing to drill: the service says so.
    proc = run_cli(sock, "drill", "reclaim")
    assert proc.returncode == EXIT_FAILURE, proc.stderr
    assert "need the trigger manager" in proc.stderr


def test_typed_answers_carry_every_key_the_service_reports(
    real_server: tuple[Path, DaemonService], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sock, service = real_server
    image = tmp_path / "image"
    write_tree(image, big=64 * 1024)
    pushed = service.store.get().push(image, workload="svc")
    caplog.set_level(logging.WARNING, logger="gpusnap.proto.wire")
    for cls, value in [
        (pb.DaemonStatus, service.status()),
        *[(pb.Workload, w) for w in service.list_workloads()],
        *[(pb.CheckpointSummary, c) for c in service.list_checkpoints()],
    ]:
        assert wire.from_message(wire.to_message(cls, value)) == _jsonable(value), cls
    assert "has no field" not in caplog.text

    with DaemonClient.for_socket(sock) as client:
        (listed,) = client.list_checkpoints()
        assert listed == _jsonable(service.list_checkpoints()[0])
        assert listed["checkpoint_id"] == pushed.checkpoint_id and listed["parent"] is None
        (workload,) = client.list_workloads()
        assert workload["last_checkpoint_id"] == pushed.checkpoint_id
        assert workload["running"] is False and workload["pid"] is None
        status = client.status()
        assert status.keys() == service.status().keys()
        store_url = service.config.store.url
        assert status["store"] == {"url": store_url, "reachable": True, "error": None}
    table = run_cli(sock, "ls").stdout.splitlines()
    assert table[0].split() == ["ID", "WORKLOAD", "CREATED", "SIZE", "PARENT"]
    assert table[1].split()[:2] == [pushed.checkpoint_id, "svc"] and table[1].endswith("-")
    shown = run_cli(sock, "show", pushed.checkpoint_id)
    assert shown.returncode == 0, shown.stderr
    assert f"checkpoint  {pushed.checkpoint_id}\nworkload    svc\n" in shown.stdout
    assert "in 5 files" in shown.stdout and "sub/dir/pages-1.img" in shown.stdout


def test_a_client_older_than_the_typed_fields_reads_the_same_in_the_struct_copy(
    real_server: tuple[Path, DaemonService], tmp_path: Path
) -> None:
    sock, service = real_server
    image = tmp_path / "image"
    write_tree(image, big=64 * 1024)
    service.store.get().push(image, workload="svc")
    with grpc.insecure_channel(f"unix:{sock}") as channel:
        listed = pb_grpc.CheckpointsStub(channel).List(pb.ListCheckpointsRequest(), timeout=30)
        workloads = pb_grpc.WorkloadsStub(channel).List(pb.ListWorkloadsRequest(), timeout=30)
        status = pb_grpc.DaemonStub(channel).Status(pb.StatusRequest(), timeout=30)
    assert [wire.from_struct(s) for s in listed.checkpoints] == [
        wire.from_message(m) for m in listed.items
    ]
    assert [wire.from_struct(s) for s in workloads.workloads] == [
        wire.from_message(m) for m in workloads.items
    ]
    old, new = wire.from_struct(status.status), wire.from_message(status.daemon)
    assert old.keys() == new.keys()
    assert {k: v for k, v in old.items() if k != "uptime_seconds"} == {
        k: v for k, v in new.items() if k != "uptime_seconds"
    }


class _OlderDaemon(pb_grpc.DaemonServicer, pb_grpc.CheckpointsServicer):
    """A daemon from before the typed fields: it fills the Structs only."""

    STATUS: dict[str, Any] = {"version": "0.0.9", "pid": 7, "store": {"url": "file:///s"}}
    SUMMARY: dict[str, Any] = {"checkpoint_id": "c1", "workload": "w", "bytes_total": 3}

    def Status(self, request: pb.StatusRequest, context: object) -> pb.StatusResponse:
        return pb.StatusResponse(status=wire.to_struct(self.STATUS))

    def List(
        self, request: pb.ListCheckpointsRequest, context: object
    ) -> pb.ListCheckpointsResponse:
        return pb.ListCheckpointsResponse(checkpoints=[wire.to_struct(self.SUMMARY)])


def test_a_client_reads_a_daemon_older_than_the_typed_fields(socket_dir: Path) -> None:
    path = socket_dir / "older.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    older = _OlderDaemon()  # type: ignore[abstract]  # the stubs mark every RPC abstract
    pb_grpc.add_DaemonServicer_to_server(older, server)
    pb_grpc.add_CheckpointsServicer_to_server(older, server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        with DaemonClient.for_socket(path) as client:
            assert client.status() == _OlderDaemon.STATUS
            assert client.list_checkpoints() == [_OlderDaemon.SUMMARY]
    finally:
        server.stop(None).wait()
