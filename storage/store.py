"""``CheckpointStore``: push, pull, list, verify and gc checkpoints in one store.

Key layout (see docs/design.md)::

    chunks/<id[:2]>/<id>            chunk objects (codec.py), written once, named by content
    manifests/<workload>/<ckpt id>  signed manifest envelopes, created with if_absent
    locks/push-<ckpt id>            a push in flight (refreshed while it runs)
    locks/gc-<gc id>                a gc run: started, then its finish time
    migrations/                     reserved for the migration protocol

Write order: chunks, a sync that makes them durable, then the manifest; readers go the other
way. gc, retention and the lock protocol that keeps a push's chunks alive are in
``storage/gc.py`` (and docs/design.md); this module keeps the public ``gc`` entry point.
"""

from __future__ import annotations

import builtins
import logging
import os
import socket
import stat
import time
from collections.abc import Collection, Generator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from gpusnap.storage.backend import (
    Backend,
    BackendOptions,
    open_backend,
    sync_deferred,
)
from gpusnap.storage.chunker import Chunker
from gpusnap.storage.codec import ChunkCodec
from gpusnap.storage.errors import (
    AlreadyExists,
    Corrupt,
    FailedPrecondition,
    GpusnapError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from gpusnap.storage.gc import (
    LOCK_PREFIX,
    LOCK_REFRESH_SECONDS,
    LOCK_STALE_SECONDS,
    GcReport,
    LockHolder,
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
from gpusnap.storage.manifest import (
    ENVELOPE_FORMAT,
    MANIFEST_PREFIX,
    FileEntry,
    Manifest,
    ManifestSummary,
    check_checkpoint_id,
    check_workload,
    manifest_key,
    new_checkpoint_id,
    split_manifest_key,
)
from gpusnap.storage.pipeline import (
    CHUNK_PREFIX,
    ProgressFn,
    PushInput,
    PushStats,
    SourceFile,
    chunk_id_of_key,
    chunk_key,
    file_input,
    push_files,
    push_inputs,
    read_entry,
)
from gpusnap.storage.pull import pull_files
from gpusnap.storage.streams import (
    STREAMS_EXTRA_KEY,
    StreamSource,
    UploadedStreams,
    check_stream_path,
    cut_stream,
    stream_kinds,
    streams_extra,
)

log = logging.getLogger(__name__)

MIGRATION_PREFIX = "migrations/"  # reserved: the migration protocol owns it
RECORD_FORMAT = "gpusnap.record/1"


@dataclass
class PushResult:
    checkpoint_id: str
    bytes_total: int
    bytes_uploaded: int
    chunks_total: int
    chunks_uploaded: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PullResult:
    checkpoint_id: str
    bytes_total: int
    bytes_fetched: int
    chunks_total: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class VerifyReport:
    checkpoints: list[str] = field(default_factory=list)
    chunks_checked: int = 0
    chunks_missing: list[str] = field(default_factory=list)
    chunks_corrupt: list[str] = field(default_factory=list)
    manifests_bad: list[str] = field(default_factory=list)
    # Objects under manifests/ that are not manifest keys (ignored by every reader).
    strays: list[str] = field(default_factory=list)
    read_data: bool = False

    @property
    def ok(self) -> bool:
        return not (self.chunks_missing or self.chunks_corrupt or self.manifests_bad or self.strays)

    @property
    def problems(self) -> list[str]:
        return (
            [f"manifest {m}" for m in self.manifests_bad]
            + [
                f"stray object {k!r} under {MANIFEST_PREFIX} (not a manifest; ignored)"
                for k in self.strays
            ]
            + [f"missing chunk {c}" for c in self.chunks_missing]
            + [f"corrupt chunk {c}" for c in self.chunks_corrupt]
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        out["problems"] = self.problems
        return out


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
    ) -> PushResult:
        """Upload the tree ``src`` as a new checkpoint; the manifest is committed last.

        ``streams`` adds virtual files whose bytes come from a stream (``storage.streams``),
        uploaded in the same run; ``uploaded_streams`` adds streams ``upload_streams``
        already put in the store. Both become ordinary file entries, named in
        ``extra["streams"]`` with their kind; a path may not also be a file under ``src``.
        """
        started = time.monotonic()
        check_workload(workload)
        if parent is not None:
            check_checkpoint_id(parent)
        checkpoint_id = check_checkpoint_id(checkpoint_id) if checkpoint_id else new_checkpoint_id()
        self._check_can_sign()
        files = _walk(src)
        stream_inputs, kinds = self._stream_inputs(streams, {f.path for f in files})
        if uploaded_streams is not None:
            taken = {f.path for f in files} | set(kinds)
            for entry in uploaded_streams.entries:
                if entry.path in taken:
                    raise InvalidArgument(f"stream {entry.path!r} collides with another entry")
            kinds.update(uploaded_streams.kinds)
        if kinds and extra is not None and STREAMS_EXTRA_KEY in extra:
            raise InvalidArgument(f"extra[{STREAMS_EXTRA_KEY!r}] is reserved for streams")
        created_at = time.time()
        lock = LockHolder(
            self.backend,
            f"{LOCK_PREFIX}push-{checkpoint_id}",
            {"host": socket.gethostname(), "pid": os.getpid(), "started_at": created_at},
            self.lock_refresh_seconds,
        )
        lock.start()
        try:
            self._sync_index_if_gc_ran()
            if stream_inputs:
                entries, stats = self._upload_inputs(
                    [file_input(f, self._chunker) for f in files] + stream_inputs,
                    compress,
                    progress,
                )
            else:
                entries, stats = self._upload(files, compress, progress)
            if uploaded_streams is not None:
                entries = entries + uploaded_streams.entries
                stats.bytes_total += uploaded_streams.bytes_total
                stats.chunks_total += uploaded_streams.chunks_total
                stats.bytes_uploaded += uploaded_streams.bytes_uploaded
                stats.chunks_uploaded += uploaded_streams.chunks_uploaded
            # A gc that may have swept while this push ran could have removed chunks the index
            # said were there: wait for it, re-list, and upload whatever is missing.
            if self._sync_index_if_gc_ran(wait_for_running=True):
                missing = {c.id for e in entries for c in e.chunks if not self.index.contains(c.id)}
                lost = sorted(
                    e.path
                    for e in entries
                    if e.path in kinds and missing & {c.id for c in e.chunks}
                )
                if lost:
                    # A stream cannot be read twice (GPU memory is gone once copied).
                    raise Unavailable(
                        f"a gc removed chunks of stream {lost[0]} while it was pushed; "
                        f"checkpoint {checkpoint_id} not committed"
                    )
                if missing:
                    streamed = [e for e in entries if e.path in kinds]
                    log.info(
                        "a gc removed %d chunks push %s needs; uploading them again",
                        len(missing),
                        checkpoint_id,
                    )
                    entries, again = self._upload(files, compress, None)
                    entries = entries + streamed
                    stats.bytes_uploaded += again.bytes_uploaded
                    stats.chunks_uploaded += again.chunks_uploaded
            # Write order: every chunk durable, then the manifest that names them.
            self._make_durable()
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
            )
            blob = seal(
                ENVELOPE_FORMAT,
                manifest.to_json(),
                signer=self._signer,
                encryption=self._encryption,
            )
            try:
                self.backend.put(manifest_key(workload, checkpoint_id), blob, if_absent=True)
            except AlreadyExists as exc:
                raise AlreadyExists(f"checkpoint {checkpoint_id} already exists") from exc
        finally:
            lock.stop()
            try:
                self.backend.delete(lock.key)
            except GpusnapError as exc:
                log.warning("could not remove lock %s: %s", lock.key, exc)
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
        )

    def _check_can_sign(self) -> None:
        if self._signer is None and self.verify_manifests:
            raise FailedPrecondition("pushing needs a signing key file (or verification off)")
        if self._signer is not None and self._signer.private_key is None:
            raise FailedPrecondition("signing needs the private key; this key file is public only")

    def _stream_inputs(
        self, streams: Mapping[str, StreamSource] | None, taken: Collection[str]
    ) -> tuple[builtins.list[PushInput], dict[str, str]]:
        inputs: builtins.list[PushInput] = []
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
                return cut_stream(self._chunker, source, path)

            inputs.append(PushInput(path, source.size, source.mode & 0o777, chunks))
        return inputs, kinds

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
        started = time.monotonic()
        self._check_can_sign()
        inputs, kinds = self._stream_inputs(streams, ())
        self._sync_index_if_gc_ran()
        entries, stats = self._upload_inputs(inputs, compress, progress)
        return UploadedStreams(
            entries=entries,
            kinds=kinds,
            bytes_total=stats.bytes_total,
            bytes_uploaded=stats.bytes_uploaded,
            chunks_total=stats.chunks_total,
            chunks_uploaded=stats.chunks_uploaded,
            seconds=time.monotonic() - started,
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
        self, files: builtins.list[SourceFile], compress: bool | None, progress: ProgressFn | None
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

    def _make_durable(self) -> None:
        """Make every pending chunk durable (one backend sync), and say so in the index.

        The pending entries are read before the sync starts, so each was added after its
        put returned: the sync covers it. They are this push's chunks and any left pending
        by earlier pushes of this boot (killed ones included) that this push may reference.
        """
        pending = self.index.pending()
        started = time.monotonic()
        sync_deferred(self.backend, [chunk_key(chunk_id) for chunk_id, _mark in pending])
        self.index.mark_synced(pending)
        log.debug(
            "synced the store for %d pending chunks in %.3fs",
            len(pending),
            time.monotonic() - started,
        )

    # --- reading manifests --------------------------------------------------------------

    def _find_manifest_key(self, checkpoint_id: str) -> str:
        check_checkpoint_id(checkpoint_id)
        for info in self.backend.list(MANIFEST_PREFIX):
            parts = split_manifest_key(info.key)
            if parts is not None and parts[1] == checkpoint_id:
                return info.key
        raise NotFound(f"checkpoint {checkpoint_id} not found")

    def _read_manifest(self, key: str, *, verify: bool | None = None) -> Manifest:
        parts = split_manifest_key(key)
        if parts is None:
            raise Corrupt(f"store object {key} is not a manifest key")
        workload, checkpoint_id = parts
        blob = self.backend.get(key)
        payload = unseal(
            blob,
            ENVELOPE_FORMAT,
            signer=self._signer,
            encryption=self._encryption,
            verify=self.verify_manifests if verify is None else verify,
            what=f"manifest {checkpoint_id}",
        )
        manifest = Manifest.from_json(payload)
        if manifest.checkpoint_id != checkpoint_id or manifest.workload != workload:
            raise Corrupt(f"manifest {key} describes {manifest.workload}/{manifest.checkpoint_id}")
        return manifest

    def manifest(self, checkpoint_id: str) -> Manifest:
        """The checkpoint's manifest, fetched and authenticated (``NotFound`` / ``Corrupt``)."""
        return self._read_manifest(self._find_manifest_key(checkpoint_id))

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
        prefix = (
            MANIFEST_PREFIX if workload is None else f"{MANIFEST_PREFIX}{check_workload(workload)}/"
        )
        out: builtins.list[ManifestSummary] = []
        skipped: builtins.list[tuple[str, GpusnapError]] = []
        for info in self.backend.list(prefix):
            if split_manifest_key(info.key) is None:
                log.warning("skipping %r: not a manifest key", info.key)
                continue
            try:
                out.append(ManifestSummary.of(self._read_manifest(info.key)))
            except (Corrupt, NotFound, FailedPrecondition) as exc:
                if not isinstance(exc, NotFound):  # deleted while we listed: not a problem
                    skipped.append((info.key, exc))
                log.warning("skipping %s: %s", info.key, exc)
        out.sort(key=lambda s: (s.created_at, s.checkpoint_id), reverse=True)
        return out, skipped

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
        stats = pull_files(
            manifest,
            dest,
            backend=self.backend,
            codec=self._codec,
            executor=self._io_executor,
            budget_bytes=self._budget,
            progress=progress,
            direct=direct,
            durable=durable,
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
        report = VerifyReport(read_data=read_data)
        if ids is None:
            keys = []
            for info in self.backend.list(MANIFEST_PREFIX):
                if split_manifest_key(info.key) is None:
                    report.strays.append(info.key)
                else:
                    keys.append(info.key)
        else:
            keys = [self._find_manifest_key(i) for i in ids]
        referenced: dict[str, str] = {}  # chunk id -> a checkpoint that uses it
        sizes: dict[str, int] = {}  # chunk id -> its size, as the manifests declare it
        for key in keys:
            checkpoint_id = key.rpartition("/")[2]
            try:
                manifest = self._read_manifest(key)
            except (Corrupt, NotFound) as exc:
                report.manifests_bad.append(f"{checkpoint_id}: {exc}")
                continue
            report.checkpoints.append(checkpoint_id)
            for entry in manifest.files:
                for ref in entry.chunks:
                    referenced.setdefault(ref.id, checkpoint_id)
                    if sizes.setdefault(ref.id, ref.size) != ref.size:
                        report.chunks_corrupt.append(
                            f"{ref.id}: declared with {sizes[ref.id]} bytes by checkpoint "
                            f"{referenced[ref.id]} and {ref.size} by {checkpoint_id}"
                        )
        present = {
            cid for info in self.backend.list(CHUNK_PREFIX) if (cid := chunk_id_of_key(info.key))
        }
        for chunk_id, checkpoint_id in sorted(referenced.items()):
            if chunk_id not in present:
                report.chunks_missing.append(f"{chunk_id} (checkpoint {checkpoint_id})")
        report.chunks_checked = len(referenced)
        if read_data:
            to_read = [c for c in referenced if c in present]

            def check(chunk_id: str) -> str | None:
                try:
                    obj = self.backend.get(chunk_key(chunk_id))
                    self._codec.decode(chunk_id, obj, sizes[chunk_id])
                except (Corrupt, NotFound) as exc:
                    return f"{chunk_id} (checkpoint {referenced[chunk_id]}): {exc}"
                return None

            for problem in self._executor.map(check, to_read):
                if problem is not None:
                    report.chunks_corrupt.append(problem)
        return report

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


__all__ = [
    "CheckpointStore",
    "GcReport",
    "PullResult",
    "PushResult",
    "VerifyReport",
    "open_store",
]
