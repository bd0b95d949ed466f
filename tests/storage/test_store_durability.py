"""Deferred durability: chunks are written without fsync and synced once, before the manifest.

The invariant kept: a manifest names only chunks that were durable before it was written. A
crash before the sync leaves unreferenced chunks; the local index does not claim them after a
reboot (it would otherwise dedup against objects a power cut may have lost).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

import pytest

from gpusnap.errors import Internal
from gpusnap.storage import CheckpointStore
from gpusnap.storage.context import open_context
from gpusnap.storage.file_backend import FileBackend
from gpusnap.storage.index import ChunkIndex
from gpusnap.storage.keys import StoreKeys, load_signing_key
from gpusnap.storage.layout import CHUNK_PREFIX, chunk_id_of_key
from gpusnap.storage.passthrough import PassThroughBackend
from tests.storage.store_helpers import Keys, MiB, make_tree, random_bytes


class RecordingBackend(PassThroughBackend):
    """A ``file://`` backend that records the order of writes and syncs.

    With ``fail_sync`` a sync after the first chunk put fails, as if the machine went down.
    """

    def __init__(self, root: Path, *, fail_sync: bool = False) -> None:
        self.files = FileBackend(str(root))
        super().__init__(self.files)
        self.calls: list[tuple[str, str]] = []
        self.synced: list[list[str] | None] = []  # the keys of each sync (None: all)
        self.fail_sync = fail_sync
        self._lock = threading.Lock()

    def _record(self, op: str, key: str) -> None:
        with self._lock:
            self.calls.append((op, key))

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        super().put(key, data, if_absent=if_absent)
        self._record("put", key)

    def put_unsynced(self, key: str, data: bytes) -> None:
        self.files.put_unsynced(key, data)
        self._record("put_unsynced", key)

    def sync(self, keys: Iterable[str] | None = None) -> None:
        if self.fail_sync and any(op == "put_unsynced" for op, _key in self.calls):
            raise Internal("the machine went down here")
        listed = None if keys is None else list(keys)
        self.files.sync(listed)
        self.synced.append(listed)
        self._record("sync", "")


def _store(tmp_path: Path, keys: Keys, backend: RecordingBackend) -> CheckpointStore:
    signing = StoreKeys(load_signing_key(keys.signing), None)
    return CheckpointStore(open_context(backend, signing, cache_dir=tmp_path / "cache", workers=2))


def _push_killed_before_its_sync(
    tmp_path: Path, keys: Keys, *, seed: int
) -> tuple[RecordingBackend, Path]:
    """A push whose backend fails its sync (as if killed there): the backend and the source."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "pages.img").write_bytes(random_bytes(6 * MiB, seed))
    crashing = RecordingBackend(tmp_path / "store", fail_sync=True)
    with _store(tmp_path, keys, crashing) as store, pytest.raises(Internal):
        store.push(src, workload="w")
    return crashing, src


def test_every_chunk_put_is_synced_before_the_manifest_is_written(
    tmp_path: Path, keys: Keys
) -> None:
    backend = RecordingBackend(tmp_path / "store")
    src = make_tree(tmp_path / "src")
    with _store(tmp_path, keys, backend) as store:
        store.push(src, workload="w")
        calls = backend.calls
        chunk_puts = [i for i, (op, key) in enumerate(calls) if key.startswith(CHUNK_PREFIX)]
        manifest = [i for i, (op, key) in enumerate(calls) if key.startswith("manifests/")]
        syncs = [i for i, (op, _key) in enumerate(calls) if op == "sync"]
        assert chunk_puts and len(manifest) == 1
        # Chunks go in without fsync; the manifest is a durable put.
        assert {calls[i][0] for i in chunk_puts} == {"put_unsynced"}
        assert calls[manifest[0]][0] == "put"
        # A sync of every chunk put lies between the last chunk put and the manifest.
        between = [n for n, s in enumerate(syncs) if max(chunk_puts) < s < manifest[0]]
        assert len(between) == 1
        synced = backend.synced[between[0]]
        assert synced is not None
        assert {calls[i][1] for i in chunk_puts} <= set(synced)
        assert store.index.pending() == []


def test_a_push_that_dies_before_the_sync_commits_nothing_and_its_chunks_are_not_trusted_after_a_reboot(  # noqa: E501
    tmp_path: Path, keys: Keys
) -> None:
    crashing, _src = _push_killed_before_its_sync(tmp_path, keys, seed=1)
    written = {
        cid
        for op, key in crashing.calls
        if op == "put_unsynced" and (cid := chunk_id_of_key(key)) is not None
    }
    assert written
    assert not any(key.startswith("manifests/") for _op, key in crashing.calls)

    index_path = tmp_path / "cache" / "index.sqlite"
    same_boot = ChunkIndex(index_path, crashing.url)
    try:
        # Same boot (the process was killed): the objects are in the page cache.
        assert {cid for cid, _mark in same_boot.pending()} == written
        assert all(same_boot.contains(cid) for cid in written)
    finally:
        same_boot.close()

    after_reboot = ChunkIndex(index_path, crashing.url, boot_id="another-boot")
    try:
        # A power cut may have lost or torn those objects: the index forgets them.
        assert after_reboot.pending() == []
        assert not any(after_reboot.contains(cid) for cid in written)
    finally:
        after_reboot.close()


def test_a_push_after_a_killed_one_reuses_its_chunks_and_syncs_them(
    tmp_path: Path, keys: Keys
) -> None:
    crashing, src = _push_killed_before_its_sync(tmp_path, keys, seed=2)

    backend = RecordingBackend(tmp_path / "store")
    with _store(tmp_path, keys, backend) as store:
        result = store.push(src, workload="w")
        # Nothing uploaded again: the same boot trusts the pending entries, and this push's
        # sync (before its manifest) makes them durable.
        assert result.chunks_uploaded == 0
        ops = [op for op, key in backend.calls if not key.startswith("locks/")]
        assert ops.index("sync") < ops.index("put")
        # That sync named the killed push's chunks.
        written = {key for op, key in crashing.calls if op == "put_unsynced"}
        assert any(keys is not None and written <= set(keys) for keys in backend.synced)
        assert store.index.pending() == []


def test_an_index_rebuilt_from_a_listing_syncs_first_so_it_holds_no_pending_chunk(
    tmp_path: Path, keys: Keys
) -> None:
    backend = RecordingBackend(tmp_path / "store")
    backend.files.put_unsynced(f"{CHUNK_PREFIX}ab/{'ab' * 32}", b"x")
    with _store(tmp_path, keys, backend) as store:
        assert store.rebuild_index() == 1
        assert backend.synced == [None]  # everything: the listing may hold unsynced chunks
        assert store.index.contains("ab" * 32)
        assert store.index.pending() == []


def test_file_put_unsynced_is_atomic_and_sync_skips_keys_gone_since(tmp_path: Path) -> None:
    backend = FileBackend(str(tmp_path / "store"))
    backend.put_unsynced("chunks/ab/one", b"first")
    backend.put_unsynced("chunks/ab/one", b"second")  # replaces, as a put does
    assert backend.get("chunks/ab/one") == b"second"
    backend.sync(["chunks/ab/one", "chunks/cd/deleted-by-gc"])
    backend.sync()
    assert [info.key for info in backend.list()] == ["chunks/ab/one"]
    assert not [p for p in (tmp_path / "store").rglob("*") if p.name.startswith(".gpusnap-tmp")]
