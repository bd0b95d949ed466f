"""Capabilities, the stamp's gpu section and the GPU compatibility rules."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from gpusnap.daemon.gpu import GpuCoordinator
from gpusnap.daemon.gpu.inventory import parse_nvrm_version
from gpusnap.errors import Unsupported
from tests.fakes.fake_cuda import GIB, default_devices


def _stamp(make_coordinator: Callable[..., GpuCoordinator]) -> dict[str, Any]:
    coordinator = make_coordinator()
    stamp = coordinator.stamp()
    coordinator.close()
    return stamp


def test_capabilities_report_driver_floor_flags_and_no_custom_storage_on_580(
    fake, make_coordinator
):
    caps = make_coordinator().capabilities()
    assert caps["driver_present"] is True
    assert caps["driver_version"] == "580.95.05"
    assert caps["cuda_driver_version"] == 13000
    assert (caps["checkpoint_api"], caps["gpu_remap"], caps["custom_storage"]) == (
        True,
        True,
        False,
    )
    assert "\n" not in caps["message"] and "custom storage no" in caps["message"]


def test_a_cuda_12_6_driver_has_no_checkpoint_api(fake, sleepers, make_coordinator):
    fake.setup(cuda_version=12060)
    (pid,) = sleepers(1)
    fake.add_process(pid)
    coordinator = make_coordinator()
    assert coordinator.capabilities()["checkpoint_api"] is False
    with pytest.raises(Unsupported, match="no checkpoint API"):
        coordinator.freeze([pid])
    assert fake.state_of(pid) == "RUNNING"


def test_stamp_records_every_gpu_and_the_exact_driver(fake, make_coordinator):
    fake.setup(devices=default_devices(2))
    stamp = _stamp(make_coordinator)
    assert stamp["present"] is True and stamp["count"] == 2
    first = stamp["devices"][0]
    assert first == {
        "index": 0,
        "name": "NVIDIA H200",
        "uuid": "GPU-00000000-0000-0000-0000-000000000000",
        "compute_capability": "9.0",
        "memory_total": 141 * GIB,
        "pci_bus_id": "00000000:18:00.0",
    }
    assert stamp["driver_version"] == "580.95.05"
    assert stamp["cuda_driver_version"] == 13000


def test_parse_nvrm_version_reads_proprietary_and_open_modules():
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


def test_same_node_is_compatible(fake, make_coordinator):
    stamp = _stamp(make_coordinator)
    assert make_coordinator().compat_reasons(stamp) == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"name": "NVIDIA H100 80GB HBM3"}, "gpu.devices[0].name"),
        ({"compute_capability": "10.0"}, "gpu.devices[0].compute_capability"),
    ],
)
def test_a_different_chip_is_refused(fake, make_coordinator, change, field):
    stamp = _stamp(make_coordinator)
    fake.update(devices=[dict(default_devices(1)[0], **change)])
    reasons = make_coordinator().compat_reasons(stamp)
    assert [r.field for r in reasons] == [field]


def test_a_different_gpu_count_is_refused(fake, make_coordinator):
    stamp = _stamp(make_coordinator)
    fake.update(devices=default_devices(2))
    reasons = make_coordinator().compat_reasons(stamp)
    assert [r.field for r in reasons] == ["gpu.count"]
    assert reasons[0].expected == "1" and reasons[0].actual == "2"


def test_any_driver_version_difference_is_refused(fake, make_coordinator):
    stamp = _stamp(make_coordinator)
    fake.update(driver_line="NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.06  R")
    reasons = make_coordinator().compat_reasons(stamp)
    assert [r.field for r in reasons] == ["gpu.driver_version"]
    assert "580.95.05" in reasons[0].message and "580.95.06" in reasons[0].message


def test_too_little_free_memory_on_the_target_gpu_is_refused(fake, sleepers, make_coordinator):
    stamp = _stamp(make_coordinator)
    uuid = stamp["devices"][0]["uuid"]
    stamp["bytes_per_device"] = {uuid: 120 * GIB}
    (tenant,) = sleepers(1)
    fake.add_process(tenant, {uuid: 30 * GIB})  # 141 - 1 reserved - 30 = 110 GiB free
    reasons = make_coordinator().compat_reasons(stamp)
    assert [r.field for r in reasons] == ["gpu.devices[0].free_memory"]
    assert "110.00 GiB free" in reasons[0].message


def test_gpu_checkpoint_on_a_node_without_driver_is_refused(fake, make_coordinator):
    stamp = _stamp(make_coordinator)
    fake.update(init_error="CUDA_ERROR_NO_DEVICE")
    reasons = make_coordinator().compat_reasons(stamp)
    assert [r.field for r in reasons] == ["gpu.present"]


def test_cpu_checkpoint_asks_nothing_of_the_gpus(fake, make_coordinator):
    assert make_coordinator().compat_reasons({"present": False}) == []


def test_real_cuda_bindings_without_a_driver_say_so_in_one_line(monkeypatch, sleepers):
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("this machine has an NVIDIA driver")
    monkeypatch.delenv("GPUSNAP_GPU_DRIVER", raising=False)
    coordinator = GpuCoordinator.create(driver="cuda", call_timeout_s=60.0)
    try:
        caps = coordinator.capabilities()
        assert caps["driver_present"] is False
        assert caps["message"].startswith("GPU checkpointing unavailable:")
        assert "\n" not in caps["message"]
        assert caps["checkpoint_api"] is False and caps["devices"] == []
        assert coordinator.stamp()["present"] is False
        (pid,) = sleepers(1)
        assert coordinator.freeze([pid]).cuda_pids == []
    finally:
        coordinator.close()
