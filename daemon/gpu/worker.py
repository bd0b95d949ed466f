"""The daemon's handle on its GPU worker process.

Driver calls can block inside the driver, so none runs in the daemon: a long-lived worker
process (``_worker_main``) makes them, one at a time, and every call has a deadline. A call
past its deadline gets the worker SIGKILLed and respawned, and fails with ``DeadlineExceeded``
naming the call, the pid and the state the process is left in, as a fresh worker sees it.

The worker sees every GPU of the node: ``CUDA_VISIBLE_DEVICES`` is removed from its
environment, because a restore needs a GPU pair for every GPU the kernel driver sees, and a
worker that sees fewer would build a partial map (issue 10 §2.7).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

from gpusnap.daemon.gpu.cudaerror import CALL_NAMES, NO_CUDA_STATE
from gpusnap.daemon.gpu.protocol import FrameTimeout, PeerClosed, read_frame, write_frame
from gpusnap.errors import DeadlineExceeded, GpusnapError, Internal, error_from_kind

log = logging.getLogger(__name__)

STATE_PROBE_TIMEOUT_S = 5.0
MASKS = ("CUDA_VISIBLE_DEVICES",)  # what would hide GPUs from the worker


class CallFailed(GpusnapError):
    """Internal carrier: a driver call failed with a CUDA error the caller said it tolerates."""

    def __init__(self, cuda_error: str, message: str) -> None:
        super().__init__(message)
        self.cuda_error = cuda_error


# Calls whose first argument is not a pid (an operation handle, a ring name).
_NO_PID = frozenset({"operation_complete", "copy_out", "copy_in", "ring_attach", "ring_detach"})


def _describe(call: str, args: list[Any]) -> str:
    name = CALL_NAMES.get(call, call)
    pid = args[0] if args and call not in _NO_PID else None
    return f"{name}({pid})" if isinstance(pid, int) else f"{name}()"


class GpuWorker:
    """One worker process, respawned whenever it dies or misses a deadline.

    Every call gets ``call_timeout_s``; a call that moves device memory gets that plus its
    bytes at ``copy_rate_gbps`` (``for_bytes``): a full H200 at 2 GB/s takes over a minute.
    """

    def __init__(self, call_timeout_s: float = 30.0, copy_rate_gbps: float = 1.0) -> None:
        self.call_timeout_s = call_timeout_s
        self.copy_rate_gbps = copy_rate_gbps
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self.spawn_count = 0

    # -- process lifecycle -------------------------------------------------------------

    def _spawn(self) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        for name in MASKS:
            if env.pop(name, None) is not None and self.spawn_count == 0:
                log.warning(
                    "%s=%r is ignored: the GPU worker sees every GPU", name, os.environ[name]
                )
        # The worker imports what this process can import (an editable checkout, a wheel).
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpusnap.daemon.gpu._worker_main"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        self.spawn_count += 1
        log.info("GPU worker started (pid %d)", proc.pid)
        return proc

    def _ensure(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and (code := self._proc.poll()) is not None:
            # It died between calls: nothing was asked of it, so the next call just gets a
            # fresh one (its pipes are closed, not left to the garbage collector).
            log.warning("GPU worker %d exited (status %s); starting another", self._proc.pid, code)
            _close_pipes(self._proc)
            self._proc = None
        if self._proc is None:
            self._proc = self._spawn()
        return self._proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()  # SIGKILL: a call stuck in the driver ignores anything gentler
        proc.wait()
        _close_pipes(proc)
        log.warning("GPU worker %d killed", proc.pid)

    def for_bytes(self, nbytes: int) -> dict[str, Any]:
        """The ``timeout_s`` and ``why`` of a call that moves ``nbytes`` of device memory."""
        extra = max(0, nbytes) / (self.copy_rate_gbps * 1e9)
        why = (
            f"{self.call_timeout_s:g}s + {nbytes / 2**30:.2f} GiB of device memory at "
            f"{self.copy_rate_gbps:g} GB/s"
        )
        return {"timeout_s": self.call_timeout_s + extra, "why": why}

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is None:
                return
            if proc.stdin is not None:
                proc.stdin.close()  # EOF: the worker returns from serve() and exits
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            _close_pipes(proc)

    # -- calls -----------------------------------------------------------------------

    def _roundtrip(self, call: str, args: list[Any], timeout_s: float) -> dict[str, Any]:
        proc = self._ensure()
        assert proc.stdin is not None and proc.stdout is not None
        write_frame(proc.stdin.fileno(), {"call": call, "args": args})
        return read_frame(proc.stdout.fileno(), time.monotonic() + timeout_s)

    def call(
        self,
        call: str,
        *args: Any,
        timeout_s: float | None = None,
        tolerate: tuple[str, ...] = (),
        why: str = "",
    ) -> Any:
        """Run one driver call in the worker and return its result.

        A CUDA error listed in ``tolerate`` raises ``CallFailed`` (its ``cuda_error`` says
        which); any other failure raises the error kind the CUDA error maps to. ``why``
        explains a deadline other than ``call_timeout_s`` in its error.
        """
        pending = self.begin(call, *args, timeout_s=timeout_s, tolerate=tolerate, why=why)
        return pending.result()

    def begin(
        self,
        call: str,
        *args: Any,
        timeout_s: float | None = None,
        tolerate: tuple[str, ...] = (),
        why: str = "",
    ) -> PendingCall:
        """Send one call and return at once; ``result()`` waits for it (same deadline rules).

        The worker is held until ``result()`` returns, so the caller can do other work
        (fill the other half of a ring) while the worker copies. Always call ``result()``.
        """
        limit = self.call_timeout_s if timeout_s is None else timeout_s
        self._lock.acquire()
        pending = PendingCall(self, call, list(args), limit, tolerate, why=why)
        try:
            proc = self._ensure()
            assert proc.stdin is not None
            write_frame(proc.stdin.fileno(), {"call": call, "args": list(args)})
        except BaseException as exc:
            pending.send_error = exc
        return pending

    def kill(self) -> None:
        """Kill the worker now (a fresh one starts on the next call); drops what it mapped."""
        with self._lock:
            self._kill()

    def _finish(self, pending: PendingCall) -> Any:
        call, args, limit = pending.call, pending.args, pending.timeout_s
        try:
            if pending.send_error is not None:
                raise pending.send_error
            proc = self._proc
            assert proc is not None and proc.stdout is not None
            reply = read_frame(proc.stdout.fileno(), pending.deadline)
        except FrameTimeout:
            self._kill()
            state = self._state_after_restart(call, args)
            why = f" ({pending.why})" if pending.why else ""
            raise DeadlineExceeded(
                f"{_describe(call, args)} did not return within {limit:g}s{why}; "
                f"worker restarted; {state}"
            ) from None
        except (PeerClosed, BrokenPipeError, ValueError, TypeError, AssertionError) as exc:
            code = self._proc.poll() if self._proc is not None else None
            self._kill()
            raise Internal(
                f"GPU worker died during {_describe(call, args)} "
                f"(exit status {code}, {type(exc).__name__}); it will be restarted"
            ) from exc
        if "error" in reply:
            err = reply["error"]
            cuda_error = err.get("cuda_error")
            if cuda_error and cuda_error in pending.tolerate:
                raise CallFailed(str(cuda_error), str(err.get("message")))
            raise error_from_kind(str(err.get("kind")), str(err.get("message")))
        return reply.get("ok")

    def _state_after_restart(self, call: str, args: list[Any]) -> str:
        """What a fresh worker sees of the process the stuck call was about."""
        named = bool(args) and isinstance(args[0], int) and call not in _NO_PID
        pid = args[0] if named else None
        if pid is None:
            return "no process was named"
        try:
            reply = self._roundtrip("get_state", [pid], STATE_PROBE_TIMEOUT_S)
        except FrameTimeout:
            self._kill()
            return f"state of process {pid} unknown (cuCheckpointProcessGetState hung too)"
        except (PeerClosed, BrokenPipeError, ValueError, TypeError):
            self._kill()
            return f"state of process {pid} unknown (worker died again)"
        if "error" in reply:
            err = reply["error"]
            if err.get("cuda_error") in NO_CUDA_STATE:
                return f"process {pid} holds no CUDA state"
            return f"state of process {pid} unknown ({err.get('message')})"
        return f"process {pid} is {reply.get('ok')}"


class PendingCall:
    """A call sent to the worker whose reply has not been read yet (``GpuWorker.begin``)."""

    def __init__(
        self,
        worker: GpuWorker,
        call: str,
        args: list[Any],
        timeout_s: float,
        tolerate: tuple[str, ...],
        *,
        why: str = "",
    ) -> None:
        self._worker = worker
        self.why = why
        self.call = call
        self.args = args
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.tolerate = tolerate
        self.send_error: BaseException | None = None
        self._done = False

    def result(self) -> Any:
        """The call's result; raises like ``GpuWorker.call``. Releases the worker."""
        if self._done:
            raise Internal(f"result of {_describe(self.call, self.args)} was already taken")
        self._done = True
        try:
            return self._worker._finish(self)
        finally:
            self._worker._lock.release()


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()
