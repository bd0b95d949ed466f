"""Freeze, thaw, rollback, deadlines and restore: the real worker and ``driver.py`` through the
real cuda-bindings, against the fake ``libcuda.so.1`` and real CUDA processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.gpu import GpuCoordinator, GpuFreeze
from gpusnap.daemon.gpu.worker import GpuWorker
from gpusnap.errors import DeadlineExceeded, FailedPrecondition, Internal, Unsupported
from tests.fakes.libcuda import (
    A0,
    B0,
    B1,
    GIB,
    MIB,
    CudaProcess,
    Spawn,
    checkpoint,
    control,
    gpu,
    ok,
    wait_for,
)
from tests.support.fake_gpu import Coordinators, FakeNode

A1 = gpu(1)["uuid"]


def _in_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run ``fn`` in a thread; the returned callable joins it and gives its result or error."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["ok"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()

    def join() -> Any:
        t.join(120)
        assert not t.is_alive(), "hang guard: the call did not return"
        if "error" in out:
            raise out["error"]
        return out["ok"]

    return join


@pytest.fixture
def one_process(fake_nodes, spawn: Spawn, tmp_path: Path) -> tuple[FakeNode, CudaProcess]:
    """Node ``a`` (one H200) and a CUDA process on it holding 1 MiB."""
    node: FakeNode = fake_nodes("a")
    return node, spawn(tmp_path / "p", node.env, [(0, MIB)])


@pytest.fixture
def two_processes(
    fake_nodes, spawn: Spawn, tmp_path: Path
) -> tuple[FakeNode, CudaProcess, CudaProcess]:
    """Node ``a`` and two CUDA processes on it holding 1 MiB each."""
    node: FakeNode = fake_nodes("a")
    a, b = (spawn(tmp_path / n, node.env, [(0, MIB)]) for n in "ab")
    return node, a, b


def _digests(*procs: CudaProcess) -> list[Any]:
    return [p.command("digest")["allocs"] for p in procs]


def test_freeze_locks_every_process_before_checkpointing_any(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, tmp_path: Path
) -> None:
    node: FakeNode = fake_nodes("a")
    a, b, c = (spawn(tmp_path / n, node.env, [(0, MIB)]) for n in "abc")
    held = node.fault("cuCheckpointProcessCheckpoint", pid=a.pid, hold=True)
    coordinator = coordinators(node)
    done = _in_thread(lambda: coordinator.freeze([a.pid, b.pid, c.pid]))
    held.wait_claimed("the first checkpoint")
    assert [node.state(p.pid) for p in (a, b, c)] == ["LOCKED"] * 3
    held.release()
    freeze = done()
    assert freeze.cuda_pids == [a.pid, b.pid, c.pid]
    assert [node.state(p.pid) for p in (a, b, c)] == ["CHECKPOINTED"] * 3


def test_a_serving_tree_freezes_its_workers_and_leaves_the_rest_alone(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, tmp_path: Path
) -> None:
    """An API server without CUDA, an engine core that ran cuInit only (GetState says RUNNING,
    locking it fails), a pid that has exited, and two workers (issue 10 §2.4)."""
    node: FakeNode = fake_nodes("a", [gpu(0), gpu(1)])
    plain = subprocess.Popen(["sleep", "600"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        engine = spawn(tmp_path / "engine", node.env, [], contexts=[])
        assert node.state(engine.pid) == "RUNNING"  # what the driver says of it
        w0 = spawn(tmp_path / "w0", node.env, [(0, 2 * MIB)])
        w1 = spawn(tmp_path / "w1", node.env, [(1, 3 * MIB)])
        coordinator = coordinators(node)
        pids = [plain.pid, engine.pid, gone.pid, w0.pid, w1.pid]
        freeze = coordinator.freeze(pids)
        assert freeze.cuda_pids == [w0.pid, w1.pid]
        assert node.state(engine.pid) == "RUNNING"
        coordinator.thaw(freeze)
        assert all(a["intact"] for d in _digests(w0, w1) for a in d)
    finally:
        plain.kill()
        plain.wait()


def test_freeze_measures_what_each_process_held_on_each_gpu(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, tmp_path: Path
) -> None:
    node: FakeNode = fake_nodes("a", [gpu(0), gpu(1)])
    a = spawn(tmp_path / "a", node.env, [(0, 3 * MIB), (1, MIB)])
    b = spawn(tmp_path / "b", node.env, [(0, 2 * MIB)])
    freeze = coordinators(node).freeze([a.pid, b.pid])
    assert freeze.bytes_per_device == {A0: 5 * MIB, A1: MIB}
    stamp = freeze.to_stamp()
    assert stamp["bytes_total"] == 6 * MIB
    assert stamp["processes"] == [
        {"pid": a.pid, "bytes_per_device": {A0: 3 * MIB, A1: MIB}, "bytes": 4 * MIB},
        {"pid": b.pid, "bytes_per_device": {A0: 2 * MIB}, "bytes": 2 * MIB},
    ]
    assert node.free(0) == 141 * GIB and node.free(1) == 141 * GIB


def test_thaw_restores_all_then_unlocks_all_and_the_memory_is_back(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, tmp_path: Path
) -> None:
    node: FakeNode = fake_nodes("a")
    a = spawn(tmp_path / "a", node.env, [(0, MIB)], seed=1)
    b = spawn(tmp_path / "b", node.env, [(0, 2 * MIB)], seed=2)
    before = _digests(a, b)
    coordinator = coordinators(node)
    freeze = coordinator.freeze([a.pid, b.pid])
    assert node.free() == 141 * GIB
    held = node.fault("cuCheckpointProcessUnlock", pid=a.pid, hold=True)
    done = _in_thread(lambda: coordinator.thaw(freeze))
    held.wait_claimed("the first unlock")
    assert [node.state(a.pid), node.state(b.pid)] == ["LOCKED", "LOCKED"]  # both restored
    held.release()
    done()
    assert [node.state(a.pid), node.state(b.pid)] == ["RUNNING", "RUNNING"]
    assert _digests(a, b) == before
    assert node.free() == 141 * GIB - 3 * MIB


def test_a_failed_checkpoint_of_the_second_process_rolls_both_back(
    two_processes: tuple[FakeNode, CudaProcess, CudaProcess], coordinators: Coordinators
) -> None:
    node, a, b = two_processes
    before = _digests(a, b)
    node.fault("cuCheckpointProcessCheckpoint", pid=b.pid, error="CUDA_ERROR_UNKNOWN")
    with pytest.raises(Internal) as caught:
        coordinators(node).freeze([a.pid, b.pid])
    message = str(caught.value)
    assert f"cuCheckpointProcessCheckpoint({b.pid}) failed: CUDA_ERROR_UNKNOWN" in message
    assert "rolled back" in message and "the workload runs on" in message
    assert "\n" not in message
    assert [node.state(a.pid), node.state(b.pid)] == ["RUNNING", "RUNNING"]
    assert _digests(a, b) == before


def test_a_lock_that_times_out_reports_not_ready_and_rolls_back(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, tmp_path: Path
) -> None:
    node: FakeNode = fake_nodes("a", copy_gbps=0.01)  # 10 MB/s
    a = spawn(tmp_path / "a", node.env, [(0, 4096)])
    b = spawn(tmp_path / "b", node.env, [(0, 4096)])
    b.command("async_copy", 0, 20 * MIB)  # two seconds of stream work in flight
    with pytest.raises(DeadlineExceeded) as caught:
        coordinators(node).freeze([a.pid, b.pid], lock_timeout_ms=50)
    assert f"cuCheckpointProcessLock({b.pid}) failed: CUDA_ERROR_NOT_READY" in str(caught.value)
    assert "rolled back" in str(caught.value)
    assert [node.state(a.pid), node.state(b.pid)] == ["RUNNING", "RUNNING"]


def test_a_hung_call_is_killed_at_its_deadline_and_the_state_is_named(
    one_process: tuple[FakeNode, CudaProcess], coordinators: Coordinators
) -> None:
    node, p = one_process
    coordinator = coordinators(node)
    first = coordinator._worker.pid
    coordinator._worker.call_timeout_s = 2.0  # after the worker started with the default
    # The driver locks the process and then never answers.
    node.fault("cuCheckpointProcessLock", pid=p.pid, hang_s=600, after=True)
    with pytest.raises(DeadlineExceeded) as caught:
        coordinator.freeze([p.pid], lock_timeout_ms=0)
    message = str(caught.value)
    assert f"cuCheckpointProcessLock({p.pid}) did not return within 2s" in message
    assert f"process {p.pid} is LOCKED" in message and "worker restarted" in message
    assert "rolled back" in message  # by the new worker
    assert node.state(p.pid) == "RUNNING"
    assert coordinator._worker.pid not in (None, first)
    assert coordinator.freeze([p.pid]).cuda_pids == [p.pid]  # the new worker serves
    assert node.state(p.pid) == "CHECKPOINTED"


def test_checkpoint_and_restore_deadlines_grow_with_the_processs_device_memory(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, tmp_path: Path
) -> None:
    """A flat deadline kills a checkpoint that is merely large (issue 10 §2.6): here every
    call gets 2 s, and 64 MiB at the node's 20 MB/s take at least 3.3 s each way."""
    node: FakeNode = fake_nodes("a", copy_gbps=0.02)
    p = spawn(tmp_path / "p", node.env, [(0, 64 * MIB)])
    before = _digests(p)
    coordinator = coordinators(node, copy_rate_gbps=0.002)  # 2 s + 64 MiB at 2 MB/s: 35 s
    coordinator._worker.call_timeout_s = 2.0
    freeze = coordinator.freeze([p.pid])
    assert node.state(p.pid) == "CHECKPOINTED"
    coordinator.thaw(freeze)
    assert node.state(p.pid) == "RUNNING" and _digests(p) == before


def test_a_checkpoint_past_its_scaled_deadline_names_it_and_the_state(
    one_process: tuple[FakeNode, CudaProcess], coordinators: Coordinators
) -> None:
    node, p = one_process
    coordinator = coordinators(node, copy_rate_gbps=1.0)
    coordinator._worker.call_timeout_s = 2.0
    node.fault("cuCheckpointProcessCheckpoint", pid=p.pid, hang_s=600, after=True)
    with pytest.raises(DeadlineExceeded) as caught:
        coordinator.freeze([p.pid])
    message = str(caught.value)
    within = r"did not return within 2\.\d+s \(2s \+ 0\.00 GiB of device memory at 1 GB/s\)"
    assert f"cuCheckpointProcessCheckpoint({p.pid})" in message
    assert re.search(within, message), message
    assert f"process {p.pid} is CHECKPOINTED" in message
    assert "rolled back" in message and node.state(p.pid) == "RUNNING"


def test_an_out_of_order_call_is_an_illegal_state(
    one_process: tuple[FakeNode, CudaProcess], coordinators: Coordinators
) -> None:
    node, p = one_process
    coordinator = coordinators(node)
    coordinator.thaw(GpuFreeze(cuda_pids=[p.pid]))  # RUNNING: thaw has nothing to do
    with pytest.raises(FailedPrecondition, match="CUDA_ERROR_ILLEGAL_STATE"):
        coordinator._worker.call("unlock", p.pid)
    assert node.state(p.pid) == "RUNNING"


def test_freeze_refuses_a_process_someone_else_locked(
    one_process: tuple[FakeNode, CudaProcess], coordinators: Coordinators
) -> None:
    node, p = one_process
    ok(control(node.env, [["lock", p.pid, 0]])[0])  # cuda-checkpoint, say
    with pytest.raises(FailedPrecondition, match="is LOCKED, not RUNNING"):
        coordinators(node).freeze([p.pid])
    assert node.state(p.pid) == "LOCKED"


def _checkpointed(coordinator: GpuCoordinator, pids: list[int]) -> dict[str, Any]:
    """Freeze ``pids``; the stamp's gpu section, as the checkpoint body writes it."""
    return coordinator.stamp() | coordinator.freeze(pids).to_stamp()


def test_restore_puts_the_processes_back_and_unlocks(
    two_processes: tuple[FakeNode, CudaProcess, CudaProcess], coordinators: Coordinators
) -> None:
    node, a, b = two_processes
    before = _digests(a, b)
    coordinator = coordinators(node)
    coordinator.restore([a.pid, b.pid], _checkpointed(coordinator, [a.pid, b.pid]))
    assert [node.state(a.pid), node.state(b.pid)] == ["RUNNING", "RUNNING"]
    assert _digests(a, b) == before


def _checkpointed_then_crowded(
    fake_nodes: Callable[..., FakeNode], spawn: Spawn, coordinators: Coordinators, tmp: Path
) -> tuple[FakeNode, CudaProcess, GpuCoordinator, dict[str, Any]]:
    """A process holding 40 MiB of a 64 MiB GPU, checkpointed."""
    node = fake_nodes("a", [gpu(0, total_memory=64 * MIB)])
    p = spawn(tmp / "p", node.env, [(0, 40 * MIB)])
    coordinator = coordinators(node)
    return node, p, coordinator, _checkpointed(coordinator, [p.pid])


def test_a_restore_that_runs_out_of_memory_says_the_process_is_lost(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, tmp_path: Path
) -> None:
    node, p, coordinator, stamp = _checkpointed_then_crowded(
        fake_nodes, spawn, coordinators, tmp_path
    )
    # Another tenant takes the room after the free-memory check, before the driver call.
    held = node.fault("cuCheckpointProcessRestore", pid=p.pid, hold=True)
    done = _in_thread(lambda: coordinator.restore([p.pid], stamp))
    held.wait_claimed("the restore")
    spawn(tmp_path / "tenant", node.env, [(0, 30 * MIB)])
    held.release()
    with pytest.raises(FailedPrecondition) as caught:
        done()
    message = str(caught.value)
    assert f"cuCheckpointProcessRestore({p.pid}) failed: CUDA_ERROR_OUT_OF_MEMORY" in message
    assert f"process {p.pid} is CHECKPOINTED" in message
    assert "cannot be retried" in message and "lost" in message
    # NVIDIA/cuda-checkpoint#44, as the fake models it: no later restore works.
    res = control(node.env, [["init"], ["restore", p.pid, None]])
    assert res[1]["error"] == "CUDA_ERROR_OPERATING_SYSTEM"


def test_a_restore_without_the_free_memory_is_refused_before_the_driver_is_asked(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, tmp_path: Path
) -> None:
    node, p, coordinator, stamp = _checkpointed_then_crowded(
        fake_nodes, spawn, coordinators, tmp_path
    )
    tenant = spawn(tmp_path / "tenant", node.env, [(0, 30 * MIB)])
    with pytest.raises(FailedPrecondition, match=r"refused before asking the driver.*free"):
        coordinator.restore([p.pid], stamp)
    tenant.kill()
    coordinator.restore([p.pid], stamp)  # the driver was never asked: it still can be
    assert node.state(p.pid) == "RUNNING"


def test_restore_with_an_explicit_gpu_map_moves_the_process_onto_the_mapped_gpus(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, tmp_path: Path
) -> None:
    node: FakeNode = fake_nodes("a", [gpu(0), gpu(1)])
    p = spawn(tmp_path / "p", node.env, [(0, 4 * MIB)])
    coordinator = coordinators(node)
    coordinator.restore([p.pid], _checkpointed(coordinator, [p.pid]), gpu_map={A0: A1, A1: A0})
    assert [a["uuid"] for a in p.command("digest")["allocs"]] == [A1]
    assert node.free(1) == 141 * GIB - 4 * MIB
    assert node.state(p.pid) == "RUNNING"


def test_restore_on_another_node_maps_its_gpus_in_order_onto_other_uuids(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, tmp_path: Path
) -> None:
    a: FakeNode = fake_nodes("a", [gpu(0), gpu(1)])
    b: FakeNode = fake_nodes("b", [gpu(0, uuid=B0), gpu(1, uuid=B1)])
    p = spawn(tmp_path / "p", a.env, [(0, 2 * MIB), (1, 3 * MIB)])
    before = _digests(p)
    on_a = coordinators(a)
    stamp = _checkpointed(on_a, [p.pid])
    on_a.close()
    coordinators(b).restore([p.pid], stamp)
    after = p.command("digest")["allocs"]
    assert [x["sha256"] for x in after] == [x["sha256"] for x in before[0]]
    assert [x["uuid"] for x in after] == [B0, B1]
    assert [b.free(0), b.free(1)] == [141 * GIB - 2 * MIB, 141 * GIB - 3 * MIB]


def test_the_worker_ignores_cuda_visible_devices_and_sends_a_pair_for_every_gpu(
    fake_nodes,
    spawn: Spawn,
    coordinators: Coordinators,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A daemon started with CUDA_VISIBLE_DEVICES=0 would see one GPU of two and send a
    one-pair map the driver refuses (issue 10 §2.7)."""
    a: FakeNode = fake_nodes("a", [gpu(0), gpu(1)])
    b: FakeNode = fake_nodes("b", [gpu(0, uuid=B0), gpu(1, uuid=B1)])
    p = spawn(tmp_path / "p", a.env, [(0, MIB), (1, MIB)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    on_a = coordinators(a)
    assert on_a.stamp()["count"] == 2
    stamp = _checkpointed(on_a, [p.pid])
    on_a.close()
    coordinators(b).restore([p.pid], stamp)
    assert [x["uuid"] for x in p.command("digest")["allocs"]] == [B0, B1]


def test_a_remap_on_a_driver_without_gpu_pairs_is_unsupported(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, tmp_path: Path
) -> None:
    node: FakeNode = fake_nodes("a", [gpu(0), gpu(1)], driver_version=12080)
    p = spawn(tmp_path / "p", node.env, [(0, MIB)])
    coordinator = coordinators(node)
    assert coordinator.capabilities()["gpu_remap"] is False
    stamp = _checkpointed(coordinator, [p.pid])
    with pytest.raises(Unsupported, match="cannot remap"):
        coordinator.restore([p.pid], stamp, gpu_map={A0: A1, A1: A0})
    assert node.state(p.pid) == "CHECKPOINTED"


OneWorker = tuple[FakeNode, CudaProcess, GpuWorker, int]


@pytest.fixture
def one_worker(one_process: tuple[FakeNode, CudaProcess], coordinators: Coordinators) -> OneWorker:
    """``one_process``, the GPU worker of a coordinator on that node and the worker's pid."""
    node, p = one_process
    worker = coordinators(node)._worker
    assert worker.pid is not None
    return node, p, worker, worker.pid


def _answers_from_a_new_worker(worker: GpuWorker, old: int, p: CudaProcess) -> None:
    assert worker.call("get_state", p.pid) == "RUNNING"  # nothing was lost
    assert worker.pid != old


def test_a_worker_killed_during_a_call_fails_that_call_and_is_replaced(
    one_worker: OneWorker,
) -> None:
    node, p, worker, old = one_worker
    held = node.fault("cuCheckpointProcessGetState", pid=p.pid, hold=True)
    pending = worker.begin("get_state", p.pid)
    held.wait_claimed("the worker's call")
    os.kill(old, signal.SIGKILL)
    with pytest.raises(Internal, match="GPU worker died during"):
        pending.result()
    _answers_from_a_new_worker(worker, old, p)


def test_a_worker_that_died_between_calls_is_replaced_by_the_next_call(
    one_worker: OneWorker,
) -> None:
    _, p, worker, old = one_worker
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: _is_zombie(old), "the worker to exit")  # exited, not yet reaped
    _answers_from_a_new_worker(worker, old, p)


def _is_zombie(pid: int) -> bool:
    """Exited and waiting to be reaped: a zombie whose threads (the fake driver's) are gone
    too; until they are, the kernel has no exit status to give its parent."""
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state == "Z" and os.listdir(f"/proc/{pid}/task") == [str(pid)]


def test_a_process_another_caller_checkpointed_is_restored_by_the_worker(
    one_process: tuple[FakeNode, CudaProcess], coordinators: Coordinators
) -> None:
    node, p = one_process
    before = _digests(p)
    checkpoint(node.env, p.pid)  # by another process of the node (cuda-checkpoint, say)
    coordinator = coordinators(node)
    coordinator.restore([p.pid], {**coordinator.stamp(), "cuda_pids": [p.pid]})
    assert node.state(p.pid) == "RUNNING" and _digests(p) == before
    # The daemon's own process never loaded the driver: its worker is the caller.
    assert "libcuda.so" not in Path(f"/proc/{os.getpid()}/maps").read_text()
