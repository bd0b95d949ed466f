"""A hostile store: what it contains must never redirect a write, exhaust memory or break listing.

The end-to-end forms of these (through the CLI) are in tests/e2e/test_badinput.py.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zstandard

from gpusnap.errors import Corrupt, FailedPrecondition, InvalidArgument
from gpusnap.storage import CheckpointStore, generate_signing_key, open_store
from gpusnap.storage.codec import MAX_CHUNK_BYTES, ChunkCodec
from gpusnap.storage.layout import chunk_key, split_manifest_key
from gpusnap.storage.manifest import Manifest, check_checkpoint_id, check_workload
from gpusnap.storage.open import open_backend
from tests.storage.store_helpers import StoreUnderTest, fast_options

ID = "20261130T083000Z-0123456789"


# --- ids, names and keys ----------------------------------------------------------------------


@pytest.mark.parametrize("value", [ID + "\n", "\n" + ID, ID + "\r"])
def test_an_id_with_a_line_break_is_not_an_id(value: str) -> None:
    with pytest.raises(InvalidArgument):
        check_checkpoint_id(value)


def test_a_workload_name_with_a_trailing_newline_is_refused() -> None:
    with pytest.raises(InvalidArgument):
        check_workload("w1\n")


@pytest.mark.parametrize(
    "key", [f"manifests/../{ID}", f"manifests/w\n/{ID}", f"manifests/w/{ID}\n"]
)
def test_a_key_that_no_push_writes_is_not_a_manifest_key(key: str) -> None:
    assert split_manifest_key(key) is None


def test_a_listing_skips_names_that_are_not_store_keys(store: StoreUnderTest) -> None:
    store.backend.put("manifests/w/a", b"x")
    if store.root is not None:
        (store.root / "manifests" / "w" / "b\n").write_bytes(b"x")
    else:
        assert store.moto is not None and store.bucket is not None
        client = store.moto.client()
        client.put_object(Bucket=store.bucket, Key=f"{store.prefix}manifests//b", Body=b"x")
        client.put_object(Bucket=store.bucket, Key=f"{store.prefix}manifests/w/b\\c", Body=b"x")
    assert [i.key for i in store.backend.list("manifests/")] == ["manifests/w/a"]


# --- symlinks in a file:// store --------------------------------------------------------------


@pytest.fixture
def linked(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A store whose ``chunks`` directory is a symlink to a directory outside it."""
    root = tmp_path / "store"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"not the store's")
    root.mkdir()
    (root / "chunks").symlink_to(outside)
    yield root, outside


def test_no_backend_call_goes_through_a_symlinked_store_directory(
    linked: tuple[Path, Path],
) -> None:
    root, outside = linked
    backend = open_backend(f"file://{root}", fast_options())
    try:
        calls: list[Callable[[], object]] = [
            lambda: backend.put("chunks/x", b"data"),
            lambda: backend.put("chunks/x", b"data", if_absent=True),
            lambda: backend.put_unsynced("chunks/x", b"data"),  # type: ignore[attr-defined]
            lambda: backend.get("chunks/secret"),
            lambda: backend.stat("chunks/secret"),
            lambda: backend.delete("chunks/secret"),
            lambda: list(backend.list("chunks/")),
            lambda: backend.sync(["chunks/secret"]),  # type: ignore[attr-defined]
        ]
        for call in calls:
            with pytest.raises(FailedPrecondition) as err:
                call()
            assert str(root / "chunks") in str(err.value)
            assert "symbolic link" in str(err.value)
    finally:
        backend.close()
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert (outside / "secret").read_bytes() == b"not the store's"


def test_a_symlink_deeper_in_the_store_is_refused_too(tmp_path: Path) -> None:
    root = tmp_path / "store"
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "manifests").mkdir(parents=True)
    (root / "manifests" / "w").symlink_to(outside)
    backend = open_backend(f"file://{root}", fast_options())
    try:
        with pytest.raises(FailedPrecondition):
            backend.put(f"manifests/w/{ID}", b"m", if_absent=True)
    finally:
        backend.close()
    assert list(outside.iterdir()) == []


def test_a_store_url_naming_a_file_says_it_is_not_a_directory(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_bytes(b"")
    with pytest.raises(FailedPrecondition, match="not a directory"):
        open_backend(f"file://{path}", fast_options())


# --- chunk sizes ------------------------------------------------------------------------------


def _object(raw_len: int, frame: bytes) -> bytes:
    return struct.pack("<4sBBHQ", b"GSNC", 1, 1, 0, raw_len) + frame


def test_decode_refuses_a_header_that_disagrees_with_the_manifest() -> None:
    codec = ChunkCodec(None)
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"x")
    with pytest.raises(Corrupt, match="manifest says 1"):
        codec.decode(codec.chunk_id(b"x"), _object(1 << 40, frame), 1)


def test_decode_refuses_a_frame_whose_content_size_disagrees_with_the_manifest() -> None:
    # zstd allocates a frame's declared content size whatever max_output_size says.
    codec = ChunkCodec(None)
    data = b"y" * 1000
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(data * 64)
    with pytest.raises(Corrupt, match="zstd frame"):
        codec.decode(codec.chunk_id(data), _object(len(data), frame), len(data))


def test_decode_refuses_a_size_larger_than_any_chunk() -> None:
    codec = ChunkCodec(None)
    with pytest.raises(Corrupt):
        codec.decode("0" * 64, _object(MAX_CHUNK_BYTES + 1, b""), MAX_CHUNK_BYTES + 1)


def test_a_manifest_declaring_one_chunk_with_two_sizes_is_corrupt() -> None:
    chunk = "a" * 64
    body = {
        "schema_version": 1,
        "checkpoint_id": ID,
        "workload": "w",
        "created_at": 0,
        "files": [
            {"path": "a", "size": 10, "mode": 0o644, "chunks": [[chunk, 10]]},
            {"path": "b", "size": 3, "mode": 0o644, "chunks": [[chunk, 3]]},
        ],
    }
    with pytest.raises(Corrupt, match="two sizes"):
        Manifest.from_dict(body)


# --- the store over a hostile directory -------------------------------------------------------


@pytest.fixture
def ckpt_store(tmp_path: Path) -> Iterator[CheckpointStore]:
    key = tmp_path / "signing.key"
    generate_signing_key(key)
    opened = open_store(f"file://{tmp_path / 'store'}", key_file=key, cache_dir=tmp_path / "c")
    yield opened
    opened.close()


def test_stray_objects_under_manifests_are_skipped_and_reported(
    ckpt_store: CheckpointStore, tmp_path: Path
) -> None:
    store = ckpt_store
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(1000))
    pushed = store.push(src, workload="w").checkpoint_id
    store.backend.put("manifests/w/not-an-id", b"junk")
    assert [s.checkpoint_id for s in store.list()] == [pushed]
    report = store.verify()
    assert report.checkpoints == [pushed]
    assert report.strays == ["manifests/w/not-an-id"] and not report.ok
    gc = store.gc(grace_seconds=0)
    assert any("not-an-id" in p for p in gc.problems)
    assert store.backend.stat(chunk_key(next(iter(store.manifest(pushed).chunk_ids()))))
