"""GPU state: checkpoint and restore CUDA processes through the CUDA driver's checkpoint API.

``GpuCoordinator`` is the daemon's entry point; ``GpuFreeze`` is what a freeze did. Driver
calls run in a separate worker process (``worker``), never in the daemon, so this package
must not import ``cuda`` at import time; only ``driver`` (loaded by the worker) does. It must
not import the fake driver in ``tests/``: that is loaded by import path at run time.
"""

from gpusnap.daemon.gpu.coordinator import GpuCoordinator, GpuFreeze

__all__ = ["GpuCoordinator", "GpuFreeze"]
