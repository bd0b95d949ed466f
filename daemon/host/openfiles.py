"""Files a checkpointed tree held open, fitted back to the size CRIU recorded.

CRIU records the size of every regular file a task holds open (but those opened
``O_WRONLY|O_APPEND``: logs) and refuses to restore an fd on a file whose size differs: ``File
… has bad size N (expect M)`` (criu/files-reg.c, ``validate_file``). A file the tree goes on
writing after a ``--leave-running`` dump (a log, a spill file written at its end) is longer by
the restore. Cutting it back to the recorded size makes it what it was at the dump, and the
restored task goes on writing from its recorded offset. A process tree's files are fitted in
place (``host/criu.py``); a container's rw-layer diff through ``containers/openfiles.py``.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from gpusnap.daemon.host.criuimg import entries, fields, zigzag
from gpusnap.errors import Corrupt

_FILES_MAGIC = 0x56303138  # FILES_MAGIC (criu/include/magic.h): files.img
_MNTS_MAGIC = 0x55563928  # MNTS_MAGIC: mountpoints-<ns>.img
_FD_TYPE_REG = 1  # fd_types.REG (criu/images/fdinfo.proto)
# file_entry (fdinfo.proto): 1 type, 3 reg. reg_file_entry (regfile.proto): 2 flags,
# 6 name, 7 mnt_id (sint32), 8 size. mnt_entry (mnt.proto): 2 mnt_id, 7 mountpoint.


@dataclass(frozen=True)
class Fitted:
    """One file of the rw layer cut back to the size CRIU recorded at the dump."""

    path: str  # as the container sees it
    bytes_stored: int  # its size in the checkpoint's rw-layer diff
    bytes_recorded: int  # CRIU's record at the dump, what it is cut to

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "bytes_stored": self.bytes_stored,
            "bytes_recorded": self.bytes_recorded,
        }


def recorded_sizes(images: Path, *, host_tree: bool = False) -> dict[str, int]:
    """Path (relative to the container's root) -> size, of each regular file on the root mount
    that CRIU recorded a size for, from the images in ``images``; empty where there are none
    (no ``files.img``). ``Corrupt`` when the images cannot be read.

    ``host_tree``: the images are of a process tree in the host's mount namespace (gpusnap's
    process-tree checkpoints, ``host/criu.py``): every file counts, its path relative to the
    host's ``/``, but only those the tree had open for writing (a log; what it only reads is
    not its to cut)."""
    files = images / "files.img"
    if not files.is_file():
        return {}
    try:
        roots = set()
        for mounts in sorted(images.glob("mountpoints-*.img")):
            for e in entries(mounts.read_bytes(), _MNTS_MAGIC):
                m = fields(e)
                if m.get(7) == b"/" and isinstance(m.get(2), int):
                    roots.add(m[2])
        out: dict[str, int] = {}
        for e in entries(files.read_bytes(), _FILES_MAGIC):
            f = fields(e)
            reg = f.get(3)
            if f.get(1) != _FD_TYPE_REG or not isinstance(reg, bytes):
                continue
            r = fields(reg)
            name, mnt, size, flags = r.get(6), r.get(7), r.get(8), r.get(2)
            if not isinstance(name, bytes) or not isinstance(size, int):
                continue
            if host_tree:
                if not isinstance(flags, int) or flags & os.O_ACCMODE == os.O_RDONLY:
                    continue
            elif not isinstance(mnt, int) or zigzag(mnt) not in roots:
                continue
            rel = relative_path(name.decode("utf-8", "surrogateescape"))
            if rel is not None:
                out[rel] = size
        return out
    except (OSError, ValueError) as exc:
        raise Corrupt(f"CRIU images in {images}: {exc}") from exc


def fit_tree(upper: Path, sizes: dict[str, int]) -> list[Fitted]:
    """The same for an rw layer that is a directory (runc's ``upper`` restored in place):
    each longer regular file truncated in place. A path through a symlink is left alone: what
    the images name never reaches outside ``upper``."""
    done: list[Fitted] = []
    for rel, want in sorted(sizes.items()):
        path = upper / rel
        cur = upper
        if any((cur := cur / part).is_symlink() for part in PurePosixPath(rel).parts):
            continue
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # not in the rw layer: the image's file, unchanged
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size <= want:
                continue
            os.ftruncate(fd, want)
            done.append(Fitted("/" + rel, st.st_size, want))
        finally:
            os.close(fd)
    return done


def relative_path(name: str) -> str | None:
    """``name`` (absolute, or a tar member's ``./a/b``) as a plain relative path; None when it
    is not one (``..``, empty)."""
    parts = [p for p in PurePosixPath(name).parts if p not in ("/", ".")]
    if not parts or ".." in parts:
        return None
    return "/".join(parts)
