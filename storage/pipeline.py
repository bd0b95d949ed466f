"""The data paths: push (cut, hash, compress, upload) and pull (fetch, verify, write).

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
import itertools
import logging
import os
import queue
import secrets
import threading
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.storage.backend import Backend, put_deferred
from gpusnap.storage.chunker import Chunker
from gpusnap.storage.codec import ChunkCodec
from gpusnap.storage.errors import (
    AlreadyExists,
    Corrupt,
    FailedPrecondition,
    GpusnapError,
    Internal,
    InvalidArgument,
    NotFound,
)
from gpusnap.storage.index import ChunkIndex
from gpusnap.storage.manifest import ChunkRef, FileEntry, Manifest

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]
CHUNK_PREFIX = "chunks/"
_TMP_PREFIX = ".gpusnap-pull-"


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


def _translate(exc: BaseException, what: str) -> GpusnapError:
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


def _dest_error(exc: BaseException, dest: Path) -> GpusnapError:
    """An error of a pull, said about the destination when it is the destination's."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return FailedPrecondition(
            f"destination disk full: cannot write into {dest} ({exc.strerror or exc})"
        )
    if isinstance(exc, OSError):
        return _translate(exc, f"cannot write into {dest}")
    return _translate(exc, f"pulling into {dest}")


class _Run:
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


_END = object()
# How many inputs are cut at once, ahead of the one being submitted, and how many chunks a
# cutter may run ahead (views into mapped files: address space and page cache, no copies).
CUT_AHEAD_INPUTS = 3
CUT_AHEAD_CHUNKS = 4096


_Named = tuple[memoryview, str | None]  # a chunk and its id, when already computed


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
            with contextlib.closing(src.chunks()) as chunks:
                for chunk in chunks:
                    if not self._offer((chunk, None)):
                        chunk.release()
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


def _unnamed(src: PushInput) -> Generator[_Named, None, None]:
    with contextlib.closing(src.chunks()) as chunks:
        for chunk in chunks:
            yield chunk, None


def file_input(src: SourceFile, chunker: Chunker) -> PushInput:
    def chunks() -> Generator[memoryview, None, None]:
        if src.size == 0:
            return
        try:
            view = chunker.open_view(src.abs_path)
        except OSError as exc:
            raise InvalidArgument(f"cannot read {src.abs_path}: {exc.strerror}") from exc
        try:
            if len(view) != src.size:
                raise InvalidArgument(f"{src.abs_path} changed size while being pushed")
            for offset, length in chunker.cut(view):
                yield view[offset : offset + length]
        finally:
            view.release()  # the map goes away when the last slice is released

    return PushInput(src.path, src.size, src.mode, chunks, cut_ahead=True)


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
) -> tuple[list[FileEntry], PushStats]:
    """Chunk, dedup and upload ``files``; return their entries once every put has returned."""
    return push_inputs(
        [file_input(f, chunker) for f in files],
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
    caller makes them so (``CheckpointStore._make_durable``) before a manifest names them.
    A stream is consumed exactly once, by the calling thread; an error it raises aborts the
    push like any other.
    """
    stats = PushStats(bytes_total=sum(f.size for f in inputs))
    budget = ByteBudget(budget_bytes)
    run = _Run()
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
            run.fail(_translate(exc, f"uploading chunk {chunk_id}"))
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
            run.fail(_translate(exc, "preparing a chunk"))
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
            with contextlib.closing(cutter.chunks() if cutter else _unnamed(src)) as chunks:
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
    entries = [
        FileEntry(src.path, src.size, src.mode, [fut.result() for fut in futures])
        for src, futures in pending
    ]
    stats.chunks_total = sum(len(e.chunks) for e in entries)
    return entries, stats


@dataclass
class PullStats:
    bytes_total: int = 0
    bytes_fetched: int = 0
    bytes_done: int = 0
    chunks_total: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Layout:
    """What a pull creates in ``dest``, so that a failure can remove exactly that."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.created_dirs: list[Path] = []
        self.temps: dict[str, tuple[Path, int]] = {}  # manifest path -> (temp path, fd)
        self.renamed: list[Path] = []

    def undo(self) -> None:
        for tmp, fd in self.temps.values():
            with contextlib.suppress(OSError):
                os.close(fd)
            tmp.unlink(missing_ok=True)
        for final in self.renamed:
            final.unlink(missing_ok=True)
        for directory in reversed(self.created_dirs):
            with contextlib.suppress(OSError):
                directory.rmdir()


def _check_targets(manifest: Manifest, dest: Path) -> dict[str, Path]:
    """Map every manifest path to its target, refusing any that could leave ``dest``."""
    real_dest = Path(os.path.realpath(dest))
    targets: dict[str, Path] = {}
    for entry in manifest.files:
        target = dest.joinpath(*entry.path.split("/"))
        probe = dest
        for part in entry.path.split("/")[:-1]:
            probe = probe / part
            if probe.is_symlink():
                real = Path(os.path.realpath(probe))
                if real != real_dest and real_dest not in real.parents:
                    raise Corrupt(f"{probe} is a symlink out of the destination")
            elif probe.exists() and not probe.is_dir():
                raise AlreadyExists(f"{probe} exists and is not a directory")
        if target.exists() or target.is_symlink():
            raise AlreadyExists(f"{target} already exists; pull into an empty destination")
        targets[entry.path] = target
    return targets


def _check_inside(directory: Path, dest: Path, path: str) -> None:
    real = Path(os.path.realpath(directory))
    real_dest = Path(os.path.realpath(dest))
    if real != real_dest and real_dest not in real.parents:
        raise Corrupt(f"{path!r} would land outside the destination")


def _interleaved(files: list[FileEntry]) -> list[str]:
    """Distinct chunk ids, taking one chunk of each file in turn.

    Buffered writes to one file serialise on its inode lock (and with it the page-cache
    allocation they do), so concurrent writers should mostly be writing different files.
    """
    order: list[str] = []
    seen: set[str] = set()
    for group in itertools.zip_longest(*(entry.chunks for entry in files)):
        for ref in group:
            if ref is not None and ref.id not in seen:
                seen.add(ref.id)
                order.append(ref.id)
    return order


def _is_zeros(obj: bytes, content: bytes | memoryview) -> bool:
    """Whether ``content`` is all zero bytes; cheap unless ``obj`` compressed it very well."""
    size = len(content)
    if size == 0 or len(obj) * 64 > size:  # zstd shrinks zeros far more than 64x
        return size == 0
    return content == bytes(size)  # calloc'd zero pages: no copy, one memcmp


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _make_dirs(path: Path, layout: _Layout) -> None:
    missing: list[Path] = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        directory.mkdir(mode=0o755)
        layout.created_dirs.append(directory)


def pull_files(
    manifest: Manifest,
    dest: Path,
    *,
    backend: Backend,
    codec: ChunkCodec,
    executor: ThreadPoolExecutor,
    budget_bytes: int,
    progress: ProgressFn | None,
) -> PullStats:
    """Write every file of ``manifest`` under ``dest``; on failure, remove what was written."""
    stats = PullStats(bytes_total=manifest.bytes_total)
    stats.chunks_total = sum(len(f.chunks) for f in manifest.files)
    targets = _check_targets(manifest, dest)  # before anything is written
    layout = _Layout(dest)
    run = _Run()
    budget = ByteBudget(budget_bytes)
    token = secrets.token_hex(4)
    try:
        _make_dirs(dest, layout)
        # Where each distinct chunk goes: one fetch serves every place it appears.
        places: dict[str, list[tuple[int, int]]] = {}
        sizes: dict[str, int] = {}
        for entry in manifest.files:
            target = targets[entry.path]
            _make_dirs(target.parent, layout)
            _check_inside(target.parent, dest, entry.path)
            tmp = target.with_name(f"{_TMP_PREFIX}{token}-{target.name}"[:255])
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600)
            layout.temps[entry.path] = (tmp, fd)
            os.ftruncate(fd, entry.size)
            offset = 0
            for ref in entry.chunks:
                places.setdefault(ref.id, []).append((fd, offset))
                sizes[ref.id] = ref.size
                offset += ref.size

        def task(chunk_id: str) -> None:
            size = sizes[chunk_id]
            try:
                if run.abort.is_set():
                    return
                obj = backend.get(chunk_key(chunk_id))
                # Verified (size, then hash) before any byte is used.
                content = codec.decode(chunk_id, obj, size)
                # Every temp file starts as a hole of its full size (ftruncate), which reads
                # as zeros: a zero chunk (a KV pool's empty blocks) needs no write at all.
                if not _is_zeros(obj, content):
                    for fd, offset in places[chunk_id]:
                        _pwrite_all(fd, content, offset)
                with stats.lock:
                    stats.bytes_fetched += len(obj)
                    stats.bytes_done += size * len(places[chunk_id])
            except NotFound as exc:
                run.fail(Corrupt(f"chunk {chunk_id} is missing from the store ({exc})"))
            except BaseException as exc:
                run.fail(_dest_error(exc, dest))
            finally:
                budget.release(size)

        futures: list[Future[None]] = []
        for chunk_id in _interleaved(manifest.files):
            budget.acquire(sizes[chunk_id], run.abort)
            if run.abort.is_set():
                break
            futures.append(executor.submit(task, chunk_id))
            if progress is not None:
                progress(stats.bytes_done, stats.bytes_total)
        for fut in futures:
            fut.result()
            if progress is not None:
                progress(stats.bytes_done, stats.bytes_total)
        run.check()
        by_path = {entry.path: entry for entry in manifest.files}
        for path, (tmp, fd) in list(layout.temps.items()):
            os.fchmod(fd, by_path[path].mode & 0o777)  # never setuid/setgid/sticky
            os.close(fd)
            del layout.temps[path]
            layout.temps[path] = (tmp, -1)
        for path, (tmp, _fd) in list(layout.temps.items()):
            os.rename(tmp, targets[path])
            del layout.temps[path]
            layout.renamed.append(targets[path])
    except BaseException as exc:
        run.abort.set()
        layout.undo()
        if isinstance(exc, OSError):
            raise _dest_error(exc, dest) from exc
        raise
    return stats


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
                raise _translate(exc, f"reading {entry.path}") from exc
            in_flight -= size
            yield at, content
    finally:
        for _at, _size, fut in window:
            fut.cancel()
