"""The tmpfs files a process tree holds (POSIX shared memory in /dev/shm, semaphores, ...),
saved with its checkpoint and put back before CRIU restores it.

CRIU records an open or mapped file by name and size and expects to find it at restore; a file
on tmpfs lives in memory only, so it is gone after a reboot, on another node, or once its last
user deleted it. gpusnap saves them as files of the checkpoint, chunked and deduplicated in the
store like the images:

- **When**: while the tree is frozen, after CRIU has dumped it and before it kills or thaws it —
  CRIU's ``post-dump`` action script (``criu.py`` passes ``--action-script``), which runs this
  file as a script. A leave-running tree cannot change the files between the dump and the copy.
- **What**: every regular file on a tmpfs mount that a process of the tree has open
  (``/proc/PID/fd``) or mapped (``/proc/PID/map_files``), once per inode, with each name it has
  in its directory. A file deleted while open but linked elsewhere (a POSIX semaphore made under
  a temporary name) is dumped by CRIU through ``--link-remap``: a ``link_remap.N`` name CRIU adds
  beside it, which CRIU deletes again after a leave-running dump — it is saved here with the
  rest, as one more name of the inode, so the restore finds it on any node. A file with no name
  left at all is CRIU's own business (a ghost file, in its images).
- **Where**: ``gpusnap-tmpfs/`` in the images directory: ``index.json`` (names, size, mode,
  owner per inode) and ``data/N``, written sparse (a 240 MB shared-memory segment that holds
  little costs little).
- **Back**: ``put_back`` before ``criu restore`` writes each inode under its first name (a new
  file renamed into place), links the other names to it, and sets mode and owner; holes stay
  holes, so tmpfs memory is spent only on what the tree had written.

Standard library only: CRIU runs this file with ``python -I`` in its action script.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DIR = "gpusnap-tmpfs"
INDEX = "index.json"
_DELETED = " (deleted)"
_BLOCK = 1 << 20
_TMPFS = ("tmpfs", "shm")


@dataclass
class _Held:
    """One inode on tmpfs the tree holds: a way to open it and the names it has."""

    opener: str  # /proc/PID/fd/N or /proc/PID/map_files/RANGE
    st: os.stat_result
    dirs: set[str]
    names: list[str]


def tree_pids(root: int) -> list[int]:
    """``root`` and its descendants (threads' children included), from /proc."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
            except OSError:
                continue
    return out


def _mount_of(path: str, mounts: list[tuple[str, str]]) -> str:
    for point, _ in mounts:
        if path == point or path.startswith(point.rstrip("/") + "/"):
            return point
    return "/"


def _mounts(pid: int | str) -> list[tuple[str, str]]:
    """(mount point, file system type) as ``pid`` sees them, longest point first; of one
    point mounted over, the one on top wins (``dict`` keeps the last)."""
    mounts: list[tuple[str, str]] = []
    with open(f"/proc/{pid}/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            mounts.append((left.split()[4], right.split()[0] if right else ""))
    mounts.sort(key=lambda m: len(m[0]), reverse=True)
    return mounts


def on_tmpfs(path: str, mounts: list[tuple[str, str]]) -> bool:
    return dict(mounts).get(_mount_of(path, mounts)) in _TMPFS


def held_files(root: int) -> list[_Held]:
    """The regular tmpfs files the tree under ``root`` has open or mapped, one per inode."""
    all_mounts = _mounts(root)
    held: dict[tuple[int, int], _Held] = {}
    for pid in tree_pids(root):
        for sub in ("fd", "map_files"):
            base = f"/proc/{pid}/{sub}"
            try:
                entries = os.listdir(base)
            except OSError:
                continue
            for entry in entries:
                opener = f"{base}/{entry}"
                try:
                    target = os.readlink(opener)
                except OSError:
                    continue
                if not target.startswith("/"):
                    continue  # a socket, a pipe, an anon inode, a memfd
                path = target.removesuffix(_DELETED)
                if not on_tmpfs(path, all_mounts):
                    continue
                try:
                    st = os.stat(opener)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                key = (st.st_dev, st.st_ino)
                h = held.setdefault(key, _Held(opener, st, set(), []))
                h.dirs.add(os.path.dirname(path))
    for h in held.values():
        for d in sorted(h.dirs):
            try:
                names = sorted(os.listdir(d))
            except OSError:
                continue
            for name in names:
                p = os.path.join(d, name)
                try:
                    st = os.lstat(p)
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) == (h.st.st_dev, h.st.st_ino):
                    h.names.append(p)
    return [h for h in held.values() if h.names]


def capture(root: int, images: Path) -> int:
    """Save the tmpfs files the tree under ``root`` holds into ``images/gpusnap-tmpfs``;
    the bytes of data they hold (their holes not counted). Nothing written when none."""
    held = held_files(root)
    if not held:
        return 0
    out = images / DIR
    (out / "data").mkdir(parents=True)
    index: list[dict[str, Any]] = []
    total = 0
    for i, h in enumerate(held):
        rel = f"data/{i}"
        with open(h.opener, "rb") as src:
            total += _copy_sparse(src.fileno(), out / rel, h.st.st_size)
        index.append(
            {
                "names": h.names,
                "size": h.st.st_size,
                "mode": stat.S_IMODE(h.st.st_mode),
                "uid": h.st.st_uid,
                "gid": h.st.st_gid,
                "data": rel,
            }
        )
    (out / INDEX).write_text(json.dumps({"version": 1, "files": index}, indent=1) + "\n")
    return total


def saved(images: Path) -> list[dict[str, Any]]:
    """The index of what ``capture`` saved in ``images`` (empty when nothing was)."""
    path = images / DIR / INDEX
    if not path.is_file():
        return []
    doc = json.loads(path.read_text())
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, list):
        raise ValueError(f"{path}: no list of files")  # noqa: TRY004 - a bad file
    return files


def put_back(images: Path) -> list[str]:
    """Write the tmpfs files saved in ``images`` back where they were (each inode under its
    names; what is there now is replaced). The names written. ``ValueError`` on a bad index,
    ``OSError`` when a file cannot be written."""
    written: list[str] = []
    files = saved(images)
    mounts = _mounts("self") if files else []
    for f in files:
        names, data = f.get("names"), f.get("data")
        if not isinstance(names, list) or not names or not isinstance(data, str):
            raise ValueError(f"{images / DIR / INDEX}: bad entry {f!r}")
        if any(not isinstance(n, str) or not n.startswith("/") or ".." in n for n in names):
            raise ValueError(f"{images / DIR / INDEX}: bad names {names!r}")
        # Only ever into tmpfs: whatever an index says, nothing on disk is overwritten.
        if not all(on_tmpfs(n, mounts) for n in names):
            raise ValueError(f"not on a tmpfs file system on this node: {', '.join(names)}")
        first = names[0]
        os.makedirs(os.path.dirname(first), exist_ok=True)
        tmp = f"{os.path.dirname(first)}/.gpusnap-{os.getpid()}-{os.path.basename(first)}"
        with open(images / DIR / data, "rb") as src:
            _copy_sparse(src.fileno(), Path(tmp), int(f["size"]))
        os.chown(tmp, int(f["uid"]), int(f["gid"]))
        os.chmod(tmp, int(f["mode"]))
        os.replace(tmp, first)
        written.append(first)
        for other in names[1:]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(other)
            os.link(first, other)
            written.append(other)
    return written


def remove_link_remaps(images: Path) -> None:
    """After a kill-mode dump: CRIU's ``link_remap.N`` names are saved in the checkpoint and
    put back by the restore, so the ones left in tmpfs (memory) go now."""
    for f in saved(images):
        for name in f.get("names", []):
            if isinstance(name, str) and os.path.basename(name).startswith("link_remap."):
                with contextlib.suppress(OSError):
                    os.unlink(name)


def _copy_sparse(src: int, dst: Path, size: int) -> int:
    """Copy the ``size`` bytes of ``src`` into a new file ``dst``, leaving its holes (and
    blocks of zeros) as holes. The bytes written."""
    written = 0
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        pos = 0
        while pos < size:
            try:
                pos = os.lseek(src, pos, os.SEEK_DATA)
                end = os.lseek(src, pos, os.SEEK_HOLE)
            except OSError:
                break  # no data past pos (ENXIO)
            while pos < end:
                buf = os.pread(src, min(_BLOCK, end - pos), pos)
                if not buf:
                    break
                if buf.count(0) != len(buf):
                    os.pwrite(fd, buf, pos)
                    written += len(buf)
                pos += len(buf)
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return written


def main(argv: list[str]) -> int:
    """CRIU's action script: ``tmpfsfiles.py IMAGES`` with ``CRTOOLS_SCRIPT_ACTION`` and
    ``CRTOOLS_INIT_PID`` set by CRIU; acts on ``post-dump`` only. A failure (one line on
    stderr, exit 1) fails the dump, and CRIU leaves the tree running."""
    if os.environ.get("CRTOOLS_SCRIPT_ACTION") != "post-dump":
        return 0
    try:
        capture(int(os.environ["CRTOOLS_INIT_PID"]), Path(argv[0]))
    except (OSError, KeyError, ValueError) as exc:
        sys.stderr.write(f"saving the tree's tmpfs files: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
