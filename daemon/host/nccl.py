"""Which NCCL a process maps, and its version: what the stamp records of a GPU worker.

A tensor-parallel worker talks to its peers through NCCL; a checkpoint records the library
each CUDA process has mapped and its version, so a restore can be judged against the NCCL
the node has. The version comes from the file name where it says it
(``libnccl.so.2.21.5``), else from the library's own banner string (``NCCL version
2.21.5+cuda12.4``, which ``ncclGetVersion``'s callers print), read from the file.
"""

from __future__ import annotations

import mmap
import re
from pathlib import Path

from gpusnap.daemon.host import proctree
from gpusnap.errors import GpusnapError

_NAME = re.compile(r"/libnccl\.so(?:\.(\d+(?:\.\d+)*))?$")
_BANNER = re.compile(rb"NCCL version (\d+\.\d+\.\d+)")
_SCAN_LIMIT = 1 << 30  # a library larger than this is not read for its banner


def nccl_of(pid: int) -> dict[str, str | None] | None:
    """``{"path", "version"}`` of the libnccl ``pid`` maps, or None when it maps none."""
    try:
        paths = sorted(p for p in proctree.mapped_paths(pid) if _NAME.search(p))
    except GpusnapError:
        return None  # gone, or not ours to read: nothing to record
    if not paths:
        return None
    path = paths[0]
    found = _NAME.search(path)
    named = found.group(1) if found else None
    version = named if named and named.count(".") == 2 else _banner(Path(path)) or named
    return {"path": path, "version": version}


def _banner(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if not 0 < size <= _SCAN_LIMIT:
                return None
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                found = _BANNER.search(data)
                return bytes(found.group(1)).decode() if found else None
    except (OSError, ValueError):
        return None
