"""Real gpusnapd daemons whose GPU worker loads the fake CUDA driver.

Each node gets ``[gpu] driver = "cuda"`` with ``$GPUSNAP_GPU_DRIVER`` pointing at the fake
(``module:tests.fakes.fake_cuda``) and its own ``$GPUSNAP_FAKE_CUDA_STATE``: two nodes are two
"machines" whose GPUs and drivers can differ. Real processes are registered in a node's fake
as CUDA processes; CRIU is real.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Node, Nodes, _subreaper, criu_or_skip, started  # noqa: F401
from tests.fakes.fake_cuda import STATE_ENV, FakeCuda

REPO = Path(__file__).resolve().parents[2]
FAKE_DRIVER = "module:tests.fakes.fake_cuda"


class GpuNodes(Nodes):
    def make_gpu(
        self, name: str, *, gpu_config: str = "", extra_config: str = ""
    ) -> tuple[Node, FakeCuda]:
        """A node with the fake driver (state set up with defaults; change it before start)."""
        node = self.make(name, extra_config=extra_config)
        fake = FakeCuda(node.root / "fake-cuda.json").setup()
        node.write_config()
        text = node.config_path.read_text()
        node.config_path.write_text(
            text.replace('[gpu]\ndriver = "none"\n', f'[gpu]\ndriver = "cuda"\n{gpu_config}')
        )
        node.env.update(
            {
                "GPUSNAP_GPU_DRIVER": FAKE_DRIVER,
                STATE_ENV: str(fake.path),
                # The repo (for the fake driver's module) before the path this run imports
                # gpusnap from: a worktree's daemon must run the worktree's code.
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
                ),
            }
        )
        return node, fake


@pytest.fixture
def gpu_nodes(tmp_path: Path) -> Iterator[GpuNodes]:
    criu_or_skip()
    with GpuNodes(tmp_path) as n:
        yield n
