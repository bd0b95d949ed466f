"""``tests/e2e/memory_holder.py`` run as a workload: a process holding N MiB of mixed data,
with a pid file, that changes 5% of its memory on SIGUSR1 and digests it on SIGUSR2.

Used by the warm-standby test (``tests/e2e_reclaim/test_prefetch.py``) and its benchmark
(``bench/standby_bench.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HOLDER = Path(__file__).resolve().parents[1] / "e2e" / "memory_holder.py"
GUARD = 600.0  # seconds; against hangs only


def _wait(what: str, ready: Callable[[], bool], timeout: float = GUARD) -> None:
    end = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


class Holder:
    """The holder, started in ``workdir`` (its ``holder.pid`` there); the files it writes
    say when it is done filling, changing or digesting."""

    def __init__(self, workdir: Path, mib: int) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.ready = workdir / "holder.ready"
        self.pid_file = workdir / "holder.pid"
        self.proc = subprocess.Popen(
            [sys.executable, str(HOLDER), "--mib", str(mib), "--ready", str(self.ready)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.pid = self.proc.pid
        self.pid_file.write_text(f"{self.pid}\n")
        _wait("the holder to fill its memory", lambda: self.ready.exists() or self.exited())
        if self.exited():
            raise RuntimeError(f"the memory holder exited ({self.proc.returncode})")

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def _ask(self, sig: int, path: Path) -> str:
        path.unlink(missing_ok=True)
        os.kill(self.pid, sig)
        _wait(f"{path.name} from the holder", path.exists)
        return path.read_text().strip()

    def change(self) -> None:
        """Overwrite 5% of its memory (one contiguous run of random bytes)."""
        self._ask(signal.SIGUSR1, Path(f"{self.ready}.changed"))

    def digest(self) -> str:
        """The BLAKE2b of everything it holds (the same after a faithful restore)."""
        return self._ask(signal.SIGUSR2, Path(f"{self.ready}.digest"))

    def kill_restored(self) -> None:
        """Kill the tree a restore brought back under the holder's pid, and wait until the
        pid is free (the restoring daemon, or we as its subreaper, reap it)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        _wait("the restored holder to be reaped", lambda: not Path(f"/proc/{self.pid}").exists())

    def kill_whatever_runs(self) -> None:
        """The original (if alive) or a restored one, reaped."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if not self.exited():
            self.proc.wait(GUARD)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
