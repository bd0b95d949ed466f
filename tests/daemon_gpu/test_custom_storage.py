"""Custom storage: device memory copied by the daemon into a real file:// store, and back.

The GPU layer copies through the sink and source the checkpoint and restore bodies build from
the store (``daemon/gpu_memory.py``); these tests build them the same way. The fake driver's
"device memory" is a file of deterministic bytes; its restore checks the refill byte for byte,
so a wrong byte anywhere on the way fails the restore.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.gpu import GpuCoordinator, GpuFreeze
from gpusnap.daemon.gpu_memory import MemoryUploads, committed_source
from gpusnap.errors import DeadlineExceeded, FailedPrecondition, Internal
from gpusnap.storage import CheckpointStore
from gpusnap.storage.streams import GPU_MEMORY_KIND, stream_kinds
from tests.fakes.fake_cuda import FakeCuda, default_devices, device_content
from tests.storage.store_helpers import file_store, make_keys

KiB = 1024
MiB = 1024 * KiB
SLOT = 256 * KiB


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    with file_store(tmp_path, make_keys(tmp_path / "keys")) as s:
        yield s


@pytest.fixture
def two_gpus(fake: FakeCuda) -> list[dict[str, Any]]:
    devs = default_devices(2)
    fake.setup(devices=devs, custom_storage=True)
    return devs


def small_ring(make: Callable[..., GpuCoordinator], **kwargs: Any) -> GpuCoordinator:
    # 4 slots of 256 KiB: a few MiB of device memory takes many batches through both halves.
    return make(ring_slots=4, ring_slot_bytes=SLOT, **kwargs)


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


def test_checkpoint_streams_device_memory_into_the_store_and_restore_puts_it_back(
    fake, two_gpus, sleepers, make_coordinator, store, tmp_path
):
    (pid,) = sleepers(1)
    sizes = {two_gpus[0]["uuid"]: 3 * MiB + 12345, two_gpus[1]["uuid"]: 1 * MiB}
    fake.add_process(pid, sizes, seed=42)
    coordinator = small_ring(make_coordinator)

    frozen = freeze_into(store, coordinator, [pid])
    freeze = frozen.freeze
    assert freeze.memory_copy == "custom-storage"
    assert freeze.bytes_per_device == sizes
    assert fake.state_of(pid) == "CHECKPOINTED"
    ops = [op for op, _pid in fake.calls()]
    assert "checkpoint" not in ops  # never the host-staged call
    assert ops.index("checkpoint_custom_storage") < ops.index("operation_complete")
    assert fake.read()["copied_bytes"] == sum(sizes.values())

    checkpoint_id = commit(store, tmp_path, coordinator, frozen)
    manifest = store.manifest(checkpoint_id)
    memory = {m["path"]: m for m in manifest.stamp["gpu"]["memory_files"]}
    assert set(stream_kinds(manifest)) == set(memory)
    assert set(stream_kinds(manifest).values()) == {GPU_MEMORY_KIND}
    for path, m in memory.items():
        entry = next(f for f in manifest.files if f.path == path)
        assert entry.size == sizes[m["uuid"]]
        got = b"".join(bytes(d) for _o, d in store.open_stream(manifest, path))
        assert got == device_content(42, m["position"], m["size"])

    coordinator.restore([pid], manifest.stamp["gpu"], source=committed_source(store, manifest))
    proc = fake.read()["processes"][str(pid)]
    assert proc["restore_check"] == "verified"
    assert proc["state"] == "RUNNING"
    assert fake.calls("restore_custom_storage", "operation_complete", "unlock")[-3:] == [
        ("restore_custom_storage", pid),
        ("operation_complete", None),
        ("unlock", pid),
    ]


def test_a_refill_with_the_wrong_bytes_fails_the_restore(
    fake, two_gpus, sleepers, make_coordinator, store, tmp_path
):
    (pid,) = sleepers(1)
    fake.add_process(pid, {two_gpus[0]["uuid"]: MiB, two_gpus[1]["uuid"]: MiB}, seed=7)
    coordinator = small_ring(make_coordinator)
    frozen = freeze_into(store, coordinator, [pid])
    manifest = store.manifest(commit(store, tmp_path, coordinator, frozen))
    gpu = dict(manifest.stamp["gpu"])
    first, second = gpu["memory_files"]
    # Same sizes, swapped contents: only the fake's byte-for-byte check can notice.
    gpu["memory_files"] = [{**first, "path": second["path"]}, {**second, "path": first["path"]}]
    with pytest.raises(Internal, match="CUDA_ERROR_UNKNOWN"):
        coordinator.restore([pid], gpu, source=committed_source(store, manifest))
    proc = fake.read()["processes"][str(pid)]
    assert proc["state"] == "FAILED"
    assert "differs at byte" in proc["restore_check"]


def test_leave_running_thaw_fills_the_memory_back_from_the_store(
    fake, two_gpus, sleepers, make_coordinator, store
):
    a, b = sleepers(2)
    fake.add_process(a, {two_gpus[0]["uuid"]: 2 * MiB + 1}, seed=1)
    fake.add_process(b, {two_gpus[1]["uuid"]: MiB}, seed=2)
    coordinator = small_ring(make_coordinator)
    freeze = freeze_into(store, coordinator, [a, b]).freeze
    assert [op for op, _ in fake.calls("lock", "checkpoint_custom_storage")] == [
        "lock",
        "lock",
        "checkpoint_custom_storage",
        "checkpoint_custom_storage",
    ]
    coordinator.thaw(freeze)
    for pid in (a, b):
        proc = fake.read()["processes"][str(pid)]
        assert proc["state"] == "RUNNING"
        assert proc["restore_check"] == "verified"


def test_without_the_capability_the_freeze_stages_in_host_memory(
    fake, sleepers, make_coordinator, store
):
    fake.setup(custom_storage=False)
    (pid,) = sleepers(1)
    fake.add_process(pid)
    frozen = freeze_into(store, small_ring(make_coordinator), [pid])
    freeze = frozen.freeze
    assert freeze.memory_copy == "host-staged"
    assert frozen.uploads.uploaded is None
    assert "memory_files" not in freeze.to_stamp()
    assert ("checkpoint", pid) in fake.calls()
    assert fake.calls("checkpoint_custom_storage", "copy_out") == []


def test_custom_storage_can_be_turned_off(fake, two_gpus, sleepers, make_coordinator, store):
    (pid,) = sleepers(1)
    fake.add_process(pid, {two_gpus[0]["uuid"]: MiB})
    freeze = freeze_into(store, small_ring(make_coordinator, custom_storage=False), [pid]).freeze
    assert freeze.memory_copy == "host-staged"
    assert fake.calls("checkpoint_custom_storage") == []


def test_a_hung_copy_hits_the_deadline_and_the_workload_runs_on(
    fake, two_gpus, sleepers, make_coordinator, store
):
    (pid,) = sleepers(1)
    fake.add_process(pid, {two_gpus[0]["uuid"]: 2 * MiB})
    coordinator = small_ring(make_coordinator, call_timeout_s=1.0)
    coordinator.capabilities()
    first_worker = coordinator._worker.pid
    fake.fault("copy_out", hang_s=120)
    with pytest.raises(DeadlineExceeded) as caught:
        freeze_into(store, coordinator, [pid])
    message = str(caught.value)
    assert "cuMemcpyDtoHAsync() did not return within 1s" in message
    assert "the workload runs on" in message and "\n" not in message
    assert fake.state_of(pid) == "RUNNING"
    assert coordinator._worker.pid != first_worker
    # The killed worker's operation was abandoned, and nothing of it is left behind.
    assert [a["kind"] for a in fake.read()["abandoned"]] == ["checkpoint"]
    assert list(fake.path.parent.glob(f"{fake.path.name}.dev-*")) == []
    assert store.list("w") == []
    assert not list(Path("/dev/shm").glob(f"gpusnap-ring-{os.getpid()}x*"))


def test_a_node_without_custom_storage_cannot_take_such_a_checkpoint(
    fake, two_gpus, sleepers, make_coordinator, store
):
    (pid,) = sleepers(1)
    fake.add_process(pid, {two_gpus[0]["uuid"]: MiB})
    coordinator = small_ring(make_coordinator)
    freeze = freeze_into(store, coordinator, [pid]).freeze
    gpu_stamp = {**coordinator.stamp(), **freeze.to_stamp()}
    fake.update(custom_storage=False)
    other = small_ring(make_coordinator)
    reasons = other.compat_reasons(gpu_stamp)
    assert [r.field for r in reasons] == ["gpu.custom_storage"]
    assert "custom storage" in reasons[0].message


def test_a_freeze_failing_after_one_process_was_stored_puts_it_back_from_the_source(
    fake, two_gpus, sleepers, make_coordinator, store
):
    a, b = sleepers(2)
    fake.add_process(a, {two_gpus[0]["uuid"]: MiB + 7}, seed=3)
    fake.add_process(b, {two_gpus[1]["uuid"]: MiB}, seed=4)
    fake.fault("checkpoint_custom_storage", b, error="CUDA_ERROR_ILLEGAL_STATE")
    uploads = MemoryUploads(store)
    with pytest.raises(FailedPrecondition) as caught:
        small_ring(make_coordinator).freeze([a, b], custom_storage=uploads.custom_storage())
    assert "rolled back" in str(caught.value)
    # a's memory existed only in the store: the roll-back read it back through the source.
    assert uploads.uploaded is not None
    assert [e.path for e in uploads.uploaded.entries] == [
        f"gpu-memory/{a}/0-{two_gpus[0]['uuid']}.bin"
    ]
    processes = fake.read()["processes"]
    assert processes[str(a)]["state"] == processes[str(b)]["state"] == "RUNNING"
    assert processes[str(a)]["restore_check"] == "verified"


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
    assert loaded == ["gpusnap.daemon", "gpusnap.daemon.verdict", "gpusnap.errors"]
