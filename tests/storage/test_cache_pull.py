"""Pulls through the node's chunk cache: what comes from where, corruption, scopes, seeding.

Real stores (a directory, and S3 through the moto server over HTTP), real caches on disk.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusnap.errors import Corrupt
from gpusnap.storage import CheckpointStore, ChunkCache, open_store
from gpusnap.storage.backend import BackendOptions
from gpusnap.storage.layout import chunk_key
from tests.storage.store_helpers import (
    Keys,
    MiB,
    fast_options,
    make_tree,
    random_bytes,
    tree_contents,
)
from tests.support.moto_server import MotoServer


def opened(
    tmp_path: Path,
    keys: Keys,
    cache: ChunkCache | None,
    *,
    url: str | None = None,
    options: BackendOptions | None = None,
    index: str = "index",
    encrypted: bool = False,
) -> CheckpointStore:
    """A store handle as one node opens it: its own chunk index, the node's chunk cache."""
    return open_store(
        url or f"file://{tmp_path / 'store'}",
        key_file=keys.signing,
        encryption_key_file=keys.encryption if encrypted else None,
        cache_dir=tmp_path / index,
        workers=2,
        options=options,
        chunk_cache=cache,
    )


@pytest.fixture(params=["file", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    if request.param == "file":
        yield f"file://{tmp_path / 'store'}", None
    else:
        moto: MotoServer = request.getfixturevalue("moto_server")
        bucket: str = request.getfixturevalue("s3_bucket")
        yield f"s3://{bucket}/ckpt", fast_options(moto.endpoint_url)


def cached_objects(cache: ChunkCache) -> list[Path]:
    return sorted(p for p in (cache.dir / "objects").rglob("*") if p.is_file())


def flip_byte(path: Path, at: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_second_pull_takes_every_chunk_from_the_cache(
    tmp_path: Path, keys: Keys, store_url: tuple[str, Any]
) -> None:
    url, options = store_url
    with ChunkCache(tmp_path / "cache", max_bytes=256 * MiB) as cache:
        with opened(tmp_path, keys, cache, url=url, options=options) as store:
            src = make_tree(tmp_path / "src")
            pushed = store.push(src, workload="w")
            first = store.pull(pushed.checkpoint_id, tmp_path / "one")
            second = store.pull(pushed.checkpoint_id, tmp_path / "two")
        assert first.bytes_cached == 0 and first.bytes_fetched > 0
        assert second.bytes_fetched == 0 and second.chunks_fetched == 0
        assert second.bytes_cached == first.bytes_fetched
        assert second.chunks_cached == first.chunks_fetched
        assert tree_contents(tmp_path / "two") == tree_contents(tmp_path / "one")
        assert cache.stats().bytes == first.bytes_fetched


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_a_flipped_byte_in_a_cached_chunk_is_dropped_and_fetched_from_the_store(
    tmp_path: Path, keys: Keys, encrypted: bool
) -> None:
    with ChunkCache(tmp_path / "cache", max_bytes=256 * MiB) as cache:
        with opened(tmp_path, keys, cache, encrypted=encrypted) as store:
            src = make_tree(tmp_path / "src")
            pushed = store.push(src, workload="w")
            first = store.pull(pushed.checkpoint_id, tmp_path / "one")
            objects = cached_objects(cache)
            flip_byte(max(objects, key=lambda p: p.stat().st_size))
            second = store.pull(pushed.checkpoint_id, tmp_path / "two")
            assert tree_contents(tmp_path / "two") == tree_contents(tmp_path / "one")
            assert second.chunks_fetched == 1
            assert second.chunks_cached == first.chunks_fetched - 1
            assert cache.stats().dropped == 1
            # What the store gave in its place is cached again, and good.
            third = store.pull(pushed.checkpoint_id, tmp_path / "three")
            assert third.chunks_fetched == 0
            assert tree_contents(tmp_path / "three") == tree_contents(tmp_path / "one")


def test_a_stream_read_through_the_cache_skips_a_bad_cached_chunk(
    tmp_path: Path, keys: Keys
) -> None:
    data = random_bytes(9 * MiB, 5)
    src = tmp_path / "src"
    src.mkdir()
    (src / "gpu.bin").write_bytes(data)
    with ChunkCache(tmp_path / "cache", max_bytes=256 * MiB) as cache:
        with opened(tmp_path, keys, cache) as store:
            pushed = store.push(src, workload="w")
            assert (
                b"".join(bytes(b) for _o, b in store.open_stream(pushed.checkpoint_id, "gpu.bin"))
                == data
            )
            for path in cached_objects(cache):
                path.write_bytes(path.read_bytes()[:-1])  # truncated, every one
            again = b"".join(
                bytes(b) for _o, b in store.open_stream(pushed.checkpoint_id, "gpu.bin")
            )
            assert again == data
            assert cache.stats().dropped == len(
                store.manifest(pushed.checkpoint_id).files[0].chunks
            )


def test_a_corrupt_store_chunk_fails_the_pull_and_is_never_cached(
    tmp_path: Path, keys: Keys
) -> None:
    with ChunkCache(tmp_path / "cache", max_bytes=256 * MiB) as cache:
        with opened(tmp_path, keys, cache) as store:
            src = tmp_path / "src"
            src.mkdir()
            (src / "a").write_bytes(random_bytes(3 * MiB, 1))
            pushed = store.push(src, workload="w")
            refs = store.manifest(pushed.checkpoint_id).files[0].chunks
            bad = refs[0].id
            flip_byte(tmp_path / "store" / chunk_key(bad), at=5000)
            with pytest.raises(Corrupt, match=bad):
                store.pull(pushed.checkpoint_id, tmp_path / "dest")
            assert store.cache is not None
            assert store.cache.present([bad]) == {}
            assert not (tmp_path / "dest").exists()


def test_chunks_of_two_stores_never_mix(tmp_path: Path, keys: Keys) -> None:
    src = make_tree(tmp_path / "src")
    with ChunkCache(tmp_path / "cache", max_bytes=256 * MiB) as cache:
        with opened(tmp_path, keys, cache, url=f"file://{tmp_path / 'a'}", index="ia") as a:
            on_a = a.push(src, workload="w")
            a.pull(on_a.checkpoint_id, tmp_path / "from-a")
        with opened(tmp_path, keys, cache, url=f"file://{tmp_path / 'b'}", index="ib") as b:
            on_b = b.push(src, workload="w")  # the same chunk ids (no encryption)
            from_b = b.pull(on_b.checkpoint_id, tmp_path / "from-b")
        assert from_b.bytes_cached == 0
        assert from_b.bytes_fetched > 0
        assert len(cache.stats().stores) == 2


def test_a_push_that_seeds_the_cache_leaves_its_checkpoint_warm(tmp_path: Path, keys: Keys) -> None:
    with ChunkCache(tmp_path / "cache", max_bytes=256 * MiB) as cache:
        with opened(tmp_path, keys, cache) as store:
            src = make_tree(tmp_path / "src")
            seeded = store.push(src, workload="w", seed_cache=True)
            assert store.warm_fraction(seeded.checkpoint_id) == 1.0
            pulled = store.pull(seeded.checkpoint_id, tmp_path / "dest")
            assert pulled.bytes_fetched == 0
            assert pulled.bytes_cached == seeded.bytes_uploaded
            assert {p: c for p, (c, _m) in tree_contents(tmp_path / "dest").items()} == {
                p: c for p, (c, _m) in tree_contents(src).items()
            }
            # Without the option a push leaves the cache as it was.
            other = make_tree(tmp_path / "src2", seed=9)
            plain = store.push(other, workload="w")
            assert store.warm_fraction(plain.checkpoint_id) < 0.5


# --- after a 5% change: the standby fetches only the delta --------------------------------

IMAGE_MIB = 128


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 128 MiB image and the same with 5% of its bytes changed in one region."""
    root = tmp_path_factory.mktemp("images")
    parent, child = root / "parent", root / "child"
    for d in (parent, child):
        d.mkdir()
    pages = bytearray(random_bytes(96 * MiB, 11))
    weights = random_bytes(32 * MiB, 12)
    (parent / "pages-1.img").write_bytes(pages)
    (parent / "weights.bin").write_bytes(weights)
    changed = int(0.05 * IMAGE_MIB * MiB)
    pages[40 * MiB : 40 * MiB + changed] = random_bytes(changed, 13)
    (child / "pages-1.img").write_bytes(pages)
    (child / "weights.bin").write_bytes(weights)
    return parent, child


@pytest.mark.slow
@pytest.mark.parametrize("warmed_by", ["pull", "prefetch", "push"])
def test_a_pull_after_a_5_percent_change_fetches_at_most_a_tenth_of_the_image(
    tmp_path: Path,
    keys: Keys,
    store_url: tuple[str, Any],
    images: tuple[Path, Path],
    warmed_by: str,
) -> None:
    url, options = store_url
    parent_dir, child_dir = images
    with ChunkCache(tmp_path / "node-cache", max_bytes=1024 * MiB) as cache:
        with opened(tmp_path, keys, cache, url=url, options=options, index="node") as node:
            # The node holds the parent: it pulled it, prefetched it, or pushed it itself.
            if warmed_by == "push":
                parent = node.push(parent_dir, workload="w", seed_cache=True).checkpoint_id
            else:
                with opened(tmp_path, keys, None, url=url, options=options, index="p") as other:
                    parent = other.push(parent_dir, workload="w").checkpoint_id
                if warmed_by == "pull":
                    node.pull(parent, tmp_path / "parent")
                else:
                    warmed = node.prefetch(parent, threads=2)
                    assert warmed.warm_fraction == 1.0 and warmed.bytes_fetched > 0
            assert node.warm_fraction(parent) == 1.0
            # Another node checkpoints the workload again, 5% of it changed.
            with opened(tmp_path, keys, None, url=url, options=options, index="q") as other:
                child = other.push(child_dir, workload="w", parent=parent)
            assert node.warm_fraction(child.checkpoint_id) >= 0.9
            pulled = node.pull(child.checkpoint_id, tmp_path / "child")
        assert pulled.bytes_fetched <= 0.10 * pulled.bytes_total, pulled
        assert pulled.bytes_cached >= 0.85 * pulled.bytes_total, pulled
        assert tree_contents(tmp_path / "child") == tree_contents(child_dir)
