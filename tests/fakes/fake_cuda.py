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
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpusnap.daemon.gpu.cudaerror import CudaError

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
        self, pid: int, memory: dict[str, int] | None = None, *, lock_blocked: bool = False
    ) -> None:
        """Register ``pid`` as a CUDA process holding ``memory`` bytes per GPU UUID."""
        with _locked(self.path) as state:
            if memory is None:
                memory = {state["devices"][0]["uuid"]: 2 * GIB}
            state["processes"][str(pid)] = {
                "state": "RUNNING",
                "memory": memory,
                "lock_blocked": lock_blocked,
                "restore_tid": pid,
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


def restore(pid: int, gpu_pairs: list[list[str]] | None) -> None:
    def step(state: dict[str, Any]) -> None:
        proc = _proc(state, "restore", pid)
        _require("restore", pid, proc, "CHECKPOINTED")
        memory: dict[str, int] = dict(proc["memory"])
        by_uuid = {d["uuid"]: d for d in state["devices"]}
        if gpu_pairs:
            mapping = {old: new for old, new in gpu_pairs}
            for old in memory:
                new = mapping.get(old)
                if new is None or new not in by_uuid:
                    raise CudaError("restore", pid, "CUDA_ERROR_INVALID_VALUE")
                if old in by_uuid and by_uuid[old]["name"] != by_uuid[new]["name"]:
                    raise CudaError("restore", pid, "CUDA_ERROR_INVALID_VALUE")
            memory = {mapping[old]: size for old, size in memory.items()}
        for uuid, size in memory.items():
            dev = by_uuid.get(uuid)
            if dev is None:
                raise CudaError("restore", pid, "CUDA_ERROR_INVALID_DEVICE")
            if int(dev["memory_total"]) - _used(state, uuid) < size:
                # Documented failure mode: the process stays CHECKPOINTED (and is wedged).
                raise CudaError("restore", pid, "CUDA_ERROR_OUT_OF_MEMORY")
        state["processes"][str(pid)]["memory"] = memory
        _set(state, pid, "LOCKED")

    _run("restore", pid, step, gpu_pairs=gpu_pairs)


def unlock(pid: int) -> None:
    def step(state: dict[str, Any]) -> None:
        _require("unlock", pid, _proc(state, "unlock", pid), "LOCKED")
        _set(state, pid, "RUNNING")

    _run("unlock", pid, step)


def checkpoint_custom_storage(pid: int) -> dict[str, Any]:
    with _locked() as state:
        if not state["custom_storage"]:
            raise CudaError("checkpoint_custom_storage", pid, "CUDA_ERROR_NOT_SUPPORTED")
    raise CudaError("checkpoint_custom_storage", pid, "CUDA_ERROR_NOT_SUPPORTED")


def restore_custom_storage(pid: int, gpu_pairs: list[list[str]] | None) -> dict[str, Any]:
    raise CudaError("restore_custom_storage", pid, "CUDA_ERROR_NOT_SUPPORTED")


def operation_complete(handle: int) -> None:
    raise CudaError("operation_complete", None, "CUDA_ERROR_INVALID_HANDLE")
