"""Content-defined chunking: exact coverage, size bounds, and stability under page shifts."""

from __future__ import annotations

import mmap
from pathlib import Path

from blake3 import blake3

from gpusnap.storage.chunker import MAX_SIZE, MIN_SIZE, SMALL_FILE, Chunker
from tests.storage.store_helpers import MiB, random_bytes

PAGE = 4096


def chunk_hashes(data: bytes) -> list[tuple[int, int, str]]:
    view = memoryview(data)
    return [(o, n, blake3(view[o : o + n]).hexdigest()) for o, n in Chunker().cut(view)]


def test_cuts_cover_the_buffer_exactly_within_size_bounds() -> None:
    data = random_bytes(40 * MiB, seed=1)
    cuts = list(Chunker().cut(data))
    offset = 0
    for start, length in cuts:
        assert start == offset
        offset += length
    assert offset == len(data)
    for _start, length in cuts[:-1]:
        assert MIN_SIZE <= length <= MAX_SIZE
    assert len(cuts) > 5  # ~2 MiB average: a 40 MiB buffer is not one chunk


def test_empty_buffer_has_no_chunks() -> None:
    assert list(Chunker().cut(b"")) == []


def test_zero_runs_are_cut_at_a_bounded_size() -> None:
    cuts = list(Chunker().cut(bytes(30 * MiB)))
    assert sum(n for _o, n in cuts) == 30 * MiB
    assert all(n <= MAX_SIZE for _o, n in cuts)


def _shared_tail(before: bytes, after: bytes) -> tuple[int, int]:
    """(chunks of ``before`` past the first 3, how many of them also appear in ``after``)."""
    old = chunk_hashes(before)
    new_ids = {h for _o, _n, h in chunk_hashes(after)}
    tail = old[3:]
    return len(tail), sum(1 for _o, _n, h in tail if h in new_ids)


def test_inserting_pages_near_the_start_keeps_every_later_chunk() -> None:
    data = random_bytes(48 * MiB, seed=2)
    inserted = data[: 100 * PAGE] + random_bytes(3 * PAGE, seed=3) + data[100 * PAGE :]
    total, shared = _shared_tail(data, inserted)
    assert total > 10
    assert shared == total


def test_removing_pages_near_the_start_keeps_every_later_chunk() -> None:
    data = random_bytes(48 * MiB, seed=4)
    removed = data[: 50 * PAGE] + data[54 * PAGE :]
    total, shared = _shared_tail(data, removed)
    assert total > 10
    assert shared == total


def test_a_changed_page_in_the_middle_changes_only_nearby_chunks() -> None:
    data = bytearray(random_bytes(48 * MiB, seed=5))
    before = chunk_hashes(bytes(data))
    data[24 * MiB : 24 * MiB + PAGE] = random_bytes(PAGE, seed=6)
    after_ids = {h for _o, _n, h in chunk_hashes(bytes(data))}
    changed = [h for _o, _n, h in before if h not in after_ids]
    assert 1 <= len(changed) <= 2


def test_large_files_are_mapped_not_read(tmp_path: Path) -> None:
    path = tmp_path / "big"
    data = random_bytes(SMALL_FILE * 3, seed=7)
    path.write_bytes(data)
    view = Chunker().open_view(path)
    try:
        assert isinstance(view.obj, mmap.mmap)
        assert view.readonly
        assert bytes(view[:100]) == data[:100]
    finally:
        view.release()


def test_file_chunks_match_buffer_chunks(tmp_path: Path) -> None:
    data = random_bytes(20 * MiB, seed=8)
    path = tmp_path / "f"
    path.write_bytes(data)
    small = tmp_path / "small"
    small.write_bytes(b"abc")
    chunker = Chunker()
    assert chunker.chunks_of_file(path) == list(chunker.cut(data))
    assert chunker.chunks_of_file(small) == [(0, 3)]
