"""Virtual files pushed from a stream of buffers, and read back without writing a file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.errors import Corrupt, InvalidArgument
from gpusnap.storage import CheckpointStore
from gpusnap.storage.chunker import Chunker
from gpusnap.storage.layout import chunk_key
from gpusnap.storage.streams import GPU_MEMORY_KIND, StreamSource, cut_stream, stream_kinds
from tests.storage.store_helpers import Keys, MiB, file_store, random_bytes, write_src


@pytest.fixture
def store(tmp_path: Path, keys: Keys) -> Iterator[CheckpointStore]:
    with file_store(tmp_path, keys) as s:
        yield s


def pieces(data: bytes, size: int) -> Iterator[memoryview]:
    """Yield ``data`` through one reused buffer, as a ring of pinned buffers would."""
    ring = bytearray(size)
    for at in range(0, len(data), size):
        n = min(size, len(data) - at)
        ring[:n] = data[at : at + n]
        with memoryview(ring)[:n] as view:
            yield view


def test_a_stream_cuts_into_the_same_chunks_as_a_file_with_its_bytes(tmp_path: Path) -> None:
    data = random_bytes(21 * MiB + 12345, 7)
    chunker = Chunker()
    path = tmp_path / "f"
    path.write_bytes(data)
    from_file = [data[o : o + n] for o, n in chunker.chunks_of_file(path)]
    from_stream = []
    for view in cut_stream(chunker, StreamSource(len(data), pieces(data, 777_777)), "s"):
        from_stream.append(bytes(view))
        view.release()
    assert from_stream == from_file


def test_push_with_streams_round_trips_and_pull_can_leave_them_out(
    store: CheckpointStore, tmp_path: Path
) -> None:
    src = write_src(tmp_path / "src", {"core.img": b"core" * 1000})
    memory = random_bytes(9 * MiB + 3, 11)
    pushed = store.push(
        src,
        workload="w",
        streams={"gpu/1/dev0.mem": StreamSource(len(memory), pieces(memory, MiB), GPU_MEMORY_KIND)},
    )
    assert pushed.bytes_total == len(memory) + 4000
    manifest = store.manifest(pushed.checkpoint_id)
    entry = next(f for f in manifest.files if f.path == "gpu/1/dev0.mem")
    assert entry.size == len(memory)
    assert stream_kinds(manifest) == {"gpu/1/dev0.mem": GPU_MEMORY_KIND}

    back = bytearray(len(memory))
    for offset, data in store.open_stream(manifest, "gpu/1/dev0.mem"):
        back[offset : offset + len(data)] = data
    assert bytes(back) == memory

    full = tmp_path / "full"
    store.pull(pushed.checkpoint_id, full)
    assert (full / "gpu" / "1" / "dev0.mem").read_bytes() == memory
    images = tmp_path / "images"
    store.pull(pushed.checkpoint_id, images, exclude_kinds=(GPU_MEMORY_KIND,))
    assert (images / "core.img").read_bytes() == b"core" * 1000
    assert not (images / "gpu").exists()


def test_uploaded_streams_are_named_by_a_later_push(store: CheckpointStore, tmp_path: Path) -> None:
    memory = random_bytes(3 * MiB, 5)
    uploaded = store.upload_streams(
        {"gpu/dev.mem": StreamSource(len(memory), pieces(memory, 100_000), GPU_MEMORY_KIND)}
    )
    assert uploaded.bytes_total == len(memory) and uploaded.chunks_uploaded >= 1
    src = write_src(tmp_path / "src", {"a": b"a"})
    pushed = store.push(src, workload="w", uploaded_streams=uploaded)
    assert pushed.bytes_total == len(memory) + 1
    got = b"".join(bytes(d) for _o, d in store.open_stream(pushed.checkpoint_id, "gpu/dev.mem"))
    assert got == memory


def test_a_stream_shorter_than_declared_fails_the_push_and_commits_nothing(
    store: CheckpointStore, tmp_path: Path
) -> None:
    src = write_src(tmp_path / "src", {})
    with pytest.raises(InvalidArgument, match="yielded 1000 bytes, declared 2000"):
        store.push(src, workload="w", streams={"s": StreamSource(2000, [b"x" * 1000])})
    assert store.list("w") == []


def test_a_stream_may_not_shadow_a_file(store: CheckpointStore, tmp_path: Path) -> None:
    src = write_src(tmp_path / "src", {"s": b"file"})
    with pytest.raises(InvalidArgument, match="collides"):
        store.push(src, workload="w", streams={"s": StreamSource(1, [b"x"])})
    with pytest.raises(InvalidArgument, match="invalid stream path"):
        store.push(src, workload="w", streams={"../out": StreamSource(1, [b"x"])})


def test_open_stream_refuses_a_damaged_chunk(store: CheckpointStore, tmp_path: Path) -> None:
    src = write_src(tmp_path / "src", {})
    memory = random_bytes(2 * MiB, 3)
    pushed = store.push(src, workload="w", streams={"m": StreamSource(len(memory), [memory])})
    manifest = store.manifest(pushed.checkpoint_id)
    first = manifest.files[0].chunks[0].id
    obj = tmp_path / "store" / chunk_key(first)
    blob = bytearray(obj.read_bytes())
    blob[-1] ^= 0xFF
    obj.chmod(0o644)
    obj.write_bytes(bytes(blob))
    with pytest.raises(Corrupt):
        for _offset, _data in store.open_stream(manifest, "m"):
            pass
