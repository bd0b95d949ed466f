"""The chunk cache's files: where each object lies, and how one is read, written and removed.

::

    <dir>/chunks.sqlite                    the cache's index (``disk.py``)
    <dir>/objects/<scope>/<id[:2]>/<id>    one chunk object, exactly as the store holds it
    <dir>/tmp/<writer>-<n>                 an object being written (renamed into place)

A scope is one store (``disk.scope_of``): 32 hex characters. Objects are written to a temp
file and renamed into place, so a name under ``objects/`` only ever holds a whole object; they
are not fsynced (why: ``docs/design.md``, "The node's chunk cache"). Names come from chunk
ids (64 lowercase hex, checked here before they become paths) and scopes (ours), never from
anything a store says.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from gpusnap.errors import InvalidArgument
from gpusnap.storage.chunker import MAX_SIZE

log = logging.getLogger(__name__)

OBJECTS = "objects"
TEMP = "tmp"
DIR_MODE = 0o700
FILE_MODE = 0o600
_ID = re.compile(r"[0-9a-f]{64}")
_SCOPE = re.compile(r"[0-9a-f]{32}")
# No chunk object is larger than this (the largest chunk, stored raw, plus its header, nonce
# and tag); a bigger file under an object's name is not read into memory.
MAX_OBJECT_BYTES = MAX_SIZE + 4096
_WRITE_PIECE = 1 << 20


def check_chunk_id(chunk_id: str) -> str:
    if not _ID.fullmatch(chunk_id):
        raise InvalidArgument(f"not a chunk id: {chunk_id!r}")
    return chunk_id


class Oversized(Exception):
    """A file under an object's name is larger than any chunk object can be."""


class CacheFiles:
    """The object and temp files under one cache directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.objects = root / OBJECTS
        self.temp = root / TEMP

    def make_dirs(self) -> None:
        for path in (self.objects, self.temp):
            with contextlib.suppress(FileExistsError):
                path.mkdir(mode=DIR_MODE)
            if not stat.S_ISDIR(path.lstat().st_mode):
                raise FileExistsError(errno.EEXIST, "not a directory", str(path))

    def object_path(self, scope: str, chunk_id: str) -> Path:
        return self.objects / scope / chunk_id[:2] / chunk_id

    def exists(self, scope: str, chunk_id: str) -> bool:
        try:
            return stat.S_ISREG(self.object_path(scope, chunk_id).lstat().st_mode)
        except OSError:
            return False

    def read(self, scope: str, chunk_id: str) -> bytes | None:
        """The object's bytes, or ``None`` when there is none; ``Oversized`` if too large."""
        try:
            fd = os.open(
                self.object_path(scope, chunk_id), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
            )
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size > MAX_OBJECT_BYTES:
                raise Oversized(f"{size} bytes")
            pieces = []
            left = size
            while left > 0:
                piece = os.read(fd, left)
                if not piece:
                    break
                pieces.append(piece)
                left -= len(piece)
            return b"".join(pieces)
        finally:
            os.close(fd)

    def write(self, scope: str, chunk_id: str, data: bytes, temp_name: str) -> None:
        """Write ``data`` as the object (temp file, then rename); the temp file is removed on
        failure. ``temp_name`` is unique to this write (it carries the writer's token)."""
        temp = self.temp / temp_name
        fd = os.open(
            temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE
        )
        try:
            try:
                view = memoryview(data)
                while view:
                    done = os.write(fd, view[:_WRITE_PIECE])
                    view = view[done:]
            finally:
                os.close(fd)
            final = self.object_path(scope, chunk_id)
            final.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            os.rename(temp, final)
        except BaseException:
            self.remove_temp(temp_name)
            raise

    def unlink(self, scope: str, chunk_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.object_path(scope, chunk_id))

    def temp_names(self) -> list[str]:
        try:
            return os.listdir(self.temp)
        except FileNotFoundError:
            return []

    def remove_temp(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temp / name)

    def walk(self) -> Iterator[tuple[str, str, int, int]]:
        """``(scope, chunk id, size, mtime ns)`` of every object file; anything else under
        ``objects/`` (a stray name, a symlink, a misplaced file) is removed on the way."""
        for scope_entry in _entries(self.objects):
            if not (
                _SCOPE.fullmatch(scope_entry.name) and scope_entry.is_dir(follow_symlinks=False)
            ):
                _remove_stray(scope_entry)
                continue
            for fan in _entries(Path(scope_entry.path)):
                if not (len(fan.name) == 2 and fan.is_dir(follow_symlinks=False)):
                    _remove_stray(fan)
                    continue
                for obj in _entries(Path(fan.path)):
                    name = obj.name
                    if not (
                        _ID.fullmatch(name)
                        and name[:2] == fan.name
                        and obj.is_file(follow_symlinks=False)
                    ):
                        _remove_stray(obj)
                        continue
                    st = obj.stat(follow_symlinks=False)
                    yield scope_entry.name, name, st.st_size, st.st_mtime_ns


def _entries(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


def _remove_stray(entry: os.DirEntry[str]) -> None:
    """Remove a file or symlink that is no object; a stray directory is only logged (we never
    delete a tree we did not make)."""
    if entry.is_dir(follow_symlinks=False):
        log.warning("chunk cache: %s is not ours; left alone", entry.path)
        return
    log.warning("chunk cache: removing %s (not a chunk object)", entry.path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(entry.path)
