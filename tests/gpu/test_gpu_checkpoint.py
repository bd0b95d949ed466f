"""Checkpoint and restore real CUDA workloads: tokens after restore equal an uninterrupted run.

Runs only on a machine with an NVIDIA GPU (see conftest.py); needs root (CRIU, and ptrace
rights over the workload for the checkpoint API) and CRIU >= 4 for the kill-and-restore tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.gpu import GpuCoordinator
from gpusnap.daemon.host.criu import Criu

WORKLOAD = Path(__file__).with_name("workload.py")
STEPS = 300
WAIT_S = 300.0  # bound on waiting for a workload; not a performance threshold


def _tokens(path: Path) -> list[str]:
    return path.read_text().split()


def _start(kind: str, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    log = open(out.with_suffix(".log"), "wb")
    return subprocess.Popen(
        [sys.executable, str(WORKLOAD), "--kind", kind, "--out", str(out), *extra],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,  # a session leader: CRIU needs no --shell-job
        cwd=out.parent,
    )


def _wait_lines(path: Path, n: int) -> None:
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        if path.exists() and len(_tokens(path)) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {n} lines")


def _restore(criu: Criu, images: Path, tmp_path: Path) -> int:
    """CRIU restore as the daemon does it without systemd: ``--restore-sibling``, so the
    restored root is this process's child and ``_reap`` can wait for it (without it, the
    restored process is nobody's child here and every test would wait out its timeout)."""
    restored = criu.restore(
        images, log_path=tmp_path / "restore.log", pidfile=tmp_path / "pid", sibling=True
    )
    return restored.pid


def _reap(pid: int) -> int:
    """Wait for a restored root (our child through --restore-sibling); its exit status."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _tree(pid: int) -> list[int]:
    pids = [pid]
    for p in pids:
        children = Path(f"/proc/{p}/task/{p}/children")
        if children.exists():
            pids += [int(c) for c in children.read_text().split()]
    return pids


@pytest.fixture
def coordinator() -> Iterator[GpuCoordinator]:
    c = GpuCoordinator.create(call_timeout_s=120.0, copy_rate_gbps=1.0)
    caps = c.capabilities()
    if not caps["checkpoint_api"]:
        pytest.skip(f"no checkpoint API: {caps['message']}")
    yield c
    c.close()


@pytest.fixture
def criu() -> Criu:
    c = Criu()
    try:
        c.check()
    except Exception as exc:  # no CRIU here: these tests cannot run
        pytest.skip(f"CRIU unusable: {exc}")
    return c


def _reference(tmp_path: Path, kind: str) -> list[str]:
    out = tmp_path / f"reference-{kind}.txt"
    proc = _start(kind, out, "--steps", str(STEPS))
    assert proc.wait(timeout=WAIT_S) == 0
    return _tokens(out)


@pytest.mark.parametrize("kind", ["kv", "rnn"])
def test_killed_and_restored_workload_continues_with_identical_tokens(
    tmp_path: Path, coordinator: GpuCoordinator, criu: Criu, figures: Any, kind: str
) -> None:
    expected = _reference(tmp_path, kind)
    out = tmp_path / f"run-{kind}.txt"
    proc = _start(kind, out, "--steps", str(STEPS), "--delay", "0.02")
    _wait_lines(out, STEPS // 3)
    t0 = time.monotonic()
    freeze = coordinator.freeze(_tree(proc.pid))
    assert freeze.cuda_pids == [proc.pid]
    stamp = coordinator.stamp() | freeze.to_stamp()
    images = tmp_path / "images"
    dump = criu.dump(proc.pid, images, leave_running=False, log_path=tmp_path / "dump.log")
    checkpoint_s = time.monotonic() - t0
    proc.wait(timeout=WAIT_S)  # CRIU killed it
    written = len(_tokens(out))
    assert written < STEPS

    t1 = time.monotonic()
    pid = _restore(criu, images, tmp_path)
    assert pid == proc.pid  # CRIU restores the same pid
    coordinator.restore([pid], stamp)
    restore_s = time.monotonic() - t1
    assert _reap(pid) == 0
    assert _tokens(out) == expected
    figures(
        f"kill-restore-{kind}",
        gpu_bytes=freeze.to_stamp()["bytes_total"],
        image_bytes=dump.images_bytes,
        criu_pause_s=dump.pause_seconds,
        lock_s=freeze.lock_seconds,
        gpu_checkpoint_s=freeze.checkpoint_seconds,
        checkpoint_s=checkpoint_s,
        restore_s=restore_s,
        tokens_before_kill=written,
    )


def test_leave_running_checkpoint_pauses_and_continues(
    tmp_path: Path, coordinator: GpuCoordinator, criu: Criu, figures: Any
) -> None:
    expected = _reference(tmp_path, "kv")
    out = tmp_path / "run.txt"
    proc = _start("kv", out, "--steps", str(STEPS), "--delay", "0.02")
    _wait_lines(out, STEPS // 3)
    t0 = time.monotonic()
    freeze = coordinator.freeze([proc.pid])
    criu.dump(proc.pid, tmp_path / "images", leave_running=True, log_path=tmp_path / "d.log")
    coordinator.thaw(freeze)
    pause_s = time.monotonic() - t0
    assert proc.wait(timeout=WAIT_S) == 0
    assert _tokens(out) == expected
    figures("leave-running", pause_s=pause_s, gpu_bytes=freeze.to_stamp()["bytes_total"])


def test_restore_with_explicit_uuid_map_onto_the_same_gpu(
    tmp_path: Path, coordinator: GpuCoordinator
) -> None:
    if not coordinator.capabilities()["gpu_remap"]:
        pytest.skip("driver cannot remap GPUs")
    expected = _reference(tmp_path, "rnn")
    out = tmp_path / "run.txt"
    proc = _start("rnn", out, "--steps", str(STEPS), "--delay", "0.02")
    _wait_lines(out, STEPS // 3)
    freeze = coordinator.freeze([proc.pid])
    stamp = coordinator.stamp() | freeze.to_stamp()
    identity = {d["uuid"]: d["uuid"] for d in stamp["devices"]}
    coordinator.restore([proc.pid], stamp, gpu_map=identity)
    assert proc.wait(timeout=WAIT_S) == 0
    assert _tokens(out) == expected


def _pinned_memcpy_gbps(nbytes: int) -> tuple[float, float]:
    """Plain pinned host<->device copy throughput (GB/s) in this run: D2H, H2D."""
    import torch  # noqa: PLC0415 - only the GPU machine has torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev.fill_(7)
    torch.cuda.synchronize()
    t = time.perf_counter()
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    d2h = nbytes / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    h2d = nbytes / (time.perf_counter() - t) / 1e9
    del dev, host
    torch.cuda.empty_cache()
    return d2h, h2d


def test_checkpoint_path_throughput_against_pinned_memcpy(
    tmp_path: Path, coordinator: GpuCoordinator, figures: Any
) -> None:
    hold_gib = float(os.environ.get("GPUSNAP_GPU_HOLD_GIB", "8"))
    out = tmp_path / "hold.txt"
    proc = _start("hold", out, "--hold-gib", str(hold_gib), "--steps", "400", "--delay", "0.01")
    _wait_lines(out, 1)
    freeze = coordinator.freeze([proc.pid])
    t = time.monotonic()
    coordinator.thaw(freeze)
    thaw_s = time.monotonic() - t
    assert proc.wait(timeout=WAIT_S) == 0
    assert _tokens(out)[-1] == "intact"
    nbytes = freeze.to_stamp()["bytes_total"]
    assert nbytes >= int(hold_gib * 2**30)
    d2h, h2d = _pinned_memcpy_gbps(int(hold_gib * 2**30))
    figures(
        "throughput",
        gpu_bytes=nbytes,
        checkpoint_d2h_gbps=nbytes / freeze.checkpoint_seconds / 1e9,
        restore_h2d_gbps=nbytes / thaw_s / 1e9,
        pinned_memcpy_d2h_gbps=d2h,
        pinned_memcpy_h2d_gbps=h2d,
        lock_s=freeze.lock_seconds,
        checkpoint_s=freeze.checkpoint_seconds,
        restore_unlock_s=thaw_s,
    )


def test_a_worker_pins_and_unpins_the_shared_ring_in_one_process() -> None:
    """cuMemHostRegister of the custom-storage ring and its undoing, by a GPU worker of its
    own (``GpuWorker``, the class the coordinator runs its driver calls in): exercisable on any
    driver (580 too). Each call raises on a CUDA error; none kills or replaces the worker."""
    from gpusnap.daemon.gpu.ring import HostRing  # noqa: PLC0415
    from gpusnap.daemon.gpu.worker import GpuWorker  # noqa: PLC0415

    worker = GpuWorker(call_timeout_s=120.0)
    try:
        with HostRing(2, 4 * 2**20) as ring:
            worker.call("ring_attach", ring.name, ring.size)
            first = worker.pid
            worker.call("ring_detach", ring.name)
            worker.call("ring_attach", ring.name, ring.size)  # pinned again once unpinned
            worker.call("ring_detach", ring.name)
        assert first is not None
        assert (worker.pid, worker.spawn_count) == (first, 1)
    finally:
        worker.close()


def test_custom_storage_leave_running_through_a_store(
    tmp_path: Path, coordinator: GpuCoordinator, figures: Any
) -> None:
    """Device memory copied by the daemon into a file:// store and back (CUDA 13.4 drivers)."""
    if not coordinator.capabilities()["custom_storage"]:
        pytest.skip(f"driver has no custom storage: {coordinator.capabilities()['message']}")
    from gpusnap.daemon.pipelines.gpu_memory import MemoryUploads  # noqa: PLC0415
    from gpusnap.storage import generate_signing_key, open_store  # noqa: PLC0415

    key = tmp_path / "sign.pem"
    generate_signing_key(key)
    expected = _reference(tmp_path, "kv")
    out = tmp_path / "run.txt"
    proc = _start("kv", out, "--steps", str(STEPS), "--delay", "0.02")
    _wait_lines(out, STEPS // 3)
    with open_store(f"file://{tmp_path / 'store'}", key_file=key, cache_dir=tmp_path / "c") as st:
        t0 = time.monotonic()
        uploads = MemoryUploads(st)
        freeze = coordinator.freeze([proc.pid], custom_storage=uploads.custom_storage())
        copied_s = time.monotonic() - t0
        assert freeze.memory_copy == "custom-storage"
        t1 = time.monotonic()
        coordinator.thaw(freeze)
        refill_s = time.monotonic() - t1
    assert proc.wait(timeout=WAIT_S) == 0
    assert _tokens(out) == expected
    nbytes = freeze.to_stamp()["bytes_total"]
    figures(
        "custom-storage",
        gpu_bytes=nbytes,
        checkpoint_to_store_gbps=nbytes / copied_s / 1e9,
        restore_from_store_gbps=nbytes / refill_s / 1e9,
    )
