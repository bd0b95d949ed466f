"""``host/preflight.py`` on real processes, for what the daemon-driven tests do not reach: a CRIU
too old for this kernel, a dump that carries connections, datagram peers, a ring mapped after
its fd was closed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.host import preflight
from gpusnap.daemon.host.criu import TcpSupport

OLD_CRIU = TcpSupport(False, "criu 4.1.1 cannot dump TCP sockets on this kernel (criu#2705)")
NEW_CRIU = TcpSupport(True, "criu 4.2.1 >= 4.2 dumps TCP sockets on any kernel")

_SETUP = {
    "listen": "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); keep.append(s)",
    "connect": "keep.append(socket.create_connection(('127.0.0.1', int(sys.argv[2]))))",
    "dgram": (
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.connect(sys.argv[2]);"
        " keep.append(s)"
    ),
    # libc's mmap: Python's mmap object keeps a dup of the fd.
    "ring": (
        "import ctypes; libc = ctypes.CDLL(None); libc.mmap.restype = ctypes.c_void_p;"
        " fd = libc.syscall(425, 8, (ctypes.c_char * 120)());"
        " assert libc.mmap(None, 4096, 1, 1, fd, 0) not in (None, 2**64 - 1); os.close(fd)"
    ),
}


@pytest.fixture
def spawn() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        p.kill()
        p.communicate()


def _start(procs: list[subprocess.Popen[str]], what: str, arg: str = "", **kw: object) -> int:
    code = (
        f"import os, socket, sys, time\nkeep = []\n{_SETUP[what]}\n"
        "print('ready', flush=True)\ntime.sleep(600)\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code, what, arg],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kw,  # type: ignore[call-overload]
    )
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    pid: int = p.pid
    return pid


def test_a_tcp_listener_blocks_only_a_criu_that_cannot_dump_tcp_here(
    spawn: list[subprocess.Popen[str]],
) -> None:
    pid = _start(spawn, "listen")
    old = preflight.check_tree([pid], tcp=OLD_CRIU)
    (blocker,) = old.blockers
    assert blocker.kind == "criu" and blocker.pid == pid
    assert "criu#2705" in blocker.detail and "TCP listener on 127.0.0.1:" in blocker.detail
    assert "install-criu.sh" in blocker.fix
    assert old.refusal().startswith(f"cannot checkpoint now: pid {pid}: criu 4.1.1")
    new = preflight.check_tree([pid], tcp=NEW_CRIU)
    assert new.checkpointable
    assert [n.kind for n in new.notes] == ["tcp"]
    # No usable CRIU at all: said the same way.
    assert [b.kind for b in preflight.check_tree([pid], tcp=None).blockers] == ["criu"]


def test_a_connection_is_a_note_closed_or_carried_by_the_dump(
    spawn: list[subprocess.Popen[str]],
) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        pid = _start(spawn, "connect", str(server.getsockname()[1]))
        conn, _ = server.accept()
        with conn:
            closed = preflight.check_tree([pid], tcp=NEW_CRIU)
            assert closed.checkpointable
            (note,) = closed.notes
            assert note.kind == "tcp" and "dumped with --tcp-close" in note.detail
            carried = preflight.check_tree([pid], tcp=NEW_CRIU, tcp_established=True)
            assert carried.checkpointable
            (note,) = carried.notes
            assert note.kind == "tcp" and "dumped with --tcp-established" in note.detail


def test_a_datagram_socket_to_a_named_peer_outside_is_fine_to_a_nameless_one_not(
    spawn: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as named:
        named.bind(str(tmp_path / "log.sock"))
        pid = _start(spawn, "dgram", str(tmp_path / "log.sock"))
        assert preflight.check_tree([pid], tcp=NEW_CRIU).to_json() == {
            "checkpointable": True,
            "blockers": [],
            "notes": [],
        }
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with ours:
        code = "import time; print('ready', flush=True); time.sleep(600)"
        p = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            text=True,
            pass_fds=(theirs.fileno(),),
            start_new_session=True,
        )
        spawn.append(p)
        theirs.close()
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        report = preflight.check_tree([p.pid], tcp=NEW_CRIU)
        (blocker,) = report.blockers
        assert blocker.kind == "unix" and "datagram" in blocker.detail
        assert f"held by pid {os.getpid()}" in blocker.detail and "nameless" in blocker.detail


def test_a_ring_mapped_after_its_fd_was_closed_still_blocks(
    spawn: list[subprocess.Popen[str]],
) -> None:
    pid = _start(spawn, "ring")
    (blocker,) = preflight.check_tree([pid], tcp=NEW_CRIU).blockers
    assert blocker.kind == "io_uring" and "maps an io_uring ring" in blocker.detail
