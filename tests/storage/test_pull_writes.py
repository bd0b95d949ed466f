"""How a pull writes: O_DIRECT interiors with buffered edges, sparse zero grains, fallbacks.

Real files in real directories (tmp_path is on the machine's disk; /dev/shm is tmpfs), real
stores; the only injected fault is a filesystem that refuses O_DIRECT writes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import zstandard

from gpusnap.errors import Corrupt
from gpusnap.storage import CheckpointStore
from gpusnap.storage import pull as pull_mod
from gpusnap.storage.codec import HEADER_SIZE, ChunkCodec
from gpusnap.storage.context import Pools
from gpusnap.storage.dest import TMP_PREFIX
from tests.storage.store_helpers import MiB, bf16_like, file_store, make_keys, random_bytes

KiB = 1024


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    # two workers: chunks of one file are written concurrently, as on a 2-core node
    with contextlib.closing(file_store(tmp_path, make_keys(tmp_path / "k"), workers=2)) as opened:
        yield opened


def kv_pool(blocks: int, seed: int) -> bytes:
    """64 KiB blocks, one in five filled: a mostly empty KV pool."""
    out = bytearray(blocks * 64 * KiB)
    for i in range(0, blocks, 5):
        out[i * 64 * KiB : (i + 1) * 64 * KiB] = bf16_like(64 * KiB, seed + i)
    return bytes(out)


def image(root: Path) -> dict[str, bytes]:
    files = {
        # an odd head so that no chunk after it starts on a block boundary
        "pages-1.img": random_bytes(12_345, 1) + bf16_like(9 * MiB, 2) + random_bytes(3 * MiB, 3),
        "kv.bin": kv_pool(200, 4),
        "small.img": random_bytes(5_000, 5),
        "empty.img": b"",
        "zeros.bin": bytes(20 * MiB),
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def pushed_image(store: CheckpointStore, tmp_path: Path) -> tuple[dict[str, bytes], str]:
    """``image()`` written under ``tmp_path/src`` and pushed: its files and checkpoint id."""
    files = image(tmp_path / "src")
    return files, store.push(tmp_path / "src", workload="w").checkpoint_id


@pytest.mark.parametrize(("direct", "durable"), [(True, True), (False, False), (True, False)])
def test_pull_round_trips_every_mode(
    store: CheckpointStore, tmp_path: Path, direct: bool, durable: bool
) -> None:
    files, cid = pushed_image(store, tmp_path)
    dest = tmp_path / "dest"
    store.pull(cid, dest, direct=direct, durable=durable)
    for rel, data in files.items():
        assert (dest / rel).read_bytes() == data, rel
    assert not [p.name for p in dest.iterdir() if p.name.startswith(TMP_PREFIX)]


def test_direct_pull_writes_the_block_aligned_interiors_directly(
    store: CheckpointStore, tmp_path: Path
) -> None:
    files, cid = pushed_image(store, tmp_path)
    manifest = store.manifest(cid)
    stats = pull_mod.pull_files(store.context, manifest, tmp_path / "dest")
    # The page image but the unaligned edges of its chunks; not the small file, not the zero
    # grains, and not the KV pool's short data runs (64 KiB blocks go through the page cache).
    pages = len(files["pages-1.img"])
    assert pages * 0.9 < stats.bytes_direct <= pages


def test_zero_grains_stay_holes(store: CheckpointStore, tmp_path: Path) -> None:
    files, cid = pushed_image(store, tmp_path)
    dest = tmp_path / "dest"
    store.pull(cid, dest)
    kv = dest / "kv.bin"
    assert kv.read_bytes() == files["kv.bin"]
    allocated = os.stat(kv).st_blocks * 512
    # One block in five holds data; allow for filesystem metadata and grain rounding.
    assert allocated < len(files["kv.bin"]) * 0.4, allocated
    assert os.stat(dest / "zeros.bin").st_blocks * 512 < 1 * MiB


def test_one_chunk_at_two_alignments(store: CheckpointStore, tmp_path: Path) -> None:
    """The same content at offsets that differ modulo 4 KiB: decoded once, written right."""
    block = bf16_like(3 * MiB, 7)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(block)
    (src / "b.bin").write_bytes(random_bytes(777, 8) + block)
    (src / "c.bin").write_bytes(random_bytes(4096, 9) + block)
    cid = store.push(src, workload="w").checkpoint_id
    dest = tmp_path / "dest"
    store.pull(cid, dest)
    for name in ("a.bin", "b.bin", "c.bin"):
        assert (dest / name).read_bytes() == (src / name).read_bytes(), name


def test_a_durable_pull_syncs_each_file_once_before_it_is_renamed(
    store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, cid = pushed_image(store, tmp_path)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    dest = tmp_path / "dest"
    store.pull(cid, dest)
    temps = sorted(p for p in synced if Path(p).name.startswith(TMP_PREFIX))
    # Every file under its temporary name (so before the rename), once; then the directory.
    assert sorted(Path(p).name.split("-", 3)[-1] for p in temps) == sorted(files)
    assert str(dest) in synced
    synced.clear()
    store.pull(cid, tmp_path / "staging", direct=False, durable=False)
    assert synced == []


def test_files_are_written_at_the_same_pace(store: CheckpointStore, tmp_path: Path) -> None:
    """The chunk order keeps every file in progress until the end (one file alone at the end
    serialises the writes on its inode)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(random_bytes(24 * MiB, 1))
    (src / "small.bin").write_bytes(random_bytes(6 * MiB, 2))
    manifest = store.manifest(store.push(src, workload="w").checkpoint_id)
    order = pull_mod._interleaved(manifest.files)
    big, small = ([r.id for r in e.chunks] for e in sorted(manifest.files, key=lambda e: -e.size))
    assert sorted(order) == sorted(set(big + small))
    # The small file's last chunk comes late, not once the first few of the big one are out.
    assert order.index(small[-1]) > len(order) * 0.6, (len(big), len(small))
    # And each file's chunks keep their own order.
    assert [c for c in order if c in small] == small
    assert [c for c in order if c in big] == big


def test_decodes_run_at_most_decoders_at_once(store: CheckpointStore, tmp_path: Path) -> None:
    files, cid = pushed_image(store, tmp_path)
    manifest = store.manifest(cid)
    codec = store.context.codec
    live = 0
    peak = 0
    lock = threading.Lock()

    class CountingCodec:
        def decode_into(self, chunk_id: str, obj: bytes, out: memoryview) -> None:
            nonlocal live, peak
            with lock:
                live += 1
                peak = max(peak, live)
            try:
                time.sleep(0.02)  # long enough for the fetch threads to pile up
                codec.decode_into(chunk_id, obj, out)
            finally:
                with lock:
                    live -= 1

        def chunk_id(self, data: bytes) -> str:
            return codec.chunk_id(data)

    with ThreadPoolExecutor(8) as fetchers:
        # Eight fetch threads, two workers: at most two chunks decode at once.
        pools = Pools(workers=2, io_workers=8, budget_bytes=256 * MiB, cpu=fetchers, io=fetchers)
        counting = replace(store.context, codec=CountingCodec(), pools=pools)  # type: ignore[arg-type]
        pull_mod.pull_files(counting, manifest, tmp_path / "dest")
    assert peak == 2
    for rel, data in files.items():
        assert (tmp_path / "dest" / rel).read_bytes() == data, rel


def test_filesystem_refusing_direct_writes_falls_back(
    store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, cid = pushed_image(store, tmp_path)
    real_pwrite = os.pwrite
    direct_fds: set[int] = set()
    real_open = os.open

    def tracking_open(path: object, flags: int, *args: object, **kw: object) -> int:
        fd = real_open(path, flags, *args, **kw)  # type: ignore[arg-type]
        if flags & getattr(os, "O_DIRECT", 0):
            direct_fds.add(fd)
        return fd

    def refusing_pwrite(fd: int, data: object, offset: int) -> int:
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "pwrite", refusing_pwrite)
    dest = tmp_path / "dest"
    result = store.pull(cid, dest)
    assert direct_fds, "O_DIRECT was never tried"
    for rel, data in files.items():
        assert (dest / rel).read_bytes() == data, rel
    assert result.bytes_total == sum(len(d) for d in files.values())


def test_disk_error_on_a_direct_write_fails_the_pull_and_leaves_nothing(
    store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _files, cid = pushed_image(store, tmp_path)
    real_pwrite = os.pwrite
    calls = 0

    def failing_pwrite(fd: int, data: object, offset: int) -> int:
        nonlocal calls
        calls += 1
        if calls > 3:
            raise OSError(errno.EIO, "Input/output error")
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwrite", failing_pwrite)
    dest = tmp_path / "dest"
    with pytest.raises(Exception, match="Input/output error"):
        store.pull(cid, dest)
    assert not dest.exists() or not list(dest.rglob("*"))


def test_pull_onto_tmpfs(store: CheckpointStore, tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    files, cid = pushed_image(store, tmp_path)
    dest = shm / f"gpusnap-pull-test-{os.getpid()}"
    try:
        store.pull(cid, dest)
        for rel, data in files.items():
            assert (dest / rel).read_bytes() == data, rel
    finally:
        for p in sorted(dest.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        if dest.exists():
            dest.rmdir()


# --- decode_into: the same checks as decode, into a caller's buffer -------------------------


def encoded(data: bytes, *, compress: bool) -> tuple[str, bytes]:
    codec = ChunkCodec(None)
    cid = codec.chunk_id(data)
    return cid, codec.encode(cid, data, compress=compress).data


@pytest.mark.parametrize("compress", [True, False])
def test_decode_into_round_trips(compress: bool) -> None:
    data = bf16_like(1 * MiB, 3) if compress else random_bytes(1 * MiB, 3)
    cid, obj = encoded(data, compress=compress)
    out = bytearray(len(data))
    ChunkCodec(None).decode_into(cid, obj, memoryview(out))
    assert bytes(out) == data


def test_decode_into_refuses_a_flipped_byte() -> None:
    data = bf16_like(256 * KiB, 4)
    cid, obj = encoded(data, compress=True)
    bad = bytearray(obj)
    bad[HEADER_SIZE + len(bad) // 2] ^= 0x40
    with pytest.raises(Corrupt):
        ChunkCodec(None).decode_into(cid, bytes(bad), memoryview(bytearray(len(data))))


def test_decode_into_refuses_a_frame_with_more_content_than_declared() -> None:
    """A planted object whose frame hides its size and holds more than the manifest says."""
    data = bytes(64 * KiB)
    cid = ChunkCodec(None).chunk_id(data)
    # zstd frame without a content size, decompressing to 1 MiB
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1 * MiB))
    header = bytearray(encoded(data, compress=True)[1][:HEADER_SIZE])
    with pytest.raises(Corrupt, match="does not decompress to"):
        ChunkCodec(None).decode_into(cid, bytes(header) + frame, memoryview(bytearray(len(data))))


def test_decode_into_refuses_a_raw_chunk_of_the_wrong_length() -> None:
    data = random_bytes(4096, 5)
    cid, obj = encoded(data, compress=False)
    with pytest.raises(Corrupt):
        ChunkCodec(None).decode_into(cid, obj[:-10], memoryview(bytearray(len(data))))
