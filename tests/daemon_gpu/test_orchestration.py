"""Freeze, thaw, rollback, deadlines and restore, through the worker process and the fake."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.gpu import GpuCoordinator, GpuFreeze
from gpusnap.daemon.gpu.worker import GpuWorker
from gpusnap.errors import DeadlineExceeded, FailedPrecondition, Internal, Unsupported
from tests.fakes.fake_cuda import GIB, FakeCuda, default_devices


def test_freeze_locks_every_process_before_checkpointing_any(
    fake: FakeCuda, sleepers, make_coordinator
):
    a, b, c = sleepers(3)
    for pid in (a, b, c):
        fake.add_process(pid)
    freeze = make_coordinator().freeze([a, b, c])
    assert freeze.cuda_pids == [a, b, c]
    order = fake.calls("lock", "checkpoint")
    locks = [("lock", a), ("lock", b), ("lock", c)]
    checkpoints = [("checkpoint", a), ("checkpoint", b), ("checkpoint", c)]
    assert order == [*locks, *checkpoints]
    assert all(fake.state_of(p) == "CHECKPOINTED" for p in (a, b, c))


def test_freeze_finds_cuda_processes_and_skips_the_rest(fake, sleepers, make_coordinator):
    cuda_pid, plain_pid = sleepers(2)
    fake.add_process(cuda_pid)
    freeze = make_coordinator().freeze([cuda_pid, plain_pid])
    assert freeze.cuda_pids == [cuda_pid]
    assert ("lock", plain_pid) not in fake.calls()


def test_freeze_measures_the_bytes_it_took_off_each_gpu(fake, sleepers, make_coordinator):
    devs = default_devices(2)
    fake.setup(devices=devs)
    a, b = sleepers(2)
    fake.add_process(a, {devs[0]["uuid"]: 3 * GIB, devs[1]["uuid"]: 1 * GIB})
    fake.add_process(b, {devs[0]["uuid"]: 2 * GIB})
    freeze = make_coordinator().freeze([a, b])
    assert freeze.bytes_per_device == {devs[0]["uuid"]: 5 * GIB, devs[1]["uuid"]: 1 * GIB}
    assert freeze.to_stamp()["bytes_total"] == 6 * GIB


def test_thaw_restores_all_then_unlocks_all(fake, sleepers, make_coordinator):
    a, b = sleepers(2)
    fake.add_process(a)
    fake.add_process(b)
    coordinator = make_coordinator()
    freeze = coordinator.freeze([a, b])
    coordinator.thaw(freeze)
    assert fake.calls("restore", "unlock") == [
        ("restore", a),
        ("restore", b),
        ("unlock", a),
        ("unlock", b),
    ]
    assert fake.state_of(a) == fake.state_of(b) == "RUNNING"


def test_failed_checkpoint_of_second_process_rolls_both_back_to_running(
    fake, sleepers, make_coordinator
):
    a, b = sleepers(2)
    fake.add_process(a)
    fake.add_process(b)
    fake.fault("checkpoint", b, error="CUDA_ERROR_UNKNOWN")
    with pytest.raises(Internal) as caught:
        make_coordinator().freeze([a, b])
    message = str(caught.value)
    assert "CUDA_ERROR_UNKNOWN" in message
    assert "rolled back" in message and "\n" not in message
    assert fake.state_of(a) == fake.state_of(b) == "RUNNING"
    assert ("restore", a) in fake.calls() and ("restore", b) not in fake.calls()


def test_lock_timeout_reports_not_ready_and_rolls_back(fake, sleepers, make_coordinator):
    a, b = sleepers(2)
    fake.add_process(a)
    fake.add_process(b, lock_blocked=True)
    with pytest.raises(DeadlineExceeded) as caught:
        make_coordinator().freeze([a, b], lock_timeout_ms=50)
    assert "CUDA_ERROR_NOT_READY" in str(caught.value)
    assert fake.state_of(a) == fake.state_of(b) == "RUNNING"
    assert fake.calls("checkpoint") == []
    assert fake.call_args("lock")[1]["timeout_ms"] == 50


def test_hanging_call_kills_and_respawns_the_worker_and_names_the_state(
    fake, sleepers, make_coordinator
):
    (pid,) = sleepers(1)
    fake.add_process(pid)
    coordinator = make_coordinator(call_timeout_s=1.0)
    coordinator.capabilities()
    first_worker = coordinator._worker.pid
    # The driver locks the process and then never returns.
    fake.fault("lock", pid, hang_s=120, apply_first=True)
    with pytest.raises(DeadlineExceeded) as caught:
        coordinator.freeze([pid], lock_timeout_ms=0)
    message = str(caught.value)
    assert f"cuCheckpointProcessLock({pid}) did not return within" in message
    assert f"process {pid} is LOCKED" in message
    assert "worker restarted" in message
    # The rollback ran in the new worker and unlocked the process.
    assert fake.state_of(pid) == "RUNNING"
    assert coordinator._worker.pid != first_worker
    # The new worker serves calls.
    assert coordinator.freeze([pid]).cuda_pids == [pid]
    assert fake.state_of(pid) == "CHECKPOINTED"


def test_out_of_order_call_is_illegal_state(fake, sleepers, make_coordinator):
    (pid,) = sleepers(1)
    fake.add_process(pid)
    coordinator = make_coordinator()
    coordinator.thaw(GpuFreeze(cuda_pids=[pid]))  # RUNNING: thaw has nothing to do
    assert fake.calls("restore", "unlock") == []
    with pytest.raises(FailedPrecondition, match="CUDA_ERROR_ILLEGAL_STATE"):
        coordinator._worker.call("unlock", pid)
    assert fake.state_of(pid) == "RUNNING"


def test_freeze_refuses_a_process_someone_else_locked(fake, sleepers, make_coordinator):
    (pid,) = sleepers(1)
    fake.add_process(pid)
    fake.set_state(pid, "LOCKED")
    with pytest.raises(FailedPrecondition, match="is LOCKED, not RUNNING"):
        make_coordinator().freeze([pid])
    assert fake.calls("lock", "checkpoint") == []


def _checkpointed(fake: FakeCuda, coordinator, pids):
    freeze = coordinator.freeze(pids)
    return coordinator.stamp() | freeze.to_stamp()


def test_restore_puts_processes_back_and_unlocks(fake, sleepers, make_coordinator):
    a, b = sleepers(2)
    fake.add_process(a)
    fake.add_process(b)
    coordinator = make_coordinator()
    stamp = _checkpointed(fake, coordinator, [a, b])
    coordinator.restore([a, b], stamp)
    assert fake.state_of(a) == fake.state_of(b) == "RUNNING"
    assert [c["gpu_pairs"] for c in fake.call_args("restore")] == [None, None]


def _checkpointed_then_crowded(
    fake: FakeCuda,
    sleepers: Callable[[int], list[int]],
    make_coordinator: Callable[..., GpuCoordinator],
) -> tuple[int, dict[str, Any], GpuCoordinator, dict[str, Any]]:
    """A process holding 100 GiB checkpointed; then another tenant takes 50 GiB of its GPU."""
    (pid,) = sleepers(1)
    dev = default_devices(1)[0]
    fake.add_process(pid, {dev["uuid"]: 100 * GIB})
    coordinator = make_coordinator()
    stamp = _checkpointed(fake, coordinator, [pid])
    (other,) = sleepers(1)
    fake.add_process(other, {dev["uuid"]: 50 * GIB})
    return pid, dev, coordinator, stamp


def test_restore_out_of_memory_leaves_process_checkpointed_and_raises(
    fake, sleepers, make_coordinator
):
    pid, dev, coordinator, stamp = _checkpointed_then_crowded(fake, sleepers, make_coordinator)
    # The stamp under-reports, so the pre-check passes.
    stamp["bytes_per_device"] = {dev["uuid"]: 1 * GIB}
    with pytest.raises(FailedPrecondition) as caught:
        coordinator.restore([pid], stamp)
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(caught.value)
    assert f"process {pid} is CHECKPOINTED" in str(caught.value)
    assert fake.state_of(pid) == "CHECKPOINTED"
    assert fake.calls("unlock") == []


def test_restore_is_refused_before_the_driver_when_free_memory_is_short(
    fake, sleepers, make_coordinator
):
    pid, _dev, coordinator, stamp = _checkpointed_then_crowded(fake, sleepers, make_coordinator)
    with pytest.raises(FailedPrecondition, match="free"):
        coordinator.restore([pid], stamp)
    assert fake.calls("restore") == []
    assert fake.state_of(pid) == "CHECKPOINTED"


def test_restore_with_explicit_gpu_map_passes_the_uuid_pairs(fake, sleepers, make_coordinator):
    devs = default_devices(2)
    fake.setup(devices=devs)
    (pid,) = sleepers(1)
    old, new = devs[0]["uuid"], devs[1]["uuid"]
    fake.add_process(pid, {old: 4 * GIB})
    coordinator = make_coordinator()
    stamp = _checkpointed(fake, coordinator, [pid])
    stamp["devices"] = stamp["devices"][:1]
    stamp["count"] = 1
    coordinator.restore([pid], stamp, gpu_map={old: new})
    assert fake.call_args("restore")[0]["gpu_pairs"] == [[old, new]]
    assert fake.read()["processes"][str(pid)]["memory"] == {new: 4 * GIB}
    assert fake.state_of(pid) == "RUNNING"


def test_restore_on_another_node_maps_old_gpus_onto_this_nodes_in_order(
    fake, sleepers, make_coordinator
):
    (pid,) = sleepers(1)
    old_devs = default_devices(1)
    fake.add_process(pid, {old_devs[0]["uuid"]: 2 * GIB})
    coordinator = make_coordinator()
    stamp = _checkpointed(fake, coordinator, [pid])
    coordinator.close()
    # "Another node": same chip, another UUID.
    new_dev = dict(old_devs[0], uuid="GPU-11111111-2222-3333-4444-555555555555")
    fake.update(devices=[new_dev])
    coordinator = make_coordinator()
    coordinator.restore([pid], stamp)
    assert fake.call_args("restore")[0]["gpu_pairs"] == [[old_devs[0]["uuid"], new_dev["uuid"]]]
    assert fake.state_of(pid) == "RUNNING"


def test_remap_on_a_driver_without_gpu_pairs_is_unsupported(fake, sleepers, make_coordinator):
    devs = default_devices(2)
    fake.setup(devices=devs, cuda_version=12080)
    (pid,) = sleepers(1)
    fake.add_process(pid, {devs[0]["uuid"]: GIB})
    coordinator = make_coordinator()
    assert coordinator.capabilities()["gpu_remap"] is False
    stamp = _checkpointed(fake, coordinator, [pid])
    with pytest.raises(Unsupported, match="cannot remap"):
        coordinator.restore(
            [pid],
            stamp,
            gpu_map={devs[0]["uuid"]: devs[1]["uuid"], devs[1]["uuid"]: devs[0]["uuid"]},
        )
    assert fake.state_of(pid) == "CHECKPOINTED"


def _one_process_and_its_worker(
    fake: FakeCuda,
    sleepers: Callable[[int], list[int]],
    make_coordinator: Callable[..., GpuCoordinator],
) -> tuple[int, GpuWorker, int]:
    """A CUDA process, and a coordinator's worker already started: (pid, worker, its pid)."""
    (pid,) = sleepers(1)
    fake.add_process(pid)
    coordinator = make_coordinator()
    coordinator.capabilities()
    worker = coordinator._worker
    assert worker.pid is not None
    return pid, worker, worker.pid


def test_a_worker_killed_during_a_call_fails_that_call_and_is_replaced(
    fake, sleepers, make_coordinator
):
    pid, worker, old = _one_process_and_its_worker(fake, sleepers, make_coordinator)
    fake.fault("get_state", pid, hang_s=60)
    pending = worker.begin("get_state", pid)
    _until(lambda: fake.read()["faults"] == [])  # the worker took it: it hangs in the call
    os.kill(old, signal.SIGKILL)
    with pytest.raises(Internal, match="GPU worker died during"):
        pending.result()
    assert worker.call("get_state", pid) == "RUNNING"
    assert worker.pid != old


def test_a_worker_that_died_between_calls_is_replaced_by_the_next_call(
    fake, sleepers, make_coordinator
):
    pid, worker, old = _one_process_and_its_worker(fake, sleepers, make_coordinator)
    os.kill(old, signal.SIGKILL)
    _until(lambda: _is_zombie(old))  # it has exited, and nobody has reaped it yet
    assert worker.call("get_state", pid) == "RUNNING"  # nothing was lost
    assert worker.pid != old


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30  # a hang guard only
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.01)


def _is_zombie(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
