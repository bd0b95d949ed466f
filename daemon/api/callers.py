"""Who is calling: a caller's identity from the kernel (unix socket) or its certificate (mTLS).

gRPC Python never shows a servicer the connection's socket, and for a unix socket
``context.peer()`` is only ``"unix:"`` and ``auth_context()`` says ``insecure``: nothing that
tells one caller from another. So gpusnapd does not let gRPC own its public socket.
``UnixFront`` listens on it, reads each connection's ``SO_PEERCRED`` (and ``SO_PEERGROUPS``) as
it is accepted, and splices the connection to the gRPC server's private socket in a directory
only root can enter, from a client socket bound to a fresh random abstract address. The
server sees that address as the call's ``context.peer()``; the front's table maps it back to
the credentials. A local user cannot forge an entry: reaching the private socket takes root,
an abstract address is held by one socket at a time, a name is never reused, and an entry is
dropped before its sockets close. A call whose peer is in no table is refused.

Over the mutual-TLS listener the caller is its client certificate's names (subject CN and
subject alternative names), as gRPC verified them. What a caller may do is the daemon's to
decide (``daemon/authz.py``); this module only says who it is.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import logging
import os
import pwd
import secrets
import socket
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import grpc

log = logging.getLogger(__name__)

_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13
_MAX_GROUPS = 65536
_BUFFER = 256 * 1024


@dataclass(frozen=True)
class Caller:
    """One call's caller. A local one (``uid`` set) is the process that connected to the
    socket, as the kernel saw it at ``connect()``; a remote one (``cert_names`` set) is the
    client certificate the mutual-TLS handshake verified."""

    uid: int | None = None
    gid: int | None = None
    groups: tuple[int, ...] = ()  # supplementary groups, as the kernel saw them
    pid: int | None = None
    cert_names: tuple[str, ...] = ()  # subject CN first, then subject alternative names


class UnknownCaller(Exception):
    """The call's connection is in no table: refuse it."""


def peer_credentials(sock: socket.socket) -> Caller:
    """``SO_PEERCRED`` (and the supplementary groups) of a connected unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    groups: tuple[int, ...] = ()
    try:
        try:
            buf = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 64)
        except OSError as exc:
            if exc.errno != errno.ERANGE:
                raise
            buf = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * _MAX_GROUPS)
        groups = tuple(array.array("I", buf))
    except OSError:
        # An older kernel: the groups /etc/group gives the uid (what a login would get).
        with contextlib.suppress(KeyError, OSError):
            user = pwd.getpwuid(uid)
            groups = tuple(os.getgrouplist(user.pw_name, user.pw_gid))
    return Caller(uid=uid, gid=gid, groups=groups, pid=pid)


def tls_caller(context: grpc.ServicerContext) -> Caller | None:
    """The verified client certificate's names, for a call over mutual TLS; else None."""
    # The stubs say bytes per key; gRPC gives a list of bytes values.
    auth = cast("Mapping[str, list[bytes]]", context.auth_context())
    if b"ssl" not in auth.get("transport_security_type", ()):
        return None
    names = [v.decode(errors="replace") for v in auth.get("x509_common_name", ())]
    names += [v.decode(errors="replace") for v in auth.get("x509_subject_alternative_name", ())]
    return Caller(cert_names=tuple(dict.fromkeys(names)))


class UnixFront:
    """The public unix socket: accept, read the peer's credentials, splice to gRPC.

    One thread runs an asyncio loop for every connection; ``close`` stops accepting, closes
    every connection and joins the thread. Bytes pass through unchanged, so unary, streaming
    and cancelled calls behave as they would on gRPC's own socket."""

    def __init__(self, listener: socket.socket, backend: Path) -> None:
        self._listener = listener
        self._backend = str(backend)
        self._callers: dict[str, Caller] = {}
        self._lock = threading.Condition()
        self._open = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpusnapd-front", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def caller(self, peer: str) -> Caller:
        with self._lock:
            found = self._callers.get(peer)
        if found is None:
            raise UnknownCaller(peer)
        return found

    def connections(self) -> int:
        """Connections open now (both of their sockets not yet closed)."""
        with self._lock:
            return self._open

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until every connection's sockets are closed (True), or ``timeout`` seconds."""
        with self._lock:
            return self._lock.wait_for(lambda: self._open == 0, timeout)

    def stop_accepting(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop_accepting(), self._loop).result()

    def close(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close_all(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()

    # --- the loop's side --------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._started.set()
        self._loop.run_forever()

    async def _serve(self) -> None:
        self._listener.setblocking(False)
        self._server = await asyncio.start_unix_server(
            self._accepted, sock=self._listener, limit=_BUFFER
        )

    async def _stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _close_all(self) -> None:
        await self._stop_accepting()
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        with self._lock:
            self._open += 1
        peer = ""
        upstream: asyncio.StreamWriter | None = None
        try:
            sock = writer.get_extra_info("socket")
            caller = peer_credentials(sock)
            name = f"gpusnapd-{secrets.token_hex(16)}"
            back = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                back.bind(b"\0" + name.encode())
                back.setblocking(False)
                await self._loop.sock_connect(back, self._backend)
            except OSError:
                back.close()
                raise
            peer = f"unix-abstract:{name}"
            with self._lock:
                self._callers[peer] = caller  # before gRPC can see a byte of this connection
            up_reader, upstream = await asyncio.open_unix_connection(sock=back, limit=_BUFFER)
            await asyncio.gather(_pump(reader, upstream), _pump(up_reader, writer))
        except (OSError, asyncio.CancelledError) as exc:
            if not isinstance(exc, asyncio.CancelledError):
                log.info("API connection ended: %s", exc)
        finally:
            with self._lock:
                self._callers.pop(peer, None)  # before the address can be freed
            for w in (upstream, writer):
                if w is not None:
                    w.close()
                    with contextlib.suppress(OSError, asyncio.CancelledError):
                        await w.wait_closed()
            self._conns.discard(task)
            with self._lock:
                self._open -= 1
                self._lock.notify_all()


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copy ``src`` to ``dst`` until end of file, then half-close ``dst``."""
    try:
        while data := await src.read(_BUFFER):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except OSError:
        dst.close()  # one side reset: end the other side too, so its pump ends
