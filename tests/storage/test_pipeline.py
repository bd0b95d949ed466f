"""The push pipeline's cut-ahead threads: errors reach the caller and no thread is left."""

from __future__ import annotations

import threading
from collections.abc import Generator
from pathlib import Path

import pytest

from gpusnap.errors import InvalidArgument
from gpusnap.storage.pipeline import PushInput, push_inputs
from tests.storage.store_helpers import MiB, file_store, make_keys, random_bytes


def _cutters() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("gpusnap-cut")]


def _input(path: str, data: bytes, fail_after: int | None) -> PushInput:
    def chunks() -> Generator[memoryview, None, None]:
        view = memoryview(data)
        for n, offset in enumerate(range(0, len(data), MiB)):
            if fail_after is not None and n >= fail_after:
                raise InvalidArgument(f"{path} changed size while being pushed")
            yield view[offset : offset + MiB]

    return PushInput(path, len(data), 0o600, chunks, cut_ahead=True)


@pytest.mark.parametrize("fail_after", [0, 2])
def test_an_error_while_cutting_ahead_fails_the_push_and_stops_every_cutter(
    tmp_path: Path, fail_after: int
) -> None:
    data = random_bytes(4 * MiB, 3)
    inputs = [
        _input("a.img", data, None),
        _input("b.img", data, fail_after),
        _input("c.img", data, None),
    ]
    with file_store(tmp_path, make_keys(tmp_path / "keys")) as store:
        with pytest.raises(InvalidArgument, match=r"b\.img changed size"):
            push_inputs(store.context, inputs, compress=True, progress=None)
        assert _cutters() == []


def test_files_cut_ahead_give_the_same_entries_as_cutting_in_turn(tmp_path: Path) -> None:
    datas = [random_bytes(3 * MiB + n, n) for n in range(4)]
    ahead = [_input(f"f{n}", d, None) for n, d in enumerate(datas)]
    in_turn = [_input(f"f{n}", d, None) for n, d in enumerate(datas)]
    for item in in_turn:
        item.cut_ahead = False
    with file_store(tmp_path, make_keys(tmp_path / "keys")) as store:
        first, _ = push_inputs(store.context, ahead, compress=True, progress=None)
        second, _ = push_inputs(store.context, in_turn, compress=True, progress=None)
    assert first == second
    assert [e.path for e in first] == ["f0", "f1", "f2", "f3"]
    assert _cutters() == []
