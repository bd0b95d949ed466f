"""Real ``gpusnapd`` processes on unix sockets, driven by the real CLI (no pytest here: the
benchmarks start their daemons with this module too).

``Nodes`` makes "nodes": each is a daemon with its own state directory and socket, sharing (by
default) one ``file://`` store and one signing key with the other nodes it made. ``Node.start``
returns once the daemon says ``READY=1`` on a notify socket of its own (sd_notify(3), as under
systemd ``Type=notify``): the daemon sends it once its API socket serves, so nothing is polled.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from gpusnap.storage import generate_signing_key
from tests.support import workloads

BIN = Path(sys.executable).parent
HANG_GUARD = 120.0  # seconds; against hangs only


def gpusnapd(*args: str) -> subprocess.CompletedProcess[str]:
    """``gpusnapd ARGS`` in the foreground, to its exit: a start that must fail, a check."""
    return subprocess.run(
        [str(BIN / "gpusnapd"), *args], capture_output=True, text=True, timeout=60, check=False
    )


def restored_cleanup(pids: list[int]) -> None:
    for pid in pids:
        workloads.kill_tree(pid)


class DaemonExited(RuntimeError):
    """The daemon exited before it said READY=1."""


def spawn_ready(
    argv: list[str], log_path: Path, env: dict[str, str], timeout: float = HANG_GUARD
) -> subprocess.Popen[bytes]:
    """Start a daemon (``argv``; its output appended to ``log_path``) and return once it has
    said ``READY=1`` on its notify socket.

    The socket has an abstract address (no file, no path-length limit). After READY a thread
    keeps reading it until the daemon exits, so the daemon's later STATUS lines never fill it
    (a full datagram queue would block the daemon's sends). Raises ``DaemonExited`` when the
    daemon dies first, ``TimeoutError`` after ``timeout`` (a hang guard).
    """
    address = f"gpusnap-test-{uuid.uuid4().hex}"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        notify.bind("\0" + address)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                env={**env, "NOTIFY_SOCKET": "@" + address},
            )
        exited = os.pidfd_open(proc.pid)
    except BaseException:
        notify.close()
        raise
    try:
        _until_ready(notify, exited, timeout)
    except BaseException:
        notify.close()
        os.close(exited)
        raise
    threading.Thread(target=_drain, args=(notify, exited), name="notify", daemon=True).start()
    return proc


def _until_ready(notify: socket.socket, exited: int, timeout: float) -> None:
    end = time.monotonic() + timeout
    while True:
        left = max(0.0, end - time.monotonic())
        readable, _, _ = select.select([notify.fileno(), exited], [], [], left)
        if not readable:
            raise TimeoutError(f"no READY=1 within {timeout:.0f} s")
        if notify.fileno() in readable:
            message = notify.recv(4096).decode(errors="replace")
            if "READY=1" in message.splitlines():
                return
        elif exited in readable:
            raise DaemonExited("the daemon exited before READY=1")


def _drain(notify: socket.socket, exited: int) -> None:
    try:
        while True:
            readable, _, _ = select.select([notify.fileno(), exited], [], [])
            if exited in readable:
                return
            notify.recv(4096)
    finally:
        notify.close()
        os.close(exited)


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str

    @property
    def json(self) -> Any:
        return json.loads(self.stdout)


def assert_cold_started(
    rs: Result, reasons: list[str], marker: Path, checkpointed: workloads.Workload
) -> None:
    """``rs`` (a restore's) cold-started with ``reasons``: the workload's ``start`` wrote
    ``cold`` to ``marker`` (tests/support/daemon_config.py), and the checkpointed process was
    not restored (its output stopped where the dump was)."""
    assert rs.rc == 0, rs.stderr
    assert rs.json["mode"] == "cold-start"
    assert rs.json["reasons"] == reasons
    workloads._poll(marker.exists, 60, "the cold start to run")
    assert marker.read_text() == "cold"
    assert not checkpointed.output().endswith(workloads.DONE)


@dataclass
class Node:
    """One gpusnapd with its own state dir and socket."""

    name: str
    root: Path
    store_url: str
    key_file: Path
    extra_config: str = ""
    daemon_config: str = ""  # more keys of the [daemon] table
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    log_level: str = "debug"

    @property
    def socket(self) -> Path:
        return self.root / "sock" / "gpusnapd.sock"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def config_path(self) -> Path:
        return self.root / "gpusnapd.toml"

    @property
    def log_path(self) -> Path:
        return self.root / "gpusnapd.log"

    def write_config(self, store_section: str | None = None) -> None:
        store = store_section or (f'url = "{self.store_url}"\nkey_file = "{self.key_file}"\n')
        self.config_path.write_text(
            f"""[daemon]
socket = "{self.socket}"
state_dir = "{self.state_dir}"
node_id = "{self.name}"
{self.daemon_config}
[store]
{store}
[gpu]
driver = "none"

{self.extra_config}
"""
        )

    def start(self) -> Node:
        """Start the daemon; returns once it serves (its ``READY=1``)."""
        (self.root / "sock").mkdir(parents=True, exist_ok=True, mode=0o750)
        if not self.config_path.exists():
            self.write_config()
        argv = [str(BIN / "gpusnapd"), "--config", str(self.config_path)]
        argv += ["--log-level", self.log_level]
        try:
            self.proc = spawn_ready(argv, self.log_path, {**os.environ, **self.env})
        except DaemonExited:
            raise RuntimeError(f"gpusnapd {self.name} exited: {self.log()}") from None
        except TimeoutError:
            raise TimeoutError(f"gpusnapd {self.name} did not come up: {self.log()}") from None
        return self

    def cli(self, *args: str, timeout: float = HANG_GUARD) -> Result:
        proc = subprocess.run(
            [str(BIN / "gpusnap"), "--socket", str(self.socket), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        return Result(proc.returncode, proc.stdout, proc.stderr)

    def job(self, job_id: str) -> dict[str, Any]:
        """``gpusnap job ID --json``, which must succeed."""
        got = self.cli("job", job_id, "--json")
        assert got.rc == 0, got.stderr
        job: dict[str, Any] = got.json
        return job

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(HANG_GUARD)

    def kill(self) -> None:
        """SIGKILL, as a crash would; its children (criu, ...) get reaped by us or pid 1."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(HANG_GUARD)


class Nodes:
    """The daemons of one test (or one benchmark run) under ``base``; ``close`` stops them."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.store_dir = base / "store"
        self.key_file = base / "signing.key"
        generate_signing_key(self.key_file)
        self.items: list[Node] = []

    def make(
        self,
        name: str,
        *,
        extra_config: str = "",
        store_url: str | None = None,
        daemon_config: str = "",
    ) -> Node:
        node = Node(
            name,
            self.base / name,
            store_url or f"file://{self.store_dir}",
            self.key_file,
            extra_config,
            daemon_config,
        )
        node.root.mkdir(parents=True, exist_ok=True)
        self.items.append(node)
        return node

    def close(self) -> None:
        for node in self.items:
            with contextlib.suppress(Exception):
                node.stop()
            node.kill()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
