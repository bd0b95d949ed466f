"""A small in-test service for the gRPC tests, and the CLI run against a socket.

``FakeService`` implements ``DaemonServiceAPI`` with canned answers in the real service's
shapes, so tests prove the translation layer (servicer, wire, client, CLI) and every error
kind; it checks no argument. ``run_cli`` runs ``gpusnap`` on a socket.
"""

from __future__ import annotations

import copy
import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpusnap.daemon.api.callers import Caller
from gpusnap.daemon.gate.verdict import CompatVerdict, Reason
from gpusnap.daemon.jobs.job import Job, JobKind, JobState, Phase, Progress
from gpusnap.errors import KINDS, NotFound

T0 = 1_700_000_000.25
REPO = Path(__file__).resolve().parents[2]

FAILING_PID = 13  # a checkpoint of this pid ends FAILED with a corrupt error
INCOMPATIBLE_ID = "ckpt-other-node"


def _raise_if_asked(value: str | None) -> None:
    """``"raise:not_found"`` makes the call fail with that error kind."""
    if value and value.startswith("raise:"):
        kind = value.removeprefix("raise:")
        if kind == "bug":
            raise RuntimeError("a bug in the service")
        raise KINDS[kind](f"asked to fail with {kind}")


class FakeService:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.jobs: dict[str, Job] = {}
        self.snapshots: dict[str, list[Job]] = {}
        self._ids = itertools.count(1)

    def for_caller(self, caller: Caller) -> FakeService:
        """Every caller may do everything here: the fake proves translation, not rights."""
        return self

    def last_call(self) -> tuple[str, dict[str, Any]]:
        """The last call the service saw: its name and arguments."""
        return self.calls[-1]

    def _job(self, kind: JobKind, workload: str, **kw: Any) -> Job:
        job = Job(
            id=f"job-{next(self._ids)}",
            kind=kind,
            workload=workload,
            created_at=T0,
            **kw,
        )
        self.jobs[job.id] = job
        return job

    def _script(self, job: Job, final_state: JobState, result: dict[str, Any], **kw: Any) -> None:
        running = replace(
            job,
            state=JobState.RUNNING,
            phase=Phase.UPLOAD if job.kind == JobKind.CHECKPOINT else Phase.FETCH,
            started_at=T0 + 1,
            progress=Progress(bytes_done=512, bytes_total=1024, rate_bytes_per_s=256.0),
        )
        final = replace(
            running,
            state=final_state,
            phase=Phase.DONE,
            finished_at=T0 + 5,
            progress=Progress(bytes_done=1024, bytes_total=1024, rate_bytes_per_s=204.8),
            result=result,
            **kw,
        )
        self.snapshots[job.id] = [copy.deepcopy(job), running, final]
        self.jobs[job.id] = final

    # Keyword arguments as the servicer passes them: ``calls`` shows every one it sent.
    def checkpoint(self, **kw: Any) -> Job:
        self.calls.append(("checkpoint", kw))
        pid, workload = kw["pid"], kw["workload"]
        _raise_if_asked(workload)
        job = self._job(
            JobKind.CHECKPOINT,
            workload or f"pid-{pid}",
            trigger=kw["trigger"],
            deadline=kw["deadline"],
        )
        if pid == FAILING_PID:
            self._script(
                job,
                JobState.FAILED,
                {},
                error="chunk 3f2a failed its hash check",
                error_kind="corrupt",
            )
        else:
            self._script(
                job,
                JobState.SUCCEEDED,
                {
                    "checkpoint_id": "ckpt-1",
                    "pause_seconds": 0.75,
                    "seconds": 4.5,
                    "bytes_total": 1024,
                    "bytes_uploaded": 1000,
                    "chunks_total": 3,
                },
            )
        return self.snapshots[job.id][0]

    def restore(self, **kw: Any) -> Job:
        self.calls.append(("restore", kw))
        checkpoint_id, workload = kw["checkpoint_id"], kw["workload"]
        _raise_if_asked(checkpoint_id)
        job = self._job(JobKind.RESTORE, workload or "llm")
        if checkpoint_id == INCOMPATIBLE_ID:
            result = {
                "checkpoint_id": checkpoint_id,
                "mode": "cold-start",
                "pids": [4242],
                "reasons": ["model revision abc123 recorded, def456 here"],
                "seconds": 2.0,
            }
        else:
            result = {
                "checkpoint_id": checkpoint_id or "ckpt-latest",
                "mode": "restored",
                "pids": [4321, 4322],
                "reasons": [],
                "seconds": 3.25,
            }
        self._script(job, JobState.SUCCEEDED, result)
        return self.snapshots[job.id][0]

    def preflight(
        self,
        *,
        pid: int | None = None,
        workload: str | None = None,
        container: str | None = None,
        runtime: str | None = None,
    ) -> dict[str, Any]:
        args = {"pid": pid, "workload": workload, "container": container, "runtime": runtime}
        self.calls.append(("preflight", args))
        _raise_if_asked(workload or container or "")
        blocker = {"kind": "io_uring", "pid": pid or 1, "detail": "an io_uring", "fix": "exec"}
        note = {"kind": "lock", "pid": pid or 1, "detail": "a FLOCK WRITE lock"}
        return {"checkpointable": False, "blockers": [blocker], "notes": [note]}

    def compat(self, checkpoint_id: str) -> CompatVerdict:
        self.calls.append(("compat", {"checkpoint_id": checkpoint_id}))
        _raise_if_asked(checkpoint_id)
        if checkpoint_id == INCOMPATIBLE_ID:
            return CompatVerdict(
                checkpoint_id,
                False,
                (Reason("model.revision", "abc123", "def456", "model revision differs"),),
            )
        return CompatVerdict(checkpoint_id, True)

    def get_job(self, job_id: str) -> Job:
        _raise_if_asked(job_id)
        try:
            return self.jobs[job_id]
        except KeyError:
            raise NotFound(f"no job {job_id}") from None

    def list_jobs(self, limit: int = 50) -> list[Job]:
        self.calls.append(("list_jobs", {"limit": limit}))
        return list(reversed(self.jobs.values()))[: limit or 50]  # 0: as the service

    def cancel_job(self, job_id: str) -> Job:
        job = self.get_job(job_id)
        if job.state.terminal:
            return job
        job.state = JobState.CANCELLED
        return job

    def watch_job(self, job_id: str) -> Iterator[Job]:
        _raise_if_asked(job_id)
        if job_id not in self.snapshots:
            raise NotFound(f"no job {job_id}")
        yield from self.snapshots[job_id]

    def list_checkpoints(self, workload: str | None = None) -> list[dict[str, Any]]:
        self.calls.append(("list_checkpoints", {"workload": workload}))
        _raise_if_asked(workload)
        return [
            {
                "checkpoint_id": "ckpt-1",
                "workload": workload or "llm",
                "created_at": T0,
                "parent": None,
                "bytes_total": 1024,
                "files": 2,
            }
        ]

    def show_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        _raise_if_asked(checkpoint_id)
        if checkpoint_id != "ckpt-1":
            raise NotFound(f"no checkpoint {checkpoint_id}")
        return {  # as DaemonService.show_checkpoint: the manifest, files without chunks
            "schema_version": 1,
            "checkpoint_id": "ckpt-1",
            "workload": "llm",
            "created_at": T0,
            "parent": None,
            "stamp": {"host": {"arch": "x86_64"}, "model": {"revision": "abc123"}},
            "spec": {},
            "files": [{"path": "pages-1.img", "size": 1024}],
            "totals": {"bytes_total": 1024, "chunks_total": 2},
            "extra": {},
            "bytes_total": 1024,
        }

    def list_workloads(self) -> list[dict[str, Any]]:
        return [
            {
                "name": "llm",
                "running": True,
                "pid": 4321,
                "finder": "pid_file /run/llm.pid",
                "engine": "vllm 0.11.0",
                "model": "llama@abc123",
                "active_job": None,
                "last_checkpoint_id": "ckpt-1",
                "last_checkpoint_at": T0,
                "last_checkpoint_age_seconds": 3725.5,
                "store_error": None,
            }
        ]

    def status(self) -> dict[str, Any]:
        return {
            "version": "0.1.0",
            "node_id": "node-a",
            "pid": 4242,
            "uptime_seconds": 12.5,
            "socket": "/run/gpusnap/gpusnapd.sock",
            "state_dir": "/var/lib/gpusnap",
            "staging_dir": "/var/lib/gpusnap/staging",
            "store": {"url": "file:///var/lib/gpusnap/store", "reachable": True, "error": None},
            "host": {"arch": "x86_64", "kernel": "6.1.0", "cpus": 2},
            "gpu": {"driver_present": False, "message": "GPU support is off"},
            "capabilities": {"criu": "criu 4.1.1", "gpu": "none", "store": "reachable"},
            "jobs_running": 0,
            "workloads": [
                {
                    "name": "llm",
                    "last_checkpoint_id": None,
                    "last_checkpoint_at": None,
                    "last_checkpoint_age_seconds": None,
                    "warm": None,
                },
                {
                    "name": "tts",
                    "last_checkpoint_id": "ckpt-1",
                    "last_checkpoint_at": T0,
                    "last_checkpoint_age_seconds": 60.0,
                    "warm": {
                        "checkpoint_id": "ckpt-1",
                        "bytes_warm": 3 << 30,
                        "bytes_total": 4 << 30,
                        "fraction": 0.75,
                    },
                },
            ],
            "interrupted_at_start": ["job-0"],
            "triggers": False,
            "criu": {
                "path": "/usr/local/sbin/criu",
                "version": "4.1.1",
                "error": None,
                "tcp_dump": False,
                "tcp_dump_reason": "criu 4.1.1 cannot dump TCP sockets on this kernel",
                "kernel": "6.18.0",
            },
            "store_check": {
                "interval_seconds": 21600.0,
                "last_check_at": T0,
                "last_check_seconds": 0.25,
                "next_check_at": T0 + 21600,
                "checkpoints_checked": 2,
                "chunks_checked": 40,
                "chunks_missing": 1,
                "damaged": [
                    {
                        "checkpoint_id": "ckpt-1",
                        "workload": "llm",
                        "missing_chunks": 1,
                        "latest": True,
                    }
                ],
                "manifests_bad": [],
                "error": None,
                "error_at": None,
                "full_next": {"llm": "its latest checkpoint ckpt-1 names 1 chunk(s) ..."},
            },
            "trigger_provider": "none",
        }

    def triggers_status(self) -> dict[str, Any]:
        return {"aws": {"state": "watching", "last_poll": T0}}

    def migrations(self) -> list[dict[str, Any]]:
        return [{"id": "mig-1", "from": "node-a", "to": "node-b"}]

    def withdraw_migration(self, checkpoint_id: str, reason: str) -> dict[str, Any]:
        self.calls.append(
            ("withdraw_migration", {"checkpoint_id": checkpoint_id, "reason": reason})
        )
        return {"checkpoint_id": checkpoint_id, "status": "withdrawn"}

    def drill(self, deadline_s: float | None) -> Job:
        self.calls.append(("drill", {"deadline_s": deadline_s}))
        return self._job(JobKind.CHECKPOINT, "llm", trigger="drill")


def run_cli(
    socket_path: Path | None, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "gpusnap.cli.main"]
    if socket_path is not None:
        argv += ["--socket", str(socket_path)]
    return subprocess.run(
        [*argv, *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
