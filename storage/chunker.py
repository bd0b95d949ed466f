"""Content-defined chunking of files, with bounded memory whatever their size.

Boundaries come from FastCDC (a gear rolling hash): a cut depends only on the bytes just
before it, so inserting or removing a few pages near the start of a file moves the first
chunk or two and leaves every later chunk as it was. CRIU page images of the same process
shift exactly this way between checkpoints.

Parameters: 512 KiB min / 2 MiB average / 8 MiB max (see docs/design.md). Files are
memory-mapped: the kernel pages data in and can drop it again, so the process never holds a
whole file; chunks are ``memoryview`` slices of the map (no copies).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyfastcdc

MIN_SIZE = 512 * 1024
AVG_SIZE = 2 * 1024 * 1024
MAX_SIZE = 8 * 1024 * 1024
# Below this a file is read into memory in one go: a map costs more than it saves.
SMALL_FILE = 1024 * 1024


@dataclass(frozen=True)
class ChunkerParams:
    min_size: int = MIN_SIZE
    avg_size: int = AVG_SIZE
    max_size: int = MAX_SIZE


DEFAULT_PARAMS = ChunkerParams()


class Chunker:
    """Cuts buffers and files into content-defined chunks."""

    def __init__(self, params: ChunkerParams = DEFAULT_PARAMS) -> None:
        self.params = params
        self._cdc = pyfastcdc.FastCDC(
            avg_size=params.avg_size, min_size=params.min_size, max_size=params.max_size
        )

    def cut(self, buf: memoryview | bytes) -> Iterator[tuple[int, int]]:
        """``(offset, length)`` of each chunk of ``buf``, in order."""
        if len(buf) == 0:
            return
        for chunk in self._cdc.cut_buf(buf):
            yield int(chunk.offset), int(chunk.length)

    def open_view(self, path: Path) -> memoryview:
        """A read-only view of the whole file: mapped, or read into memory when small.

        The map is unmapped when the view and every slice of it have been released, so slices
        can be handed to worker threads without keeping the file open.
        """
        with path.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < SMALL_FILE:
                return memoryview(fh.read())
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        with contextlib.suppress(AttributeError, OSError):  # older kernels lack the advice
            mapped.madvise(mmap.MADV_SEQUENTIAL)
        return memoryview(mapped)

    def chunks_of_file(self, path: Path) -> list[tuple[int, int]]:
        """All ``(offset, length)`` cuts of a file (a convenience for tests and tools)."""
        view = self.open_view(path)
        try:
            return list(self.cut(view))
        finally:
            view.release()
