"""Who can reach the API: the socket file's mode and group, the directory it lives in, and a
real user outside (and inside) the ``gpusnap`` group."""

from __future__ import annotations

import grp
import os
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from gpusnap.cli._client import DaemonClient
from gpusnap.daemon.api.listeners import TcpListenerConfig, start_server, stop_server
from gpusnap.errors import EXIT_DAEMON_UNREACHABLE, AlreadyExists, FailedPrecondition
from tests.api.fake_service import REPO, FakeService
from tests.support.tls import Ca, free_port
from tests.support.users import ensure_group, ensure_user

GROUP = "gpusnap"
OUTSIDER = "gpusnap-test-outsider"
MEMBER = "gpusnap-test-member"

# Users are made here (tests/support/users.py): every test of this module runs on the worker
# of the etc-passwd group.
pytestmark = pytest.mark.xdist_group("etc-passwd")

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="needs root with useradd/groupadd to create test users",
)


@pytest.fixture
def grouped_server(service: FakeService, socket_dir: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("chown to the gpusnap group needs root")
    ensure_group(GROUP)
    path = socket_dir / "gpusnapd.sock"
    srv = start_server(service, socket_path=path)  # default group: gpusnap
    yield path
    stop_server(srv, path, grace=None)


def test_socket_is_0660_root_gpusnap(grouped_server: Path) -> None:
    st = grouped_server.stat()
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_uid == 0
    assert st.st_gid == grp.getgrnam(GROUP).gr_gid


def test_missing_group_keeps_0660_and_warns(
    service: FakeService, socket_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = socket_dir / "g.sock"
    srv = start_server(service, socket_path=path, socket_group="gpusnap-no-such-group")
    try:
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == os.getegid()
        assert "gpusnap-no-such-group" in caplog.text and "does not exist" in caplog.text
    finally:
        stop_server(srv, path, grace=None)


def test_stale_socket_is_replaced(service: FakeService, socket_dir: Path) -> None:
    path = socket_dir / "s.sock"
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(str(path))
    leftover.close()
    srv = start_server(service, socket_path=path, socket_group=None)
    try:
        assert DaemonClient.for_socket(path).status()["version"] == "0.1.0"
    finally:
        stop_server(srv, path, grace=None)
    assert not path.exists()


def test_live_socket_is_not_taken_over(server: Path, service: FakeService) -> None:
    with pytest.raises(AlreadyExists):
        start_server(service, socket_path=server, socket_group=None)
    assert DaemonClient.for_socket(server).status()["version"] == "0.1.0"


def test_a_regular_file_is_not_replaced(service: FakeService, socket_dir: Path) -> None:
    path = socket_dir / "not-a-socket"
    path.write_text("precious")
    with pytest.raises(FailedPrecondition):
        start_server(service, socket_path=path, socket_group=None)
    assert path.read_text() == "precious"


def test_world_writable_directory_without_sticky_bit_is_refused(
    service: FakeService, socket_dir: Path
) -> None:
    open_dir = socket_dir / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(FailedPrecondition, match="world-writable"):
        start_server(service, socket_path=open_dir / "g.sock", socket_group=None)
    open_dir.chmod(0o1777)  # like /tmp: others cannot remove our socket
    srv = start_server(service, socket_path=open_dir / "g.sock", socket_group=None)
    stop_server(srv, open_dir / "g.sock", grace=None)


def _cli_as(user: str, socket_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    helper = Path(__file__).with_name("_as_user.py")
    return subprocess.run(
        [sys.executable, str(helper), user, "--socket", str(socket_path), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        cwd=REPO,
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": str(REPO),
        },
    )


@needs_root
def test_user_outside_the_group_is_refused_at_the_socket(grouped_server: Path) -> None:
    ensure_user(OUTSIDER, [])
    proc = _cli_as(OUTSIDER, grouped_server, "status")
    assert proc.returncode == EXIT_DAEMON_UNREACHABLE, proc.stderr
    assert proc.stderr == (
        f"gpusnap: error: cannot reach gpusnapd at unix:{grouped_server}: Permission denied\n"
    )


@needs_root
def test_user_in_the_group_can_connect(grouped_server: Path) -> None:
    ensure_user(MEMBER, [GROUP])
    proc = _cli_as(MEMBER, grouped_server, "status", "--json")
    assert proc.returncode == 0, proc.stderr
    assert '"version": "0.1.0"' in proc.stdout


# --- mutual TLS ----------------------------------------------------------------------------


def _pki(d: Path) -> dict[str, bytes]:
    """A CA, a server cert for 127.0.0.1/localhost and a client cert, all signed by the CA."""
    ca = Ca("gpusnap test CA")
    server_cert, server_key = ca.leaf("gpusnapd", ExtendedKeyUsageOID.SERVER_AUTH)
    client_cert, client_key = ca.leaf("operator", ExtendedKeyUsageOID.CLIENT_AUTH)
    out = {
        "ca": ca.pem,
        "server_cert": server_cert,
        "server_key": server_key,
        "client_cert": client_cert,
        "client_key": client_key,
    }
    for k, v in out.items():
        (d / f"{k}.pem").write_bytes(v)
    return out


def test_tcp_listener_requires_a_client_certificate(
    service: FakeService, socket_dir: Path, tmp_path: Path
) -> None:
    pki = _pki(tmp_path)
    address = f"127.0.0.1:{free_port()}"
    tcp = TcpListenerConfig(
        address=address,
        cert_file=tmp_path / "server_cert.pem",
        key_file=tmp_path / "server_key.pem",
        client_ca_file=tmp_path / "ca.pem",
    )
    path = socket_dir / "tls.sock"
    srv = start_server(service, socket_path=path, socket_group=None, tcp=tcp)
    try:
        with_cert = grpc.ssl_channel_credentials(
            root_certificates=pki["ca"],
            private_key=pki["client_key"],
            certificate_chain=pki["client_cert"],
        )
        assert DaemonClient(address, credentials=with_cert).status()["version"] == "0.1.0"

        without_cert = grpc.ssl_channel_credentials(root_certificates=pki["ca"])
        with pytest.raises(Exception) as info:
            DaemonClient(address, credentials=without_cert, timeout=30).status()
        assert "0.1.0" not in str(info.value)
        with pytest.raises(Exception):
            DaemonClient(address, timeout=30).status()  # plaintext to a TLS port
    finally:
        stop_server(srv, path, grace=None)
