"""Reaps the processes the daemon restored or cold-started, when they exit.

A restored tree's root is the daemon's child where CRIU restores it as a sibling (no systemd
to take it); its other processes become the daemon's only when their parent dies and the
daemon is the child subreaper (``main._set_child_subreaper``). A cold start is a ``Popen``.
Without a reaper each would stay a zombie and keep its pid, which a later restore of the same
tree needs free.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading

from gpusnap.daemon.host import proctree

log = logging.getLogger(__name__)

POLL_S = 0.2


class Reaper:
    """Watches adopted pids on a thread of its own until ``stop``."""

    def __init__(self) -> None:
        self._children: dict[int, subprocess.Popen[bytes] | None] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def adopt(self, pid: int, proc: subprocess.Popen[bytes] | None = None) -> None:
        """Reap ``pid`` when it exits (a restored root made our child, or a cold start)."""
        with self._lock:
            self._children[pid] = proc

    def _loop(self) -> None:
        # A pid that is not (yet) our child stays watched while it exists: a restored tree's
        # processes become ours only when their parent dies and we are the child subreaper.
        while not self._stop.wait(POLL_S):
            with self._lock:
                items = list(self._children.items())
            for pid, proc in items:
                if _exited(pid, proc):
                    log.info("workload process %d exited", pid)
                    with self._lock:
                        self._children.pop(pid, None)


def _exited(pid: int, proc: subprocess.Popen[bytes] | None) -> bool:
    if proc is not None:
        return proc.poll() is not None
    try:
        wpid, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return not proctree.pid_in_use(pid)
    return wpid == pid
