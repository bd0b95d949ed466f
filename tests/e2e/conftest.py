"""End-to-end tests: real ``gpusnapd`` processes on unix sockets, driven by the real CLI
(``nodes``, ``tests/support/daemons.py``). The test process is a child subreaper, so the orphans
of a kill-mode dump (a tree's child) are ours to reap and their pids are free for the restore.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _adopt_orphans(child_subreaper: None) -> None:
    """Every test here runs as the orphans' subreaper (``child_subreaper``)."""
