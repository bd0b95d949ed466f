"""Where gpusnapd's API listens: the unix socket, and an optional mutual-TLS TCP listener.

The socket file is the first gate: ``start_server`` binds it with mode 0660, owner root,
group ``gpusnap``, so only members of the group can connect at all. Behind it each call is
authorized by its caller: gRPC Python does not expose the peer's ``SO_PEERCRED``, so the
socket is owned by ``UnixFront`` (``daemon/api/callers.py``), which reads the credentials of
each connection and hands it to the gRPC server on a private socket in a 0700 directory
beside the public one (in the system temporary directory where that path would be too long
for a socket address). Remote access is an optional TCP listener with mutual TLS, whose
callers are their certificates. See docs/operations.md, the authorization table.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import shutil
import socket
import stat
import tempfile
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from gpusnap.daemon.api.callers import Caller, UnixFront, UnknownCaller, tls_caller
from gpusnap.daemon.api.service_api import DaemonServiceAPI
from gpusnap.daemon.api.servicers import add_servicers
from gpusnap.errors import AlreadyExists, FailedPrecondition, PermissionDenied, Unavailable

log = logging.getLogger(__name__)

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


@dataclass
class ApiServer:
    """The running API: the gRPC server and the front that owns the public socket."""

    grpc_server: grpc.Server
    front: UnixFront
    private_dir: Path

    def caller(self, context: grpc.ServicerContext) -> Caller:
        """Who makes this call: its certificate over TLS, else the credentials the front read
        from its connection. ``PermissionDenied`` when neither is known."""
        remote = tls_caller(context)
        if remote is not None:
            return remote
        try:
            return self.front.caller(context.peer())
        except UnknownCaller:
            raise PermissionDenied(
                "cannot tell who is calling (not a connection through the API socket)"
            ) from None


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
) -> ApiServer:
    """Serve ``service`` on ``unix:socket_path`` (0660, group ``socket_group``), and on a
    mutual-TLS TCP listener when ``tcp`` is given; each call goes to
    ``service.for_caller(its caller)``. Returns the started server.

    Raises ``FailedPrecondition`` for an unsafe socket directory or a path that is not a
    socket, ``AlreadyExists`` when another process listens on the socket, and
    ``Unavailable`` when an address cannot be bound.
    """
    socket_path = Path(socket_path)
    _check_socket_dir(socket_path.parent)
    _remove_stale_socket(socket_path)

    private_dir = _private_dir(socket_path.parent)
    try:
        return _start(
            service, socket_path, socket_group, tcp=tcp, workers=max_workers, private=private_dir
        )
    except BaseException:
        shutil.rmtree(private_dir, ignore_errors=True)
        raise


_PRIVATE_PREFIX = ".gpusnapd-api-"
_PRIVATE_SOCKET = "grpc.sock"
_SUN_PATH_MAX = 107  # bytes of a unix socket path, without its NUL (sun_path is 108)


def _private_dir(beside: Path) -> Path:
    """A fresh 0700 directory (``mkdtemp``: a random name, created exclusively) for the gRPC
    server's private socket: beside the public socket where the path fits a unix socket
    address, else in the system's temporary directory (a deep socket directory, as in tests)."""
    # mkdtemp adds 8 random characters to the prefix.
    fits = len(os.fsencode(str(beside))) + len(_PRIVATE_PREFIX) + 8 + len(_PRIVATE_SOCKET) + 2
    where = beside if fits <= _SUN_PATH_MAX else None
    return Path(tempfile.mkdtemp(prefix=_PRIVATE_PREFIX, dir=where))


def _start(
    service: DaemonServiceAPI,
    socket_path: Path,
    socket_group: str | None,
    *,
    tcp: TcpListenerConfig | None,
    workers: int,
    private: Path,
) -> ApiServer:
    backend = private / _PRIVATE_SOCKET
    if len(os.fsencode(str(backend))) > _SUN_PATH_MAX:
        raise FailedPrecondition(
            f"socket directory {socket_path.parent} is too long a path for the daemon's "
            f"private socket ({backend}); use a shorter one such as /run/gpusnap"
        )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    try:
        server.add_insecure_port(f"unix:{backend}")
    except RuntimeError as exc:
        raise Unavailable(f"cannot listen on unix:{backend}: {exc}") from exc

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

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # A umask of 0117 makes the socket 0660 from the first instant, before the chown below.
    old_umask = os.umask(0o117)
    try:
        listener.bind(str(socket_path))
        listener.listen(128)
    except OSError as exc:
        listener.close()
        raise Unavailable(f"cannot listen on unix:{socket_path}: {exc.strerror}") from exc
    finally:
        os.umask(old_umask)
    _secure_socket(socket_path, socket_group)

    front = UnixFront(listener, backend)
    api = ApiServer(server, front, private)
    add_servicers(server, service, api.caller)
    server.start()
    front.start()
    log.info("serving the gpusnap API on unix:%s", socket_path)
    return api


def stop_server(server: ApiServer, socket_path: Path, *, grace: float | None = 5.0) -> None:
    """Stop serving (in-flight calls get ``grace`` seconds) and remove the socket file."""
    server.front.stop_accepting()  # no new connections; open ones still reach their calls
    try:
        socket_path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove %s: %s", socket_path, exc)
    server.grpc_server.stop(grace).wait()
    server.front.close()
    with contextlib.suppress(OSError):
        shutil.rmtree(server.private_dir)
