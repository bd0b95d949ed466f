"""The store never commits what it cannot restore (issue 12's two cases, and a backup restore).

Each test pushes, then changes the store behind the local chunk index's back -- the store
recreated under the same URL (a ``file://`` directory wiped; an S3 bucket emptied, or deleted
and created again), restored from an older copy, or a chunk removed by hand -- and pushes
again. The second checkpoint must pull back byte-identical and the store must verify: the
index said the chunks were there, and a push must not take its word for it.

These tests use only what the store offered before issue 12 (push, pull, verify, the
backend), so that they can be run against that code too: there, each of them fails.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.storage import CheckpointStore
from gpusnap.storage.layout import chunk_key
from gpusnap.storage.push import PushResult
from tests.storage.store_helpers import (
    Keys,
    MiB,
    Pushed,
    fast_options,
    file_store,
    pushed_file_store,
    random_bytes,
    tree_contents,
    write_src,
)
from tests.support.moto_server import MotoServer


def _image(root: Path, seed: int = 1) -> Path:
    return write_src(
        root,
        {"pages-1.img": random_bytes(6 * MiB, seed), "core.img": random_bytes(300_000, seed + 1)},
    )


def _assert_restores(store: CheckpointStore, checkpoint_id: str, src: Path, dest: Path) -> None:
    store.pull(checkpoint_id, dest)
    assert tree_contents(dest) == tree_contents(src)


def _push_again(store: CheckpointStore, src: Path, dest: Path) -> PushResult:
    """Push ``src`` again: the store then verifies, and the new checkpoint restores to ``dest``
    byte-identical. The push's result, for what it uploaded."""
    again = store.push(src, workload="w")
    assert store.verify().ok
    _assert_restores(store, again.checkpoint_id, src, dest)
    return again


def _lose_a_chunk(store: CheckpointStore, checkpoint_id: str, file: int) -> str:
    """Delete the first chunk of the checkpoint's ``file``-th file behind the store's back (an
    operator's rm, a lifecycle rule); its id."""
    victim = store.manifest(checkpoint_id).files[file].chunks[0].id
    store.backend.delete(chunk_key(victim))
    return victim


@pytest.fixture
def pushed(tmp_path: Path, keys: Keys) -> Iterator[Pushed]:
    with pushed_file_store(tmp_path, keys, _image(tmp_path / "src")) as pushed:
        yield pushed


@pytest.fixture
def s3_store(
    tmp_path: Path, keys: Keys, moto_server: MotoServer, s3_bucket: str
) -> Iterator[CheckpointStore]:
    opened = file_store(
        tmp_path,
        keys,
        url=f"s3://{s3_bucket}/ckpt",
        options=fast_options(moto_server.endpoint_url),
    )
    try:
        yield opened
    finally:
        opened.close()


def _empty_bucket(moto: MotoServer, bucket: str, *, recreate: bool) -> None:
    client = moto.client()
    try:
        listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
        for obj in listed:
            client.delete_object(Bucket=bucket, Key=obj["Key"])
        if recreate:
            client.delete_bucket(Bucket=bucket)
            client.create_bucket(Bucket=bucket)
    finally:
        client.close()


def test_a_push_into_a_wiped_file_store_uploads_every_chunk_again(
    tmp_path: Path, keys: Keys
) -> None:
    src = _image(tmp_path / "src")
    with file_store(tmp_path, keys) as store:
        store.push(src, workload="w")
    shutil.rmtree(tmp_path / "store")  # the operator wipes the directory
    # A new process (the CLI), with the same cache directory and so the same local index.
    with file_store(tmp_path, keys) as store:
        second = _push_again(store, src, tmp_path / "dest")
        assert second.chunks_uploaded == second.chunks_total


def test_a_long_lived_store_handle_notices_its_directory_was_wiped(
    pushed: Pushed, tmp_path: Path
) -> None:
    """The daemon keeps its store open across checkpoints: the same handle pushes again.

    (Its directory's contents are wiped; the directory itself stays: a store root that
    vanished may be an unmounted disk, and is never recreated under a running handle.)
    """
    for child in (tmp_path / "store").iterdir():
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()
    _push_again(pushed.store, pushed.src, tmp_path / "dest")


@pytest.mark.s3
@pytest.mark.parametrize("recreate", [False, True], ids=["emptied", "recreated"])
def test_a_push_into_an_emptied_or_recreated_bucket_uploads_every_chunk_again(
    tmp_path: Path,
    keys: Keys,
    moto_server: MotoServer,
    s3_bucket: str,
    s3_store: CheckpointStore,
    recreate: bool,
) -> None:
    src = _image(tmp_path / "src")
    s3_store.push(src, workload="w")
    _empty_bucket(moto_server, s3_bucket, recreate=recreate)
    second = _push_again(s3_store, src, tmp_path / "dest")
    assert second.chunks_uploaded == second.chunks_total


def test_a_chunk_lost_behind_the_stores_back_is_uploaded_again_by_the_next_push(
    pushed: Pushed, tmp_path: Path
) -> None:
    _lose_a_chunk(pushed.store, pushed.first.checkpoint_id, file=-1)
    second = _push_again(pushed.store, pushed.src, tmp_path / "dest-2")
    assert second.chunks_uploaded >= 1
    # The chunk is back: both checkpoints restore (chunks are named by their content).
    _assert_restores(pushed.store, pushed.first.checkpoint_id, pushed.src, tmp_path / "dest-1")


def test_after_verify_reports_a_lost_chunk_the_next_push_of_the_same_bytes_restores(
    pushed: Pushed, tmp_path: Path
) -> None:
    first = pushed.first.checkpoint_id
    victim = _lose_a_chunk(pushed.store, first, file=0)
    report = pushed.store.verify()
    assert not report.ok
    assert any(victim in m and first in m for m in report.chunks_missing)
    _push_again(pushed.store, pushed.src, tmp_path / "dest")


def test_a_store_restored_from_an_older_copy_gets_its_lost_chunks_back(
    tmp_path: Path, keys: Keys
) -> None:
    """Same store, same identity, but the chunks of the newer checkpoints are gone."""
    first_src = _image(tmp_path / "src-1", seed=1)
    second_src = _image(tmp_path / "src-2", seed=5)
    backup = tmp_path / "backup"
    with file_store(tmp_path, keys) as store:
        store.push(first_src, workload="w")
        shutil.copytree(tmp_path / "store", backup)
        store.push(second_src, workload="w")
    shutil.rmtree(tmp_path / "store")
    shutil.copytree(backup, tmp_path / "store")  # the restore from last night's backup
    with file_store(tmp_path, keys) as store:
        third = _push_again(store, second_src, tmp_path / "dest")
        assert third.chunks_uploaded >= 1
