"""What a daemon that died mid-checkpoint left in staging, settled by the next one's start: the
cases that must not restore the tree (tests/e2e/test_daemon_killed.py kills real daemons at
each point of a checkpoint; these are the ones a kill cannot reach on a test's time).

Each test leaves a state directory as a dead daemon would (the journal's row of a running
checkpoint job, its staging with ``dump.json`` and images) and starts a real ``DaemonService``
on it, whose start runs the recovery."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.config.file import parse_config
from gpusnap.daemon.host import proctree
from gpusnap.daemon.jobs.job import Job, JobKind, JobState, Phase
from gpusnap.daemon.jobs.journal import INTERRUPTED_MESSAGE, Journal
from gpusnap.daemon.pipelines.recovery import DUMP_RECORD, record_dump
from gpusnap.daemon.service import DaemonService
from gpusnap.storage import generate_signing_key, open_store

JOB = "20990101T000000-abcdef"


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


class DeadDaemon:
    """A state directory as a daemon that died in the upload of job ``JOB`` left it."""

    def __init__(self, root: Path, workload: dict[str, Any] | None = None) -> None:
        self.root = root
        self.key = root / "signing.key"
        generate_signing_key(self.key)
        table: dict[str, Any] = {
            "daemon": {"socket": str(root / "sock"), "state_dir": str(root / "state")},
            "store": {"url": f"file://{root / 'store'}", "key_file": str(self.key)},
            "gpu": {"driver": "none"},
        }
        if workload:
            table["workload"] = [workload]
        self.config = parse_config(table)
        self.staging = root / "state" / "staging" / JOB
        self.images = self.staging / "images"
        self.images.mkdir(parents=True)
        (self.images / "inventory.img").write_bytes(b"written last by CRIU")
        (self.images / "pages-1.img").write_bytes(b"the only copy of the workload")
        journal = Journal(root / "state" / "jobs.sqlite")
        journal.save(
            Job(
                JOB,
                JobKind.CHECKPOINT,
                "svc",
                state=JobState.RUNNING,
                phase=Phase.UPLOAD,
                created_at=time.time(),
            )
        )
        journal.close()

    def record(self, pids: list[int], **changes: Any) -> None:
        record_dump(self.staging, workload="svc", leave_running=False, pids=pids)
        path = self.staging / DUMP_RECORD
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    def start(self) -> tuple[DaemonService, dict[str, Any]]:
        service = DaemonService(self.config)
        return service, _asdict(service.get_job(JOB))


def _asdict(job: Job) -> dict[str, Any]:
    return {"state": job.state.value, "error": job.error, "result": job.result}


def _gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_after_a_reboot_the_images_are_kept_and_not_restored(tmp_path: Path) -> None:
    dead = DeadDaemon(tmp_path)
    dead.record([_gone_pid()], boot_id="an-earlier-boot")
    service, job = dead.start()
    try:
        kept = tmp_path / "state" / "kept" / JOB
        assert job["state"] == "interrupted"
        assert job["error"] == (
            f"{INTERRUPTED_MESSAGE}; the node rebooted since; its images are kept in {kept}, "
            "not restored"
        )
        assert (kept / "pages-1.img").read_bytes() == b"the only copy of the workload"
        assert not dead.staging.exists()
    finally:
        service.close()


def test_a_workload_that_runs_again_is_not_restored_a_second_time(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    # Its service manager started it afresh after the dump killed it (Restart=always).
    (tmp_path / "svc.pid").write_text(f"{sleeper.pid}\n")
    dead = DeadDaemon(tmp_path, {"name": "svc", "pid_file": str(tmp_path / "svc.pid")})
    dead.record([_gone_pid()])
    service, job = dead.start()
    try:
        kept = tmp_path / "state" / "kept" / JOB
        assert job["error"] == (
            f"{INTERRUPTED_MESSAGE}; the workload runs again (pid {sleeper.pid}, started "
            f"afresh); its images are kept in {kept}, not restored"
        )
        assert (kept / "inventory.img").exists()
    finally:
        service.close()


def test_a_checkpoint_committed_before_the_daemon_died_is_the_jobs_success(
    tmp_path: Path,
) -> None:
    dead = DeadDaemon(tmp_path)
    dead.record([_gone_pid()])
    with open_store(f"file://{tmp_path / 'store'}", key_file=dead.key) as store:
        pushed = store.push(dead.images, workload="svc", extra={"job": JOB})
    service, job = dead.start()
    try:
        assert job["state"] == "succeeded", job
        assert job["error"] is None
        assert job["result"]["checkpoint_id"] == pushed.checkpoint_id
        assert "was committed before the daemon died" in job["result"]["recovered"]
        assert not dead.staging.exists()
        assert not (tmp_path / "state" / "kept").exists()  # and nothing restored
    finally:
        service.close()


def test_a_gone_tree_whose_dump_did_not_finish_is_said_lost(tmp_path: Path) -> None:
    dead = DeadDaemon(tmp_path)
    (dead.images / "inventory.img").unlink()
    dead.record([_gone_pid()])
    service, job = dead.start()
    try:
        assert job["error"] == (
            f"{INTERRUPTED_MESSAGE}; the workload's tree is gone and its dump did not finish: "
            "nothing to restore"
        )
    finally:
        service.close()


def test_a_tree_whose_pid_was_reused_counts_as_gone(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    dead = DeadDaemon(tmp_path)
    (dead.images / "inventory.img").unlink()
    start = proctree.start_time(sleeper.pid)
    assert start is not None
    dead.record([sleeper.pid], tree=[[sleeper.pid, start - 1]])  # another process, same pid
    service, job = dead.start()
    try:
        assert "the workload's tree is gone" in job["error"]
        assert proctree.exists(sleeper.pid)  # and the process that holds the pid now is left
    finally:
        service.close()
