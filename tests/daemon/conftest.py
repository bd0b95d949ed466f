"""Fixtures the daemon's unit tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.workloads import Started


@pytest.fixture
def started() -> Iterator[Started]:
    """Workloads a test starts; whatever still runs at the end is killed and reaped."""
    s = Started()
    yield s
    s.kill_all()
