"""Pushes beside pushes, and gc beside pushes: no checkpoint ever loses a chunk."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gpusnap.storage import CheckpointStore, PushResult
from gpusnap.storage.layout import (
    CHUNK_PREFIX,
    LOCK_PREFIX,
    MANIFEST_PREFIX,
    chunk_key,
    push_lock_key,
)
from gpusnap.storage.locks import GC_RECORD_FORMAT
from tests.storage.store_helpers import Keys, MiB, file_store, random_bytes, write_src


def in_thread(
    fn: Callable[[], PushResult],
) -> tuple[threading.Thread, list[PushResult | BaseException]]:
    out: list[PushResult | BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def delete_manifests(store: CheckpointStore) -> None:
    for info in list(store.backend.list(MANIFEST_PREFIX)):
        store.backend.delete(info.key)


def test_two_concurrent_pushes_of_overlapping_trees_both_commit(tmp_path: Path, keys: Keys) -> None:
    shared = random_bytes(12 * MiB, seed=1)
    src_a = write_src(tmp_path / "a", {"shared.img": shared, "own.img": random_bytes(4 * MiB, 2)})
    src_b = write_src(tmp_path / "b", {"shared.img": shared, "own.img": random_bytes(4 * MiB, 3)})
    store_a = file_store(tmp_path, keys, cache="cache-a")
    store_b = file_store(tmp_path, keys, cache="cache-b")
    try:
        ta, out_a = in_thread(lambda: store_a.push(src_a, workload="a"))
        tb, out_b = in_thread(lambda: store_b.push(src_b, workload="b"))
        ta.join()
        tb.join()
        result_a, result_b = out_a[0], out_b[0]
        assert isinstance(result_a, PushResult), result_a
        assert isinstance(result_b, PushResult), result_b
        report = store_a.verify(read_data=True)
        assert report.ok, report.problems
        assert len(report.checkpoints) == 2
        for result, src in ((result_a, src_a), (result_b, src_b)):
            dest = tmp_path / f"dest-{result.checkpoint_id}"
            store_b.pull(result.checkpoint_id, dest)
            for name in ("shared.img", "own.img"):
                assert (dest / name).read_bytes() == (src / name).read_bytes()
        assert not list(store_a.backend.list(LOCK_PREFIX + "push-"))
    finally:
        store_a.close()
        store_b.close()


def test_gc_during_a_push_deletes_nothing_that_push_references(tmp_path: Path, keys: Keys) -> None:
    old = random_bytes(8 * MiB, seed=10)
    pusher = file_store(tmp_path, keys, cache="cache-p")
    collector = file_store(tmp_path, keys, cache="cache-g")
    try:
        # The pusher's index knows these chunks; then their only manifest goes away, so to a
        # gc they are unreferenced and (with grace 0) deletable.
        pusher.push(write_src(tmp_path / "v1", {"old.img": old}), workload="w")
        delete_manifests(pusher)
        src = write_src(tmp_path / "v2", {"old.img": old, "new.img": random_bytes(6 * MiB, 11)})

        paused = threading.Event()
        resume = threading.Event()

        def progress(done: int, total: int) -> None:
            if done > 0 and not resume.is_set():
                paused.set()
                assert resume.wait(60)

        thread, out = in_thread(lambda: pusher.push(src, workload="w", progress=progress))
        assert paused.wait(60)
        assert list(collector.backend.list(LOCK_PREFIX + "push-"))  # the push is announced
        report = collector.gc(grace_seconds=0)
        resume.set()
        thread.join()

        assert report.blocked_by and report.chunks_deleted == 0
        result = out[0]
        assert isinstance(result, PushResult), result
        assert result.chunks_total > result.chunks_uploaded  # old.img was dedup-skipped
        verify = collector.verify([result.checkpoint_id], read_data=True)
        assert verify.ok, verify.problems
        pusher.pull(result.checkpoint_id, tmp_path / "dest")
        assert (tmp_path / "dest" / "old.img").read_bytes() == old
        # With the push done, the same gc now proceeds (and still keeps referenced chunks).
        after = collector.gc(grace_seconds=0)
        assert not after.blocked_by
        assert collector.verify().ok
    finally:
        pusher.close()
        collector.close()


def test_push_after_a_foreign_gc_reuploads_chunks_its_index_still_lists(
    tmp_path: Path, keys: Keys
) -> None:
    data = random_bytes(8 * MiB, seed=20)
    pusher = file_store(tmp_path, keys, cache="cache-p")
    collector = file_store(tmp_path, keys, cache="cache-g")
    try:
        first = pusher.push(write_src(tmp_path / "v1", {"d.img": data}), workload="w")
        delete_manifests(pusher)
        swept = collector.gc(grace_seconds=0)
        assert swept.chunks_deleted == first.chunks_total
        second = pusher.push(tmp_path / "v1", workload="w")
        assert second.chunks_uploaded == first.chunks_uploaded  # not trusted to the stale index
        assert pusher.verify(read_data=True).ok
    finally:
        pusher.close()
        collector.close()


def test_push_rechecks_its_chunks_when_a_sweeping_gc_overlapped_it(
    tmp_path: Path, keys: Keys
) -> None:
    """A gc that passed its lock check just before the push began can still be deleting."""
    old = random_bytes(8 * MiB, seed=30)
    store = file_store(tmp_path, keys)
    try:
        store.push(write_src(tmp_path / "v1", {"old.img": old}), workload="w")
        delete_manifests(store)
        src = write_src(tmp_path / "v2", {"old.img": old, "new.img": random_bytes(3 * MiB, 31)})
        done = threading.Event()

        def progress(bytes_done: int, total: int) -> None:
            if bytes_done > 0 and not done.is_set():
                done.set()
                # What such a gc leaves behind: the chunks gone, and its record.
                for info in list(store.backend.list(CHUNK_PREFIX)):
                    store.backend.delete(info.key)
                now = time.time()
                record = {"started_at": now - 1, "finished_at": now, "swept": True}
                record["refreshed_at"] = now
                sealed = store.context.keys.seal(GC_RECORD_FORMAT, json.dumps(record).encode())
                store.backend.put(f"{LOCK_PREFIX}gc-manual", sealed)

        result = store.push(src, workload="w", progress=progress)
        assert done.is_set()
        manifest = store.manifest(result.checkpoint_id)
        for entry in manifest.files:
            for chunk in entry.chunks:
                assert store.backend.stat(chunk_key(chunk.id)) is not None
        assert store.verify(read_data=True).ok
    finally:
        store.close()


def _unreferenced_chunks_and_a_push_lock(store: CheckpointStore, tmp_path: Path, seed: int) -> str:
    """Chunks no manifest names (a gc may delete them) and a push lock; the lock's key."""
    store.push(write_src(tmp_path / "v1", {"x.img": random_bytes(2 * MiB, seed)}), workload="w")
    delete_manifests(store)
    key = push_lock_key(f"20000101T000000Z-00000000{seed:02d}")
    store.backend.put(key, b"{}")
    return key


def test_gc_ignores_and_removes_a_stale_push_lock(tmp_path: Path, keys: Keys) -> None:
    with file_store(tmp_path, keys) as store:
        key = _unreferenced_chunks_and_a_push_lock(store, tmp_path, 40)
        old = time.time() - 2 * store.context.options.lock_stale_seconds
        os.utime(tmp_path / "store" / key, (old, old))
        report = store.gc(grace_seconds=0)
        assert report.stale_locks_removed == [key]
        assert not report.blocked_by
        assert report.chunks_deleted > 0
        assert store.backend.stat(key) is None


def test_gc_with_a_fresh_push_lock_deletes_no_chunk(tmp_path: Path, keys: Keys) -> None:
    with file_store(tmp_path, keys) as store:
        key = _unreferenced_chunks_and_a_push_lock(store, tmp_path, 50)
        before = sorted(i.key for i in store.backend.list(CHUNK_PREFIX))
        report = store.gc(grace_seconds=0)
        assert report.blocked_by == [key] and report.chunks_deleted == 0
        assert sorted(i.key for i in store.backend.list(CHUNK_PREFIX)) == before
