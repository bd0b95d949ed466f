"""What the daemon benchmarks share: a real gpusnapd in a work directory, the CLI on its socket.

``gpusnapd(work, ...)`` writes a signing key and a config into ``work`` (socket, state dir, a
``file://`` store in ``work`` unless given another, no GPU), starts the daemon with the test
suite's harness (``tests/support/daemons.py``), which returns once it serves, and stops it
(SIGTERM) when the block ends; ``cli(sock, ...)`` runs one ``gpusnap``
command with ``--json`` and returns its answer. ``GUARD`` bounds every wait: a hang guard,
never a timing.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from tests.support.daemons import Nodes

BIN = Path(sys.executable).parent
GUARD = 1800.0  # seconds; against hangs only

T = TypeVar("T")


def poll(what: str, ready: Callable[[], T | None], interval: float = 0.05) -> T:
    """``ready()``'s first true value, asked every ``interval`` seconds for up to ``GUARD``."""
    end = time.monotonic() + GUARD
    while True:
        value = ready()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(interval)


def cli(sock: Path, *args: str) -> Any:
    """``gpusnap --socket SOCK ARGS --json``: its JSON answer; a failure raises, saying why."""
    proc = _gpusnap(sock, *args, "--json")
    if proc.returncode != 0:
        raise RuntimeError(f"gpusnap {' '.join(args)} failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def adopt_orphans() -> None:
    """Make this process the child subreaper of what it starts (PR_SET_CHILD_SUBREAPER):
    a restored tree, or a workload a kill-mode dump orphaned, is ours to reap."""
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)


@contextlib.contextmanager
def gpusnapd(
    work: Path, *, name: str = "bench", daemon: str = "", store: str = "", extra: str = ""
) -> Iterator[Path]:
    """A serving gpusnapd on ``work`` for the block; yields its socket.

    The daemon is the test suite's (``tests/support/daemons.py``: started, and waited for on
    its ``READY=1``, the same way) at log level info. ``name``: its node id and the folder
    under ``work`` that holds its state, socket and ``gpusnapd.log``; ``daemon``: more keys of
    ``[daemon]``; ``store``: the ``[store]`` keys but ``key_file`` (default: ``file://`` in
    ``work``); ``extra``: tables after ``[gpu]``.
    """
    with Nodes(work) as nodes:
        node = nodes.make(name, daemon_config=daemon, extra_config=extra)
        node.log_level = "info"
        if store:
            node.write_config(f'{store}key_file = "{nodes.key_file}"\n')
        node.start()
        yield node.socket


def _gpusnap(sock: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "gpusnap"), "--socket", str(sock), *args],
        capture_output=True,
        text=True,
        timeout=GUARD,
        check=False,
    )
