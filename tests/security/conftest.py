"""The security suite: its daemons' orphans (a kill-mode dump's tree) are the test process's
to reap, as in tests/e2e; stores, keys and daemons come from the suite's plugin."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _adopt_orphans(child_subreaper: None) -> None:
    """Every test here runs as the orphans' subreaper (``child_subreaper``)."""
