"""Page images uploaded while a writer (CRIU, here a thread writing the same way) appends.

Real files, a real file:// store, real threads; the writer appends front to back in pieces
with pauses, as CRIU's page transfer does.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.host.pagestream import PageStreamer
from gpusnap.storage import CheckpointStore
from gpusnap.storage.streams import stream_kinds
from tests.storage.store_helpers import MiB, bf16_like, file_store, make_keys, random_bytes


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    with contextlib.closing(file_store(tmp_path, make_keys(tmp_path / "k"), workers=2)) as s:
        yield s


def write_slowly(path: Path, data: bytes, piece: int = 300_000, pause: float = 0.002) -> None:
    with open(path, "wb") as f:
        for at in range(0, len(data), piece):
            f.write(data[at : at + piece])
            f.flush()
            time.sleep(pause)


def dump_like(images: Path, files: dict[str, bytes]) -> None:
    """Write page images one after another, then the small images, like ``criu dump``."""
    images.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        write_slowly(images / name, data)
    (images / "core-1.img").write_bytes(random_bytes(3000, 1))
    (images / "pagemap-1.img").write_bytes(random_bytes(500, 2))


def image_files() -> dict[str, bytes]:
    return {
        "pages-1.img": bf16_like(6 * MiB, 3) + random_bytes(2 * MiB + 123, 4),
        "pages-2.img": random_bytes(3 * MiB, 5),
        "pages-10.img": bf16_like(1 * MiB, 6),
    }


def checkpoint(store: CheckpointStore, images: Path) -> tuple[str, set[str]]:
    streamer = PageStreamer(store, images, compress=None)
    streamer.start()
    writer = threading.Thread(target=dump_like, args=(images, image_files()), daemon=True)
    writer.start()
    writer.join()
    uploaded = streamer.finish()
    assert uploaded is not None
    pushed = store.push(images, workload="w", uploaded_streams=uploaded)
    return pushed.checkpoint_id, set(uploaded.of_files)


def test_streamed_page_images_make_the_same_checkpoint(
    store: CheckpointStore, tmp_path: Path
) -> None:
    images = tmp_path / "staging" / "images"
    streamed_id, of_files = checkpoint(store, images)
    assert of_files == {"pages-1.img", "pages-2.img", "pages-10.img"}
    plain = store.push(images, workload="w")
    a, b = store.manifest(streamed_id), store.manifest(plain.checkpoint_id)
    assert {f.path: f.chunks for f in a.files} == {f.path: f.chunks for f in b.files}
    assert stream_kinds(a) == dict.fromkeys(of_files, "criu-pages")
    out = tmp_path / "out"
    store.pull(streamed_id, out)
    for name, data in image_files().items():
        assert (out / name).read_bytes() == data


def test_a_page_image_that_grew_after_it_was_streamed_is_read_again(
    store: CheckpointStore, tmp_path: Path
) -> None:
    """A writer that goes back to a page image after starting the next one."""
    images = tmp_path / "images"
    images.mkdir()
    files = image_files()
    streamer = PageStreamer(store, images, compress=None)
    streamer.start()
    first = files["pages-1.img"]
    (images / "pages-1.img").write_bytes(first[: len(first) // 2])
    (images / "pages-2.img").write_bytes(files["pages-2.img"])
    # Wait until the streamer has taken pages-1 as complete (the next image exists).
    while "pages-1.img" not in streamer._result.of_files:
        time.sleep(0.01)
    with open(images / "pages-1.img", "ab") as f:
        f.write(first[len(first) // 2 :])
    (images / "pages-10.img").write_bytes(files["pages-10.img"])
    uploaded = streamer.finish()
    assert uploaded is not None and "pages-1.img" in uploaded.of_files
    pushed = store.push(images, workload="w", uploaded_streams=uploaded)
    manifest = store.manifest(pushed.checkpoint_id)
    assert set(stream_kinds(manifest)) == {"pages-2.img", "pages-10.img"}
    out = tmp_path / "out"
    store.pull(pushed.checkpoint_id, out)
    for name, data in files.items():
        assert (out / name).read_bytes() == data, name


def test_abort_stops_streaming_and_commits_nothing(store: CheckpointStore, tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    (images / "pages-1.img").write_bytes(random_bytes(1 * MiB, 7))  # and never finished
    streamer = PageStreamer(store, images, compress=None)
    streamer.start()
    time.sleep(0.2)
    streamer.abort()  # returns once the streamer thread has ended (a hang fails by timeout)
    assert store.list() == []
    assert not any(t.name == "gpusnap-dumpstream" for t in threading.enumerate())


def test_no_page_images_streams_nothing(store: CheckpointStore, tmp_path: Path) -> None:
    streamer = PageStreamer(store, tmp_path / "never-created", compress=None)
    streamer.start()
    uploaded = streamer.finish()
    assert uploaded is not None and uploaded.entries == [] and uploaded.of_files == set()
    assert not (tmp_path / "never-created").exists()


def test_abort_before_start_is_harmless(store: CheckpointStore, tmp_path: Path) -> None:
    (tmp_path / "pages-1.img").write_bytes(random_bytes(1 * MiB, 9))
    streamer = PageStreamer(store, tmp_path, compress=None)
    streamer.abort()  # e.g. the job failed before CRIU was started
    uploaded = streamer.finish()
    assert uploaded is not None and uploaded.entries == [] and uploaded.of_files == set()
    assert store.list() == []
