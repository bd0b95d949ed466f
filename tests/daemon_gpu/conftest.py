"""The GPU layer against the fake driver: the real worker, the real ``driver.py``, the real
cuda-bindings, the fake ``libcuda.so.1`` (``tests/fakes/libcuda``) and real CUDA processes."""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.config.file import Config, parse_config
from gpusnap.daemon.gpu import GpuCoordinator
from gpusnap.errors import InvalidArgument
from tests.e2e.conftest import started  # noqa: F401 - fixture
from tests.fakes.fixtures import FakeNode, fake_nodes, lib, spawn  # noqa: F401 - fixtures
from tests.fakes.libcuda import ROOT_ENV

Coordinators = Callable[..., GpuCoordinator]


def parse_with(tmp_path: Path, extra: str) -> Config:
    """A minimal daemon config with ``extra`` TOML at its end, parsed (and checked)."""
    text = f"""
[daemon]
state_dir = "{tmp_path / "state"}"
[store]
url = "file://{tmp_path / "store"}"
verify = false
{extra}
"""
    return parse_config(tomllib.loads(text))


def config_error(tmp_path: Path, extra: str) -> str:
    """The message of the InvalidArgument that ``parse_with(tmp_path, extra)`` raises."""
    with pytest.raises(InvalidArgument) as caught:
        parse_with(tmp_path, extra)
    return str(caught.value)


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
