"""Custom storage: device memory copied by the daemon into a real file:// store, and back.

The GPU layer copies through the sink and source the checkpoint and restore bodies build from
the store (``daemon/pipelines/gpu_memory.py``); these tests build them the same way. The device
memory is the fake driver's, in real CUDA processes whose allocations hold known bytes: their digest
after a restore proves every byte came back.
"""

from __future__ import annotations

import ast
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.gpu import GpuCoordinator, GpuFreeze
from gpusnap.daemon.pipelines.gpu_memory import MemoryUploads, committed_source
from gpusnap.errors import DeadlineExceeded, FailedPrecondition
from gpusnap.storage import CheckpointStore
from gpusnap.storage.streams import GPU_MEMORY_KIND, stream_kinds
from tests.fakes.libcuda import A0, B0, B1, GIB, MIB, CudaProcess, Spawn, gpu
from tests.storage.store_helpers import file_store, make_keys
from tests.support.fake_gpu import Coordinators, FakeNode

A1 = gpu(1)["uuid"]
SLOT = 256 * 1024
CS = {"custom_storage": True, "driver_version": 13040}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    with file_store(tmp_path, make_keys(tmp_path / "keys")) as s:
        yield s


def small_ring(coordinators: Coordinators, node: FakeNode, **kw: Any) -> GpuCoordinator:
    # 4 slots of 256 KiB: a few MiB of device memory takes many batches through both halves.
    return coordinators(node, ring_slots=4, ring_slot_bytes=SLOT, **kw)


def content(seed: int, index: int, size: int) -> bytes:
    """What allocation ``index`` of a ``CudaProcess`` started with ``seed`` holds."""
    return random.Random(f"{seed}-{index}").randbytes(size)


def device_bytes(p: CudaProcess, allocs: list[tuple[int, int]], seed: int, ordinal: int) -> bytes:
    """What the driver maps of GPU ``ordinal`` for ``p``: its allocations in address order."""
    mine = [
        (ptr, content(seed, i, n))
        for i, ((o, n), ptr) in enumerate(zip(allocs, p.info["pointers"], strict=True))
        if o == ordinal
    ]
    return b"".join(c for _, c in sorted(mine))


@dataclass(frozen=True)
class Frozen:
    """A freeze and the uploads its device memory went to, as the checkpoint body holds them."""

    freeze: GpuFreeze
    uploads: MemoryUploads


def freeze_into(store: CheckpointStore, c: GpuCoordinator, pids: list[int]) -> Frozen:
    uploads = MemoryUploads(store)
    return Frozen(c.freeze(pids, custom_storage=uploads.custom_storage()), uploads)


def commit(store: CheckpointStore, tmp_path: Path, c: GpuCoordinator, f: Frozen) -> str:
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    (images / "core.img").write_bytes(b"host state")
    pushed = store.push(
        images,
        workload="w",
        stamp={"gpu": {**c.stamp(), **f.freeze.to_stamp()}},
        uploaded_streams=f.uploads.uploaded,
    )
    return pushed.checkpoint_id


def test_device_memory_on_two_gpus_goes_into_the_store_and_comes_back_on_another_node(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, store: CheckpointStore, tmp_path: Path
) -> None:
    """Every device the driver maps is copied (issue 10 §2.1: the info's per-device array was
    read through a binding that saw none of it, and the operation completed with nothing)."""
    a: FakeNode = fake_nodes("a", [gpu(0), gpu(1)], **CS)
    b: FakeNode = fake_nodes("b", [gpu(0, uuid=B0), gpu(1, uuid=B1)], **CS)
    allocs = [(0, 2 * MIB), (1, MIB + 12345), (0, MIB + 7)]
    p = spawn(tmp_path / "p", a.env, allocs, seed=42)
    before = p.command("digest")
    on_a = small_ring(coordinators, a)

    frozen = freeze_into(store, on_a, [p.pid])
    freeze = frozen.freeze
    assert freeze.memory_copy == "custom-storage"
    assert freeze.bytes_per_device == {A0: 3 * MIB + 7, A1: MIB + 12345}
    assert a.state(p.pid) == "CHECKPOINTED"
    assert [a.free(0), a.free(1)] == [141 * GIB, 141 * GIB]

    checkpoint_id = commit(store, tmp_path, on_a, frozen)
    on_a.close()
    manifest = store.manifest(checkpoint_id)
    memory = {m["path"]: m for m in manifest.stamp["gpu"]["memory_files"]}
    assert set(stream_kinds(manifest)) == set(memory)
    assert set(stream_kinds(manifest).values()) == {GPU_MEMORY_KIND}
    for path, m in memory.items():
        got = b"".join(bytes(d) for _o, d in store.open_stream(manifest, path))
        assert got == device_bytes(p, allocs, 42, 0 if m["uuid"] == A0 else 1)

    on_b = small_ring(coordinators, b)
    on_b.restore([p.pid], manifest.stamp["gpu"], source=committed_source(store, manifest))
    assert b.state(p.pid) == "RUNNING"
    after = p.command("digest")
    assert [x["sha256"] for x in after["allocs"]] == [x["sha256"] for x in before["allocs"]]
    assert [x["uuid"] for x in after["allocs"]] == [B0, B1, B0]


def test_leave_running_thaw_fills_the_memory_back_from_the_store(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, store: CheckpointStore, tmp_path: Path
) -> None:
    node: FakeNode = fake_nodes("a", [gpu(0), gpu(1)], **CS)
    p = spawn(tmp_path / "p", node.env, [(0, 2 * MIB + 1)], seed=1)
    q = spawn(tmp_path / "q", node.env, [(1, MIB)], seed=2)
    before = [p.command("digest"), q.command("digest")]
    coordinator = small_ring(coordinators, node)
    freeze = freeze_into(store, coordinator, [p.pid, q.pid]).freeze
    coordinator.thaw(freeze)
    assert [node.state(p.pid), node.state(q.pid)] == ["RUNNING", "RUNNING"]
    assert [p.command("digest"), q.command("digest")] == before
    assert node.free(0) == 141 * GIB - 2 * MIB - 1  # free memory back after the thaw


def test_a_fresh_worker_page_locks_the_ring_for_a_custom_storage_freeze(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, store: CheckpointStore, tmp_path: Path
) -> None:
    """cuMemHostRegister needs a current context: a worker started afresh (after a close, as
    after a respawn) has made none when the freeze page-locks the ring (issue 10 §2.2), and the
    device memory still goes through the ring into the store and back."""
    node: FakeNode = fake_nodes("a", **CS)
    p = spawn(tmp_path / "p", node.env, [(0, MIB + 3)], seed=1)
    before = p.command("digest")
    coordinator = small_ring(coordinators, node)
    coordinator.close()  # the next call starts a fresh worker
    frozen = freeze_into(store, coordinator, [p.pid])
    assert [m["pid"] for m in frozen.freeze.memory_files] == [p.pid]
    assert frozen.uploads.uploaded  # the memory went through the ring into the store
    coordinator.thaw(frozen.freeze)
    assert node.state(p.pid) == "RUNNING"
    assert p.command("digest") == before


def test_without_the_capability_the_freeze_stages_in_host_memory(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, store: CheckpointStore, tmp_path: Path
) -> None:
    node: FakeNode = fake_nodes("a")
    p = spawn(tmp_path / "p", node.env, [(0, MIB)])
    frozen = freeze_into(store, small_ring(coordinators, node), [p.pid])
    assert frozen.freeze.memory_copy == "host-staged"
    assert frozen.uploads.uploaded is None
    assert "memory_files" not in frozen.freeze.to_stamp()


def test_custom_storage_can_be_turned_off(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, store: CheckpointStore, tmp_path: Path
) -> None:
    node: FakeNode = fake_nodes("a", **CS)
    p = spawn(tmp_path / "p", node.env, [(0, MIB)])
    c = small_ring(coordinators, node, custom_storage=False)
    frozen = freeze_into(store, c, [p.pid])
    assert frozen.freeze.memory_copy == "host-staged" and frozen.uploads.uploaded is None


def test_bindings_older_than_13_4_1_have_no_custom_storage_whatever_the_driver_says(
    fake_nodes,
) -> None:
    """Custom storage needs cuda-bindings 13.4.1 (issue 10 §2.5); older ones either lack the
    names or lay the structs out otherwise, so it is found at run time, not assumed."""
    node: FakeNode = fake_nodes("a", **CS)
    code = (
        "import sys, cuda.bindings\n"
        "cuda.bindings.__version__ = sys.argv[1]\n"
        "from gpusnap.daemon.gpu import driver\n"
        "driver.init()\n"
        "print(driver.custom_storage_supported())\n"
    )
    answers = [
        subprocess.run(
            [sys.executable, "-c", code, version],
            env=node.env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
        for version in ("13.3.1", "13.4.0", "13.4.1", "13.5.0")
    ]
    assert answers == ["False", "False", "True", "True"]


def test_a_hung_copy_hits_the_deadline_and_the_workload_runs_on(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, store: CheckpointStore, tmp_path: Path
) -> None:
    node: FakeNode = fake_nodes("a", **CS)
    p = spawn(tmp_path / "p", node.env, [(0, 2 * MIB)])
    before = p.command("digest")
    coordinator = small_ring(coordinators, node)
    first = coordinator._worker.pid
    coordinator._worker.call_timeout_s = 2.0
    node.fault("cuMemcpyDtoHAsync", hang_s=600)
    with pytest.raises(DeadlineExceeded) as caught:
        freeze_into(store, coordinator, [p.pid])
    message = str(caught.value)
    assert "cuMemcpyDtoHAsync() did not return within 2" in message
    assert "the workload runs on" in message and "\n" not in message
    assert node.state(p.pid) == "RUNNING" and p.command("digest") == before
    assert coordinator._worker.pid != first
    assert store.list("w") == []
    assert not list(Path("/dev/shm").glob(f"gpusnap-ring-{os.getpid()}x*"))


def test_a_node_without_custom_storage_cannot_take_such_a_checkpoint(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, store: CheckpointStore, tmp_path: Path
) -> None:
    a: FakeNode = fake_nodes("a", **CS)
    b: FakeNode = fake_nodes("b", [gpu(0, uuid=B0)], driver_version=13040)
    p = spawn(tmp_path / "p", a.env, [(0, MIB)])
    on_a = small_ring(coordinators, a)
    gpu_stamp = {**on_a.stamp(), **freeze_into(store, on_a, [p.pid]).freeze.to_stamp()}
    on_a.close()
    reasons = small_ring(coordinators, b).compat_reasons(gpu_stamp)
    assert [r.field for r in reasons] == ["gpu.custom_storage"]
    assert "custom storage" in reasons[0].message


def test_a_freeze_failing_after_one_process_was_stored_puts_it_back_from_the_source(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, store: CheckpointStore, tmp_path: Path
) -> None:
    node: FakeNode = fake_nodes("a", [gpu(0), gpu(1)], **CS)
    p = spawn(tmp_path / "p", node.env, [(0, MIB + 7)], seed=3)
    q = spawn(tmp_path / "q", node.env, [(1, MIB)], seed=4)
    before = [p.command("digest"), q.command("digest")]
    node.fault("cuCheckpointProcessCheckpoint", pid=q.pid, error="CUDA_ERROR_ILLEGAL_STATE")
    uploads = MemoryUploads(store)
    with pytest.raises(FailedPrecondition) as caught:
        small_ring(coordinators, node).freeze(
            [p.pid, q.pid], custom_storage=uploads.custom_storage()
        )
    assert "rolled back" in str(caught.value)
    # p's memory existed only in the store: the roll-back read it back through the source.
    assert uploads.uploaded is not None
    assert [e.path for e in uploads.uploaded.entries] == [f"gpu-memory/{p.pid}/0-{A0}.bin"]
    assert [node.state(p.pid), node.state(q.pid)] == ["RUNNING", "RUNNING"]
    assert [p.command("digest"), q.command("digest")] == before


def test_a_restore_whose_stored_size_differs_from_the_mapping_is_refused(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, store: CheckpointStore, tmp_path: Path
) -> None:
    node: FakeNode = fake_nodes("a", **CS)
    p = spawn(tmp_path / "p", node.env, [(0, MIB)])
    coordinator = small_ring(coordinators, node)
    frozen = freeze_into(store, coordinator, [p.pid])
    manifest = store.manifest(commit(store, tmp_path, coordinator, frozen))
    gpu_stamp = dict(manifest.stamp["gpu"])
    gpu_stamp["memory_files"] = [{**gpu_stamp["memory_files"][0], "size": MIB + 1}]
    with pytest.raises(FailedPrecondition, match=f"maps {MIB} bytes for process {p.pid}"):
        coordinator.restore([p.pid], gpu_stamp, source=committed_source(store, manifest))


def test_the_gpu_layer_loads_without_the_store() -> None:
    """The GPU layer copies through callables it is given and never imports the store."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import gpusnap.daemon.gpu as gpu\n"
        "for m in pkgutil.iter_modules(gpu.__path__):\n"
        "    importlib.import_module(f'gpusnap.daemon.gpu.{m.name}')\n"
        "print(sorted(n for n in sys.modules if n.startswith('gpusnap.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    loaded = [n for n in ast.literal_eval(out) if not n.startswith("gpusnap.daemon.gpu")]
    assert loaded == [
        "gpusnap.daemon",
        "gpusnap.daemon.gate",
        "gpusnap.daemon.gate.verdict",
        "gpusnap.errors",
    ]
