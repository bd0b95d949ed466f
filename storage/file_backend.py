"""The ``file://`` backend: objects are files under a root directory on a local disk.

``file:///abs/path`` maps key ``a/b/c`` to ``/abs/path/a/b/c``. Every key is checked by
``validate_key`` (relative, no ``..``, no empty segment, no backslash, no control character)
and may not name one of this module's temp files, so nothing is ever read or written outside
the root. Directories are created with mode 0700 and files with mode 0600: a store holds
process memory.

Durability: a put writes a temp file in the target directory, fsyncs it, renames (or, for
``if_absent``, hard-links) it into place and fsyncs the directory, so after ``put`` returns the
object survives a power cut, and a reader never sees a partial object. ``if_absent`` relies on
``link(2)`` failing with ``EEXIST``, which is atomic against any number of concurrent writers.
``put_unsynced`` (chunks) is the same temp + rename without either fsync, with the file's
writeback started at once; ``sync(keys)`` later fsyncs those files in parallel and then their
directories, one batch before the manifest instead of two waits per object, and ``sync()``
syncs the whole filesystem (``syncfs(2)``). Deletes are not fsynced: a crash may bring a
deleted object back, which is harmless for the garbage it was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import os
import secrets
import stat as stat_mod
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import unquote, urlsplit

from gpusnap.storage.backend import (
    BackendOptions,
    ObjectInfo,
    register_backend,
    validate_key,
    validate_prefix,
)
from gpusnap.storage.errors import (
    AlreadyExists,
    FailedPrecondition,
    GpusnapError,
    Internal,
    InvalidArgument,
    NotFound,
)

log = logging.getLogger(__name__)

TEMP_PREFIX = ".gpusnap-tmp-"
_SYNC_THREADS = 16
DIR_MODE = 0o700
FILE_MODE = 0o600
_READ_BLOCK = 1 << 30  # pread() returns at most ~2 GiB per call on Linux


class FileBackend:
    """A store in a local directory. Use ``open_backend("file:///path")`` rather than this."""

    def __init__(self, root: str) -> None:
        if not os.path.isabs(root):
            raise InvalidArgument(f"file store path {root!r} is not absolute")
        root = os.path.normpath(root)
        try:
            os.makedirs(root, mode=DIR_MODE, exist_ok=True)
        except OSError as exc:
            raise FailedPrecondition(
                f"cannot create store directory {root}: {exc.strerror or exc}"
            ) from exc
        if not os.path.isdir(root):
            raise FailedPrecondition(f"store path {root} is not a directory")
        self.root = root
        self.url = f"file://{root}"

    # -- the Backend protocol -------------------------------------------------------------

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        path = self._path(key)
        parent = os.path.dirname(path)
        try:
            self._make_dirs(parent, key)
            if if_absent and os.path.isdir(path):
                raise FailedPrecondition(f"store key {key!r} names a directory in {self.root}")
            tmp = self._write_temp(parent, data, durable=True)
            try:
                if if_absent:
                    try:
                        os.link(tmp, path)
                    except FileExistsError:
                        raise AlreadyExists(
                            f"object {key!r} already exists in {self.url}"
                        ) from None
                else:
                    os.replace(tmp, path)
            finally:
                _unlink_quietly(tmp)
            _fsync_dir(parent)
        except OSError as exc:
            raise self._translate(exc, "put", key) from exc

    # -- DeferredSyncBackend --------------------------------------------------------------

    def put_unsynced(self, key: str, data: bytes) -> None:
        """Like ``put`` (atomic rename into place) but durable only after ``sync``."""
        path = self._path(key)
        parent = os.path.dirname(path)
        try:
            self._make_dirs(parent, key)
            tmp = self._write_temp(parent, data, durable=False)
            try:
                os.replace(tmp, path)
            finally:
                _unlink_quietly(tmp)
        except OSError as exc:
            raise self._translate(exc, "put", key) from exc

    def sync(self, keys: Iterable[str] | None = None) -> None:
        """Make ``keys`` durable: fsync each file, then each directory holding one.

        The fsyncs run in parallel (they wait on the disk, not on a core; the journal
        commits concurrent ones together), and only what was asked for is written back: a
        CRIU image directory on the same filesystem is not. With ``keys=None`` the whole
        filesystem is synced (``syncfs(2)``), which also covers puts nobody listed.
        """
        try:
            if keys is None:
                fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    _syncfs(fd)
                finally:
                    os.close(fd)
                return
            paths = sorted({self._path(key) for key in keys})
            if not paths:
                return
            with ThreadPoolExecutor(min(_SYNC_THREADS, len(paths))) as pool:
                found = pool.map(_fsync_file, paths)
                present = [p for p, there in zip(paths, found, strict=True) if there]
                directories = sorted({os.path.dirname(path) for path in present})
                list(pool.map(_fsync_dir, directories))
        except OSError as exc:
            raise self._translate(exc, "sync", ".") from exc

    def get(self, key: str, *, offset: int = 0, length: int | None = None) -> bytes:
        if offset < 0 or (length is not None and length < 0):
            raise InvalidArgument(f"invalid range for {key!r}: offset {offset}, length {length}")
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"no object {key!r} in {self.url}") from None
        except OSError as exc:
            raise self._translate(exc, "get", key) from exc
        try:
            st = os.fstat(fd)
            if not stat_mod.S_ISREG(st.st_mode):
                raise NotFound(f"no object {key!r} in {self.url}")
            end = st.st_size if length is None else min(st.st_size, offset + length)
            parts: list[bytes] = []
            pos = offset
            while pos < end:
                block = os.pread(fd, min(end - pos, _READ_BLOCK), pos)
                if not block:  # truncated under us; return what is there
                    break
                parts.append(block)
                pos += len(block)
            return b"".join(parts)
        except OSError as exc:
            raise self._translate(exc, "get", key) from exc
        finally:
            os.close(fd)

    def stat(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        try:
            st = os.stat(path, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise self._translate(exc, "stat", key) from exc
        if not stat_mod.S_ISREG(st.st_mode):
            return None
        return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        validate_prefix(prefix)
        if prefix == "" or prefix.endswith("/"):
            dir_key, name_start = prefix.rstrip("/"), ""
        else:
            dir_key, _, name_start = prefix.rpartition("/")
        start = os.path.join(self.root, *dir_key.split("/")) if dir_key else self.root
        key_prefix = f"{dir_key}/" if dir_key else ""
        try:
            yield from self._walk(start, key_prefix, name_start)
        except OSError as exc:
            raise self._translate(exc, "list", prefix) from exc

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return
        except OSError as exc:
            raise self._translate(exc, "delete", key) from exc

    def close(self) -> None:
        pass

    # -- internals ------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        validate_key(key)
        segments = key.split("/")
        if any(s.startswith(TEMP_PREFIX) for s in segments):
            raise InvalidArgument(f"invalid store key {key!r}: names a temp file")
        return os.path.join(self.root, *segments)

    def _make_dirs(self, parent: str, key: str) -> None:
        if os.path.isdir(parent):
            return
        rel = os.path.relpath(parent, self.root)
        current = self.root
        for segment in rel.split(os.sep):
            below = os.path.join(current, segment)
            try:
                os.mkdir(below, DIR_MODE)
            except FileExistsError:
                if not os.path.isdir(below):
                    raise FailedPrecondition(
                        f"store key {key!r} lies under an existing object in {self.url}"
                    ) from None
            else:
                _fsync_dir(current)
            current = below

    def _write_temp(self, directory: str, data: bytes, *, durable: bool) -> str:
        tmp = os.path.join(directory, TEMP_PREFIX + secrets.token_hex(8))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if durable:
                os.fsync(fd)
            else:
                _start_writeback(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        os.close(fd)
        return tmp

    def _walk(self, directory: str, key_prefix: str, name_start: str) -> Iterator[ObjectInfo]:
        try:
            with os.scandir(directory) as it:
                entries = [
                    e
                    for e in it
                    if e.name.startswith(name_start) and not e.name.startswith(TEMP_PREFIX)
                ]
        except (FileNotFoundError, NotADirectoryError):
            return
        # Sorting directories as "name/" makes the walk yield keys in exact string order.
        ordered: list[tuple[str, os.DirEntry[str], bool]] = []
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                ordered.append((entry.name + "/", entry, True))
            elif entry.is_file(follow_symlinks=False):
                ordered.append((entry.name, entry, False))
        ordered.sort(key=lambda item: item[0])
        for _, entry, is_dir in ordered:
            if is_dir:
                yield from self._walk(entry.path, f"{key_prefix}{entry.name}/", "")
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # deleted while we listed
                continue
            yield ObjectInfo(key=key_prefix + entry.name, size=st.st_size, mtime=st.st_mtime)

    def _translate(self, exc: OSError, op: str, key: str) -> GpusnapError:
        reason = exc.strerror or str(exc)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return FailedPrecondition(
                f"store disk full: cannot {op} {key!r} in {self.root} ({reason})"
            )
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return FailedPrecondition(f"store {self.root}: cannot {op} {key!r}: {reason}")
        if exc.errno == errno.ELOOP:
            return FailedPrecondition(
                f"store {self.root}: {key!r} is a symbolic link, which a store never holds"
            )
        if exc.errno in (errno.ENOTDIR, errno.EISDIR):
            return FailedPrecondition(
                f"store {self.root}: cannot {op} {key!r}: a file and a directory collide"
            )
        if exc.errno == errno.ENAMETOOLONG:
            return InvalidArgument(f"store key {key!r} is too long for {self.root}")
        return Internal(f"store {self.root}: cannot {op} {key!r}: {reason}")


def _fsync_file(path: str) -> bool:
    """fsync ``path``; ``False`` when it is gone (a gc removed it: gc's protocol covers it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        log.debug("sync: %s is gone", path)
        return False
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int) -> None:
    """Start writing ``fd``'s dirty pages to disk now, without waiting for them.

    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``: the disk works while the push computes, so
    the ``sync`` before the manifest has little left to wait for. Best effort: it commits
    nothing (no metadata, no disk cache flush), and where it is missing nothing happens.
    """
    fn = getattr(_libc(), "sync_file_range", None)
    if fn is not None:
        whole_file = ctypes.c_int64(0)  # offset 0, length 0: to the end of the file
        fn(ctypes.c_int(fd), whole_file, whole_file, ctypes.c_uint(_SYNC_FILE_RANGE_WRITE))


def _syncfs(fd: int) -> None:
    """``syncfs(fd)``: write back and commit the whole filesystem holding ``fd``.

    Unlike ``sync(2)`` it touches only that filesystem, and (Linux 5.8+) it reports
    writeback errors. Where libc has no ``syncfs`` the whole system is synced instead.
    """
    syncfs = getattr(_libc(), "syncfs", None)
    if syncfs is None:
        os.sync()
        return
    if syncfs(ctypes.c_int(fd)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove temp file %s: %s", path, exc)


def open_file_backend(url: str, options: BackendOptions) -> FileBackend:
    """Factory for ``file:///abs/path`` (``file://localhost/abs/path`` is accepted too)."""
    del options  # nothing in BackendOptions applies to a directory
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidArgument(
            f"store URL {url!r} names host {parts.netloc!r}; use file:///absolute/path"
        )
    if parts.query or parts.fragment:
        raise InvalidArgument(f"store URL {url!r} may not carry a query or fragment")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise InvalidArgument(f"store URL {url!r} needs an absolute path: file:///path")
    if "\x00" in path:
        raise InvalidArgument(f"store URL {url!r} contains a NUL byte")
    return FileBackend(path)


register_backend("file", open_file_backend)
