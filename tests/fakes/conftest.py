"""Fixtures for the fake driver's tests: the library built once, CUDA processes, CRIU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpusnap.daemon.host.criu import Criu
from tests.fakes.fixtures import fake_nodes, lib, spawn  # noqa: F401 - fixtures
from tests.support import workloads
from tests.support.criu import criu_or_skip


@pytest.fixture
def criu() -> Iterator[Criu]:
    found = criu_or_skip()
    workloads.set_child_subreaper(True)  # adopt what a kill-mode dump orphans
    yield found
    workloads.set_child_subreaper(False)
