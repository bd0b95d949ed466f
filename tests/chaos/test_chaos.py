"""The chaos suite: every fault of ``scenarios.py``, ``GPUSNAP_CHAOS_ROUNDS`` times each, with
real ``gpusnap`` processes, real files, and moto behind a fault-injecting proxy on loopback.
After each fault every listed checkpoint pulls back byte-identical and verify passes (or
names exactly the damage done); a committed checkpoint that does not is lost, and none may be.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos import scenarios
from tests.chaos.harness import ChaosRun, ChaosStore
from tests.storage.store_helpers import mounted_tmpfs
from tests.support.faultproxy import FaultProxy

pytestmark = pytest.mark.slow


def _report(store: ChaosStore, scenario: str) -> None:
    print(f"{scenario} on {store.kind}: {store.tally.as_dict()}")
    assert store.tally.checkpoints_lost == 0
    assert sum(store.tally.faults.values()) > 0, "no fault was injected"


def test_pushes_killed_at_random_points_lose_no_checkpoint_on_file(
    file_store: ChaosStore, chaos: ChaosRun
) -> None:
    scenarios.kill_pushes(file_store, chaos.rng("kill-file"), chaos.rounds)
    _report(file_store, "kill")


@pytest.mark.s3
def test_pushes_killed_at_random_points_lose_no_checkpoint_on_s3(
    s3_store: ChaosStore, proxy: FaultProxy, chaos: ChaosRun
) -> None:
    scenarios.kill_pushes(s3_store, chaos.rng("kill-s3"), chaos.rounds, proxy)
    _report(s3_store, "kill")


@pytest.mark.s3
def test_503_storms_and_reset_connections_mid_multipart_lose_no_checkpoint(
    s3_store: ChaosStore, proxy: FaultProxy, chaos: ChaosRun
) -> None:
    scenarios.s3_storms(s3_store, proxy, chaos.rng("storms"), chaos.rounds)
    _report(s3_store, "storms")


def test_a_disk_that_fills_mid_push_loses_no_checkpoint(tmp_path: Path, chaos: ChaosRun) -> None:
    with mounted_tmpfs(tmp_path / "disk", "28m") as disk:
        store = ChaosStore.on_file(tmp_path / "work", chaos.seed, root=disk / "store")
        scenarios.full_disk(store, chaos.rng("full-disk"), chaos.rounds)
        _report(store, "full disk")


def test_two_pushes_and_a_gc_at_once_lose_no_checkpoint(
    file_store: ChaosStore, chaos: ChaosRun
) -> None:
    scenarios.pushes_and_gc(file_store, chaos.rng("push-gc"), chaos.rounds)
    _report(file_store, "pushes and gc")


def test_a_store_recreated_between_pushes_gets_complete_checkpoints_on_file(
    file_store: ChaosStore, chaos: ChaosRun
) -> None:
    scenarios.store_recreated(file_store, chaos.rng("recreated-file"), chaos.rounds)
    _report(file_store, "store recreated")


@pytest.mark.s3
def test_a_bucket_emptied_or_recreated_between_pushes_gets_complete_checkpoints(
    s3_store: ChaosStore, chaos: ChaosRun
) -> None:
    scenarios.store_recreated(s3_store, chaos.rng("recreated-s3"), chaos.rounds)
    _report(s3_store, "bucket recreated")


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_chunks_removed_between_pushes_are_named_and_never_committed_missing(
    kind: str, request: pytest.FixtureRequest, chaos: ChaosRun
) -> None:
    store: ChaosStore = request.getfixturevalue(f"{kind}_store")
    scenarios.chunk_removed(store, chaos.rng(f"removed-{kind}"), chaos.rounds)
    _report(store, "chunks removed")
