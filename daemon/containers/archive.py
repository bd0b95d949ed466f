"""Tar streams between a runtime and a parts directory.

Runtimes export a checkpoint as one tar archive (podman ``--export``, containerd's ``ctr image
export``). gpusnap wants the files, not the archive: ``TarReceiver`` hands the runtime a FIFO to
write its archive into and unpacks it as it arrives, so the checkpoint is written to disk once,
as parts, instead of once as an archive and again as its unpacked files. ``pack`` goes the other
way for a restore (a real file: podman reads an import archive more than once).

The stream is read straight from the pipe: headers parsed by ``tarfile``, file data moved into
place by ``os.splice`` (``unpack_stream``). Only directories and regular files are accepted
from an archive, each inside the destination (``tarfile``'s data filter on top): what a
runtime exports is ours to store, and what comes back from the store is authenticated, but a
parts directory never holds a link or a device.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import tarfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

from gpusnap.errors import Corrupt, Internal

log = logging.getLogger(__name__)

_BUF = 1 << 20


def _files_only(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    if not (member.isfile() or member.isdir()):
        raise tarfile.FilterError(f"{member.name}: not a regular file or directory")
    out = tarfile.data_filter(member, dest)
    if out is not None and out.isdir():
        out = out.replace(mode=0o700, deep=False)  # podman exports checkpoint/ as 0600
    return out


class Arrivals:
    """The files of a checkpoint as they arrive in its directory, in order: written by a
    ``TarReceiver`` on its thread, read by whoever uploads them meanwhile on another. A file is
    complete once a later one has started, or once the runtime's call is over (``done``)."""

    def __init__(self) -> None:
        self._files: list[tuple[str, int]] = []  # (relative path, size from the tar header)
        self._lock = threading.Lock()
        self.done = threading.Event()

    def started(self, rel: str, size: int) -> None:
        with self._lock:
            self._files.append((rel, size))

    def files(self) -> list[tuple[str, int]]:
        with self._lock:
            return list(self._files)

    def complete(self, rel: str) -> bool:
        if self.done.is_set():
            return True
        with self._lock:
            return bool(self._files) and self._files[-1][0] != rel


class TarReceiver:
    """A FIFO at ``fifo`` whose tar stream is unpacked into ``dest`` while it is written.

    ``arrivals`` hears of each file as it starts to arrive (an upload can follow it). Use as a
    context manager around the runtime call that writes to ``fifo``; ``close()``
    (or leaving the block) waits for the unpacking and raises what went wrong in it. When the
    runtime failed before opening the FIFO, leaving the block unblocks the reader.
    """

    def __init__(self, fifo: Path, dest: Path, arrivals: Arrivals | None = None) -> None:
        self.fifo = fifo
        self.dest = dest
        self.arrivals = arrivals
        self.members = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._receive, name="gpusnap-untar", daemon=True)

    def __enter__(self) -> TarReceiver:
        self.dest.mkdir(parents=True, exist_ok=True)
        os.mkfifo(self.fifo, 0o600)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(failed=exc is not None)

    def _receive(self) -> None:
        try:
            fd = os.open(self.fifo, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _widen(fd)
                on_file = self.arrivals.started if self.arrivals is not None else None
                self.members = unpack_stream(fd, self.dest, on_file=on_file)
                # Drain what follows the archive's end so the writer never blocks on a full pipe.
                while os.read(fd, _BUF):
                    pass
            finally:
                os.close(fd)
        except BaseException as exc:
            self._error = exc
        finally:
            if self.arrivals is not None:
                self.arrivals.done.set()

    def close(self, *, failed: bool = False) -> None:
        # Once the runtime has returned it has closed its end, so one more writer opening and
        # closing at once adds no data and only ends a reader still waiting in open() (the
        # runtime failed before opening the FIFO). Repeated: the reader may not be there yet.
        deadline = time.monotonic() + 60
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._unblock()
            self._thread.join(timeout=0.2)
        with contextlib.suppress(FileNotFoundError):
            self.fifo.unlink()
        if self._thread.is_alive() and not failed:
            raise Internal("unpacking the checkpoint archive did not finish in 60 s")
        if failed:
            return  # the caller raises its own error; ours would only be its consequence
        if self._error is not None:
            if isinstance(self._error, tarfile.FilterError):
                raise Corrupt(f"checkpoint archive: {self._error}") from self._error
            raise Internal(f"unpacking the checkpoint archive: {self._error}") from self._error
        if self.members == 0:
            raise Internal("the runtime wrote an empty checkpoint archive")

    def _unblock(self) -> None:
        # The reader may sit in open(): a writer that opens and closes at once gives it EOF.
        try:
            fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno not in (errno.ENXIO, errno.ENOENT):
                raise
            return
        os.close(fd)


def _widen(fd: int) -> None:
    """The largest pipe buffer this host allows on the FIFO ``fd``: with the default 64 KiB
    the writer blocks, and both sides switch, every 64 KiB of a checkpoint."""
    try:
        limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, min(limit, 16 * _BUF))
    except (OSError, ValueError):
        pass  # the default buffer: slower, not wrong


# --- a tar stream unpacked from a pipe, file data spliced -------------------------------------

_BLOCK = 512
# A PAX or GNU long-name header's payload at most (a path and a size are all that is read).
_MAX_META = 1 << 20
# What creating a member's file or directory fails with when the archive's names clash.
_CLASHES = (errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP)


def unpack_stream(fd: int, dest: Path, *, on_file: Callable[[str, int], None] | None = None) -> int:
    """Unpack the tar stream read from the pipe ``fd`` into ``dest``; the number of members.

    Headers are parsed by ``tarfile`` (``TarInfo.frombuf``, PAX and GNU long names applied),
    every member passes ``_files_only`` (regular files and directories inside ``dest``), and
    each file's data is moved from the pipe into the file by ``os.splice``, in the kernel:
    a checkpoint is mostly a few large page images, and a copy through this process would be
    most of the unpacking's cost. ``on_file(path, size)`` is called once each file exists,
    before its data is written. A bad header or a truncated stream is ``Corrupt``."""
    members = 0
    pending: dict[str, str] = {}
    root = str(dest)
    while True:
        header = _read_exact(fd, _BLOCK)
        if len(header) < _BLOCK or header == bytes(_BLOCK):
            if header.strip(b"\0"):
                raise Corrupt("checkpoint archive: truncated in a header")
            return members  # the end blocks (or the end of the stream)
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            raise Corrupt(f"checkpoint archive: bad header ({exc})") from exc
        if info.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME):
            if info.size > _MAX_META:
                raise Corrupt(f"checkpoint archive: an extended header of {info.size} bytes")
            payload = _read_exact(fd, info.size)
            _read_exact(fd, -info.size % _BLOCK)
            if info.type == tarfile.XHDTYPE:
                pending.update(_pax_records(payload))
            elif info.type == tarfile.GNUTYPE_LONGNAME:
                pending["path"] = payload.rstrip(b"\0").decode("utf-8", "surrogateescape")
            continue
        if "path" in pending:
            info.name = pending["path"]
        if "size" in pending:
            size = pending["size"]
            if not (size.isascii() and size.isdigit() and len(size) <= 20):
                raise Corrupt("checkpoint archive: bad size in a PAX header")
            info.size = int(size)
        pending = {}
        try:
            member = _files_only(info, root)
        except (tarfile.FilterError, ValueError) as exc:  # ValueError: a NUL in a PAX path
            raise Corrupt(f"checkpoint archive: {exc}") from exc
        if member is None:
            continue
        target = dest / member.name
        try:
            if member.isdir():
                target.mkdir(mode=0o700, parents=True, exist_ok=True)
            else:
                target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                out = os.open(
                    target,
                    os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                    (member.mode or 0o600) & 0o700 or 0o600,
                )
        except OSError as exc:
            if exc.errno not in _CLASHES:
                raise
            # A name the archive's own members make impossible (a file where it has a
            # directory, or the reverse), or one too long: not an archive a runtime writes.
            raise Corrupt(
                f"checkpoint archive: cannot make {member.name[:200]!r} ({exc.strerror})"
            ) from exc
        if not member.isdir():
            _receive_file(fd, out, member, on_file)
        members += 1


def _receive_file(
    fd: int,
    out: int,
    member: tarfile.TarInfo,
    on_file: Callable[[str, int], None] | None,
) -> None:
    """Move ``member``'s data from the pipe ``fd`` into the file open at ``out`` (closed)."""
    try:
        if on_file is not None:
            on_file(os.path.normpath(member.name), member.size)
        left = member.size
        while left:
            try:
                n = os.splice(fd, out, min(left, _BUF))
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                n = os.write(out, os.read(fd, min(left, _BUF)))  # no splice to this file system
            if n == 0:
                raise Corrupt(f"checkpoint archive: truncated in {member.name}")
            left -= n
    finally:
        os.close(out)
    _read_exact(fd, -member.size % _BLOCK)


def _read_exact(fd: int, n: int) -> bytes:
    """``n`` bytes from ``fd``, or fewer at the end of the stream."""
    parts: list[bytes] = []
    while n > 0:
        data = os.read(fd, min(n, _BUF))  # what a header claims is not allocated up front
        if not data:
            break
        parts.append(data)
        n -= len(data)
    return b"".join(parts)


def _pax_records(payload: bytes) -> dict[str, str]:
    """The ``path`` and ``size`` of a PAX extended header ("LEN key=value\\n" records)."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(payload):
        space = payload.find(b" ", pos)
        if space < 0:
            break
        try:
            length = int(payload[pos:space])
        except ValueError as exc:
            raise Corrupt("checkpoint archive: bad PAX header") from exc
        key, _, value = payload[space + 1 : pos + length - 1].partition(b"=")
        if key in (b"path", b"size"):
            out[key.decode()] = value.decode("utf-8", "surrogateescape")
        if length <= 0:
            raise Corrupt("checkpoint archive: bad PAX header")
        pos += length
    return out


def pack(directory: Path, names: Iterable[str], out: Path) -> int:
    """An uncompressed tar at ``out`` of ``names`` (relative paths in ``directory``), in order;
    returns its size. Owners are root and times are the files' own, as a runtime exports them."""
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs_done: set[str] = set()
        for rel in names:
            parts = rel.split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in dirs_done:
                    dirs_done.add(d)
                    tar.add(directory / d, arcname=d, recursive=False, filter=_root_owned)
            tar.add(directory / rel, arcname=rel, recursive=False, filter=_root_owned)
    os.replace(tmp, out)
    return out.stat().st_size


def _root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info
