"""The GPU layer against the fake driver: the real worker, the real ``driver.py``, the real
cuda-bindings, the fake ``libcuda.so.1`` (``tests/fakes/libcuda``) and real CUDA processes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gpusnap.daemon.gpu import GpuCoordinator
from tests.fakes.libcuda import ROOT_ENV
from tests.support.fake_gpu import Coordinators, FakeNode


@pytest.fixture
def coordinators(monkeypatch: pytest.MonkeyPatch) -> Iterator[Coordinators]:
    """``coordinators(node, **kw)``: a ``GpuCoordinator`` whose worker runs on ``node``.

    The worker inherits this process's environment when it starts (and again when it is
    respawned), so the node is set in it; a test that moves to another node makes that
    node's coordinator after it is done with the first.
    """
    made: list[GpuCoordinator] = []

    def make(node: FakeNode, **kw: Any) -> GpuCoordinator:
        monkeypatch.setenv("LD_LIBRARY_PATH", node.env["LD_LIBRARY_PATH"])
        monkeypatch.setenv(ROOT_ENV, str(node.root))
        kw.setdefault("call_timeout_s", 30.0)
        coordinator = GpuCoordinator.create(nvidia_version_file=str(node.version_file), **kw)
        made.append(coordinator)
        coordinator.capabilities()  # the worker starts now, on this node
        return coordinator

    yield make
    for c in made:
        c.close()
