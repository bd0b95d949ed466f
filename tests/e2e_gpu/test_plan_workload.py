"""``gpusnap plan --workload NAME`` against a real gpusnapd: the figures are the workload's real
last checkpoints (a model's device memory streamed through the fake ``libcuda.so.1``'s custom
storage under the real ``driver.py``, CRIU page images of the real process), read back through
the daemon, not estimates."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e_reclaim.ask import cli_json
from tests.gpu.lm import start_device_lm
from tests.support.fake_gpu import GpuNodes
from tests.support.workloads import Started

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]

CONFIGS = Path(__file__).resolve().parents[1] / "plan" / "configs"
GPU_BYTES = 5 * 1024 * 1024  # device_lm's weights (4 MiB) and KV pool (1 MiB)


def test_plan_workload_reads_the_real_last_checkpoints_through_the_daemon(
    gpu_nodes: GpuNodes, tmp_path: Path, started: Started
) -> None:
    g = gpu_nodes.make_gpu(
        "a",
        custom_storage=True,
        driver_version=13040,
        extra_config=f'[[workload]]\nname = "svc"\npid_file = "{tmp_path / "svc.pid"}"\n',
    )
    node = g.node
    node.start()
    w = started(
        start_device_lm(g.fake.env, tmp_path / "run", "--interval", "0.05", steps=2000), steps=5
    )
    (tmp_path / "svc.pid").write_text(f"{w.pid}\n")

    # No checkpoint yet: exit 3, one line.
    none_yet = node.cli("plan", "--workload", "svc")
    assert none_yet.rc == 3 and "svc has no checkpoint" in none_yet.stderr, none_yet.stderr

    first = cli_json(node, "checkpoint", "--workload", "svc", "--leave-running", "--wait")
    second = cli_json(node, "checkpoint", "--workload", "svc", "--leave-running", "--wait")
    shown = [cli_json(node, "show", c["checkpoint_id"]) for c in (first, second)]
    assert shown[1]["parent"] == first["checkpoint_id"]

    doc = cli_json(node, "plan", "--workload", "svc")
    m = doc["measured"]
    assert (m["workload"], m["checkpoints"]) == ("svc", 2)
    assert m["latest"]["checkpoint_id"] == second["checkpoint_id"]
    (stream,) = m["gpu_memory_streams"]
    assert stream["bytes"] == GPU_BYTES == m["gpu_memory_bytes"]
    pages = sum(f["size"] for f in shown[1]["files"] if Path(f["path"]).name.startswith("pages-"))
    assert m["page_image_bytes"] == pages > 0
    assert (
        m["gpu_memory_bytes"] + m["page_image_bytes"] + m["other_host_bytes"]
        == (shown[1]["bytes_total"])
    )
    inc, full = m["last_incremental"], m["last_full"]
    assert inc["checkpoint_id"] == second["checkpoint_id"]
    assert inc["bytes_uploaded"] == shown[1]["totals"]["bytes_stored"] == second["bytes_uploaded"]
    assert full["checkpoint_id"] == first["checkpoint_id"]
    assert full["bytes_uploaded"] == shown[0]["totals"]["bytes_stored"]
    assert doc["checkpoint_bytes_full"] == {"per_node": shown[1]["bytes_total"]}
    assert doc["checkpoint_bytes_reclaim"] == {"per_node": inc["bytes_uploaded"]}
    # No bandwidth given: the fit uses the last incremental push's own time.
    aws = doc["reclaim_fit"]["aws"]
    assert aws["upload_seconds"] == pytest.approx(inc["upload_seconds"], abs=1e-3)
    assert aws["fits"] is (inc["upload_seconds"] <= 120)

    # With a model too: the model's shapes, and the measured checkpoints instead of estimates.
    both = cli_json(
        node,
        "plan",
        "--workload",
        "svc",
        "--model",
        str(CONFIGS / "llama-3.1-8b.json"),
        "--bandwidth",
        "1GB/s",
        "--tp",
        "2",
    )
    assert both["kv_bytes_per_token"]["per_gpu"] > 0
    assert both["checkpoint_bytes_full"]["per_node"] == shown[1]["bytes_total"]
    assert both["checkpoint_bytes_reclaim"]["per_node"] == inc["bytes_uploaded"]
    assert both["checkpoint_bytes_source"]["full"] == f"measured: {second['checkpoint_id']}"
    assert both["estimated"]["checkpoint_bytes_reclaim"]["per_node"] != inc["bytes_uploaded"]
    assert both["reclaim_fit"]["gcp"]["upload_seconds"] == pytest.approx(
        inc["bytes_uploaded"] / 1e9, abs=1e-3
    )
    text = node.cli("plan", "--workload", "svc").stdout
    assert "workload svc: 2 checkpoint(s)" in text and second["checkpoint_id"] in text
