"""The real driver: one thin function per CUDA driver call, through ``cuda.bindings.driver``.

Imported only inside the GPU worker process (``_worker_main``), never by the daemon itself:
the daemon must not load libcuda, and a call that blocks inside the driver must be killable.
Every function takes and returns JSON values, because its arguments and results cross the
worker's pipe. Any result other than CUDA_SUCCESS raises ``CudaError`` naming the call, the
pid and the CUDA error name. Tests run this very module against a fake ``libcuda.so.1``
(``tests/fakes/libcuda``), loaded by the same cuda-bindings.

Contexts: the worker holds a primary context only while it needs one (issue 10 §2.9: a
context costs device memory on its GPU and, in EXCLUSIVE_PROCESS mode, shuts the workload
out): ``memory_info`` retains, measures and releases each GPU's; a custom-storage operation
holds those of its GPUs until ``operation_complete``; an attached ring holds device 0's, in
which it was page-locked, until ``ring_detach``.
"""

from __future__ import annotations

import ctypes
import logging
import re
import uuid as uuidlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import cuda.bindings
from cuda.bindings import driver as cu

from gpusnap.daemon.gpu.cudaerror import CudaError
from gpusnap.daemon.gpu.ring import map_ring
from gpusnap.errors import Unavailable

log = logging.getLogger(__name__)

CUSTOM_STORAGE_ABI = 13040  # cuCheckpointOperationComplete first exists at CUDA 13.4
# cuda-bindings 13.4.1 is the first with the custom-storage names (its release notes); 13.4.0
# was a developer preview.
CUSTOM_STORAGE_BINDINGS = (13, 4, 1)

_initialized = False
_retained: dict[int, tuple[Any, int]] = {}  # ordinal -> (primary context, our retain count)
# handle -> (operation handle, devices, copy streams by ordinal)
_operations: dict[int, tuple[Any, list[dict[str, Any]], dict[int, list[Any]]]] = {}


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


def _version_tuple(text: str) -> tuple[int, ...]:
    found = re.match(r"(\d+(?:\.\d+)*)", text)
    return tuple(int(p) for p in found.group(1).split(".")) if found else ()


def bindings() -> dict[str, Any]:
    """What this cuda-bindings offers, found at run time: its version, GPU pairs, custom storage."""
    version = str(getattr(cuda.bindings, "__version__", "unknown"))
    names = ("cuCheckpointOperationComplete", "CUcheckpointCustomStorageInfo")
    return {
        "version": version,
        "gpu_pairs": hasattr(cu, "CUcheckpointGpuPair"),
        "custom_storage": _version_tuple(version) >= CUSTOM_STORAGE_BINDINGS
        and all(hasattr(cu, n) for n in names),
    }


def driver_version() -> int:
    """The driver's CUDA version, e.g. 13000 for a CUDA 13.0 driver."""
    return int(_check("driver_version", None, cu.cuDriverGetVersion()))


def driver_version_string(path: str) -> str | None:
    """The kernel module's version line (``NVRM version: ...``), or None without one.

    No driver call returns it; the kernel module writes it to /proc/driver/nvidia/version
    (``[gpu] nvidia_version_file`` names another file of that format, e.g. a fake node's).
    """
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    lines = text.splitlines()
    return lines[0].strip() if lines else None


def _uuid_text(raw: bytes, name: str) -> str:
    # A MIG instance is named "<GPU> MIG <profile>" and nvidia-smi spells its UUID "MIG-…";
    # CUDA_VISIBLE_DEVICES and the restore's pairs take that spelling.
    prefix = "MIG-" if re.search(r"\bMIG\b", name) else "GPU-"
    return prefix + str(uuidlib.UUID(bytes=bytes(raw[:16])))


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
        name = _cstr(_check("devices", None, cu.cuDeviceGetName(256, dev)))
        found.append(
            {
                "index": ordinal,
                "name": name,
                "uuid": _uuid_text(_check("devices", None, cu.cuDeviceGetUuid(dev)).bytes, name),
                "compute_capability": f"{major}.{minor}",
                "memory_total": int(_check("devices", None, cu.cuDeviceTotalMem(dev))),
                "pci_bus_id": _cstr(_check("devices", None, cu.cuDeviceGetPCIBusId(64, dev))),
            }
        )
    return found


# -- primary contexts: held only while needed ------------------------------------------------


def _retain(call: str, ordinal: int) -> Any:
    held = _retained.get(ordinal)
    if held is None:
        dev = _check(call, None, cu.cuDeviceGet(ordinal))
        held = (_check(call, None, cu.cuDevicePrimaryCtxRetain(dev)), 0)
    _retained[ordinal] = (held[0], held[1] + 1)
    return held[0]


def _release(call: str, ordinal: int) -> None:
    ctx, count = _retained.pop(ordinal, (None, 0))
    if count > 1:
        _retained[ordinal] = (ctx, count - 1)
    elif ctx is not None:
        _check(call, None, cu.cuCtxSetCurrent(None))
        _check(
            call, None, cu.cuDevicePrimaryCtxRelease(_check(call, None, cu.cuDeviceGet(ordinal)))
        )


@contextmanager
def _context(call: str, ordinal: int) -> Iterator[Any]:
    """GPU ``ordinal``'s primary context, current for the block, released after it."""
    ctx = _retain(call, ordinal)
    try:
        _check(call, None, cu.cuCtxSetCurrent(ctx))
        yield ctx
    finally:
        _release(call, ordinal)


def memory_info() -> dict[str, dict[str, int]]:
    """Free and total bytes per GPU UUID (``cuMemGetInfo`` in each GPU's primary context).

    Measured with this worker's own context on that GPU, which a custom-storage restore holds
    too; the host-staged restore, which holds none, finds at least that much free.
    """
    info: dict[str, dict[str, int]] = {}
    for dev in devices():
        try:
            with _context("memory_info", dev["index"]):
                free, total = _check("memory_info", None, cu.cuMemGetInfo())
        except CudaError as err:
            if err.cuda_error != "CUDA_ERROR_OUT_OF_MEMORY":
                raise
            free, total = 0, dev["memory_total"]  # not even a context fits: nothing is free
        info[dev["uuid"]] = {"free": int(free), "total": int(total)}
    return info


# -- the checkpoint calls ------------------------------------------------------------------


def get_state(pid: int) -> str:
    """RUNNING, LOCKED, CHECKPOINTED, FAILED, CHECKPOINTING or RESTORING.

    CUDA_ERROR_NOT_INITIALIZED or CUDA_ERROR_INVALID_VALUE (raised): no CUDA state there.
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


def restore_args(gpu_pairs: list[list[str]] | None) -> Any:
    """The CUcheckpointRestoreArgs naming ``gpu_pairs`` (old/new UUIDs), none if none."""
    args = cu.CUcheckpointRestoreArgs()
    if gpu_pairs:
        pairs = []
        for old, new in gpu_pairs:
            pair = cu.CUcheckpointGpuPair()
            pair.oldUuid = _uuid_struct(old)
            pair.newUuid = _uuid_struct(new)
            pairs.append(pair)
        args.gpuPairs = pairs
        args.gpuPairsCount = len(pairs)
    return args


def restore(pid: int, gpu_pairs: list[list[str]] | None) -> None:
    """CHECKPOINTED -> LOCKED, optionally onto other GPUs (pairs of old/new UUIDs)."""
    args = restore_args(gpu_pairs) if gpu_pairs else None
    _check("restore", pid, cu.cuCheckpointProcessRestore(pid, args))


def unlock(pid: int) -> None:
    """LOCKED -> RUNNING."""
    _check("unlock", pid, cu.cuCheckpointProcessUnlock(pid, None))


# -- custom storage (CUDA 13.4) ------------------------------------------------------------


def custom_storage_supported() -> bool:
    """Whether these bindings have custom storage and this driver resolves
    ``cuCheckpointOperationComplete`` at ABI 13040.

    No driver floor is published for custom storage; drivers before it answer
    CUDA_ERROR_INVALID_VALUE or a null pointer, which both mean "no".
    """
    if not bindings()["custom_storage"]:
        return False
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


class _PerDevice(ctypes.Structure):
    _fields_ = [("devPtr", ctypes.c_uint64), ("size", ctypes.c_size_t), ("stream", ctypes.c_void_p)]


class _StorageInfo(ctypes.Structure):
    """``CUcheckpointCustomStorageInfo`` as cuda.h 13.4 lays it out. Read with ctypes: the
    binding keeps the length of ``perDeviceData`` on the Python side, which is 0 for the
    struct the driver allocates (issue 10 §2.1: read through it, every device was lost)."""

    _fields_ = [
        ("handle", ctypes.c_void_p),
        ("perDeviceData", ctypes.POINTER(_PerDevice)),
        ("deviceCount", ctypes.c_uint),
    ]


def _storage_info(call: str, pid: int, info_ptr: ctypes.c_void_p) -> dict[str, Any]:
    """The mapped devices of a new operation; keeps only the contexts of those devices."""
    if not info_ptr.value:
        raise CudaError(call, pid, "CUDA_ERROR_INVALID_VALUE")
    raw = _StorageInfo.from_address(info_ptr.value)
    handle = cu.CUcheckpointCustomStorageInfo(_ptr=info_ptr.value).handle
    handle_id = int(raw.handle or 0)
    uuids = {d["index"]: d["uuid"] for d in devices()}
    mapped: list[dict[str, Any]] = []
    for i in range(int(raw.deviceCount)):
        per = raw.perDeviceData[i]
        # The mapped pointer carries no context attribute; its stream does.
        stream = cu.CUstream(per.stream or 0)
        ctx = _check(call, pid, cu.cuStreamGetCtx(stream))
        _check(call, pid, cu.cuCtxSetCurrent(ctx))
        ordinal = int(_check(call, pid, cu.cuCtxGetDevice()))
        entry = {"index": ordinal, "uuid": uuids.get(ordinal), "dev_ptr": int(per.devPtr)}
        mapped.append(entry | {"size": int(per.size), "ctx": ctx})
    _operations[handle_id] = (handle, mapped, {})
    for ordinal in list(_retained):
        if ordinal not in {m["index"] for m in mapped}:
            _release(call, ordinal)  # retained for the call, not needed for the copies
    return {
        "handle": handle_id,
        "devices": [{k: m[k] for k in ("index", "uuid", "size", "dev_ptr")} for m in mapped],
    }


def _with_every_context(call: str, pid: int, start: Any) -> dict[str, Any]:
    """Start an operation holding every GPU's primary context, as the driver requires of the
    GPUs the target uses (which only the driver knows); keeps those of its devices."""
    for dev in devices():
        _retain(call, dev["index"])
    info_ptr = ctypes.c_void_p(0)
    try:
        _check(call, pid, start(ctypes.addressof(info_ptr)))
    except CudaError:
        for dev in devices():
            _release(call, dev["index"])
        raise
    return _storage_info(call, pid, info_ptr)


def checkpoint_custom_storage(pid: int) -> dict[str, Any]:
    """LOCKED -> CHECKPOINTING with the target's memory mapped onto this process's GPUs.

    Returns the operation handle and, per device, its ordinal, UUID, mapped pointer and size;
    the caller copies the bytes out and then calls ``operation_complete(handle)``.
    """

    def start(out: int) -> Any:
        args = cu.CUcheckpointCheckpointArgs()
        args.customStorageInfo_out = out
        return cu.cuCheckpointProcessCheckpoint(pid, args)

    return _with_every_context("checkpoint_custom_storage", pid, start)


def restore_custom_storage(pid: int, gpu_pairs: list[list[str]] | None) -> dict[str, Any]:
    """CHECKPOINTED -> RESTORING with the memory to fill mapped onto this process's GPUs."""

    def start(out: int) -> Any:
        args = restore_args(gpu_pairs)
        args.customStorageInfo_out = out
        return cu.cuCheckpointProcessRestore(pid, args)

    return _with_every_context("restore_custom_storage", pid, start)


def operation_complete(handle: int) -> None:
    """Finish a custom-storage operation: CHECKPOINTING -> CHECKPOINTED, RESTORING -> LOCKED.

    The driver first synchronises the streams it returned; this worker's own copy streams
    were synchronised by every ``copy_out``/``copy_in`` and are destroyed here, before the
    contexts they live in are released.
    """
    found = _operations.pop(handle, None)
    if found is None:
        raise CudaError("operation_complete", None, "CUDA_ERROR_INVALID_HANDLE")
    op, mapped, streams = found
    try:
        for ordinal, own in streams.items():
            ctx = next(m["ctx"] for m in mapped if m["index"] == ordinal)
            _check("operation_complete", None, cu.cuCtxSetCurrent(ctx))
            for stream in own:
                _check("operation_complete", None, cu.cuStreamDestroy(stream))
        _check("operation_complete", None, cu.cuCheckpointOperationComplete(op))
    finally:
        for m in mapped:
            _release("operation_complete", m["index"])


# -- copies through the shared ring (custom storage) ----------------------------------------

COPY_STREAMS = 4  # per device; 2-4 streams of 32-64 MiB copies saturate H2D into the mapping
RING_DEVICE = 0  # the ring is page-locked in this GPU's primary context (PORTABLE: all see it)
_rings: dict[str, tuple[Any, int, int]] = {}  # name -> (mmap, host address, size)


def ring_attach(name: str, size: int) -> None:
    """Map the daemon's ring and page-lock it (``cuMemHostRegister``), once per ring.

    Registration needs a current context (issue 10 §2.2): device 0's is retained until
    ``ring_detach``, because the registration lives in the context that made it.
    """
    if name in _rings:
        return
    mapped = map_ring(name, int(size))
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
    flags = cu.CU_MEMHOSTREGISTER_PORTABLE
    try:
        ctx = _retain("ring_attach", RING_DEVICE)
        try:
            _check("ring_attach", None, cu.cuCtxSetCurrent(ctx))
            _check("ring_attach", None, cu.cuMemHostRegister(address, int(size), flags))
        except CudaError:
            _release("ring_attach", RING_DEVICE)
            raise
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
        ctx = _retained[RING_DEVICE][0]
        _check("ring_detach", None, cu.cuCtxSetCurrent(ctx))
        _check("ring_detach", None, cu.cuMemHostUnregister(address))
    finally:
        mapped.close()
        _release("ring_detach", RING_DEVICE)


def _streams_for(call: str, streams: dict[int, list[Any]], ordinal: int) -> list[Any]:
    own = streams.get(ordinal)
    if own is None:
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        own = [_check(call, None, cu.cuStreamCreate(flags)) for _ in range(COPY_STREAMS)]
        streams[ordinal] = own
    return own


def _copy(call: str, handle: int, device: int, ring: str, copies: list[list[int]]) -> None:
    found = _operations.get(handle)
    if found is None:
        raise CudaError(call, None, "CUDA_ERROR_INVALID_HANDLE")
    _op, mapped, streams = found
    if not 0 <= device < len(mapped) or ring not in _rings:
        raise CudaError(call, None, "CUDA_ERROR_INVALID_VALUE")
    dev = mapped[device]
    _mapped_ring, base, ring_size = _rings[ring]
    _check(call, None, cu.cuCtxSetCurrent(dev["ctx"]))
    own = _streams_for(call, streams, dev["index"])
    used: list[Any] = []
    for i, (ring_offset, dev_offset, nbytes) in enumerate(copies):
        if ring_offset + nbytes > ring_size or dev_offset + nbytes > dev["size"] or nbytes < 0:
            raise CudaError(call, None, "CUDA_ERROR_INVALID_VALUE")
        stream = own[i % len(own)]
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
