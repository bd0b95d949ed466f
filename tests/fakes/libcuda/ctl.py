"""Driver calls in a process of their own: ``python ctl.py`` with a JSON list of ops on stdin.

Each op is ``[name, *args]``; stdout gets one result per op, ``{"ok": value, "seconds": s}``
or ``{"error": "CUDA_ERROR_..."}``, and later ops still run. An argument ``{"ref": i}`` is
the value op ``i`` returned (``{"ref": i, "add": n}``: plus n), e.g. a device pointer.
This is the second process of the checkpoint API (as cuda-checkpoint and gpusnapd's worker
are), talking to the real cuda-bindings. Custom storage is read the way the 13.4 header
lays it out, with ctypes from the raw pointer the driver returns. Run as a script, never
imported.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
import uuid as uuidlib
from pathlib import Path
from typing import Any

from cuda.bindings import driver as cu

from gpusnap.daemon.gpu.driver import restore_args


# Kept in each script (not imported from tests.fakes): a hook or a CRIU-restored process
# runs the script by its path, where the tests package is not importable.
class CudaError(Exception):
    """A driver call failed; the message is the CUresult's name (``CUDA_ERROR_...``)."""


def check(result: Any) -> Any:
    """The value(s) of a successful call: None, one value, or a tuple of them."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(cu.CUresult(err).name)
    return values[0] if len(values) == 1 else tuple(values) if values else None


STATES: dict[int, str] = {
    int(s): s.name.removeprefix("CU_PROCESS_STATE_") for s in cu.CUprocessState
}


class PerDevice(ctypes.Structure):
    _fields_ = [("devPtr", ctypes.c_uint64), ("size", ctypes.c_size_t), ("stream", ctypes.c_void_p)]


class StorageInfo(ctypes.Structure):
    _fields_ = [
        ("handle", ctypes.c_void_p),
        ("perDeviceData", ctypes.POINTER(PerDevice)),
        ("deviceCount", ctypes.c_uint),
    ]


def uuid_text(raw: bytes) -> str:
    return "GPU-" + str(uuidlib.UUID(bytes=bytes(raw[:16])))


class Ctl:
    def __init__(self) -> None:
        self.ctx: dict[int, Any] = {}
        self.streams: dict[int, Any] = {}
        self.buffers: dict[int, Any] = {}  # host buffers of copies in flight, by id

    def init(self) -> None:
        check(cu.cuInit(0))

    def retain(self, ordinal: int) -> None:
        if ordinal not in self.ctx:
            self.ctx[ordinal] = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(ordinal))))
        check(cu.cuCtxSetCurrent(self.ctx[ordinal]))

    def release(self, ordinal: int) -> None:
        check(cu.cuDevicePrimaryCtxRelease(check(cu.cuDeviceGet(ordinal))))
        del self.ctx[ordinal]

    def version(self) -> int:
        return int(check(cu.cuDriverGetVersion()))

    def devices(self) -> list[dict[str, Any]]:
        out = []
        attr = cu.CUdevice_attribute
        for i in range(int(check(cu.cuDeviceGetCount()))):
            dev = check(cu.cuDeviceGet(i))
            cc = [
                int(check(cu.cuDeviceGetAttribute(a, dev)))
                for a in (
                    attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                    attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                )
            ]
            out.append(
                {
                    "name": bytes(check(cu.cuDeviceGetName(256, dev))).split(b"\0")[0].decode(),
                    "uuid": uuid_text(check(cu.cuDeviceGetUuid(dev)).bytes),
                    "total_memory": int(check(cu.cuDeviceTotalMem(dev))),
                    "pci_bus_id": bytes(check(cu.cuDeviceGetPCIBusId(64, dev)))
                    .split(b"\0")[0]
                    .decode(),
                    "compute_capability": cc,
                }
            )
        return out

    def mem_info(self, ordinal: int) -> dict[str, int]:
        self.retain(ordinal)
        free, total = check(cu.cuMemGetInfo())
        return {"free": int(free), "total": int(total)}

    def state(self, pid: int) -> str:
        return STATES[int(check(cu.cuCheckpointProcessGetState(pid)))]

    def restore_tid(self, pid: int) -> int:
        return int(check(cu.cuCheckpointProcessGetRestoreThreadId(pid)))

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = cu.CUcheckpointLockArgs()
        args.timeoutMs = int(timeout_ms)
        check(cu.cuCheckpointProcessLock(pid, args))

    def checkpoint(self, pid: int) -> None:
        check(cu.cuCheckpointProcessCheckpoint(pid, None))

    def restore(self, pid: int, pairs: list[list[str]] | None) -> None:
        check(cu.cuCheckpointProcessRestore(pid, restore_args(pairs) if pairs else None))

    def unlock(self, pid: int) -> None:
        check(cu.cuCheckpointProcessUnlock(pid, None))

    def proc_address(self, name: str, version: int) -> dict[str, Any]:
        flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
        err, pfn, status = cu.cuGetProcAddress(name.encode(), version, flags)
        return {
            "result": cu.CUresult(err).name,
            "found": int(pfn or 0) != 0,
            "status": None if status is None else cu.CUdriverProcAddressQueryResult(status).name,
        }

    def _mapped(self, info_ptr: ctypes.c_void_p) -> tuple[Any, list[dict[str, Any]]]:
        info = StorageInfo.from_address(int(info_ptr.value or 0))
        mapped = []
        for i in range(info.deviceCount):
            per = info.perDeviceData[i]
            stream = cu.CUstream(per.stream)
            ctx = check(cu.cuStreamGetCtx(stream))
            check(cu.cuCtxSetCurrent(ctx))
            ordinal = int(check(cu.cuCtxGetDevice()))
            uuid = uuid_text(check(cu.cuDeviceGetUuid(check(cu.cuDeviceGet(ordinal)))).bytes)
            mapped.append(
                {"ordinal": ordinal, "uuid": uuid, "dev_ptr": per.devPtr, "size": per.size}
            )
        handle = cu.CUcheckpointCustomStorageInfo(_ptr=int(info_ptr.value or 0)).handle
        return handle, mapped

    def cs_checkpoint(self, pid: int, save_dir: str, complete: bool = True) -> list[dict[str, Any]]:
        """Custom-storage checkpoint: copy each mapped device range into SAVE_DIR/<uuid>.bin."""
        info_ptr = ctypes.c_void_p(0)
        args = cu.CUcheckpointCheckpointArgs()
        args.customStorageInfo_out = ctypes.addressof(info_ptr)
        check(cu.cuCheckpointProcessCheckpoint(pid, args))
        handle, mapped = self._mapped(info_ptr)
        for m in mapped:
            self.retain(m["ordinal"])
            buf = bytearray(m["size"])
            check(cu.cuMemcpyDtoH(buf, m["dev_ptr"], m["size"]))
            (Path(save_dir) / f"{m['uuid']}.bin").write_bytes(buf)
        if complete:
            check(cu.cuCheckpointOperationComplete(handle))
        return mapped

    def cs_restore(
        self, pid: int, pairs: list[list[str]] | None, save_dir: str, complete: bool = True
    ) -> list[dict[str, Any]]:
        """Custom-storage restore: fill each mapped range from the file of its old GPU."""
        info_ptr = ctypes.c_void_p(0)
        args = restore_args(pairs)
        args.customStorageInfo_out = ctypes.addressof(info_ptr)
        check(cu.cuCheckpointProcessRestore(pid, args))
        handle, mapped = self._mapped(info_ptr)
        old_of = {new: old for old, new in (pairs or [])}
        for m in mapped:
            self.retain(m["ordinal"])
            data = (Path(save_dir) / f"{old_of.get(m['uuid'], m['uuid'])}.bin").read_bytes()
            stream = check(cu.cuStreamCreate(1))
            check(cu.cuMemcpyHtoDAsync(m["dev_ptr"], data, len(data), stream))
            check(cu.cuStreamSynchronize(stream))
            check(cu.cuStreamDestroy(stream))
        if complete:
            check(cu.cuCheckpointOperationComplete(handle))
        return mapped

    def pid(self) -> int:
        return os.getpid()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    # -- memory, one driver call per op (pointers and hex bytes in, hex bytes out) ----------

    def clear_current(self) -> None:
        check(cu.cuCtxSetCurrent(None))

    def current_mem_info(self) -> list[int]:
        return [int(v) for v in check(cu.cuMemGetInfo())]

    def mem_alloc(self, size: int) -> int:
        return int(check(cu.cuMemAlloc(size)))

    def mem_free(self, ptr: int) -> None:
        check(cu.cuMemFree(ptr))

    def htod(self, ptr: int, data_hex: str) -> None:
        data = bytes.fromhex(data_hex)
        check(cu.cuMemcpyHtoD(ptr, data, len(data)))

    def htod_zeros(self, ptr: int, size: int) -> None:
        check(cu.cuMemcpyHtoD(ptr, bytes(size), size))

    def dtoh(self, ptr: int, size: int) -> str:
        buf = bytearray(size)
        check(cu.cuMemcpyDtoH(buf, ptr, size))
        return buf.hex()

    def dtod(self, dst: int, src: int, size: int) -> None:
        check(cu.cuMemcpyDtoD(dst, src, size))

    def memset(self, ptr: int, value: int, size: int) -> None:
        check(cu.cuMemsetD8(ptr, value, size))

    def stream_create(self, flags: int) -> int:
        self.streams[len(self.streams) + 1] = check(cu.cuStreamCreate(flags))
        return len(self.streams)

    def htod_async(self, ptr: int, data_hex: str, stream: int) -> None:
        data = bytes.fromhex(data_hex)
        self.buffers[id(data)] = data
        check(cu.cuMemcpyHtoDAsync(ptr, data, len(data), self.streams[stream]))

    def dtoh_async(self, ptr: int, size: int, stream: int) -> int:
        """Enqueue a copy into a new host buffer; ``take`` it after synchronizing."""
        buf = bytearray(size)
        self.buffers[id(buf)] = buf
        check(cu.cuMemcpyDtoHAsync(buf, ptr, size, self.streams[stream]))
        return id(buf)

    def memset_async(self, ptr: int, value: int, size: int, stream: int) -> None:
        check(cu.cuMemsetD8Async(ptr, value, size, self.streams[stream]))

    def stream_sync(self, stream: int) -> None:
        check(cu.cuStreamSynchronize(self.streams[stream]))

    def stream_destroy(self, stream: int) -> None:
        check(cu.cuStreamDestroy(self.streams.pop(stream)))

    def take(self, buffer_id: int) -> str:
        return bytes(self.buffers.pop(buffer_id)).hex()

    def host_register(self, size: int) -> int:
        buf = ctypes.create_string_buffer(size)
        self.buffers[ctypes.addressof(buf)] = buf
        check(cu.cuMemHostRegister(ctypes.addressof(buf), size, cu.CU_MEMHOSTREGISTER_PORTABLE))
        return ctypes.addressof(buf)

    def host_register_at(self, address: int, size: int) -> None:
        check(cu.cuMemHostRegister(address, size, cu.CU_MEMHOSTREGISTER_PORTABLE))

    def host_unregister(self, address: int) -> None:
        check(cu.cuMemHostUnregister(address))


def main() -> int:
    ops = json.load(sys.stdin)
    ctl = Ctl()
    results: list[dict[str, Any]] = []
    for name, *raw in ops:
        args = [
            results[a["ref"]]["ok"] + a.get("add", 0) if isinstance(a, dict) and "ref" in a else a
            for a in raw
        ]
        start = time.monotonic()
        try:
            value = getattr(ctl, name)(*args)
            results.append({"ok": value, "seconds": time.monotonic() - start})
        except CudaError as exc:
            results.append({"error": str(exc), "seconds": time.monotonic() - start})
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
