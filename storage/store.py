"""``CheckpointStore``: push, pull, list, verify and gc checkpoints in one store.

Key layout (see docs/design.md)::

    chunks/<id[:2]>/<id>            chunk objects (codec.py), written once, named by content
    manifests/<workload>/<ckpt id>  signed manifest envelopes, created with if_absent
    locks/push-<ckpt id>            a push in flight (refreshed while it runs)
    locks/gc-<gc id>                a gc run: started, then its finish time
    migrations/                     reserved for the migration protocol

Write order: chunks, then the manifest; readers go the other way. The gc protocol that keeps
a push's chunks alive is described in ``gc`` and in docs/design.md.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Collection, Generator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from gpusnap.storage.backend import Backend, BackendOptions, ObjectInfo, open_backend
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
    FileEntry,
    Manifest,
    ManifestSummary,
    check_checkpoint_id,
    check_workload,
    is_checkpoint_id,
    new_checkpoint_id,
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
    pull_files,
    push_files,
    push_inputs,
    read_entry,
)
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

MANIFEST_PREFIX = "manifests/"
LOCK_PREFIX = "locks/"
MIGRATION_PREFIX = "migrations/"  # reserved: the migration protocol owns it
RECORD_FORMAT = "gpusnap.record/1"
# A lock not refreshed for this long belongs to a dead process.
LOCK_STALE_SECONDS = 900.0
LOCK_REFRESH_SECONDS = 120.0
# Allowance for clocks of different hosts (and the store) disagreeing.
CLOCK_MARGIN_SECONDS = 300.0
# gc records are kept this long; an index older than this is rebuilt before use.
GC_RECORD_KEEP_SECONDS = 7 * 86400.0


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
    read_data: bool = False

    @property
    def ok(self) -> bool:
        return not (self.chunks_missing or self.chunks_corrupt or self.manifests_bad)

    @property
    def problems(self) -> list[str]:
        return (
            [f"manifest {m}" for m in self.manifests_bad]
            + [f"missing chunk {c}" for c in self.chunks_missing]
            + [f"corrupt chunk {c}" for c in self.chunks_corrupt]
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        out["problems"] = self.problems
        return out


@dataclass
class GcReport:
    dry_run: bool = False
    manifests_deleted: list[str] = field(default_factory=list)
    chunks_deleted: int = 0
    bytes_freed: int = 0
    chunks_kept_in_grace: int = 0
    chunks_referenced: int = 0
    blocked_by: list[str] = field(default_factory=list)
    stale_locks_removed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _GcRecord:
    key: str
    started_at: float
    finished_at: float | None
    mtime: float
    swept: bool


class _LockHolder:
    """Writes a lock object and rewrites it every ``interval`` seconds until stopped."""

    def __init__(self, backend: Backend, key: str, body: dict[str, Any], interval: float) -> None:
        self._backend = backend
        self.key = key
        self.body = body
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, name=f"lock {key}", daemon=True)

    def start(self) -> None:
        self.write()
        self._thread.start()

    def write(self) -> None:
        self.body["refreshed_at"] = time.time()
        self._backend.put(self.key, json.dumps(self.body).encode())

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.write()
            except GpusnapError as exc:
                log.warning("could not refresh lock %s: %s", self.key, exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _manifest_key(workload: str, checkpoint_id: str) -> str:
    return f"{MANIFEST_PREFIX}{workload}/{checkpoint_id}"


def _split_manifest_key(key: str) -> tuple[str, str] | None:
    rest = key.removeprefix(MANIFEST_PREFIX)
    workload, _, checkpoint_id = rest.partition("/")
    if key == rest or not workload or not is_checkpoint_id(checkpoint_id):
        return None
    return workload, checkpoint_id


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
        lock = _LockHolder(
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
                self.backend.put(_manifest_key(workload, checkpoint_id), blob, if_absent=True)
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
        return self.index.replace_all(entries, listed_at)

    def _gc_records(self) -> builtins.list[_GcRecord]:
        records = []
        for info in self.backend.list(f"{LOCK_PREFIX}gc-"):
            try:
                body = json.loads(self.backend.get(info.key))
                started = float(body["started_at"])
                finished = body.get("finished_at")
                records.append(
                    _GcRecord(
                        info.key,
                        started,
                        None if finished is None else float(finished),
                        info.mtime,
                        bool(body.get("swept", True)),
                    )
                )
            except NotFound:
                continue
            except (ValueError, KeyError, TypeError):
                # An unreadable record: assume the worst (a gc that is running now).
                records.append(_GcRecord(info.key, time.time(), None, time.time(), True))
        return records

    def _sync_index_if_gc_ran(self, *, wait_for_running: bool = False) -> bool:
        """Rebuild the index when a gc may have deleted chunks since it was last listed.

        A gc record is dangerous to an index listed at ``T`` if that gc had not finished
        before ``T`` (less a clock margin). With ``wait_for_running``, gc runs still in
        progress are waited for first, so the LIST sees everything they deleted.
        """
        synced = self.index.synced_at
        now = time.time()
        if synced is None or synced < now - GC_RECORD_KEEP_SECONDS + CLOCK_MARGIN_SECONDS:
            self.rebuild_index()
            return True
        deadline = time.monotonic() + self.lock_stale_seconds
        while True:
            records = self._gc_records()
            risky = [
                r
                for r in records
                if r.finished_at is None
                or (r.swept and r.finished_at >= synced - CLOCK_MARGIN_SECONDS)
            ]
            if not risky:
                return False
            running = [
                r
                for r in risky
                if r.finished_at is None and r.mtime >= time.time() - self.lock_stale_seconds
            ]
            if not (wait_for_running and running):
                break
            if time.monotonic() > deadline:
                raise Unavailable(f"gc {running[0].key} is still running; push not committed")
            time.sleep(0.2)
        self.rebuild_index()
        return True

    # --- reading manifests --------------------------------------------------------------

    def _find_manifest_key(self, checkpoint_id: str) -> str:
        check_checkpoint_id(checkpoint_id)
        for info in self.backend.list(MANIFEST_PREFIX):
            parts = _split_manifest_key(info.key)
            if parts is not None and parts[1] == checkpoint_id:
                return info.key
        raise NotFound(f"checkpoint {checkpoint_id} not found")

    def _read_manifest(self, key: str, *, verify: bool | None = None) -> Manifest:
        parts = _split_manifest_key(key)
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
        prefix = (
            MANIFEST_PREFIX if workload is None else f"{MANIFEST_PREFIX}{check_workload(workload)}/"
        )
        out: builtins.list[ManifestSummary] = []
        for info in self.backend.list(prefix):
            if _split_manifest_key(info.key) is None:
                continue
            try:
                out.append(ManifestSummary.of(self._read_manifest(info.key)))
            except (Corrupt, NotFound, FailedPrecondition) as exc:
                log.warning("skipping %s: %s", info.key, exc)
        out.sort(key=lambda s: (s.created_at, s.checkpoint_id), reverse=True)
        return out

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
    ) -> PullResult:
        """Restore a checkpoint's files under ``dest`` (all or nothing).

        Entries pushed as streams of a kind in ``exclude_kinds`` are left out (read them
        with ``open_stream``); by default every entry is written as a file.
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
            keys = [i.key for i in self.backend.list(MANIFEST_PREFIX) if _split_manifest_key(i.key)]
        else:
            keys = [self._find_manifest_key(i) for i in ids]
        referenced: dict[str, str] = {}  # chunk id -> a checkpoint that uses it
        for key in keys:
            checkpoint_id = key.rpartition("/")[2]
            try:
                manifest = self._read_manifest(key)
            except (Corrupt, NotFound) as exc:
                report.manifests_bad.append(f"{checkpoint_id}: {exc}")
                continue
            report.checkpoints.append(checkpoint_id)
            for chunk_id in manifest.chunk_ids():
                referenced.setdefault(chunk_id, checkpoint_id)
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
                    self._codec.decode(chunk_id, self.backend.get(chunk_key(chunk_id)))
                except (Corrupt, NotFound) as exc:
                    return f"{chunk_id} (checkpoint {referenced[chunk_id]}): {exc}"
                return None

            for problem in self._executor.map(check, to_read):
                if problem is not None:
                    report.chunks_corrupt.append(problem)
        return report

    # --- gc -----------------------------------------------------------------------------

    def gc(
        self, *, keep_last: int | None = None, grace_seconds: float = 3600.0, dry_run: bool = False
    ) -> GcReport:
        """Apply retention, then delete chunks no manifest references and older than grace.

        Order matters: (1) record this gc under ``locks/gc-<id>``; (2) look for push locks —
        a fresh one means no chunk is deleted in this run; (3) only then read the manifests;
        (4) delete unreferenced chunks older than the grace period; (5) record the finish.
        A push that starts after (2) sees this gc's record before committing and re-checks
        its chunks (``_sync_index_if_gc_ran``).
        """
        if keep_last is not None and keep_last < 1:
            raise InvalidArgument("keep_last must be at least 1")
        if grace_seconds < 0:
            raise InvalidArgument("grace must not be negative")
        report = GcReport(dry_run=dry_run)
        now = time.time()
        holder: _LockHolder | None = None
        if not dry_run:
            holder = _LockHolder(
                self.backend,
                f"{LOCK_PREFIX}gc-{new_checkpoint_id(now)}",
                {
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "started_at": now,
                    "finished_at": None,
                    "swept": False,
                },
                self.lock_refresh_seconds,
            )
            holder.start()
        try:
            self._gc_locks(report, dry_run)
            if keep_last is not None:
                self._gc_retention(report, keep_last, dry_run)
            if not report.blocked_by:
                if holder is not None:
                    # Pushes that overlap a sweeping gc re-check their chunks; say so first.
                    holder.body["swept"] = True
                    holder.write()
                self._gc_sweep(report, grace_seconds, dry_run)
        finally:
            if holder is not None:
                holder.stop()
                holder.body["finished_at"] = time.time()
                holder.write()
        if not dry_run:
            self._gc_old_records(holder.key if holder else None)
        return report

    def _gc_locks(self, report: GcReport, dry_run: bool) -> None:
        now = time.time()
        for info in self.backend.list(f"{LOCK_PREFIX}push-"):
            if info.mtime >= now - self.lock_stale_seconds:
                report.blocked_by.append(info.key)
            else:
                report.stale_locks_removed.append(info.key)
                if not dry_run:
                    self.backend.delete(info.key)
        if report.blocked_by:
            log.info("gc: pushes in flight (%s); no chunk is deleted", ", ".join(report.blocked_by))

    def _gc_retention(self, report: GcReport, keep_last: int, dry_run: bool) -> None:
        by_workload: dict[str, builtins.list[tuple[float, str, str]]] = {}
        for info in self.backend.list(MANIFEST_PREFIX):
            parts = _split_manifest_key(info.key)
            if parts is None:
                continue
            try:
                created = self._read_manifest(info.key).created_at
            except (Corrupt, NotFound, FailedPrecondition) as exc:
                report.problems.append(f"{info.key}: {exc} (kept)")
                continue
            by_workload.setdefault(parts[0], []).append((created, parts[1], info.key))
        for entries in by_workload.values():
            entries.sort(reverse=True)
            for _created, checkpoint_id, key in entries[keep_last:]:
                report.manifests_deleted.append(checkpoint_id)
                if not dry_run:
                    self.backend.delete(key)

    def _gc_sweep(self, report: GcReport, grace_seconds: float, dry_run: bool) -> None:
        referenced: set[str] = set()
        deleted_manifests = set(report.manifests_deleted) if not dry_run else set()
        pretend_deleted = set(report.manifests_deleted) if dry_run else set()
        for info in self.backend.list(MANIFEST_PREFIX):
            parts = _split_manifest_key(info.key)
            if parts is None or parts[1] in deleted_manifests or parts[1] in pretend_deleted:
                continue
            try:
                # Authenticity does not matter for marking: keeping more is always safe.
                manifest = self._read_manifest(info.key, verify=False)
            except (Corrupt, FailedPrecondition) as exc:
                report.problems.append(f"{info.key}: {exc}; no chunk deleted")
                return
            except NotFound:
                continue
            referenced |= manifest.chunk_ids()
        report.chunks_referenced = len(referenced)
        cutoff = time.time() - grace_seconds
        doomed: builtins.list[ObjectInfo] = []
        for info in self.backend.list(CHUNK_PREFIX):
            chunk_id = chunk_id_of_key(info.key)
            if chunk_id is None or chunk_id in referenced:
                continue
            if info.mtime > cutoff:
                report.chunks_kept_in_grace += 1
                continue
            doomed.append(info)
        for info in doomed:
            if not dry_run:
                self.backend.delete(info.key)
            report.chunks_deleted += 1
            report.bytes_freed += info.size
        if not dry_run:
            self.index.discard(cid for i in doomed if (cid := chunk_id_of_key(i.key)))

    def _gc_old_records(self, own_key: str | None) -> None:
        cutoff = time.time() - GC_RECORD_KEEP_SECONDS
        for record in self._gc_records():
            if record.key == own_key:
                continue
            end = record.finished_at if record.finished_at is not None else record.mtime
            if end < cutoff:
                self.backend.delete(record.key)

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
