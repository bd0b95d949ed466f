"""Per-workload hooks through the real daemon: ``pre_checkpoint`` before anything is frozen,
``post_thaw`` once the workload runs on, ``post_restore`` after a restore; their output in the
job's hook log. Each hook asks the fake driver the workload's GPU state as it runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import libcuda
from tests.gpu.lm import reference_tokens, start_device_lm
from tests.support import workloads
from tests.support.fake_gpu import GpuNode, GpuNodes
from tests.support.workloads import Started

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 40
PACE = ("--interval", "0.05")
CTL = Path(libcuda.__file__).with_name("ctl.py")


def _with_hooks(g: GpuNode, tmp_path: Path, *, pre_status: int = 0) -> Path:
    """Give node ``g`` a ``[[workload]] device_lm`` whose hooks record what they saw."""
    seen = tmp_path / "seen"
    seen.mkdir()
    script = tmp_path / "hook.sh"
    script.write_text(
        "#!/bin/sh\n"
        'echo "hook $GPUSNAP_HOOK of $GPUSNAP_WORKLOAD, pid $GPUSNAP_PID"'
        ' "(${GPUSNAP_CHECKPOINT_ID:-})"\n'
        f'echo "[[\\"state\\", $GPUSNAP_PID]]" | {sys.executable} {CTL} > {seen}/$GPUSNAP_HOOK\n'
        f'[ "$GPUSNAP_HOOK" = pre_checkpoint ] && exit {pre_status}\n'
        "exit 0\n"
    )
    hook = f'["/bin/sh", "{script}"]'
    config = g.node.config_path
    config.write_text(
        config.read_text()
        + f"""[[workload]]
name = "device_lm"
hooks = {{ pre_checkpoint = {hook}, post_thaw = {hook}, post_restore = {hook}, timeout_s = 60 }}
"""
    )
    return seen


def _state_seen(seen: Path, hook: str) -> Any:
    return json.loads((seen / hook).read_text())[0].get("ok")


def test_hooks_run_around_a_leave_running_checkpoint_and_a_restore(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    a = gpu_nodes.make_gpu("a")
    seen = _with_hooks(a, tmp_path)
    a.node.start()
    w = started(start_device_lm(a.fake.env, tmp_path / "run", *PACE, steps=0), steps=5)

    ck = a.cli("checkpoint", "--pid", str(w.pid), "--leave-running", "--wait", "--json")
    assert ck.rc == 0, ck.stderr + a.node.log()
    assert _state_seen(seen, "pre_checkpoint") == "RUNNING"  # before anything was frozen
    assert _state_seen(seen, "post_thaw") == "RUNNING"  # after the thaw
    ran = ck.json["hooks"]
    assert [(h["hook"], h["exit_status"]) for h in ran] == [("pre_checkpoint", 0), ("post_thaw", 0)]
    log = Path(ran[0]["log"]).read_text()
    assert f"hook pre_checkpoint of device_lm, pid {w.pid}" in log
    assert f"hook post_thaw of device_lm, pid {w.pid}" in log

    (seen / "pre_checkpoint").unlink()
    ck = a.cli("checkpoint", "--pid", str(w.pid), "--wait", "--json")
    assert ck.rc == 0, ck.stderr + a.node.log()
    assert [h["hook"] for h in ck.json["hooks"]] == ["pre_checkpoint"]  # kill mode: gone
    w.reap()
    rs = a.cli("restore", ck.json["checkpoint_id"], "--wait", "--json")
    assert rs.rc == 0, rs.stderr + a.node.log()
    assert [(h["hook"], h["exit_status"]) for h in rs.json["hooks"]] == [("post_restore", 0)]
    assert _state_seen(seen, "post_restore") == "RUNNING"
    restored_log = Path(rs.json["hooks"][0]["log"]).read_text()
    assert (
        f"hook post_restore of device_lm, pid {w.pid} ({ck.json['checkpoint_id']})" in restored_log
    )
    w.wait_steps(w.steps_done() + 3)  # and it goes on
    workloads.kill_tree(rs.json["pids"][0])


def test_a_failing_pre_checkpoint_fails_the_job_before_anything_is_frozen(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    a = gpu_nodes.make_gpu("a")
    seen = _with_hooks(a, tmp_path, pre_status=3)
    a.node.start()
    # Long enough (10 s) to be running still after two hooks and a CLI round trip, each a
    # fresh interpreter: a finished workload answers GetState as no CUDA process at all.
    steps = 200
    expected = reference_tokens(a.fake.env, tmp_path / "ref", steps=steps)
    w = started(start_device_lm(a.fake.env, tmp_path / "run", *PACE, steps=steps), steps=5)
    ck = a.cli("checkpoint", "--pid", str(w.pid), "--wait", "--json")
    assert ck.rc != 0
    message = ck.stderr.strip()
    assert "pre_checkpoint hook exited with status 3; nothing was frozen" in message, message
    assert "\n" not in message
    assert _state_seen(seen, "post_thaw") == "RUNNING"  # told to go on
    assert a.fake.state(w.pid) == "RUNNING"
    assert w.wait_done() == expected  # never frozen, never dumped
