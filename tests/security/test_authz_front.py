"""The API socket's front (``daemon/api/callers.py``): who calls is what the kernel says, a
connection that did not come through the front is nobody, and the front leaks nothing.

In-process: the real listener in front of ``FakeService`` (which lets every identified caller
do everything), so what is tested is identification and the splice, not the rules.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gpusnap.cli._client import DaemonClient
from gpusnap.daemon.api.callers import Caller
from gpusnap.daemon.api.listeners import ApiServer, start_server, stop_server
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2 as pb
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2_grpc as pb_grpc
from tests.api.fake_service import FakeService


class Recording(FakeService):
    """``FakeService`` that keeps the caller of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.callers: list[Caller] = []

    def for_caller(self, caller: Caller) -> FakeService:
        self.callers.append(caller)
        return self


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, ApiServer, Recording]]:
    service = Recording()
    path = tmp_path / "gpusnapd.sock"
    srv = start_server(service, socket_path=path, socket_group=None)
    yield path, srv, service
    stop_server(srv, path, grace=None)


def _front_sockets(path: Path) -> tuple[int, int]:
    """This process's sockets: (connections accepted on the public socket, which show its
    path; the front's sockets to gRPC, bound to ``@gpusnapd-...``)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                mine.add(target[len("socket:[") : -1])
    names = [
        f[7]
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]
        if len(f := line.split()) > 7 and f[6] in mine
    ]
    return names.count(str(path)) - 1, sum(1 for n in names if n.startswith("@gpusnapd-"))


def test_the_caller_is_the_connecting_process_as_the_kernel_sees_it(
    served: tuple[Path, ApiServer, Recording],
) -> None:
    path, _, service = served
    with DaemonClient.for_socket(path) as client:
        assert client.status()["version"] == "0.1.0"
    (caller,) = service.callers
    assert (caller.uid, caller.gid, caller.pid) == (os.getuid(), os.getgid(), os.getpid())
    assert set(os.getgroups()) <= set(caller.groups)
    assert caller.cert_names == ()


def test_a_connection_that_bypasses_the_front_is_nobody(
    served: tuple[Path, ApiServer, Recording],
) -> None:
    _, srv, service = served
    private = srv.private_dir
    st = private.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    # Even root, connecting to gRPC's own socket (not through the front), is no caller.
    with grpc.insecure_channel(f"unix:{private / 'grpc.sock'}") as channel:
        with pytest.raises(grpc.RpcError) as raised:
            pb_grpc.DaemonStub(channel).Status(pb.StatusRequest(), timeout=30)
    err: grpc.Call = raised.value  # type: ignore[assignment]
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "cannot tell who is calling" in (err.details() or "")
    assert service.callers == []


def test_streams_and_cancelled_calls_pass_and_nothing_leaks(
    served: tuple[Path, ApiServer, Recording],
) -> None:
    path, srv, service = served
    threads_before = set(threading.enumerate())
    for _ in range(20):
        client = DaemonClient.for_socket(path)
        job = client.checkpoint(pid=4242)
        # The Watch stream through the front, to the job's end.
        states = [j["state"] for j in client.watch_job(job["id"])]
        assert states[-1] == "succeeded", states
        client.close()
    # A stream cancelled by the client mid-way.
    with grpc.insecure_channel(f"unix:{path}") as channel:
        job_id = service.checkpoint(
            pid=4243,
            workload=None,
            leave_running=False,
            trigger="operator",
            deadline=None,
            container=None,
            runtime=None,
        ).id
        stream = pb_grpc.JobsStub(channel).Watch(pb.WatchJobRequest(job_id=job_id))
        first: pb.Job = next(iter(stream))
        assert first.id == job_id
        stream.cancel()
    # Every connection the clients closed is closed on both of the front's sides, and the
    # threads are what they were but for the gRPC server's worker pool, which grows to its
    # bound on demand (the front's connections end when their clients do).
    assert srv.front.wait_idle()
    assert _front_sockets(path) == (0, 0)
    new = {t.name for t in set(threading.enumerate()) - threads_before}
    assert all(name.startswith("grpc_") for name in new), new


def test_stop_ends_the_front_and_removes_what_it_made(tmp_path: Path) -> None:
    threads_before = {t.name for t in threading.enumerate()}
    path = tmp_path / "gpusnapd.sock"
    srv = start_server(FakeService(), socket_path=path, socket_group=None)
    held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    held.connect(str(path))  # a client that never says anything: stop must not wait on it
    with DaemonClient.for_socket(path) as client:
        assert client.status()["version"] == "0.1.0"
    stop_server(srv, path, grace=None)
    held.close()
    assert not path.exists() and not srv.private_dir.exists()
    assert "gpusnapd-front" not in {t.name for t in threading.enumerate()} - threads_before
