"""What the daemon benchmarks share: a real gpusnapd in a work directory, the CLI on its socket.

``gpusnapd(work, ...)`` writes a signing key and a config into ``work`` (socket, state dir, a
``file://`` store in ``work`` unless given another, no GPU), starts the daemon, waits until it
serves and stops it (SIGTERM) when the block ends; ``cli(sock, ...)`` runs one ``gpusnap``
command with ``--json`` and returns its answer. ``GUARD`` bounds every wait: a hang guard,
never a timing.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from gpusnap.storage import generate_signing_key

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
def gpusnapd(work: Path, *, daemon: str = "", store: str = "", extra: str = "") -> Iterator[Path]:
    """A serving gpusnapd on ``work`` for the block; yields its socket.

    ``daemon``: more keys of ``[daemon]``; ``store``: the ``[store]`` keys but ``key_file``
    (default: ``file://`` in ``work``); ``extra``: tables after ``[gpu]``. Its log is
    ``work/gpusnapd.log``.
    """
    key = work / "signing.key"
    generate_signing_key(key)
    sock = work / "sock" / "gpusnapd.sock"
    sock.parent.mkdir(mode=0o750)
    cfg = work / "gpusnapd.toml"
    store = store or f'url = "file://{work}/store"\n'
    cfg.write_text(
        f'[daemon]\nsocket = "{sock}"\nstate_dir = "{work}/state"\n{daemon}'
        f'[store]\n{store}key_file = "{key}"\n[gpu]\ndriver = "none"\n{extra}'
    )
    with open(work / "gpusnapd.log", "wb") as log:
        proc = subprocess.Popen(
            [str(BIN / "gpusnapd"), "--config", str(cfg)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:
        poll("gpusnapd to serve", lambda: proc.poll() is not None or _serves(sock))
        if proc.poll() is not None:
            raise RuntimeError(f"gpusnapd exited {proc.returncode}: see {work}/gpusnapd.log")
        yield sock
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _serves(sock: Path) -> bool:
    return sock.exists() and _gpusnap(sock, "status").returncode == 0


def _gpusnap(sock: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "gpusnap"), "--socket", str(sock), *args],
        capture_output=True,
        text=True,
        timeout=GUARD,
        check=False,
    )
