"""The ``file://`` backend: objects are files under a root directory on a local disk.

``file:///abs/path`` maps key ``a/b/c`` to ``/abs/path/a/b/c``. Every key is checked by
``layout.validate_key`` (relative, no ``..``, no empty segment, no backslash, no control character)
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

Space reserve: the first write through a backend makes sure the store root holds
``.gpusnap-reserve``, ``RESERVE_BYTES`` of preallocated blocks that no key can name and no
listing shows. Only gc gives it up (``release_reserve``), to record itself when the disk is
full, and puts it back after its sweep (``restore_reserve``); a put never touches it, so a
push on a full disk fails and the reserve stays for the gc that gets the store out of it.

The POSIX primitives underneath (opening names relative to a directory fd without following a
symlink, temp files, ``syncfs``) are in ``storage/file_ops.py``.
"""

from __future__ import annotations

import errno
import logging
import os
import stat as stat_mod
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import unquote, urlsplit

from gpusnap.errors import (
    Corrupt,
    FailedPrecondition,
    GpusnapError,
    Internal,
    InvalidArgument,
    NotFound,
)
from gpusnap.storage.backend import BackendOptions, ObjectInfo, check_range, key_taken, no_object
from gpusnap.storage.file_ops import (
    DIR_FLAGS,
    DIR_MODE,
    ensure_reserve,
    is_dir_at,
    is_private_name,
    is_symlink_at,
    open_below,
    release_reserve,
    syncfs,
    unlink_quietly,
    write_temp,
)
from gpusnap.storage.layout import RESERVE_NAME, is_valid_key, validate_key, validate_prefix

log = logging.getLogger(__name__)

_SYNC_THREADS = 16
_READ_BLOCK = 1 << 30  # pread() returns at most ~2 GiB per call on Linux
_GET_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
# Enough for a gc record and its rewrites, and the ``locks/`` directory, many times over
# on any block size; small beside any disk that holds checkpoints.
RESERVE_BYTES = 4 * 1024 * 1024


class FileBackend:
    """A store in a local directory. Use ``open_backend("file:///path")`` rather than this."""

    def __init__(self, root: str, *, create: bool = True) -> None:
        if not os.path.isabs(root):
            raise InvalidArgument(f"file store path {root!r} is not absolute")
        root = os.path.normpath(root)
        if os.path.lexists(root) and not os.path.isdir(root):
            raise FailedPrecondition(f"store path {root} exists and is not a directory")
        if not create and not os.path.lexists(root):
            raise NotFound(f"no store at {root} (nothing has been pushed there)")
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
        self._reserve_checked = False
        self._reserve_lock = threading.Lock()

    # -- the Backend protocol -------------------------------------------------------------

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._put(key, data, if_absent=if_absent, durable=True)

    # -- DeferredSyncBackend --------------------------------------------------------------

    def put_unsynced(self, key: str, data: bytes) -> None:
        """Like ``put`` (atomic rename into place) but durable only after ``sync``."""
        self._put(key, data, if_absent=False, durable=False)

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
                    syncfs(fd)
                finally:
                    os.close(fd)
                return
            split = sorted({self._split(key) for key in keys})
            if not split:
                return
            with ThreadPoolExecutor(min(_SYNC_THREADS, len(split))) as pool:
                found = pool.map(self._fsync_object, split)
                present = [d for (d, _n), there in zip(split, found, strict=True) if there]
                list(pool.map(self._fsync_directory, sorted(set(present))))
        except OSError as exc:
            raise self._translate(exc, "sync", ".") from exc

    def get(self, key: str, *, offset: int = 0, length: int | None = None) -> bytes:
        check_range(key, offset, length)
        directory, name = self._split(key)
        try:
            dfd = self._open_dir(directory, key, create=False)
            if dfd is None:
                raise no_object(self.url, key)
            try:
                # Anyone who can write the store may put a FIFO or a device at a key: look
                # before opening (opening either can block or act), open without blocking
                # or following, and look again at what was opened.
                self._check_regular(os.stat(name, dir_fd=dfd, follow_symlinks=False), key)
                fd = os.open(name, _GET_FLAGS, dir_fd=dfd)
            finally:
                os.close(dfd)
        except (FileNotFoundError, NotADirectoryError):
            raise no_object(self.url, key) from None
        except OSError as exc:
            raise self._translate(exc, "get", key) from exc
        try:
            st = os.fstat(fd)
            self._check_regular(st, key)
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

    def _check_regular(self, st: os.stat_result, key: str) -> None:
        if stat_mod.S_ISLNK(st.st_mode):
            raise self._translate(OSError(errno.ELOOP, os.strerror(errno.ELOOP)), "get", key)
        if not stat_mod.S_ISREG(st.st_mode):
            raise Corrupt(f"store object {key!r} in {self.url} is not a regular file")

    def stat(self, key: str) -> ObjectInfo | None:
        directory, name = self._split(key)
        try:
            dfd = self._open_dir(directory, key, create=False)
            if dfd is None:
                return None
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            finally:
                os.close(dfd)
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
        segments = dir_key.split("/") if dir_key else []
        key_prefix = f"{dir_key}/" if dir_key else ""
        try:
            dfd = self._open_dir(segments, prefix, create=False)
            if dfd is None:
                return
            yield from self._walk(dfd, key_prefix, name_start)
        except OSError as exc:
            raise self._translate(exc, "list", prefix) from exc

    def delete(self, key: str) -> None:
        directory, name = self._split(key)
        try:
            dfd = self._open_dir(directory, key, create=False)
            if dfd is None:
                return
            try:
                os.unlink(name, dir_fd=dfd)
            finally:
                os.close(dfd)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return
        except OSError as exc:
            raise self._translate(exc, "delete", key) from exc

    def close(self) -> None:
        pass

    # -- SpaceReserveBackend --------------------------------------------------------------

    def release_reserve(self) -> bool:
        """Delete the space reserve; ``True`` if there was one to free."""
        try:
            fd = os.open(self.root, DIR_FLAGS)
            try:
                released = release_reserve(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._translate(exc, "release", RESERVE_NAME) from exc
        if released:
            log.warning("store %s is full: released its %s", self.root, RESERVE_NAME)
        return released

    def restore_reserve(self) -> bool:
        """Recreate the space reserve if it is missing; ``False`` if there is no room."""
        try:
            fd = os.open(self.root, DIR_FLAGS)
            try:
                return ensure_reserve(fd, RESERVE_BYTES)
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._translate(exc, "create", RESERVE_NAME) from exc

    # -- internals ------------------------------------------------------------------------

    def _put(self, key: str, data: bytes, *, if_absent: bool, durable: bool) -> None:
        """A temp file beside the target, renamed (``if_absent``: hard-linked) into place;
        ``durable`` fsyncs the file before and its directory after."""
        directory, name = self._split(key)
        self._check_reserve_once()
        try:
            dfd = self._open_dir(directory, key, create=True)
            assert dfd is not None
            try:
                if if_absent and is_dir_at(dfd, name):
                    raise FailedPrecondition(f"store key {key!r} names a directory in {self.root}")
                tmp = write_temp(dfd, data, durable=durable)
                try:
                    if if_absent:
                        try:
                            os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                        except FileExistsError:
                            raise key_taken(self.url, key) from None
                    else:
                        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                finally:
                    unlink_quietly(dfd, tmp)
                if durable:
                    os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            raise self._translate(exc, "put", key) from exc

    def _check_reserve_once(self) -> None:
        """Before this backend's first write, make the reserve if it is missing.

        Best effort: a store whose disk cannot hold the reserve still takes the write (and
        warns). Once per backend, so that a put costs no extra system call; gc restores
        the reserve it released itself.
        """
        if self._reserve_checked:
            return
        with self._reserve_lock:
            if self._reserve_checked:
                return
            self._reserve_checked = True
            try:
                made = self.restore_reserve()
            except GpusnapError as exc:
                log.warning("store %s: cannot make its space reserve: %s", self.root, exc)
                return
            if not made:
                log.warning(
                    "store %s: no room for its %d MiB space reserve; gc may not run on a full disk",
                    self.root,
                    RESERVE_BYTES >> 20,
                )

    def _split(self, key: str) -> tuple[tuple[str, ...], str]:
        """``(directory segments, file name)`` of a key, after validating it."""
        validate_key(key)
        segments = key.split("/")
        if any(is_private_name(s) for s in segments):
            raise InvalidArgument(f"invalid store key {key!r}: names a file of the backend's own")
        return tuple(segments[:-1]), segments[-1]

    def _open_dir(self, segments: Sequence[str], key: str, *, create: bool) -> int | None:
        """An fd of the directory ``root/segments``, reached without following a symlink.

        Each component is opened relative to the one before with ``O_NOFOLLOW``, so a
        symlink planted in the store (``chunks`` -> ``/etc``) can never redirect a write, a
        read or a delete out of the root; it is refused, named. With ``create`` missing
        directories are made (mode 0700, their parent fsynced); without it ``None`` means
        one is missing. The root itself may be a symlink: the operator chose it.
        """
        fd = os.open(self.root, DIR_FLAGS)
        try:
            for depth, segment in enumerate(segments):
                try:
                    below = open_below(fd, segment, create=create)
                except FileNotFoundError:
                    if not create:
                        os.close(fd)
                        return None
                    raise
                except OSError as exc:
                    if exc.errno == errno.ELOOP or is_symlink_at(fd, segment):
                        where = os.path.join(self.root, *segments[: depth + 1])
                        raise FailedPrecondition(
                            f"store {self.root}: {where} is a symbolic link, which a store "
                            "never holds; refusing to follow it (remove it)"
                        ) from None
                    if exc.errno == errno.ENOTDIR:
                        if not create:
                            os.close(fd)
                            return None
                        raise FailedPrecondition(
                            f"store key {key!r} lies under an existing object in {self.url}"
                        ) from None
                    raise
                os.close(fd)
                fd = below
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _fsync_object(self, where: tuple[tuple[str, ...], str]) -> bool:
        """fsync one object; ``False`` when it is gone (a gc removed it: gc's protocol
        covers it)."""
        directory, name = where
        dfd = self._open_dir(directory, name, create=False)
        if dfd is None:
            return False
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dfd)
        except (FileNotFoundError, NotADirectoryError):
            log.debug("sync: %s is gone", "/".join((*directory, name)))
            return False
        finally:
            os.close(dfd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def _fsync_directory(self, directory: tuple[str, ...]) -> None:
        dfd = self._open_dir(directory, "/".join(directory), create=False)
        if dfd is None:
            return
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _walk(self, dfd: int, key_prefix: str, name_start: str) -> Iterator[ObjectInfo]:
        """Objects under the directory ``dfd`` (which this closes), in key order.

        Nothing is followed: symlinks, sockets and other non-files are not objects, and a
        name that is not a valid key (a newline, a backslash) is skipped with a warning, so
        that one stray file cannot make every listing fail.
        """
        try:
            with os.scandir(dfd) as it:
                entries = [
                    e for e in it if e.name.startswith(name_start) and not is_private_name(e.name)
                ]
            # Sorting directories as "name/" makes the walk yield keys in exact string order.
            ordered: list[tuple[str, os.DirEntry[str], bool]] = []
            for entry in entries:
                if not is_valid_key(key_prefix + entry.name):
                    log.warning(
                        "store %s: ignoring %r, not a valid store key", self.root, entry.name
                    )
                elif entry.is_dir(follow_symlinks=False):
                    ordered.append((entry.name + "/", entry, True))
                elif entry.is_file(follow_symlinks=False):
                    ordered.append((entry.name, entry, False))
            ordered.sort(key=lambda item: item[0])
            for _, entry, is_dir in ordered:
                if is_dir:
                    try:
                        below = os.open(entry.name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dfd)
                    except (FileNotFoundError, NotADirectoryError):
                        continue  # removed, or replaced by a symlink, while we listed
                    yield from self._walk(below, f"{key_prefix}{entry.name}/", "")
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # deleted while we listed
                    continue
                yield ObjectInfo(key=key_prefix + entry.name, size=st.st_size, mtime=st.st_mtime)
        finally:
            os.close(dfd)

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


def open_file_backend(url: str, options: BackendOptions) -> FileBackend:
    """Factory for ``file:///abs/path`` (``file://localhost/abs/path`` is accepted too)."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidArgument(
            f"store URL {url!r} names host {parts.netloc!r}; use file:///absolute/path"
        )
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise InvalidArgument(f"store URL {url!r} needs an absolute path: file:///path")
    if "\x00" in path:
        raise InvalidArgument(f"store URL {url!r} contains a NUL byte")
    return FileBackend(path, create=options.create)
