"""Real gpusnapd daemons on fake GPU nodes.

Each node is a real daemon with ``[gpu] driver = "cuda"``: its GPU worker runs the real
``daemon/gpu/driver.py`` through the real cuda-bindings, which load the fake ``libcuda.so.1``
first on the daemon's ``LD_LIBRARY_PATH``, on the node named by its
``GPUSNAP_FAKE_CUDA_ROOT``; ``[gpu] nvidia_version_file`` points at that node's version line
(what /proc/driver/nvidia/version holds on a real one). Two nodes are two "machines" whose
GPUs, UUIDs and drivers differ. The workloads are real CUDA processes on the fake driver;
CRIU is real.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Node, Nodes, _subreaper, started  # noqa: F401
from tests.fakes.fixtures import FakeNode, fake_nodes, lib, spawn  # noqa: F401 - fixtures
from tests.fakes.libcuda import ROOT_ENV
from tests.support.criu import criu_or_skip


@dataclass
class GpuNode:
    """A daemon (``node``) on a fake GPU node (``fake``)."""

    node: Node
    fake: FakeNode

    def cli(self, *args: str) -> Any:
        return self.node.cli(*args)


class GpuNodes(Nodes):
    def __init__(self, base: Path, lib_dir: Path) -> None:
        super().__init__(base)
        self.lib = lib_dir

    def make_gpu(
        self,
        name: str,
        gpus: list[dict[str, Any]] | None = None,
        *,
        gpu_config: str = "",
        extra_config: str = "",
        **node_json: Any,
    ) -> GpuNode:
        """A daemon on a new fake node (``libcuda.write_node``'s keys; default: one H200)."""
        fake = FakeNode(self.lib, self.base / f"gpus-{name}").write(gpus, **node_json)
        node = self.make(name, extra_config=extra_config)
        node.write_config()
        text = node.config_path.read_text()
        gpu = f'[gpu]\ndriver = "cuda"\nnvidia_version_file = "{fake.version_file}"\n'
        node.config_path.write_text(text.replace('[gpu]\ndriver = "none"\n', gpu + gpu_config))
        node.env.update({"LD_LIBRARY_PATH": fake.env["LD_LIBRARY_PATH"], ROOT_ENV: str(fake.root)})
        return GpuNode(node, fake)


@pytest.fixture
def gpu_nodes(tmp_path: Path, lib: Path) -> Iterator[GpuNodes]:  # noqa: F811
    criu_or_skip()
    with GpuNodes(tmp_path, lib) as n:
        yield n
