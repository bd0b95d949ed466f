"""The real driver: one thin function per CUDA driver call, through ``cuda.bindings.driver``.

Imported only inside the GPU worker process (``_worker_main``), never by the daemon itself:
the daemon must not load libcuda, and a call that blocks inside the driver must be killable.
Every function takes and returns JSON values, because its arguments and results cross the
worker's pipe. Any result other than CUDA_SUCCESS raises ``CudaError`` naming the call, the
pid and the CUDA error name. The fake in ``tests/fakes/fake_cuda.py`` has the same surface.
"""

from __future__ import annotations

import ctypes
import logging
import uuid as uuidlib
from pathlib import Path
from typing import Any

from cuda.bindings import driver as cu

from gpusnap.daemon.gpu.cudaerror import CudaError
from gpusnap.daemon.gpu.ring import map_ring
from gpusnap.errors import Unavailable

log = logging.getLogger(__name__)

NVRM_VERSION_FILE = Path("/proc/driver/nvidia/version")
CUSTOM_STORAGE_ABI = 13040  # cuCheckpointOperationComplete first exists at CUDA 13.4

_initialized = False
_contexts: dict[int, Any] = {}  # ordinal -> retained primary context (released at exit)
_operations: dict[int, tuple[Any, list[dict[str, Any]]]] = {}  # handle -> (op, devices)


def _error_name(err: Any) -> str:
    try:
        res, name = cu.cuGetErrorName(err)
        if res == cu.CUresult.CUDA_SUCCESS and name:
            return bytes(name).decode()
    except Exception:  # noqa: S110 - the enum member's name is the same string
        pass
    return str(getattr(err, "name", err))


def _check(call: str, pid: int | None, result: Any) -> Any:
    """Unpack a cuda.bindings ``(CUresult, *values)`` tuple, raising on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(call, pid, _error_name(err))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def init() -> None:
    """``cuInit(0)``, once per worker lifetime. No driver library: ``Unavailable``."""
    global _initialized  # noqa: PLW0603 - one cuInit per process is the driver's own rule
    if _initialized:
        return
    try:
        result = cu.cuInit(0)
    except Exception as exc:  # cuda.pathfinder raises when libcuda.so.1 is absent
        raise Unavailable(
            f"no NVIDIA driver on this node: libcuda could not be loaded ({type(exc).__name__})"
        ) from exc
    _check("init", None, result)
    _initialized = True


def driver_version() -> int:
    """The driver's CUDA version, e.g. 13000 for a CUDA 13.0 driver."""
    return int(_check("driver_version", None, cu.cuDriverGetVersion()))


def driver_version_string() -> str | None:
    """The kernel module's version line (``NVRM version: ...``), or None without one."""
    try:
        text = NVRM_VERSION_FILE.read_text(errors="replace")
    except OSError:
        return None
    lines = text.splitlines()
    return lines[0].strip() if lines else None


def _uuid_text(raw: bytes) -> str:
    return "GPU-" + str(uuidlib.UUID(bytes=bytes(raw[:16])))


def _uuid_struct(text: str) -> Any:
    raw = uuidlib.UUID(text.removeprefix("GPU-").removeprefix("MIG-")).bytes
    value = cu.CUuuid()
    ctypes.memmove(value.getPtr(), raw, 16)
    return value


def _cstr(raw: Any) -> str:
    data = raw if isinstance(raw, bytes) else str(raw).encode()
    return data.split(b"\0", 1)[0].decode(errors="replace")


def _attribute(attr: Any, dev: Any) -> int:
    return int(_check("devices", None, cu.cuDeviceGetAttribute(attr, dev)))


def devices() -> list[dict[str, Any]]:
    """Every GPU this process sees: index, name, uuid, compute capability, memory, PCI bus id."""
    count = int(_check("devices", None, cu.cuDeviceGetCount()))
    found: list[dict[str, Any]] = []
    attr = cu.CUdevice_attribute
    for ordinal in range(count):
        dev = _check("devices", None, cu.cuDeviceGet(ordinal))
        major = _attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        minor = _attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        found.append(
            {
                "index": ordinal,
                "name": _cstr(_check("devices", None, cu.cuDeviceGetName(256, dev))),
                "uuid": _uuid_text(_check("devices", None, cu.cuDeviceGetUuid(dev)).bytes),
                "compute_capability": f"{major}.{minor}",
                "memory_total": int(_check("devices", None, cu.cuDeviceTotalMem(dev))),
                "pci_bus_id": _cstr(_check("devices", None, cu.cuDeviceGetPCIBusId(64, dev))),
            }
        )
    return found


def _primary_context(ordinal: int) -> Any:
    ctx = _contexts.get(ordinal)
    if ctx is None:
        dev = _check("memory_info", None, cu.cuDeviceGet(ordinal))
        ctx = _check("memory_info", None, cu.cuDevicePrimaryCtxRetain(dev))
        _contexts[ordinal] = ctx
    return ctx


def memory_info() -> dict[str, dict[str, int]]:
    """Free and total bytes per GPU UUID (``cuMemGetInfo`` in each retained primary context).

    Retaining the primary contexts once also satisfies custom storage, which needs them.
    """
    info: dict[str, dict[str, int]] = {}
    for dev in devices():
        _check("memory_info", None, cu.cuCtxSetCurrent(_primary_context(dev["index"])))
        free, total = _check("memory_info", None, cu.cuMemGetInfo())
        info[dev["uuid"]] = {"free": int(free), "total": int(total)}
    return info


def get_state(pid: int) -> str:
    """RUNNING, LOCKED, CHECKPOINTED, FAILED, CHECKPOINTING or RESTORING.

    CUDA_ERROR_NOT_INITIALIZED (raised) means the process holds no CUDA state.
    """
    state = _check("get_state", pid, cu.cuCheckpointProcessGetState(pid))
    return str(cu.CUprocessState(state).name).removeprefix("CU_PROCESS_STATE_")


def get_restore_thread_id(pid: int) -> int:
    return int(_check("get_restore_thread_id", pid, cu.cuCheckpointProcessGetRestoreThreadId(pid)))


def lock(pid: int, timeout_ms: int) -> None:
    """RUNNING -> LOCKED; CUDA_ERROR_NOT_READY when the timeout passes (process left RUNNING)."""
    args = cu.CUcheckpointLockArgs()
    args.timeoutMs = int(timeout_ms)
    _check("lock", pid, cu.cuCheckpointProcessLock(pid, args))


def checkpoint(pid: int) -> None:
    """LOCKED -> CHECKPOINTED, device memory staged in the target's host memory."""
    _check("checkpoint", pid, cu.cuCheckpointProcessCheckpoint(pid, None))


def _restore_args(gpu_pairs: list[list[str]] | list[tuple[str, str]] | None) -> Any:
    if not gpu_pairs:
        return None
    args = cu.CUcheckpointRestoreArgs()
    pairs = []
    for old, new in gpu_pairs:
        pair = cu.CUcheckpointGpuPair()
        pair.oldUuid = _uuid_struct(old)
        pair.newUuid = _uuid_struct(new)
        pairs.append(pair)
    args.gpuPairs = pairs
    args.gpuPairsCount = len(pairs)
    return args


def restore(pid: int, gpu_pairs: list[list[str]] | list[tuple[str, str]] | None) -> None:
    """CHECKPOINTED -> LOCKED, optionally onto other GPUs (pairs of old/new UUIDs)."""
    _check("restore", pid, cu.cuCheckpointProcessRestore(pid, _restore_args(gpu_pairs)))


def unlock(pid: int) -> None:
    """LOCKED -> RUNNING."""
    _check("unlock", pid, cu.cuCheckpointProcessUnlock(pid, None))


def custom_storage_supported() -> bool:
    """Whether this driver resolves ``cuCheckpointOperationComplete`` at ABI 13040.

    No driver floor is published for custom storage; drivers before it answer
    CUDA_ERROR_INVALID_VALUE or a null pointer, which both mean "no".
    """
    flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    try:
        err, pfn, status = cu.cuGetProcAddress(
            b"cuCheckpointOperationComplete", CUSTOM_STORAGE_ABI, flags
        )
    except Exception as exc:
        log.info("custom storage probe failed: %s", exc)
        return False
    found = cu.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS
    return bool(err == cu.CUresult.CUDA_SUCCESS and int(pfn or 0) != 0 and status == found)


def _device_of_stream(call: str, pid: int, stream: Any) -> tuple[Any, int]:
    """The context and device ordinal of a custom-storage stream.

    The mapped pointer carries no context attribute; the per-device stream does
    (``cuStreamGetCtx``), and from it the device (``cuCtxGetDevice`` in that context).
    """
    ctx = _check(call, pid, cu.cuStreamGetCtx(stream))
    _check(call, pid, cu.cuCtxSetCurrent(ctx))
    dev = _check(call, pid, cu.cuCtxGetDevice())
    return ctx, int(dev)


def _storage_info(call: str, pid: int, info_ptr: ctypes.c_void_p) -> dict[str, Any]:
    if not info_ptr.value:
        raise CudaError(call, pid, "CUDA_ERROR_INVALID_VALUE")
    info = cu.CUcheckpointCustomStorageInfo(_ptr=info_ptr.value)
    handle_id = int(info.handle.getPtr())
    per_device = info.perDeviceData
    entries = per_device if isinstance(per_device, list) else [per_device]
    uuids = {d["index"]: d["uuid"] for d in devices()}
    mapped: list[dict[str, Any]] = []
    for entry in entries[: int(info.deviceCount)]:
        ctx, ordinal = _device_of_stream(call, pid, entry.stream)
        mapped.append(
            {
                "index": ordinal,
                "uuid": uuids.get(ordinal),
                "dev_ptr": int(entry.devPtr),
                "size": int(entry.size),
                "ctx": ctx,
                "stream": entry.stream,
            }
        )
    _operations[handle_id] = (info.handle, mapped)
    return {
        "handle": handle_id,
        "devices": [
            {"index": m["index"], "uuid": m["uuid"], "size": m["size"], "dev_ptr": m["dev_ptr"]}
            for m in mapped
        ],
    }


def checkpoint_custom_storage(pid: int) -> dict[str, Any]:
    """LOCKED -> CHECKPOINTING with the target's memory mapped onto this process's GPUs.

    Returns the operation handle and, per device, the mapped pointer, size and stream; the
    caller copies the bytes out and then calls ``operation_complete(handle)``. Needs cuInit and
    retained primary contexts (``memory_info`` retains them).
    """
    memory_info()
    info_ptr = ctypes.c_void_p(0)
    args = cu.CUcheckpointCheckpointArgs()
    args.customStorageInfo_out = ctypes.addressof(info_ptr)
    _check("checkpoint_custom_storage", pid, cu.cuCheckpointProcessCheckpoint(pid, args))
    return _storage_info("checkpoint_custom_storage", pid, info_ptr)


def restore_custom_storage(
    pid: int, gpu_pairs: list[list[str]] | list[tuple[str, str]] | None
) -> dict[str, Any]:
    """CHECKPOINTED -> RESTORING with the memory to fill mapped onto this process's GPUs."""
    memory_info()
    info_ptr = ctypes.c_void_p(0)
    args = _restore_args(gpu_pairs) or cu.CUcheckpointRestoreArgs()
    args.customStorageInfo_out = ctypes.addressof(info_ptr)
    _check("restore_custom_storage", pid, cu.cuCheckpointProcessRestore(pid, args))
    return _storage_info("restore_custom_storage", pid, info_ptr)


def operation_complete(handle: int) -> None:
    """Finish a custom-storage operation: CHECKPOINTING -> CHECKPOINTED, RESTORING -> LOCKED.

    The driver first synchronises the streams it returned; this worker's own copy streams
    were synchronised by every ``copy_out``/``copy_in`` already.
    """
    found = _operations.pop(handle, None)
    if found is None:
        raise CudaError("operation_complete", None, "CUDA_ERROR_INVALID_HANDLE")
    op, _mapped = found
    _check("operation_complete", None, cu.cuCheckpointOperationComplete(op))


# -- copies through the shared ring (custom storage) ----------------------------------------

COPY_STREAMS = 4  # per device; 2-4 streams of 32-64 MiB copies saturate H2D into the mapping
_rings: dict[str, tuple[Any, int, int]] = {}  # name -> (mmap, host address, size)
_copy_streams: dict[int, list[Any]] = {}  # device ordinal -> this worker's copy streams


def ring_attach(name: str, size: int) -> None:
    """Map the daemon's ring and page-lock it (``cuMemHostRegister``), once per ring."""
    if name in _rings:
        return
    mapped = map_ring(name, int(size))
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
    flags = cu.CU_MEMHOSTREGISTER_PORTABLE
    try:
        _check("ring_attach", None, cu.cuMemHostRegister(address, int(size), flags))
    except CudaError:
        mapped.close()
        raise
    _rings[name] = (mapped, address, int(size))


def ring_detach(name: str) -> None:
    found = _rings.pop(name, None)
    if found is None:
        return
    mapped, address, _size = found
    try:
        _check("ring_detach", None, cu.cuMemHostUnregister(address))
    finally:
        mapped.close()


def _streams_for(ctx: Any, ordinal: int) -> list[Any]:
    streams = _copy_streams.get(ordinal)
    if streams is None:
        _check("copy_out", None, cu.cuCtxSetCurrent(ctx))
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        streams = [_check("copy_out", None, cu.cuStreamCreate(flags)) for _ in range(COPY_STREAMS)]
        _copy_streams[ordinal] = streams
    return streams


def _copy(call: str, handle: int, device: int, ring: str, copies: list[list[int]]) -> None:
    found = _operations.get(handle)
    if found is None:
        raise CudaError(call, None, "CUDA_ERROR_INVALID_HANDLE")
    _op, mapped = found
    if not 0 <= device < len(mapped) or ring not in _rings:
        raise CudaError(call, None, "CUDA_ERROR_INVALID_VALUE")
    dev = mapped[device]
    _mapped_ring, base, ring_size = _rings[ring]
    streams = _streams_for(dev["ctx"], dev["index"])
    _check(call, None, cu.cuCtxSetCurrent(dev["ctx"]))
    used: list[Any] = []
    for i, (ring_offset, dev_offset, nbytes) in enumerate(copies):
        if ring_offset + nbytes > ring_size or dev_offset + nbytes > dev["size"] or nbytes < 0:
            raise CudaError(call, None, "CUDA_ERROR_INVALID_VALUE")
        stream = streams[i % len(streams)]
        host = base + ring_offset
        device_ptr = cu.CUdeviceptr(dev["dev_ptr"] + dev_offset)
        if call == "copy_out":
            _check(call, None, cu.cuMemcpyDtoHAsync(host, device_ptr, nbytes, stream))
        else:
            _check(call, None, cu.cuMemcpyHtoDAsync(device_ptr, host, nbytes, stream))
        if stream not in used:
            used.append(stream)
    for stream in used:
        _check(call, None, cu.cuStreamSynchronize(stream))


def copy_out(handle: int, device: int, ring: str, copies: list[list[int]]) -> None:
    """Copy ``[ring offset, device offset, bytes]`` ranges of mapped device memory into the
    ring, spread over this worker's streams, and wait for all of them."""
    _copy("copy_out", handle, device, ring, copies)


def copy_in(handle: int, device: int, ring: str, copies: list[list[int]]) -> None:
    """The reverse of ``copy_out``: ring ranges into the mapped memory of a restore."""
    _copy("copy_in", handle, device, ring, copies)
