"""GPU checkpoints through the real daemon: real gpusnapd and CLI, real CRIU, real CUDA
processes; the daemon's GPU worker runs the real ``driver.py`` through the real cuda-bindings
against the fake ``libcuda.so.1`` of each node (``tests/support/fake_gpu.py``)."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.host import proctree
from tests.fakes.libcuda import A0, B0, B1, GIB, MIB, ROOT_ENV, Spawn, gpu, wait_for
from tests.gpu.lm import device_lm_command, reference_tokens, start_device_lm
from tests.support import workloads
from tests.support.fake_gpu import GpuNode, GpuNodes
from tests.support.workloads import Started, Workload

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 60
PACE = ("--interval", "0.05")
HELD = 5 * MIB  # device_lm's weights (4 MiB) and KV pool (1 MiB) per worker
A1 = gpu(1)["uuid"]
HANG_GUARD = 120.0


def _checkpoint(g: GpuNode, w: Workload, *extra: str) -> dict[str, Any]:
    ck = g.cli("checkpoint", "--pid", str(w.pid), *extra, "--wait", "--json")
    assert ck.rc == 0, ck.stderr + g.node.log()
    result: dict[str, Any] = ck.json
    return result


def _gpu_stamp(g: GpuNode, checkpoint_id: str) -> dict[str, Any]:
    shown = g.cli("show", checkpoint_id, "--json")
    assert shown.rc == 0, shown.stderr
    stamp: dict[str, Any] = shown.json["stamp"]["gpu"]
    return stamp


def test_a_model_in_device_memory_goes_on_bit_exactly_after_a_kill_and_a_restore_elsewhere(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    a = gpu_nodes.make_gpu("a")
    b = gpu_nodes.make_gpu("b", [gpu(0, uuid=B0)])
    a.node.start()
    b.node.start()
    expected = reference_tokens(a.fake.env, tmp_path / "ref", steps=STEPS)
    w = started(start_device_lm(a.fake.env, tmp_path / "run", *PACE, steps=STEPS), steps=10)
    assert a.fake.free() == 141 * GIB - HELD

    result = _checkpoint(a, w)
    w.reap()  # kill mode: CRIU killed it once dumped
    assert not proctree.exists(w.pid)
    assert a.fake.free() == 141 * GIB
    gpu_stamp = _gpu_stamp(a, result["checkpoint_id"])
    assert gpu_stamp["present"] is True and gpu_stamp["memory_copy"] == "host-staged"
    assert [d["uuid"] for d in gpu_stamp["devices"]] == [A0]
    assert gpu_stamp["driver_version"] == "580.95.05"
    assert gpu_stamp["cuda_pids"] == [w.pid]
    assert gpu_stamp["processes"] == [{"pid": w.pid, "bytes_per_device": {A0: HELD}, "bytes": HELD}]

    rs = b.cli("restore", result["checkpoint_id"], "--wait", "--json")
    assert rs.rc == 0, rs.stderr + b.node.log()
    assert rs.json["mode"] == "restored", rs.json
    assert b.fake.free() == 141 * GIB - HELD  # it lives on node b's GPU now
    assert w.wait_done() == expected


def test_leave_running_gives_the_gpu_memory_back_and_the_model_goes_on(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    a = gpu_nodes.make_gpu("a")
    a.node.start()
    expected = reference_tokens(a.fake.env, tmp_path / "ref", steps=STEPS)
    w = started(start_device_lm(a.fake.env, tmp_path / "run", *PACE, steps=STEPS), steps=10)
    result = _checkpoint(a, w, "--leave-running")
    assert result["leave_running"] is True
    assert a.fake.state(w.pid) == "RUNNING"
    assert a.fake.free() == 141 * GIB - HELD  # back on the GPU after the thaw
    assert w.wait_done() == expected


@pytest.fixture
def libnccl(tmp_path: Path) -> Path:
    """A ``libnccl.so.2`` carrying NCCL's version banner (what the stamp reads it from)."""
    src = tmp_path / "nccl.c"
    src.write_text(
        '__attribute__((used)) const char nccl_banner[] = "NCCL version 2.21.5+cuda12.4";\n'
    )
    lib = tmp_path / "nccl" / "libnccl.so.2"
    lib.parent.mkdir()
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def _workers(root: int) -> list[int]:
    """The tensor-parallel workers of a device_lm tree, in rank order."""
    found = []
    for pid in workloads.descendants_of(root):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--worker" in cmd:
            found.append((int(cmd[cmd.index(b"--worker") + 1]), pid))
    return [pid for _rank, pid in sorted(found)]


def test_a_two_gpu_tree_with_a_non_cuda_parent_moves_to_a_node_with_other_uuids(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started, libnccl: Path
) -> None:
    """An API-server-like parent without CUDA, an engine core that ran cuInit only, and two
    workers, one per GPU, mapping NCCL: lock all, checkpoint each, dump; restore each onto
    node b's GPUs; a node with one GPU cold-starts it and says why."""
    a = gpu_nodes.make_gpu("a", [gpu(0), gpu(1)])
    b = gpu_nodes.make_gpu("b", [gpu(0, uuid=B0), gpu(1, uuid=B1)])
    c = gpu_nodes.make_gpu("c", [gpu(0, uuid=B0)])
    for g in (a, b, c):
        g.node.start()
    tree = ("--tp", "2", "--engine-core", "--nccl", str(libnccl))
    expected = reference_tokens(a.fake.env, tmp_path / "ref", *tree, steps=STEPS)
    w = started(start_device_lm(a.fake.env, tmp_path / "run", *PACE, *tree, steps=STEPS), steps=10)
    w0, w1 = _workers(w.pid)

    result = _checkpoint(a, w)
    w.reap()
    gpu_stamp = _gpu_stamp(a, result["checkpoint_id"])
    assert gpu_stamp["cuda_pids"] == [w0, w1]  # not the parent, not the engine core
    nccl = {"path": str(libnccl), "version": "2.21.5"}
    assert gpu_stamp["processes"] == [
        {"pid": w0, "bytes_per_device": {A0: HELD}, "bytes": HELD, "nccl": nccl},
        {"pid": w1, "bytes_per_device": {A1: HELD}, "bytes": HELD, "nccl": nccl},
    ]

    rs = b.cli("restore", result["checkpoint_id"], "--wait", "--json")
    assert rs.rc == 0, rs.stderr + b.node.log()
    assert rs.json["mode"] == "restored", rs.json
    assert [b.fake.free(0), b.fake.free(1)] == [141 * GIB - HELD] * 2
    assert w.wait_done() == expected

    verdict = c.cli("compat", result["checkpoint_id"], "--json")
    assert "checkpoint was taken with 2 GPU(s), this node has 1" in verdict.stdout
    rs = c.cli("restore", result["checkpoint_id"], "--wait", "--json")
    assert rs.rc == 0, rs.stderr + c.node.log()
    assert rs.json["mode"] == "cold-start"
    assert any("2 GPU(s), this node has 1" in r for r in rs.json["reasons"]), rs.json
    workloads.kill_tree(rs.json["pids"][0])


def _cold_start_config(g_root: Path, fake_env: dict[str, str], out: Path) -> str:
    """A ``[[workload]]`` for device_lm whose cold start runs on this node's GPUs."""
    command = ", ".join(f'"{c}"' for c in device_lm_command(out, "--steps", "0", *PACE))
    env = {k: fake_env[k] for k in ("LD_LIBRARY_PATH", ROOT_ENV, "PYTHONPATH")}
    env_toml = ", ".join(f'{k} = "{v}"' for k, v in env.items())
    return f"""[[workload]]
name = "device_lm"
start = {{ command = [{command}], env = {{ {env_toml} }}, cwd = "{g_root}" }}
"""


def test_a_restore_that_runs_out_of_gpu_memory_is_a_cold_start_with_the_reason(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started, spawn: Spawn
) -> None:
    big = ("--weights-mib", "40")
    a = gpu_nodes.make_gpu("a")
    b = gpu_nodes.make_gpu("b", [gpu(0, uuid=B0, total_memory=64 * MIB)])
    cold_out = tmp_path / "cold" / "tokens"
    cold_out.parent.mkdir()
    config = b.node.config_path
    config.write_text(
        config.read_text() + _cold_start_config(cold_out.parent, b.fake.env, cold_out)
    )
    a.node.start()
    b.node.start()
    w = started(start_device_lm(a.fake.env, tmp_path / "run", *PACE, *big, steps=0), steps=5)
    checkpoint_id = _checkpoint(a, w)["checkpoint_id"]
    w.reap()

    # The gate finds 64 MiB free for 41; another tenant takes 30 MiB before the driver call.
    held = b.fake.fault("cuCheckpointProcessRestore", hold=True)
    job: dict[str, Any] = {}
    restore = threading.Thread(
        target=lambda: job.update(b.cli("restore", checkpoint_id, "--wait", "--json").json)
    )
    restore.start()
    held.wait_claimed("the daemon's GPU restore")
    spawn(tmp_path / "tenant", b.fake.env, [(0, 30 * MIB)])
    held.release()
    restore.join(HANG_GUARD)
    assert job["state"] == "succeeded", job
    assert job["mode"] == "cold-start", job
    reason = " ".join(job["reasons"])
    assert "CUDA_ERROR_OUT_OF_MEMORY" in reason and "were killed" in reason, reason
    assert any(d["field"] == "gpu.restore" for d in job["reason_details"])
    wait_for(lambda: not proctree.exists(w.pid), "the lost process to go")
    cold = Workload("device_lm", subprocess.Popen(["true"]), cold_out.parent, cold_out, 0)
    cold.wait_steps(3)  # the cold start runs, on node b
    workloads.kill_tree(job["pids"][0])
    cold.proc.wait()


def test_a_node_with_another_driver_version_cold_starts_and_says_why(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    a = gpu_nodes.make_gpu("a")
    b = gpu_nodes.make_gpu("b", [gpu(0, uuid=B0)], driver_version_string="580.105.08")
    a.node.start()
    b.node.start()
    w = started(start_device_lm(a.fake.env, tmp_path / "run", *PACE, steps=0), steps=3)
    checkpoint_id = _checkpoint(a, w)["checkpoint_id"]
    w.reap()

    why = "driver version differs: checkpoint 580.95.05, this node 580.105.08"
    assert why in b.cli("compat", checkpoint_id, "--json").stdout
    rs = b.cli("restore", checkpoint_id, "--wait", "--json")
    assert rs.rc == 0, rs.stderr + b.node.log()
    assert rs.json["mode"] == "cold-start"
    assert any(why in r for r in rs.json["reasons"]), rs.json["reasons"]
    assert b.fake.state(w.pid) == "CUDA_ERROR_INVALID_VALUE"  # never restored: no such pid
    workloads.kill_tree(rs.json["pids"][0])


def test_a_gpu_lock_that_times_out_fails_the_job_in_one_line_and_the_workload_runs_on(
    gpu_nodes: GpuNodes, tmp_path: Path, spawn: Spawn
) -> None:
    a = gpu_nodes.make_gpu("a", copy_gbps=0.01, gpu_config="lock_timeout_s = 0.2\n")
    a.node.start()
    p = spawn(tmp_path / "p", a.fake.env, [(0, MIB)])
    before = p.command("digest")
    p.command("async_copy", 0, 30 * MIB)  # three seconds of stream work in flight
    ck = a.cli("checkpoint", "--pid", str(p.pid), "--wait", "--json")
    assert ck.rc != 0
    message = ck.stderr.strip()
    assert "\n" not in message
    assert f"cuCheckpointProcessLock({p.pid}) failed: CUDA_ERROR_NOT_READY" in message
    assert "the workload runs on" in message
    assert a.fake.state(p.pid) == "RUNNING"
    p.command("synchronize")
    assert p.command("digest") == before


def test_a_hung_driver_call_is_killed_at_its_deadline_and_the_workload_runs_on(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    a = gpu_nodes.make_gpu("a", gpu_config="call_timeout_s = 5\n")
    a.node.start()
    expected = reference_tokens(a.fake.env, tmp_path / "ref", steps=STEPS)
    w = started(start_device_lm(a.fake.env, tmp_path / "run", *PACE, steps=STEPS), steps=5)
    # The driver checkpoints the process, then never answers.
    a.fake.fault("cuCheckpointProcessCheckpoint", pid=w.pid, hang_s=600, after=True)
    ck = a.cli("checkpoint", "--pid", str(w.pid), "--wait", "--json")
    assert ck.rc != 0
    message = ck.stderr.strip()
    assert f"cuCheckpointProcessCheckpoint({w.pid}) did not return within 5" in message
    assert "of device memory at 1 GB/s); worker restarted" in message
    assert f"process {w.pid} is CHECKPOINTED" in message and "rolled back" in message
    assert w.wait_done() == expected


def test_custom_storage_takes_device_memory_through_the_store_and_back_byte_for_byte(
    gpu_nodes: GpuNodes, tmp_path: Path, spawn: Spawn
) -> None:
    cs: dict[str, Any] = {"custom_storage": True, "driver_version": 13040}
    a = gpu_nodes.make_gpu("a", [gpu(0), gpu(1)], **cs)
    b = gpu_nodes.make_gpu("b", [gpu(0, uuid=B0), gpu(1, uuid=B1)], **cs)
    a.node.start()
    b.node.start()
    p = spawn(tmp_path / "p", a.fake.env, [(0, 3 * MIB + 77), (1, MIB), (0, 2 * MIB)], seed=9)
    before = p.command("digest")
    ck = a.cli("checkpoint", "--pid", str(p.pid), "--wait", "--json")
    assert ck.rc == 0, ck.stderr + a.node.log()
    assert p.proc.wait(60) == -9  # kill mode
    p.reaped()
    gpu_stamp = _gpu_stamp(a, ck.json["checkpoint_id"])
    assert gpu_stamp["memory_copy"] == "custom-storage"
    assert gpu_stamp["bytes_per_device"] == {A0: 5 * MIB + 77, A1: MIB}
    assert sorted(m["size"] for m in gpu_stamp["memory_files"]) == [MIB, 5 * MIB + 77]

    rs = b.cli("restore", ck.json["checkpoint_id"], "--wait", "--json")
    assert rs.rc == 0, rs.stderr + b.node.log()
    assert rs.json["mode"] == "restored", rs.json
    after = p.command("digest")
    assert [x["sha256"] for x in after["allocs"]] == [x["sha256"] for x in before["allocs"]]
    assert all(x["intact"] for x in after["allocs"])
    assert [x["uuid"] for x in after["allocs"]] == [B0, B1, B0]
    os.kill(p.pid, 9)
