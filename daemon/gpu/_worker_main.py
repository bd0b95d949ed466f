"""Entry point of the GPU worker process: ``python -m gpusnap.daemon.gpu._worker_main``.

Loads ``gpusnap.daemon.gpu.driver`` (which loads cuda-bindings, which loads ``libcuda.so.1``:
NVIDIA's, or in tests the fake one found first on ``LD_LIBRARY_PATH``), then answers one
request frame at a time on fd 0 with one reply frame on the original fd 1. Anything the driver
or libraries print goes to stderr, never into the protocol stream.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from types import ModuleType
from typing import Any

from gpusnap.daemon.gpu.cudaerror import CudaError, kind_for
from gpusnap.daemon.gpu.protocol import CALLS, PeerClosed, read_frame, write_frame
from gpusnap.errors import GpusnapError

log = logging.getLogger("gpusnap.daemon.gpu.worker")


# Calls that need no cuInit: what the bindings offer, the versions.
_NO_INIT = frozenset({"bindings", "driver_version", "driver_version_string"})


def load_driver() -> ModuleType:
    return importlib.import_module("gpusnap.daemon.gpu.driver")


def _error(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, CudaError):
        return {
            "kind": kind_for(exc.cuda_error).kind,
            "message": exc.message,
            "cuda_error": exc.cuda_error,
        }
    if isinstance(exc, GpusnapError):
        return {"kind": exc.kind, "message": str(exc), "cuda_error": None}
    one_line = " ".join(str(exc).split()) or type(exc).__name__
    return {"kind": "internal", "message": f"{type(exc).__name__}: {one_line}", "cuda_error": None}


def serve(driver: ModuleType, rfd: int, wfd: int) -> None:
    initialized: dict[str, Any] | None = None  # None until cuInit ran: one per lifetime
    while True:
        try:
            request = read_frame(rfd)
        except PeerClosed:
            return
        call = str(request.get("call"))
        args = list(request.get("args") or [])
        try:
            if call not in CALLS or not hasattr(driver, call):
                write_frame(wfd, {"error": _error(ValueError(f"unknown driver call {call!r}"))})
                continue
            if call not in _NO_INIT:
                if initialized is None:
                    try:
                        driver.init()
                        initialized = {}
                    except Exception as exc:
                        initialized = _error(exc)
                if initialized:
                    write_frame(wfd, {"error": initialized})
                    continue
                if call == "init":
                    write_frame(wfd, {"ok": None})
                    continue
            result = getattr(driver, call)(*args)
            write_frame(wfd, {"ok": result})
        except Exception as exc:  # every failure goes back as a reply, the worker lives on
            write_frame(wfd, {"error": _error(exc)})


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="gpu-worker: %(message)s")
    wfd = os.dup(1)
    os.dup2(2, 1)  # stray prints from the driver go to stderr
    sys.stdout = sys.stderr
    try:
        driver = load_driver()
    except Exception as exc:
        # Answer every request with the load failure rather than dying.
        failure = _error(exc)
        while True:
            try:
                read_frame(0)
            except PeerClosed:
                return
            write_frame(wfd, {"error": failure})
    serve(driver, 0, wfd)


if __name__ == "__main__":
    main()
