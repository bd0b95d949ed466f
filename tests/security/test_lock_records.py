"""gc records (``locks/gc-*``) are signed: only an authentic one can hold a push waiting, and no
wait outlives the job's deadline.

The records are written straight into a ``file://`` store, as a store writer without the
node's key would (or, for authentic ones, by the real gc code), and read back through the
real push path (``sync_index_if_gc_ran``, ``CheckpointStore.push``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpusnap.errors import DeadlineExceeded, exit_code_for
from gpusnap.storage import CheckpointStore
from gpusnap.storage.context import StoreContext, StoreOptions
from gpusnap.storage.keys import generate_signing_key, load_signing_key, seal
from gpusnap.storage.locks import GC_RECORD_FORMAT, GcRecord, gc_runs, sync_index_if_gc_ran
from tests.storage.store_helpers import Keys, fast_options, file_store, make_tree, push_tree
from tests.support.faultproxy import FaultProxy


@pytest.fixture
def pushed(tmp_path: Path, keys: Keys) -> Iterator[CheckpointStore]:
    """A file:// store holding one signed checkpoint of workload ``w``."""
    store = file_store(tmp_path, keys)
    try:
        push_tree(store, tmp_path)
        yield store
    finally:
        store.close()


def _running_claim() -> bytes:
    """What a gc running right now says of itself."""
    now = time.time()
    body = {"host": "h", "pid": 1, "started_at": now, "finished_at": None, "swept": True}
    return json.dumps({**body, "refreshed_at": now}).encode()


def _stranger_signed(tmp_path: Path) -> bytes:
    stranger = tmp_path / "stranger.pem"
    generate_signing_key(stranger)
    return seal(
        GC_RECORD_FORMAT, _running_claim(), signer=load_signing_key(stranger), encryption=None
    )


FORGERIES = {
    # An older gpusnap's record, or anyone's: plain JSON, well formed, unsigned.
    "plain-json": lambda _tmp: _running_claim(),
    "unsigned-envelope": lambda _tmp: seal(
        GC_RECORD_FORMAT, _running_claim(), signer=None, encryption=None
    ),
    "signed-by-a-stranger": _stranger_signed,
}


@pytest.mark.parametrize("forge", FORGERIES.values(), ids=FORGERIES.keys())
def test_a_forged_gc_record_claiming_a_running_gc_holds_no_push(
    pushed: CheckpointStore, tmp_path: Path, forge: object
) -> None:
    record = tmp_path / "store" / "locks" / "gc-forged"
    record.parent.mkdir(exist_ok=True)
    record.write_bytes(forge(tmp_path))  # type: ignore[operator]
    # A short stale time: a reader that believed the record would wait this long, then fail
    # the push (15 minutes in production).
    ctx = replace(pushed.context, options=StoreOptions(lock_stale_seconds=1.0))
    assert sync_index_if_gc_ran(ctx, wait_for_running=True) is True  # rebuilt, not waited
    # Judged by its age alone: a gc that swept and finished when the object was written.
    [run] = gc_runs(ctx)
    mtime = record.stat().st_mtime
    assert (run.started_at, run.finished_at, run.swept) == (mtime, mtime, True)
    assert pushed.push(make_tree(tmp_path / "src2", seed=5), workload="w").checkpoint_id


def _running_gc(ctx: StoreContext) -> GcRecord:
    record = GcRecord(ctx, time.time())
    record.start()
    record.mark_swept()
    return record


def test_a_gc_record_the_node_signed_is_believed(pushed: CheckpointStore, tmp_path: Path) -> None:
    ctx = pushed.context
    record = _running_gc(ctx)
    try:
        stored = (tmp_path / "store" / record.key).read_bytes()
        assert json.loads(stored)["format"] == GC_RECORD_FORMAT
        assert json.loads(stored)["signature"]
        [run] = gc_runs(ctx)
        assert run.finished_at is None and run.swept
    finally:
        record.finish()
    [run] = gc_runs(ctx)
    assert run.finished_at is not None


def test_a_replayed_signed_record_of_a_long_gone_gc_holds_no_push(
    pushed: CheckpointStore, tmp_path: Path
) -> None:
    """A genuine "running" record copied back under a fresh mtime is as old as it says."""
    ctx = pushed.context
    then = time.time() - 3 * 3600
    body = {"started_at": then, "finished_at": None, "swept": True, "refreshed_at": then}
    record = tmp_path / "store" / "locks" / "gc-replayed"
    record.parent.mkdir(exist_ok=True)
    record.write_bytes(ctx.keys.seal(GC_RECORD_FORMAT, json.dumps(body).encode()))
    # Were it believed running, this would end in DeadlineExceeded.
    assert sync_index_if_gc_ran(ctx, wait_for_running=True, deadline=time.time() + 2) is True


def test_a_push_waiting_for_a_gc_ends_at_the_jobs_deadline(
    pushed: CheckpointStore, tmp_path: Path
) -> None:
    ctx = pushed.context
    assert ctx.options.lock_stale_seconds >= 600  # the wait the deadline must cut short
    record = _running_gc(ctx)
    try:
        with pytest.raises(DeadlineExceeded) as raised:
            pushed.push(
                make_tree(tmp_path / "src2", seed=6), workload="w", deadline=time.time() + 2
            )
    finally:
        record.finish()
    message = str(raised.value)
    assert "\n" not in message and record.key in message and "deadline" in message
    assert exit_code_for(raised.value) == 1  # docs/api.md: deadline_exceeded exits 1
    # The gc finished: the same push goes through.
    assert pushed.push(tmp_path / "src2", workload="w").checkpoint_id


def test_a_push_retrying_a_failing_store_ends_at_the_jobs_deadline(
    proxy: FaultProxy, s3_bucket: str, tmp_path: Path, keys: Keys
) -> None:
    """Retries that would go on for hours (attempts without end) stop at the job's deadline,
    also those made on the store's worker threads (the chunk puts)."""
    options = fast_options(
        proxy.endpoint_url, retry_attempts=1_000_000, retry_base_delay=0.05, retry_max_delay=0.2
    )
    store = file_store(tmp_path, keys, url=f"s3://{s3_bucket}/ckpt", options=options)
    try:
        push_tree(store, tmp_path)
        proxy.fail_next(1_000_000_000, status=503)
        with pytest.raises(DeadlineExceeded) as raised:
            store.push(make_tree(tmp_path / "src2", seed=7), workload="w", deadline=time.time() + 2)
        message = str(raised.value)
        assert "\n" not in message and "the job's deadline came after" in message
        assert exit_code_for(raised.value) == 1
    finally:
        proxy.fail_next(0)
        store.close()
