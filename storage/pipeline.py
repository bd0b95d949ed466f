"""The push data path: cut, hash, dedup, compress and upload the chunks of files and streams.

Chunks go through the store's pools (``context.Pools``): hashing, compression and
encryption on the CPU pool, puts on the I/O pool, within the byte budget on chunks in
flight (``parallel.ByteBudget``). Files are cut on helper threads, the next file's cut
overlapping this one's (``_CutAhead``); streams are cut by the calling thread, which submits
chunks and reports progress; workers never call back into user code. The read path (fetch,
verify, write files or yield an entry) is ``storage/pull.py``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.errors import GpusnapError, InvalidArgument
from gpusnap.storage.backend import put_deferred
from gpusnap.storage.chunker import Chunker
from gpusnap.storage.context import StoreContext
from gpusnap.storage.follow import ChunkIdFn, cut_following
from gpusnap.storage.layout import chunk_key
from gpusnap.storage.manifest import ChunkRef, FileEntry
from gpusnap.storage.parallel import (
    ByteBudget,
    Outstanding,
    ProgressFn,
    Run,
    Tally,
    translate_error,
)

log = logging.getLogger(__name__)


@dataclass
class SourceFile:
    path: str  # relative, POSIX
    abs_path: Path
    size: int
    mode: int


@dataclass
class PushStats(Tally):
    bytes_uploaded: int = 0
    chunks_uploaded: int = 0
    # Ids this run put, and ids it did not put because the local index listed them: the
    # latter are what the push must prove are in the store before it commits (confirm.py).
    put_ids: set[str] = field(default_factory=set)
    index_skipped: set[str] = field(default_factory=set)

    @property
    def unproven(self) -> set[str]:
        """Chunks skipped on the index's word alone (none of them put by this run)."""
        return self.index_skipped - self.put_ids


NamedChunk = tuple[memoryview, str | None]  # a chunk and its id, when already computed


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
    named_chunks: Callable[[], Generator[NamedChunk, None, None]] | None = None

    @classmethod
    def of_named(
        cls,
        path: str,
        size: int,
        mode: int,
        named: Callable[[], Generator[NamedChunk, None, None]],
        *,
        cut_ahead: bool = False,
    ) -> PushInput:
        """An input whose chunks come with their ids where known; ``chunks`` drops the ids."""

        def chunks() -> Generator[memoryview, None, None]:
            with contextlib.closing(named()) as items:
                for chunk, _cid in items:
                    yield chunk

        return cls(path, size, mode, chunks, cut_ahead=cut_ahead, named_chunks=named)

    def named(self) -> Generator[NamedChunk, None, None]:
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

    def chunks(self) -> Generator[NamedChunk, None, None]:
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

    def named() -> Generator[NamedChunk, None, None]:
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


def push_inputs(
    ctx: StoreContext,
    inputs: list[PushInput],
    *,
    compress: bool,
    progress: ProgressFn | None,
    use_index: bool = True,
) -> tuple[list[FileEntry], PushStats]:
    """Chunk, dedup and upload ``inputs`` (files or streams), in order.

    Returns their entries once every put has returned. Puts may not be durable yet: the
    caller makes them so (``storage.push.make_durable``) before a manifest names them.
    A stream is consumed exactly once, by the calling thread; an error it raises aborts the
    push like any other. Without ``use_index`` every distinct chunk is put (a full
    checkpoint: nothing is taken on the index's word).

    Memory: the chunks in flight are held within the store's byte budget; what stays for
    the whole push is one ``ChunkRef`` per chunk (the manifest's chunk lists) and the id of
    each distinct chunk (``seen``, this push's dedup): about 300 bytes a chunk. Tasks are
    counted (``Outstanding``), not kept.
    """
    # A stream of unknown size counts when it ends (below).
    stats = PushStats(bytes_total=sum(max(0, f.size) for f in inputs))
    backend, codec, index = ctx.backend, ctx.codec, ctx.index
    budget = ByteBudget(ctx.pools.budget_bytes)
    # Encoded objects waiting for their put are the push's own memory (a file's chunks are
    # views of its map): at most half the budget of them, whatever the store's speed.
    waiting = ByteBudget(ctx.pools.budget_bytes // 2)
    run = Run()
    seen: set[str] = set()  # dedup within this push, including chunks still uploading
    seen_lock = threading.Lock()
    hashing = Outstanding()  # CPU tasks
    putting = Outstanding()  # puts on the I/O pool

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
                stats.put_ids.add(chunk_id)
        except BaseException as exc:
            run.fail(translate_error(exc, f"uploading chunk {chunk_id}"))
        finally:
            waiting.release(len(data))
            budget.release(length)

    def task(view: memoryview, length: int, named: str | None, refs: list[Any], at: int) -> None:
        # CPU stage (hash, compress, encrypt) here; the put goes to the I/O pool so that
        # slow storage never idles a core.
        handed_off = False
        try:
            run.raise_if_aborted()
            chunk_id = named if named is not None else codec.chunk_id(view)
            with seen_lock:
                known = chunk_id not in seen and use_index and index.contains(chunk_id)
                fresh = chunk_id not in seen and not known
                seen.add(chunk_id)
                if known:
                    stats.index_skipped.add(chunk_id)
            refs[at] = ChunkRef(chunk_id, length)
            if fresh:
                obj = codec.encode(chunk_id, view, compress=compress)
                view.release()  # before the put: the input is not needed any more
                waiting.acquire(len(obj.data), run.abort)  # released by the put
                try:
                    putting.submit(ctx.pools.io, put, chunk_id, obj.data, length)
                except BaseException:
                    waiting.release(len(obj.data))
                    raise
                handed_off = True
            else:
                with stats.lock:
                    stats.bytes_done += length
        except BaseException as exc:
            run.fail(translate_error(exc, "preparing a chunk"))
        finally:
            view.release()
            if not handed_off:
                budget.release(length)

    def report() -> None:
        stats.report(progress)

    pending: list[tuple[PushInput, list[Any]]] = []  # each input and its refs, in order
    cutters: dict[int, _CutAhead] = {}
    try:
        for i, src in enumerate(inputs):
            refs: list[Any] = []  # ChunkRef once its task ran
            pending.append((src, refs))
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
                    refs.append(None)
                    hashing.submit(ctx.pools.cpu, task, chunk, length, named, refs, len(refs) - 1)
                    report()
        hashing.wait(report)
        # Every CPU task has run, so every put is submitted: wait for each to return.
        putting.wait(report)
        run.check()
    except BaseException as exc:
        if isinstance(exc, GpusnapError):
            # First error wins: the caller's own (e.g. ``Cancelled`` from the progress
            # callback) must not be replaced by a worker's secondary "aborted".
            run.fail(exc)
        run.abort.set()
        # Tasks still queued see the abort and return at once: nothing outlives the push.
        hashing.wait()
        putting.wait()
        if run.error is not None:
            raise run.error from None
        raise
    finally:
        for cutter in cutters.values():  # idempotent; stops any cut never consumed
            cutter.close()
    entries: list[FileEntry] = []
    for src, refs in pending:
        size = src.size if src.size >= 0 else sum(ref.size for ref in refs)
        if src.size < 0:
            stats.bytes_total += size
        entries.append(FileEntry(src.path, size, src.mode, refs))
    stats.chunks_total = sum(len(e.chunks) for e in entries)
    report()
    return entries, stats
