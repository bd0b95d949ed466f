"""What a freeze did (``GpuFreeze``) and what the stamp's ``gpu`` section says of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpusnap.daemon.gpu.custom_storage import CustomStorage

HOST_STAGED = "host-staged"
CUSTOM_STORAGE = "custom-storage"


@dataclass
class GpuFreeze:
    """What ``freeze`` did: the CUDA processes it checkpointed and what it cost."""

    cuda_pids: list[int]
    # pid -> bytes it held per GPU UUID: what its checkpoint released (host-staged: the rise of
    # free memory across it; custom storage: the sizes the driver mapped).
    per_process: dict[int, dict[str, int]] = field(default_factory=dict)
    lock_seconds: float = 0.0
    checkpoint_seconds: float = 0.0
    memory_copy: str = HOST_STAGED
    # Custom storage: one entry per process and device ({pid, position, uuid, path, size}),
    # and where they went (a thaw or a roll-back reads them back from its source).
    memory_files: list[dict[str, Any]] = field(default_factory=list)
    custom_storage: CustomStorage | None = field(default=None, repr=False)

    @property
    def bytes_per_device(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for used in self.per_process.values():
            for uuid, n in used.items():
                total[uuid] = total.get(uuid, 0) + n
        return total

    def to_stamp(self) -> dict[str, Any]:
        """Fields merged into the stamp's ``gpu`` section (none collide with ``stamp()``)."""
        per_device = self.bytes_per_device
        out: dict[str, Any] = {
            "cuda_pids": list(self.cuda_pids),
            "bytes_per_device": per_device,
            "bytes_total": sum(per_device.values()),
            "processes": [
                {
                    "pid": pid,
                    "bytes_per_device": dict(self.per_process.get(pid, {})),
                    "bytes": sum(self.per_process.get(pid, {}).values()),
                }
                for pid in self.cuda_pids
            ],
            "lock_seconds": self.lock_seconds,
            "checkpoint_seconds": self.checkpoint_seconds,
            "memory_copy": self.memory_copy,
        }
        if self.memory_files:
            out["memory_files"] = [dict(m) for m in self.memory_files]
        return out


def process_bytes(gpu_stamp: dict[str, Any], pid: int) -> int:
    """Device bytes ``pid`` held at the checkpoint (all of the checkpoint's without a record)."""
    for p in gpu_stamp.get("processes") or []:
        if isinstance(p, dict) and p.get("pid") == pid:
            return int(p.get("bytes") or 0)
    return int(gpu_stamp.get("bytes_total") or 0)
