"""Virtual files: checkpoint entries whose bytes come from a stream of buffers, not a file.

The daemon copies GPU device memory itself (custom storage) through a small ring of pinned
host buffers; those buffers go straight into the store's chunk pipeline, without ever being
written to a file. A ``StreamSource`` declares its total size and yields buffers in order;
``cut_stream`` turns them into the same content-defined chunks a file with the same bytes
would get (FastCDC over a rolling window), with memory bounded by the window, whatever the
size of the stream.

In the manifest a stream is an ordinary file entry (path, size, mode, chunks), so a reader
that knows nothing of streams pulls it as a file. What kind of stream it was is recorded in
the manifest's ``extra["streams"]`` (``{path: {"kind": ...}}``); ``stream_kinds`` reads it.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpusnap.errors import Corrupt, InvalidArgument
from gpusnap.storage.chunker import Chunker
from gpusnap.storage.manifest import FileEntry, Manifest, check_relative_path

STREAMS_EXTRA_KEY = "streams"
GPU_MEMORY_KIND = "gpu-memory"

Buffer = bytes | bytearray | memoryview


# The size of a push input known only when it ends (``storage/growing.py``); a
# ``StreamSource`` always declares its size.
UNKNOWN_SIZE = -1


@dataclass
class StreamSource:
    """``size`` bytes, yielded in order by ``buffers`` in pieces of any length.

    A yielded buffer need only stay valid until the next one is asked for: the pipeline
    copies it before it does (so a producer may reuse one ring of buffers).
    """

    size: int
    buffers: Iterable[Buffer]
    kind: str = "stream"
    mode: int = 0o600


@dataclass
class UploadedStreams:
    """Streams whose chunks are in the store, waiting for a manifest to name them.

    On a backend that defers durability (``file://``) the chunks become durable when the
    ``push`` that names them syncs the store, before it writes its manifest.

    Made by ``CheckpointStore.upload_streams``; handed to ``CheckpointStore.push`` through
    ``uploaded_streams``. Until a manifest refers to them the chunks are unreferenced and a
    gc may remove them once they are older than its grace period (default one hour).
    """

    entries: list[FileEntry] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)
    bytes_total: int = 0
    bytes_uploaded: int = 0
    chunks_total: int = 0
    chunks_uploaded: int = 0
    seconds: float = 0.0
    # Paths whose stream is the bytes of the file of that path in the tree a ``push`` reads
    # (uploaded while another process wrote it): the push uses the stream, not the file.
    of_files: set[str] = field(default_factory=set)
    # Chunks not put because the local index listed them: the push that names them proves
    # they are in the store before committing (a stream cannot be read again to re-put one).
    unproven: set[str] = field(default_factory=set)

    def merge(self, other: UploadedStreams) -> None:
        taken = {e.path for e in self.entries}
        for entry in other.entries:
            if entry.path in taken:
                raise InvalidArgument(f"stream {entry.path!r} uploaded twice")
        self.entries.extend(other.entries)
        self.kinds.update(other.kinds)
        self.bytes_total += other.bytes_total
        self.bytes_uploaded += other.bytes_uploaded
        self.chunks_total += other.chunks_total
        self.chunks_uploaded += other.chunks_uploaded
        self.seconds += other.seconds
        self.of_files |= other.of_files
        self.unproven |= other.unproven


def check_stream_path(path: str) -> str:
    """A stream's manifest path must be a safe relative path, like any file's."""
    try:
        return check_relative_path(path)
    except Corrupt as exc:
        raise InvalidArgument(f"invalid stream path: {exc}") from None


def window_bytes(chunker: Chunker) -> int:
    """How many bytes ``cut_stream`` holds at most (besides chunks handed on)."""
    return 2 * chunker.params.max_size


def cut_stream(
    chunker: Chunker, source: StreamSource, path: str
) -> Generator[memoryview, None, None]:
    """Content-defined chunks of a stream, in order, as views the caller must release.

    FastCDC decides a cut from the bytes since the previous cut only, so cutting a window
    that starts at a cut gives the same cuts as cutting the whole stream, except that the
    window's last chunk may have been cut short by the window's end: it is carried over to
    the front of the window and cut again with what follows. The window is one ``bytearray``,
    reused; each chunk handed on is a copy of its bytes, so what the stream holds in flight is
    exactly the chunks the push's byte budget counts (views of the window would keep whole
    windows of ``window_bytes`` alive for one chunk each, beyond the budget).
    """
    limit = window_bytes(chunker)
    window = bytearray()
    seen = 0
    for buf in source.buffers:
        data = memoryview(buf).cast("B")
        try:
            seen += len(data)
            if seen > source.size:
                raise InvalidArgument(
                    f"stream {path!r} yielded more than its declared {source.size} bytes"
                )
            pos = 0
            while pos < len(data):
                take = min(len(data) - pos, limit - len(window))
                window += data[pos : pos + take]
                pos += take
                if len(window) >= limit:
                    yield from _emit(chunker, window, final=False)
        finally:
            data.release()
    if seen != source.size:
        raise InvalidArgument(f"stream {path!r} yielded {seen} bytes, declared {source.size}")
    if window:
        yield from _emit(chunker, window, final=True)


def _emit(chunker: Chunker, window: bytearray, *, final: bool) -> Generator[memoryview, None, None]:
    """Yield copies of the window's complete chunks, then leave in it only the carried tail."""
    view = memoryview(window)
    consumed = 0
    try:
        cuts = list(chunker.cut(view))
        if not final:
            cuts = cuts[:-1]  # the last one may have been cut short: cut it again later
        for offset, length in cuts:
            yield memoryview(bytes(view[offset : offset + length]))
            consumed = offset + length
    finally:
        view.release()  # before the window changes: a view pins its size
    del window[:consumed]


def stream_kinds(manifest: Manifest) -> dict[str, str]:
    """``{path: kind}`` of the manifest's entries that were pushed as streams."""
    raw: Any = manifest.extra.get(STREAMS_EXTRA_KEY)
    if not isinstance(raw, Mapping):
        return {}
    names = {f.path for f in manifest.files}
    out: dict[str, str] = {}
    for path, info in raw.items():
        if isinstance(path, str) and path in names and isinstance(info, Mapping):
            out[path] = str(info.get("kind", "stream"))
    return out


def streams_extra(kinds: Mapping[str, str]) -> dict[str, dict[str, str]]:
    return {path: {"kind": kind} for path, kind in sorted(kinds.items())}


__all__ = [
    "GPU_MEMORY_KIND",
    "STREAMS_EXTRA_KEY",
    "UNKNOWN_SIZE",
    "StreamSource",
    "UploadedStreams",
    "check_stream_path",
    "cut_stream",
    "stream_kinds",
]
