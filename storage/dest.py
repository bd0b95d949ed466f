"""The destination side of a pull: temp files sized as holes, written in place, renamed.

Every file is written to a temporary name beside its target (``TMP_PREFIX``), created at its
full size as a hole (so a zero chunk needs no write at all), and renamed into place only when
every chunk of every file is in; ``Destination.undo`` removes exactly what the pull created.
Nothing a manifest names may land outside the destination (``check_targets``).

Writes, two ways:

- ``direct`` (the default for a pull to keep): each chunk is decompressed and verified in a
  reused page-aligned buffer (``AlignedBuffers``) and its block-aligned interior is written
  with ``O_DIRECT``; the few bytes at each end that share a 4 KiB block with the next chunk go
  through the page cache. A restore of tens of GiB then neither fills the page cache with
  pages nobody reads soon nor waits behind dirty-page throttling, and never touches fresh
  memory per chunk. Filesystems that refuse ``O_DIRECT`` (some FUSE and network filesystems)
  fall back to buffered writes, per file, silently.
- buffered (``direct=False``): for files read back at once (the daemon's restore staging,
  which CRIU reads the moment the pull ends): the page cache is where the reader wants them.

With ``durable`` every file is fsynced before the renames and each directory after them, so
a pull that returned survives a power cut; without it (staging) nothing is synced.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import queue
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpusnap.errors import AlreadyExists, Corrupt, FailedPrecondition, GpusnapError
from gpusnap.storage.chunker import MAX_SIZE
from gpusnap.storage.manifest import FileEntry, Manifest
from gpusnap.storage.parallel import translate_error

TMP_PREFIX = ".gpusnap-pull-"
# O_DIRECT wants offsets, lengths and buffer addresses aligned to the device's logical block
# size: 4 KiB satisfies every common device (512-byte ones included).
ALIGN = 4096
# Interiors shorter than this go through the page cache: not worth a synchronous device write.
_MIN_DIRECT = 64 * 1024
# Sparse chunks' data runs shorter than this are written through the page cache.
_MIN_DIRECT_RUN = 256 * 1024
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# Zero detection by grains of this size (in chunks that compressed well: ``write_place``).
_GRAIN = 32 * 1024
_ZERO = bytes(_GRAIN)
# errnos that mean "this filesystem does not do O_DIRECT (here)", not "the disk failed".
_NO_DIRECT = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})


def dest_error(exc: BaseException, dest: Path) -> GpusnapError:
    """An error of a pull, said about the destination when it is the destination's."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return FailedPrecondition(
            f"destination disk full: cannot write into {dest} ({exc.strerror or exc})"
        )
    if isinstance(exc, OSError):
        return translate_error(exc, f"cannot write into {dest}")
    return translate_error(exc, f"pulling into {dest}")


class Target:
    """One file being written: its temp path, a buffered fd, and an O_DIRECT fd when allowed."""

    def __init__(self, tmp: Path, fd: int, dfd: int | None) -> None:
        self.tmp = tmp
        self.fd = fd
        self.dfd = dfd
        self._lock = threading.Lock()
        self.unwritten = 0  # chunk places not yet written (under the pull's stats lock)
        self.synced = False

    def no_direct(self) -> None:
        with self._lock:
            if self.dfd is not None:
                with contextlib.suppress(OSError):
                    os.close(self.dfd)
                self.dfd = None

    def close(self) -> None:
        self.no_direct()
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


class Destination:
    """What a pull creates in ``dest``, so that a failure can remove exactly that.

    ``check_targets`` has mapped every manifest path to its final path (before anything is
    written); ``create`` makes each entry's temp file, ``commit`` renames them all into place.
    """

    def __init__(self, dest: Path, targets: dict[str, Path]) -> None:
        self.dest = dest
        self.targets = targets
        self.created_dirs: list[Path] = []
        self.temps: dict[str, Target] = {}  # manifest path -> file being written
        self.renamed: list[Path] = []
        self._token = secrets.token_hex(4)

    def make_dirs(self, path: Path) -> None:
        """Create ``path`` and its missing parents, remembering each for ``undo``."""
        missing: list[Path] = []
        probe = path
        while not probe.exists():
            missing.append(probe)
            probe = probe.parent
        for directory in reversed(missing):
            directory.mkdir(mode=0o755)
            self.created_dirs.append(directory)

    def create(self, entry: FileEntry, *, direct: bool) -> Target:
        """The temp file of ``entry``: a hole of its size, with its mode, beside its target."""
        final = self.targets[entry.path]
        self.make_dirs(final.parent)
        _check_inside(final.parent, self.dest, entry.path)
        tmp = final.with_name(f"{TMP_PREFIX}{self._token}-{final.name}"[:255])
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600)
        target = Target(tmp, fd, None)
        self.temps[entry.path] = target
        # Its mode now (never setuid/setgid/sticky): the fsync of its data covers it too.
        os.fchmod(fd, entry.mode & 0o777)
        os.ftruncate(fd, entry.size)
        if direct and entry.size >= _MIN_DIRECT:
            target.dfd = _open_direct(tmp)
        return target

    def commit(self, *, durable: bool, pool: ThreadPoolExecutor) -> None:
        """Rename every temp file into place; with ``durable`` sync first (on ``pool``)
        those not synced yet (empty ones: no chunk completed them), and the directories
        after."""
        unsynced = [t for t in self.temps.values() if durable and not t.synced]
        for fut in [pool.submit(os.fsync, t.fd) for t in unsynced]:
            fut.result()
        for path, target in list(self.temps.items()):
            target.close()
            os.rename(target.tmp, self.targets[path])
            del self.temps[path]
            self.renamed.append(self.targets[path])
        if durable:
            parents = {final.parent for final in self.targets.values()}
            _sync_dirs(parents | {self.dest, self.dest.parent})

    def undo(self) -> None:
        for target in self.temps.values():
            target.close()
            target.tmp.unlink(missing_ok=True)
        for final in self.renamed:
            final.unlink(missing_ok=True)
        for directory in reversed(self.created_dirs):
            with contextlib.suppress(OSError):
                directory.rmdir()


class AlignedBuffers:
    """Page-aligned buffers of one chunk's size (plus alignment slack), reused across chunks.

    At most ``limit`` exist: ``take`` waits for one to be given back beyond that, so what a
    pull holds of decoded chunks (each buffer's pages stay resident once touched) is bounded
    by ``limit`` whatever the size of the image. They are unmapped when the pull ends.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a pull needs at least one buffer")
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self._all: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._out = threading.BoundedSemaphore(limit)

    def take(self) -> mmap.mmap:
        self._out.acquire()  # given back by ``give``, which writers always reach
        try:
            return self._free.get_nowait()
        except queue.Empty:
            buf = mmap.mmap(-1, MAX_SIZE + 2 * ALIGN)  # anonymous maps are page-aligned
            with self._lock:
                self._all.append(buf)
            return buf

    def give(self, buf: mmap.mmap) -> None:
        self._free.put(buf)
        self._out.release()

    def close(self) -> None:
        with self._lock:
            for buf in self._all:
                with contextlib.suppress(BufferError):  # a view still alive: the GC frees it
                    buf.close()
            self._all.clear()


def check_targets(manifest: Manifest, dest: Path) -> dict[str, Path]:
    """Map every manifest path to its target, refusing any that could leave ``dest``."""
    real_dest = Path(os.path.realpath(dest))
    targets: dict[str, Path] = {}
    for entry in manifest.files:
        target = dest.joinpath(*entry.path.split("/"))
        probe = dest
        for part in entry.path.split("/")[:-1]:
            probe = probe / part
            if probe.is_symlink():
                real = Path(os.path.realpath(probe))
                if real != real_dest and real_dest not in real.parents:
                    raise Corrupt(f"{probe} is a symlink out of the destination")
            elif probe.exists() and not probe.is_dir():
                raise AlreadyExists(f"{probe} exists and is not a directory")
        if target.exists() or target.is_symlink():
            raise AlreadyExists(f"{target} already exists; pull into an empty destination")
        targets[entry.path] = target
    return targets


def _check_inside(directory: Path, dest: Path, path: str) -> None:
    real = Path(os.path.realpath(directory))
    real_dest = Path(os.path.realpath(dest))
    if real != real_dest and real_dest not in real.parents:
        raise Corrupt(f"{path!r} would land outside the destination")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data = data[written:]
        offset += written


def _open_direct(tmp: Path) -> int | None:
    if not _O_DIRECT:
        return None
    try:
        return os.open(tmp, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | _O_DIRECT)
    except OSError as exc:
        if exc.errno in _NO_DIRECT:
            return None
        raise


def _data_runs(buf: mmap.mmap, lo: int, hi: int, file_lo: int) -> list[tuple[int, int]]:
    """The ranges of ``buf[lo:hi]`` that hold data; the rest is whole zero grains.

    ``buf[lo]`` lands at file offset ``file_lo``; grains are aligned to file offsets, so a
    KV pool's empty blocks are seen as such. Skipped grains stay holes in the new file (they
    read as zeros), like ``zstd -d --sparse`` or ``cp --sparse``.
    """
    runs: list[tuple[int, int]] = []
    begin = -1
    pos = lo
    while pos < hi:
        end = min(hi, pos + _GRAIN - (file_lo + pos - lo) % _GRAIN)
        n = end - pos
        # In place (no copy): a whole grain of zeros is found where it starts, or not at all;
        # a data grain is rejected at its first bytes.
        zero = buf.find(_ZERO[:n], pos, end) == pos
        if zero and begin >= 0:
            runs.append((begin, pos))
            begin = -1
        elif not zero and begin < 0:
            begin = pos
        pos = end
    if begin >= 0:
        runs.append((begin, hi))
    return runs


def write_place(
    target: Target, buf: mmap.mmap, shift: int, size: int, offset: int, *, sparse: bool
) -> int:
    """Write the chunk at ``buf[shift:shift + size]`` to ``offset``; bytes written directly.

    ``shift`` is ``offset % ALIGN`` of the place the chunk was decoded for; a place with
    another alignment (the same chunk twice at different offsets) is written buffered. With
    ``sparse`` (the chunk compressed well: it may hold empty blocks) zero grains are skipped.
    """
    view = memoryview(buf)
    try:
        dfd = target.dfd
        start = -(-offset // ALIGN) * ALIGN  # first block boundary at or after offset
        end = (offset + size) // ALIGN * ALIGN
        if dfd is None or offset % ALIGN != shift or end - start < _MIN_DIRECT:
            lo, hi = shift, shift + size
            runs = _data_runs(buf, lo, hi, offset) if sparse else [(lo, hi)]
            for a, b in runs:
                _pwrite_all(target.fd, view[a:b], offset + a - lo)
            return 0
        head, tail = start - offset, end - offset
        lo, hi = shift + head, shift + tail  # at multiples of ALIGN from the map's start
        runs = _data_runs(buf, lo, hi, start) if sparse else [(lo, hi)]
        done = 0
        for a, b in runs:
            if b - a < _MIN_DIRECT_RUN:  # a device round trip for a few blocks: buffered
                _pwrite_all(target.fd, view[a:b], start + a - lo)
                continue
            try:
                _pwrite_all(dfd, view[a:b], start + a - lo)
            except OSError as exc:
                if exc.errno not in _NO_DIRECT:
                    raise
                target.no_direct()
                _pwrite_all(target.fd, view[a:b], start + a - lo)
                continue
            done += b - a
        if head:
            _pwrite_all(target.fd, view[shift:lo], offset)
        if tail < size:
            _pwrite_all(target.fd, view[hi : shift + size], end)
        # What went through the page cache (edges, short runs) starts for the disk now, as
        # the O_DIRECT part did: the file's fsync then has little left to wait for, and the
        # pages are not kept (DONTNEED starts writeback; dirty data is never dropped).
        with contextlib.suppress(OSError):
            os.posix_fadvise(target.fd, offset, size, os.POSIX_FADV_DONTNEED)
        return done
    finally:
        view.release()


def _sync_dirs(directories: set[Path]) -> None:
    for directory in sorted(directories):
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue  # dest's parent may not be ours to open; the files themselves are synced
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EROFS):
                raise
        finally:
            os.close(fd)
