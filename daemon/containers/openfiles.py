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
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any

from gpusnap.daemon.containers.model import PART_CRIU, CheckpointParts
from gpusnap.daemon.host.openfiles import Fitted, recorded_sizes, relative_path
from gpusnap.errors import Corrupt

log = logging.getLogger(__name__)

_COPY = 1 << 20
ROOTFS_DIFF = "rootfs-diff.tar"  # the rw-layer diff as podman exports it and runc's body writes


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
        rel = relative_path(m.name)
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


def _copy(src: Any, dst: Any, n: int) -> None:
    while n > 0:
        buf = src.read(min(_COPY, n))
        if not buf:
            raise Corrupt(f"{src.name}: cut short")
        dst.write(buf)
        n -= len(buf)
