"""Preflight: every reason a process tree cannot be checkpointed *now*, before anything is frozen.

Read from /proc (and the kernel's ``sock_diag`` for unix socket peers), nothing is stopped or
changed. Each finding names the process, what was found and, for a blocker, the fix:

- ``io_uring``: a process holds or maps an io_uring (CRIU: "Unknown shit 600
  (anon_inode:[io_uring])");
- ``ptrace``: a process or one of its threads is traced (CRIU must seize every task itself:
  "Unseizable non-zombie");
- ``criu``: the tree holds a TCP socket and this CRIU cannot dump TCP sockets here (CRIU < 4.2
  on Linux >= 6.16, criu#2705);
- ``unix``: a unix stream socket's peer, or a nameless datagram peer, is outside the tree
  (CRIU: "Can't dump half of stream unix connection", "Can't dump name-less external socket").

Notes, which do not stop a checkpoint: TCP listeners (the restore needs their ports free), TCP
connections (a dump with ``--tcp-established`` carries them; otherwise ``--tcp-close`` restores
them closed, and their clients see the connection end), tmpfs files (``/dev/shm``) the tree
holds open or maps (not in CRIU's images: saved beside them, ``host/tmpfsfiles.py``), and file
locks (dumped with ``--file-locks``, taken again at restore). A journal stream
(``host/journalstream.py``) and a datagram socket sending to a named socket outside the tree
(``/dev/log``) are handled by the dump and not reported.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gpusnap.daemon.host import journalstream
from gpusnap.daemon.host.criu import Criu, TcpSupport
from gpusnap.errors import FailedPrecondition, GpusnapError

log = logging.getLogger(__name__)

T = TypeVar("T")

IO_URING = "anon_inode:[io_uring]"
IO_URING_FIX = (
    "run it under `gpusnap exec -- COMMAND` (io_uring off through seccomp, inherited by every "
    "child), or in a podman container with `--security-opt seccomp=PROFILE` that blocks "
    "io_uring_setup (podman's default profile does)"
)
PTRACE_FIX = "detach the tracer (a debugger, strace, a profiler) before the checkpoint"
CRIU_FIX = "run scripts/install-criu.sh (CRIU >= 4.2)"
UNIX_FIX = (
    "keep both ends in the tree (start the peer as a child of the workload) or close the "
    "connection before the checkpoint: CRIU dumps a unix connection only whole"
)

# /proc/net/tcp states (include/net/tcp_states.h).
_TCP_STATES = {
    1: "ESTABLISHED",
    2: "SYN_SENT",
    3: "SYN_RECV",
    4: "FIN_WAIT1",
    5: "FIN_WAIT2",
    6: "TIME_WAIT",
    7: "CLOSE",
    8: "CLOSE_WAIT",
    9: "LAST_ACK",
    10: "LISTEN",
    11: "CLOSING",
}
_TCP_CLOSE, _TCP_LISTEN = 7, 10
_UNIX_TYPES = {socket.SOCK_STREAM: "stream", socket.SOCK_DGRAM: "datagram", 5: "seqpacket"}


@dataclass(frozen=True)
class Finding:
    """One thing found: a blocker (with its fix) or a note (``fix`` empty)."""

    kind: str
    pid: int
    detail: str
    fix: str = ""

    def line(self) -> str:
        """The one-line message a refused checkpoint fails with."""
        return f"pid {self.pid}: {self.detail}; fix: {self.fix}"


@dataclass(frozen=True)
class Report:
    blockers: list[Finding] = field(default_factory=list)
    notes: list[Finding] = field(default_factory=list)

    @property
    def checkpointable(self) -> bool:
        return not self.blockers

    def to_json(self) -> dict[str, Any]:
        """``{"checkpointable", "blockers": [{kind, pid, detail, fix}], "notes": [{kind, pid,
        detail}]}``: the ``gpusnap preflight --json`` document."""
        return {
            "checkpointable": self.checkpointable,
            "blockers": [
                {"kind": b.kind, "pid": b.pid, "detail": b.detail, "fix": b.fix}
                for b in self.blockers
            ],
            "notes": [{"kind": n.kind, "pid": n.pid, "detail": n.detail} for n in self.notes],
        }

    def refusal(self) -> str:
        """Why a checkpoint job is refused: the first blocker, in one line."""
        first = self.blockers[0]
        more = len(self.blockers) - 1
        tail = f" (and {more} more: see `gpusnap preflight`)" if more else ""
        return f"cannot checkpoint now: {first.line()}{tail}"


@dataclass
class _Proc:
    """What one process of the tree holds, read once."""

    pid: int
    fds: list[tuple[int, str]]  # (fd, readlink target)
    maps: list[tuple[str, str]]  # (address range, path) of file-backed mappings
    tracers: list[tuple[int, int]]  # (task id, tracer pid) of traced tasks

    def sockets(self) -> list[int]:
        return [int(t[8:-1]) for _, t in self.fds if t.startswith("socket:[")]


def check_tree(
    pids: Sequence[int],
    *,
    tcp: TcpSupport | None,
    tcp_established: bool = False,
    tmpfs: bool = True,
) -> Report:
    """Every reason the tree ``pids`` (root first) cannot be checkpointed now, and the notes.

    ``tcp``: whether the CRIU that will dump it can dump TCP sockets here (None: no usable
    CRIU, said as a blocker). ``tcp_established``: the dump carries live connections.
    ``tmpfs``: report tmpfs files (not for a container, whose runtime dumps its mounts whole).
    """
    procs = [p for p in (_read_proc(pid) for pid in pids) if p is not None]
    report = Report()
    _io_uring(procs, report)
    _ptrace(procs, report)
    _tcp(procs, report, tcp, tcp_established)
    _unix(procs, report)
    if tmpfs:
        _tmpfs(procs, report)
    _locks(procs, report)
    return report


def check_for(
    criu: Criu, pids: Sequence[int], *, tcp_established: bool = False, tmpfs: bool = True
) -> Report:
    """``check_tree`` for a dump by ``criu`` (what it can do on this kernel; none usable is a
    blocker where the tree has TCP sockets, and the dump would fail anyway)."""
    try:
        tcp: TcpSupport | None = criu.tcp_support()
    except GpusnapError as err:
        log.warning("preflight: %s", err)
        tcp = None
    return check_tree(pids, tcp=tcp, tcp_established=tcp_established, tmpfs=tmpfs)


def require(
    criu: Criu, pids: Sequence[int], *, tcp_established: bool = False, tmpfs: bool = True
) -> Report:
    """What a checkpoint job runs before anything is frozen: the report, or FailedPrecondition
    with the first blocker's line (the workload untouched). ``tcp_established``: the dump
    will carry live TCP connections (then a note each, not a blocker)."""
    report = check_for(criu, pids, tcp_established=tcp_established, tmpfs=tmpfs)
    if not report.checkpointable:
        raise FailedPrecondition(report.refusal())
    return report


# --- reading /proc ---------------------------------------------------------------------------


def _read_proc(pid: int) -> _Proc | None:
    """The process's fds, file mappings and traced tasks; None when it is gone."""
    base = f"/proc/{pid}"
    try:
        fds: list[tuple[int, str]] = []
        for name in os.listdir(f"{base}/fd"):
            try:
                fds.append((int(name), os.readlink(f"{base}/fd/{name}")))
            except OSError:
                continue  # closed meanwhile
        maps: list[tuple[str, str]] = []
        with open(f"{base}/maps", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                parts = line.rstrip("\n").split(maxsplit=5)
                if len(parts) == 6 and not parts[5].startswith("["):
                    maps.append((parts[0], parts[5]))
        tracers: list[tuple[int, int]] = []
        for tid in os.listdir(f"{base}/task"):
            tracer = _tracer(f"{base}/task/{tid}/status")
            if tracer:
                tracers.append((int(tid), tracer))
    except (FileNotFoundError, ProcessLookupError):
        return None
    return _Proc(pid, sorted(fds), maps, tracers)


def _tracer(status_path: str) -> int:
    try:
        with open(status_path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _by_namespace(
    procs: Iterable[_Proc], ns: str, read: Callable[[int], T]
) -> Iterator[tuple[_Proc, T]]:
    """Each process with what ``read(pid)`` says of its namespace ``ns`` ("net", "mnt"), read
    once per namespace (the same object for every process in it)."""
    seen: dict[str, T] = {}
    for p in procs:
        try:
            key = os.readlink(f"/proc/{p.pid}/ns/{ns}")
        except OSError:
            continue  # gone
        if key not in seen:
            seen[key] = read(p.pid)
        yield p, seen[key]


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return "?"


# --- the checks --------------------------------------------------------------------------------


def _io_uring(procs: Iterable[_Proc], report: Report) -> None:
    for p in procs:
        fds = [fd for fd, target in p.fds if target == IO_URING]
        mapped = any(path == IO_URING for _, path in p.maps)
        if fds:
            what = ", ".join(str(fd) for fd in fds)
            detail = f"{_comm(p.pid)} holds an io_uring (fd {what}), which CRIU cannot dump"
        elif mapped:
            detail = f"{_comm(p.pid)} maps an io_uring ring, which CRIU cannot dump"
        else:
            continue
        report.blockers.append(Finding("io_uring", p.pid, detail, IO_URING_FIX))


def _ptrace(procs: Iterable[_Proc], report: Report) -> None:
    for p in procs:
        for tid, tracer in p.tracers:
            who = f"{_comm(p.pid)}" + (f" (thread {tid})" if tid != p.pid else "")
            detail = (
                f"{who} is traced by pid {tracer} ({_comm(tracer)}): CRIU cannot seize a "
                "traced process"
            )
            report.blockers.append(Finding("ptrace", p.pid, detail, PTRACE_FIX))
            break  # one per process: the fix is the same for every thread


@dataclass(frozen=True)
class _TcpSocket:
    state: int
    local: str
    remote: str


def _tcp(
    procs: Sequence[_Proc], report: Report, tcp: TcpSupport | None, tcp_established: bool
) -> None:
    found: list[tuple[int, _TcpSocket]] = []
    holders = [p for p in procs if p.sockets()]
    for p, table in _by_namespace(holders, "net", _tcp_table):
        # A socket shared after a fork is the first holder's (the tree comes root first).
        found += [(p.pid, table.pop(i)) for i in p.sockets() if i in table]
    if not found:
        return
    if tcp is None or not tcp.ok:
        pid, first = found[0]
        why = tcp.why if tcp is not None else "no usable CRIU"
        detail = f"{why}; the tree holds {len(found)} TCP socket(s) ({_describe(first)})"
        report.blockers.append(Finding("criu", pid, detail, CRIU_FIX))
    listening: dict[int, list[str]] = {}
    for pid, sk in found:
        if sk.state == _TCP_LISTEN:
            listening.setdefault(pid, []).append(sk.local)
        elif sk.state != _TCP_CLOSE:
            if tcp_established:
                detail = (
                    f"{_describe(sk)}: dumped with --tcp-established; it lives on only where "
                    "the restore has the same addresses (this node)"
                )
                report.notes.append(Finding("tcp", pid, detail))
            else:
                detail = (
                    f"{_describe(sk)}: dumped with --tcp-close; it comes back closed (the "
                    "client sees the connection end and reconnects)"
                )
                report.notes.append(Finding("tcp", pid, detail))
    for pid, ports in listening.items():
        where = ", ".join(sorted(set(ports)))
        detail = f"listening on {where} (TCP): a restore needs the port(s) free"
        report.notes.append(Finding("tcp", pid, detail))


def _describe(sk: _TcpSocket) -> str:
    state = _TCP_STATES.get(sk.state, str(sk.state))
    if sk.state == _TCP_LISTEN:
        return f"TCP listener on {sk.local}"
    return f"TCP connection {sk.local} -> {sk.remote} ({state})"


def _tcp_table(pid: int) -> dict[int, _TcpSocket]:
    """The TCP sockets of ``pid``'s network namespace: inode -> state and addresses."""
    out: dict[int, _TcpSocket] = {}
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            with open(f"/proc/{pid}/net/{name}", encoding="ascii") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            out[int(fields[9])] = _TcpSocket(
                int(fields[3], 16), _address(fields[1], v6), _address(fields[2], v6)
            )
    return out


def _address(text: str, v6: bool) -> str:
    """``0100007F:1F90`` -> ``127.0.0.1:8080`` (the kernel prints each 32-bit word in host
    order)."""
    host_hex, port_hex = text.split(":")
    raw = b"".join(
        int(host_hex[i : i + 8], 16).to_bytes(4, "little") for i in range(0, len(host_hex), 8)
    )
    port = int(port_hex, 16)
    if v6:
        return f"[{socket.inet_ntop(socket.AF_INET6, raw)}]:{port}"
    return f"{socket.inet_ntop(socket.AF_INET, raw)}:{port}"


def _unix(procs: Sequence[_Proc], report: Report) -> None:
    held: dict[int, int] = {}  # socket inode -> the first pid of the tree holding it
    for p in procs:
        for ino in p.sockets():
            held.setdefault(ino, p.pid)
    if not held:
        return
    try:
        table = journalstream.unix_sockets()  # this network namespace's
    except OSError as exc:
        log.warning("preflight: cannot list unix sockets: %s", exc)
        return
    outside: list[tuple[int, int, int, str, int]] = []  # (pid, ino, type, peer name, peer)
    for ino, pid in held.items():
        sk_type, _, peer = table.get(ino, (0, "", 0))
        if not peer or peer in held:
            continue  # not connected, or both ends in the tree
        peer_name = table.get(peer, (0, "", 0))[1]
        if sk_type == socket.SOCK_DGRAM and peer_name:
            continue  # --ext-unix-sk: sent to a named socket (e.g. /dev/log) again at restore
        if sk_type == socket.SOCK_STREAM and peer_name == journalstream.JOURNAL_STDOUT:
            continue  # a journal stream, named external at dump
        outside.append((pid, ino, sk_type, peer_name, peer))
    if not outside:
        return
    holders = _holders({peer for *_, peer in outside})
    for pid, ino, sk_type, peer_name, peer in sorted(outside):
        kind = _UNIX_TYPES.get(sk_type, str(sk_type))
        where = f" {peer_name}" if peer_name else " a nameless socket"
        holder = holders.get(peer)
        by = f" held by pid {holder} ({_comm(holder)})" if holder else ""
        detail = (
            f"{_comm(pid)}'s unix {kind} socket (inode {ino}) is connected to{where}{by}, "
            "outside the tree"
        )
        report.blockers.append(Finding("unix", pid, detail, UNIX_FIX))


def _holders(inodes: set[int]) -> dict[int, int]:
    """A process holding each of the socket ``inodes`` (any process of the host)."""
    want = {f"socket:[{i}]": i for i in inodes}
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{name}/fd"):
                try:
                    target = os.readlink(f"/proc/{name}/fd/{fd}")
                except OSError:
                    continue
                if target in want:
                    out.setdefault(want[target], int(name))
        except OSError:
            continue
        if len(out) == len(want):
            break
    return out


@dataclass
class _TmpfsFile:
    pid: int
    path: str
    size: int
    allocated: int
    how: set[str]
    deleted: bool


def _tmpfs(procs: Sequence[_Proc], report: Report) -> None:
    files: dict[tuple[int, int], _TmpfsFile] = {}
    for p, points in _by_namespace(procs, "mnt", _tmpfs_mounts):
        if not points:
            continue
        entries = [(f"/proc/{p.pid}/fd/{fd}", t, "open") for fd, t in p.fds]
        entries += [(f"/proc/{p.pid}/map_files/{r}", path, "mapped") for r, path in p.maps]
        for handle, target, how in entries:
            deleted = target.endswith(" (deleted)")
            path = target.removesuffix(" (deleted)")
            if not path.startswith("/") or not any(_under(path, m) for m in points):
                continue
            try:
                st = os.stat(handle)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            key = (st.st_dev, st.st_ino)
            if key not in files:
                files[key] = _TmpfsFile(p.pid, path, st.st_size, st.st_blocks * 512, set(), deleted)
            files[key].how.add(how)
    for f in sorted(files.values(), key=lambda f: (f.pid, f.path)):
        how = " and ".join(sorted(f.how, key=lambda h: h != "open"))
        gone = ", deleted while open" if f.deleted else ""
        detail = (
            f"{f.path} (tmpfs): {_size(f.size)}, {_size(f.allocated)} in memory, {how}{gone}; "
            "saved with the checkpoint while the tree is frozen (host/tmpfsfiles.py)"
        )
        report.notes.append(Finding("tmpfs", f.pid, detail))


def _under(path: str, mount: str) -> bool:
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def _tmpfs_mounts(pid: int) -> list[str]:
    """The tmpfs mount points ``pid`` sees, except ``/`` (a tmpfs root holds everything)."""
    out: list[str] = []
    try:
        with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                if right.split(maxsplit=1)[:1] == ["tmpfs"]:
                    point = _unescape(left.split()[4])
                    if point != "/":
                        out.append(point)
    except OSError:
        pass
    return out


def _unescape(text: str) -> str:
    """mountinfo's octal escapes (``\\040`` for a space)."""
    if "\\" not in text:
        return text
    raw = text.encode("utf-8", "surrogateescape").decode("unicode_escape")
    return raw.encode("latin-1").decode("utf-8", "surrogateescape")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _locks(procs: Sequence[_Proc], report: Report) -> None:
    pids = {p.pid for p in procs}
    try:
        with open("/proc/locks", encoding="ascii") as f:
            lines = f.readlines()
    except OSError:
        return
    files: dict[tuple[int, int], tuple[int, str]] = {}  # (dev, ino) -> (pid, path)
    for p in procs:
        for fd, target in p.fds:
            if target.startswith("/"):
                try:
                    st = os.stat(f"/proc/{p.pid}/fd/{fd}")
                except OSError:
                    continue
                files.setdefault((st.st_dev, st.st_ino), (p.pid, target))
    for line in lines:
        fields = line.split()[1:]
        waiting = fields[:1] == ["->"]
        if waiting:
            fields = fields[1:]
        if len(fields) < 5:
            continue
        kind, _, mode, owner, where = fields[:5]
        major, minor, ino = where.split(":")
        key = (os.makedev(int(major, 16), int(minor, 16)), int(ino))
        holder = int(owner)
        if holder in pids:
            path = files.get(key, (holder, f"inode {ino}"))[1]
        elif holder == -1 and key in files:  # an OFD lock: no owner pid
            holder, path = files[key]
        else:
            continue
        what = "waits for" if waiting else "holds"
        detail = (
            f"{_comm(holder)} {what} a {kind} {mode} lock on {path}: dumped with --file-locks "
            "and taken again at restore"
        )
        report.notes.append(Finding("lock", holder, detail))
