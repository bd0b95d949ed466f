"""``gpusnap exec``: io_uring off for the command and every process it starts, and nothing
else changed. Real processes: the probe (tests/support/iouring_probe.py) tries
``io_uring_setup`` itself and in a child of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpusnap.daemon.host import coldstart
from gpusnap.daemon.host.coldstart import StartSpec
from tests.cli._cli import GPUSNAP, Cli

PROBE = Path(__file__).parents[1] / "support" / "iouring_probe.py"


def _run(argv: list[str], tmp: Path, *, status: int = 0) -> tuple[int, dict[str, object]]:
    """Run the probe through ``argv``'s prefix in ``tmp/work`` with PROBE_VALUE set and one
    extra descriptor (a pipe) open; its exit status and its report."""
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    out = tmp / "report.json"
    r, w = os.pipe()
    try:
        proc = subprocess.Popen(
            [*argv, sys.executable, str(PROBE), str(out), str(status)],
            cwd=work,
            env={**os.environ, "PROBE_VALUE": "kept as it was"},
            pass_fds=(w,),
        )
        rc = proc.wait(timeout=120)
    finally:
        os.close(r)
    report = json.loads(out.read_text())
    report["fd_passed"] = w in report["fds"]
    os.close(w)
    report["same_pid"] = report["pid"] == proc.pid
    return rc, report


def test_without_exec_io_uring_works(tmp_path: Path) -> None:
    rc, report = _run([], tmp_path)
    assert rc == 0
    assert report["self"] == "ok" and report["child"] == "ok"


def test_exec_turns_io_uring_off_for_the_command_and_its_children(tmp_path: Path) -> None:
    rc, report = _run([*GPUSNAP, "exec", "--"], tmp_path, status=7)
    assert report["self"] == "ENOSYS"
    assert report["child"] == "ENOSYS"
    # Nothing else changed: exit status, environment, cwd, descriptors, and the pid (exec'd).
    assert rc == 7
    assert report["env"] == "kept as it was"
    assert report["cwd"] == str(tmp_path / "work")
    assert report["fd_passed"]
    assert report["same_pid"]


def test_exec_without_the_separator(tmp_path: Path) -> None:
    rc, report = _run([*GPUSNAP, "exec"], tmp_path)
    assert rc == 0 and report["self"] == "ENOSYS"


def test_exec_bad_input_is_one_line(tmp_path: Path) -> None:
    cli = Cli()
    missing = cli("exec")
    assert missing.rc == 2 and "a COMMAND is required" in missing.err
    unknown = cli("exec", "--", "no-such-command-here")
    assert unknown.rc == 3
    assert unknown.err.strip() == "gpusnap: error: exec: no such command: no-such-command-here"
    notexe = cli("exec", str(tmp_path))
    assert notexe.rc == 1 and "not an executable file" in notexe.err


def _cold_start(tmp: Path, *, checkpoint_ready: bool) -> dict[str, object]:
    out = tmp / "report.json"
    spec = coldstart.from_config(
        StartSpec(
            (sys.executable, str(PROBE), str(out)),
            cwd=str(tmp),
            env={"PROBE_VALUE": "v"},
            checkpoint_ready=checkpoint_ready,
        )
    )
    proc = coldstart.launch(spec, tmp / "cold.log")
    assert proc.wait(timeout=120) == 0, (tmp / "cold.log").read_text()
    report: dict[str, object] = json.loads(out.read_text())
    return report


def test_a_cold_start_is_checkpoint_ready_by_default(tmp_path: Path) -> None:
    report = _cold_start(tmp_path, checkpoint_ready=True)
    assert report["self"] == "ENOSYS" and report["child"] == "ENOSYS"
    assert report["env"] == "v"


def test_a_cold_start_with_checkpoint_ready_false_keeps_io_uring(tmp_path: Path) -> None:
    report = _cold_start(tmp_path, checkpoint_ready=False)
    assert report["self"] == "ok" and report["child"] == "ok"
