"""What a store's contents can and cannot do to a reader: tampering, paths, keys, encryption."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from blake3 import blake3

from gpusnap.errors import Corrupt, FailedPrecondition
from gpusnap.storage import CheckpointStore, ChunkRef
from gpusnap.storage.keys import load_signing_key, seal
from gpusnap.storage.layout import CHUNK_PREFIX, MANIFEST_PREFIX, chunk_key
from gpusnap.storage.manifest import ENVELOPE_FORMAT
from tests.storage.store_helpers import (
    Keys,
    MiB,
    all_files,
    file_store,
    make_keys,
    make_tree,
    push_tree,
    random_bytes,
    tree_contents,
)


@pytest.fixture
def store(tmp_path: Path, keys: Keys) -> Iterator[CheckpointStore]:
    opened = file_store(tmp_path, keys)
    try:
        yield opened
    finally:
        opened.close()


def store_path(tmp_path: Path, key: str, name: str = "store") -> Path:
    return tmp_path / name / key


def manifest_key(store: CheckpointStore, checkpoint_id: str) -> str:
    return next(i.key for i in store.backend.list(MANIFEST_PREFIX) if i.key.endswith(checkpoint_id))


def test_flipped_byte_in_a_chunk_is_refused_on_pull_and_found_by_read_data(
    store: CheckpointStore, tmp_path: Path
) -> None:
    pushed = push_tree(store, tmp_path)
    manifest = store.manifest(pushed.checkpoint_id)
    victim = max((c for f in manifest.files for c in f.chunks), key=lambda c: c.size)
    path = store_path(tmp_path, chunk_key(victim.id))
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))

    dest = tmp_path / "dest"
    with pytest.raises(Corrupt, match=victim.id):
        store.pull(pushed.checkpoint_id, dest)
    assert all_files(dest) == []

    assert store.verify().ok  # presence only: the object is there
    report = store.verify(read_data=True)
    assert not report.ok
    assert len(report.chunks_corrupt) == 1 and victim.id in report.chunks_corrupt[0]


def test_missing_chunk_is_reported_by_verify_and_refused_by_pull(
    store: CheckpointStore, tmp_path: Path
) -> None:
    pushed = push_tree(store, tmp_path)
    victim = store.manifest(pushed.checkpoint_id).files[-1].chunks[0]
    store.backend.delete(chunk_key(victim.id))
    report = store.verify([pushed.checkpoint_id])
    assert [m.split()[0] for m in report.chunks_missing] == [victim.id]
    with pytest.raises(Corrupt, match="missing"):
        store.pull(pushed.checkpoint_id, tmp_path / "dest")
    assert all_files(tmp_path / "dest") == []


def test_edited_manifest_is_refused(store: CheckpointStore, tmp_path: Path) -> None:
    pushed = push_tree(store, tmp_path)
    key = manifest_key(store, pushed.checkpoint_id)
    envelope = json.loads(store.backend.get(key))
    payload = json.loads(base64.b64decode(envelope["payload"]))
    payload["files"][0]["mode"] = 0o777
    envelope["payload"] = base64.b64encode(json.dumps(payload).encode()).decode()
    store_path(tmp_path, key).write_bytes(json.dumps(envelope).encode())
    with pytest.raises(Corrupt, match="signature"):
        store.manifest(pushed.checkpoint_id)
    with pytest.raises(Corrupt):
        store.pull(pushed.checkpoint_id, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
    assert pushed.checkpoint_id in store.verify().manifests_bad[0]


def test_manifest_moved_to_another_id_is_refused(store: CheckpointStore, tmp_path: Path) -> None:
    pushed = push_tree(store, tmp_path)
    blob = store.backend.get(manifest_key(store, pushed.checkpoint_id))
    store.backend.put(f"{MANIFEST_PREFIX}w/20990101T000000Z-0123456789", blob)
    with pytest.raises(Corrupt, match="describes"):
        store.manifest("20990101T000000Z-0123456789")


@pytest.mark.parametrize(
    "evil", ["../escaped", "/etc/gpusnap-evil", "a/../../escaped", "a//b", "./a"]
)
def test_manifest_with_an_escaping_path_is_refused_and_nothing_is_written(
    store: CheckpointStore, tmp_path: Path, keys: Keys, evil: str
) -> None:
    pushed = push_tree(store, tmp_path)
    key = manifest_key(store, pushed.checkpoint_id)
    payload = json.loads(store.manifest(pushed.checkpoint_id).to_json())
    payload["files"][-1]["path"] = evil  # keep the good files first: none may be written
    resigned = seal(
        ENVELOPE_FORMAT,
        json.dumps(payload).encode(),
        signer=load_signing_key(keys.signing),
        encryption=None,
    )
    store_path(tmp_path, key).write_bytes(resigned)
    dest = tmp_path / "work" / "dest"
    with pytest.raises(Corrupt):
        store.pull(pushed.checkpoint_id, dest)
    assert all_files(tmp_path / "work") == []
    assert not (tmp_path / "work" / "escaped").exists()
    assert not Path("/etc/gpusnap-evil").exists()


def test_symlink_in_the_destination_cannot_redirect_writes(
    store: CheckpointStore, tmp_path: Path
) -> None:
    pushed = push_tree(store, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(outside, dest / "pages")
    with pytest.raises(Corrupt, match="symlink"):
        store.pull(pushed.checkpoint_id, dest)
    assert all_files(outside) == []
    assert all_files(dest) == [dest / "pages"]


def test_unsigned_manifest_is_refused_unless_verification_is_off(
    tmp_path: Path, keys: Keys
) -> None:
    src = make_tree(tmp_path / "src")
    unsigned_writer = file_store(tmp_path, None, verify=False, cache="c1")
    pushed = unsigned_writer.push(src, workload="w")
    unsigned_writer.close()
    checking = file_store(tmp_path, keys, cache="c2")
    try:
        with pytest.raises(Corrupt, match="not signed"):
            checking.manifest(pushed.checkpoint_id)
        with pytest.raises(Corrupt):
            checking.pull(pushed.checkpoint_id, tmp_path / "d1")
        assert checking.list() == []
    finally:
        checking.close()
    trusting = file_store(tmp_path, keys, cache="c3", verify=False)
    try:
        trusting.pull(pushed.checkpoint_id, tmp_path / "d2")
        assert tree_contents(tmp_path / "d2").keys() == tree_contents(src).keys()
    finally:
        trusting.close()


def test_manifest_signed_by_another_key_is_refused(tmp_path: Path, keys: Keys) -> None:
    src = make_tree(tmp_path / "src")
    writer = file_store(tmp_path, keys, cache="c1")
    pushed = writer.push(src, workload="w")
    writer.close()
    stranger = file_store(tmp_path, make_keys(tmp_path / "other-keys"), cache="c2")
    try:
        with pytest.raises(Corrupt, match="key"):
            stranger.manifest(pushed.checkpoint_id)
    finally:
        stranger.close()


def test_encryption_hides_contents_and_names(tmp_path: Path, keys: Keys) -> None:
    src = tmp_path / "src"
    src.mkdir()
    secret = random_bytes(3 * MiB, seed=21)
    (src / "kv.img").write_bytes(secret)
    store = file_store(tmp_path, keys, encrypted=True)
    try:
        pushed = store.push(
            src, workload="w", stamp={"env": {"API_TOKEN": "hunter2-very-secret"}}, compress=False
        )
        manifest = store.manifest(pushed.checkpoint_id)
        assert manifest.stamp["env"]["API_TOKEN"] == "hunter2-very-secret"
        objects = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
        chunk_objects = [p for p in objects if CHUNK_PREFIX in p.as_posix() + "/"]
        assert chunk_objects
        probes = [secret[i : i + 64] for i in range(0, len(secret), 512 * 1024)]
        for path in objects:
            blob = path.read_bytes()
            assert b"hunter2-very-secret" not in blob
            assert not any(probe in blob for probe in probes), path
        plain_ids = {
            blake3(memoryview(secret)[o : o + c.size]).hexdigest()
            for o, c in _offsets(manifest.files[0].chunks)
        }
        stored_ids = {p.name for p in chunk_objects}
        assert stored_ids == {c.id for c in manifest.files[0].chunks}
        assert not plain_ids & stored_ids
        store.pull(pushed.checkpoint_id, tmp_path / "dest")
        assert (tmp_path / "dest" / "kv.img").read_bytes() == secret
    finally:
        store.close()
    keyless = file_store(tmp_path, keys, cache="c-keyless")
    try:
        with pytest.raises(FailedPrecondition, match="encrypt"):
            keyless.manifest(pushed.checkpoint_id)
    finally:
        keyless.close()


def _offsets(chunks: list[ChunkRef]) -> list[tuple[int, ChunkRef]]:
    out: list[tuple[int, ChunkRef]] = []
    offset = 0
    for chunk in chunks:
        out.append((offset, chunk))
        offset += chunk.size
    return out


def test_encrypted_chunk_swapped_for_another_is_refused(tmp_path: Path, keys: Keys) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.img").write_bytes(random_bytes(2 * MiB, seed=31))
    (src / "b.img").write_bytes(random_bytes(2 * MiB, seed=32))
    store = file_store(tmp_path, keys, encrypted=True)
    try:
        pushed = store.push(src, workload="w")
        files = store.manifest(pushed.checkpoint_id).files
        a, b = files[0].chunks[0].id, files[1].chunks[0].id
        store_path(tmp_path, chunk_key(a)).write_bytes(
            store_path(tmp_path, chunk_key(b)).read_bytes()
        )
        with pytest.raises(Corrupt, match=a):
            store.pull(pushed.checkpoint_id, tmp_path / "dest")
        assert all_files(tmp_path / "dest") == []
    finally:
        store.close()
