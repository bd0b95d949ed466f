"""The fake driver's checkpoint API, used on one process from another, as cuda-checkpoint and
gpusnapd's worker use it: the state machine, lock timeouts, restores onto other nodes, pairs,
out of memory, pids without CUDA state, and copy time. docs/gpu.md cites each rule.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes import libcuda
from tests.fakes.libcuda import (
    Spawn,
    add_fault,
    checkpoint,
    control,
    err,
    free_memory,
    ok,
    wait_for,
)
from tests.fakes.libcuda.nodes import A0, B0, B1, GIB, MIB, gpu, one_gpu_node, write_node


def main_thread_syscall(pid: int) -> str:
    return Path(f"/proc/{pid}/syscall").read_text().split()[0]


# -- the checkpoint state machine, from another process ----------------------------------------


def test_state_machine_from_a_second_process_frees_device_memory_and_keeps_the_bytes(
    lib: Path, tmp_path: Path, spawn: Spawn
) -> None:
    e = libcuda.env(lib, one_gpu_node(tmp_path))
    p = spawn(tmp_path / "p", e, [(0, 4 * MIB), (0, 2 * MIB)])
    before = p.command("digest")
    assert all(a["intact"] for a in before["allocs"])
    total = 141 * GIB
    assert free_memory(e) == total - 6 * MIB
    pid = p.pid
    res = control(
        e,
        [
            ["init"],  # a restore needs cuInit in its caller; the other calls do not
            ["state", pid],
            ["unlock", pid],  # 1: not locked
            ["checkpoint", pid],  # 2: not locked
            ["lock", pid, 0],
            ["state", pid],
            ["lock", pid, 0],  # 5: already locked
            ["restore", pid, None],  # 6: not checkpointed
            ["checkpoint", pid],
            ["state", pid],
        ],
    )
    res = res[1:]
    assert ok(res[0]) == "RUNNING"
    assert [err(res[i]) for i in (1, 2, 5, 6)] == ["CUDA_ERROR_ILLEGAL_STATE"] * 4
    assert ok(res[4]) == "LOCKED" and ok(res[8]) == "CHECKPOINTED"
    assert free_memory(e) == total  # the checkpoint released its device memory

    # The process's own calls wait while it is not RUNNING (CPU threads go on).
    pending = p.begin("digest")
    wait_for(lambda: main_thread_syscall(pid) == "202", "the target to block in the driver (futex)")
    assert not pending.exists()

    res = control(
        e, [["init"], ["restore", pid, None], ["state", pid], ["unlock", pid], ["state", pid]]
    )
    assert [ok(r) for r in res[2::2]] == ["LOCKED", "RUNNING"]
    assert free_memory(e) == total - 6 * MIB
    assert p.result(pending) == before


def test_restore_thread_id_names_a_thread_of_the_target_called_cuda_and_hex_digits(
    lib: Path, tmp_path: Path, spawn: Spawn
) -> None:
    e = libcuda.env(lib, one_gpu_node(tmp_path))
    p = spawn(tmp_path / "p", e, [(0, MIB)])
    tid = ok(control(e, [["restore_tid", p.pid]])[0])
    assert tid != p.pid and re.fullmatch(r"cuda[0-9a-f]+", p.threads()[tid])
    # Any thread id of the process reaches it, as with cuda-checkpoint (its issue #41).
    assert ok(control(e, [["state", tid]])[0]) == "RUNNING"


def test_a_lock_that_times_out_answers_not_ready_and_leaves_the_process_running(
    lib: Path, tmp_path: Path, spawn: Spawn
) -> None:
    e = libcuda.env(lib, one_gpu_node(tmp_path, copy_gbps=0.01))  # 10 MB/s
    p = spawn(tmp_path / "p", e, [(0, 4096)])
    p.command("async_copy", 0, 20 * MIB)  # ~2 s of stream work, submitted and running
    res = control(e, [["lock", p.pid, 100], ["state", p.pid], ["lock", p.pid, 0], ["state", p.pid]])
    assert err(res[0]) == "CUDA_ERROR_NOT_READY"
    assert ok(res[1]) == "RUNNING"
    # Without a timeout the lock waits for the submitted work, then holds.
    assert "ok" in res[2] and ok(res[3]) == "LOCKED"


def test_pids_without_cuda_state_answer_as_the_driver_does(
    lib: Path, tmp_path: Path, spawn: Spawn
) -> None:
    e = libcuda.env(lib, one_gpu_node(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    plain = subprocess.Popen(["sleep", "600"])
    loaded = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nfrom cuda.bindings import driver as cu\n"
            "cu.cuDriverGetVersion()\nprint('ready', flush=True)\ntime.sleep(600)",
        ],
        env=e,
        stdout=subprocess.PIPE,
    )
    try:
        assert loaded.stdout is not None and loaded.stdout.readline() == b"ready\n"
        init_only = spawn(tmp_path / "init-only", e, [], contexts=[])
        calls = ["state", "restore_tid", "lock", "checkpoint", "unlock"]

        def answers(pid: int) -> list[str]:
            ops = [[c, pid, 0] if c == "lock" else [c, pid] for c in calls]
            return [r.get("error", r.get("ok")) for r in control(e, [["init"], *ops])[1:]]

        assert answers(gone.pid) == ["CUDA_ERROR_INVALID_VALUE"] * 5
        assert answers(0) == ["CUDA_ERROR_INVALID_VALUE"] * 5
        assert answers(plain.pid) == ["CUDA_ERROR_NOT_INITIALIZED"] * 5  # no driver there
        assert answers(loaded.pid) == ["CUDA_ERROR_NOT_INITIALIZED"] * 5  # driver, no cuInit
        # cuInit but never a context (an API server, a launcher): GetState says RUNNING,
        # nothing else finds CUDA state to act on.
        assert answers(init_only.pid) == ["RUNNING"] + ["CUDA_ERROR_NOT_INITIALIZED"] * 4
        child = init_only.command("fork")
        try:
            assert answers(child) == ["CUDA_ERROR_NOT_INITIALIZED"] * 5  # a fork child
        finally:
            os.kill(child, 9)
    finally:
        for proc in (plain, loaded):
            proc.kill()
            proc.wait()
        assert loaded.stdout is not None
        loaded.stdout.close()


# -- restore: onto other nodes, pairs, memory ----------------------------------------------------


def test_restore_onto_another_node_with_a_uuid_map_rehomes_the_process(
    lib: Path, tmp_path: Path, spawn: Spawn
) -> None:
    ea = libcuda.env(lib, write_node(tmp_path / "a", [gpu(0), gpu(1)]))
    eb = libcuda.env(lib, write_node(tmp_path / "b", [gpu(0, uuid=B0), gpu(1, uuid=B1)]))
    p = spawn(tmp_path / "p", ea, [(0, 2 * MIB), (1, 3 * MIB)])
    before = p.command("digest")
    checkpoint(ea, p.pid)
    pairs = [[A0, B1], [gpu(1)["uuid"], B0]]  # crossed over
    res = control(eb, [["init"], ["restore", p.pid, pairs], ["unlock", p.pid]])
    assert all("ok" in r for r in res), res
    after = p.command("digest")
    assert [a["sha256"] for a in after["allocs"]] == [a["sha256"] for a in before["allocs"]]
    assert [a["uuid"] for a in after["allocs"]] == [B1, B0]
    assert [free_memory(ea, i) for i in (0, 1)] == [141 * GIB] * 2
    assert [free_memory(eb, i) for i in (0, 1)] == [141 * GIB - 3 * MIB, 141 * GIB - 2 * MIB]
    # It lives on node b now: its new allocations are counted there.
    p.command("async_copy", 0, MIB)
    assert free_memory(eb, 1) == 141 * GIB - 3 * MIB


def test_restore_needs_a_pair_for_every_gpu_of_the_node_and_the_same_chip(
    lib: Path, tmp_path: Path, spawn: Spawn
) -> None:
    ea = libcuda.env(lib, write_node(tmp_path / "a", [gpu(0), gpu(1)]))
    eb = libcuda.env(
        lib, write_node(tmp_path / "b", [gpu(0, uuid=B0), gpu(1, uuid=B1, name="NVIDIA H100")])
    )
    p = spawn(tmp_path / "p", ea, [(0, MIB)])  # uses one GPU of two
    checkpoint(ea, p.pid)
    wrong = [
        [[A0, B0]],  # the process's GPU only: node b's other GPU is missing
        [[A0, B1], [gpu(1)["uuid"], B0]],  # onto an H100
        [[A0, B0], [A0, B1]],  # a source twice
        [[A0, B0], [gpu(1)["uuid"], "GPU-99999999-0000-4000-8000-000000000000"]],  # not on b
        None,  # no map: its GPU is not on node b
    ]
    # A caller that sees one GPU of two builds a one-pair map: refused the same way.
    narrow = libcuda.env(lib, tmp_path / "b", CUDA_VISIBLE_DEVICES="0")
    res = control(eb, [["init"], *[["restore", p.pid, w] for w in wrong], ["state", p.pid]])
    assert [err(r) for r in res[1:-1]] == ["CUDA_ERROR_INVALID_VALUE"] * len(wrong)
    assert ok(res[-1]) == "CHECKPOINTED"
    res = control(narrow, [["init"], ["devices"], ["restore", p.pid, [[A0, B0]]]])
    assert len(ok(res[1])) == 1 and err(res[2]) == "CUDA_ERROR_INVALID_VALUE"
    # None of those poisoned it: the right map works.
    res = control(
        eb, [["init"], ["restore", p.pid, [[A0, B0], [gpu(1)["uuid"], B1]]], ["unlock", p.pid]]
    )
    assert all("ok" in r for r in res), res
    assert p.command("digest")["allocs"][0]["intact"]


def test_restore_without_room_fails_out_of_memory_and_the_process_is_lost_for_good(
    lib: Path, tmp_path: Path, spawn: Spawn
) -> None:
    ea = libcuda.env(lib, one_gpu_node(tmp_path))
    eb = libcuda.env(lib, write_node(tmp_path / "b", [gpu(0, uuid=B0, total_memory=64 * MIB)]))
    p = spawn(tmp_path / "p", ea, [(0, 40 * MIB)])
    checkpoint(ea, p.pid)
    filler = spawn(tmp_path / "filler", eb, [(0, 30 * MIB)])
    res = control(eb, [["init"], ["restore", p.pid, [[A0, B0]]], ["state", p.pid]])
    assert err(res[1]) == "CUDA_ERROR_OUT_OF_MEMORY"
    assert ok(res[2]) == "CHECKPOINTED"
    assert free_memory(eb) == 34 * MIB  # nothing of it landed
    filler.kill()
    assert free_memory(eb) == 64 * MIB
    # cuda-checkpoint issue #44: once a restore ran out of memory, no later restore works and
    # unlock is an illegal state; only killing the process ends it.
    res = control(
        eb, [["init"], ["restore", p.pid, [[A0, B0]]], ["unlock", p.pid], ["state", p.pid]]
    )
    assert err(res[1]) == "CUDA_ERROR_OPERATING_SYSTEM"
    assert err(res[2]) == "CUDA_ERROR_ILLEGAL_STATE"
    assert ok(res[3]) == "CHECKPOINTED"
    res = control(ea, [["init"], ["restore", p.pid, None]])  # not on its old node either
    assert err(res[1]) == "CUDA_ERROR_OPERATING_SYSTEM"


def test_restore_needs_cuinit_in_the_caller(lib: Path, tmp_path: Path, spawn: Spawn) -> None:
    e = libcuda.env(lib, one_gpu_node(tmp_path))
    p = spawn(tmp_path / "p", e, [(0, MIB)])
    checkpoint(e, p.pid)
    res = control(e, [["restore", p.pid, None], ["init"], ["restore", p.pid, None]])
    assert err(res[0]) == "CUDA_ERROR_NOT_INITIALIZED"
    assert "ok" in res[2]


# -- time ------------------------------------------------------------------------------------


def test_copies_checkpoints_and_restores_take_at_least_their_bytes_over_copy_gbps(
    lib: Path, tmp_path: Path, spawn: Spawn
) -> None:
    gbps = 0.05  # 50 MB/s
    e = libcuda.env(lib, one_gpu_node(tmp_path, copy_gbps=gbps))
    n = 8 * MIB
    least = n / (gbps * 1e9)  # a lower bound the fake guarantees: no load can make it shorter
    res = control(e, [["init"], ["retain", 0], ["mem_alloc", n], ["htod_zeros", {"ref": 2}, n]])
    assert res[3]["seconds"] >= least
    p = spawn(tmp_path / "p", e, [(0, n)])
    res = control(
        e, [["init"], ["lock", p.pid, 0], ["checkpoint", p.pid], ["restore", p.pid, None]]
    )
    assert res[2]["seconds"] >= least and res[3]["seconds"] >= least
    # A caller with a deadline shorter than the copy loses: how deadline tests use it.
    slow = libcuda.env(lib, write_node(tmp_path / "slow", [gpu(0)], copy_gbps=0.001))
    q = spawn(tmp_path / "q", slow, [(0, 4096)])
    q.command("async_copy", 0, 50 * MIB)  # 50 s at 1 MB/s
    with pytest.raises(subprocess.TimeoutExpired):
        control(slow, [["lock", q.pid, 0]], timeout=1.0)


def test_a_target_that_cannot_run_hangs_its_caller_but_its_state_stays_readable(
    lib: Path, tmp_path: Path, spawn: Spawn
) -> None:
    e = libcuda.env(lib, one_gpu_node(tmp_path))
    p = spawn(tmp_path / "p", e, [(0, MIB)])
    os.kill(p.pid, signal.SIGSTOP)  # its restore thread cannot run (a CRIU freeze is the same)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            control(e, [["lock", p.pid, 0]], timeout=2.0)  # the caller's own deadline is the bound
        assert ok(control(e, [["state", p.pid]])[0]) == "RUNNING"
    finally:
        os.kill(p.pid, signal.SIGCONT)
    # The request reached it before its caller died: it is carried out once the target runs.
    wait_for(lambda: ok(control(e, [["state", p.pid]])[0]) == "LOCKED", "the lock to land")


def test_injected_faults_fail_or_hang_the_chosen_calls_a_given_number_of_times(
    lib: Path, tmp_path: Path, spawn: Spawn
) -> None:
    root = one_gpu_node(tmp_path)
    e = libcuda.env(lib, root)
    p = spawn(tmp_path / "p", e, [(0, MIB)])
    q = spawn(tmp_path / "q", e, [(0, MIB)])
    add_fault(root, "cuCheckpointProcessCheckpoint", pid=q.pid, error="CUDA_ERROR_UNKNOWN")
    res = control(
        e,
        [
            ["lock", p.pid, 0],
            ["lock", q.pid, 0],
            ["checkpoint", p.pid],
            ["checkpoint", q.pid],  # 3: the fault, before anything happened
            ["state", q.pid],
            ["checkpoint", q.pid],  # once only
        ],
    )
    assert "ok" in res[2] and err(res[3]) == "CUDA_ERROR_UNKNOWN"
    assert ok(res[4]) == "LOCKED" and "ok" in res[5]
    # "after": the driver did it, then never answered.
    add_fault(root, "cuCheckpointProcessRestore", pid=p.pid, hang_s=600, after=True)
    with pytest.raises(subprocess.TimeoutExpired):
        control(e, [["init"], ["restore", p.pid, None]], timeout=3.0)
    assert ok(control(e, [["state", p.pid]])[0]) == "LOCKED"
    add_fault(root, "cuInit", error="CUDA_ERROR_NO_DEVICE", times=2)
    res = [control(e, [["init"]])[0] for _ in range(3)]
    assert [r.get("error") for r in res] == ["CUDA_ERROR_NO_DEVICE"] * 2 + [None]
