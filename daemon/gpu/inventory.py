"""What GPUs and driver this node has (probed through the worker), and the stamp's ``gpu``
section: what GPUs and driver a checkpoint was taken against."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from gpusnap.errors import GpusnapError

if TYPE_CHECKING:
    from gpusnap.daemon.gpu.worker import GpuWorker

log = logging.getLogger(__name__)

# "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 ..." (also "Open
# Kernel Module"). The version number is what must match; the build date may differ per node.
_NVRM = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)")

NVRM_VERSION_FILE = "/proc/driver/nvidia/version"  # where the kernel module says its version
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
        "driver_version_source": caps.get("driver_version_source"),
        "cuda_driver_version": caps.get("cuda_driver_version"),
        "checkpoint_api": caps.get("checkpoint_api"),
        "gpu_remap": caps.get("gpu_remap"),
        "custom_storage": caps.get("custom_storage"),
        "cuda_bindings": caps.get("cuda_bindings"),
    }


def probe_capabilities(worker: GpuWorker, version_file: str = NVRM_VERSION_FILE) -> dict[str, Any]:
    """What the driver behind ``worker`` offers; without one, ``driver_present`` False and a
    one-line ``message`` saying why.

    The driver's version (``580.95.05``) comes from ``version_file``, the kernel module's
    ``NVRM version`` line: no driver call returns it (``cuDriverGetVersion`` is the CUDA
    version the driver supports, ``13000``)."""
    caps: dict[str, Any] = {
        "driver_present": False,
        "message": "",
        "driver_version": None,
        "driver_version_line": None,
        "cuda_driver_version": None,
        "checkpoint_api": False,
        "gpu_remap": False,
        "custom_storage": False,
        "cuda_bindings": None,
        "driver_version_source": version_file,
        "devices": [],
    }
    try:
        bindings = dict(worker.call("bindings"))
        caps["cuda_bindings"] = bindings["version"]
        worker.call("init")
        version = int(worker.call("driver_version"))
        line = worker.call("driver_version_string", version_file)
        caps["devices"] = list(worker.call("devices"))
        caps["custom_storage"] = bool(worker.call("custom_storage_supported"))
    except GpusnapError as err:
        caps["message"] = f"GPU checkpointing unavailable: {err}"
        log.info("%s", caps["message"])
        return caps
    caps.update(
        driver_present=True,
        driver_version=parse_nvrm_version(line),
        driver_version_line=line,
        cuda_driver_version=version,
        checkpoint_api=version >= CHECKPOINT_API_MIN,
        gpu_remap=version >= GPU_REMAP_MIN and bool(bindings["gpu_pairs"]),
    )

    def yes(flag: str) -> str:
        return "yes" if caps[flag] else "no"

    caps["message"] = (
        f"NVIDIA driver {caps['driver_version'] or 'unknown'} "
        f"(CUDA {cuda_version_text(version)}), {len(caps['devices'])} GPU(s); "
        f"checkpoint API {yes('checkpoint_api')}, GPU remap {yes('gpu_remap')}, "
        f"custom storage {yes('custom_storage')}"
        + ("" if bindings["custom_storage"] else f" (cuda-bindings {bindings['version']} has none)")
    )
    log.info("%s", caps["message"])
    return caps
