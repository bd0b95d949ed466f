"""The push data path (cut, hash, compress, upload), and reading one entry back in order.

The pull path (fetch, verify, write files) is ``storage/pull.py``.

Both run chunks through a thread pool; zstandard, blake3, AES-GCM and file/socket I/O release
the GIL, so the stages overlap across cores. Memory is bounded by a byte budget on the chunks
in flight (``workers x 2 x max chunk`` by default), whatever the size of the input. Files are
cut on helper threads, the next file's cut overlapping this one's (``_CutAhead``); streams are
cut by the calling thread, which submits chunks and reports progress; workers never call
back into user code.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import queue
import threading
from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.errors import (
    Corrupt,
    FailedPrecondition,
    GpusnapError,
    Internal,
    InvalidArgument,
    NotFound,
)
from gpusnap.storage.backend import Backend, put_deferred
from gpusnap.storage.chunker import Chunker
from gpusnap.storage.codec import ChunkCodec
from gpusnap.storage.follow import ChunkIdFn, cut_following
from gpusnap.storage.index import ChunkIndex
from gpusnap.storage.manifest import ChunkRef, FileEntry

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]
CHUNK_PREFIX = "chunks/"


def chunk_key(chunk_id: str) -> str:
    return f"{CHUNK_PREFIX}{chunk_id[:2]}/{chunk_id}"


def chunk_id_of_key(key: str) -> str | None:
    name = key.rpartition("/")[2]
    return name if key == chunk_key(name) and len(name) == 64 else None


class ByteBudget:
    """Blocks the producer while more than ``limit`` bytes are in flight (one item always fits)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int, abort: threading.Event) -> None:
        with self._cond:
            while self._used and self._used + n > self._limit and not abort.is_set():
                self._cond.wait(0.5)
            self._used += n

    def release(self, n: int) -> None:
        with self._cond:
            self._used -= n
            self._cond.notify_all()


@dataclass
class SourceFile:
    path: str  # relative, POSIX
    abs_path: Path
    size: int
    mode: int


@dataclass
class PushStats:
    bytes_total: int = 0
    bytes_uploaded: int = 0
    chunks_total: int = 0
    chunks_uploaded: int = 0
    bytes_done: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


# What an OSError says about the arguments given (a file where a directory should be, a
# name too long); any other errno is about the machine (a full or read-only disk), not usage.
_BAD_ARGUMENT_ERRNOS = frozenset(
    {errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP}
)


def translate_error(exc: BaseException, what: str) -> GpusnapError:
    if isinstance(exc, GpusnapError):
        return exc
    if isinstance(exc, OSError):
        reason = exc.strerror or str(exc)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return FailedPrecondition(f"{what}: disk full ({reason})")
        if exc.errno in _BAD_ARGUMENT_ERRNOS:
            return InvalidArgument(f"{what}: {reason}")
        return FailedPrecondition(f"{what}: {reason}")
    if isinstance(exc, MemoryError):
        return Internal(f"{what}: out of memory")
    return Internal(f"{what}: {type(exc).__name__}: {exc}")


class Run:
    """Shared state of one pipeline run: first error wins, everyone stops."""

    def __init__(self) -> None:
        self.abort = threading.Event()
        self.error: GpusnapError | None = None
        self._lock = threading.Lock()

    def fail(self, err: GpusnapError) -> None:
        with self._lock:
            if self.error is None:
                self.error = err
        self.abort.set()

    def raise_if_aborted(self) -> None:
        if self.abort.is_set():
            raise self.error or Internal("aborted")

    def check(self) -> None:
        if self.error is not None:
            raise self.error


_Named = tuple[memoryview, str | None]  # a chunk and its id, when already computed


@dataclass
class PushInput:
    """One entry to push: a file, or a stream (``storage.streams``) that has no file."""

    path: str  # relative, POSIX
    size: int
    mode: int
    chunks: Callable[[], Generator[memoryview, None, None]]  # in order; caller releases
    # Whether ``chunks`` may run on a helper thread, ahead of the calling thread (files:
    # yes; streams: no, their producer may be tied to the calling thread, e.g. a CUDA one).
    cut_ahead: bool = False
    # When set, used instead of ``chunks``: chunks with their ids where already computed.
    named_chunks: Callable[[], Generator[_Named, None, None]] | None = None

    @classmethod
    def of_named(
        cls,
        path: str,
        size: int,
        mode: int,
        named: Callable[[], Generator[_Named, None, None]],
        *,
        cut_ahead: bool = False,
    ) -> PushInput:
        """An input whose chunks come with their ids where known; ``chunks`` drops the ids."""

        def chunks() -> Generator[memoryview, None, None]:
            with contextlib.closing(named()) as items:
                for chunk, _cid in items:
                    yield chunk

        return cls(path, size, mode, chunks, cut_ahead=cut_ahead, named_chunks=named)

    def named(self) -> Generator[_Named, None, None]:
        if self.named_chunks is not None:
            yield from self.named_chunks()
            return
        with contextlib.closing(self.chunks()) as chunks:
            for chunk in chunks:
                yield chunk, None


_END = object()
# How many inputs are cut at once, ahead of the one being submitted, and how many chunks a
# cutter may run ahead (views into mapped files: address space and page cache, no copies).
CUT_AHEAD_INPUTS = 3
CUT_AHEAD_CHUNKS = 4096


class _CutAhead:
    """Runs one input's ``chunks`` generator on its own thread, feeding a bounded queue.

    FastCDC releases the GIL while it scans, so cutting the next files overlaps with cutting
    this one and with hashing (on the workers): an incremental push, which compresses little,
    is otherwise bounded by one thread cutting every byte in turn. (Hashing on the cutter,
    while the bytes are in cache, measured slower: it lengthens each file's serial path.)
    """

    def __init__(self, src: PushInput) -> None:
        self._queue: queue.Queue[object] = queue.Queue(CUT_AHEAD_CHUNKS)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(src,), name=f"gpusnap-cut {src.path}", daemon=True
        )
        self._thread.start()

    def _run(self, src: PushInput) -> None:
        try:
            with contextlib.closing(src.named()) as chunks:
                for item in chunks:
                    if not self._offer(item):
                        item[0].release()
                        return
            self._offer(_END)
        except BaseException as exc:  # handed to the consumer, which raises it
            self._offer(exc)

    def _offer(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def chunks(self) -> Generator[_Named, None, None]:
        try:
            while True:
                item = self._queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, tuple)
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Stop the cutter and release every chunk it cut that nobody consumed."""
        self._stop.set()
        self._drain()  # frees a cutter blocked on a full queue
        self._thread.join()
        self._drain()  # it may have queued one more before it saw the stop

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                item[0].release()


def file_input(
    src: SourceFile,
    chunker: Chunker,
    parent: FileEntry | None = None,
    chunk_id: ChunkIdFn | None = None,
) -> PushInput:
    """A file to push; with ``parent`` (its entry in the parent checkpoint) and ``chunk_id``,
    cut along the parent's boundaries where the bytes prove them (``storage/follow.py``)."""

    def named() -> Generator[_Named, None, None]:
        if src.size == 0:
            return
        try:
            view = chunker.open_view(src.abs_path)
        except OSError as exc:
            raise InvalidArgument(f"cannot read {src.abs_path}: {exc.strerror}") from exc
        try:
            if len(view) != src.size:
                raise InvalidArgument(f"{src.abs_path} changed size while being pushed")
            if parent is not None and parent.chunks and chunk_id is not None:
                for offset, length, cid in cut_following(view, chunker, parent.chunks, chunk_id):
                    yield view[offset : offset + length], cid
            else:
                for offset, length in chunker.cut(view):
                    yield view[offset : offset + length], None
        finally:
            view.release()  # the map goes away when the last slice is released

    return PushInput.of_named(src.path, src.size, src.mode, named, cut_ahead=True)


def push_files(
    files: list[SourceFile],
    *,
    backend: Backend,
    codec: ChunkCodec,
    index: ChunkIndex,
    chunker: Chunker,
    executor: ThreadPoolExecutor,
    io_executor: ThreadPoolExecutor,
    budget_bytes: int,
    compress: bool,
    progress: ProgressFn | None,
    parents: Mapping[str, FileEntry] | None = None,
) -> tuple[list[FileEntry], PushStats]:
    """Chunk, dedup and upload ``files``; return their entries once every put has returned.

    ``parents`` maps paths to their entries in the parent checkpoint: those files are cut
    along the parent's boundaries where the bytes prove them.
    """
    parents = parents or {}
    return push_inputs(
        [file_input(f, chunker, parents.get(f.path), codec.chunk_id) for f in files],
        backend=backend,
        codec=codec,
        index=index,
        executor=executor,
        io_executor=io_executor,
        budget_bytes=budget_bytes,
        compress=compress,
        progress=progress,
    )


def push_inputs(
    inputs: list[PushInput],
    *,
    backend: Backend,
    codec: ChunkCodec,
    index: ChunkIndex,
    executor: ThreadPoolExecutor,
    io_executor: ThreadPoolExecutor,
    budget_bytes: int,
    compress: bool,
    progress: ProgressFn | None,
) -> tuple[list[FileEntry], PushStats]:
    """Chunk, dedup and upload ``inputs`` (files or streams), in order.

    Returns their entries once every put has returned. Puts may not be durable yet: the
    caller makes them so (``storage.push.make_durable``) before a manifest names them.
    A stream is consumed exactly once, by the calling thread; an error it raises aborts the
    push like any other.
    """
    # A stream of unknown size counts when it ends (below).
    stats = PushStats(bytes_total=sum(max(0, f.size) for f in inputs))
    budget = ByteBudget(budget_bytes)
    run = Run()
    seen: set[str] = set()  # dedup within this push, including chunks still uploading
    seen_lock = threading.Lock()

    io_futures: list[Future[None]] = []
    io_lock = threading.Lock()

    def put(chunk_id: str, data: bytes, length: int) -> None:
        try:
            run.raise_if_aborted()
            # Not durable yet where the backend defers it: the caller syncs once, before
            # any manifest names the chunk; until then the index marks it pending.
            put_deferred(backend, chunk_key(chunk_id), data)
            index.add(chunk_id, len(data), pending=True)
            with stats.lock:
                stats.bytes_uploaded += len(data)
                stats.chunks_uploaded += 1
                stats.bytes_done += length
        except BaseException as exc:
            run.fail(translate_error(exc, f"uploading chunk {chunk_id}"))
            raise
        finally:
            budget.release(length)

    def task(view: memoryview, length: int, named: str | None) -> ChunkRef:
        # CPU stage (hash, compress, encrypt) here; the put goes to the I/O pool so that
        # slow storage never idles a core.
        handed_off = False
        try:
            run.raise_if_aborted()
            chunk_id = named if named is not None else codec.chunk_id(view)
            with seen_lock:
                fresh = chunk_id not in seen and not index.contains(chunk_id)
                seen.add(chunk_id)
            if fresh:
                obj = codec.encode(chunk_id, view, compress=compress)
                with io_lock:
                    io_futures.append(io_executor.submit(put, chunk_id, obj.data, length))
                handed_off = True
            else:
                with stats.lock:
                    stats.bytes_done += length
            return ChunkRef(chunk_id, length)
        except BaseException as exc:
            run.fail(translate_error(exc, "preparing a chunk"))
            raise
        finally:
            view.release()
            if not handed_off:
                budget.release(length)

    def report() -> None:
        if progress is not None:
            progress(stats.bytes_done, stats.bytes_total)

    pending: list[tuple[PushInput, list[Future[ChunkRef]]]] = []
    cutters: dict[int, _CutAhead] = {}
    try:
        for i, src in enumerate(inputs):
            futures: list[Future[ChunkRef]] = []
            pending.append((src, futures))
            for ahead in range(i, min(i + CUT_AHEAD_INPUTS, len(inputs))):
                if inputs[ahead].cut_ahead and ahead not in cutters:
                    cutters[ahead] = _CutAhead(inputs[ahead])
            cutter = cutters.get(i)
            with contextlib.closing(cutter.chunks() if cutter else src.named()) as chunks:
                for chunk, named in chunks:
                    length = len(chunk)
                    try:
                        budget.acquire(length, run.abort)
                        run.check()
                    except BaseException:
                        chunk.release()
                        raise
                    futures.append(executor.submit(task, chunk, length, named))
                    report()
        for _src, futures in pending:
            for fut in futures:
                try:
                    fut.result()
                except BaseException:  # noqa: S112 - the first error is in run.error
                    continue
                report()
        # Every CPU task has run, so io_futures is complete: wait for every put to return.
        for io in io_futures:
            try:
                io.result()
            except BaseException:  # noqa: S112 - the first error is in run.error
                continue
            report()
        run.check()
    except BaseException as exc:
        if isinstance(exc, GpusnapError):
            # First error wins: the caller's own (e.g. ``Cancelled`` from the progress
            # callback) must not be replaced by a worker's secondary "aborted".
            run.fail(exc)
        run.abort.set()
        all_futures: list[Future[Any]] = [f for _src, futs in pending for f in futs]
        for fut in all_futures:
            fut.cancel()
        for fut in all_futures:
            if not fut.cancelled():
                fut.exception()
        with io_lock:
            started_io = list(io_futures)
        for io in started_io:
            io.cancel()
            if not io.cancelled():
                io.exception()
        if run.error is not None:
            raise run.error from None
        raise
    finally:
        for cutter in cutters.values():  # idempotent; stops any cut never consumed
            cutter.close()
    entries: list[FileEntry] = []
    for src, futures in pending:
        refs = [fut.result() for fut in futures]
        size = src.size if src.size >= 0 else sum(ref.size for ref in refs)
        if src.size < 0:
            stats.bytes_total += size
        entries.append(FileEntry(src.path, size, src.mode, refs))
    stats.chunks_total = sum(len(e.chunks) for e in entries)
    return entries, stats


def read_entry(
    entry: FileEntry,
    *,
    backend: Backend,
    codec: ChunkCodec,
    executor: ThreadPoolExecutor,
    budget_bytes: int,
) -> Iterator[tuple[int, bytes | memoryview]]:
    """``(offset, bytes)`` of one entry's chunks, in order, each verified before it is given.

    Chunks are fetched ahead in parallel, at most ``budget_bytes`` of them (and always at
    least one) at a time, so memory stays bounded whatever the entry's size. Nothing is
    written anywhere: a restore can fill mapped device memory straight from this.
    """

    def fetch(chunk_id: str, size: int) -> bytes | memoryview:
        try:
            obj = backend.get(chunk_key(chunk_id))
        except NotFound as exc:
            raise Corrupt(f"chunk {chunk_id} is missing from the store ({exc})") from None
        return codec.decode(chunk_id, obj, size)

    window: list[tuple[int, int, Future[bytes | memoryview]]] = []
    in_flight = 0
    offset = 0
    refs = iter(entry.chunks)
    try:
        while True:
            for ref in refs:
                window.append((offset, ref.size, executor.submit(fetch, ref.id, ref.size)))
                offset += ref.size
                in_flight += ref.size
                if in_flight >= budget_bytes:
                    break
            if not window:
                return
            at, size, fut = window.pop(0)
            try:
                content = fut.result()
            except GpusnapError:
                raise
            except BaseException as exc:
                raise translate_error(exc, f"reading {entry.path}") from exc
            in_flight -= size
            yield at, content
    finally:
        for _at, _size, fut in window:
            fut.cancel()
