"""Fixtures of the fake driver, for every suite that runs on it (``tests/fakes``,
``tests/daemon_gpu``, ``tests/e2e_gpu``): a conftest imports the ones it uses.

- ``lib``: the fake ``libcuda.so.1``, built once per session.
- ``spawn``: CUDA processes (``libcuda.CudaProcess``), killed at the end.
- ``fake_nodes``: fake nodes (``FakeNode``) under the test's directory.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import libcuda
from tests.fakes.libcuda import CudaProcess, Fault, Spawn, control, gpu, write_node


@pytest.fixture(scope="session")
def lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake libcuda.so.1, built once per session into a temporary directory."""
    if shutil.which("make") is None or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler or make here (scripts/bootstrap.sh installs them)")
    return libcuda.build(tmp_path_factory.mktemp("libcuda"))


def _ptrace_scope() -> int:
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        return 0


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """``spawn(workdir, env, allocs, **kw)``: a started CUDA process, killed at the end."""
    if os.geteuid() != 0 and _ptrace_scope() >= 1:
        pytest.skip("the checkpoint calls need ptrace rights over their target (Yama forbids)")
    procs: list[CudaProcess] = []

    def start(workdir: Path, environ: dict[str, str], allocs: Any, **kw: Any) -> CudaProcess:
        p = CudaProcess.start(workdir, environ, allocs, **kw)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()


@dataclass
class FakeNode:
    """One fake node: its directory (``GPUSNAP_FAKE_CUDA_ROOT``) and how to look at it."""

    lib: Path
    root: Path

    def write(self, gpus: list[dict[str, Any]] | None = None, **kw: Any) -> FakeNode:
        """(Re)write node.json (``libcuda.write_node``); default: one H200."""
        write_node(self.root, gpus if gpus is not None else [gpu(0)], **kw)
        return self

    @property
    def env(self) -> dict[str, str]:
        """The environment of a process on this node."""
        return libcuda.env(self.lib, self.root)

    @property
    def version_file(self) -> Path:
        """The kernel module's version line, as this node's /proc/driver/nvidia/version."""
        return self.root / libcuda.VERSION_FILE

    def state(self, pid: int) -> str:
        """``GetState`` from a process of this node: the state, or the CUDA error."""
        res = control(self.env, [["state", pid]])[0]
        return str(res.get("ok", res.get("error")))

    def free(self, ordinal: int = 0) -> int:
        """Free memory of GPU ``ordinal`` as a new process sees it (its own context counted)."""
        return libcuda.free_memory(self.env, ordinal)

    def fault(self, call: str, *, hold: bool = False, **kw: Any) -> Fault:
        """``libcuda.add_fault`` on this node; ``hold`` keeps the call until ``release()``."""
        if hold:
            kw["until"] = self.root / f"release-{secrets.token_hex(4)}"
        return libcuda.add_fault(self.root, call, **kw)


@pytest.fixture
def fake_nodes(lib: Path, tmp_path: Path) -> Any:
    """``fake_nodes(name, gpus=None, **node_json)``: a ``FakeNode`` under ``tmp_path``."""

    def make(name: str, gpus: list[dict[str, Any]] | None = None, **kw: Any) -> FakeNode:
        return FakeNode(lib, tmp_path / f"node-{name}").write(gpus, **kw)

    return make
