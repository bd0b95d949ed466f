"""Files a container held open in its rw layer, fitted back to the size CRIU recorded.

CRIU records the size of every regular file a task holds open (but those opened
``O_WRONLY|O_APPEND``: logs) and refuses to restore an fd on a file whose size differs: ``File
… has bad size N (expect M)`` (criu/files-reg.c, ``validate_file``). podman and runc export the
container's rw-layer diff after CRIU returns, and with ``--leave-running`` the container runs
again by then, so a file it goes on writing there is longer in the diff than at the dump, and
the checkpoint would not restore. (containerd's ``ctr`` diffs the rw layer while it holds the
task paused for CRIU, so its checkpoint has nothing to fit: tests/containers/test_containerd.py.)

Before a restore gpusnap cuts each such file back to the size CRIU recorded: what it was at the
dump, for a file that only grew past it — a log or a spill file written at its end, as the
restored task goes on writing from its recorded offset. Only files on the container's root
mount (the overlay: ``mountpoint`` ``/`` in CRIU's mount image) that the diff holds are touched;
a file that is now shorter than recorded cannot be fitted, and the restore then fails with
CRIU's error naming it. Bytes rewritten *inside* the recorded size after the dump stay as the
diff has them: a leave-running checkpoint's files are not a snapshot (docs/containers.md).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from gpusnap.daemon.containers.criuimg import entries, fields, zigzag
from gpusnap.daemon.containers.model import PART_CRIU, CheckpointParts
from gpusnap.errors import Corrupt

log = logging.getLogger(__name__)

_FILES_MAGIC = 0x56303138  # FILES_MAGIC (criu/include/magic.h): files.img
_MNTS_MAGIC = 0x55563928  # MNTS_MAGIC: mountpoints-<ns>.img
_FD_TYPE_REG = 1  # fd_types.REG (criu/images/fdinfo.proto)
# file_entry (fdinfo.proto): 1 type, 3 reg. reg_file_entry (regfile.proto): 2 flags,
# 6 name, 7 mnt_id (sint32), 8 size. mnt_entry (mnt.proto): 2 mnt_id, 7 mountpoint.
_COPY = 1 << 20
ROOTFS_DIFF = "rootfs-diff.tar"  # the rw-layer diff as podman exports it and runc's body writes


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
            rel = _relative(name.decode("utf-8", "surrogateescape"))
            if rel is not None:
                out[rel] = size
        return out
    except (OSError, ValueError) as exc:
        raise Corrupt(f"CRIU images in {images}: {exc}") from exc


def fit_parts(parts: CheckpointParts) -> list[Fitted]:
    """Fit the parts' rw-layer diff (``rootfs-diff.tar``: podman's and runc's) to what CRIU
    recorded; nothing where the parts have no such diff or no CRIU image directory."""
    images = criu_images(parts)
    if images is None or ROOTFS_DIFF not in parts.parts:
        return []
    return fit_tar(parts.directory / ROOTFS_DIFF, recorded_sizes(images))


def criu_images(parts: CheckpointParts) -> Path | None:
    """The directory of the parts' CRIU images (podman's ``checkpoint/``, runc's ``criu/``);
    None where they are not a directory (containerd packs them into one blob)."""
    for rel, kind in parts.parts.items():
        if kind == PART_CRIU and PurePosixPath(rel).name == "files.img":
            return (parts.directory / rel).parent
    return None


def fit_tar(archive: Path, sizes: dict[str, int]) -> list[Fitted]:
    """Rewrite the tar ``archive`` (a rw-layer diff) with each regular file that ``sizes``
    names and that is longer cut to its recorded size; everything else is copied byte for
    byte. Nothing is written when nothing needs fitting."""
    if not sizes:
        return []
    with tarfile.open(archive) as t:
        members = [m for m in t.getmembers() if m.isreg()]
    todo: list[tuple[tarfile.TarInfo, str, int]] = []  # in the archive's order
    for m in members:
        rel = _relative(m.name)
        want = sizes.get(rel) if rel is not None else None
        if rel is None or want is None or m.size == want:
            continue
        if m.size < want or m.issparse():
            log.warning(
                "the rw layer's /%s is %d bytes, %d at the dump: it cannot be fitted",
                rel,
                m.size,
                want,
            )
            continue
        todo.append((m, rel, want))
    if not todo:
        return []
    out = archive.with_name(f".{archive.name}.fitted")
    with open(archive, "rb") as src, open(out, "wb") as dst:
        pos = 0
        for m, _, want in todo:
            _copy(src, dst, m.offset - pos)
            info = copy.copy(m)
            info.size = want
            info.pax_headers = {k: v for k, v in m.pax_headers.items() if k != "size"}
            dst.write(info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape"))
            src.seek(m.offset_data)
            _copy(src, dst, want)
            dst.write(tarfile.NUL * (-want % tarfile.BLOCKSIZE))
            pos = m.offset_data + m.size + (-m.size % tarfile.BLOCKSIZE)
            src.seek(pos)
        shutil.copyfileobj(src, dst, _COPY)
    shutil.copymode(archive, out)
    os.replace(out, archive)
    return [Fitted("/" + rel, m.size, want) for m, rel, want in todo]


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


def log_fitted(container: str, fitted: list[Fitted]) -> None:
    for f in fitted:
        log.warning(
            "restore of %s: %s was %d bytes in its rw layer, %d at the dump (it ran on after a "
            "leave-running checkpoint): cut back to %d",
            container,
            f.path,
            f.bytes_stored,
            f.bytes_recorded,
            f.bytes_recorded,
        )


def _relative(name: str) -> str | None:
    """``name`` (absolute, or a tar member's ``./a/b``) as a plain relative path; None when it
    is not one (``..``, empty)."""
    parts = [p for p in PurePosixPath(name).parts if p not in ("/", ".")]
    if not parts or ".." in parts:
        return None
    return "/".join(parts)


def _copy(src: Any, dst: Any, n: int) -> None:
    while n > 0:
        buf = src.read(min(_COPY, n))
        if not buf:
            raise Corrupt(f"{src.name}: cut short")
        dst.write(buf)
        n -= len(buf)
