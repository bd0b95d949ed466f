"""The gRPC server on a real unix socket, in front of a small in-test service
(``fake_service.FakeService``) or the real one: ``real_server`` serves the real
``DaemonService`` (a file:// store, no GPU), for what the service itself decides: which
arguments it takes.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.api import DaemonServiceAPI, start_server, stop_server
from gpusnap.daemon.api.listeners import ApiServer
from gpusnap.daemon.config.file import parse_config
from gpusnap.daemon.service import DaemonService
from gpusnap.storage import generate_signing_key
from tests.api.fake_service import FakeService


def _typed(service: FakeService) -> DaemonServiceAPI:
    # mypy (scripts/test.sh runs it on tests/ too) holds FakeService to the Protocol here.
    return service


@pytest.fixture
def service() -> FakeService:
    return FakeService()


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Not under pytest's tmp_path (0700 for root): other users must be able to reach it.
    d = Path(tempfile.mkdtemp(prefix="gpusnap-api-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


@pytest.fixture
def server(service: FakeService, socket_dir: Path) -> Iterator[Path]:
    """Serves ``service``; yields the socket path."""
    path = socket_dir / "gpusnapd.sock"
    srv: ApiServer = start_server(_typed(service), socket_path=path, socket_group=None)
    yield path
    stop_server(srv, path, grace=None)


@pytest.fixture
def real_server(socket_dir: Path, tmp_path: Path) -> Iterator[tuple[Path, DaemonService]]:
    """The real ``DaemonService`` (file:// store, signed manifests, no GPU, one workload
    ``svc`` that is not running) served on a socket; yields the socket and the service."""
    path = socket_dir / "gpusnapd.sock"
    key = tmp_path / "signing.key"
    generate_signing_key(key)
    config = parse_config(
        {
            "daemon": {"socket": str(path), "state_dir": str(tmp_path / "state"), "node_id": "a"},
            "store": {"url": f"file://{tmp_path / 'store'}", "key_file": str(key)},
            "gpu": {"driver": "none"},
            "workload": [{"name": "svc", "pid_file": str(tmp_path / "svc.pid")}],
        }
    )
    service = DaemonService(config)
    srv = start_server(service, socket_path=path, socket_group=None)
    try:
        yield path, service
    finally:
        stop_server(srv, path, grace=None)
        service.close()
