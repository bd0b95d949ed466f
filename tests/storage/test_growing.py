"""Cutting a file while a writer appends to it gives the finished file's chunks."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest

from gpusnap.errors import InvalidArgument
from gpusnap.storage.chunker import Chunker, ChunkerParams
from gpusnap.storage.growing import growing_file_input
from tests.storage.store_helpers import bf16_like, random_bytes

KiB = 1024
CHUNKER = Chunker(ChunkerParams(min_size=16 * KiB, avg_size=64 * KiB, max_size=256 * KiB))


def cuts_of(data: bytes) -> list[bytes]:
    view = memoryview(data)
    return [bytes(view[o : o + n]) for o, n in CHUNKER.cut(view)]


def test_chunks_while_growing_equal_the_finished_files(tmp_path: Path) -> None:
    data = bf16_like(3 * 1024 * KiB, 1) + bytes(700 * KiB) + random_bytes(1024 * KiB + 7, 2)
    path = tmp_path / "pages-1.img"
    path.write_bytes(b"")
    done = threading.Event()

    def writer() -> None:
        with open(path, "ab") as f:
            for at in range(0, len(data), 100_003):  # odd pieces, never chunk-aligned
                f.write(data[at : at + 100_003])
                f.flush()
                time.sleep(0.001)
        done.set()

    source = growing_file_input(path, "pages-1.img", CHUNKER, done.is_set)
    thread = threading.Thread(target=writer)
    thread.start()
    got: list[bytes] = []
    with contextlib.closing(source.named()) as chunks:
        for view, cid in chunks:
            assert cid is None
            got.append(bytes(view))
            view.release()
    thread.join()
    assert got == cuts_of(data)
    assert b"".join(got) == data


def test_an_empty_file_once_complete_has_no_chunks(tmp_path: Path) -> None:
    path = tmp_path / "pages-2.img"
    path.write_bytes(b"")
    source = growing_file_input(path, "pages-2.img", CHUNKER, lambda: True)
    assert list(source.named()) == []


def test_stop_abandons_the_file(tmp_path: Path) -> None:
    path = tmp_path / "pages-3.img"
    path.write_bytes(random_bytes(10 * KiB, 3))  # never completes
    stopped = threading.Event()
    source = growing_file_input(path, "pages-3.img", CHUNKER, lambda: False, stop=stopped.is_set)
    threading.Timer(0.05, stopped.set).start()
    with pytest.raises(InvalidArgument, match="stopped reading"):
        list(source.named())


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read"):
        growing_file_input(tmp_path / "nope.img", "nope.img", CHUNKER, lambda: True)
