"""Fixtures for the fake driver's tests: the library built once, CUDA processes, CRIU."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from gpusnap.daemon.host.criu import Criu
from gpusnap.errors import Unsupported
from tests.fakes.fixtures import fake_nodes, lib, spawn  # noqa: F401 - fixtures
from tests.support import workloads


@pytest.fixture
def criu() -> Iterator[Criu]:
    if os.geteuid() != 0:
        pytest.skip("CRIU needs root; run the suite as root")
    found = Criu()
    try:
        found.check()
    except Unsupported as exc:
        pytest.skip(f"no working CRIU here ({exc})")
    workloads.set_child_subreaper(True)  # adopt what a kill-mode dump orphans
    yield found
    workloads.set_child_subreaper(False)
