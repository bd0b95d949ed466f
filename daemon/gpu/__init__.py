"""GPU state: checkpoint and restore CUDA processes through the CUDA driver's checkpoint API.

``GpuCoordinator`` is the daemon's entry point (the policy: lock all, checkpoint each, roll
back, restore with UUID pairs); ``GpuFreeze`` is what a freeze did; ``adapter`` is the view the
rest of the daemon has (``GpuAdapter``, or ``NoGpu`` when GPU support is off);
``custom_storage`` copies device memory itself where the driver offers it. Driver calls run in
a separate worker process (``worker``), never in the daemon.

Must not import ``cuda`` at import time (only ``driver``, loaded by the worker, does), nor
``gpusnap.storage``: what custom storage copies out or in goes through the sink and source
callables the checkpoint and restore bodies give it (``daemon/pipelines/gpu_memory.py``).
Imports only ``daemon/gate/verdict.py`` and ``gpusnap.errors`` outside itself.
"""

from gpusnap.daemon.gpu.coordinator import GpuCoordinator
from gpusnap.daemon.gpu.freeze import GpuFreeze

__all__ = ["GpuCoordinator", "GpuFreeze"]
