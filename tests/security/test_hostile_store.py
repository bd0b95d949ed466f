"""What anyone who can write to the store -- without a key -- can put there, and what it must
not do to a reader: crash it, hang it, make it read without bound, or hide a real checkpoint.

Each object is written straight into the store (a file, or a PUT to the moto server), as a
store writer without a key would; everything is read back through the real store code.
"""

from __future__ import annotations

import os
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpusnap.errors import Corrupt, GpusnapError
from gpusnap.storage import CheckpointStore, open_store
from gpusnap.storage.context import StoreOptions
from gpusnap.storage.layout import CONFIG_KEY, chunk_key, manifest_key
from gpusnap.storage.locks import sync_index_if_gc_ran
from tests.storage.store_helpers import (
    Keys,
    MiB,
    StoreUnderTest,
    fast_options,
    file_store,
    make_tree,
    push_tree,
)

# The documented limit on the store config (docs/design.md, "Size limits").
MAX_CONFIG_BYTES = 64 * 1024
NESTED = b"[" * 200_000 + b"]" * 200_000
NESTED_ENVELOPE = b'{"format":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
SURROGATE_ENVELOPE = (
    b'{"format":"gpusnap.manifest/1","encryption":"none","payload":"","signature":"AA==",'
    b'"key_id":"\\ud800"}'
)
HUGE_NUMBER = b'{"format_version":1' + b"0" * 4000 + b"}"
HOSTILE_ENVELOPES = {
    "nested": NESTED,
    "nested-in-an-object": NESTED_ENVELOPE,
    "lone-surrogate": SURROGATE_ENVELOPE,
    "huge-number": HUGE_NUMBER,
    "nan": b'{"format":NaN}',
    "not-utf8": b'{"format":"\xff"}',
    "wrong-types": b'{"format":"gpusnap.manifest/1","encryption":[],"payload":7}',
}


@pytest.fixture
def pushed(tmp_path: Path, keys: Keys) -> Iterator[tuple[CheckpointStore, str]]:
    """A file:// store holding one signed checkpoint of workload ``w``."""
    store = file_store(tmp_path, keys)
    try:
        yield store, push_tree(store, tmp_path).checkpoint_id
    finally:
        store.close()


def _object_path(tmp_path: Path, key: str) -> Path:
    return tmp_path / "store" / key


@pytest.mark.parametrize("blob", HOSTILE_ENVELOPES.values(), ids=HOSTILE_ENVELOPES.keys())
def test_a_hostile_manifest_envelope_is_an_integrity_error_naming_it(
    pushed: tuple[CheckpointStore, str], tmp_path: Path, blob: bytes
) -> None:
    store, cid = pushed
    _object_path(tmp_path, manifest_key("w", cid)).write_bytes(blob)
    with pytest.raises(Corrupt, match=f"manifest {cid}"):
        store.manifest(cid)
    listed, left_out = store.list_checked()
    assert listed == []
    assert [key for key, _ in left_out] == [manifest_key("w", cid)]
    assert all(isinstance(err, Corrupt) for _, err in left_out)


@pytest.mark.parametrize("blob", HOSTILE_ENVELOPES.values(), ids=HOSTILE_ENVELOPES.keys())
def test_a_hostile_store_config_is_not_used_and_the_store_still_opens(
    pushed: tuple[CheckpointStore, str], tmp_path: Path, keys: Keys, blob: bytes
) -> None:
    _store, cid = pushed
    _object_path(tmp_path, CONFIG_KEY).write_bytes(blob)
    reopened = file_store(tmp_path, keys, cache="cache2")
    try:
        assert isinstance(reopened.context.identity.problem, Corrupt)
        assert reopened.manifest(cid).checkpoint_id == cid
    finally:
        reopened.close()


def test_an_untrusted_key_id_with_terminal_escapes_is_printed_escaped(
    pushed: tuple[CheckpointStore, str], tmp_path: Path
) -> None:
    store, cid = pushed
    _object_path(tmp_path, manifest_key("w", cid)).write_bytes(
        b'{"format":"gpusnap.manifest/1","encryption":"none","payload":"","signature":"AA==",'
        b'"key_id":"\\u001b]0;owned\\u0007\\u001b[2J"}'
    )
    with pytest.raises(Corrupt) as caught:
        store.manifest(cid)
    message = str(caught.value)
    assert "\x1b" not in message and "\x07" not in message
    assert "\\x1b]0;owned\\x07" in message


def _store_url_and_writer(store: StoreUnderTest) -> tuple[str, Callable[[str, bytes], None]]:
    if store.root is not None:
        root = store.root

        def write_file(key: str, data: bytes) -> None:
            (root / key).parent.mkdir(parents=True, exist_ok=True)
            (root / key).write_bytes(data)

        return f"file://{root}", write_file
    assert store.moto is not None and store.bucket is not None
    client = store.moto.client()
    bucket, prefix = store.bucket, store.prefix

    def put_object(key: str, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key=prefix + key, Body=data)

    return f"s3://{bucket}/{prefix.rstrip('/')}", put_object


def test_a_store_config_over_its_limit_is_refused_unread(
    store: StoreUnderTest, tmp_path: Path, keys: Keys
) -> None:
    url, write = _store_url_and_writer(store)
    # Over the limit by a little, so the S3 case stays cheap; "unread" is the file case below.
    write(CONFIG_KEY, b"{" + b" " * (MAX_CONFIG_BYTES + 10) + b"}")
    opened = open_store(
        url,
        key_file=keys.signing,
        options=fast_options(store.moto.endpoint_url if store.moto else None),
        cache_dir=tmp_path / "cache",
    )
    try:
        problem = opened.context.identity.problem
        assert isinstance(problem, Corrupt) and "larger than" in str(problem)
    finally:
        opened.close()


def _peak_while(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_huge_sparse_config_costs_no_memory_to_refuse(tmp_path: Path, keys: Keys) -> None:
    root = tmp_path / "store"
    root.mkdir()
    with open(root / CONFIG_KEY, "wb") as fh:
        fh.truncate(512 * MiB)  # sparse: costs the disk nothing, a whole read 512 MiB
    found: list[GpusnapError | None] = []

    def open_it() -> None:
        opened = file_store(tmp_path, keys)
        found.append(opened.context.identity.problem)
        opened.close()

    peak = _peak_while(open_it)
    assert isinstance(found[0], Corrupt)
    assert peak < 16 * MiB, peak


def test_a_huge_chunk_object_is_refused_without_reading_it(
    pushed: tuple[CheckpointStore, str], tmp_path: Path
) -> None:
    store, cid = pushed
    chunk = store.manifest(cid).files[0].chunks[0]
    path = _object_path(tmp_path, chunk_key(chunk.id))
    path.unlink()
    with open(path, "wb") as fh:
        fh.truncate(256 * MiB)
    errors: list[Exception] = []

    def pull() -> None:
        try:
            store.pull(cid, tmp_path / "out")
        except Corrupt as exc:
            errors.append(exc)

    peak = _peak_while(pull)
    assert errors and "larger than" in str(errors[0]), errors
    assert peak < 128 * MiB, peak


def _within_guard(fn: Callable[[], Any], unblock: Callable[[], None]) -> BaseException | None:
    """Run ``fn`` on a thread; if it is still blocked after a generous guard, ``unblock`` it
    (so the test ends) and fail. Returns what ``fn`` raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():
        unblock()
        thread.join(60)
        pytest.fail("a read of a FIFO in the store blocked")
    return raised[0] if raised else None


def _open_fifo_writer(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    os.close(fd)


def test_a_fifo_at_the_config_key_is_an_unused_config_not_a_hang(
    pushed: tuple[CheckpointStore, str], tmp_path: Path, keys: Keys
) -> None:
    config = _object_path(tmp_path, CONFIG_KEY)
    config.unlink()
    os.mkfifo(config)
    found: list[GpusnapError | None] = []

    def open_it() -> None:
        opened = file_store(tmp_path, keys, cache="cache2")
        found.append(opened.context.identity.problem)
        opened.close()

    assert _within_guard(open_it, lambda: _open_fifo_writer(config)) is None
    assert isinstance(found[0], Corrupt) and "not a regular file" in str(found[0])


def test_a_fifo_at_a_chunk_key_is_an_integrity_error_not_a_hang(
    pushed: tuple[CheckpointStore, str], tmp_path: Path
) -> None:
    store, cid = pushed
    chunk = store.manifest(cid).files[0].chunks[0]
    path = _object_path(tmp_path, chunk_key(chunk.id))
    path.unlink()
    os.mkfifo(path)
    raised = _within_guard(
        lambda: store.pull(cid, tmp_path / "out"), lambda: _open_fifo_writer(path)
    )
    assert isinstance(raised, Corrupt), raised
    assert "not a regular file" in str(raised)
    report = store.verify([cid], read_data=True)
    assert not report.ok


GC_RECORDS = {
    "garbage": b"\x00not json",
    "nested": b'{"started_at":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "huge-number": b'{"started_at":1' + b"0" * 4000 + b"}",
    "huge-float": b'{"started_at":1e999}',
    "list": b"[1, 2]",
}


@pytest.mark.parametrize("record", GC_RECORDS.values(), ids=GC_RECORDS.keys())
def test_an_unreadable_gc_record_holds_no_push_waiting(
    pushed: tuple[CheckpointStore, str], tmp_path: Path, record: bytes
) -> None:
    store, _cid = pushed
    path = _object_path(tmp_path, "locks/gc-junk")
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(record)
    # A short stale time: a reader that took the record for a running gc would wait this
    # long and then fail the push (15 minutes in production).
    ctx = replace(store.context, options=StoreOptions(lock_stale_seconds=1.0))
    assert sync_index_if_gc_ran(ctx, wait_for_running=True) is True  # rebuilt, not waited
    # And a whole push goes through.
    assert store.push(make_tree(tmp_path / "src2", seed=5), workload="w").checkpoint_id


def test_a_junk_object_under_another_workload_never_shadows_the_checkpoint(
    pushed: tuple[CheckpointStore, str], tmp_path: Path
) -> None:
    store, cid = pushed
    junk = _object_path(tmp_path, manifest_key("a", cid))
    junk.parent.mkdir()
    junk.write_bytes(b"junk")
    assert store.manifest(cid).workload == "w"
    result = store.pull(cid, tmp_path / "out")
    assert result.checkpoint_id == cid
    # verify by id reports the junk object beside the real one.
    report = store.verify([cid])
    assert len(report.manifests_bad) == 1, report.manifests_bad
