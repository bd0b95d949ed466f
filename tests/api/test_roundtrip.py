"""Every RPC through the real servicer and client over a unix socket."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusnap.cli._client import DaemonClient
from gpusnap.daemon.jobs.job import Job, JobKind, JobState, Phase
from gpusnap.proto.gpusnap.v1 import gpusnap_pb2 as pb
from gpusnap.proto.wire import job_from_pb, job_to_pb
from tests.api.fake_service import INCOMPATIBLE_ID, T0, FakeService


@pytest.fixture
def client(server: Path) -> DaemonClient:
    return DaemonClient.for_socket(server)


def test_checkpoint_round_trips_arguments_and_job(
    client: DaemonClient, service: FakeService
) -> None:
    job = client.checkpoint(pid=4321, leave_running=True)
    assert service.last_call() == (
        "checkpoint",
        {
            "pid": 4321,
            "workload": None,
            "leave_running": True,
            "trigger": "operator",
            "deadline": None,
            "container": None,
            "runtime": None,
        },
    )
    assert job["kind"] == "checkpoint"
    assert job["state"] == "queued"
    assert job["phase"] == "pending"
    assert job["workload"] == "pid-4321"
    assert job["created_at"] == T0
    assert job["started_at"] is None and job["finished_at"] is None and job["deadline"] is None
    assert job["error"] is None and job["error_kind"] is None
    client.checkpoint(workload="llm")
    assert service.last_call()[1]["workload"] == "llm"
    assert service.last_call()[1]["pid"] is None
    client.checkpoint(container="llm-0", runtime="podman")
    called = service.last_call()[1]
    assert (called["container"], called["runtime"]) == ("llm-0", "podman")
    assert called["pid"] is None and called["workload"] is None


def test_get_job_carries_progress_times_and_integral_result(
    client: DaemonClient, service: FakeService
) -> None:
    job_id = client.checkpoint(workload="llm")["id"]
    job = client.get_job(job_id)
    assert job["state"] == "succeeded"
    assert job["phase"] == "done"
    assert (job["bytes_done"], job["bytes_total"]) == (1024, 1024)
    assert job["rate_bytes_per_s"] == 204.8
    assert job["started_at"] == T0 + 1
    assert job["finished_at"] == T0 + 5
    result = job["result"]
    assert result["bytes_uploaded"] == 1000 and isinstance(result["bytes_uploaded"], int)
    assert result["pause_seconds"] == 0.75
    assert result["checkpoint_id"] == "ckpt-1"


def test_restore_compat_and_lists(client: DaemonClient, service: FakeService) -> None:
    job = client.restore(workload="llm", latest=True)
    assert service.last_call() == (
        "restore",
        {
            "checkpoint_id": None,
            "workload": "llm",
            "latest": True,
            "name": None,
            "allow_rollback": False,
        },
    )
    assert job["kind"] == "restore"
    client.restore(checkpoint_id="ckpt-1")
    assert service.last_call()[1]["checkpoint_id"] == "ckpt-1"
    client.restore(checkpoint_id="ckpt-1", name="llm-copy")
    assert service.last_call()[1]["name"] == "llm-copy"

    assert client.compat("ckpt-1") == {"checkpoint_id": "ckpt-1", "compatible": True, "reasons": []}
    verdict = client.compat(INCOMPATIBLE_ID)
    assert verdict["compatible"] is False
    assert verdict["reasons"] == [
        {
            "field": "model.revision",
            "expected": "abc123",
            "actual": "def456",
            "message": "model revision differs",
        }
    ]

    jobs = client.list_jobs(limit=1)
    assert service.last_call() == ("list_jobs", {"limit": 1})
    assert [j["kind"] for j in jobs] == ["restore"]
    client.list_jobs()  # limit 0 on the wire: the service's default, the service decides it
    assert service.last_call() == ("list_jobs", {"limit": 0})

    assert client.list_checkpoints("llm") == service.list_checkpoints("llm")
    assert service.last_call() == ("list_checkpoints", {"workload": "llm"})
    client.list_checkpoints()
    assert service.last_call() == ("list_checkpoints", {"workload": None})
    shown = client.show_checkpoint("ckpt-1")
    assert shown == service.show_checkpoint("ckpt-1")
    assert shown["stamp"]["model"]["revision"] == "abc123"
    assert shown["files"][0]["size"] == 1024 and isinstance(shown["files"][0]["size"], int)
    assert client.list_workloads() == service.list_workloads()
    assert client.status() == service.status()


def test_cancel_returns_the_job(client: DaemonClient, service: FakeService) -> None:
    job = client.drill()
    assert service.last_call() == ("drill", {"deadline_s": None})
    cancelled = client.cancel_job(job["id"])
    assert cancelled["state"] == "cancelled"
    assert cancelled["trigger"] == "drill"


def test_issue_5_calls(client: DaemonClient, service: FakeService) -> None:
    assert client.triggers_status() == {"aws": {"state": "watching", "last_poll": T0}}
    assert client.migrations() == [{"id": "mig-1", "from": "node-a", "to": "node-b"}]
    client.drill(25.0)
    assert service.last_call() == ("drill", {"deadline_s": 25.0})


def test_watch_streams_each_snapshot_to_the_end(client: DaemonClient) -> None:
    job_id = client.checkpoint(workload="llm")["id"]
    snapshots = list(client.watch_job(job_id))
    assert [s["state"] for s in snapshots] == ["queued", "running", "succeeded"]
    assert [s["phase"] for s in snapshots] == ["pending", "upload", "done"]
    assert [s["bytes_done"] for s in snapshots] == [0, 512, 1024]
    assert snapshots[-1]["result"]["checkpoint_id"] == "ckpt-1"


@pytest.mark.parametrize(
    ("enum", "prefix", "pb_enum"),
    [
        (JobKind, "JOB_KIND_", pb.JobKind),
        (JobState, "JOB_STATE_", pb.JobState),
        (Phase, "PHASE_", pb.Phase),
    ],
)
def test_every_model_enum_value_has_a_proto_value(enum: type, prefix: str, pb_enum: object) -> None:
    # The proto must grow with the model: a missing value would travel as "unspecified".
    for member in enum:  # type: ignore[attr-defined]
        name = prefix + member.value.upper().replace("-", "_")
        assert name in pb_enum.keys(), f"add {name} to gpusnap.proto"  # type: ignore[attr-defined]


def test_job_conversion_round_trips_every_state_and_phase() -> None:
    for state in JobState:
        for phase in Phase:
            job = Job(
                id="j", kind=JobKind.RESTORE, workload="w", state=state, phase=phase, deadline=T0
            )
            back = job_from_pb(job_to_pb(job))
            assert (back["state"], back["phase"], back["kind"]) == (
                state.value,
                phase.value,
                "restore",
            )
            assert back["deadline"] == T0
