"""Fixtures for the fake driver's tests: the library built once, CUDA processes, CRIU."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest

from gpusnap.daemon.host.criu import Criu
from tests.support import workloads
from tests.support.criu import criu_or_skip


def _subreaper() -> bool:
    flag = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(37, ctypes.byref(flag), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
    return bool(flag.value)


@pytest.fixture
def criu() -> Iterator[Criu]:
    found = criu_or_skip()
    was = _subreaper()  # a session fixture of another suite may have made us one already
    workloads.set_child_subreaper(True)  # adopt what a kill-mode dump orphans
    yield found
    workloads.set_child_subreaper(was)
