"""The fake ``libcuda.so.1`` (C, in this directory) and the helpers tests drive it with.

The library is loaded by the real cuda-bindings in the processes a test starts: put the
build directory first on ``LD_LIBRARY_PATH`` and name a node in ``GPUSNAP_FAKE_CUDA_ROOT``
(``env``). A node is a directory with ``node.json`` (``write_node``); every process started
with one root sees the same GPUs and shares their memory, two roots are two nodes.

- ``nodes``: what a node holds (``gpu``, ``write_node``, ``one_gpu_node``, the UUIDs ``A0``,
  ``B0``, ``B1``, the sizes ``GIB``, ``MIB``); its names are importable from here too.
- ``build(out_dir)``: ``make -C tests/fakes/libcuda OUT=out_dir``; returns ``out_dir``.
- ``CudaProcess.start(...)``: a CUDA process (``target.py``) holding device memory with
  known content; it answers commands through files, so CRIU can dump and restore it.
- ``control(env, ops)``: run driver calls (``ctl.py``) in a fresh process, e.g. the
  checkpoint calls on another pid, and get one result per call; ``free_memory`` and
  ``checkpoint`` are the two sequences tests need most.

The test process itself never loads the library.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.fakes.libcuda.nodes import (
    A0,
    B0,
    B1,
    GIB,
    MIB,
    VERSION_FILE,
    gpu,
    nvrm_line,
    one_gpu_node,
    write_node,
)

# The names tests use, also those of nodes.py (what a node holds), imported here for them.
__all__ = [
    "A0",
    "B0",
    "B1",
    "GIB",
    "HERE",
    "MIB",
    "ROOT_ENV",
    "TIMEOUT",
    "VERSION_FILE",
    "CudaProcess",
    "Fault",
    "Spawn",
    "add_fault",
    "build",
    "checkpoint",
    "control",
    "env",
    "err",
    "free_memory",
    "gpu",
    "nvrm_line",
    "ok",
    "one_gpu_node",
    "wait_for",
    "write_node",
]

HERE = Path(__file__).resolve().parent
ROOT_ENV = "GPUSNAP_FAKE_CUDA_ROOT"
TIMEOUT = 120.0  # hang guard only, never a performance expectation


def build(out_dir: Path) -> Path:
    """Build ``out_dir/libcuda.so.1`` with the system compiler; raises if that fails."""
    make = shutil.which("make")
    if make is None or shutil.which(os.environ.get("CC", "cc")) is None:
        raise FileNotFoundError(
            "make and a C compiler are needed (scripts/bootstrap.sh installs them)"
        )
    subprocess.run(
        [make, "-s", "-C", str(HERE), f"OUT={out_dir}"], check=True, capture_output=True, text=True
    )
    return out_dir


def add_fault(
    root: Path,
    call: str,
    *,
    pid: int | None = None,
    error: str | None = None,
    hang_s: float = 0.0,
    after: bool = False,
    times: int = 1,
    until: Path | None = None,
) -> Fault:
    """Make the next ``times`` calls of ``call`` on node ``root`` hang and/or fail.

    A test knob of the fake, not driver behaviour (faults.c): ``after`` makes the call do its
    work first, as a driver that acted and then never answered; ``until`` holds the call
    until that file exists (``Fault.release`` creates it; ``Fault.wait_claimed`` waits for a
    call to be held). Takes effect at once, also in processes already running.
    """
    doc = json.loads((root / "node.json").read_text())
    fault: dict[str, Any] = {"call": call, "hang_s": hang_s, "after": after, "times": times}
    if pid is not None:
        fault["pid"] = pid
    if error is not None:
        fault["error"] = error
    if until is not None:
        fault["until"] = str(until)
    doc.setdefault("faults", []).append(fault)
    tmp = root / "node.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.rename(root / "node.json")
    return Fault(root, len(doc["faults"]) - 1, until)


@dataclass(frozen=True)
class Fault:
    """An injected fault: which entry of node.json's ``faults`` it is."""

    root: Path
    index: int
    until: Path | None

    def claimed(self, times: int = 1) -> bool:
        """Whether ``times`` calls have taken this fault (faults.c's claim files)."""
        done = self.root / ".fake-cuda" / "faults"
        return all((done / f"{self.index}.{k}").exists() for k in range(times))

    def wait_claimed(self, what: str = "the faulted call") -> None:
        wait_for(self.claimed, f"{what} to reach the fault")

    def release(self) -> None:
        """Let a call held by ``until`` go on."""
        assert self.until is not None
        self.until.touch()


def env(lib_dir: Path, root: Path | None, **extra: str) -> dict[str, str]:
    """The environment of a process that loads the fake on node ``root``."""
    out = dict(os.environ)
    out["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(lib_dir), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
    )
    out.pop(ROOT_ENV, None)
    out.pop("CUDA_VISIBLE_DEVICES", None)
    if root is not None:
        out[ROOT_ENV] = str(root)
    out["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    out.update(extra)
    return out


def control(environ: dict[str, str], ops: list[list[Any]], timeout: float = TIMEOUT) -> list[Any]:
    """Run ``ops`` through cuda.bindings in a new process; one result per op.

    A result is ``{"ok": value, "seconds": s}`` or ``{"error": "CUDA_ERROR_..."}``.
    """
    proc = subprocess.run(
        [sys.executable, str(HERE / "ctl.py")],
        check=False,
        input=json.dumps(ops),
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"ctl.py failed ({proc.returncode}): {proc.stderr.strip()}")
    results: list[Any] = json.loads(proc.stdout)
    return results


def ok(result: dict[str, Any]) -> Any:
    """The value of a successful ``control`` result; AssertionError naming the error otherwise."""
    assert "error" not in result, result
    return result["ok"]


def err(result: dict[str, Any]) -> str:
    """The CUDA error of a failed ``control`` result."""
    assert "error" in result, result
    return str(result["error"])


def free_memory(environ: dict[str, str], ordinal: int = 0) -> int:
    """Free device memory of GPU ``ordinal`` as a new process on that node sees it."""
    return int(ok(control(environ, [["init"], ["mem_info", ordinal]])[1])["free"])


def checkpoint(environ: dict[str, str], pid: int) -> None:
    """Lock and checkpoint ``pid`` from another process; it ends CHECKPOINTED."""
    res = control(environ, [["lock", pid, 0], ["checkpoint", pid], ["state", pid]])
    if res[2].get("ok") != "CHECKPOINTED":
        raise RuntimeError(f"checkpoint of {pid} failed: {res}")


def wait_for(ready: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.01)


@dataclass
class CudaProcess:
    """A started ``target.py``: device memory with deterministic content, answering commands.

    ``pid`` survives a CRIU restore (CRIU restores pids); ``proc`` is the original's Popen.
    """

    proc: subprocess.Popen[bytes]
    workdir: Path
    info: dict[str, Any]
    _seq: int = 0
    _reaped: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(
        cls,
        workdir: Path,
        environ: dict[str, str],
        allocs: list[tuple[int, int]],
        *,
        seed: int = 1,
        contexts: list[int] | None = None,
    ) -> CudaProcess:
        """Start a CUDA process holding ``allocs`` ([ordinal, bytes], ...) and wait for it.

        ``contexts``: ordinals to retain primary contexts on (default: those of the allocs);
        an empty list with no allocs makes a process that ran cuInit only.
        """
        workdir.mkdir(parents=True, exist_ok=True)
        spec = {"allocs": allocs, "seed": seed, "contexts": contexts}
        with (
            open(os.devnull, "rb") as stdin,
            open(workdir / "stdout", "ab") as out,
            open(workdir / "stderr", "ab") as errf,
        ):
            proc = subprocess.Popen(
                [sys.executable, str(HERE / "target.py"), str(workdir), json.dumps(spec)],
                stdin=stdin,
                stdout=out,
                stderr=errf,
                cwd=workdir,
                env=environ,
                start_new_session=True,  # no controlling terminal: CRIU needs no --shell-job
                close_fds=True,
            )
        ready = workdir / "ready.json"
        wait_for(lambda: ready.exists() or proc.poll() is not None, "the CUDA process to start")
        if not ready.exists():
            raise RuntimeError(
                f"target.py exited {proc.returncode}: {(workdir / 'stderr').read_text()}"
            )
        return cls(proc, workdir, json.loads(ready.read_text()))

    def begin(self, *command: Any) -> Path:
        """Send a command; returns the path its result will appear at."""
        self._seq += 1
        tmp = self.workdir / f"cmd-{self._seq}.tmp"
        tmp.write_text(json.dumps(list(command)))
        tmp.rename(self.workdir / f"cmd-{self._seq}.json")
        return self.workdir / f"res-{self._seq}.json"

    def result(self, path: Path, timeout: float = TIMEOUT) -> Any:
        wait_for(path.exists, f"the CUDA process to answer {path.name}", timeout)
        res = json.loads(path.read_text())
        if "error" in res:
            raise RuntimeError(f"{self.workdir}: {res['error']}")
        return res["ok"]

    def command(self, *command: Any, timeout: float = TIMEOUT) -> Any:
        return self.result(self.begin(*command), timeout)

    def threads(self) -> dict[int, str]:
        """tid -> comm of every thread now."""
        found = {}
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found[int(task.name)] = (task / "comm").read_text().strip()
        return found

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if not self._reaped:
            with contextlib.suppress(ChildProcessError):
                self.proc.wait(TIMEOUT)
            self._reaped = True

    def reaped(self) -> None:
        """The original was reaped elsewhere (e.g. CRIU killed it and we waited)."""
        self._reaped = True


Spawn = Callable[..., CudaProcess]  # the ``spawn`` fixture: (workdir, env, allocs, **kw)
