"""Real gpusnapd daemons on fake GPU nodes (``gpu_nodes``, ``tests/support/fake_gpu.py``): two
nodes are two "machines" whose GPUs, UUIDs and drivers differ. The workloads are real CUDA
processes on the fake driver; CRIU is real. The test process adopts the orphans of what it
starts, as in tests/e2e.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _adopt_orphans(child_subreaper: None) -> None:
    """Every test here runs as the orphans' subreaper (``child_subreaper``)."""
