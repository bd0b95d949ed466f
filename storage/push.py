"""A push: a directory tree (and streams) uploaded as chunks, then committed by its manifest.

Write order (docs/design.md): chunks, one sync that makes them durable, then the manifest.
A push holds ``locks/push-<ckpt id>`` while it runs. It first reads the store's identity
again and binds the local index to it (``confirm.refresh_identity``: a recreated store's
index is rebuilt before anything is skipped). The index only decides what to upload: before
committing, every chunk skipped on its word is proven present in the store
(``confirm.ChunkProof``), and a gc that swept meanwhile makes the push wait and re-list
(``storage/locks.py``); whatever the store lacks is uploaded again, so a manifest never
names a chunk the store does not hold. Streams (``storage/streams.py``) become ordinary
file entries; ``upload_streams`` and ``upload_growing`` put them in the store before the
push that names them. Every function here takes the store's parts (``StoreContext``) and
hands chunks to the data path (``storage/pipeline.py``).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Collection, Generator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from gpusnap.errors import GpusnapError, InvalidArgument, NotFound, Unavailable
from gpusnap.storage.backend import sync_deferred
from gpusnap.storage.cache.seeding import seeding
from gpusnap.storage.catalog import fetch_manifest, write_manifest
from gpusnap.storage.chunker import Chunker
from gpusnap.storage.confirm import ChunkProof, refresh_identity
from gpusnap.storage.context import StoreContext
from gpusnap.storage.growing import growing_file_input
from gpusnap.storage.heads import write_head
from gpusnap.storage.layout import chunk_key
from gpusnap.storage.locks import push_lock, sync_index_if_gc_ran
from gpusnap.storage.manifest import (
    FileEntry,
    Manifest,
    check_checkpoint_id,
    check_workload,
    new_checkpoint_id,
)
from gpusnap.storage.parallel import ProgressFn
from gpusnap.storage.pipeline import PushInput, PushStats, SourceFile, file_input, push_inputs
from gpusnap.storage.retry import job_deadline
from gpusnap.storage.streams import (
    STREAMS_EXTRA_KEY,
    StreamSource,
    UploadedStreams,
    check_stream_path,
    cut_stream,
    streams_extra,
)

log = logging.getLogger(__name__)


@dataclass
class PushResult:
    checkpoint_id: str
    bytes_total: int
    bytes_uploaded: int
    chunks_total: int
    chunks_uploaded: int
    seconds: float
    # The proof of the chunks skipped on the local index's word (``confirm.ProofStats``):
    # how, how many were proven present, how many the store lacked (uploaded again), and how
    # long the commit waited on it.
    proof: str = "none"
    chunks_proven: int = 0
    chunks_reuploaded: int = 0
    proof_seconds: float = 0.0
    store_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _seeded(ctx: StoreContext, seed_cache: bool) -> StoreContext:
    """``ctx``, its chunk puts also kept in the node's cache when asked and there is one:
    what a node just pushed, it holds (``storage/cache/seeding.py``)."""
    if not seed_cache or ctx.cache is None:
        return ctx
    return replace(ctx, backend=seeding(ctx.backend, ctx.cache))


def _parent_entries(ctx: StoreContext, parent: str | None) -> dict[str, FileEntry]:
    """The parent checkpoint's file entries by path: where to try cutting first.

    Only a hint (``storage/follow.py`` proves every boundary by its hash): a parent that
    cannot be read costs the shortcut, not the push.
    """
    if parent is None:
        return {}
    try:
        manifest = fetch_manifest(ctx, parent)
    except GpusnapError as exc:
        log.info("parent %s not readable (%s); cutting without it", parent, exc)
        return {}
    return {entry.path: entry for entry in manifest.files}


def _file_inputs(
    ctx: StoreContext, files: list[SourceFile], parents: Mapping[str, FileEntry]
) -> list[PushInput]:
    return [file_input(f, ctx.chunker, parents.get(f.path), ctx.codec.chunk_id) for f in files]


def push_tree(
    ctx: StoreContext,
    src: Path,
    *,
    workload: str,
    parent: str | None,
    stamp: dict[str, Any] | None,
    spec: dict[str, Any] | None,
    progress: ProgressFn | None,
    compress: bool | None,
    checkpoint_id: str | None,
    extra: dict[str, Any] | None,
    streams: Mapping[str, StreamSource] | None,
    uploaded_streams: UploadedStreams | None,
    full: bool = False,
    seed_cache: bool = False,
    deadline: float | None = None,
) -> PushResult:
    """Upload ``src`` (and streams) as a new checkpoint, then commit its manifest.

    ``CheckpointStore.push`` documents the arguments (and their defaults).
    """
    started = time.monotonic()
    ctx = _seeded(ctx, seed_cache)
    check_workload(workload)
    if parent is not None:
        check_checkpoint_id(parent)
    checkpoint_id = check_checkpoint_id(checkpoint_id) if checkpoint_id else new_checkpoint_id()
    ctx.keys.check_can_push()
    squeeze = compress is not False
    files = _walk(src)
    if uploaded_streams is not None and uploaded_streams.of_files:
        files, uploaded_streams = _files_streamed(files, uploaded_streams)
    stream_inputs, kinds = _stream_inputs(ctx.chunker, streams, {f.path for f in files})
    if uploaded_streams is not None:
        taken = {f.path for f in files} | set(kinds)
        for entry in uploaded_streams.entries:
            if entry.path in taken:
                raise InvalidArgument(f"stream {entry.path!r} collides with another entry")
        kinds.update(uploaded_streams.kinds)
    if kinds and extra is not None and STREAMS_EXTRA_KEY in extra:
        raise InvalidArgument(f"extra[{STREAMS_EXTRA_KEY!r}] is reserved for streams")
    created_at = time.time()
    with job_deadline(deadline), push_lock(ctx, checkpoint_id, created_at):
        identity = refresh_identity(ctx)
        sync_index_if_gc_ran(ctx)
        parents = _parent_entries(ctx, parent)
        proof = ChunkProof(ctx)
        try:
            if not full:  # the parent's chunks are what this push expects to skip
                proof.start({c.id for e in parents.values() for c in e.chunks})
            entries, stats = push_inputs(
                ctx,
                _file_inputs(ctx, files, parents) + stream_inputs,
                compress=squeeze,
                progress=progress,
                use_index=not full,
            )
            unproven = stats.unproven
            if uploaded_streams is not None:
                entries = entries + uploaded_streams.entries
                stats.bytes_total += uploaded_streams.bytes_total
                stats.chunks_total += uploaded_streams.chunks_total
                stats.bytes_uploaded += uploaded_streams.bytes_uploaded
                stats.chunks_uploaded += uploaded_streams.chunks_uploaded
                unproven |= uploaded_streams.unproven - stats.put_ids
            # A gc that may have swept while this push ran could have removed chunks the
            # index said were there, even ones the proof saw: wait for it, then prove every
            # chunk the manifest names against a LIST taken after it.
            if sync_index_if_gc_ran(ctx, wait_for_running=True, deadline=deadline):
                proof.abandon()
                proof = ChunkProof(ctx)
                unproven = {c.id for e in entries for c in e.chunks}
            missing = proof.missing(unproven)
        except BaseException:
            proof.abandon()  # a failed push does not wait for a listing
            raise
        reuploaded = _upload_missing(
            ctx, checkpoint_id, files, entries, missing, kinds=kinds, stats=stats, compress=squeeze
        )
        entries = reuploaded.entries
        # Write order: every chunk durable, then the manifest that names them.
        make_durable(ctx)
        seconds = time.monotonic() - started
        manifest = Manifest(
            checkpoint_id=checkpoint_id,
            workload=workload,
            created_at=created_at,
            parent=parent,
            stamp=stamp or {},
            spec=spec or {},
            files=entries,
            totals={
                "bytes_total": stats.bytes_total,
                "bytes_stored": stats.bytes_uploaded,
                "chunks_total": stats.chunks_total,
                "chunks_new": stats.chunks_uploaded,
                "seconds": round(seconds, 3),
            },
            extra=_with_streams(extra, kinds),
            store_id=identity.store_id if identity is not None else None,
        )
        write_manifest(ctx, manifest)
        write_head(ctx, manifest)
    if progress is not None:
        progress(stats.bytes_total, stats.bytes_total)
    log.info(
        "pushed %s: %d bytes, %d uploaded in %.2fs",
        checkpoint_id,
        stats.bytes_total,
        stats.bytes_uploaded,
        seconds,
    )
    return PushResult(
        checkpoint_id,
        stats.bytes_total,
        stats.bytes_uploaded,
        stats.chunks_total,
        stats.chunks_uploaded,
        seconds,
        proof=proof.stats.method,
        chunks_proven=proof.stats.chunks_proven,
        chunks_reuploaded=reuploaded.chunks,
        proof_seconds=round(proof.stats.wait_seconds + reuploaded.proof_seconds, 6),
        store_id=identity.store_id if identity is not None else None,
    )


@dataclass
class _Reuploaded:
    entries: list[FileEntry]
    chunks: int = 0  # chunks found missing and put again
    proof_seconds: float = 0.0  # proving what the re-run skipped in its turn


# A re-run that finds yet more chunks missing runs again, at most this many times in all.
REUPLOAD_ROUNDS = 3


def _upload_missing(
    ctx: StoreContext,
    checkpoint_id: str,
    files: list[SourceFile],
    entries: list[FileEntry],
    missing: set[str],
    *,
    kinds: Mapping[str, str],
    stats: PushStats,
    compress: bool,
) -> _Reuploaded:
    """The push's entries, with every chunk the store turned out not to hold put again: the
    files holding one are pushed once more (the index has forgotten those chunks, so they are
    uploaded); a stream's chunk (a stream cannot be read twice) fails the push uncommitted."""
    done = _Reuploaded(entries)
    for _round in range(REUPLOAD_ROUNDS):
        if not missing:
            return done
        ctx.index.discard(missing)
        lost = sorted(e.path for e in done.entries if e.path in kinds and _names(e, missing))
        if lost:
            # GPU memory is gone once copied: the next checkpoint uploads these chunks.
            raise Unavailable(
                f"{len(missing)} chunk(s) of stream {lost[0]} are not in the store (deleted "
                f"while it was pushed, or lost behind the store's back); checkpoint "
                f"{checkpoint_id} not committed"
            )
        paths = {e.path for e in done.entries if _names(e, missing)}
        log.info(
            "push %s: %d chunks are not in the store; pushing %d file(s) again",
            checkpoint_id,
            len(missing),
            len(paths),
        )
        again, more = push_inputs(
            ctx,
            _file_inputs(ctx, [f for f in files if f.path in paths], {}),
            compress=compress,
            progress=None,
        )
        stats.bytes_uploaded += more.bytes_uploaded
        stats.chunks_uploaded += more.chunks_uploaded
        stats.put_ids |= more.put_ids
        done.chunks += len(missing & more.put_ids)
        replaced = {e.path: e for e in again}
        done.entries = [replaced.get(e.path, e) for e in done.entries]
        # What the re-run skipped was proven already, unless the files changed meanwhile.
        proof = ChunkProof(ctx)
        missing = proof.missing(more.unproven - stats.index_skipped)
        done.proof_seconds += proof.stats.wait_seconds
    if missing:
        raise Unavailable(
            f"chunks of checkpoint {checkpoint_id} keep vanishing from the store while it is "
            "pushed; not committed"
        )
    return done


def _names(entry: FileEntry, ids: set[str]) -> bool:
    return any(c.id in ids for c in entry.chunks)


def _uploaded(
    entries: list[FileEntry], stats: PushStats, started: float, kinds: dict[str, str]
) -> UploadedStreams:
    return UploadedStreams(
        entries=entries,
        kinds=kinds,
        bytes_total=stats.bytes_total,
        bytes_uploaded=stats.bytes_uploaded,
        chunks_total=stats.chunks_total,
        chunks_uploaded=stats.chunks_uploaded,
        seconds=time.monotonic() - started,
        unproven=stats.unproven,
    )


def upload_streams(
    ctx: StoreContext,
    streams: Mapping[str, StreamSource],
    *,
    compress: bool | None,
    progress: ProgressFn | None,
    full: bool = False,
    seed_cache: bool = False,
) -> UploadedStreams:
    """Put the chunks of ``streams`` in the store now; a later push names them (no manifest).
    ``full``: every chunk put, none taken on the index's word (for a full push)."""
    started = time.monotonic()
    ctx = _seeded(ctx, seed_cache)
    ctx.keys.check_can_push()
    inputs, kinds = _stream_inputs(ctx.chunker, streams, ())
    refresh_identity(ctx)
    sync_index_if_gc_ran(ctx)
    entries, stats = push_inputs(
        ctx, inputs, compress=compress is not False, progress=progress, use_index=not full
    )
    return _uploaded(entries, stats, started, kinds)


def upload_growing(
    ctx: StoreContext,
    path: Path,
    name: str,
    *,
    complete: Callable[[], bool],
    stop: Callable[[], bool],
    kind: str,
    compress: bool | None,
    full: bool = False,
    seed_cache: bool = False,
) -> UploadedStreams:
    """Upload a file while its writer appends to it (``CheckpointStore.upload_growing``)."""
    started = time.monotonic()
    ctx = _seeded(ctx, seed_cache)
    ctx.keys.check_can_push()
    check_stream_path(name)
    source = growing_file_input(path, name, ctx.chunker, complete, stop=stop)
    refresh_identity(ctx)
    sync_index_if_gc_ran(ctx)
    entries, stats = push_inputs(
        ctx, [source], compress=compress is not False, progress=None, use_index=not full
    )
    uploaded = _uploaded(entries, stats, started, {name: kind})
    uploaded.of_files.add(name)
    return uploaded


def _files_streamed(
    files: list[SourceFile], uploaded: UploadedStreams
) -> tuple[list[SourceFile], UploadedStreams]:
    """Files of ``src`` already uploaded while they were written (``UploadedStreams.of_files``).

    Such a file is not read again when it still has the size its stream had; one that does
    not (it grew after its writer was thought done) is pushed as a file, its stream dropped.
    """
    sizes = {f.path: f.size for f in files}
    kept = replace(uploaded, entries=[], kinds={}, of_files=set())
    for entry in uploaded.entries:
        if entry.path not in uploaded.of_files:
            kept.entries.append(entry)
            if entry.path in uploaded.kinds:
                kept.kinds[entry.path] = uploaded.kinds[entry.path]
        elif sizes.get(entry.path) == entry.size:
            kept.entries.append(entry)
            kept.kinds[entry.path] = uploaded.kinds.get(entry.path, "file")
            kept.of_files.add(entry.path)
        else:
            log.warning(
                "%s has %s bytes, %d when it was streamed; reading it again",
                entry.path,
                sizes.get(entry.path, "no"),
                entry.size,
            )
    return [f for f in files if f.path not in kept.of_files], kept


def _stream_inputs(
    chunker: Chunker, streams: Mapping[str, StreamSource] | None, taken: Collection[str]
) -> tuple[list[PushInput], dict[str, str]]:
    """Push inputs for ``streams`` and their kinds by path; a path in ``taken`` is refused."""
    inputs: list[PushInput] = []
    kinds: dict[str, str] = {}
    for path, source in sorted((streams or {}).items()):
        check_stream_path(path)
        if path in taken:
            raise InvalidArgument(f"stream {path!r} collides with a file of the same name")
        if source.size < 0:
            raise InvalidArgument(f"stream {path!r} declares a negative size")
        kinds[path] = source.kind

        def chunks(
            path: str = path, source: StreamSource = source
        ) -> Generator[memoryview, None, None]:
            return cut_stream(chunker, source, path)

        inputs.append(PushInput(path, source.size, source.mode & 0o777, chunks))
    return inputs, kinds


def make_durable(ctx: StoreContext) -> None:
    """Make every pending chunk durable (one backend sync), and say so in the index.

    The pending entries are read before the sync starts, so each was added after its
    put returned: the sync covers it. They are this push's chunks and any left pending
    by earlier pushes of this boot (killed ones included) that this push may reference.
    """
    pending = ctx.index.pending()
    started = time.monotonic()
    sync_deferred(ctx.backend, [chunk_key(chunk_id) for chunk_id, _mark in pending])
    ctx.index.mark_synced(pending)
    log.debug(
        "synced the store for %d pending chunks in %.3fs",
        len(pending),
        time.monotonic() - started,
    )


def _with_streams(extra: dict[str, Any] | None, kinds: Mapping[str, str]) -> dict[str, Any]:
    out = dict(extra or {})
    if kinds:
        out[STREAMS_EXTRA_KEY] = streams_extra(kinds)
    return out


def _walk(src: Path) -> list[SourceFile]:
    """Every regular file under ``src``, sorted; anything else is refused (nothing is lost)."""
    try:
        st = src.stat()
    except FileNotFoundError as exc:
        raise NotFound(f"source directory {src} does not exist") from exc
    except OSError as exc:
        raise InvalidArgument(f"cannot read {src}: {exc.strerror}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(f"{src} is not a directory")
    files: list[SourceFile] = []

    def visit(directory: Path, rel: str) -> None:
        try:
            names = sorted(os.listdir(directory))
        except OSError as exc:
            raise InvalidArgument(f"cannot list {directory}: {exc.strerror}") from exc
        for name in names:
            path = directory / name
            rel_path = f"{rel}{name}"
            try:
                st = path.lstat()
            except OSError as exc:
                raise InvalidArgument(f"cannot read {path}: {exc.strerror}") from exc
            if stat.S_ISDIR(st.st_mode):
                visit(path, f"{rel_path}/")
            elif stat.S_ISREG(st.st_mode):
                files.append(
                    SourceFile(rel_path, path, st.st_size, stat.S_IMODE(st.st_mode) & 0o777)
                )
            else:
                raise InvalidArgument(f"{path} is not a regular file or directory; not pushed")

    visit(src, "")
    return files
