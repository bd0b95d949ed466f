"""``CheckpointStore``: push, pull, list, verify and gc checkpoints in one store.

A store is its parts (``context.StoreContext``: backend, keys, codec, chunker, index, pools)
and the operations on them, one module each, which take the context and never call back
here: ``push.py`` (push, upload_streams, upload_growing), ``catalog.py`` (reading, listing
and writing manifests), ``pull.py`` (pull, open_stream), ``verify.py``, ``gc.py`` and
``records.py`` (signed records). The keys they use are ``layout.py``'s. This class holds one
context, says what each call means to its users, and delegates.

Write order: chunks, a sync that makes them durable, then the manifest; readers go the other
way (docs/design.md).
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, Unpack

from gpusnap.errors import GpusnapError, InvalidArgument
from gpusnap.storage import catalog, gc, heads, prefetch, pull, push, verify
from gpusnap.storage.backend import Backend, BackendOptions
from gpusnap.storage.cache import ChunkCache, StoreCache
from gpusnap.storage.context import StoreContext, open_context
from gpusnap.storage.gc import GcReport
from gpusnap.storage.heads import Latest
from gpusnap.storage.identity import StoreIdentity
from gpusnap.storage.index import ChunkIndex, rebuild_index
from gpusnap.storage.keys import (
    StoreKeys,
    load_encryption_key,
    load_signing_key,
    load_trusted_keys,
)
from gpusnap.storage.manifest import Manifest, ManifestSummary
from gpusnap.storage.open import open_backend
from gpusnap.storage.parallel import ProgressFn
from gpusnap.storage.prefetch import PrefetchOptions, PrefetchResult
from gpusnap.storage.pull import PullResult, PullStats
from gpusnap.storage.push import PushResult
from gpusnap.storage.records import SignedRecords, open_record, seal_record
from gpusnap.storage.streams import StreamSource, UploadedStreams
from gpusnap.storage.verify import StoreCheck, VerifyReport


class CheckpointStore:
    """A checkpoint store on one backend; thread-safe for independent calls."""

    def __init__(self, context: StoreContext) -> None:
        self.context = context

    @property
    def backend(self) -> Backend:
        """The store's backend (for tools and tests that look at objects themselves)."""
        return self.context.backend

    @property
    def index(self) -> ChunkIndex:
        """The node's local chunk index for this store (a hint, never the truth)."""
        return self.context.index

    @property
    def identity(self) -> StoreIdentity | None:
        """The store's identity (its signed ``config``) as last read: at open, and again by
        each push, which writes one into a store that has none. ``None`` before that, or
        when the config found cannot be authenticated (``identity_problem`` says why)."""
        return self.context.store_identity

    @property
    def identity_problem(self) -> GpusnapError | None:
        """Why the store's config was not used (altered, or signed by an untrusted key)."""
        return self.context.identity.problem

    @property
    def cache(self) -> StoreCache | None:
        """This store's part of the node's chunk cache, if the store was opened with one."""
        return self.context.cache

    # --- signed records -----------------------------------------------------------------

    def records(self, prefix: str) -> SignedRecords:
        """The signed records under ``prefix`` (e.g. ``layout.MIGRATION_PREFIX``): small
        JSON objects written once and read back authenticated (``storage/records.py``)."""
        return SignedRecords(self.context, prefix)

    def sign(self, payload: bytes) -> bytes:
        """Seal ``payload`` (signed, and encrypted when the store has an encryption key)."""
        return seal_record(self.context.keys, payload)

    def open_signed(self, blob: bytes) -> bytes:
        """The payload of a record made by ``sign``; ``Corrupt`` if altered or foreign."""
        return open_record(self.context.keys, blob)

    # --- push ---------------------------------------------------------------------------

    def push(
        self,
        src: Path,
        *,
        workload: str,
        parent: str | None = None,
        stamp: dict[str, Any] | None = None,
        spec: dict[str, Any] | None = None,
        progress: ProgressFn | None = None,
        compress: bool | None = None,
        checkpoint_id: str | None = None,
        extra: dict[str, Any] | None = None,
        streams: Mapping[str, StreamSource] | None = None,
        uploaded_streams: UploadedStreams | None = None,
        full: bool = False,
        seed_cache: bool = False,
        deadline: float | None = None,
    ) -> PushResult:
        """Upload the tree ``src`` as a new checkpoint; the manifest is committed last.

        ``streams`` adds virtual files whose bytes come from a stream (``storage.streams``),
        uploaded in the same run; ``uploaded_streams`` adds streams ``upload_streams``
        already put in the store. Both become ordinary file entries, named in
        ``extra["streams"]`` with their kind; a path may not also be a file under ``src``.

        Chunks the local index lists are not uploaded, and are proven present in the store
        before the commit (those it lacks are uploaded after all). ``full`` uploads every
        chunk whatever the index says, replacing the objects (for a workload whose latest
        checkpoint a check found damaged; ``parent`` is then only a cutting hint); the
        ``uploaded_streams`` of a full push are uploaded with ``full`` too, since the push
        names their chunks as they went up.

        ``seed_cache`` keeps every chunk object this push uploads in the node's chunk cache
        too (when the store has one): what a node just pushed, it holds.
        ``deadline`` (epoch seconds, the job's) bounds the wait for a running gc before the
        commit: past it the push fails with ``DeadlineExceeded``.
        """
        return push.push_tree(
            self.context,
            src,
            workload=workload,
            parent=parent,
            stamp=stamp,
            spec=spec,
            progress=progress,
            compress=compress,
            checkpoint_id=checkpoint_id,
            extra=extra,
            streams=streams,
            uploaded_streams=uploaded_streams,
            full=full,
            seed_cache=seed_cache,
            deadline=deadline,
        )

    def upload_streams(
        self,
        streams: Mapping[str, StreamSource],
        *,
        compress: bool | None = None,
        progress: ProgressFn | None = None,
        full: bool = False,
        seed_cache: bool = False,
    ) -> UploadedStreams:
        """Put the chunks of ``streams`` in the store now; a later ``push`` names them.

        For data that must leave its source before the rest of the checkpoint exists (GPU
        memory copied with custom storage, before CRIU dumps the process). No manifest is
        written: pass the result to ``push(..., uploaded_streams=...)``. ``full`` and
        ``seed_cache`` as for ``push`` (the streams of a full push are uploaded whole too).
        """
        return push.upload_streams(
            self.context,
            streams,
            compress=compress,
            progress=progress,
            full=full,
            seed_cache=seed_cache,
        )

    def upload_growing(
        self,
        path: Path,
        name: str,
        *,
        complete: Callable[[], bool],
        stop: Callable[[], bool] = lambda: False,
        kind: str = "file",
        compress: bool | None = None,
        full: bool = False,
        seed_cache: bool = False,
    ) -> UploadedStreams:
        """Put the chunks of ``path`` in the store while another process appends to it.

        ``complete()`` says the writer is done; ``stop()`` gives up. The result names the
        file as entry ``name`` and is handed to ``push(..., uploaded_streams=...)``, which
        uses it instead of the file of that name if the file still has the size read
        (``storage/growing.py``). ``full`` and ``seed_cache`` as for ``push``.
        """
        return push.upload_growing(
            self.context,
            path,
            name,
            complete=complete,
            stop=stop,
            kind=kind,
            compress=compress,
            full=full,
            seed_cache=seed_cache,
        )

    def rebuild_index(self) -> int:
        """Rebuild the local chunk index from one LIST of the store; returns the chunk count."""
        return rebuild_index(self.context.backend, self.context.index)

    # --- reading manifests --------------------------------------------------------------

    def manifest(self, checkpoint_id: str) -> Manifest:
        """The checkpoint's manifest, fetched and authenticated (``NotFound`` / ``Corrupt``)."""
        return catalog.fetch_manifest(self.context, checkpoint_id)

    def list(self, workload: str | None = None) -> builtins.list[ManifestSummary]:
        """Checkpoints, newest first. Manifests that fail their checks are left out (logged)."""
        return self.list_checked(workload)[0]

    def list_checked(
        self, workload: str | None = None
    ) -> tuple[builtins.list[ManifestSummary], builtins.list[tuple[str, GpusnapError]]]:
        """Like ``list``, and also the manifests left out, with why (key, error).

        A manifest that cannot be authenticated (no key, the wrong key, altered) is left out
        of the list; a caller showing the list to a person should say so, or a wrong key
        looks like an empty store.
        """
        return catalog.list_manifests(self.context, workload)

    def checkpoint_ids(self, workload: str) -> builtins.list[str]:
        """``workload``'s checkpoint ids, newest first (by the second in the id; two of one
        second in no particular order). Cheap: one LIST, no manifest read or authenticated;
        a caller that polls for a new checkpoint reads (``manifest``) only the one it uses."""
        return catalog.checkpoint_ids(self.context, workload)

    def latest(self, workload: str) -> ManifestSummary | None:
        """The newest checkpoint of ``workload`` this node can read; no freshness check (for
        choosing a parent, a status line). What is restored goes through ``latest_checked``."""
        found = self.list(workload)
        return found[0] if found else None

    def latest_checked(self, workload: str, *, allow_rollback: bool = False) -> Latest:
        """``latest``, refused (``RollbackRefused``, exit 4) when the workload's newest head
        record names a checkpoint the store no longer has, or is older than this node's
        high-water mark; ``allow_rollback`` accepts what the store holds (``heads.py``).
        ``Latest.note`` says when the answer is not vouched for (no head yet, or accepted)."""
        return heads.latest_checked(self.context, workload, allow_rollback=allow_rollback)

    # --- pull ---------------------------------------------------------------------------

    def pull(
        self,
        checkpoint_id: str,
        dest: Path,
        *,
        progress: ProgressFn | None = None,
        exclude_kinds: Collection[str] = (),
        direct: bool = True,
        durable: bool = True,
    ) -> PullResult:
        """Restore a checkpoint's files under ``dest`` (all or nothing).

        Entries pushed as streams of a kind in ``exclude_kinds`` are left out (read them
        with ``open_stream``); by default every entry is written as a file. ``direct`` writes
        around the page cache and ``durable`` syncs before returning (see ``storage/dest.py``);
        a pull whose files are read back at once and thrown away wants neither. Chunks come
        from the node's chunk cache where it has them (``bytes_cached``), else from the
        store (``bytes_fetched``), and what the store gave is kept in the cache.
        """
        return pull.pull(
            self.context,
            checkpoint_id,
            dest,
            progress=progress,
            exclude_kinds=exclude_kinds,
            direct=direct,
            durable=durable,
        )

    def open_stream(
        self, checkpoint: str | Manifest, path: str, *, stats: PullStats | None = None
    ) -> Iterator[tuple[int, bytes | memoryview]]:
        """``(offset, bytes)`` of one entry of a checkpoint, in order, each chunk verified.

        ``checkpoint`` is an id or a manifest already fetched (and so authenticated) by
        ``manifest``. Fetches run ahead in parallel within the store's memory budget; nothing
        is written to disk. A missing entry is ``NotFound``; a bad chunk ``Corrupt``. Chunks
        come from the node's chunk cache where it has them; ``stats`` (``PullStats()``) counts
        ``bytes_fetched`` from the store and ``bytes_cached``, over every stream given it.
        """
        return pull.open_stream(self.context, checkpoint, path, stats=stats)

    # --- the node's chunk cache -------------------------------------------------------

    def prefetch(
        self, checkpoint: str | Manifest, **options: Unpack[PrefetchOptions]
    ) -> PrefetchResult:
        """Fetch into the node's chunk cache what it lacks of ``checkpoint``, gently.

        At most ``bandwidth`` store bytes per second (or what a shared ``bucket`` allows),
        on ``threads`` threads of lowered priority, no more than the cache's budget holds
        beside the chunks it already has of it; ``stop`` ends it early. Returns how much of
        the checkpoint is now warm (``storage/prefetch.py``). Needs a store opened with a
        chunk cache (``FailedPrecondition`` otherwise).
        """
        return prefetch.prefetch(self.context, checkpoint, **options)

    def warm_bytes(self, checkpoint: str | Manifest) -> tuple[int, int]:
        """``(bytes held here, bytes a restore would fetch)`` of a checkpoint; cheap: one
        query of the cache's index (the manifest is fetched if an id is given)."""
        return prefetch.warm_bytes(self.context, checkpoint)

    def warm_fraction(self, checkpoint: str | Manifest) -> float:
        """How much of what a restore of ``checkpoint`` would fetch the cache holds (0..1)."""
        return prefetch.warm_fraction(self.context, checkpoint)

    # --- verify and gc ------------------------------------------------------------------

    def verify(
        self, ids: builtins.list[str] | None = None, *, read_data: bool = False
    ) -> VerifyReport:
        """Check manifests and chunk presence (one LIST); with ``read_data`` re-hash chunks.

        Missing chunks are dropped from the local index and corrupt ones marked bad, so the
        next push uploads them again; the report names every damaged checkpoint.
        """
        return verify.verify_store(self.context, ids, read_data=read_data)

    def check(self, checkpoint_ids: Collection[str] | None = None) -> StoreCheck:
        """A cheap existence check of every chunk the checkpoints name (all when ``None``):
        one LIST of the manifests, a GET of each, one LIST of the chunks, nothing read.

        For the daemon's schedule (``[store] check_interval``). ``StoreCheck.missing`` maps
        each damaged checkpoint to the chunks the store lacks; those are dropped from the
        local index, so the next push uploads them again.
        """
        return verify.check_chunks(self.context, checkpoint_ids)

    def gc(
        self, *, keep_last: int | None = None, grace_seconds: float = 3600.0, dry_run: bool = False
    ) -> GcReport:
        """Apply retention, then delete chunks no manifest references and older than grace.

        The protocol that keeps a push's chunks alive is in ``storage/locks.py`` and
        docs/design.md.
        """
        return gc.collect(
            self.context, keep_last=keep_last, grace_seconds=grace_seconds, dry_run=dry_run
        )

    def close(self) -> None:
        self.context.close()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(
    url: str,
    *,
    key_file: Path | None = None,
    encryption_key_file: Path | None = None,
    options: BackendOptions | None = None,
    verify: bool = True,
    cache_dir: Path | None = None,
    workers: int | None = None,
    trusted_keys: Collection[Path] = (),
    chunk_cache: ChunkCache | None = None,
    high_water_file: Path | None = None,
) -> CheckpointStore:
    """Open the checkpoint store at ``url`` (``file:///path`` or ``s3://bucket/prefix``).

    ``key_file`` is this node's signing key (its manifests are signed with it, and its own
    signature is always trusted); ``trusted_keys`` are public key files, or directories of
    ``*.pub`` files, whose signatures this node also accepts (other nodes' keys, and retired
    keys whose checkpoints must still restore). A manifest signed by any other key is
    refused (``UntrustedSigner``, exit 4). Opening reads the store's ``config`` (one GET).

    ``cache_dir`` holds the store's chunk index; ``chunk_cache`` is the node's chunk cache
    (``storage.cache.ChunkCache``, the caller's to close, after the store), which pulls read
    before the store and fill, and pushes may seed. ``high_water_file`` holds the node's
    marks of the head records it has seen (``storage/highwater.py``; default ``heads.json``
    in ``cache_dir``).
    """
    signer = load_signing_key(key_file) if key_file is not None else None
    encryption = load_encryption_key(encryption_key_file) if encryption_key_file else None
    trusted = load_trusted_keys(trusted_keys)
    if workers is not None and workers < 1:
        raise InvalidArgument("workers must be at least 1")
    backend = open_backend(url, options)
    try:
        keys = StoreKeys(signer, encryption, verify, trusted)
        return CheckpointStore(
            open_context(
                backend,
                keys,
                cache_dir=cache_dir,
                workers=workers,
                chunk_cache=chunk_cache,
                high_water_file=high_water_file,
            )
        )
    except BaseException:
        backend.close()
        raise


__all__ = [
    "CheckpointStore",
    "GcReport",
    "PrefetchResult",
    "PullResult",
    "PullStats",
    "PushResult",
    "StoreCheck",
    "VerifyReport",
    "open_store",
]
