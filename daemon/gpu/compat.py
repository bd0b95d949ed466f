"""GPU compatibility rules: may a checkpoint's GPU state be restored on this node?

A restore onto another chip, compute capability or GPU count, or any other driver version,
crashes or corrupts; one that runs out of GPU memory wedges the process in CHECKPOINTED for
good. Each mismatch becomes one ``Reason``; any reason means cold start.
"""

from __future__ import annotations

from typing import Any

from gpusnap.daemon.gate.verdict import Reason


def bytes_per_device(gpu_stamp: dict[str, Any]) -> dict[str, int]:
    """GPU bytes the checkpoint holds per old GPU UUID (from ``GpuFreeze.to_stamp``)."""
    raw = gpu_stamp.get("bytes_per_device")
    if raw is None and isinstance(gpu_stamp.get("freeze"), dict):
        raw = gpu_stamp["freeze"].get("bytes_per_device")
    return {str(k): int(v) for k, v in (raw or {}).items()}


def target_devices(
    gpu_stamp: dict[str, Any], here: list[dict[str, Any]], gpu_map: dict[str, str] | None
) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Pairs (old device, this node's device or None): by the explicit map, else in order."""
    by_uuid = {d["uuid"]: d for d in here}
    pairs: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    for i, old in enumerate(gpu_stamp.get("devices", [])):
        if gpu_map is not None:
            pairs.append((old, by_uuid.get(gpu_map.get(old["uuid"], ""))))
        else:
            pairs.append((old, here[i] if i < len(here) else None))
    return pairs


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def gpu_compat_reasons(
    gpu_stamp: dict[str, Any],
    here_stamp: dict[str, Any],
    free_by_uuid: dict[str, int],
    gpu_map: dict[str, str] | None = None,
) -> list[Reason]:
    """Every reason this node cannot take the checkpoint's GPU state; empty means it can."""
    if not gpu_stamp.get("present"):
        return []  # a CPU-only checkpoint asks nothing of the GPUs here
    if not here_stamp.get("present"):
        return [
            Reason(
                "gpu.present",
                "true",
                "false",
                "checkpoint holds GPU state but this node has no usable NVIDIA driver: "
                + str(here_stamp.get("message", "")),
            )
        ]
    reasons: list[Reason] = []
    old_count, new_count = int(gpu_stamp.get("count", 0)), int(here_stamp.get("count", 0))
    if old_count != new_count:
        reasons.append(
            Reason(
                "gpu.count",
                str(old_count),
                str(new_count),
                f"checkpoint was taken with {old_count} GPU(s), this node has {new_count}",
            )
        )
    for field in ("driver_version", "cuda_driver_version"):
        old, new = gpu_stamp.get(field), here_stamp.get(field)
        if old != new:
            reasons.append(
                Reason(
                    f"gpu.{field}",
                    str(old),
                    str(new),
                    f"driver {field.replace('_', ' ')} differs: checkpoint {old}, this node {new}",
                )
            )
    needed = bytes_per_device(gpu_stamp)
    for i, (old, new) in enumerate(target_devices(gpu_stamp, here_stamp["devices"], gpu_map)):
        if new is None:
            if old_count == new_count:  # else the count reason already says it
                reasons.append(
                    Reason(
                        f"gpu.devices[{i}].uuid",
                        str(old.get("uuid")),
                        "none",
                        f"no GPU on this node to take GPU {i} ({old.get('uuid')})",
                    )
                )
            continue
        for key, label in (("name", "chip"), ("compute_capability", "compute capability")):
            if old.get(key) != new.get(key):
                reasons.append(
                    Reason(
                        f"gpu.devices[{i}].{key}",
                        str(old.get(key)),
                        str(new.get(key)),
                        f"GPU {i} {label} differs: checkpoint {old.get(key)}, "
                        f"this node {new.get(key)}",
                    )
                )
        need = needed.get(str(old.get("uuid")), 0)
        free = free_by_uuid.get(str(new.get("uuid")), 0)
        if need > free:
            reasons.append(
                Reason(
                    f"gpu.devices[{i}].free_memory",
                    str(need),
                    str(free),
                    f"GPU {i} ({new.get('uuid')}) has {_gib(free)} free, "
                    f"the checkpoint needs {_gib(need)}",
                )
            )
    return reasons
