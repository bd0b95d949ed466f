"""The journal streams of a process tree: its stdout/stderr when systemd connects them to journald.

A unit's ``StandardOutput=journal`` (systemd's default) is an ``AF_UNIX`` stream socket whose
peer is journald's end of ``/run/systemd/journal/stdout``. CRIU cannot dump one half of a stream
connection ("Can't dump half of stream unix connection"), unless it is named as external
(``--external unix[INO]``); a restore must then hand the tree a socket for it
(``--inherit-fd fd[N]:socket:[INO]``). ``of_tree`` names them at dump time (``dump_args``);
``Replacements`` makes the new streams at restore time, each with the header journald's stream
protocol starts with (identifier, unit, priority, level prefix, no forwarding).

Where the restored lines land: journald attributes each line to the process that wrote it (the
kernel passes the writer's credentials with every message; systemd 252 reads them), so they
carry the restored process's ``_PID`` and, once journald refreshes what it knows of that pid,
the ``_SYSTEMD_UNIT`` of the scope the tree now lives in (``gpusnap-<workload>-<job>.scope``).
The unit named in the header is only journald's fallback for a writer whose cgroup it cannot
read. Where no journald listens (a checkpoint from a systemd node restored on one without),
the stream is replaced by ``/dev/null``: writes succeed and are dropped, never ``EPIPE``, which
would kill or break a workload that prints.

The peers come from the kernel's ``sock_diag`` netlink interface (``UNIX_DIAG_PEER``); no
other tool is needed.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpusnap.errors import InvalidArgument

log = logging.getLogger(__name__)

JOURNAL_STDOUT = "/run/systemd/journal/stdout"
# A header line journald accepts: no control characters (a NUL or a newline would end the
# negotiation early and journald would drop the stream), and short.
_MAX_NAME = 256

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_DONE, _NLMSG_ERROR = 3, 2
_UDIAG_SHOW_NAME, _UDIAG_SHOW_PEER = 0x1, 0x4
_UNIX_DIAG_NAME, _UNIX_DIAG_PEER = 0, 2
_ALL_STATES = 0xFFFFFFFF


@dataclass(frozen=True)
class JournalStream:
    """One socket of the tree connected to journald's stdout socket."""

    ino: int
    identifier: str  # the process's name, as journald shows it (SYSLOG_IDENTIFIER)
    unit: str  # the unit the process ran in at dump time ("" when none)

    def as_json(self) -> dict[str, object]:
        return {"ino": self.ino, "identifier": self.identifier, "unit": self.unit}

    @classmethod
    def from_json(cls, entry: object, where: Path) -> JournalStream:
        """One recorded stream, from images that may come from a store: checked, since its
        names go into journald's stream header."""
        if not (
            isinstance(entry, dict)
            and set(entry) == {"ino", "identifier", "unit"}
            and isinstance(entry["ino"], int)
            and not isinstance(entry["ino"], bool)
            and entry["ino"] > 0
            and all(_header_safe(entry[k]) for k in ("identifier", "unit"))
        ):
            raise InvalidArgument(f"bad journal stream in {where}: {entry!r}")
        return cls(entry["ino"], entry["identifier"], entry["unit"])


def _header_safe(value: object) -> bool:
    return (
        isinstance(value, str) and len(value) <= _MAX_NAME and all(ch.isprintable() for ch in value)
    )


def unix_sockets() -> dict[int, tuple[int, str, int]]:
    """Every unix socket of this network namespace: inode -> (type, bound name, peer inode)."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
        # unix_diag_req: family, protocol, pad, states, ino, show, cookie[2]
        req = struct.pack(
            "=BBHIIIII",
            socket.AF_UNIX,
            0,
            0,
            _ALL_STATES,
            0,
            _UDIAG_SHOW_NAME | _UDIAG_SHOW_PEER,
            0xFFFFFFFF,
            0xFFFFFFFF,
        )
        header = struct.pack(
            "=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0
        )
        nl.sendall(header + req)
        out: dict[int, tuple[int, str, int]] = {}
        while True:
            data = nl.recv(1 << 20)
            offset = 0
            while offset + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if kind == _NLMSG_DONE:
                    return out
                if kind == _NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", data, offset + 16)
                    raise OSError(-err, f"sock_diag: {os.strerror(-err)}")
                _, sk_type, _, _, ino = struct.unpack_from("=BBBBI", data, offset + 16)
                name, peer = "", 0
                attr = offset + 16 + 16  # unix_diag_msg is 16 bytes
                while attr + 4 <= offset + length:
                    alen, atype = struct.unpack_from("=HH", data, attr)
                    body = data[attr + 4 : attr + alen]
                    if atype == _UNIX_DIAG_NAME:
                        name = body.rstrip(b"\0").decode(errors="replace")
                    elif atype == _UNIX_DIAG_PEER:
                        (peer,) = struct.unpack("=I", body[:4])
                    attr += (alen + 3) & ~3
                out[ino] = (sk_type, name, peer)
                offset += (length + 3) & ~3


def find(pids: Sequence[int], listener: str | None = None) -> list[JournalStream]:
    """The sockets the processes ``pids`` hold that are stream connections to ``listener``
    (default ``JOURNAL_STDOUT``). The accepted end of a connection carries the name of the
    socket it was accepted on, which is how journald's end is told from any other."""
    listener = listener or JOURNAL_STDOUT
    held: dict[int, int] = {}  # socket inode -> a pid holding it
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                held.setdefault(int(target[8:-1]), pid)
    if not held:
        return []
    sockets = unix_sockets()
    found = []
    for ino, pid in sorted(held.items()):
        sk_type, _, peer = sockets.get(ino, (0, "", 0))
        if sk_type != socket.SOCK_STREAM or not peer or peer in held:
            continue  # not a stream, not connected, or a pair inside the tree
        if sockets.get(peer, (0, "", 0))[1] == listener:
            found.append(JournalStream(ino, _comm(pid), _unit(pid)))
    return found


def of_tree(pids: Sequence[int]) -> list[JournalStream]:
    """``find`` for a tree about to be dumped; an empty list (and a warning) when the kernel
    will not say: the dump may still work, and CRIU says why if not."""
    try:
        return find(pids)
    except OSError as exc:
        log.warning("cannot list the journal streams of pid %d: %s", pids[0], exc)
        return []


def dump_args(streams: Sequence[JournalStream]) -> list[str]:
    """CRIU's dump options naming each stream as external."""
    return [arg for s in streams for arg in ("--external", f"unix[{s.ino}]")]


class Replacements:
    """The new streams of a restore, open while CRIU runs: ``args`` for CRIU's command line,
    ``fds`` for it to inherit. A context manager: they are closed (our copies) at exit."""

    def __init__(self, streams: Sequence[JournalStream], listener: str | None = None) -> None:
        self.fds: tuple[int, ...] = ()
        self.args: list[str] = []
        fds = []
        try:
            for stream in streams:
                fd = connect(stream, listener)
                fds.append(fd)
                self.args += ["--inherit-fd", f"fd[{fd}]:socket:[{stream.ino}]"]
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self.fds = tuple(fds)

    def __enter__(self) -> Replacements:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = ()


def connect(stream: JournalStream, listener: str | None = None) -> int:
    """A descriptor for a new journal stream for ``stream`` (its header sent), or, with no
    journald listening, one of ``/dev/null``. Inheritable only where passed on explicitly."""
    listener = listener or JOURNAL_STDOUT
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(listener)
        sock.shutdown(socket.SHUT_RD)
        # identifier, unit id (journald takes it from root, as a fallback), priority (info),
        # level prefix ("<3>" lines set their own), no forwarding to syslog, kmsg, console:
        # what systemd itself sends for StandardOutput=journal.
        header = f"{stream.identifier}\n{stream.unit}\n6\n1\n0\n0\n0\n"
        sock.sendall(header.encode())
    except OSError as exc:
        sock.close()
        log.warning(
            "no journal at %s (%s): the restored tree's output on that stream is dropped",
            listener,
            exc,
        )
        return os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    return sock.detach()


def _comm(pid: int) -> str:
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gpusnap-restored"
    return name if _header_safe(name) and name else "gpusnap-restored"


def _unit(pid: int) -> str:
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("0::"):
            last = line[3:].rsplit("/", 1)[-1]
            if last.endswith((".service", ".scope")) and _header_safe(last):
                return last
    return ""
