"""A fake node: the directory ``GPUSNAP_FAKE_CUDA_ROOT`` names, with ``node.json`` (its
GPUs and driver, read by the fake at cuInit) and the kernel module's version file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GIB = 2**30
MIB = 2**20


def gpu(
    index: int,
    *,
    uuid: str | None = None,
    name: str = "NVIDIA H200",
    total_memory: int = 141 * GIB,
    compute_capability: tuple[int, int] = (9, 0),
) -> dict[str, Any]:
    """One ``gpus`` entry of node.json."""
    return {
        "uuid": uuid or f"GPU-{index:08x}-0000-4000-8000-{index:012x}",
        "name": name,
        "total_memory": total_memory,
        "compute_capability": list(compute_capability),
        "pci_bus_id": f"0000:{0x19 + index:02x}:00.0",
    }


# GPU UUIDs tests give the GPUs of a first node ("a", gpu(i)'s default) and of a second one.
A0 = "GPU-00000000-0000-4000-8000-000000000000"
B0, B1 = "GPU-b0b0b0b0-0000-4000-8000-00000000000b", "GPU-b1b1b1b1-0000-4000-8000-00000000000b"


VERSION_FILE = "nvidia-version"  # in a node: the kernel module's line, as /proc shows it


def nvrm_line(version: str) -> str:
    """The first line of /proc/driver/nvidia/version for driver ``version`` (open module)."""
    return (
        f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build  "
        "(dvs-builder@U16-I2-C03-12-4)  Thu Sep 25 2025"
    )


def write_node(
    root: Path,
    gpus: list[dict[str, Any]],
    *,
    driver_version: int = 13000,
    driver_version_string: str = "580.95.05",
    custom_storage: bool = False,
    copy_gbps: float = 20.0,
    **extra: Any,
) -> Path:
    """Create (or rewrite) the node directory ``root``; returns it.

    Also writes ``root/nvidia-version`` (``VERSION_FILE``), the kernel module's version line
    as /proc/driver/nvidia/version gives it on a real node: no driver call returns that
    version, so a daemon on this node is pointed at the file (``[gpu] nvidia_version_file``).
    """
    root.mkdir(parents=True, exist_ok=True)
    (root / VERSION_FILE).write_text(
        nvrm_line(driver_version_string) + "\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )
    doc = {
        "driver_version": driver_version,
        "driver_version_string": driver_version_string,
        "custom_storage": custom_storage,
        "copy_gbps": copy_gbps,
        "gpus": gpus,
        **extra,
    }
    (root / "node.json").write_text(json.dumps(doc, indent=1))
    return root


def one_gpu_node(tmp_path: Path, **kw: Any) -> Path:
    """``tmp_path/node-a``: one default H200 (UUID ``A0``)."""
    return write_node(tmp_path / "node-a", [gpu(0)], **kw)
