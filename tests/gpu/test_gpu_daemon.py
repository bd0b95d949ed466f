"""The real daemon on a real GPU: gpusnapd with ``[gpu] driver = "cuda"`` checkpoints
``device_lm.py`` (weights and a KV pool in device memory, cuda-bindings only), kills it,
restores it, and it writes the tokens of an uninterrupted run; leave-running too.

The same scenario as ``tests/e2e_gpu`` runs against the fake libcuda; here it is NVIDIA's.
Runs only on a machine with an NVIDIA GPU (conftest.py) and CRIU, as root.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.lm import reference_tokens, start_device_lm
from tests.support.criu import criu_or_skip
from tests.support.daemons import Node, Nodes
from tests.support.workloads import Started, Workload

STEPS = 300
WEIGHTS_MIB = int(os.environ.get("GPUSNAP_GPU_LM_WEIGHTS_MIB", "2048"))
MODEL = ("--weights-mib", str(WEIGHTS_MIB), "--kv-mib", "256")  # 2.25 GiB on the GPU


@pytest.fixture
def gpu_node(tmp_path: Path) -> Iterator[Node]:
    criu_or_skip()
    with Nodes(tmp_path) as nodes:
        node = nodes.make("gpu")
        node.write_config()
        text = node.config_path.read_text()
        node.config_path.write_text(text.replace('driver = "none"', 'driver = "cuda"'))
        node.start()
        yield node


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}


def _running_model(tmp_path: Path, started: Started) -> tuple[bytes, Workload]:
    """The tokens of an uninterrupted run, and a paced run a third of the way through."""
    expected = reference_tokens(_env(), tmp_path / "ref", *MODEL, steps=STEPS)
    w = started(
        start_device_lm(_env(), tmp_path / "run", *MODEL, "--interval", "0.01", steps=STEPS),
        steps=STEPS // 3,
    )
    return expected, w


def _checkpoint(node: Node, pid: int, *extra: str) -> dict[str, Any]:
    ck = node.cli("checkpoint", "--pid", str(pid), *extra, "--wait", "--json", timeout=300)
    assert ck.rc == 0, ck.stderr + node.log()
    result: dict[str, Any] = ck.json
    return result


def test_the_daemon_kills_and_restores_a_model_in_device_memory_bit_exactly(
    gpu_node: Node, tmp_path: Path, started: Started, figures: Any
) -> None:
    expected, w = _running_model(tmp_path, started)
    t0 = time.monotonic()
    result = _checkpoint(gpu_node, w.pid)
    checkpoint_s = time.monotonic() - t0
    w.reap()
    shown = gpu_node.cli("show", result["checkpoint_id"], "--json")
    gpu = shown.json["stamp"]["gpu"]
    assert gpu["present"] is True and gpu["cuda_pids"] == [w.pid]
    assert gpu["processes"][0]["bytes"] >= (WEIGHTS_MIB + 256) * 2**20
    t1 = time.monotonic()
    rs = gpu_node.cli("restore", result["checkpoint_id"], "--wait", "--json", timeout=300)
    restore_s = time.monotonic() - t1
    assert rs.rc == 0, rs.stderr + gpu_node.log()
    assert rs.json["mode"] == "restored", rs.json
    assert w.wait_done(timeout=300) == expected
    figures(
        "daemon-kill-restore",
        gpu_bytes=gpu["bytes_total"],
        memory_copy=gpu["memory_copy"],
        pause_s=result["pause_seconds"],
        checkpoint_s=checkpoint_s,
        restore_s=restore_s,
        gpu_checkpoint_s=gpu["checkpoint_seconds"],
    )


def test_the_daemon_leave_running_checkpoint_of_a_model_in_device_memory(
    gpu_node: Node, tmp_path: Path, started: Started, figures: Any
) -> None:
    expected, w = _running_model(tmp_path, started)
    result = _checkpoint(gpu_node, w.pid, "--leave-running")
    assert w.wait_done(timeout=300) == expected
    figures("daemon-leave-running", pause_s=result["pause_seconds"])
