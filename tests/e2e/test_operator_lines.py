"""The small things an operator reads, from a real daemon: a queued job says how to follow it,
``status`` says whether a cloud is watched, ``triggers`` shows a running workload's pid, a
restore blocked by an unreaped process says it is a zombie, and the demo says it ran without
a GPU and where ``--keep`` left its files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpusnap.daemon.host import proctree
from tests.support import workloads
from tests.support.daemons import Nodes
from tests.support.workloads import Started

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
NO_CLOUD = '[triggers]\nprovider = "none"\nlogind = false\n'


def test_a_checkpoint_without_wait_prints_its_id_and_how_to_follow_it(
    nodes: Nodes, tmp_path: Path, started: Started
) -> None:
    w = started(workloads.start_counter(tmp_path / "run"), steps=2)
    node = nodes.make("a", extra_config=NO_CLOUD).start()
    got = node.cli("checkpoint", "--pid", str(w.pid), "--leave-running")
    assert got.rc == 0, got.stderr
    job_id = got.stdout.strip()
    assert got.stdout == f"{job_id}\n"  # what a script reads
    assert got.stderr == (
        f"checkpoint job {job_id} queued: `gpusnap job {job_id}` shows how it goes "
        "(--wait follows it to its end)\n"
    )


def test_status_and_triggers_say_what_is_watched_and_which_workload_runs(
    nodes: Nodes, tmp_path: Path, started: Started
) -> None:
    w = started(workloads.start_counter(tmp_path / "run"), steps=1)
    pid_file = tmp_path / "svc.pid"
    pid_file.write_text(f"{w.pid}\n")
    workload = f'[[workload]]\nname = "svc"\npid_file = "{pid_file}"\n'
    node = nodes.make("a", extra_config=NO_CLOUD + workload).start()
    status = node.cli("status")
    assert "triggers: none (no cloud watcher)" in status.stdout.splitlines()
    as_json = node.cli("status", "--json").json
    assert (as_json["triggers"], as_json["trigger_provider"]) == (False, "none")

    triggers = node.cli("triggers")
    row = next(ln for ln in triggers.stdout.splitlines() if ln.startswith("svc "))
    assert row.split()[:2] == ["svc", str(w.pid)], triggers.stdout
    (state,) = node.cli("triggers", "--json").json["workloads"]
    assert state["pid"] == w.pid


def test_a_restore_blocked_by_a_zombie_says_so(
    nodes: Nodes, tmp_path: Path, started: Started
) -> None:
    w = started(workloads.start_counter(tmp_path / "run"), steps=2)
    node = nodes.make("a", extra_config=NO_CLOUD).start()
    ck = node.cli("checkpoint", "--pid", str(w.pid), "--wait", "--json")  # kill mode
    assert ck.rc == 0, ck.stderr
    # Dead, and not reaped by us, its parent: a zombie.
    workloads._poll(lambda: not proctree.exists(w.pid), 60, "the dumped workload to die")
    rs = node.cli("restore", ck.json["checkpoint_id"], "--wait")
    assert rs.rc == 1
    assert (
        f"pid {w.pid} of the checkpointed tree is in use here by a zombie (not yet reaped "
        "by its parent, pid "
    ) in rs.stderr, rs.stderr


def test_the_demo_says_it_ran_without_a_gpu_and_where_it_kept_its_files(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, str(REPO / "demo" / "run_demo.py"), "--steps", "80",
         "--checkpoint-after", "10", "--keep", "--workdir", str(work)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    assert out[0] == f"scratch directory: {work} (kept)"
    assert out[1].startswith("no GPU in this demo: tinylm runs on the CPU")
    assert out[-1].startswith(f"files kept in {work}: gpusnapd.toml, signing.key, store/")
    assert (work / "store").is_dir() and (work / "run" / "tokens.txt").is_file()
    assert '"gpu": false' in proc.stdout
