"""Device memory and the node's chunk cache, through real daemons (the fake ``libcuda.so.1``
with custom storage, under the real ``driver.py`` and cuda-bindings; real CRIU on a real CUDA
process): a node holds what it checkpointed and restores it from its cache; with the cache
emptied it fetches it; either way the restore counts the device memory in what it reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e_reclaim.ask import cli_json
from tests.gpu.lm import reference_tokens, start_device_lm
from tests.support.fake_gpu import GpuNode, GpuNodes
from tests.support.workloads import Started, Workload

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]

HELD = 5 * 1024 * 1024  # device_lm's weights (4 MiB) and KV pool (1 MiB)
STEPS = 60
PACE = ("--interval", "0.05")


def _checkpointed(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> tuple[GpuNode, Workload, bytes, dict[str, Any]]:
    """A node with custom storage; a model on its GPU, checkpointed in kill mode."""
    g = gpu_nodes.make_gpu("a", custom_storage=True, driver_version=13040)
    g.node.start()
    expected = reference_tokens(g.fake.env, tmp_path / "ref", steps=STEPS)
    w = started(start_device_lm(g.fake.env, tmp_path / "run", *PACE, steps=STEPS), steps=10)
    ck = cli_json(g.node, "checkpoint", "--pid", str(w.pid), "--wait")
    w.reap()
    assert cli_json(g.node, "show", ck["checkpoint_id"])["stamp"]["gpu"]["memory_copy"] == (
        "custom-storage"
    )
    return g, w, expected, ck


def test_device_memory_is_restored_from_the_cache_of_the_node_that_pushed_it(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    g, w, expected, ck = _checkpointed(gpu_nodes, tmp_path, started)
    node = g.node
    shown = cli_json(node, "show", ck["checkpoint_id"])
    image = sum(f["size"] for f in shown["files"])
    rs = cli_json(node, "restore", ck["checkpoint_id"], "--wait")
    assert rs["mode"] == "restored", rs
    # Everything, device memory included, is counted, and came from this node's own cache.
    assert rs["bytes_total"] == image
    assert rs["bytes_fetched"] == 0, rs
    assert rs["bytes_cached"] > HELD // 2  # compressed objects of the device memory too
    assert w.wait_done() == expected  # the model's tokens: its device memory came back whole


def test_with_its_cache_emptied_a_node_fetches_the_device_memory_and_keeps_it_again(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    g, w, expected, ck = _checkpointed(gpu_nodes, tmp_path, started)
    node = g.node
    cache = node.state_dir / "cache"
    emptied = cli_json(node, "cache", "prune", "--all", "--cache-dir", str(cache))
    assert emptied["bytes_left"] == 0
    rs = cli_json(node, "restore", ck["checkpoint_id"], "--wait")
    assert rs["mode"] == "restored", rs
    assert rs["bytes_cached"] == 0, rs
    assert rs["bytes_fetched"] > HELD // 2  # the device memory came from the store
    assert w.wait_done() == expected
    held = cli_json(node, "cache", "stats", "--cache-dir", str(cache))
    assert held["bytes"] >= rs["bytes_fetched"]  # and what it fetched it holds again
