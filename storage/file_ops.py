"""The ``file://`` backend's POSIX primitives: names opened relative to a directory fd.

Every name is opened relative to an open directory (``dir_fd``) with ``O_NOFOLLOW``, so a
symlink planted in a store cannot redirect an operation out of it. Here too are the temp
files a put writes before renaming them into place (mode 0600, named ``TEMP_PREFIX...``),
the space reserve (``RESERVE_NAME``; both names are ``layout.py``'s), and the two libc
calls ``os`` lacks: ``sync_file_range`` (start writeback) and ``syncfs``.
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

from gpusnap.storage.layout import RESERVE_NAME, TEMP_PREFIX

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def open_below(fd: int, segment: str, *, create: bool) -> int:
    """An fd of the directory ``segment`` in the directory ``fd``, never through a symlink.

    With ``create`` a missing one is made first (mode 0700, ``fd`` fsynced after).
    """
    try:
        return os.open(segment, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(segment, DIR_MODE, dir_fd=fd)
    except FileExistsError:
        pass  # made by a concurrent put, or not a directory: the open says which
    else:
        os.fsync(fd)
    return os.open(segment, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)


def is_symlink_at(dfd: int, name: str) -> bool:
    try:
        return stat_mod.S_ISLNK(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def is_dir_at(dfd: int, name: str) -> bool:
    try:
        return stat_mod.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def is_private_name(name: str) -> bool:
    """Whether ``name`` is one of the backend's own files (a temp file, the reserve), which
    no key may name and no listing shows."""
    return name.startswith(TEMP_PREFIX) or name == RESERVE_NAME


def ensure_reserve(dfd: int, size: int) -> bool:
    """Make sure ``RESERVE_NAME`` in the directory ``dfd`` holds ``size`` allocated bytes.

    An existing regular file that holds them is kept. A new one is allocated with
    ``posix_fallocate`` (real blocks, not a hole) under a temp name and renamed into place,
    so a reserve is never half made. Something else under that name (a symlink, a
    directory) is neither followed nor replaced. ``False`` when there is no reserve after
    this; ``ENOSPC``/``EDQUOT`` (no room for one) is such a case, not an error.
    """
    try:
        st = os.stat(RESERVE_NAME, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        pass
    else:
        if not stat_mod.S_ISREG(st.st_mode):
            log.warning("%s is not a regular file; the store has no space reserve", RESERVE_NAME)
            return False
        if st.st_blocks * 512 >= size:
            return True
    tmp = TEMP_PREFIX + secrets.token_hex(8)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(tmp, flags, FILE_MODE, dir_fd=dfd)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        os.replace(tmp, RESERVE_NAME, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError as exc:
        unlink_quietly(dfd, tmp)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return False
        raise
    return True


def release_reserve(dfd: int) -> bool:
    """Delete ``RESERVE_NAME`` in the directory ``dfd``; ``True`` if that freed space.

    Only a regular file is removed: a symlink under that name is left alone (it would free
    nothing, and a store never acts on one).
    """
    try:
        st = os.stat(RESERVE_NAME, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat_mod.S_ISREG(st.st_mode):
        return False
    try:
        os.unlink(RESERVE_NAME, dir_fd=dfd)
    except FileNotFoundError:
        return False  # a concurrent gc released it first
    return True


def write_temp(dfd: int, data: bytes, *, durable: bool) -> str:
    """A new temp file in the directory ``dfd`` holding ``data``; returns its name."""
    tmp = TEMP_PREFIX + secrets.token_hex(8)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(tmp, flags, FILE_MODE, dir_fd=dfd)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        if durable:
            os.fsync(fd)
        else:
            start_writeback(fd)
    except BaseException:
        os.close(fd)
        unlink_quietly(dfd, tmp)
        raise
    os.close(fd)
    return tmp


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Start writing ``fd``'s dirty pages to disk now, without waiting for them.

    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``: the disk works while the push computes, so
    the ``sync`` before the manifest has little left to wait for. Best effort: it commits
    nothing (no metadata, no disk cache flush), and where it is missing nothing happens.
    """
    fn = getattr(_libc(), "sync_file_range", None)
    if fn is not None:
        whole_file = ctypes.c_int64(0)  # offset 0, length 0: to the end of the file
        fn(ctypes.c_int(fd), whole_file, whole_file, ctypes.c_uint(_SYNC_FILE_RANGE_WRITE))


def syncfs(fd: int) -> None:
    """``syncfs(fd)``: write back and commit the whole filesystem holding ``fd``.

    Unlike ``sync(2)`` it touches only that filesystem, and (Linux 5.8+) it reports
    writeback errors. Where libc has no ``syncfs`` the whole system is synced instead.
    """
    fn = getattr(_libc(), "syncfs", None)
    if fn is None:
        os.sync()
        return
    if fn(ctypes.c_int(fd)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def unlink_quietly(dfd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove temp file %s: %s", name, exc)
