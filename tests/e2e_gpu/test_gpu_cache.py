"""Device memory and the node's chunk cache, through real daemons (fake CUDA driver, custom
storage, real CRIU): a node holds what it checkpointed and restores it from its cache; another
node fetches it; either way the restore counts the device memory in what it reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Node
from tests.e2e_gpu.conftest import GpuNodes
from tests.e2e_reclaim.ask import cli_json
from tests.fakes.fake_cuda import FakeCuda, default_devices
from tests.support import workloads
from tests.support.workloads import Started, Workload

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]

GPU_BYTES = 9 * 1024 * 1024 + 5
STEPS = 80


def _checkpointed(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> tuple[Node, FakeCuda, Workload, dict[str, Any]]:
    """A node with custom storage; a counter with GPU memory, checkpointed in kill mode."""
    node, fake = gpu_nodes.make_gpu("a")
    fake.update(custom_storage=True)
    node.start()
    w = started(workloads.start_counter(tmp_path / "run", steps=STEPS), steps=5)
    fake.add_process(w.pid, {default_devices()[0]["uuid"]: GPU_BYTES}, seed=9)
    ck = cli_json(node, "checkpoint", "--pid", str(w.pid), "--wait")
    w.reap()
    return node, fake, w, ck


def test_device_memory_is_restored_from_the_cache_of_the_node_that_pushed_it(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    node, fake, w, ck = _checkpointed(gpu_nodes, tmp_path, started)
    shown = cli_json(node, "show", ck["checkpoint_id"])
    image = sum(f["size"] for f in shown["files"])
    rs = cli_json(node, "restore", ck["checkpoint_id"], "--wait")
    assert rs["mode"] == "restored", rs
    # Everything, device memory included, is counted, and came from this node's own cache.
    assert rs["bytes_total"] == image
    assert rs["bytes_fetched"] == 0, rs
    assert rs["bytes_cached"] > GPU_BYTES // 2  # compressed objects of the device memory too
    assert fake.read()["processes"][str(w.pid)]["restore_check"] == "verified"
    assert w.wait_done() == workloads.expected_lines("counter", STEPS)


def test_with_its_cache_emptied_a_node_fetches_the_device_memory_and_keeps_it_again(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    node, _fake, w, ck = _checkpointed(gpu_nodes, tmp_path, started)
    cache = node.state_dir / "cache"
    emptied = cli_json(node, "cache", "prune", "--all", "--cache-dir", str(cache))
    assert emptied["bytes_left"] == 0
    rs = cli_json(node, "restore", ck["checkpoint_id"], "--wait")
    assert rs["mode"] == "restored", rs
    assert rs["bytes_cached"] == 0, rs
    assert rs["bytes_fetched"] > GPU_BYTES // 2  # the device memory came from the store
    assert w.wait_done() == workloads.expected_lines("counter", STEPS)
    held = cli_json(node, "cache", "stats", "--cache-dir", str(cache))
    assert held["bytes"] >= rs["bytes_fetched"]  # and what it fetched it holds again
