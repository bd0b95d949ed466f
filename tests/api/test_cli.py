"""The daemon commands as an operator runs them: subprocesses against the served socket."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpusnap.errors import (
    ERROR_TABLE,
    EXIT_DAEMON_UNREACHABLE,
    EXIT_INTEGRITY,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
)
from tests.api.fake_service import FAILING_PID, INCOMPATIBLE_ID, FakeService, run_cli


def _json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    out = proc.stdout
    assert out.count("\n") == 1, out
    data = json.loads(out)
    assert isinstance(data, dict), out
    return data


def test_checkpoint_wait_json_prints_the_documented_keys(
    server: Path, service: FakeService
) -> None:
    proc = run_cli(server, "checkpoint", "--pid", "4321", "--leave-running", "--wait", "--json")
    assert proc.returncode == 0, proc.stderr
    out = _json(proc)
    for key in ("checkpoint_id", "pause_seconds", "seconds", "bytes_total", "bytes_uploaded"):
        assert key in out
    assert out["checkpoint_id"] == "ckpt-1"
    assert out["bytes_uploaded"] == 1000
    assert out["state"] == "succeeded"
    assert out["job_id"].startswith("job-")
    assert service.calls[0][1]["leave_running"] is True
    assert proc.stderr == ""  # no progress bar when stderr is not a terminal


def test_checkpoint_without_wait_prints_the_job_id(server: Path) -> None:
    proc = run_cli(server, "checkpoint", "--workload", "llm")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith("job-")
    as_json = _json(run_cli(server, "checkpoint", "--workload", "llm", "--json"))
    assert as_json["state"] == "queued" and as_json["kind"] == "checkpoint"


def test_checkpoint_needs_exactly_one_target(server: Path) -> None:
    assert run_cli(server, "checkpoint").returncode == EXIT_USAGE
    assert run_cli(server, "checkpoint", "--pid", "1", "--workload", "x").returncode == EXIT_USAGE


def test_failed_job_exits_with_its_kinds_code(server: Path) -> None:
    proc = run_cli(server, "checkpoint", "--pid", str(FAILING_PID), "--wait", "--json")
    assert proc.returncode == EXIT_INTEGRITY == ERROR_TABLE["corrupt"].exit_code
    out = _json(proc)
    assert out["state"] == "failed"
    assert out["kind"] == "corrupt"
    assert "hash check" in out["error"]
    assert len(proc.stderr.strip().splitlines()) == 1


def test_restore_wait_json_restored_and_cold_start(server: Path) -> None:
    proc = run_cli(server, "restore", "ckpt-1", "--wait", "--json")
    assert proc.returncode == 0, proc.stderr
    out = _json(proc)
    assert out["mode"] == "restored"
    assert out["pids"] == [4321, 4322]
    assert out["reasons"] == []
    assert out["seconds"] == 3.25

    proc = run_cli(server, "restore", INCOMPATIBLE_ID, "--wait", "--json")
    assert proc.returncode == 0, proc.stderr
    out = _json(proc)
    assert out["mode"] == "cold-start"
    assert out["reasons"] == ["model revision abc123 recorded, def456 here"]

    human = run_cli(server, "restore", INCOMPATIBLE_ID, "--wait")
    assert "cold-started" in human.stdout and "model revision" in human.stdout


def test_restore_latest_of_a_workload(server: Path, service: FakeService) -> None:
    proc = run_cli(server, "restore", "--workload", "llm", "--latest", "--json")
    assert proc.returncode == 0, proc.stderr
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
    run_cli(server, "restore", "--workload", "llm", "--latest", "--allow-rollback", "--json")
    assert service.last_call()[1]["allow_rollback"] is True
    # Which of ID, --workload and --latest go together is the service's to say (see
    # test_real_service.py); the CLI passes on what it was given.
    assert run_cli(server, "restore", "--workload", "llm").returncode == 0
    assert service.last_call() == (
        "restore",
        {
            "checkpoint_id": None,
            "workload": "llm",
            "latest": False,
            "name": None,
            "allow_rollback": False,
        },
    )
    assert run_cli(server, "restore", "ckpt-1", "--name", "llm-copy").returncode == 0
    assert service.calls[-1][1]["name"] == "llm-copy"


def test_checkpoint_of_a_container_passes_its_name_and_runtime(
    server: Path, service: FakeService
) -> None:
    proc = run_cli(server, "checkpoint", "--container", "llm-0", "--runtime", "runc", "--json")
    assert proc.returncode == 0, proc.stderr
    called = service.calls[-1][1]
    assert (called["container"], called["runtime"], called["pid"]) == ("llm-0", "runc", None)
    # The runtime is one the daemon knows, and a target is one of three: argparse's to say.
    bad = run_cli(server, "checkpoint", "--container", "x", "--runtime", "docker")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
    both = run_cli(server, "checkpoint", "--container", "x", "--pid", "7")
    assert both.returncode == 2 and "not allowed with" in both.stderr


def test_preflight_over_the_wire_json_text_exit_codes_and_usage(
    server: Path, service: FakeService
) -> None:
    proc = run_cli(server, "preflight", "--pid", "4321", "--json")
    assert proc.returncode == 1, proc.stderr  # not checkpointable
    assert _json(proc) == {
        "checkpointable": False,
        "blockers": [{"kind": "io_uring", "pid": 4321, "detail": "an io_uring", "fix": "exec"}],
        "notes": [{"kind": "lock", "pid": 4321, "detail": "a FLOCK WRITE lock"}],
    }
    assert service.last_call() == (
        "preflight",
        {"pid": 4321, "workload": None, "container": None, "runtime": None},
    )
    run_cli(server, "preflight", "--container", "c1", "--runtime", "podman")
    assert service.last_call()[1] == {
        "pid": None,
        "workload": None,
        "container": "c1",
        "runtime": "podman",
    }
    human = run_cli(server, "preflight", "--workload", "llm")
    assert human.returncode == 1
    assert "BLOCKER io_uring pid 1: an io_uring" in human.stdout and "fix: exec" in human.stdout
    missing = run_cli(server, "preflight", "--workload", "raise:not_found")
    assert missing.returncode == EXIT_NOT_FOUND and missing.stderr.count("\n") == 1
    none = run_cli(server, "preflight")
    assert none.returncode == EXIT_USAGE and "one of the arguments" in none.stderr, none.stderr
    both = run_cli(server, "preflight", "--pid", "1", "--workload", "llm")
    assert both.returncode == EXIT_USAGE and "not allowed with" in both.stderr


def test_compat_json(server: Path) -> None:
    proc = run_cli(server, "compat", "ckpt-1", "--json")
    assert proc.returncode == 0
    assert _json(proc) == {"checkpoint_id": "ckpt-1", "compatible": True, "reasons": []}
    proc = run_cli(server, "compat", INCOMPATIBLE_ID, "--json")
    assert proc.returncode == ERROR_TABLE["incompatible"].exit_code
    out = _json(proc)
    assert out["compatible"] is False
    assert out["reasons"][0]["field"] == "model.revision"
    human = run_cli(server, "compat", INCOMPATIBLE_ID)
    assert "NOT compatible" in human.stdout and "model revision differs" in human.stdout


def test_job_jobs_cancel(server: Path) -> None:
    job_id = run_cli(server, "checkpoint", "--workload", "llm").stdout.strip()
    job = _json(run_cli(server, "job", job_id, "--json"))
    assert job["id"] == job_id and job["state"] == "succeeded"
    jobs = _json(run_cli(server, "jobs", "--json"))["jobs"]
    assert [j["id"] for j in jobs] == [job_id]
    table = run_cli(server, "jobs").stdout.splitlines()
    assert table[0].split()[:4] == ["ID", "KIND", "WORKLOAD", "STATE"]
    assert table[1].split()[:4] == [job_id, "checkpoint", "llm", "succeeded"]
    assert _json(run_cli(server, "cancel", job_id, "--json"))["id"] == job_id
    assert "state" in run_cli(server, "job", job_id).stdout


def test_not_found_exits_3(server: Path) -> None:
    proc = run_cli(server, "job", "job-nope")
    assert proc.returncode == EXIT_NOT_FOUND
    assert proc.stderr.strip() == "gpusnap: error: no job job-nope"
    proc = run_cli(server, "show", "ckpt-nope", "--json")
    assert proc.returncode == EXIT_NOT_FOUND
    assert _json(proc)["kind"] == "not_found"


def test_ls_show_workloads_status(server: Path, service: FakeService) -> None:
    listed = _json(run_cli(server, "ls", "--workload", "llm", "--json"))["checkpoints"]
    assert listed[0]["checkpoint_id"] == "ckpt-1"
    assert service.last_call() == ("list_checkpoints", {"workload": "llm"})
    table = run_cli(server, "ls").stdout.splitlines()
    assert table[0].split()[:2] == ["ID", "WORKLOAD"] and table[1].split()[:2] == ["ckpt-1", "llm"]
    shown = _json(run_cli(server, "show", "ckpt-1", "--json"))
    assert shown["stamp"]["model"]["revision"] == "abc123"
    assert "ckpt-1" in run_cli(server, "show", "ckpt-1").stdout
    workloads = _json(run_cli(server, "workloads", "--json"))["workloads"]
    assert workloads[0]["name"] == "llm"
    assert run_cli(server, "workloads").stdout.splitlines()[1].startswith("llm")
    status = _json(run_cli(server, "status", "--json"))
    assert status["version"] == "0.1.0"
    # How much of each workload's latest checkpoint this node's cache holds: typed, both ways.
    warm = {w["name"]: w["warm"] for w in status["workloads"]}
    assert warm["llm"] is None
    assert warm["tts"] == {
        "checkpoint_id": "ckpt-1",
        "bytes_warm": 3 << 30,
        "bytes_total": 4 << 30,
        "fraction": 0.75,
    }
    text = run_cli(server, "status").stdout
    assert "jobs_running: 0" in text
    (tts_row,) = [line for line in text.splitlines() if line.startswith("tts")]
    assert tts_row.endswith("75% of 4.00 GiB"), tts_row


def test_socket_from_environment(server: Path) -> None:
    proc = run_cli(None, "status", "--json", env={"GPUSNAP_SOCKET": str(server)})
    assert proc.returncode == 0, proc.stderr
    assert _json(proc)["version"] == "0.1.0"


def test_missing_socket_is_exit_5_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "nobody-home.sock"
    proc = run_cli(path, "status")
    assert proc.returncode == EXIT_DAEMON_UNREACHABLE
    assert proc.stdout == ""
    assert proc.stderr == (
        f"gpusnap: error: cannot reach gpusnapd at unix:{path}: No such file or directory\n"
    )
    proc = run_cli(path, "checkpoint", "--workload", "llm", "--json")
    assert proc.returncode == EXIT_DAEMON_UNREACHABLE
    assert _json(proc)["exit_code"] == EXIT_DAEMON_UNREACHABLE


def test_refused_socket_is_exit_5(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))  # bound, never listening: what a crashed daemon leaves behind
    try:
        proc = run_cli(path, "jobs")
    finally:
        s.close()
    assert proc.returncode == EXIT_DAEMON_UNREACHABLE
    assert proc.stderr.strip() == (
        f"gpusnap: error: cannot reach gpusnapd at unix:{path}: Connection refused"
    )


@pytest.mark.skipif(
    Path("/run/gpusnap/gpusnapd.sock").exists(), reason="a gpusnapd is installed and running here"
)
def test_default_socket_path_is_named() -> None:
    proc = run_cli(None, "status", env={"GPUSNAP_SOCKET": ""})
    # /run/gpusnap/gpusnapd.sock does not exist on a test machine (or is not ours).
    assert proc.returncode == EXIT_DAEMON_UNREACHABLE
    assert "cannot reach gpusnapd at unix:/run/gpusnap/gpusnapd.sock: " in proc.stderr
