"""End-to-end fixtures: real ``gpusnapd`` processes on unix sockets, driven by the real CLI.

``nodes`` makes "nodes": each is a daemon with its own state directory and socket, sharing
(by default) one ``file://`` store and one signing key with the other nodes of the test.
The test process becomes a child subreaper, so the orphans of a kill-mode dump (a tree's
child) are ours to reap and their pids are free for the restore.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import pytest

from gpusnap.storage import generate_signing_key
from tests.support import workloads
from tests.support.criu import criu_or_skip

BIN = Path(sys.executable).parent
HANG_GUARD = 120.0  # seconds; against hangs only


def gpusnapd(*args: str) -> subprocess.CompletedProcess[str]:
    """``gpusnapd ARGS`` in the foreground, to its exit: a start that must fail, a check."""
    return subprocess.run(
        [str(BIN / "gpusnapd"), *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture(scope="session", autouse=True)
def _subreaper() -> Iterator[None]:
    workloads.set_child_subreaper(True)
    yield
    workloads.set_child_subreaper(False)


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
    _logs: list[Path] = field(default_factory=list)

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
        (self.root / "sock").mkdir(parents=True, exist_ok=True, mode=0o750)
        if not self.config_path.exists():
            self.write_config()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(BIN / "gpusnapd"), "--config", str(self.config_path), "--log-level", "debug"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                env={**os.environ, **self.env},
            )
        end = time.monotonic() + HANG_GUARD
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gpusnapd {self.name} exited: {self.log()}")
            if self.socket.exists() and self.cli("status", "--json").rc == 0:
                return self
            if time.monotonic() > end:
                raise TimeoutError(f"gpusnapd {self.name} did not come up: {self.log()}")
            time.sleep(0.05)

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


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    criu_or_skip()
    with Nodes(tmp_path) as n:
        yield n


@pytest.fixture
def started() -> Iterator[workloads.Started]:
    """Workloads a test starts; whatever still runs at the end is killed and reaped."""
    s = workloads.Started()
    yield s
    s.kill_all()


def restored_cleanup(pids: list[int]) -> None:
    for pid in pids:
        workloads.kill_tree(pid)
