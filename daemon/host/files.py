"""The regular files a process tree has open or mapped, with how it uses each.

The stamp records them (``stamp.file_entry``) and the compatibility gate applies a rule per
kind (``docs/compat.md``): ``mapped``, ``open-ro`` (read only), ``open-rw`` (written by the
process) or ``open-append``. Read from ``/proc/<pid>/maps``, ``fd`` and ``fdinfo``.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpusnap.daemon.host import proctree
from gpusnap.errors import GpusnapError

# Files whose content is the kernel's or a device's, not something a restore could find changed.
_PSEUDO_PREFIXES = ("/proc/", "/sys/", "/dev/", "/memfd:", "/anon_inode:")
# A file used two ways is recorded by the one the gate is strictest about.
_RANK = {"mapped": 0, "open-ro": 1, "open-append": 2, "open-rw": 3}


def watched_files(pids: list[int]) -> list[tuple[str, str]]:
    """(path, kind) of the regular files the processes ``pids`` have open or mapped, by path.

    A process that exits meanwhile is skipped; so is any file it cannot be asked about.
    """
    kinds: dict[str, str] = {}

    def add(path: str, kind: str) -> None:
        if path.startswith(_PSEUDO_PREFIXES) or path.endswith(" (deleted)"):
            return
        if path not in kinds or _RANK[kind] >= _RANK[kinds[path]]:
            kinds[path] = kind

    for pid in pids:
        try:
            for path in proctree.mapped_paths(pid):
                add(path, "mapped")
        except GpusnapError:
            continue
        for target, flags in _open_fds(pid):
            if flags & os.O_ACCMODE == os.O_RDONLY:
                add(target, "open-ro")
            elif flags & os.O_APPEND:
                add(target, "open-append")
            else:
                add(target, "open-rw")
    return sorted(kinds.items())


def _open_fds(pid: int) -> list[tuple[str, int]]:
    """(absolute target, open flags) of each fd of ``pid`` that names a path."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return []
    out: list[tuple[str, int]] = []
    for fd in fds:
        try:
            target = os.readlink(fd)
            flags = _fd_flags(pid, fd.name)
        except OSError:
            continue
        if target.startswith("/"):
            out.append((target, flags))
    return out


def _fd_flags(pid: int, fd: str) -> int:
    for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    return 0
