"""``start_triggers`` end to end without the daemon: a fake service, a real file:// store and a
loopback IMDS server. A reclaim notice leads to a kill-mode checkpoint and a published request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.jobs.job import Job, JobState
from gpusnap.daemon.migration import MigrationConfig
from gpusnap.daemon.triggers.config import TriggersConfig
from gpusnap.daemon.triggers.wiring import start_triggers
from gpusnap.daemon.verdict import CompatVerdict
from gpusnap.errors import FailedPrecondition
from gpusnap.storage.keys import generate_signing_key
from gpusnap.storage.manifest import new_checkpoint_id
from gpusnap.storage.store import CheckpointStore, open_store
from tests.support.metadata_servers import AwsImdsServer
from tests.triggers.fakes import FakeRunner

pytestmark = pytest.mark.timeout(60)


@dataclass
class Workload:
    name: str
    policy: dict[str, Any] = field(default_factory=dict)


@dataclass
class Config:
    workloads: list[Workload]
    triggers: Any
    migration: Any


class Handle:
    def __init__(self, store: CheckpointStore) -> None:
        self.store = store

    def get(self) -> CheckpointStore:
        return self.store


class FakeService:
    def __init__(self, config: Config, store: CheckpointStore) -> None:
        self.config = config
        self.store = Handle(store)
        self.runner = FakeRunner()

    def checkpoint(self, **kw: Any) -> Job:
        job = self.runner.checkpoint(**kw)
        if not kw["leave_running"]:
            self.runner.finish(job.id)
            job.result["checkpoint_id"] = new_checkpoint_id()
        return job

    def wait_job(self, job_id: str, timeout: float) -> Job:
        return self.runner.wait_job(job_id, timeout)

    def cancel_job(self, job_id: str) -> Job:
        self.runner.cancel_job(job_id)
        return self.runner.jobs[job_id]

    def get_job(self, job_id: str) -> Job:
        return self.runner.jobs[job_id]

    def compat(self, checkpoint_id: str) -> CompatVerdict:
        return CompatVerdict(checkpoint_id, True)

    def restore(self, *, checkpoint_id: str | None = None) -> Job:
        raise AssertionError("not a standby node")


def test_reclaim_notice_checkpoints_and_publishes(tmp_path: Path) -> None:
    key = tmp_path / "k.pem"
    generate_signing_key(key)
    with (
        AwsImdsServer() as aws,
        open_store(
            f"file://{tmp_path / 'store'}", key_file=key, cache_dir=tmp_path / "cache"
        ) as store,
    ):
        cfg = Config(
            [Workload("llm"), Workload("batch", {"on_notice": "none"})],
            TriggersConfig(provider="aws", aws_imds_url=aws.url, poll_interval=0.05, logind=False),
            {"node_id": "node-a"},
        )
        service = FakeService(cfg, store)
        runtime = start_triggers(service, cfg)
        try:
            assert isinstance(runtime.mcfg, MigrationConfig)
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
            (call,) = service.runner.calls
            assert (call.workload, call.leave_running) == ("llm", False)
            assert runtime.status()["watchers"][0]["last_notice"]["kind"] == "reclaim"
            # The workload is reclaimed: a drill finds nothing new to start... but attaches.
            job = runtime.drill(30)
            assert job.id == call.job_id and job.state == JobState.SUCCEEDED
        finally:
            runtime.stop()


def test_drill_without_checkpoint_workloads_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "k.pem"
    generate_signing_key(key)
    with open_store(
        f"file://{tmp_path / 'store'}", key_file=key, cache_dir=tmp_path / "cache"
    ) as store:
        cfg = Config(
            [Workload("batch", {"on_notice": "none"})],
            TriggersConfig(provider="none", logind=False),
            MigrationConfig(),
        )
        runtime = start_triggers(FakeService(cfg, store), cfg)
        try:
            with pytest.raises(FailedPrecondition, match="drill started no checkpoint"):
                runtime.drill(10)
        finally:
            runtime.stop()
