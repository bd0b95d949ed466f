"""Nodes of the fake driver (``tests/fakes/libcuda``): a fake node's directory and how to look
at it (``FakeNode``), and real daemons on fake nodes (``GpuNodes``).

Each ``GpuNode`` is a real daemon with ``[gpu] driver = "cuda"``: its GPU worker runs the real
``daemon/gpu/driver.py`` through the real cuda-bindings, which load the fake ``libcuda.so.1``
first on the daemon's ``LD_LIBRARY_PATH``, on the node named by its ``GPUSNAP_FAKE_CUDA_ROOT``;
``[gpu] nvidia_version_file`` points at that node's version line (what
/proc/driver/nvidia/version holds on a real one). Two nodes are two "machines" whose GPUs,
UUIDs and drivers differ.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusnap.daemon.gpu import GpuCoordinator
from tests.fakes import libcuda
from tests.fakes.libcuda import ROOT_ENV, Fault, control, gpu, write_node
from tests.support.daemons import Node, Nodes

# The ``coordinators`` fixture of tests/daemon_gpu: ``coordinators(node, **kw)``.
Coordinators = Callable[..., GpuCoordinator]


@dataclass
class FakeNode:
    """One fake node: its directory (``GPUSNAP_FAKE_CUDA_ROOT``) and how to look at it."""

    lib: Path
    root: Path

    def write(self, gpus: list[dict[str, Any]] | None = None, **kw: Any) -> FakeNode:
        """(Re)write node.json (``libcuda.write_node``); default: one H200."""
        write_node(self.root, gpus if gpus is not None else [gpu(0)], **kw)
        return self

    @property
    def env(self) -> dict[str, str]:
        """The environment of a process on this node."""
        return libcuda.env(self.lib, self.root)

    @property
    def version_file(self) -> Path:
        """The kernel module's version line, as this node's /proc/driver/nvidia/version."""
        return self.root / libcuda.VERSION_FILE

    def state(self, pid: int) -> str:
        """``GetState`` from a process of this node: the state, or the CUDA error."""
        res = control(self.env, [["state", pid]])[0]
        return str(res.get("ok", res.get("error")))

    def free(self, ordinal: int = 0) -> int:
        """Free memory of GPU ``ordinal`` as a new process sees it (its own context counted)."""
        return libcuda.free_memory(self.env, ordinal)

    def fault(self, call: str, *, hold: bool = False, **kw: Any) -> Fault:
        """``libcuda.add_fault`` on this node; ``hold`` keeps the call until ``release()``."""
        if hold:
            kw["until"] = self.root / f"release-{secrets.token_hex(4)}"
        return libcuda.add_fault(self.root, call, **kw)


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
