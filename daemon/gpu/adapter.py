"""The daemon's view of GPU support: the GPU coordinator, or "no GPU support" when it is off.

``[gpu] driver = "none"`` (or a coordinator that cannot be created) gives ``NoGpu``, which
finds no CUDA processes, stamps ``present: false`` and has no compatibility reasons of its
own; CPU checkpoints work the same either way.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from gpusnap.daemon.gate.verdict import Reason
from gpusnap.daemon.gpu.coordinator import GpuCoordinator
from gpusnap.daemon.gpu.custom_storage import CustomStorage, MemorySource
from gpusnap.daemon.gpu.inventory import NVRM_VERSION_FILE
from gpusnap.errors import Unavailable

log = logging.getLogger(__name__)


class Freeze(Protocol):
    cuda_pids: list[int]

    def to_stamp(self) -> dict[str, Any]: ...


class GpuAdapter(Protocol):
    """What the daemon asks of GPU support; ``GpuCoordinator`` and ``NoGpu`` give it."""

    def capabilities(self) -> dict[str, Any]: ...

    def stamp(self) -> dict[str, Any]: ...

    def freeze(self, pids: list[int], *, custom_storage: CustomStorage | None = None) -> Freeze:
        """Lock and checkpoint the CUDA processes among ``pids``; their device memory goes
        to ``custom_storage``'s sink where the driver offers it."""
        ...

    def thaw(self, freeze: Any) -> None: ...

    def restore(
        self, pids: list[int], gpu_stamp: dict[str, Any], *, source: MemorySource | None = None
    ) -> None:
        """Put restored processes back on this node's GPUs; a checkpoint whose device memory
        went to custom storage reads it from ``source``."""
        ...

    def compat_reasons(self, gpu_stamp: dict[str, Any]) -> list[Reason]: ...

    def close(self) -> None: ...


class _NoFreeze:
    def __init__(self) -> None:
        self.cuda_pids: list[int] = []

    def to_stamp(self) -> dict[str, Any]:
        return {"cuda_pids": [], "bytes_per_device": {}, "bytes_total": 0}


class NoGpu:
    """GPU support off: no CUDA processes, nothing to freeze or restore."""

    def __init__(self, message: str = 'GPU support is off ([gpu] driver = "none")') -> None:
        self.message = message

    def capabilities(self) -> dict[str, Any]:
        return {"driver_present": False, "message": self.message, "devices": []}

    def stamp(self) -> dict[str, Any]:
        return {"present": False}

    def freeze(self, pids: list[int], *, custom_storage: CustomStorage | None = None) -> Freeze:
        return _NoFreeze()

    def thaw(self, freeze: Any) -> None:
        return None

    def restore(
        self, pids: list[int], gpu_stamp: dict[str, Any], *, source: MemorySource | None = None
    ) -> None:
        if _holds_gpu_state(gpu_stamp):
            raise Unavailable(f"cannot restore GPU state: {self.message}")

    def compat_reasons(self, gpu_stamp: dict[str, Any]) -> list[Reason]:
        if _holds_gpu_state(gpu_stamp):
            return [
                Reason(
                    "gpu.present",
                    "GPU state",
                    "no GPU support",
                    f"the checkpoint holds GPU state but this node has none: {self.message}",
                )
            ]
        return []

    def close(self) -> None:
        return None


def _holds_gpu_state(gpu_stamp: dict[str, Any]) -> bool:
    return bool(gpu_stamp.get("present") and gpu_stamp.get("cuda_pids"))


def open_gpu(
    *,
    driver: str,
    call_timeout_s: float,
    lock_timeout_s: float,
    copy_rate_gbps: float = 1.0,
    nvidia_version_file: str = NVRM_VERSION_FILE,
) -> GpuAdapter:
    """GPU support as ``[gpu]`` configures it (``driver``: auto, cuda or none)."""
    if driver == "none":
        return NoGpu()
    try:
        coordinator: GpuAdapter = GpuCoordinator.create(
            call_timeout_s=call_timeout_s,
            copy_rate_gbps=copy_rate_gbps,
            lock_timeout_ms=int(lock_timeout_s * 1000),
            nvidia_version_file=nvidia_version_file,
        )
    except Exception as exc:  # GPU support must never keep CPU checkpoints from working
        log.warning("GPU support unavailable: %s", exc)
        return NoGpu(f"GPU support unavailable: {exc}")
    return coordinator
