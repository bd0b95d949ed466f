"""Signing keys per node: trusted public keys, rotation and revocation, and what gc, verify
and the migration board's records make of a signer this node does not trust."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusnap.errors import FailedPrecondition, InvalidArgument, NotFound
from gpusnap.storage import (
    CheckpointStore,
    UntrustedSigner,
    export_public_key,
    generate_signing_key,
    open_store,
    public_key_path,
)
from gpusnap.storage.keys import load_signing_key
from gpusnap.storage.layout import MIGRATION_PREFIX
from tests.storage.store_helpers import random_bytes, tree_contents, write_src

CID = "20261130T083000Z-0123456789"


def _node_key(directory: Path, name: str) -> Path:
    """A node's key as ``gpusnap store keygen`` leaves it: ``name`` and ``name.pub``."""
    directory.mkdir(parents=True, exist_ok=True)
    key = directory / name
    generate_signing_key(key)
    export_public_key(key, public_key_path(key))
    return key


def _open(
    tmp_path: Path,
    key: Path | None,
    *,
    trusted: list[Path] | None = None,
    cache: str = "cache",
    verify: bool = True,
) -> CheckpointStore:
    return open_store(
        f"file://{tmp_path / 'store'}",
        key_file=key,
        trusted_keys=trusted or [],
        cache_dir=tmp_path / cache,
        workers=2,
        verify=verify,
    )


def _src(root: Path, seed: int) -> Path:
    return write_src(root, {"pages.img": random_bytes(3 * 1024 * 1024, seed)})


def test_a_node_restores_what_a_trusted_peer_signed_and_refuses_a_stranger(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    a, b, stranger = (_node_key(keys, n) for n in ("a.key", "b.key", "stranger.key"))
    src_b, src_s = _src(tmp_path / "src-b", 1), _src(tmp_path / "src-s", 2)
    with _open(tmp_path, b, cache="cache-b") as node_b:
        from_b = node_b.push(src_b, workload="w").checkpoint_id
    with _open(tmp_path, stranger, cache="cache-s") as node_s:
        from_stranger = node_s.push(src_s, workload="w").checkpoint_id
    with _open(tmp_path, a, trusted=[public_key_path(b)]) as node_a:
        node_a.pull(from_b, tmp_path / "dest")
        assert tree_contents(tmp_path / "dest") == tree_contents(src_b)
        stranger_id = load_signing_key(stranger).key_id
        with pytest.raises(UntrustedSigner, match=stranger_id) as refused:
            node_a.pull(from_stranger, tmp_path / "dest-2")
        assert refused.value.key_id == stranger_id
        assert not (tmp_path / "dest-2").exists()
        listed, skipped = node_a.list_checked()
        assert [s.checkpoint_id for s in listed] == [from_b]
        assert [type(e) for _k, e in skipped] == [UntrustedSigner]


def test_rotation_old_checkpoints_restore_while_the_retired_key_is_trusted_then_are_refused(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    old, new = _node_key(keys, "2025.key"), _node_key(keys, "2026.key")
    old_src, new_src = _src(tmp_path / "old", 3), _src(tmp_path / "new", 4)
    with _open(tmp_path, old) as node:
        before = node.push(old_src, workload="w").checkpoint_id
    # The node rotates: it signs with the new key and keeps trusting the retired one.
    with _open(tmp_path, new, trusted=[public_key_path(old)]) as node:
        after = node.push(new_src, workload="w", parent=before).checkpoint_id
        node.pull(before, tmp_path / "dest-before")
        assert tree_contents(tmp_path / "dest-before") == tree_contents(old_src)
        assert node.verify().ok
    # The retired key is removed from the trusted keys: what it signed is refused.
    with _open(tmp_path, new) as node:
        with pytest.raises(UntrustedSigner, match=load_signing_key(old).key_id):
            node.pull(before, tmp_path / "dest-refused")
        node.pull(after, tmp_path / "dest-after")
        assert tree_contents(tmp_path / "dest-after") == tree_contents(new_src)
        report = node.verify()
        assert not report.ok and len(report.manifests_bad) == 1
        assert load_signing_key(old).key_id in report.manifests_bad[0]


def test_gc_keeps_the_chunks_of_checkpoints_whose_signer_it_does_not_trust(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    a, b = _node_key(keys, "a.key"), _node_key(keys, "b.key")
    with _open(tmp_path, b, cache="cache-b") as node_b:
        theirs = node_b.push(_src(tmp_path / "b1", 5), workload="w").checkpoint_id
        node_b.push(_src(tmp_path / "b2", 6), workload="w")
    with _open(tmp_path, a) as node_a:
        mine = node_a.push(_src(tmp_path / "a1", 7), workload="w").checkpoint_id
        report = node_a.gc(keep_last=1, grace_seconds=0)
        assert report.chunks_deleted == 0 and report.manifests_deleted == []
        assert len(report.untrusted) == 2 and not report.problems
    with _open(tmp_path, b, cache="cache-b", trusted=[public_key_path(a)]) as node_b:
        assert node_b.verify().ok  # b's checkpoints lost nothing to a's gc
        assert node_b.manifest(theirs).checkpoint_id == theirs
        assert node_b.manifest(mine).checkpoint_id == mine


def test_records_signed_by_a_trusted_peer_are_accepted_and_a_strangers_refused(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    a, b, stranger = (_node_key(keys, n) for n in ("a.key", "b.key", "s.key"))
    with _open(tmp_path, b, cache="cache-b") as node_b:
        node_b.records(MIGRATION_PREFIX).create(f"{CID}/claim-b", {"node": "b"})
    with _open(tmp_path, stranger, cache="cache-s") as node_s:
        node_s.records(MIGRATION_PREFIX).create(f"{CID}/claim-s", {"node": "s"})
    with _open(tmp_path, a, trusted=[keys]) as node_a:  # a directory of .pub files
        records = node_a.records(MIGRATION_PREFIX)
        assert records.read(f"{CID}/claim-b") == {"node": "b"}
    with _open(tmp_path, a, trusted=[public_key_path(b)]) as node_a:
        with pytest.raises(UntrustedSigner):
            node_a.records(MIGRATION_PREFIX).read(f"{CID}/claim-s")


def test_a_directory_of_public_keys_is_read_and_a_private_key_in_it_is_refused(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    b = _node_key(keys, "b.key")  # b.key (private) sits beside b.key.pub: not a *.pub
    with _open(tmp_path, _node_key(tmp_path / "own", "a.key"), trusted=[keys]) as node:
        assert load_signing_key(b).key_id in node.context.keys.trusted_ids
    with pytest.raises(InvalidArgument, match="private key"):
        _open(tmp_path, None, trusted=[b], verify=False)
    with pytest.raises(NotFound):
        _open(tmp_path, None, trusted=[keys / "absent.pub"], verify=False)


def test_a_verify_only_node_with_trusted_keys_alone_verifies_but_cannot_push(
    tmp_path: Path,
) -> None:
    key = _node_key(tmp_path / "keys", "a.key")
    src = _src(tmp_path / "src", 8)
    with _open(tmp_path, key) as node:
        pushed = node.push(src, workload="w").checkpoint_id
    with _open(tmp_path, None, trusted=[public_key_path(key)], cache="c-ro") as reader:
        assert reader.verify([pushed]).ok
        reader.pull(pushed, tmp_path / "dest")
        with pytest.raises(FailedPrecondition, match="signing key"):
            reader.push(src, workload="w")
