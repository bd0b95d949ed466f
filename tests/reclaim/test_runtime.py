"""``ReclaimRuntime`` end to end without the daemon: a fake node, a real file:// store and a
loopback IMDS server. A reclaim notice leads to a kill-mode checkpoint and a published request."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.jobs.job import JobState
from gpusnap.daemon.reclaim.config import MigrationConfig, TriggersConfig, WorkloadPolicy
from gpusnap.daemon.reclaim.runtime import ReclaimRuntime
from gpusnap.errors import FailedPrecondition
from gpusnap.storage.keys import generate_signing_key
from gpusnap.storage.store import CheckpointStore, open_store
from tests.reclaim.fakes import FakeNode, FakeStore
from tests.support.metadata_servers import AwsImdsServer

pytestmark = pytest.mark.timeout(60)

NO_CLOUD = TriggersConfig(provider="none", logind=False)


@pytest.fixture
def file_store(tmp_path: Path) -> Iterator[CheckpointStore]:
    key = tmp_path / "k.pem"
    generate_signing_key(key)
    with open_store(
        f"file://{tmp_path / 'store'}", key_file=key, cache_dir=tmp_path / "cache"
    ) as store:
        yield store


@contextlib.contextmanager
def running(
    node: FakeNode,
    triggers: TriggersConfig,
    migration: MigrationConfig,
    policies: Sequence[WorkloadPolicy] = (),
    *,
    daemon_node_id: str | None = None,
    store_verifies: bool = True,
) -> Iterator[ReclaimRuntime]:
    runtime = ReclaimRuntime(
        node,
        triggers,
        migration,
        policies,
        daemon_node_id=daemon_node_id,
        store_verifies=store_verifies,
    )
    runtime.start()
    try:
        yield runtime
    finally:
        runtime.stop()


def test_reclaim_notice_checkpoints_and_publishes(file_store: CheckpointStore) -> None:
    node = FakeNode(auto={"kill": JobState.SUCCEEDED}, store_handle=FakeStore(file_store))
    policies = [WorkloadPolicy("llm"), WorkloadPolicy("batch", on_notice="none")]
    with AwsImdsServer() as aws:
        aws_only = TriggersConfig(
            provider="aws", aws_imds_url=aws.url, poll_interval=0.05, logind=False
        )
        with running(node, aws_only, MigrationConfig(node_id="node-a"), policies) as runtime:
            status = runtime.status()
            assert status["provider"] == "aws" and status["node_id"] == "node-a"
            aws.announce_reclaim()
            end = time.monotonic() + 10
            while time.monotonic() < end and not runtime.migrations():
                time.sleep(0.05)
            (mig,) = runtime.migrations()
            assert mig["status"] == "pending"
            assert mig["request"]["workload"] == "llm"
            assert mig["request"]["source_node"] == "node-a"
            assert mig["request"]["stamp_summary"]["trigger"] == "reclaim:aws"
            (call,) = node.calls
            assert (call.workload, call.leave_running) == ("llm", False)
            assert mig["checkpoint_id"] == node.jobs[call.job_id].result["checkpoint_id"]
            assert runtime.status()["watchers"][0]["last_notice"]["kind"] == "reclaim"
            # The workload is reclaimed: a drill finds nothing new to start... but attaches.
            job = runtime.drill(30)
            assert job.id == call.job_id and job.state == JobState.SUCCEEDED


@pytest.mark.parametrize(
    ("migration_id", "daemon_id", "expected"),
    [("mig-id", "daemon-id", "mig-id"), ("", "daemon-id", "daemon-id")],
)
def test_the_node_id_is_the_migration_tables_else_the_daemons(
    migration_id: str, daemon_id: str, expected: str
) -> None:
    migration = MigrationConfig(node_id=migration_id)
    with running(FakeNode(), NO_CLOUD, migration, daemon_node_id=daemon_id) as runtime:
        assert runtime.status()["node_id"] == expected


@pytest.mark.parametrize("verifies", [True, False])
def test_a_standby_runs_only_on_a_store_that_verifies(
    file_store: CheckpointStore, verifies: bool, caplog: pytest.LogCaptureFixture
) -> None:
    node = FakeNode(store_handle=FakeStore(file_store))
    standby = MigrationConfig(standby=True, poll_interval=0.05)
    with running(node, NO_CLOUD, standby, store_verifies=verifies) as runtime:
        if verifies:
            end = time.monotonic() + 10
            while time.monotonic() < end and not runtime.status()["standby"]["running"]:
                time.sleep(0.02)
            assert runtime.status()["standby"]["running"] is True
        else:
            # start() decides at once: it logs the refusal and starts no standby thread.
            assert "standby = true is ignored" in caplog.text
            assert runtime.status()["standby"] == {
                "enabled": True,
                "running": False,
                "last_error": None,
                "looks": 0,
                "request_ttl_s": 3600.0,
            }


def test_drill_without_checkpoint_workloads_is_refused(file_store: CheckpointStore) -> None:
    node = FakeNode(store_handle=FakeStore(file_store))
    batch = [WorkloadPolicy("batch", on_notice="none")]
    with running(node, NO_CLOUD, MigrationConfig(), batch) as runtime:
        with pytest.raises(FailedPrecondition, match="drill started no checkpoint"):
            runtime.drill(10)


def test_a_standby_whose_store_is_unreachable_at_start_runs_once_it_answers(
    file_store: CheckpointStore,
) -> None:
    node = FakeNode()  # its store handle has no store yet: Unavailable
    standby = MigrationConfig(standby=True, poll_interval=0.05)
    with running(node, NO_CLOUD, standby) as runtime:

        def standby_state() -> dict[str, Any]:
            state: dict[str, Any] = runtime.status()["standby"]
            return state

        end = time.monotonic() + 10
        while time.monotonic() < end and standby_state()["last_error"] is None:
            time.sleep(0.02)
        assert standby_state()["running"] is False
        assert "no store" in standby_state()["last_error"]
        node.store_handle.store = file_store  # the store answers now
        while time.monotonic() < end + 10 and not standby_state()["running"]:
            time.sleep(0.02)
        state = standby_state()
        assert (state["enabled"], state["running"], state["last_error"]) == (True, True, None)
