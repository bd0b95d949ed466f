"""Cutting along a parent's boundaries gives exactly FastCDC's cuts, and every id is proved."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import pytest

from gpusnap.storage.chunker import Chunker, ChunkerParams
from gpusnap.storage.codec import ChunkCodec
from gpusnap.storage.follow import cut_following
from gpusnap.storage.manifest import ChunkRef
from tests.storage.store_helpers import MiB, bf16_like, file_store, make_keys, random_bytes

KiB = 1024
# Small chunks so that a few MiB make dozens of them.
CHUNKER = Chunker(ChunkerParams(min_size=16 * KiB, avg_size=64 * KiB, max_size=256 * KiB))
CODEC = ChunkCodec(None)


def cdc(data: bytes) -> list[tuple[int, int, str]]:
    view = memoryview(data)
    return [(o, n, CODEC.chunk_id(view[o : o + n])) for o, n in CHUNKER.cut(view)]


def refs(cuts: list[tuple[int, int, str]]) -> list[ChunkRef]:
    return [ChunkRef(cid, n) for _o, n, cid in cuts]


class CountingIds:
    def __init__(self) -> None:
        self.hashed = 0

    def __call__(self, view: memoryview) -> str:
        self.hashed += len(view)
        return CODEC.chunk_id(view)


def follow(data: bytes, parent: list[ChunkRef]) -> tuple[list[tuple[int, int, str]], int]:
    ids = CountingIds()
    return list(cut_following(memoryview(data), CHUNKER, parent, ids)), ids.hashed


def base(seed: int = 1) -> bytes:
    return random_bytes(700 * KiB, seed) + bf16_like(2 * 1024 * KiB, seed) + bytes(300 * KiB)


def test_unchanged_file_follows_every_boundary_hashing_each_byte_once() -> None:
    data = base()
    got, hashed = follow(data, refs(cdc(data)))
    assert got == cdc(data)
    assert hashed == len(data)


@pytest.mark.parametrize(
    "change",
    ["overwrite-middle", "insert-pages-near-start", "remove-pages", "append", "truncate", "prefix"],
)
def test_changed_file_gives_fastcdcs_cuts(change: str) -> None:
    old = base()
    rng = random.Random(change)
    if change == "overwrite-middle":
        at = rng.randrange(1024 * KiB, 2048 * KiB)
        new = old[:at] + random_bytes(40 * KiB, 9) + old[at + 40 * KiB :]
    elif change == "insert-pages-near-start":
        new = old[: 8 * 4096] + random_bytes(3 * 4096, 9) + old[8 * 4096 :]
    elif change == "remove-pages":
        new = old[: 100 * 4096] + old[104 * 4096 :]
    elif change == "append":
        new = old + random_bytes(123_457, 9)
    elif change == "truncate":
        new = old[: len(old) - 200 * KiB - 17]
    else:
        new = random_bytes(5000, 9) + old
    got, hashed = follow(new, refs(cdc(old)))
    assert got == cdc(new)
    # Following skipped FastCDC for most bytes; wasted hashing is about a chunk per change.
    assert hashed < len(new) + 2 * CHUNKER.params.max_size


def test_parent_that_ended_at_its_file_end_is_not_a_cut_in_a_longer_file() -> None:
    old = random_bytes(40 * KiB, 3)  # one chunk, ended by the end of the file
    new = old + random_bytes(400 * KiB, 4)
    got, _ = follow(new, refs(cdc(old)))
    assert got == cdc(new)


def test_a_wrong_or_hostile_parent_costs_time_never_correctness() -> None:
    data = base(5)
    other = base(6)
    lying = [ChunkRef(cid, n + 1) for _o, n, cid in cdc(data)]  # right ids, wrong sizes
    huge = [ChunkRef("0" * 64, 10**12)]
    for parent in (refs(cdc(other)), lying, huge, [ChunkRef(CODEC.chunk_id(b""), 0)]):
        got, _ = follow(data, parent)
        assert got == cdc(data)


def test_ids_always_hash_the_bytes_they_name() -> None:
    old = base(7)
    new = old[: 300 * KiB] + random_bytes(70 * KiB, 8) + old[300 * KiB :]
    got, _ = follow(new, refs(cdc(old)))
    pos = 0
    for offset, length, cid in got:
        assert offset == pos
        assert cid == CODEC.chunk_id(new[offset : offset + length])
        pos += length
    assert pos == len(new)


# --- through the store ----------------------------------------------------------------------


def test_push_with_a_parent_cuts_as_without_and_reads_back(tmp_path: Path) -> None:
    keys = make_keys(tmp_path / "k")
    src = tmp_path / "src"
    src.mkdir()
    old = base(11) + random_bytes(3 * MiB, 12)
    (src / "pages-1.img").write_bytes(old)
    (src / "other.bin").write_bytes(bf16_like(2 * MiB, 13))
    with contextlib.closing(file_store(tmp_path, keys)) as store:
        first = store.push(src, workload="w")
        new = old[:8192] + random_bytes(3 * 4096, 14) + old[8192 : 2 * MiB] + old[2 * MiB + 5 :]
        (src / "pages-1.img").write_bytes(new)
        followed = store.push(src, workload="w", parent=first.checkpoint_id)
        unknown = store.push(src, workload="w", parent="20990101T000000Z-0123456789")
        plain = store.push(src, workload="w")
        a, b, c = (store.manifest(r.checkpoint_id) for r in (followed, unknown, plain))
        assert [f.chunks for f in a.files] == [f.chunks for f in c.files]
        assert [f.chunks for f in b.files] == [f.chunks for f in c.files]
        assert a.parent == first.checkpoint_id
        store.pull(followed.checkpoint_id, tmp_path / "out")
        assert (tmp_path / "out" / "pages-1.img").read_bytes() == new
