"""Freshness and binding at the storage API: head sequences under concurrent commits, the
node scope of a trusted key, legacy manifests without a store id, gc pruning old heads, and
the high-water marks shared by the daemon and the CLI on one node."""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path

import pytest

from gpusnap.storage import CheckpointStore, open_store
from gpusnap.storage.heads import HEADS_KEPT, RollbackRefused, read_head
from gpusnap.storage.keys import UntrustedSigner, export_public_key
from gpusnap.storage.layout import HEAD_PREFIX, manifest_key
from tests.storage.store_helpers import (
    Keys,
    fast_options,
    file_store,
    make_keys,
    unbind_manifest,
    write_src,
)
from tests.support.moto_server import MotoServer


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return make_keys(tmp_path / "keys")


def _src(tmp_path: Path, name: str, seed: int) -> Path:
    return write_src(tmp_path / name, {"a.img": bytes([seed]) * 4096, "b.img": b"b" * seed})


def _head_sequences(store: CheckpointStore, workload: str) -> list[int]:
    keys = [i.key for i in store.backend.list(f"{HEAD_PREFIX}{workload}/")]
    return [int(k.rpartition("/")[2]) for k in keys]


def test_two_nodes_committing_one_workload_at_once_never_reuse_or_lower_a_sequence(
    tmp_path: Path, keys: Keys
) -> None:
    stores = [file_store(tmp_path, keys, cache=f"cache-{i}") for i in range(2)]
    rounds = 4
    try:
        stores[0].push(_src(tmp_path, "first", 0), workload="w")  # the store's config
        barrier = threading.Barrier(2)
        pushed: list[str] = []
        errors: list[BaseException] = []

        def commit(i: int, store: CheckpointStore) -> None:
            try:
                for r in range(rounds):
                    barrier.wait()
                    src = _src(tmp_path, f"src-{i}-{r}", 10 * i + r + 1)
                    pushed.append(store.push(src, workload="w").checkpoint_id)
            except BaseException as exc:  # reported below, with the thread's failure
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=commit, args=(i, s)) for i, s in enumerate(stores)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert sorted(_head_sequences(stores[0], "w")) == list(range(1, 2 * rounds + 2))
        head = read_head(stores[0].context, "w")
        assert head is not None and head.sequence == 2 * rounds + 1
        assert head.checkpoint_id in pushed
        for store in stores:  # each node's own mark is at most the head: neither refuses
            latest = store.latest_checked("w")
            assert latest.summary is not None and latest.note is None
    finally:
        for s in stores:
            s.close()


def test_a_key_scoped_to_a_node_signs_only_that_nodes_checkpoints(
    tmp_path: Path, keys: Keys
) -> None:
    other = make_keys(tmp_path / "other")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    export_public_key(other.signing, trusted / "x.pub")
    (trusted / "x.pub.scope").write_text("nodes = node-x\nworkloads = w*\n")
    src = _src(tmp_path, "src", 1)
    with file_store(tmp_path, other) as pusher:
        from_x = pusher.push(src, workload="w1", stamp={"host": {"node_id": "node-x"}})
        from_y = pusher.push(src, workload="w1", stamp={"host": {"node_id": "node-y"}})
        no_node = pusher.push(src, workload="w2")
    with open_store(
        f"file://{tmp_path / 'store'}",
        key_file=keys.signing,
        trusted_keys=[trusted],
        cache_dir=tmp_path / "reader",
    ) as reader:
        assert reader.manifest(from_x.checkpoint_id).node_id == "node-x"
        for refused, node in ((from_y, "node-y"), (no_node, "(none)")):
            with pytest.raises(
                UntrustedSigner, match=re.escape(f"node {node} is not in its scope")
            ):
                reader.manifest(refused.checkpoint_id)


def test_a_legacy_manifest_without_a_store_id_is_accepted_with_one_note(
    tmp_path: Path, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    src = _src(tmp_path, "src", 2)
    with file_store(tmp_path, keys) as store:
        pushed = store.push(src, workload="w")
        assert unbind_manifest(store, "w", pushed.checkpoint_id) == pushed.store_id
        with caplog.at_level(logging.WARNING, logger="gpusnap.storage"):
            assert store.manifest(pushed.checkpoint_id).store_id is None
            store.pull(pushed.checkpoint_id, tmp_path / "dest")
        notes = [r for r in caplog.records if "carries no store id" in r.getMessage()]
        assert len(notes) == 1, caplog.text


def test_gc_keeps_the_newest_heads_and_latest_still_vouches(tmp_path: Path, keys: Keys) -> None:
    with file_store(tmp_path, keys) as store:
        ids = [
            store.push(_src(tmp_path, f"src-{i}", i + 1), workload="w").checkpoint_id
            for i in range(HEADS_KEPT + 2)
        ]
        store.gc(dry_run=True)
        assert len(_head_sequences(store, "w")) == HEADS_KEPT + 2
        store.gc(grace_seconds=0)
        assert _head_sequences(store, "w") == list(range(3, HEADS_KEPT + 3))
        assert store.latest_checked("w").summary is not None
        assert store.latest_checked("w").summary.checkpoint_id == ids[-1]  # type: ignore[union-attr]


def test_the_daemon_and_the_cli_on_one_node_share_marks_through_one_file(
    tmp_path: Path, keys: Keys
) -> None:
    """A mark raised through one handle refuses a rollback seen through another."""
    marks = tmp_path / "heads.json"
    url = f"file://{tmp_path / 'store'}"

    def opened(cache: str) -> CheckpointStore:
        return open_store(
            url, key_file=keys.signing, cache_dir=tmp_path / cache, high_water_file=marks
        )

    with opened("one") as one:
        one.push(_src(tmp_path, "a", 1), workload="w")
        newest = one.push(_src(tmp_path, "b", 2), workload="w")
    (tmp_path / "store" / "heads" / "w" / "0000000000000002").unlink()
    with opened("two") as two, pytest.raises(RollbackRefused, match="older than sequence 2"):
        two.latest_checked("w")
    assert newest.checkpoint_id in marks.read_text()


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
@pytest.mark.parametrize("kind", ["file", "s3"])
def test_heads_on_each_backend_refuse_a_deleted_newest_checkpoint(
    request: pytest.FixtureRequest, tmp_path: Path, keys: Keys, kind: str, encrypted: bool
) -> None:
    url, options = None, None
    if kind == "s3":
        moto: MotoServer = request.getfixturevalue("moto_server")
        url = f"s3://{request.getfixturevalue('s3_bucket')}/ckpt"
        options = fast_options(moto.endpoint_url)
    with file_store(tmp_path, keys, url=url, options=options, encrypted=encrypted) as store:
        older = store.push(_src(tmp_path, "a", 1), workload="w").checkpoint_id
        newest = store.push(_src(tmp_path, "b", 2), workload="w").checkpoint_id
        assert _head_sequences(store, "w") == [1, 2]
        envelope = json.loads(store.backend.get(f"{HEAD_PREFIX}w/0000000000000002"))
        assert envelope["encryption"] == ("aes-256-gcm" if encrypted else "none")
        head = read_head(store.context, "w")
        assert head is not None and head.checkpoint_id == newest
        assert head.store_id == store.identity.store_id  # type: ignore[union-attr]
        assert head.key_id == store.context.keys.signer.key_id  # type: ignore[union-attr]
        store.backend.delete(manifest_key("w", newest))
        with pytest.raises(RollbackRefused, match=newest):
            store.latest_checked("w")
        accepted = store.latest_checked("w", allow_rollback=True)
        assert accepted.summary is not None and accepted.summary.checkpoint_id == older
        assert accepted.note is not None and "accepted (--allow-rollback)" in accepted.note
