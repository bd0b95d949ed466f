"""The read path: a checkpoint's chunks fetched in parallel, each verified, written or yielded.

``pull`` writes every file of a checkpoint under a destination, all or nothing (the files
themselves: ``storage/dest.py``); ``open_stream`` yields one entry's bytes in order without
writing anything (a restore fills mapped GPU memory from it). Both fetch ahead within the
store's byte budget, and every chunk is decoded against the size the authenticated manifest
declares, which re-checks its hash, before anyone sees a byte of it.

Pull threads: a chunk of a local store is read faster than it decodes, so one thread per core
both reads and decodes (the CPU pool); a remote store's fetches wait on the network, so many
run on the I/O pool while decodes still run one per core. Writes run on their own threads.

Every chunk is fetched by ``fetch_chunk``: from the node's chunk cache when the context has
one and it holds the chunk, else from the store; a cached object that fails to decode is
dropped and fetched from the store instead, and a store object that decoded is kept in the
cache. Either way the bytes used are the ones that were just verified.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from gpusnap.errors import Corrupt, GpusnapError, NotFound
from gpusnap.storage.catalog import fetch_manifest
from gpusnap.storage.chunker import MAX_SIZE
from gpusnap.storage.codec import MAX_OBJECT_BYTES
from gpusnap.storage.context import StoreContext
from gpusnap.storage.dest import (
    ALIGN,
    AlignedBuffers,
    Destination,
    Target,
    check_targets,
    dest_error,
    write_place,
)
from gpusnap.storage.layout import chunk_key
from gpusnap.storage.manifest import FileEntry, Manifest
from gpusnap.storage.parallel import (
    ByteBudget,
    Outstanding,
    ProgressFn,
    Run,
    Tally,
    translate_error,
)
from gpusnap.storage.streams import stream_kinds
from gpusnap.storage.untrusted import read_capped

log = logging.getLogger(__name__)

_R = TypeVar("_R")

# Threads that write decoded chunks (O_DIRECT writes block; one per file runs at a time).
_WRITERS = 8
# Zero grains are looked for in chunks that compressed at least this well.
_SPARSE_RATIO = 2


@dataclass
class PullResult:
    checkpoint_id: str
    bytes_total: int
    bytes_fetched: int  # object bytes read from the store
    chunks_total: int
    seconds: float
    bytes_cached: int = 0  # object bytes read from the node's chunk cache instead
    chunks_fetched: int = 0
    chunks_cached: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PullStats(Tally):
    bytes_fetched: int = 0
    bytes_cached: int = 0
    chunks_fetched: int = 0
    chunks_cached: int = 0
    bytes_direct: int = 0  # written with O_DIRECT

    def count(self, obj_len: int, cached: bool) -> None:
        with self.lock:
            if cached:
                self.bytes_cached += obj_len
                self.chunks_cached += 1
            else:
                self.bytes_fetched += obj_len
                self.chunks_fetched += 1


def pull(
    ctx: StoreContext,
    checkpoint_id: str,
    dest: Path,
    *,
    progress: ProgressFn | None,
    exclude_kinds: Collection[str],
    direct: bool,
    durable: bool,
) -> PullResult:
    """Restore a checkpoint's files under ``dest`` (``CheckpointStore.pull``)."""
    started = time.monotonic()
    manifest = fetch_manifest(ctx, checkpoint_id)
    if exclude_kinds:
        kinds = stream_kinds(manifest)
        left_out = {p for p, k in kinds.items() if k in exclude_kinds}
        manifest = replace(manifest, files=[f for f in manifest.files if f.path not in left_out])
    stats = pull_files(ctx, manifest, dest, progress=progress, direct=direct, durable=durable)
    return PullResult(
        checkpoint_id,
        stats.bytes_total,
        stats.bytes_fetched,
        stats.chunks_total,
        time.monotonic() - started,
        bytes_cached=stats.bytes_cached,
        chunks_fetched=stats.chunks_fetched,
        chunks_cached=stats.chunks_cached,
    )


def open_stream(
    ctx: StoreContext,
    checkpoint: str | Manifest,
    path: str,
    *,
    stats: PullStats | None = None,
) -> Iterator[tuple[int, bytes | memoryview]]:
    """``(offset, bytes)`` of one entry of a checkpoint (``CheckpointStore.open_stream``)."""
    manifest = fetch_manifest(ctx, checkpoint) if isinstance(checkpoint, str) else checkpoint
    entry = next((f for f in manifest.files if f.path == path), None)
    if entry is None:
        raise NotFound(f"checkpoint {manifest.checkpoint_id} has no entry {path!r}")
    return read_entry(ctx, entry, stats=stats)


def _missing(chunk_id: str, exc: NotFound) -> Corrupt:
    # The manifest names it, so the store lost it: an integrity failure, not a lookup miss.
    return Corrupt(f"chunk {chunk_id} is missing from the store ({exc})")


def read_chunk_object(ctx: StoreContext, chunk_id: str) -> bytes:
    """Chunk ``chunk_id``'s object from the store, never more than a chunk object can be."""
    return read_capped(ctx.backend, chunk_key(chunk_id), MAX_OBJECT_BYTES, f"chunk {chunk_id}")


def fetch_chunk(
    ctx: StoreContext, chunk_id: str, decode: Callable[[bytes], _R]
) -> tuple[_R, int, bool]:
    """``decode(object)`` of one chunk, its object's size, and whether it came from the cache.

    ``decode`` verifies (``ChunkCodec.decode``/``decode_into``) and raises ``Corrupt`` when
    the object is bad. The node's chunk cache is asked first; a cached object that fails is
    dropped and the store's is used instead, and the store's is kept in the cache only once
    it decoded, so nothing unverified is ever cached or used. A chunk the store lacks is
    ``Corrupt`` (the manifest names it).
    """
    cache = ctx.cache
    if cache is not None:
        obj = cache.get(chunk_id)
        if obj is not None:
            try:
                return decode(obj), len(obj), True
            except Corrupt as exc:
                cache.discard(chunk_id, str(exc))
    try:
        obj = read_chunk_object(ctx, chunk_id)
    except NotFound as exc:
        raise _missing(chunk_id, exc) from None
    value = decode(obj)
    if cache is not None:
        cache.put(chunk_id, obj)
    return value, len(obj), False


def read_entry(
    ctx: StoreContext, entry: FileEntry, *, stats: PullStats | None = None
) -> Iterator[tuple[int, bytes | memoryview]]:
    """``(offset, bytes)`` of one entry's chunks, in order, each verified before it is given.

    Chunks are fetched ahead in parallel on the I/O pool, at most the store's byte budget of
    them (and always at least one) at a time, so memory stays bounded whatever the entry's
    size. Nothing is written anywhere. ``stats`` counts what came from the store and what
    from the node's chunk cache (``PullStats.count``), and the entry's bytes in its total.
    """
    if stats is not None:
        with stats.lock:
            stats.bytes_total += entry.size
            stats.chunks_total += len(entry.chunks)

    def fetch(chunk_id: str, size: int) -> bytes | memoryview:
        content, obj_len, cached = fetch_chunk(
            ctx, chunk_id, lambda obj: ctx.codec.decode(chunk_id, obj, size)
        )
        if stats is not None:
            stats.count(obj_len, cached)
        return content

    window: list[tuple[int, int, Future[bytes | memoryview]]] = []
    in_flight = 0
    offset = 0
    refs = iter(entry.chunks)
    try:
        while True:
            for ref in refs:
                window.append((offset, ref.size, ctx.pools.io.submit(fetch, ref.id, ref.size)))
                offset += ref.size
                in_flight += ref.size
                if in_flight >= ctx.pools.budget_bytes:
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


def pull_files(
    ctx: StoreContext,
    manifest: Manifest,
    dest: Path,
    *,
    progress: ProgressFn | None = None,
    direct: bool = True,
    durable: bool = True,
    writers: int = _WRITERS,
) -> PullStats:
    """Write every file of ``manifest`` under ``dest``; on failure, remove what was written.

    Chunks are fetched on the CPU pool (a local store) or the I/O pool (a remote one); at
    most one per worker decompresses and verifies at once, ``writers`` threads write.
    """
    stats = PullStats(bytes_total=manifest.bytes_total)
    stats.chunks_total = sum(len(f.chunks) for f in manifest.files)
    destination = Destination(dest, check_targets(manifest, dest))  # checked before any write
    codec = ctx.codec
    fetcher = ctx.pools.cpu if ctx.local else ctx.pools.io
    run = Run()
    budget = ByteBudget(ctx.pools.budget_bytes)
    # A buffer per decode running and per write waiting, at most: what the pull holds of
    # decoded chunks is bounded by the machine, whatever the image.
    buffers = AlignedBuffers(ctx.pools.workers + writers)
    writer = ThreadPoolExecutor(writers, thread_name_prefix="gpusnap-pull-write")
    decoding = threading.BoundedSemaphore(ctx.pools.workers)
    fetching = Outstanding()
    writing = Outstanding()
    try:
        destination.make_dirs(dest)
        # Where each distinct chunk goes: one fetch serves every place it appears.
        places: dict[str, list[tuple[Target, int]]] = {}
        sizes: dict[str, int] = {}
        for entry in manifest.files:
            target = destination.create(entry, direct=direct)
            offset = 0
            for ref in entry.chunks:
                places.setdefault(ref.id, []).append((target, offset))
                sizes[ref.id] = ref.size
                offset += ref.size
            target.unwritten = len(entry.chunks)

        def written(chunk_id: str) -> list[Target]:
            """Count the places of a chunk as written; the files that are now complete."""
            complete = []
            with stats.lock:
                stats.bytes_done += sizes[chunk_id] * len(places[chunk_id])
                for target, _ in places[chunk_id]:
                    target.unwritten -= 1
                    if target.unwritten == 0:
                        complete.append(target)
            return complete

        def sync(target: Target) -> None:
            # A durable pull syncs each file as soon as its last chunk is in, on a writer
            # thread while other chunks still decode, not all of them at the end.
            if durable and not run.abort.is_set():
                os.fsync(target.fd)
                target.synced = True

        def sync_task(target: Target) -> None:
            try:
                sync(target)
            except BaseException as exc:
                run.fail(dest_error(exc, dest))

        def write(chunk_id: str, obj_len: int, buf: mmap.mmap, shift: int) -> None:
            size = sizes[chunk_id]
            where = places[chunk_id]
            try:
                if run.abort.is_set():
                    return
                # Every temp file starts as a hole of its full size (ftruncate), which reads
                # as zeros: zero chunks and (sparse) zero grains need no write at all.
                sparse = obj_len * _SPARSE_RATIO < size
                done_direct = 0
                for target, offset in where:
                    done_direct += write_place(target, buf, shift, size, offset, sparse=sparse)
                with stats.lock:
                    stats.bytes_direct += done_direct
                for target in written(chunk_id):
                    sync(target)
            except BaseException as exc:
                run.fail(dest_error(exc, dest))
            finally:
                buffers.give(buf)
                budget.release(size)

        def task(chunk_id: str) -> None:
            size = sizes[chunk_id]
            buf = None
            handed = False
            shift = places[chunk_id][0][1] % ALIGN

            def decode(obj: bytes) -> None:
                nonlocal buf
                with decoding:  # fetches overlap freely; decodes run one per core
                    run.raise_if_aborted()
                    if buf is None:
                        buf = buffers.take()
                    out = memoryview(buf)[shift : shift + size]
                    try:
                        codec.decode_into(chunk_id, obj, out)  # verified before any use
                    finally:
                        out.release()

            try:
                if run.abort.is_set():
                    return
                _none, obj_len, cached = fetch_chunk(ctx, chunk_id, decode)
                assert buf is not None
                stats.count(obj_len, cached)
                # Writes block (O_DIRECT, one at a time per file): on their own threads, so
                # that decoding goes on meanwhile, within the byte budget.
                writing.submit(writer, write, chunk_id, obj_len, buf, shift)
                handed = True  # the writer gives the buffer back and releases the budget
            except BaseException as exc:
                run.fail(dest_error(exc, dest))
            finally:
                if not handed:
                    if buf is not None:
                        buffers.give(buf)
                    budget.release(size)

        # A chunk of zeros is known from its (authenticated) id alone: nothing to fetch or
        # write. Zero runs longer than the largest chunk all become that one chunk.
        zeros = {MAX_SIZE: codec.chunk_id(bytes(MAX_SIZE))} if MAX_SIZE in sizes.values() else {}
        for chunk_id in _interleaved(manifest.files):
            if zeros.get(sizes[chunk_id]) == chunk_id:
                for target in written(chunk_id):
                    writing.submit(writer, sync_task, target)
                continue
            budget.acquire(sizes[chunk_id], run.abort)
            if run.abort.is_set():
                break
            fetching.submit(fetcher, task, chunk_id)
            stats.report(progress)
        fetching.wait(lambda: stats.report(progress))
        # Every decode has run, so every write is submitted: wait for them all.
        writing.wait(lambda: stats.report(progress))
        stats.report(progress)
        run.check()
        destination.commit(durable=durable, pool=writer)
    except BaseException as exc:
        run.abort.set()
        # Nothing may still write through a descriptor that undo is about to close: tasks
        # still queued see the abort and return at once.
        fetching.wait()
        writing.wait()
        writer.shutdown(wait=True)
        destination.undo()
        if isinstance(exc, OSError):
            raise dest_error(exc, dest) from exc
        raise
    finally:
        writer.shutdown(wait=True)
        buffers.close()
    return stats


def chunks_to_fetch(ctx: StoreContext, files: list[FileEntry]) -> dict[str, int]:
    """The distinct chunks a pull of ``files`` fetches, in the order it does, with their sizes:
    all but the all-zero maximum-size chunk, which is known from its id."""
    sizes = {ref.id: ref.size for entry in files for ref in entry.chunks}
    zero = ctx.codec.chunk_id(bytes(MAX_SIZE)) if MAX_SIZE in sizes.values() else None
    return {chunk_id: sizes[chunk_id] for chunk_id in _interleaved(files) if chunk_id != zero}


def _interleaved(files: list[FileEntry]) -> list[str]:
    """Distinct chunk ids, every file advancing at the same pace (by fraction of its size).

    Writes to one file serialise on its inode lock (and with it the block allocation they
    do), so concurrent writers should be writing different files until the very end: were
    the files taken a chunk each in turn, the small ones would be done early and the end of
    the pull would write the largest alone, one chunk at a time.
    """
    keyed: list[tuple[float, int, str]] = []
    for index, entry in enumerate(files):
        offset = 0
        for ref in entry.chunks:
            keyed.append((offset / entry.size if entry.size else 0.0, index, ref.id))
            offset += ref.size
    keyed.sort(key=lambda k: (k[0], k[1]))
    order: list[str] = []
    seen: set[str] = set()
    for _, _, chunk_id in keyed:
        if chunk_id not in seen:
            seen.add(chunk_id)
            order.append(chunk_id)
    return order
