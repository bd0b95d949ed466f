"""The stamp's ``gpu`` section: what GPUs and driver a checkpoint was taken against."""

from __future__ import annotations

import re
from typing import Any

# "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 ..." (also "Open
# Kernel Module"). The version number is what must match; the build date may differ per node.
_NVRM = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)")

CHECKPOINT_API_MIN = 12080  # cuCheckpointProcess* at parity with cuda-checkpoint (r570)
GPU_REMAP_MIN = 13000  # CUcheckpointRestoreArgs.gpuPairs (r580)


def parse_nvrm_version(line: str | None) -> str | None:
    """``580.65.06`` from a /proc/driver/nvidia/version line, or None."""
    if not line:
        return None
    match = _NVRM.search(line)
    return match.group(1) if match else None


def cuda_version_text(version: int | None) -> str:
    if version is None:
        return "unknown"
    return f"{version // 1000}.{(version % 1000) // 10}"


def build_stamp(caps: dict[str, Any]) -> dict[str, Any]:
    """The stamp section from probed capabilities (see ``GpuCoordinator.capabilities``)."""
    if not caps.get("driver_present"):
        return {"present": False, "message": caps.get("message", "no NVIDIA driver")}
    devices = [
        {
            "index": d["index"],
            "name": d["name"],
            "uuid": d["uuid"],
            "compute_capability": d["compute_capability"],
            "memory_total": d["memory_total"],
            "pci_bus_id": d["pci_bus_id"],
        }
        for d in caps.get("devices", [])
    ]
    return {
        "present": True,
        "count": len(devices),
        "devices": devices,
        "driver_version": caps.get("driver_version"),
        "driver_version_line": caps.get("driver_version_line"),
        "driver_version_source": "/proc/driver/nvidia/version",
        "cuda_driver_version": caps.get("cuda_driver_version"),
        "checkpoint_api": caps.get("checkpoint_api"),
        "gpu_remap": caps.get("gpu_remap"),
        "custom_storage": caps.get("custom_storage"),
    }
