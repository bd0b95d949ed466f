"""The checkpoint store end to end: push, pull, list, incremental pushes, gc and retention."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpusnap.errors import (
    AlreadyExists,
    Corrupt,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from gpusnap.storage import CheckpointStore
from gpusnap.storage.keys import export_public_key
from gpusnap.storage.layout import CHUNK_PREFIX
from tests.storage.store_helpers import (
    Keys,
    MiB,
    all_files,
    file_store,
    make_tree,
    push_tree,
    random_bytes,
    tree_contents,
    write_src,
)

PAGE = 4096


@pytest.fixture
def store(checkpoint_store: CheckpointStore) -> CheckpointStore:
    return checkpoint_store


def test_round_trip_restores_every_file_byte_for_byte_with_safe_modes(
    store: CheckpointStore, tmp_path: Path
) -> None:
    src = make_tree(tmp_path / "src")
    pushed = store.push(src, workload="llm-a", stamp={"gpu": "H200"}, spec={"cmd": ["serve"]})
    assert pushed.bytes_total == sum(len(c) for c, _m in tree_contents(src).values())
    assert 0 < pushed.chunks_uploaded <= pushed.chunks_total
    assert pushed.bytes_uploaded < pushed.bytes_total  # zeros and bf16 compress

    progress: list[tuple[int, int]] = []
    pulled = store.pull(
        pushed.checkpoint_id, tmp_path / "dest", progress=lambda d, t: progress.append((d, t))
    )
    assert pulled.bytes_total == pushed.bytes_total
    assert progress and progress[-1] == (pushed.bytes_total, pushed.bytes_total)

    want = tree_contents(src)
    got = tree_contents(tmp_path / "dest")
    assert set(got) == set(want)
    for path, (content, mode) in want.items():
        assert got[path][0] == content, path
        assert got[path][1] == mode & 0o777, path  # setuid dropped, permission bits kept
    assert got["core.img"][1] == 0o600
    assert got["pages/deep/er/tiny"][1] == 0o755
    manifest = store.manifest(pushed.checkpoint_id)
    assert manifest.stamp == {"gpu": "H200"}
    assert manifest.spec == {"cmd": ["serve"]}
    assert manifest.totals["bytes_total"] == pushed.bytes_total
    assert [f.path for f in manifest.files] == sorted(want)


def test_second_push_of_the_same_tree_uploads_nothing(
    store: CheckpointStore, tmp_path: Path
) -> None:
    src = make_tree(tmp_path / "src")
    first = store.push(src, workload="w")
    second = store.push(src, workload="w", parent=first.checkpoint_id)
    assert first.chunks_uploaded > 0
    assert second.chunks_uploaded == 0
    assert second.bytes_uploaded == 0
    assert store.manifest(second.checkpoint_id).parent == first.checkpoint_id


def test_incremental_push_uploads_only_changed_chunks(
    store: CheckpointStore, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    data = bytearray(random_bytes(32 * MiB, seed=11))
    (src / "pages.img").write_bytes(data)
    first = store.push(src, workload="w", compress=False)
    data[16 * MiB : 16 * MiB + 4 * PAGE] = random_bytes(4 * PAGE, seed=12)
    (src / "pages.img").write_bytes(data)
    second = store.push(src, workload="w", compress=False)
    assert first.bytes_uploaded >= 32 * MiB
    assert 0 < second.bytes_uploaded <= 0.25 * first.bytes_uploaded
    assert second.chunks_uploaded <= 2
    store.pull(second.checkpoint_id, tmp_path / "dest")
    assert (tmp_path / "dest" / "pages.img").read_bytes() == bytes(data)


def test_pages_inserted_near_the_start_keep_later_chunks_shared(
    store: CheckpointStore, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    data = random_bytes(40 * MiB, seed=13)
    (src / "pages.img").write_bytes(data)
    first = store.push(src, workload="w")
    (src / "pages.img").write_bytes(
        data[: 64 * PAGE] + random_bytes(2 * PAGE, 14) + data[64 * PAGE :]
    )
    second = store.push(src, workload="w")
    old = [c.id for c in store.manifest(first.checkpoint_id).files[0].chunks]
    new = {c.id for c in store.manifest(second.checkpoint_id).files[0].chunks}
    assert len(old) > 8
    assert all(chunk_id in new for chunk_id in old[2:])
    assert second.chunks_uploaded <= 2


def test_list_latest_and_lookup_errors(store: CheckpointStore, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    a1 = store.push(src, workload="a")
    b1 = store.push(src, workload="b")
    a2 = store.push(src, workload="a", parent=a1.checkpoint_id)
    assert [s.checkpoint_id for s in store.list("a")] == [a2.checkpoint_id, a1.checkpoint_id]
    assert {s.checkpoint_id for s in store.list()} == {
        a1.checkpoint_id,
        a2.checkpoint_id,
        b1.checkpoint_id,
    }
    latest = store.latest("a")
    assert latest is not None and latest.checkpoint_id == a2.checkpoint_id
    assert latest.files == len(tree_contents(src))
    assert store.latest("nobody") is None
    with pytest.raises(NotFound):
        store.manifest("20000101T000000Z-0000000000")
    with pytest.raises(InvalidArgument):
        store.manifest("../../etc/passwd")
    with pytest.raises(InvalidArgument):
        store.push(src, workload="../evil")


def test_pull_refuses_to_overwrite_and_writes_nothing(
    store: CheckpointStore, tmp_path: Path
) -> None:
    pushed = push_tree(store, tmp_path)
    dest = write_src(tmp_path / "dest", {"core.img": b"mine"})
    with pytest.raises(AlreadyExists):
        store.pull(pushed.checkpoint_id, dest)
    assert all_files(dest) == [dest / "core.img"]
    assert (dest / "core.img").read_bytes() == b"mine"


def test_push_of_an_existing_checkpoint_id_is_refused(
    store: CheckpointStore, tmp_path: Path
) -> None:
    pushed = push_tree(store, tmp_path)
    with pytest.raises(AlreadyExists):
        store.push(tmp_path / "src", workload="w", checkpoint_id=pushed.checkpoint_id)


def test_compression_auto_and_off(store: CheckpointStore, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "zeros.img").write_bytes(bytes(8 * MiB))
    auto = store.push(src, workload="w")
    assert auto.bytes_uploaded < MiB
    other = file_store(tmp_path, None, name="store2", cache="cache2", verify=False)
    try:
        raw = other.push(src, workload="w", compress=False)
        assert raw.bytes_uploaded >= 8 * MiB
    finally:
        other.close()


def test_verify_only_node_pulls_but_cannot_push(tmp_path: Path, keys: Keys) -> None:
    src = make_tree(tmp_path / "src")
    writer = file_store(tmp_path, keys)
    pushed = writer.push(src, workload="w")
    writer.close()
    public = tmp_path / "public.pem"
    export_public_key(keys.signing, public)
    reader = file_store(tmp_path, Keys(public, keys.encryption), cache="cache-r")
    try:
        reader.pull(pushed.checkpoint_id, tmp_path / "dest")
        assert tree_contents(tmp_path / "dest").keys() == tree_contents(src).keys()
        with pytest.raises(FailedPrecondition, match="private key"):
            reader.push(src, workload="w")
    finally:
        reader.close()


def test_push_without_a_key_needs_verification_off(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    store = file_store(tmp_path, None)
    try:
        with pytest.raises(FailedPrecondition):
            store.push(src, workload="w")
    finally:
        store.close()


def test_gc_respects_grace_and_keep_last(store: CheckpointStore, tmp_path: Path) -> None:
    ids = []
    for seed in range(3):
        src = tmp_path / f"src{seed}"
        src.mkdir()
        (src / "pages.img").write_bytes(random_bytes(3 * MiB, seed=100 + seed))
        ids.append(store.push(src, workload="w").checkpoint_id)
    other_src = make_tree(tmp_path / "other")
    other = store.push(other_src, workload="other").checkpoint_id
    chunks_before = sum(1 for _ in store.backend.list(CHUNK_PREFIX))

    dry = store.gc(keep_last=1, grace_seconds=0, dry_run=True)
    assert sorted(dry.manifests_deleted) == sorted(ids[:2])
    assert dry.chunks_deleted > 0
    assert len(store.list()) == 4
    assert sum(1 for _ in store.backend.list(CHUNK_PREFIX)) == chunks_before

    graced = store.gc(keep_last=1, grace_seconds=3600)
    assert sorted(graced.manifests_deleted) == sorted(ids[:2])
    assert graced.chunks_deleted == 0
    assert graced.chunks_kept_in_grace > 0
    assert {s.checkpoint_id for s in store.list()} == {ids[2], other}

    swept = store.gc(grace_seconds=0)
    assert swept.chunks_deleted == graced.chunks_kept_in_grace
    assert swept.bytes_freed > 0
    report = store.verify(read_data=True)
    assert report.ok, report.problems
    store.pull(ids[2], tmp_path / "dest")
    assert (tmp_path / "dest" / "pages.img").read_bytes() == (
        tmp_path / "src2" / "pages.img"
    ).read_bytes()


def test_a_push_after_gc_reuploads_what_gc_removed(store: CheckpointStore, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    first = store.push(src, workload="w")
    store.gc(keep_last=1, grace_seconds=0)  # keeps `first`
    second = store.push(src, workload="w")
    assert second.chunks_uploaded == 0
    store.gc(keep_last=1, grace_seconds=0)  # deletes `first`; every chunk still referenced
    assert store.verify().ok
    assert first.checkpoint_id not in {s.checkpoint_id for s in store.list()}


def test_signed_records_round_trip_and_refuse_tampering(store: CheckpointStore) -> None:
    blob = store.sign(b'{"migrate": "w"}')
    assert store.open_signed(blob) == b'{"migrate": "w"}'
    tampered = blob.replace(b'"payload": "', b'"payload": "A')
    with pytest.raises(Corrupt):
        store.open_signed(tampered)
    with pytest.raises(Corrupt):
        store.open_signed(b"not json")


def test_push_refuses_symlinks_in_the_source(store: CheckpointStore, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    os.symlink("/etc/passwd", src / "link")
    with pytest.raises(InvalidArgument, match="not a regular file"):
        store.push(src, workload="w")
    assert store.list() == []
