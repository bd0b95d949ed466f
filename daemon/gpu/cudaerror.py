"""A failed CUDA driver call, and the error kind each CUDA error name maps to.

Kept free of ``cuda`` imports so that the daemon process (which never loads libcuda itself)
can use it.
"""

from __future__ import annotations

from gpusnap.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    GpusnapError,
    Internal,
    InvalidArgument,
    Unavailable,
    Unsupported,
)

# The driver's C names, as ``cuGetErrorName`` returns them, for the calls the worker runs.
CALL_NAMES: dict[str, str] = {
    "init": "cuInit",
    "get_state": "cuCheckpointProcessGetState",
    "get_restore_thread_id": "cuCheckpointProcessGetRestoreThreadId",
    "lock": "cuCheckpointProcessLock",
    "checkpoint": "cuCheckpointProcessCheckpoint",
    "restore": "cuCheckpointProcessRestore",
    "unlock": "cuCheckpointProcessUnlock",
    "checkpoint_custom_storage": "cuCheckpointProcessCheckpoint(customStorageInfo_out)",
    "restore_custom_storage": "cuCheckpointProcessRestore(customStorageInfo_out)",
    "operation_complete": "cuCheckpointOperationComplete",
    "ring_attach": "cuMemHostRegister",
    "ring_detach": "cuMemHostUnregister",
    "copy_out": "cuMemcpyDtoHAsync",
    "copy_in": "cuMemcpyHtoDAsync",
    "custom_storage_supported": "cuGetProcAddress(cuCheckpointOperationComplete, 13040)",
    "bindings": "cuda.bindings",
    "driver_version": "cuDriverGetVersion",
    "driver_version_string": "/proc/driver/nvidia/version",
    "devices": "cuDeviceGet*",
    "memory_info": "cuMemGetInfo",
}

# What the checkpoint calls answer for a pid that holds no CUDA state: NOT_INITIALIZED (no
# driver there, no cuInit, no context), INVALID_VALUE (no such process, e.g. one that just
# exited). NVIDIA's own helper treats both alike (ai-dynamo/snapshot#109).
NO_CUDA_STATE = ("CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_INVALID_VALUE")

_KINDS: dict[str, type[GpusnapError]] = {
    # For a pid, NOT_INITIALIZED means "this process holds no CUDA state".
    "CUDA_ERROR_NOT_INITIALIZED": FailedPrecondition,
    "CUDA_ERROR_ILLEGAL_STATE": FailedPrecondition,
    "CUDA_ERROR_OUT_OF_MEMORY": FailedPrecondition,
    "CUDA_ERROR_NOT_READY": DeadlineExceeded,  # lock timed out; the process runs on
    "CUDA_ERROR_NOT_SUPPORTED": Unsupported,
    "CUDA_ERROR_NOT_FOUND": Unsupported,
    "CUDA_ERROR_INVALID_VALUE": InvalidArgument,
    "CUDA_ERROR_NO_DEVICE": Unavailable,
    "CUDA_ERROR_INSUFFICIENT_DRIVER": Unavailable,
    "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH": Unavailable,
    "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE": Unavailable,
    "CUDA_ERROR_OPERATING_SYSTEM": FailedPrecondition,  # e.g. no ptrace rights over the target
    "CUDA_ERROR_INVALID_HANDLE": InvalidArgument,
    "CUDA_ERROR_INVALID_CONTEXT": FailedPrecondition,  # custom storage without primary contexts
}


def kind_for(cuda_error: str) -> type[GpusnapError]:
    """The project's error kind for a CUDA error name."""
    return _KINDS.get(cuda_error, Internal)


class CudaError(Exception):
    """A driver call returned something other than CUDA_SUCCESS.

    Raised by the driver modules inside the GPU worker; the worker sends ``call``, ``pid`` and
    ``cuda_error`` to the daemon, which raises the matching kind from ``gpusnap.errors``.
    """

    def __init__(self, call: str, pid: int | None, cuda_error: str) -> None:
        self.call = call
        self.pid = pid
        self.cuda_error = cuda_error
        super().__init__(self.message)

    @property
    def message(self) -> str:
        name = CALL_NAMES.get(self.call, self.call)
        target = f"({self.pid})" if self.pid is not None else "()"
        return f"{name}{target} failed: {self.cuda_error}"
