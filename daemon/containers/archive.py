"""Tar streams between a runtime and a parts directory.

Runtimes export a checkpoint as one tar archive (podman ``--export``, containerd's ``ctr image
export``). gpusnap wants the files, not the archive: ``TarReceiver`` hands the runtime a FIFO to
write its archive into and unpacks it as it arrives, so the checkpoint is written to disk once,
as parts, instead of once as an archive and again as its unpacked files. ``pack`` goes the other
way for a restore (a real file: podman reads an import archive more than once).

Only directories and regular files are accepted from an archive, each inside the destination
(``tarfile``'s data filter on top): what a runtime exports is ours to store, and what comes
back from the store is authenticated, but a parts directory never holds a link or a device.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import tarfile
import threading
import time
from collections.abc import Iterable
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
            # Large reads and copies: a checkpoint is mostly a few big page images, and
            # tarfile's 10 KiB records and 16 KiB copies would make most of its cost calls.
            with (
                open(self.fifo, "rb", buffering=_BUF) as f,
                tarfile.open(fileobj=f, mode="r|", bufsize=_BUF) as tar,
            ):
                tar.copybufsize = _BUF  # type: ignore[attr-defined]  # (CPython's; not in typeshed)
                for member in tar:
                    if self.arrivals is not None and member.isfile():
                        self.arrivals.started(os.path.normpath(member.name), member.size)
                    tar.extract(member, self.dest, filter=_files_only)
                    self.members += 1
                # Drain what follows the archive's end so the writer never blocks on a full pipe.
                while f.read(1 << 20):
                    pass
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
