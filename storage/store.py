"""``CheckpointStore``: push, pull, list, verify and gc checkpoints in one store.

Key layout (see docs/design.md)::

    chunks/<id[:2]>/<id>            chunk objects (codec.py), written once, named by content
    manifests/<workload>/<ckpt id>  signed manifest envelopes, created with if_absent
    locks/push-<ckpt id>            a push in flight (refreshed while it runs)
    locks/gc-<gc id>                a gc run: started, then its finish time
    migrations/                     reserved for the migration protocol

Write order: chunks, a sync that makes them durable, then the manifest; readers go the other
way. This module holds the store's state (backend, keys, index, worker pools) and its public
methods; the work is done by one module each, to which the methods delegate:
``storage/push.py`` (push, upload_streams), ``storage/catalog.py`` (reading, listing and
writing manifests), ``storage/pull.py`` (pull), ``storage/verify.py`` (verify) and
``storage/gc.py`` (gc, retention and the lock protocol that keeps a push's chunks alive).
"""

from __future__ import annotations

import builtins
import logging
import os
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from gpusnap.errors import FailedPrecondition, GpusnapError, InvalidArgument, NotFound
from gpusnap.storage.backend import Backend, BackendOptions, open_backend, sync_deferred
from gpusnap.storage.catalog import find_manifest_key, list_manifests, read_manifest
from gpusnap.storage.chunker import Chunker
from gpusnap.storage.codec import ChunkCodec
from gpusnap.storage.gc import (
    LOCK_PREFIX,
    LOCK_REFRESH_SECONDS,
    LOCK_STALE_SECONDS,
    GcReport,
    collect,
    sync_index_if_gc_ran,
)
from gpusnap.storage.index import ChunkIndex, default_cache_dir
from gpusnap.storage.keys import (
    EncryptionKeys,
    SigningKey,
    load_encryption_key,
    load_signing_key,
    seal,
    unseal,
)
from gpusnap.storage.manifest import MANIFEST_PREFIX, FileEntry, Manifest, ManifestSummary
from gpusnap.storage.pipeline import (
    CHUNK_PREFIX,
    ProgressFn,
    PushInput,
    PushStats,
    SourceFile,
    chunk_id_of_key,
    push_files,
    push_inputs,
    read_entry,
)
from gpusnap.storage.pull import pull_files
from gpusnap.storage.push import PushResult, push_tree, upload_growing_file, upload_streams_ahead
from gpusnap.storage.streams import StreamSource, UploadedStreams, stream_kinds
from gpusnap.storage.verify import VerifyReport, verify_store

log = logging.getLogger(__name__)

MIGRATION_PREFIX = "migrations/"  # reserved: the migration protocol owns it
RECORD_FORMAT = "gpusnap.record/1"


@dataclass
class PullResult:
    checkpoint_id: str
    bytes_total: int
    bytes_fetched: int
    chunks_total: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class CheckpointStore:
    """A checkpoint store on one backend; thread-safe for independent calls."""

    def __init__(
        self,
        backend: Backend,
        *,
        signer: SigningKey | None,
        encryption: EncryptionKeys | None,
        verify: bool = True,
        cache_dir: Path | None = None,
        workers: int | None = None,
        chunker: Chunker | None = None,
    ) -> None:
        self.backend = backend
        self.verify_manifests = verify
        self._signer = signer
        self._encryption = encryption
        self._codec = ChunkCodec(encryption)
        self._chunker = chunker or Chunker()
        self.workers = workers or (os.cpu_count() or 2)
        cache = cache_dir or default_cache_dir(backend.url)
        self.index = ChunkIndex(cache / "index.sqlite", backend.url)
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="gpusnap-store")
        # Puts and gets wait on storage, not on a core: they get their own, wider pool.
        self.io_workers = max(8, 2 * self.workers)
        self._io_executor = ThreadPoolExecutor(self.io_workers, thread_name_prefix="gpusnap-io")
        # Bytes in flight (being hashed, compressed, or waiting on a put/get) at most.
        self._budget = max(2 * self.workers, self.io_workers) * self._chunker.params.max_size
        # Tunable for tests: how long a lock lives without refresh, and how often to refresh.
        self.lock_stale_seconds = LOCK_STALE_SECONDS
        self.lock_refresh_seconds = LOCK_REFRESH_SECONDS

    # --- records: signed small objects --------------------------------------------------

    def sign(self, payload: bytes) -> bytes:
        """Seal ``payload`` (signed, and encrypted when the store has an encryption key)."""
        if self._signer is None:
            raise FailedPrecondition("signing needs a signing key file")
        return seal(RECORD_FORMAT, payload, signer=self._signer, encryption=self._encryption)

    def open_signed(self, blob: bytes) -> bytes:
        """The payload of a record made by ``sign``; ``Corrupt`` if altered or foreign."""
        return unseal(
            blob,
            RECORD_FORMAT,
            signer=self._signer,
            encryption=self._encryption,
            verify=True,
            what="signed record",
        )

    # --- push (storage/push.py) ---------------------------------------------------------

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
    ) -> PushResult:
        """Upload the tree ``src`` as a new checkpoint; the manifest is committed last.

        ``streams`` adds virtual files whose bytes come from a stream (``storage.streams``),
        uploaded in the same run; ``uploaded_streams`` adds streams ``upload_streams``
        already put in the store. Both become ordinary file entries, named in
        ``extra["streams"]`` with their kind; a path may not also be a file under ``src``.
        """
        return push_tree(
            self,
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
        )

    def upload_streams(
        self,
        streams: Mapping[str, StreamSource],
        *,
        compress: bool | None = None,
        progress: ProgressFn | None = None,
    ) -> UploadedStreams:
        """Put the chunks of ``streams`` in the store now; a later ``push`` names them.

        For data that must leave its source before the rest of the checkpoint exists (GPU
        memory copied with custom storage, before CRIU dumps the process). No manifest is
        written: pass the result to ``push(..., uploaded_streams=...)``.
        """
        return upload_streams_ahead(self, streams, compress=compress, progress=progress)

    def upload_growing(
        self,
        path: Path,
        name: str,
        *,
        complete: Callable[[], bool],
        stop: Callable[[], bool] = lambda: False,
        kind: str = "file",
        compress: bool | None = None,
    ) -> UploadedStreams:
        """Put the chunks of ``path`` in the store while another process appends to it.

        ``complete()`` says the writer is done; ``stop()`` gives up. The result names the
        file as entry ``name`` and is handed to ``push(..., uploaded_streams=...)``, which
        uses it instead of the file of that name if the file still has the size read
        (``storage/growing.py``).
        """
        return upload_growing_file(
            self, path, name, complete=complete, stop=stop, kind=kind, compress=compress
        )

    def _upload_inputs(
        self, inputs: builtins.list[PushInput], compress: bool | None, progress: ProgressFn | None
    ) -> tuple[builtins.list[FileEntry], PushStats]:
        return push_inputs(
            inputs,
            backend=self.backend,
            codec=self._codec,
            index=self.index,
            executor=self._executor,
            io_executor=self._io_executor,
            budget_bytes=self._budget,
            compress=compress is not False,
            progress=progress,
        )

    def _upload(
        self,
        files: builtins.list[SourceFile],
        compress: bool | None,
        progress: ProgressFn | None,
        parents: Mapping[str, FileEntry] | None = None,
    ) -> tuple[builtins.list[FileEntry], PushStats]:
        return push_files(
            files,
            backend=self.backend,
            codec=self._codec,
            index=self.index,
            chunker=self._chunker,
            executor=self._executor,
            io_executor=self._io_executor,
            budget_bytes=self._budget,
            compress=compress is not False,
            progress=progress,
            parents=parents,
        )

    # --- the index and gc records -------------------------------------------------------

    def rebuild_index(self) -> int:
        """Rebuild the local chunk index from one LIST of the store; returns the chunk count."""
        listed_at = time.time()
        entries = []
        for info in self.backend.list(CHUNK_PREFIX):
            chunk_id = chunk_id_of_key(info.key)
            if chunk_id is not None:
                entries.append((chunk_id, info.size))
        # A listed chunk may be one a local push put but has not synced yet (perhaps with
        # another index): sync everything, so that every entry of the rebuilt index is
        # durable. Rebuilds are rare (first use, after a gc), so a whole-store sync is fine.
        sync_deferred(self.backend)
        return self.index.replace_all(entries, listed_at)

    # --- reading manifests (storage/catalog.py) -----------------------------------------

    def _read_manifest(self, key: str, *, verify: bool | None = None) -> Manifest:
        return read_manifest(
            self.backend,
            key,
            signer=self._signer,
            encryption=self._encryption,
            verify=self.verify_manifests if verify is None else verify,
        )

    def manifest(self, checkpoint_id: str) -> Manifest:
        """The checkpoint's manifest, fetched and authenticated (``NotFound`` / ``Corrupt``)."""
        return self._read_manifest(find_manifest_key(self.backend, checkpoint_id))

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
        return list_manifests(self.backend, workload, self._read_manifest)

    def latest(self, workload: str) -> ManifestSummary | None:
        found = self.list(workload)
        return found[0] if found else None

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
        around the page cache and ``durable`` syncs before returning (see ``storage/pull.py``);
        a pull whose files are read back at once and thrown away wants neither.
        """
        started = time.monotonic()
        manifest = self.manifest(checkpoint_id)
        if exclude_kinds:
            kinds = stream_kinds(manifest)
            left_out = {p for p, k in kinds.items() if k in exclude_kinds}
            manifest = replace(
                manifest, files=[f for f in manifest.files if f.path not in left_out]
            )
        # A local store's chunks are read faster than they decode: one thread per core both
        # reads and decodes (more only contend for the cores). A remote store's fetches wait
        # on the network: many in flight, their decodes still one per core.
        local = self.backend.url.startswith("file://")
        stats = pull_files(
            manifest,
            dest,
            backend=self.backend,
            codec=self._codec,
            executor=self._executor if local else self._io_executor,
            budget_bytes=self._budget,
            progress=progress,
            direct=direct,
            durable=durable,
            decoders=self.workers,
        )
        return PullResult(
            checkpoint_id,
            stats.bytes_total,
            stats.bytes_fetched,
            stats.chunks_total,
            time.monotonic() - started,
        )

    def open_stream(
        self, checkpoint: str | Manifest, path: str
    ) -> Iterator[tuple[int, bytes | memoryview]]:
        """``(offset, bytes)`` of one entry of a checkpoint, in order, each chunk verified.

        ``checkpoint`` is an id or a manifest already fetched (and so authenticated) by
        ``manifest``. Fetches run ahead in parallel within the store's memory budget; nothing
        is written to disk. A missing entry is ``NotFound``; a bad chunk ``Corrupt``.
        """
        manifest = self.manifest(checkpoint) if isinstance(checkpoint, str) else checkpoint
        entry = next((f for f in manifest.files if f.path == path), None)
        if entry is None:
            raise NotFound(f"checkpoint {manifest.checkpoint_id} has no entry {path!r}")
        return read_entry(
            entry,
            backend=self.backend,
            codec=self._codec,
            executor=self._io_executor,
            budget_bytes=self._budget,
        )

    # --- verify -------------------------------------------------------------------------

    def verify(
        self, ids: builtins.list[str] | None = None, *, read_data: bool = False
    ) -> VerifyReport:
        """Check manifests and chunk presence (one LIST); with ``read_data`` re-hash chunks."""
        return verify_store(
            self.backend,
            ids,
            read_manifest=self._read_manifest,
            codec=self._codec,
            executor=self._executor,
            read_data=read_data,
        )

    # --- gc (storage/gc.py) -------------------------------------------------------------

    def gc(
        self, *, keep_last: int | None = None, grace_seconds: float = 3600.0, dry_run: bool = False
    ) -> GcReport:
        """Apply retention, then delete chunks no manifest references and older than grace.

        The protocol that keeps a push's chunks alive is in ``storage/gc.py`` and
        docs/design.md.
        """
        return collect(self, keep_last=keep_last, grace_seconds=grace_seconds, dry_run=dry_run)

    def _sync_index_if_gc_ran(self, *, wait_for_running: bool = False) -> bool:
        return sync_index_if_gc_ran(self, wait_for_running=wait_for_running)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._io_executor.shutdown(wait=True)
        self.index.close()
        self.backend.close()

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
) -> CheckpointStore:
    """Open the checkpoint store at ``url`` (``file:///path`` or ``s3://bucket/prefix``)."""
    signer = load_signing_key(key_file) if key_file is not None else None
    encryption = load_encryption_key(encryption_key_file) if encryption_key_file else None
    if workers is not None and workers < 1:
        raise InvalidArgument("workers must be at least 1")
    backend = open_backend(url, options)
    try:
        return CheckpointStore(
            backend,
            signer=signer,
            encryption=encryption,
            verify=verify,
            cache_dir=cache_dir,
            workers=workers,
        )
    except BaseException:
        backend.close()
        raise


# The key prefixes are re-exported: they name the layout in this module's docstring.
__all__ = [
    "LOCK_PREFIX",
    "MANIFEST_PREFIX",
    "CheckpointStore",
    "GcReport",
    "PullResult",
    "PushResult",
    "VerifyReport",
    "open_store",
]
