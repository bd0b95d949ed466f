"""Shared host buffers between the daemon and its GPU worker, for custom-storage copies.

The daemon creates the ring (a file in /dev/shm, mode 0600, mapped shared) and reads or
fills it; the worker maps the same file and, with the real driver, page-locks it
(``cuMemHostRegister``) so that ``cuMemcpyDtoHAsync``/``cuMemcpyHtoDAsync`` run at pinned
speed straight between the GPU and these pages. The ring is cut into ``slots`` of
``slot_bytes``; the daemon uses one half while the worker copies into or out of the other.

Plain files in /dev/shm rather than ``multiprocessing.shared_memory``: its resource tracker
would unlink the segment when the *worker* (which only attaches) exits (Python < 3.13).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from pathlib import Path

from gpusnap.errors import InvalidArgument, Unavailable

SHM_DIR = Path("/dev/shm")
RING_PREFIX = "gpusnap-ring-"


def ring_path(name: str) -> Path:
    """The file of ring ``name``; names come from ``HostRing`` and nothing else is allowed."""
    if not name.startswith(RING_PREFIX) or "/" in name or not name[len(RING_PREFIX) :].isalnum():
        raise InvalidArgument(f"not a gpusnap ring name: {name!r}")
    return SHM_DIR / name


def map_ring(name: str, size: int) -> mmap.mmap:
    """Map an existing ring (the worker's side)."""
    fd = os.open(ring_path(name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size != size:
            raise InvalidArgument(f"ring {name} is not {size} bytes")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class HostRing:
    """The daemon's side: creates, maps and finally removes the ring."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        if slots < 2 or slots % 2:
            raise InvalidArgument(f"a ring needs an even number of slots, at least 2, not {slots}")
        if slot_bytes < 4096:
            raise InvalidArgument(f"ring slots must hold at least 4096 bytes, not {slot_bytes}")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.size = slots * slot_bytes
        self.name = f"{RING_PREFIX}{os.getpid()}x{secrets.token_hex(6)}"
        path = ring_path(self.name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise Unavailable(f"cannot create shared buffer {path}: {exc.strerror}") from exc
        try:
            os.ftruncate(fd, self.size)
            self._map: mmap.mmap | None = mmap.mmap(fd, self.size, mmap.MAP_SHARED)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise Unavailable(f"cannot map shared buffer {path}: {exc.strerror}") from exc
        finally:
            os.close(fd)

    @property
    def half(self) -> int:
        return self.slots // 2

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def view(self, offset: int, length: int) -> memoryview:
        """A view of ring bytes; release it before ``close``."""
        if self._map is None:
            raise InvalidArgument(f"ring {self.name} is closed")
        return memoryview(self._map)[offset : offset + length]

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        ring_path(self.name).unlink(missing_ok=True)

    def __enter__(self) -> HostRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
