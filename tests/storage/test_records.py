"""Signed records: written once, read back authenticated, listed by prefix, deleted.

On a directory and on S3 (moto over HTTP); what another part (the migration board) writes
with ``CheckpointStore.sign`` and what the records API writes are the same objects.
"""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

import pytest

from gpusnap.errors import AlreadyExists, Corrupt, FailedPrecondition, InvalidArgument, NotFound
from gpusnap.storage import MIGRATION_PREFIX, CheckpointStore, SignedRecords
from gpusnap.storage.keys import seal
from gpusnap.storage.manifest import ENVELOPE_FORMAT
from gpusnap.storage.records import RECORD_FORMAT
from tests.storage.store_helpers import Keys, file_store, make_keys

CID = "20261130T083000Z-0123456789"
REQUEST = {"format": "gpusnap.migration.request/1", "checkpoint_id": CID, "workload": "w"}


@pytest.fixture
def records(checkpoint_store: CheckpointStore) -> SignedRecords:
    return checkpoint_store.records(MIGRATION_PREFIX)


def test_a_record_reads_back_as_written(records: SignedRecords) -> None:
    records.create(f"{CID}/request", REQUEST)
    assert records.read(f"{CID}/request") == REQUEST
    assert records.key(f"{CID}/request") == f"migrations/{CID}/request"


def test_a_record_is_written_once(records: SignedRecords) -> None:
    records.create(f"{CID}/claim-0000", {"node_id": "a"})
    with pytest.raises(AlreadyExists):
        records.create(f"{CID}/claim-0000", {"node_id": "b"})
    assert records.read(f"{CID}/claim-0000") == {"node_id": "a"}


def test_of_writers_racing_for_one_name_exactly_one_wins(records: SignedRecords) -> None:
    start = threading.Barrier(6)
    won: list[str] = []
    lost: list[str] = []

    def claim(node: str) -> None:
        start.wait(timeout=60)
        try:
            records.create(f"{CID}/claim-0001", {"node_id": node})
            won.append(node)
        except AlreadyExists:
            lost.append(node)

    threads = [threading.Thread(target=claim, args=(f"n{i}",)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(won) == 1 and len(lost) == 5
    assert records.read(f"{CID}/claim-0001") == {"node_id": won[0]}


def test_names_lists_the_records_under_the_prefix_in_key_order(
    records: SignedRecords, checkpoint_store: CheckpointStore
) -> None:
    other = "20261130T090000Z-abcdefabcd"
    for name in (f"{other}/request", f"{CID}/outcome", f"{CID}/request"):
        records.create(name, {"n": name})
    checkpoint_store.backend.put("elsewhere/x", b"not under the prefix")
    assert records.names() == [f"{CID}/outcome", f"{CID}/request", f"{other}/request"]
    assert records.names(f"{other}/") == [f"{other}/request"]


def test_a_deleted_record_is_gone_and_deleting_it_again_is_no_error(
    records: SignedRecords,
) -> None:
    records.create(f"{CID}/outcome", {"state": "failed"})
    records.delete(f"{CID}/outcome")
    records.delete(f"{CID}/outcome")
    with pytest.raises(NotFound):
        records.read(f"{CID}/outcome")
    assert records.names() == []
    records.create(f"{CID}/outcome", {"state": "succeeded"})  # the name is free again
    assert records.read(f"{CID}/outcome") == {"state": "succeeded"}


def test_records_made_by_sign_and_by_the_api_are_the_same_objects(
    records: SignedRecords, checkpoint_store: CheckpointStore
) -> None:
    """What ``sign`` + ``backend.put`` wrote (the board today) reads through the API, and what
    the API writes opens with ``open_signed``: no store-format change between them."""
    doc = {"format": "gpusnap.migration.claim/1", "attempt": 0, "nonce": "ab12"}
    payload = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    checkpoint_store.backend.put(
        f"migrations/{CID}/claim-0000", checkpoint_store.sign(payload), if_absent=True
    )
    assert records.read(f"{CID}/claim-0000") == doc
    records.create(f"{CID}/request", REQUEST)
    blob = checkpoint_store.backend.get(f"migrations/{CID}/request")
    assert json.loads(checkpoint_store.open_signed(blob)) == REQUEST
    assert json.loads(blob)["format"] == RECORD_FORMAT


def test_a_record_planted_without_the_key_is_refused(
    records: SignedRecords, checkpoint_store: CheckpointStore, tmp_path: Path
) -> None:
    backend = checkpoint_store.backend
    backend.put(f"migrations/{CID}/garbage", b"garbage from someone without the key")
    unsigned = seal(RECORD_FORMAT, json.dumps(REQUEST).encode(), signer=None, encryption=None)
    backend.put(f"migrations/{CID}/unsigned", unsigned)
    with file_store(tmp_path, make_keys(tmp_path / "k2"), name="other", cache="c2") as other:
        backend.put(f"migrations/{CID}/foreign", other.sign(json.dumps(REQUEST).encode()))
    for name, why in (
        ("garbage", "not a readable"),
        ("unsigned", "is not signed"),
        ("foreign", "which this node does not trust"),
    ):
        with pytest.raises(Corrupt, match=why):
            records.read(f"{CID}/{name}")


def test_a_manifest_envelope_does_not_pass_as_a_record(
    records: SignedRecords, checkpoint_store: CheckpointStore
) -> None:
    signer = checkpoint_store.context.keys.signer
    envelope = seal(ENVELOPE_FORMAT, json.dumps(REQUEST).encode(), signer=signer, encryption=None)
    checkpoint_store.backend.put(f"migrations/{CID}/request", envelope)
    with pytest.raises(Corrupt, match=r"not a gpusnap\.record/1 envelope"):
        records.read(f"{CID}/request")


def test_an_altered_record_fails_its_signature(
    records: SignedRecords, checkpoint_store: CheckpointStore
) -> None:
    records.create(f"{CID}/request", REQUEST)
    key = records.key(f"{CID}/request")
    envelope = json.loads(checkpoint_store.backend.get(key))
    payload = base64.b64decode(envelope["payload"]).replace(b'"w"', b'"x"')
    envelope["payload"] = base64.b64encode(payload).decode()
    checkpoint_store.backend.put(key, json.dumps(envelope).encode())
    with pytest.raises(Corrupt, match="failed its signature check"):
        records.read(f"{CID}/request")


@pytest.mark.parametrize(("payload", "why"), [(b"[1, 2]", "not a JSON object"), (b"{", "not JSON")])
def test_a_signed_payload_that_is_no_json_object_is_refused(
    records: SignedRecords, checkpoint_store: CheckpointStore, payload: bytes, why: str
) -> None:
    checkpoint_store.backend.put(f"migrations/{CID}/odd", checkpoint_store.sign(payload))
    with pytest.raises(Corrupt, match=why):
        records.read(f"{CID}/odd")


def test_an_encrypted_store_keeps_its_records_secret(tmp_path: Path, keys: Keys) -> None:
    with file_store(tmp_path, keys, encrypted=True) as store:
        records = store.records(MIGRATION_PREFIX)
        records.create(f"{CID}/request", {"secret": "the workload's prompt"})
        assert b"prompt" not in store.backend.get(records.key(f"{CID}/request"))
        assert records.read(f"{CID}/request") == {"secret": "the workload's prompt"}
    with file_store(tmp_path, keys, encrypted=False) as without_key:
        with pytest.raises(FailedPrecondition, match="encryption key"):
            without_key.records(MIGRATION_PREFIX).read(f"{CID}/request")


def test_a_store_without_a_signing_key_neither_writes_nor_trusts_records(
    tmp_path: Path, keys: Keys
) -> None:
    with file_store(tmp_path, keys) as signed:
        signed.records(MIGRATION_PREFIX).create(f"{CID}/request", REQUEST)
    with file_store(tmp_path, None, verify=False) as keyless:
        records = keyless.records(MIGRATION_PREFIX)
        with pytest.raises(FailedPrecondition, match="signing key"):
            records.create(f"{CID}/outcome", {"state": "failed"})
        # Records are always verified, even where manifests are not.
        with pytest.raises(FailedPrecondition, match="no signing key"):
            records.read(f"{CID}/request")


@pytest.mark.parametrize(
    "prefix", ["chunks/", "manifests/w/", "locks/", "", "/", "migrations", "../x/", "a//"]
)
def test_records_may_not_live_among_the_stores_own_keys_or_off_the_key_space(
    checkpoint_store: CheckpointStore, prefix: str
) -> None:
    with pytest.raises(InvalidArgument):
        checkpoint_store.records(prefix)


@pytest.mark.parametrize("name", ["", "../x", "a//b", "a/", "a\nb"])
def test_a_record_name_that_makes_no_valid_key_is_refused(
    records: SignedRecords, name: str
) -> None:
    with pytest.raises(InvalidArgument):
        records.create(name, {})
    with pytest.raises(InvalidArgument):
        records.read(name)
