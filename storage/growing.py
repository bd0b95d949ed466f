"""Chunks of a file that another process is still appending to (CRIU writing a page image).

The file is mapped in windows as it grows, and each window is cut from the last cut on:
FastCDC decides a cut from the bytes since the previous one, so every chunk of a window but
its last is a chunk of the finished file (the last may have been cut short by the window's
end; it is cut again from the next window). Once the writer is done, the rest is cut to
the end. The chunks are views of the maps, as for a finished file: no byte is copied and no
memory is allocated per chunk (fresh memory is what costs in a VM that hands freed pages
back to the host).

The writer must only append: the daemon checks each file's size after the dump and reads
any that changed again (``storage/push.py``, ``UploadedStreams.of_files``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Callable, Generator
from pathlib import Path

from gpusnap.errors import InvalidArgument
from gpusnap.storage.chunker import Chunker
from gpusnap.storage.pipeline import NamedChunk, PushInput
from gpusnap.storage.streams import UNKNOWN_SIZE

POLL_SECONDS = 0.003  # between looks at a file that has not grown enough


def growing_file_input(
    path: Path,
    name: str,
    chunker: Chunker,
    complete: Callable[[], bool],
    *,
    stop: Callable[[], bool] = lambda: False,
) -> PushInput:
    """A push input for ``path`` (entry ``name``), cut while it grows.

    ``complete()`` says the writer is done with the file (then its size is final); ``stop()``
    abandons it (the push fails with ``InvalidArgument``).
    """
    window = 2 * chunker.params.max_size  # enough for at least two chunks
    try:
        mode = path.stat().st_mode & 0o777
    except OSError as exc:
        raise InvalidArgument(f"cannot read {path}: {exc.strerror}") from exc

    def named() -> Generator[NamedChunk, None, None]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise InvalidArgument(f"cannot read {path}: {exc.strerror}") from exc
        try:
            pos = 0  # always at a cut
            while True:
                if stop():
                    raise InvalidArgument(f"stopped reading {path} while it was written")
                size = os.fstat(fd).st_size
                final = False
                if size - pos < window:
                    if not complete():
                        time.sleep(POLL_SECONDS)
                        continue
                    size = os.fstat(fd).st_size  # the writer is done: this is the end
                    final = True
                if size < pos:
                    raise InvalidArgument(f"{path} shrank while it was read")
                if size == pos:
                    return
                base = pos // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
                mapped = mmap.mmap(fd, size - base, offset=base, access=mmap.ACCESS_READ)
                with contextlib.suppress(AttributeError, OSError):
                    mapped.madvise(mmap.MADV_SEQUENTIAL)
                view = memoryview(mapped)[pos - base :]
                try:
                    cuts = list(chunker.cut(view))
                    if not final:
                        cuts = cuts[:-1]  # may have been cut short by the window's end
                    for offset, length in cuts:
                        yield view[offset : offset + length], None
                        pos += length
                finally:
                    view.release()  # the map goes when its last chunk is released
                if final:
                    return
        finally:
            os.close(fd)

    return PushInput.of_named(name, UNKNOWN_SIZE, mode, named)
