"""The node's chunk cache on its own: budget, LRU order, prune, repair at open, refusals.

Real directories and a real SQLite index; the objects are opaque bytes here (what they mean
to a pull is ``test_cache_pull.py``).
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from blake3 import blake3

from gpusnap.errors import FailedPrecondition, NotFound
from gpusnap.storage.cache import ChunkCache, scope_of
from gpusnap.storage.cache.db import DB_NAME

SCOPE = scope_of("file:///somewhere")


def cid(n: int | str) -> str:
    return str(blake3(str(n).encode()).hexdigest())


def disk_bytes(directory: Path) -> int:
    """Bytes of every object and temp file under a cache directory."""
    return sum(
        p.stat().st_size
        for sub in ("objects", "tmp")
        for p in (directory / sub).rglob("*")
        if p.is_file()
    )


def test_a_full_cache_evicts_the_least_recently_used_first(tmp_path: Path) -> None:
    with ChunkCache(tmp_path / "c", max_bytes=3000) as cache:
        for name in "abc":
            assert cache.put(SCOPE, cid(name), name.encode() * 1000)
        assert cache.get(SCOPE, cid("a")) == b"a" * 1000  # a is now the most recent
        assert cache.put(SCOPE, cid("d"), b"d" * 1000)
        assert set(cache.present(SCOPE, [cid(n) for n in "abcd"])) == {cid("a"), cid("c"), cid("d")}
        assert cache.get(SCOPE, cid("b")) is None
        assert not cache.files.object_path(SCOPE, cid("b")).exists()
        cache.touch(SCOPE, [cid("c")])
        assert cache.put(SCOPE, cid("e"), b"e" * 2000)  # two must go: a, then d (c was touched)
        assert set(cache.present(SCOPE, [cid(n) for n in "acde"])) == {cid("c"), cid("e")}
        stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.evicted) == (2, 3000, 3)
    assert stats.hits == 1 and stats.misses == 1


def test_the_bytes_on_disk_never_exceed_the_budget(tmp_path: Path) -> None:
    budget = 50_000
    rng = __import__("random").Random(7)
    with ChunkCache(tmp_path / "c", max_bytes=budget) as cache:
        for n in range(200):
            cache.put(SCOPE, cid(n), os.urandom(rng.randrange(1, 12_000)))
            on_disk = disk_bytes(tmp_path / "c")
            assert on_disk <= budget
            assert cache.stats().bytes == on_disk
        assert cache.stats().evicted > 0


def test_an_object_larger_than_the_budget_is_not_kept(tmp_path: Path) -> None:
    with ChunkCache(tmp_path / "c", max_bytes=1000) as cache:
        assert cache.put(SCOPE, cid(1), b"x" * 900)
        assert not cache.put(SCOPE, cid(2), b"y" * 1001)
        assert cache.get(SCOPE, cid(1)) == b"x" * 900  # nothing was evicted for it
        assert cache.stats().bytes == 900


def test_putting_an_object_already_held_adds_nothing(tmp_path: Path) -> None:
    with ChunkCache(tmp_path / "c", max_bytes=10_000) as cache:
        assert cache.put(SCOPE, cid(1), b"x" * 100)
        assert not cache.put(SCOPE, cid(1), b"x" * 100)
        assert cache.stats().bytes == 100


def test_scopes_keep_the_same_id_apart(tmp_path: Path) -> None:
    other = scope_of("s3://bucket/prefix")
    with ChunkCache(tmp_path / "c", max_bytes=10_000) as cache:
        cache.put(SCOPE, cid(1), b"one store")
        assert cache.get(other, cid(1)) is None
        cache.put(other, cid(1), b"another store")
        assert cache.get(SCOPE, cid(1)) == b"one store"
        assert cache.get(other, cid(1)) == b"another store"
    assert scope_of("file:///s", "key one") != scope_of("file:///s", "key two")


def test_prune_evicts_to_a_target_and_all_of_it(tmp_path: Path) -> None:
    with ChunkCache(tmp_path / "c", max_bytes=100_000) as cache:
        for n in range(10):
            cache.put(SCOPE, cid(n), bytes([n]) * 1000)
        cache.get(SCOPE, cid(0))
        result = cache.prune(4500)
        assert (result.entries_evicted, result.bytes_freed, result.bytes_left) == (6, 6000, 4000)
        # 1..6 went (least recently used); 0 was read last, 7..9 written last.
        assert set(cache.present(SCOPE, [cid(n) for n in range(10)])) == {
            cid(n) for n in (0, 7, 8, 9)
        }
        assert cache.prune(0).bytes_left == 0
        assert disk_bytes(tmp_path / "c") == 0


def test_a_budget_given_at_open_is_kept_and_shrinks_the_cache(tmp_path: Path) -> None:
    with ChunkCache(tmp_path / "c", max_bytes=10_000) as cache:
        for n in range(8):
            cache.put(SCOPE, cid(n), b"z" * 1000)
    with ChunkCache(tmp_path / "c", max_bytes=3000) as cache:
        assert cache.stats().bytes == 3000
    with ChunkCache(tmp_path / "c") as cache:  # no budget given: the recorded one
        assert cache.max_bytes == 3000
    assert disk_bytes(tmp_path / "c") == 3000


def test_a_lost_index_is_rebuilt_from_the_files(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    with ChunkCache(directory, max_bytes=100_000) as cache:
        for n in range(5):
            cache.put(SCOPE, cid(n), bytes([n]) * 1000)
    (directory / DB_NAME).unlink()
    with ChunkCache(directory) as cache:
        stats = cache.stats()
        assert (stats.entries, stats.bytes) == (5, 5000)
        assert cache.get(SCOPE, cid(3)) == bytes([3]) * 1000


def test_an_unreadable_index_is_moved_aside_and_rebuilt(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    with ChunkCache(directory, max_bytes=100_000) as cache:
        cache.put(SCOPE, cid(1), b"kept" * 100)
    (directory / DB_NAME).write_bytes(b"this is not a database" * 100)
    with ChunkCache(directory, max_bytes=100_000) as cache:
        assert cache.get(SCOPE, cid(1)) == b"kept" * 100
        assert cache.stats().bytes == 400
    assert list(directory.glob(f"{DB_NAME}.unreadable-*"))


def test_after_a_reboot_the_index_is_made_to_agree_with_the_files(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    with ChunkCache(directory, max_bytes=100_000) as cache:
        for n in range(4):
            cache.put(SCOPE, cid(n), bytes([n]) * 1000)
        path = cache.files.object_path
        orphan = path(SCOPE, cid("orphan"))
    # What a power cut can leave: a row whose file is gone, a file whose row is gone, and
    # (whatever put it there) names under objects/ that are no object.
    path(SCOPE, cid(0)).unlink()
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"o" * 500)
    stray = directory / "objects" / SCOPE / "zz-not-an-object"
    stray.write_bytes(b"?")
    link = path(SCOPE, cid("link"))
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to("/etc/passwd")
    db = sqlite3.connect(directory / DB_NAME)
    with db:
        db.execute("UPDATE meta SET v = 'another-boot' WHERE k = 'boot_id'")
    db.close()
    with ChunkCache(directory) as cache:
        held = cache.present(SCOPE, [cid(n) for n in (0, 1, 2, 3, "orphan")])
        assert held == {cid(1): 1000, cid(2): 1000, cid(3): 1000, cid("orphan"): 500}
        assert cache.stats().bytes == 3500 == disk_bytes(directory)
    assert not stray.exists() and not link.is_symlink()


def test_a_cache_directory_others_may_write_to_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    ChunkCache(directory, max_bytes=1000).close()
    directory.chmod(0o777)
    with pytest.raises(FailedPrecondition, match="writable by no one else"):
        ChunkCache(directory)


def test_a_missing_cache_is_not_found_unless_it_may_be_made(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        ChunkCache(tmp_path / "none", create=False)
    assert not (tmp_path / "none").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFound):
        ChunkCache(tmp_path / "empty", create=False)


def test_an_object_file_larger_than_any_chunk_is_dropped_unread(tmp_path: Path) -> None:
    with ChunkCache(tmp_path / "c", max_bytes=100_000) as cache:
        cache.put(SCOPE, cid(1), b"small")
        with cache.files.object_path(SCOPE, cid(1)).open("r+b") as fh:
            fh.truncate(64 * 1024 * 1024)  # a hole: no disk used
        assert cache.get(SCOPE, cid(1)) is None
        assert not cache.files.object_path(SCOPE, cid(1)).exists()
        assert cache.stats().dropped == 1
