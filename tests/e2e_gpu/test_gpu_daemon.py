"""GPU checkpoints through the real daemon: real gpusnapd, real CRIU, real processes, the
fake CUDA driver in the daemon's GPU worker, the real CLI over the socket."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusnap.daemon.host import proctree
from tests.e2e_gpu.conftest import GpuNodes
from tests.fakes.fake_cuda import GIB, default_devices
from tests.support import workloads
from tests.support.workloads import Started, Workload

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 60
DRIVER_570 = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.10  "
    "Release Build  (dvs-builder@U16-I2-C03-12-4)  Thu Jan 16 2025"
)


def _checkpoint(node, w: Workload, *extra: str):
    ck = node.cli("checkpoint", "--pid", str(w.pid), *extra, "--wait", "--json")
    assert ck.rc == 0, ck.stderr + node.log()
    return ck.json


def test_checkpoint_locks_then_checkpoints_stamps_the_gpu_and_restore_remaps_and_unlocks(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    node, fake = gpu_nodes.make_gpu("a")
    node.start()
    w = started(workloads.start_counter(tmp_path / "run", steps=STEPS), steps=5)
    fake.add_process(w.pid, {default_devices()[0]["uuid"]: 3 * GIB})

    result = _checkpoint(node, w)
    assert fake.calls("lock", "checkpoint") == [("lock", w.pid), ("checkpoint", w.pid)]
    assert fake.state_of(w.pid) == "CHECKPOINTED"
    w.reap()
    assert not proctree.exists(w.pid)

    shown = node.cli("show", result["checkpoint_id"], "--json")
    assert shown.rc == 0, shown.stderr
    gpu = shown.json["stamp"]["gpu"]
    assert gpu["present"] is True
    assert gpu["count"] == 1 and gpu["devices"][0]["name"] == "NVIDIA H200"
    assert gpu["driver_version"] == "580.95.05"
    assert gpu["cuda_pids"] == [w.pid]
    assert gpu["bytes_per_device"] == {default_devices()[0]["uuid"]: 3 * GIB}
    assert gpu["memory_copy"] == "host-staged"

    rs = node.cli("restore", result["checkpoint_id"], "--wait", "--json")
    assert rs.rc == 0, rs.stderr + node.log()
    assert rs.json["mode"] == "restored", rs.json
    assert fake.calls("restore", "unlock")[-2:] == [("restore", w.pid), ("unlock", w.pid)]
    assert fake.state_of(w.pid) == "RUNNING"
    assert w.wait_done() == workloads.expected_lines("counter", STEPS)


def test_leave_running_thaws_the_gpu_state_and_the_workload_keeps_running(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    node, fake = gpu_nodes.make_gpu("a")
    node.start()
    w = started(workloads.start_counter(tmp_path / "run", steps=0), steps=5)
    fake.add_process(w.pid)

    _checkpoint(node, w, "--leave-running")
    assert fake.calls("lock", "checkpoint", "restore", "unlock") == [
        ("lock", w.pid),
        ("checkpoint", w.pid),
        ("restore", w.pid),
        ("unlock", w.pid),
    ]
    assert fake.state_of(w.pid) == "RUNNING"
    at = w.steps_done()
    w.wait_steps(at + 5)


def test_a_node_with_another_driver_version_cold_starts_and_says_why(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    a, fake_a = gpu_nodes.make_gpu("a")
    b, fake_b = gpu_nodes.make_gpu("b")
    fake_b.update(driver_line=DRIVER_570, cuda_version=12080)
    a.start()
    b.start()
    w = started(workloads.start_counter(tmp_path / "run", steps=0), steps=3)
    fake_a.add_process(w.pid)
    cid = _checkpoint(a, w)["checkpoint_id"]
    w.reap()

    verdict = b.cli("compat", cid, "--json")
    assert "driver version differs: checkpoint 580.95.05, this node 570.86.10" in verdict.stdout
    rs = b.cli("restore", cid, "--wait", "--json")
    assert rs.rc == 0, rs.stderr + b.log()
    assert rs.json["mode"] == "cold-start"
    assert any("driver version differs" in r for r in rs.json["reasons"]), rs.json["reasons"]
    assert fake_b.calls("restore") == []
    workloads.kill_tree(rs.json["pids"][0])


def test_too_little_free_gpu_memory_on_the_target_cold_starts_with_that_reason(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    a, fake_a = gpu_nodes.make_gpu("a")
    b, fake_b = gpu_nodes.make_gpu("b")
    crowded = default_devices()
    crowded[0]["reserved"] = 140 * GIB  # 1 GiB free of 141
    fake_b.update(devices=crowded)
    a.start()
    b.start()
    w = started(workloads.start_counter(tmp_path / "run", steps=0), steps=3)
    fake_a.add_process(w.pid, {crowded[0]["uuid"]: 2 * GIB})
    cid = _checkpoint(a, w)["checkpoint_id"]
    w.reap()

    rs = b.cli("restore", cid, "--wait", "--json")
    assert rs.rc == 0, rs.stderr + b.log()
    assert rs.json["mode"] == "cold-start"
    assert any(
        "has 1.00 GiB free, the checkpoint needs 2.00 GiB" in r for r in rs.json["reasons"]
    ), rs.json["reasons"]
    assert fake_b.calls("restore") == []
    workloads.kill_tree(rs.json["pids"][0])


def test_a_gpu_lock_timeout_fails_the_job_in_one_line_and_the_workload_runs_on(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    node, fake = gpu_nodes.make_gpu("a", gpu_config="lock_timeout_s = 0.2\n")
    node.start()
    w = started(workloads.start_counter(tmp_path / "run", steps=0), steps=3)
    fake.add_process(w.pid, lock_blocked=True)

    ck = node.cli("checkpoint", "--pid", str(w.pid), "--wait", "--json")
    assert ck.rc != 0
    message = ck.stderr.strip()
    assert "\n" not in message
    assert "failed" in message
    assert "CUDA_ERROR_NOT_READY" in message
    assert "the workload runs on" in message
    assert fake.call_args("lock")[0]["timeout_ms"] == 200
    assert fake.calls("checkpoint") == []
    assert fake.state_of(w.pid) == "RUNNING"
    at = w.steps_done()
    w.wait_steps(at + 3)  # still running, not frozen by a half-done dump


def test_custom_storage_streams_gpu_memory_to_the_store_and_restore_refills_it(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    node, fake = gpu_nodes.make_gpu("a")
    fake.update(custom_storage=True)
    node.start()
    w = started(workloads.start_counter(tmp_path / "run", steps=STEPS), steps=5)
    uuid = default_devices()[0]["uuid"]
    fake.add_process(w.pid, {uuid: 5 * 1024 * 1024 + 77}, seed=3)

    result = _checkpoint(node, w)
    ops = [op for op, _ in fake.calls()]
    assert "checkpoint" not in ops
    assert ops.index("checkpoint_custom_storage") < ops.index("operation_complete")
    w.reap()
    shown = node.cli("show", result["checkpoint_id"], "--json")
    assert shown.rc == 0, shown.stderr
    gpu = shown.json["stamp"]["gpu"]
    assert gpu["memory_copy"] == "custom-storage"
    assert gpu["bytes_per_device"] == {uuid: 5 * 1024 * 1024 + 77}
    assert [m["size"] for m in gpu["memory_files"]] == [5 * 1024 * 1024 + 77]

    rs = node.cli("restore", result["checkpoint_id"], "--wait", "--json")
    assert rs.rc == 0, rs.stderr + node.log()
    assert rs.json["mode"] == "restored", rs.json
    proc = fake.read()["processes"][str(w.pid)]
    assert proc["restore_check"] == "verified"
    assert proc["state"] == "RUNNING"
    assert w.wait_done() == workloads.expected_lines("counter", STEPS)
