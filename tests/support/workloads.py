"""Small real workloads for checkpoint/restore tests: a counter and a process tree.

Both write a deterministic hash chain, one fixed line per step, to an output file, so the
output after N steps is the same bytes whether or not the run was checkpointed and restored in
between::

    ref = reference_output("tree", tmp_path / "ref", steps=40)     # uninterrupted, no sleeps
    w = start_tree(tmp_path / "run", steps=40)
    w.wait_steps(10)
    criu.dump(w.pid, images, leave_running=False, log_path=...)
    w.reap()                                # the pid must be free before restoring it
    criu.restore(images, ...)
    assert w.wait_done() == ref

Every workload starts in a new session (no controlling terminal), with stdin from /dev/null and
stdout/stderr appended to files in its directory — never the test's pipes, which CRIU cannot
restore once the test's end of them is gone. ``Workload.proc`` is the ``Popen`` of the original
process so a test can reap it; a restored process is not the test's child, so ``wait_done``
watches the output file for the final ``done`` line instead.

A workload keeps its own idea of the output length and truncates the file back to it before each
write: a process restored from an older checkpoint (leave-running, then killed) rewrites the
lines the original wrote after the dump, exactly as a restored database rewrites its own file.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_TIMEOUT = 60.0  # a hang guard, never a performance expectation
DONE = b"done\n"

# Shared by both workloads: the line for a step and the write that owns the file's length.
_COMMON = r"""
import hashlib, os, signal, sys, time

def chain(prev: bytes, step: int, tag: bytes) -> bytes:
    return hashlib.sha256(prev + tag + step.to_bytes(8, "little")).digest()

class Out:
    def __init__(self, path):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.length = 0
        os.ftruncate(self.fd, 0)

    def write(self, data: bytes) -> None:
        # Truncate to our own length first: after a restore from an older checkpoint the file may
        # hold lines written after the dump by the original process.
        os.ftruncate(self.fd, self.length)
        os.write(self.fd, data)
        self.length += len(data)
"""

_COUNTER = (
    _COMMON
    + r"""
out_path, steps, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
out = Out(out_path)
state = {"step": 0, "hash": b"\0" * 32}

def report(signum, frame):
    tmp = out_path + ".state.tmp"
    with open(tmp, "w") as f:
        f.write(f"{state['step']} {state['hash'].hex()} {os.getpid()}\n")
    os.rename(tmp, out_path + ".state")

signal.signal(signal.SIGUSR1, report)
step = 0
while steps <= 0 or step < steps:
    step += 1
    h = chain(state["hash"], step, b"counter")
    out.write(b"%08d %s\n" % (step, h.hex().encode()))
    state["step"], state["hash"] = step, h
    if interval:
        time.sleep(interval)
out.write(b"done\n")
"""
)

# Parent and child talk over two pipes; a worker thread in the parent hashes too. Every line
# depends on all three, so a restore that lost any of them (or their pipe contents) shows up.
_TREE = (
    _COMMON
    + r"""
import queue, threading
out_path, steps, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
p2c_r, p2c_w = os.pipe()
c2p_r, c2p_w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(p2c_w); os.close(c2p_r)
    g = b"\1" * 32
    while True:
        msg = os.read(p2c_r, 40)
        if len(msg) < 40:
            os._exit(0)
        step = int.from_bytes(msg[:8], "little")
        g = chain(g + msg[8:], step, b"child")
        os.write(c2p_w, g)

os.close(p2c_r); os.close(c2p_w)
jobs: "queue.Queue[int | None]" = queue.Queue()
results: "queue.Queue[bytes]" = queue.Queue()

def worker():
    t = b"\2" * 32
    while (step := jobs.get()) is not None:
        t = chain(t, step, b"thread")
        results.put(t)

threading.Thread(target=worker, name="hasher", daemon=True).start()
out = Out(out_path)
h = b"\0" * 32
for step in range(1, steps + 1):
    h = chain(h, step, b"parent")
    jobs.put(step)
    os.write(p2c_w, step.to_bytes(8, "little") + h)
    g = b""
    while len(g) < 32:
        g += os.read(c2p_r, 32 - len(g))
    t = results.get()
    short = [x.hex()[:16].encode() for x in (h, g, t)]
    out.write(b"%08d %s %s %s\n" % (step, *short))
    if interval:
        time.sleep(interval)
jobs.put(None)
os.close(p2c_w)
os.waitpid(pid, 0)
out.write(b"done\n")
"""
)

# Imports the given modules, says so, and sleeps: a target for /proc-based probes.
_IMPORTER = r"""
import importlib, sys, time
for name in sys.argv[2:]:
    importlib.import_module(name)
with open(sys.argv[1], "w") as f:
    f.write("ready\n")
while True:
    time.sleep(1)
"""

_PROGRAMS = {"counter": _COUNTER, "tree": _TREE}


@dataclass
class Workload:
    """A started workload. ``pid`` is the root of its tree (the same pid after a restore)."""

    kind: str
    proc: subprocess.Popen[bytes]
    workdir: Path
    out_path: Path
    steps: int
    descendants: list[int] = field(default_factory=list)  # as last seen by wait_steps
    _reaped: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> bytes:
        try:
            return self.out_path.read_bytes()
        except FileNotFoundError:
            return b""

    def steps_done(self) -> int:
        return sum(1 for line in self.output().splitlines() if line[:1].isdigit())

    def wait_steps(self, n: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Block until at least ``n`` steps are in the output file."""
        _poll(lambda: self.steps_done() >= n, timeout, f"{self.kind} to reach step {n}")
        self.descendants = descendants_of(self.pid)

    def wait_done(self, timeout: float = DEFAULT_TIMEOUT) -> bytes:
        """Block until the output ends with ``done`` (works for restored, non-child processes)."""
        _poll(lambda: self.output().endswith(DONE), timeout, f"{self.kind} to finish")
        if not self._reaped:
            self.proc.wait(timeout)
            self._reaped = True
        return self.output()

    def state(self, timeout: float = DEFAULT_TIMEOUT) -> tuple[int, str, int]:
        """Counter only: ask the running process for (step, hash hex, pid) via SIGUSR1."""
        state_path = self.out_path.with_name(self.out_path.name + ".state")
        state_path.unlink(missing_ok=True)
        os.kill(self.pid, signal.SIGUSR1)
        _poll(state_path.exists, timeout, f"{self.kind} to report its state")
        step, digest, pid = state_path.read_text().split()
        return int(step), digest, int(pid)

    def reap(self, timeout: float = DEFAULT_TIMEOUT) -> int:
        """Wait for the original process (e.g. after a kill-mode dump) so its pid is free.

        Its descendants, orphaned when it died, were reparented to us if we are a child
        subreaper (``set_child_subreaper``); they are reaped too, so their pids are free.
        """
        rc = self.proc.wait(timeout)
        self._reaped = True
        for pid in self.descendants:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        return rc

    def kill(self) -> None:
        """Kill the original process and reap it."""
        if not self._reaped:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.reap()

    def stderr(self) -> str:
        return (self.workdir / "stderr").read_text(errors="replace")


class Started:
    """The workloads a test started (a fixture's value): ``started(w, steps=n)`` keeps ``w``
    and waits for its first ``n`` steps; ``kill_all`` kills and reaps whatever still runs."""

    def __init__(self) -> None:
        self._items: list[Workload] = []

    def __call__(self, w: Workload, *, steps: int = 0) -> Workload:
        self._items.append(w)
        if steps:
            w.wait_steps(steps)
        return w

    @property
    def workloads(self) -> list[Workload]:
        return list(self._items)

    def kill_all(self) -> None:
        for w in self._items:
            with contextlib.suppress(Exception):
                w.kill()


def start_counter(
    workdir: Path, *, steps: int = 0, interval: float = 0.05, python: str = sys.executable
) -> Workload:
    """A single process appending one hash-chain line per step (``steps=0``: forever)."""
    return _start("counter", workdir, steps, interval, python)


def start_tree(
    workdir: Path, *, steps: int, interval: float = 0.05, python: str = sys.executable
) -> Workload:
    """Parent + forked child + a worker thread; a pipe each way; the parent appends a file."""
    return _start("tree", workdir, steps, interval, python)


def reference_output(kind: str, workdir: Path, *, steps: int) -> bytes:
    """The bytes an uninterrupted run of ``kind`` writes in ``steps`` steps (run without sleeps)."""
    w = _start(kind, workdir, steps, 0.0, sys.executable)
    out = w.wait_done()
    if w.proc.returncode != 0:
        raise RuntimeError(f"reference {kind} run failed: {w.stderr()}")
    return out


def start_importer(workdir: Path, modules: list[str], python: str = sys.executable) -> Workload:
    """A Python process that imports ``modules`` and then sleeps; returns once they are loaded."""
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / "ready"
    proc = _popen([python, "-c", _IMPORTER, str(ready), *modules], workdir)
    w = Workload("importer", proc, workdir, ready, 0)
    _poll(lambda: ready.exists() or proc.poll() is not None, DEFAULT_TIMEOUT, "imports")
    if proc.poll() is not None:
        raise RuntimeError(f"importer exited: {w.stderr()}")
    return w


def descendants_of(pid: int) -> list[int]:
    """All descendants of ``pid`` now, from /proc/<pid>/task/*/children."""
    found: list[int] = []
    queue = [pid]
    while queue:
        cur = queue.pop()
        for children in Path(f"/proc/{cur}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                kids = [int(c) for c in children.read_text().split()]
                found += kids
                queue += kids
    return found


def set_child_subreaper(on: bool = True) -> None:
    """Make this process adopt orphaned descendants (prctl PR_SET_CHILD_SUBREAPER).

    A kill-mode dump kills a tree's root and its children together; the children's zombies are
    reparented to the nearest subreaper or PID 1. Where PID 1 reaps nothing (some containers)
    they keep their pids forever and a restore of the same pids fails ("File exists").
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, int(on), 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def kill_tree(pid: int) -> None:
    """SIGKILL a (restored, non-child) process tree: the root's process group and session."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(os.getpgid(pid), signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def expected_lines(kind: str, steps: int) -> bytes:
    """The counter's output computed here, without a process (to check the workload itself)."""
    if kind != "counter":
        raise ValueError("only the counter is computed in-process")
    h = b"\0" * 32
    lines = []
    for step in range(1, steps + 1):
        h = hashlib.sha256(h + b"counter" + step.to_bytes(8, "little")).digest()
        lines.append(b"%08d %s\n" % (step, h.hex().encode()))
    return b"".join(lines) + DONE


def _start(kind: str, workdir: Path, steps: int, interval: float, python: str) -> Workload:
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "out"
    program = _PROGRAMS[kind]
    proc = _popen([python, "-c", program, str(out), str(steps), str(interval)], workdir)
    return Workload(kind, proc, workdir, out, steps)


def _popen(argv: list[str], workdir: Path) -> subprocess.Popen[bytes]:
    # O_APPEND log files: CRIU does not insist on their size at restore, so a workload that
    # logs after a leave-running dump can still be restored from it.
    with (
        open(os.devnull, "rb") as stdin,
        open(workdir / "stdout", "ab") as stdout,
        open(workdir / "stderr", "ab") as stderr,
    ):
        return subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            cwd=workdir,
            start_new_session=True,
            close_fds=True,
        )


def _poll(ready: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.01)
