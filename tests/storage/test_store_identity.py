"""The store's identity (its signed ``config``), what the local index is trusted for, the
proof a push gives before it commits, and the background check's storage function."""

from __future__ import annotations

import base64
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.errors import FailedPrecondition, Unavailable
from gpusnap.storage import CheckpointStore
from gpusnap.storage.identity import CONFIG_FORMAT, create_identity, read_identity
from gpusnap.storage.keys import load_signing_key, seal
from gpusnap.storage.layout import CONFIG_KEY, chunk_key
from gpusnap.storage.streams import StreamSource, UploadedStreams
from tests.storage.store_helpers import (
    Keys,
    MiB,
    Pushed,
    file_store,
    make_keys,
    pushed_file_store,
    random_bytes,
    tree_contents,
    unbind_manifest,
    write_src,
)


def _src(root: Path, seed: int = 1, mib: int = 6) -> Path:
    return write_src(root, {"pages.img": random_bytes(mib * MiB, seed), "core.img": b"c" * 999})


def _config(store: CheckpointStore) -> dict[str, object]:
    envelope = json.loads(store.backend.get(CONFIG_KEY))
    assert envelope["format"] == CONFIG_FORMAT
    assert envelope["signature"] and envelope["encryption"] == "none"
    payload: dict[str, object] = json.loads(base64.b64decode(envelope["payload"]))
    return payload


def test_the_first_push_writes_a_signed_config_that_every_later_open_reads(
    checkpoint_store: CheckpointStore, tmp_path: Path
) -> None:
    assert checkpoint_store.identity is None  # a new store has none until it is pushed to
    pushed = checkpoint_store.push(_src(tmp_path / "src"), workload="w")
    identity = checkpoint_store.identity
    assert identity is not None and pushed.store_id == identity.store_id
    config = _config(checkpoint_store)
    assert config["store_id"] == identity.store_id
    assert config["format_version"] == 1
    assert config["chunking"] == {
        "algorithm": "fastcdc",
        "min_size": 512 * 1024,
        "avg_size": 2 * MiB,
        "max_size": 8 * MiB,
    }
    assert config["chunk_id"] == {"hash": "blake3-256", "keyed": False, "encryption_key_id": None}
    assert checkpoint_store.index.store_id == identity.store_id
    # Later pushes keep the identity: it is written once.
    again = checkpoint_store.push(_src(tmp_path / "src2", seed=2), workload="w")
    assert again.store_id == identity.store_id
    assert _config(checkpoint_store)["created_at"] == config["created_at"]


def test_two_nodes_creating_a_store_at_once_agree_on_one_identity(
    tmp_path: Path, keys: Keys
) -> None:
    stores = [file_store(tmp_path, keys, cache=f"cache-{i}") for i in range(2)]
    try:
        barrier = threading.Barrier(2)
        found: list[str] = []

        def create(store: CheckpointStore) -> None:
            barrier.wait()
            ctx = store.context
            found.append(create_identity(ctx.backend, ctx.keys, ctx.chunker.params).store_id)

        threads = [threading.Thread(target=create, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(found) == 2 and found[0] == found[1]
        on_disk = read_identity(stores[0].backend, stores[0].context.keys).identity
        assert on_disk is not None and on_disk.store_id == found[0]
    finally:
        for s in stores:
            s.close()


def test_a_config_swapped_by_an_untrusted_key_is_not_used(tmp_path: Path, keys: Keys) -> None:
    """Someone with write access but another key replaces the identity: nodes do not believe
    it (its id, its chunk sizes), say so, and go on correctly."""
    src = _src(tmp_path / "src")
    with file_store(tmp_path, keys) as store:
        first = store.push(src, workload="w")
        genuine = store.identity
        assert genuine is not None
        stranger = load_signing_key(make_keys(tmp_path / "stranger").signing)
        forged = _config(store) | {
            "store_id": "ab" * 16,
            "chunking": {"algorithm": "fastcdc", "min_size": 64, "avg_size": 64, "max_size": 64},
        }
        blob = seal(CONFIG_FORMAT, json.dumps(forged).encode(), signer=stranger, encryption=None)
        store.backend.delete(CONFIG_KEY)
        store.backend.put(CONFIG_KEY, blob)
        second = store.push(src, workload="w")  # the same open handle, like the daemon's
        assert second.store_id is None and store.identity is None
        assert store.index.store_id is not None
        assert store.index.store_id.startswith("unverified-")
    with file_store(tmp_path, keys) as reopened:
        assert reopened.identity is None
        assert stranger.key_id in str(reopened.identity_problem)
        assert reopened.context.chunker.params == genuine.chunking  # not the forged sizes
        third = reopened.push(src, workload="w")
        assert third.chunks_uploaded == 0 and third.chunks_total < 10
        report = reopened.verify()
        assert report.ok and any(stranger.key_id in w for w in report.warnings)
        for checkpoint in (first, second, third):
            dest = tmp_path / f"dest-{checkpoint.checkpoint_id}"
            reopened.pull(checkpoint.checkpoint_id, dest)
            assert tree_contents(dest) == tree_contents(src)


def test_an_altered_config_is_a_problem_verify_reports(tmp_path: Path, keys: Keys) -> None:
    with file_store(tmp_path, keys) as store:
        store.push(_src(tmp_path / "src"), workload="w")
    config = tmp_path / "store" / CONFIG_KEY
    envelope = json.loads(config.read_bytes())
    payload = json.loads(base64.b64decode(envelope["payload"])) | {"store_id": "cd" * 16}
    envelope["payload"] = base64.b64encode(json.dumps(payload).encode()).decode()
    config.write_text(json.dumps(envelope))  # the signature no longer matches
    with file_store(tmp_path, keys) as store:
        report = store.verify()
        assert not report.ok
        assert any("signature" in p for p in report.config_problems)


def test_a_store_made_before_configs_existed_gets_one_on_the_next_push_and_still_dedups(
    tmp_path: Path, keys: Keys
) -> None:
    """The migration: an old store has chunks and manifests but no config."""
    src = _src(tmp_path / "src")
    with file_store(tmp_path, keys) as store:
        first = store.push(src, workload="w")
        # As the store looked before issue 12: no config, and manifests not bound to one.
        unbind_manifest(store, "w", first.checkpoint_id)
    (tmp_path / "store" / CONFIG_KEY).unlink()
    with file_store(tmp_path, keys, cache="fresh-cache") as store:
        assert store.identity is None
        second = store.push(src, workload="w")
        assert store.identity is not None
        assert (tmp_path / "store" / CONFIG_KEY).exists()
        # The index was rebuilt from a LIST of the old store: nothing uploaded again.
        assert second.chunks_uploaded == 0
        assert second.chunks_proven == second.chunks_total
        assert store.verify([first.checkpoint_id, second.checkpoint_id]).ok


def test_an_index_of_another_store_is_emptied_when_it_is_opened_for_this_one(
    tmp_path: Path, keys: Keys
) -> None:
    with file_store(tmp_path, keys) as store:
        store.push(_src(tmp_path / "src"), workload="w")
        old_id = store.index.store_id
        assert store.index.count() > 0
    shutil.rmtree(tmp_path / "store")
    with file_store(tmp_path, keys) as store:  # the same cache dir, a recreated store
        store.push(_src(tmp_path / "other", seed=9, mib=1), workload="x")
        assert store.index.store_id not in (None, old_id)
        ids = store.manifest(store.list()[0].checkpoint_id).chunk_ids()
        # Only the new store's chunks are left in the index.
        assert store.index.count() == len(ids)


def test_pushing_with_an_encryption_key_into_a_plain_store_is_refused(
    tmp_path: Path, keys: Keys
) -> None:
    with file_store(tmp_path, keys) as store:
        store.push(_src(tmp_path / "src"), workload="w")
    with file_store(tmp_path, keys, encrypted=True) as encrypted:
        with pytest.raises(FailedPrecondition, match="not encrypted"):
            encrypted.push(_src(tmp_path / "src2", seed=3), workload="w")


def test_an_incremental_push_proves_the_chunks_it_skipped_and_uploads_nothing_more(
    checkpoint_store: CheckpointStore, tmp_path: Path
) -> None:
    src = _src(tmp_path / "src", mib=12)
    first = checkpoint_store.push(src, workload="w")
    second = checkpoint_store.push(src, workload="w", parent=first.checkpoint_id)
    assert second.chunks_uploaded == 0
    assert second.chunks_proven == second.chunks_total
    assert second.proof in ("head", "list")
    assert second.chunks_reuploaded == 0


def _flip_last_byte(store: CheckpointStore, tmp_path: Path, checkpoint_id: str) -> str:
    """Damage one chunk object of a checkpoint in place (a bad disk); its id."""
    victim = store.manifest(checkpoint_id).files[-1].chunks[0].id
    path = tmp_path / "store" / chunk_key(victim)
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0xFF
    path.write_bytes(bytes(damaged))
    return victim


@pytest.fixture
def damaged(tmp_path: Path, keys: Keys) -> Iterator[tuple[Pushed, str]]:
    """A file store holding a push one of whose chunks is damaged in place; that chunk's id."""
    with pushed_file_store(tmp_path, keys, _src(tmp_path / "src")) as pushed:
        yield pushed, _flip_last_byte(pushed.store, tmp_path, pushed.first.checkpoint_id)


def test_a_full_push_uploads_every_chunk_and_repairs_a_damaged_one(
    damaged: tuple[Pushed, str],
) -> None:
    pushed, _ = damaged
    parent = pushed.first.checkpoint_id
    full = pushed.store.push(pushed.src, workload="w", parent=parent, full=True)
    assert full.chunks_uploaded == full.chunks_total and full.proof == "none"
    assert pushed.store.verify(read_data=True).ok


def _streamed(store: CheckpointStore, path: Path, how: str, *, full: bool) -> UploadedStreams:
    """``path`` put in the store ahead of its push as entry ``pages.img``: as a growing file
    (a page image, a container part) or as a stream of buffers (GPU memory)."""
    if how == "growing":
        return store.upload_growing(path, "pages.img", complete=lambda: True, full=full)
    data = path.read_bytes()
    return store.upload_streams({"pages.img": StreamSource(len(data), [data])}, full=full)


@pytest.mark.parametrize("how", ["growing", "streams"])
@pytest.mark.parametrize("full", [True, False])
def test_a_full_push_repairs_a_damaged_chunk_of_what_it_streamed_only_if_it_went_up_full(
    damaged: tuple[Pushed, str], tmp_path: Path, how: str, full: bool
) -> None:
    pushed, victim = damaged
    uploaded = _streamed(pushed.store, pushed.src / "pages.img", how, full=full)
    # A growing file's push names it among its files; a stream is no file of the push.
    src = pushed.src
    if how == "streams":
        src = write_src(tmp_path / "rest", {"core.img": (src / "core.img").read_bytes()})
    again = pushed.store.push(
        src,
        workload="w",
        parent=pushed.first.checkpoint_id,
        uploaded_streams=uploaded,
        full=True,
    )
    assert victim in pushed.store.manifest(again.checkpoint_id).chunk_ids()
    report = pushed.store.verify([again.checkpoint_id], read_data=True)
    if full:
        # Every chunk put, the damaged object replaced by its good bytes.
        assert uploaded.chunks_uploaded == uploaded.chunks_total
        assert again.chunks_uploaded == again.chunks_total and report.ok
    else:
        # Skipped on the index's word: the proof sees the object there, not that it is bad.
        assert victim in uploaded.unproven
        assert report.damaged == {again.checkpoint_id: [victim]}


def test_verify_read_data_marks_a_corrupt_chunk_so_the_next_push_replaces_it(
    damaged: tuple[Pushed, str],
) -> None:
    pushed, victim = damaged
    report = pushed.store.verify(read_data=True)
    assert report.damaged == {pushed.first.checkpoint_id: [victim]}
    assert report.index_dropped == 1
    pushed.store.rebuild_index()  # a LIST still shows the object; it stays distrusted
    again = pushed.store.push(pushed.src, workload="w")
    assert again.chunks_uploaded == 1
    assert pushed.store.verify(read_data=True).ok


def test_verify_names_every_damaged_checkpoint_and_drops_the_chunk_from_the_index(
    tmp_path: Path, keys: Keys
) -> None:
    src = _src(tmp_path / "src")
    with file_store(tmp_path, keys) as store:
        a = store.push(src, workload="w").checkpoint_id
        b = store.push(src, workload="w2").checkpoint_id
        other = store.push(_src(tmp_path / "o", seed=4), workload="w3").checkpoint_id
        victim = store.manifest(a).files[-1].chunks[0].id
        store.backend.delete(chunk_key(victim))
        assert store.index.contains(victim)
        report = store.verify()
        assert report.checked == "chunks present"
        assert report.damaged == {a: [victim], b: [victim]}
        assert other not in report.damaged
        assert not store.index.contains(victim)
        assert report.as_dict()["checkpoints_damaged"] == sorted([a, b])


def test_check_reports_each_checkpoints_missing_chunks_and_forgets_them(
    tmp_path: Path, keys: Keys
) -> None:
    with file_store(tmp_path, keys) as store:
        a = store.push(_src(tmp_path / "a", seed=1), workload="w").checkpoint_id
        b = store.push(_src(tmp_path / "b", seed=2), workload="w").checkpoint_id
        healthy = store.check([a, b])
        assert healthy.missing == {} and sorted(healthy.checkpoints) == sorted([a, b])
        assert healthy.chunks_checked > 0 and healthy.chunks_missing == 0
        lost = [c.id for c in store.manifest(b).files[-1].chunks[:2]]
        for chunk_id in lost:
            store.backend.delete(chunk_key(chunk_id))
        gone = "20200101T000000Z-0123456789"
        result = store.check([a, b, gone])
        assert result.missing == {b: sorted(lost)}
        assert result.damaged == [b] and result.chunks_missing == len(lost)
        assert result.not_found == [gone]
        assert not any(store.index.contains(c) for c in lost)
        assert store.check(None).damaged == [b]


def test_a_stream_chunk_lost_before_the_commit_fails_the_push_and_the_next_one_works(
    tmp_path: Path, keys: Keys
) -> None:
    data = random_bytes(4 * MiB, seed=11)
    src = write_src(tmp_path / "src", {"core.img": b"x" * 100})
    with file_store(tmp_path, keys) as store:
        store.upload_streams({"gpu/0.bin": StreamSource(len(data), [data], kind="gpu-memory")})
        uploaded = store.upload_streams(
            {"gpu/0.bin": StreamSource(len(data), [data], kind="gpu-memory")}
        )
        assert uploaded.unproven  # the second upload skipped them on the index's word
        for chunk_id in uploaded.unproven:
            store.backend.delete(chunk_key(chunk_id))
        with pytest.raises(Unavailable, match="not committed"):
            store.push(src, workload="w", uploaded_streams=uploaded)
        assert store.list() == []
        again = store.upload_streams(
            {"gpu/0.bin": StreamSource(len(data), [data], kind="gpu-memory")}
        )
        pushed = store.push(src, workload="w", uploaded_streams=again)
        assert store.verify([pushed.checkpoint_id]).ok
