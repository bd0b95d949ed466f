"""A fake CUDA driver with the surface of ``gpusnap.daemon.gpu.driver``, for CPU-only tests.

It models what the driver keeps per process, and enforces the documented checkpoint state
machine and error codes:

    RUNNING --lock--> LOCKED --checkpoint--> CHECKPOINTED --restore--> LOCKED --unlock--> RUNNING

- a pid that is alive but not registered as a CUDA process: CUDA_ERROR_NOT_INITIALIZED;
  a pid that does not exist: CUDA_ERROR_INVALID_VALUE;
- any call out of order: CUDA_ERROR_ILLEGAL_STATE, state unchanged;
- a lock whose process never reaches a lockable point (``lock_blocked``): waits the timeout,
  then CUDA_ERROR_NOT_READY with the process left RUNNING;
- a restore onto a GPU without the free memory: CUDA_ERROR_OUT_OF_MEMORY, left CHECKPOINTED;
- gpuPairs must name every GPU the process was checkpointed on, onto a GPU of the same chip.

The worker runs in another process, so the state lives in a JSON file named by
$GPUSNAP_FAKE_CUDA_STATE, guarded by ``flock``; tests set it up with ``FakeCuda``. Every
driver call is appended to the file's call log. Fault knobs (``FakeCuda.fault``) make one
call fail with a given CUDA error or hang for N seconds, once per knob.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpusnap.daemon.gpu.cudaerror import CudaError
from gpusnap.daemon.gpu.ring import map_ring

STATE_ENV = "GPUSNAP_FAKE_CUDA_STATE"
GIB = 2**30


def default_devices(count: int = 1) -> list[dict[str, Any]]:
    return [
        {
            "index": i,
            "name": "NVIDIA H200",
            "uuid": f"GPU-00000000-0000-0000-0000-00000000000{i}",
            "compute_capability": "9.0",
            "memory_total": 141 * GIB,
            "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0",
            "reserved": 1 * GIB,  # what the driver itself holds on the GPU
        }
        for i in range(count)
    ]


class FakeCuda:
    """Test-side handle on the fake's state file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def setup(
        self,
        *,
        devices: list[dict[str, Any]] | None = None,
        cuda_version: int = 13000,
        driver_line: str | None = (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  "
            "Release Build  (dvs-builder@U16-I2-C03-12-4)  Thu Sep 25 2025"
        ),
        custom_storage: bool = False,
        init_error: str | None = None,
    ) -> FakeCuda:
        state = {
            "devices": devices if devices is not None else default_devices(),
            "cuda_version": cuda_version,
            "driver_line": driver_line,
            "custom_storage": custom_storage,
            "init_error": init_error,
            "processes": {},
            "faults": [],
            "calls": [],
        }
        self.path.write_text(json.dumps(state))
        return self

    def add_process(
        self,
        pid: int,
        memory: dict[str, int] | None = None,
        *,
        lock_blocked: bool = False,
        seed: int | None = None,
    ) -> None:
        """Register ``pid`` as a CUDA process holding ``memory`` bytes per GPU UUID.

        ``seed`` picks the content of its device memory (``device_content``) for custom
        storage; keep ``memory`` small (MiBs) when custom storage is on.
        """
        with _locked(self.path) as state:
            if memory is None:
                memory = {state["devices"][0]["uuid"]: 2 * GIB}
            state["processes"][str(pid)] = {
                "state": "RUNNING",
                "memory": memory,
                "lock_blocked": lock_blocked,
                "restore_tid": pid,
                "seed": pid if seed is None else seed,
            }

    def fault(
        self,
        op: str,
        pid: int | None = None,
        *,
        error: str | None = None,
        hang_s: float = 0.0,
        apply_first: bool = False,
    ) -> None:
        """Next ``op`` (on ``pid``) fails with ``error`` and/or hangs ``hang_s`` seconds.

        ``apply_first``: the call's state change happens before the hang (a driver that
        did its work and then never returned).
        """
        with _locked(self.path) as state:
            state["faults"].append(
                {"op": op, "pid": pid, "error": error, "hang_s": hang_s, "apply_first": apply_first}
            )

    def update(self, **fields: Any) -> None:
        with _locked(self.path) as state:
            state.update(fields)

    def read(self) -> dict[str, Any]:
        with _locked(self.path) as state:
            return dict(state)

    def state_of(self, pid: int) -> str:
        return str(self.read()["processes"][str(pid)]["state"])

    def set_state(self, pid: int, new: str) -> None:
        with _locked(self.path) as state:
            state["processes"][str(pid)]["state"] = new

    def calls(self, *ops: str) -> list[tuple[str, int | None]]:
        """The call log as (op, pid), optionally only the given ops."""
        log = [(c["op"], c.get("pid")) for c in self.read()["calls"]]
        return [c for c in log if not ops or c[0] in ops]

    def call_args(self, op: str) -> list[dict[str, Any]]:
        return [c for c in self.read()["calls"] if c["op"] == op]


# -- state file ----------------------------------------------------------------------------


def _path() -> Path:
    value = os.environ.get(STATE_ENV)
    if not value:
        raise RuntimeError(f"fake CUDA driver: ${STATE_ENV} is not set")
    return Path(value)


@contextmanager
def _locked(path: Path | None = None) -> Iterator[dict[str, Any]]:
    path = path or _path()
    with open(str(path) + ".lock", "a+") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            state: dict[str, Any] = json.loads(path.read_text())
            try:
                yield state
            except CudaError:
                _save(path, state)  # keep the call log; a failed call changes no state
                raise
            _save(path, state)
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _save(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _take_fault(state: dict[str, Any], op: str, pid: int | None) -> dict[str, Any] | None:
    for i, f in enumerate(state["faults"]):
        if f["op"] == op and f["pid"] in (None, pid):
            return dict(state["faults"].pop(i))
    return None


def _proc(state: dict[str, Any], op: str, pid: int) -> dict[str, Any]:
    if not _alive(pid):
        raise CudaError(op, pid, "CUDA_ERROR_INVALID_VALUE")
    proc = state["processes"].get(str(pid))
    if proc is None:
        raise CudaError(op, pid, "CUDA_ERROR_NOT_INITIALIZED")
    return dict(proc)


def _require(op: str, pid: int, proc: dict[str, Any], *allowed: str) -> None:
    if proc["state"] not in allowed:
        raise CudaError(op, pid, "CUDA_ERROR_ILLEGAL_STATE")


def _used(state: dict[str, Any], uuid: str) -> int:
    """Bytes on GPU ``uuid``: the driver's reserve plus every process not CHECKPOINTED."""
    dev = next(d for d in state["devices"] if d["uuid"] == uuid)
    used = int(dev.get("reserved", 0))
    for proc in state["processes"].values():
        if proc["state"] != "CHECKPOINTED":
            used += int(proc["memory"].get(uuid, 0))
    return used


def _run(op: str, pid: int | None, step: Any, **logged: Any) -> Any:
    """Log the call, apply faults, run ``step(state)`` under the lock."""
    with _locked() as state:
        _abandon_orphaned_operations(state)
        state["calls"].append({"op": op, "pid": pid, **logged})
        fault = _take_fault(state, op, pid)
        result = None
        if fault and fault["apply_first"]:
            result = step(state)
    if fault and fault["hang_s"]:
        time.sleep(fault["hang_s"])
    if fault and fault["error"]:
        raise CudaError(op, pid, fault["error"])
    if fault and fault["apply_first"]:
        return result
    with _locked() as state:
        return step(state)


# -- the driver surface ---------------------------------------------------------------------


def init() -> None:
    def step(state: dict[str, Any]) -> None:
        if state.get("init_error"):
            raise CudaError("init", None, state["init_error"])

    _run("init", None, step)


def driver_version() -> int:
    with _locked() as state:
        return int(state["cuda_version"])


def driver_version_string() -> str | None:
    with _locked() as state:
        line = state.get("driver_line")
        return str(line) if line is not None else None


def devices() -> list[dict[str, Any]]:
    with _locked() as state:
        return [{k: v for k, v in d.items() if k != "reserved"} for d in state["devices"]]


def memory_info() -> dict[str, dict[str, int]]:
    with _locked() as state:
        return {
            d["uuid"]: {
                "free": int(d["memory_total"]) - _used(state, d["uuid"]),
                "total": int(d["memory_total"]),
            }
            for d in state["devices"]
        }


def custom_storage_supported() -> bool:
    with _locked() as state:
        return bool(state["custom_storage"])


def get_state(pid: int) -> str:
    return str(_run("get_state", pid, lambda s: _proc(s, "get_state", pid)["state"]))


def get_restore_thread_id(pid: int) -> int:
    return int(
        _run(
            "get_restore_thread_id",
            pid,
            lambda s: _proc(s, "get_restore_thread_id", pid)["restore_tid"],
        )
    )


def _set(state: dict[str, Any], pid: int, new: str) -> None:
    state["processes"][str(pid)]["state"] = new


def lock(pid: int, timeout_ms: int) -> None:
    blocked = False

    def step(state: dict[str, Any]) -> None:
        nonlocal blocked
        proc = _proc(state, "lock", pid)
        _require("lock", pid, proc, "RUNNING")
        if proc["lock_blocked"]:
            blocked = True
            return
        _set(state, pid, "LOCKED")

    _run("lock", pid, step, timeout_ms=timeout_ms)
    if blocked:
        time.sleep(timeout_ms / 1000.0)  # the driver waits out the timeout, then gives up
        raise CudaError("lock", pid, "CUDA_ERROR_NOT_READY")


def checkpoint(pid: int) -> None:
    def step(state: dict[str, Any]) -> None:
        _require("checkpoint", pid, _proc(state, "checkpoint", pid), "LOCKED")
        _set(state, pid, "CHECKPOINTED")

    _run("checkpoint", pid, step)


def _restore_memory(
    state: dict[str, Any], op: str, pid: int, gpu_pairs: list[list[str]] | None
) -> dict[str, int]:
    """The process's memory per GPU after a restore with ``gpu_pairs``, or the CUDA error."""
    proc = _proc(state, op, pid)
    _require(op, pid, proc, "CHECKPOINTED")
    memory: dict[str, int] = dict(proc["memory"])
    by_uuid = {d["uuid"]: d for d in state["devices"]}
    if gpu_pairs:
        mapping = {old: new for old, new in gpu_pairs}
        for old in memory:
            new = mapping.get(old)
            if new is None or new not in by_uuid:
                raise CudaError(op, pid, "CUDA_ERROR_INVALID_VALUE")
            if old in by_uuid and by_uuid[old]["name"] != by_uuid[new]["name"]:
                raise CudaError(op, pid, "CUDA_ERROR_INVALID_VALUE")
        memory = {mapping[old]: size for old, size in memory.items()}
    for uuid, size in memory.items():
        dev = by_uuid.get(uuid)
        if dev is None:
            raise CudaError(op, pid, "CUDA_ERROR_INVALID_DEVICE")
        if int(dev["memory_total"]) - _used(state, uuid) < size:
            # Documented failure mode: the process stays CHECKPOINTED (and is wedged).
            raise CudaError(op, pid, "CUDA_ERROR_OUT_OF_MEMORY")
    return memory


def restore(pid: int, gpu_pairs: list[list[str]] | None) -> None:
    def step(state: dict[str, Any]) -> None:
        state["processes"][str(pid)]["memory"] = _restore_memory(state, "restore", pid, gpu_pairs)
        _set(state, pid, "LOCKED")

    _run("restore", pid, step, gpu_pairs=gpu_pairs)


def unlock(pid: int) -> None:
    def step(state: dict[str, Any]) -> None:
        _require("unlock", pid, _proc(state, "unlock", pid), "LOCKED")
        _set(state, pid, "RUNNING")

    _run("unlock", pid, step)


# -- custom storage --------------------------------------------------------------------------
#
# A fake CUDA process's "device memory" is, during a custom-storage operation, a file next to
# the state file (one per GPU it uses, of the size ``memory`` gives) whose content is a
# deterministic function of the process's ``seed`` and the device's position. A checkpoint
# writes that content and lets the worker copy it out; a restore hands out zeroed files and,
# at ``operation_complete``, checks them byte for byte: a difference fails the restore and
# leaves the process FAILED, as wrong bytes would wedge a real one.
#
# Assumption, unverified on hardware: when the process that holds an operation's mappings
# dies (the worker killed past a deadline), the driver abandons the operation: a checkpoint
# goes back to LOCKED, a restore back to CHECKPOINTED.


def device_content(seed: int, position: int, size: int) -> bytes:
    """What device ``position`` of a process with ``seed`` holds (deterministic)."""
    return random.Random(f"fake-cuda-{seed}-{position}").randbytes(size)


def _device_file(state_path: Path, pid: int, position: int) -> Path:
    return state_path.with_name(f"{state_path.name}.dev-{pid}-{position}")


def _abandon_orphaned_operations(state: dict[str, Any]) -> None:
    for handle, op in list(state.get("operations", {}).items()):
        if _alive(int(op["owner"])):
            continue
        proc = state["processes"].get(str(op["pid"]))
        if proc is not None:
            proc["state"] = "LOCKED" if op["kind"] == "checkpoint" else "CHECKPOINTED"
        for dev in op["devices"]:
            Path(dev["path"]).unlink(missing_ok=True)
        state.setdefault("abandoned", []).append({"handle": handle, **op})
        del state["operations"][handle]


def _new_operation(
    state: dict[str, Any], kind: str, pid: int, memory: dict[str, int]
) -> dict[str, Any]:
    state["next_handle"] = int(state.get("next_handle", 0)) + 1
    handle = state["next_handle"]
    by_uuid = {d["uuid"]: d for d in state["devices"]}
    devs = []
    for position, (uuid, size) in enumerate(memory.items()):
        path = _device_file(_path(), pid, position)
        with path.open("wb") as fh:
            if kind == "checkpoint":
                seed = int(state["processes"][str(pid)].get("seed", pid))
                fh.write(device_content(seed, position, size))
            else:
                fh.truncate(size)
        devs.append(
            {"index": by_uuid[uuid]["index"], "uuid": uuid, "size": size, "path": str(path)}
        )
    state.setdefault("operations", {})[str(handle)] = {
        "kind": kind,
        "pid": pid,
        "owner": os.getpid(),
        "devices": devs,
    }
    return {
        "handle": handle,
        "devices": [
            {"index": d["index"], "uuid": d["uuid"], "size": d["size"], "dev_ptr": 0} for d in devs
        ],
    }


def checkpoint_custom_storage(pid: int) -> dict[str, Any]:
    def step(state: dict[str, Any]) -> dict[str, Any]:
        _abandon_orphaned_operations(state)
        if not state["custom_storage"]:
            raise CudaError("checkpoint_custom_storage", pid, "CUDA_ERROR_NOT_SUPPORTED")
        proc = _proc(state, "checkpoint_custom_storage", pid)
        _require("checkpoint_custom_storage", pid, proc, "LOCKED")
        result = _new_operation(state, "checkpoint", pid, dict(proc["memory"]))
        _set(state, pid, "CHECKPOINTING")
        return result

    return dict(_run("checkpoint_custom_storage", pid, step))


def restore_custom_storage(pid: int, gpu_pairs: list[list[str]] | None) -> dict[str, Any]:
    def step(state: dict[str, Any]) -> dict[str, Any]:
        _abandon_orphaned_operations(state)
        if not state["custom_storage"]:
            raise CudaError("restore_custom_storage", pid, "CUDA_ERROR_NOT_SUPPORTED")
        memory = _restore_memory(state, "restore_custom_storage", pid, gpu_pairs)
        state["processes"][str(pid)]["memory"] = memory
        result = _new_operation(state, "restore", pid, memory)
        _set(state, pid, "RESTORING")
        return result

    return dict(_run("restore_custom_storage", pid, step, gpu_pairs=gpu_pairs))


def operation_complete(handle: int) -> None:
    def step(state: dict[str, Any]) -> None:
        _abandon_orphaned_operations(state)
        op = state.get("operations", {}).pop(str(handle), None)
        if op is None:
            raise CudaError("operation_complete", None, "CUDA_ERROR_INVALID_HANDLE")
        pid = int(op["pid"])
        proc = state["processes"][str(pid)]
        try:
            if op["kind"] == "checkpoint":
                proc["state"] = "CHECKPOINTED"
                return
            seed = int(proc.get("seed", pid))
            for position, dev in enumerate(op["devices"]):
                got = Path(dev["path"]).read_bytes()
                want = device_content(seed, position, int(dev["size"]))
                if got != want:
                    at = next(
                        (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                        min(len(got), len(want)),
                    )
                    proc["state"] = "FAILED"
                    proc["restore_check"] = f"device {dev['uuid']} differs at byte {at}"
                    raise CudaError("operation_complete", None, "CUDA_ERROR_UNKNOWN")
            proc["restore_check"] = "verified"
            proc["state"] = "LOCKED"
        finally:
            for dev in op["devices"]:
                Path(dev["path"]).unlink(missing_ok=True)

    _run("operation_complete", None, step, handle=handle)


_attached: dict[str, mmap.mmap] = {}


def ring_attach(name: str, size: int) -> None:
    def step(state: dict[str, Any]) -> None:
        if name not in _attached:
            _attached[name] = map_ring(name, int(size))

    _run("ring_attach", None, step, ring=name)


def ring_detach(name: str) -> None:
    found = _attached.pop(name, None)
    if found is not None:
        found.close()


def _copy(op_name: str, handle: int, device: int, ring: str, copies: list[list[int]]) -> None:
    def step(state: dict[str, Any]) -> None:
        op = state.get("operations", {}).get(str(handle))
        if op is None:
            raise CudaError(op_name, None, "CUDA_ERROR_INVALID_HANDLE")
        want = "checkpoint" if op_name == "copy_out" else "restore"
        if op["kind"] != want or not 0 <= device < len(op["devices"]) or ring not in _attached:
            raise CudaError(op_name, None, "CUDA_ERROR_INVALID_VALUE")
        dev = op["devices"][device]
        buf = _attached[ring]
        with open(dev["path"], "r+b") as fh:
            for ring_offset, dev_offset, nbytes in copies:
                if dev_offset + nbytes > int(dev["size"]) or ring_offset + nbytes > len(buf):
                    raise CudaError(op_name, None, "CUDA_ERROR_INVALID_VALUE")
                if op_name == "copy_out":
                    fh.seek(dev_offset)
                    buf[ring_offset : ring_offset + nbytes] = fh.read(nbytes)
                else:
                    os.pwrite(fh.fileno(), buf[ring_offset : ring_offset + nbytes], dev_offset)
        state["copied_bytes"] = int(state.get("copied_bytes", 0)) + sum(c[2] for c in copies)

    _run(op_name, None, step, handle=handle, device=device, copies=len(copies))


def copy_out(handle: int, device: int, ring: str, copies: list[list[int]]) -> None:
    _copy("copy_out", handle, device, ring, copies)


def copy_in(handle: int, device: int, ring: str, copies: list[list[int]]) -> None:
    _copy("copy_in", handle, device, ring, copies)
