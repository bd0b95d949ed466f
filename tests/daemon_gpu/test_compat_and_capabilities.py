"""Capabilities, the stamp's gpu section and the GPU compatibility rules, on fake nodes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.gpu import GpuCoordinator
from gpusnap.daemon.gpu.inventory import parse_nvrm_version
from gpusnap.errors import Unsupported
from tests.fakes.libcuda import A0, B0, GIB, MIB, ROOT_ENV, Spawn, gpu
from tests.support.fake_gpu import Coordinators, FakeNode


def _stamp(coordinators: Coordinators, node: FakeNode) -> dict[str, Any]:
    coordinator = coordinators(node)
    stamp = coordinator.stamp()
    coordinator.close()
    return stamp


def test_capabilities_report_the_driver_its_floors_and_no_custom_storage_on_580(
    fake_nodes, coordinators: Coordinators
) -> None:
    node: FakeNode = fake_nodes("a")
    caps = coordinators(node).capabilities()
    assert caps["driver_present"] is True
    assert caps["driver_version"] == "580.95.05"  # from the kernel module's version line
    assert caps["driver_version_source"] == str(node.version_file)
    assert caps["cuda_driver_version"] == 13000
    assert (caps["checkpoint_api"], caps["gpu_remap"], caps["custom_storage"]) == (
        True,
        True,
        False,
    )
    assert caps["cuda_bindings"]
    assert "\n" not in caps["message"] and "custom storage no" in caps["message"]


def test_custom_storage_is_found_where_the_driver_resolves_it_at_13040(
    fake_nodes, coordinators: Coordinators
) -> None:
    node: FakeNode = fake_nodes("a", custom_storage=True, driver_version=13040)
    assert coordinators(node).capabilities()["custom_storage"] is True


def test_a_cuda_12_6_driver_has_no_checkpoint_api(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, tmp_path: Path
) -> None:
    node: FakeNode = fake_nodes("a", driver_version=12060)
    p = spawn(tmp_path / "p", node.env, [(0, MIB)])
    coordinator = coordinators(node)
    assert coordinator.capabilities()["checkpoint_api"] is False
    with pytest.raises(Unsupported, match="no checkpoint API"):
        coordinator.freeze([p.pid])
    assert node.state(p.pid) == "RUNNING"


def test_the_stamp_records_every_gpu_and_the_exact_driver(
    fake_nodes, coordinators: Coordinators
) -> None:
    node: FakeNode = fake_nodes("a", [gpu(0), gpu(1)])
    stamp = _stamp(coordinators, node)
    assert stamp["present"] is True and stamp["count"] == 2
    assert stamp["devices"][0] == {
        "index": 0,
        "name": "NVIDIA H200",
        "uuid": A0,
        "compute_capability": "9.0",
        "memory_total": 141 * GIB,
        "pci_bus_id": "0000:19:00.0",
    }
    assert stamp["driver_version"] == "580.95.05"
    assert stamp["cuda_driver_version"] == 13000


def test_a_mig_instance_is_stamped_with_its_mig_uuid(
    fake_nodes, coordinators: Coordinators
) -> None:
    """MIG UUIDs are not GPU- UUIDs (issue 10 §2.9): the spelling is what pairs and
    CUDA_VISIBLE_DEVICES take."""
    mig = gpu(0, uuid="MIG-4b7a6c43-0000-4000-8000-00000000000a", name="NVIDIA H200 MIG 1g.18gb")
    node: FakeNode = fake_nodes("a", [mig])
    assert [d["uuid"] for d in _stamp(coordinators, node)["devices"]] == [mig["uuid"]]


def test_parse_nvrm_version_reads_proprietary_and_open_modules() -> None:
    assert (
        parse_nvrm_version(
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC"
        )
        == "550.54.14"
    )
    assert (
        parse_nvrm_version("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  R")
        == "580.65.06"
    )
    assert parse_nvrm_version("garbage") is None


def test_the_same_node_is_compatible(fake_nodes, coordinators: Coordinators) -> None:
    node: FakeNode = fake_nodes("a")
    stamp = _stamp(coordinators, node)
    assert coordinators(node).compat_reasons(stamp) == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"name": "NVIDIA H100 80GB HBM3"}, "gpu.devices[0].name"),
        ({"compute_capability": (10, 0)}, "gpu.devices[0].compute_capability"),
    ],
)
def test_a_different_chip_is_refused(
    fake_nodes, coordinators: Coordinators, change: dict[str, Any], field: str
) -> None:
    stamp = _stamp(coordinators, fake_nodes("a"))
    other: FakeNode = fake_nodes("b", [gpu(0, uuid=B0, **change)])
    assert [r.field for r in coordinators(other).compat_reasons(stamp)] == [field]


def test_a_different_gpu_count_is_refused(fake_nodes, coordinators: Coordinators) -> None:
    stamp = _stamp(coordinators, fake_nodes("a", [gpu(0), gpu(1)]))
    reasons = coordinators(fake_nodes("b", [gpu(0, uuid=B0)])).compat_reasons(stamp)
    assert [r.field for r in reasons] == ["gpu.count"]
    assert reasons[0].expected == "2" and reasons[0].actual == "1"


def test_any_driver_version_difference_is_refused(fake_nodes, coordinators: Coordinators) -> None:
    stamp = _stamp(coordinators, fake_nodes("a"))
    other: FakeNode = fake_nodes("b", [gpu(0, uuid=B0)], driver_version_string="580.95.06")
    reasons = coordinators(other).compat_reasons(stamp)
    assert [r.field for r in reasons] == ["gpu.driver_version"]
    assert "580.95.05" in reasons[0].message and "580.95.06" in reasons[0].message


def test_too_little_free_memory_on_the_target_gpu_is_refused(
    fake_nodes, spawn: Spawn, coordinators: Coordinators, tmp_path: Path
) -> None:
    node: FakeNode = fake_nodes("a", [gpu(0, total_memory=256 * MIB)])
    stamp = _stamp(coordinators, node)
    stamp["bytes_per_device"] = {A0: 200 * MIB}
    spawn(tmp_path / "tenant", node.env, [(0, 96 * MIB)])
    reasons = coordinators(node).compat_reasons(stamp)
    assert [r.field for r in reasons] == ["gpu.devices[0].free_memory"]
    assert "0.16 GiB free, the checkpoint needs 0.20 GiB" in reasons[0].message


def test_the_workers_contexts_are_released_after_it_measured_free_memory(
    fake_nodes, coordinators: Coordinators
) -> None:
    """A context costs memory on its GPU (and shuts others out in EXCLUSIVE_PROCESS mode):
    the worker holds none between calls (issue 10 §2.9)."""
    ctx = 64 * MIB
    node: FakeNode = fake_nodes("a", [gpu(0), gpu(1)], context_memory=ctx)
    coordinator = coordinators(node)
    # Measured with its own context on that GPU, as a custom-storage restore will hold it.
    assert coordinator._free_by_uuid() == {A0: 141 * GIB - ctx, gpu(1)["uuid"]: 141 * GIB - ctx}
    # Another process sees only its own context in use: the worker's are gone.
    assert [node.free(0), node.free(1)] == [141 * GIB - ctx] * 2


def test_a_gpu_checkpoint_on_a_node_without_a_driver_is_refused(
    fake_nodes, coordinators: Coordinators, monkeypatch: pytest.MonkeyPatch
) -> None:
    node: FakeNode = fake_nodes("a")
    stamp = _stamp(coordinators, node)
    monkeypatch.setenv("LD_LIBRARY_PATH", node.env["LD_LIBRARY_PATH"])
    monkeypatch.delenv(ROOT_ENV)  # the library, and no GPU: cuInit says CUDA_ERROR_NO_DEVICE
    coordinator = GpuCoordinator.create(call_timeout_s=60.0)
    try:
        assert "CUDA_ERROR_NO_DEVICE" in coordinator.capabilities()["message"]
        assert [r.field for r in coordinator.compat_reasons(stamp)] == ["gpu.present"]
    finally:
        coordinator.close()


def test_a_cpu_checkpoint_asks_nothing_of_the_gpus(fake_nodes, coordinators: Coordinators) -> None:
    assert coordinators(fake_nodes("a")).compat_reasons({"present": False}) == []


def test_the_real_cuda_bindings_without_any_libcuda_say_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("this machine has an NVIDIA driver")
    monkeypatch.delenv(ROOT_ENV, raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", "")
    coordinator = GpuCoordinator.create(call_timeout_s=60.0)
    try:
        caps = coordinator.capabilities()
        assert caps["driver_present"] is False
        assert caps["message"].startswith("GPU checkpointing unavailable:")
        assert "\n" not in caps["message"]
        assert caps["checkpoint_api"] is False and caps["devices"] == []
        assert coordinator.stamp()["present"] is False
        assert coordinator.freeze([os.getpid()]).cuda_pids == []
    finally:
        coordinator.close()
