"""Fixtures for the fake driver's tests: the library built once, CUDA processes, CRIU."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.host.criu import Criu
from tests.fakes import libcuda
from tests.fakes.libcuda import CudaProcess, Spawn
from tests.support import workloads
from tests.support.criu import criu_or_skip


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


@pytest.fixture
def criu() -> Iterator[Criu]:
    found = criu_or_skip()
    workloads.set_child_subreaper(True)  # adopt what a kill-mode dump orphans
    yield found
    workloads.set_child_subreaper(False)
