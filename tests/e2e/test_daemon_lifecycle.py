"""gpusnapd's own life: killed mid-job, refusing a second checkpoint, refusing a bad config."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.cli._client import DaemonClient
from gpusnap.daemon.host import proctree
from tests.e2e import memory_holder
from tests.support import workloads
from tests.support.daemons import Nodes, gpusnapd

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]

HOLDER_MIB = 768  # big enough that the upload is still running when the test looks


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    ready = tmp_path / "holder.ready"
    proc = memory_holder.start(HOLDER_MIB, ready)
    workloads._poll(lambda: ready.exists() or proc.poll() is not None, 120, "the holder")
    assert proc.poll() is None
    yield proc
    proc.kill()
    proc.wait()


def test_daemon_killed_mid_upload_comes_back_with_the_job_interrupted_and_nothing_half_committed(
    nodes: Nodes, holder: subprocess.Popen[bytes]
) -> None:
    # Everything is uploaded after the dump (no upload while CRIU writes), so the upload
    # phase is long enough to be caught: the job's own stream says when it starts.
    node = nodes.make("a", daemon_config="upload_during_dump = false").start()
    with DaemonClient.for_socket(node.socket) as client:
        job_id = client.checkpoint(pid=holder.pid, leave_running=True)["id"]

        # A second checkpoint of the same workload while the first runs is refused, clearly.
        again = node.cli("checkpoint", "--pid", str(holder.pid), "--leave-running")
        assert again.rc == 1
        assert f"already has checkpoint job {job_id}" in again.stderr

        for snapshot in client.watch_job(job_id):
            assert snapshot["state"] in ("queued", "running"), snapshot
            if snapshot["phase"] == "upload":
                node.kill()  # SIGKILL, mid-upload
                break
        else:
            pytest.fail(f"job {job_id} ended without an upload phase")
    staged = list((node.state_dir / "staging").iterdir())
    assert staged, "the killed daemon left its staging behind (that is what recovery cleans)"

    node.start()
    job = node.job(job_id)
    assert job["state"] == "interrupted"
    assert job["error"] == (
        f"daemon restarted during the job; the workload was left running (pid {holder.pid})"
    )
    assert not list((node.state_dir / "staging").iterdir())
    listed = node.cli("ls", "--json")
    assert listed.rc == 0, listed.stderr
    assert listed.json == {"checkpoints": []}
    assert proctree.exists(holder.pid)  # leave-running: the workload never stopped
    status = node.cli("status", "--json").json
    assert job_id in json.dumps(status)


def test_a_config_error_refuses_to_start_with_one_line_and_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(
        '[daemon]\nstate_dir = "/tmp/x"\n[[workload]]\nname = "a"\n'
        '[[workload]]\nname = "llm"\npidfile = "/run/llm.pid"\n'
    )
    proc = gpusnapd("--config", str(cfg))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "gpusnapd: error: config: [[workload]] #2 'llm': unknown key 'pidfile' "
        "(did you mean 'pid_file'?)"
    ]


def test_a_missing_config_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = gpusnapd("--config", str(tmp_path / "nope.toml"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"gpusnapd: error: config: {tmp_path / 'nope.toml'}: no such file"
