"""The model directory's digest through gpusnapd: recorded in the stamp, compared by `compat`,
and a restore that cold-starts from the workload's `start` when the weights changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusnap.daemon.gate.model_digest import CACHE_NAME, DigestCache
from tests.support import workloads
from tests.support.daemon_config import workload_section
from tests.support.daemons import Node, Nodes, assert_cold_started
from tests.support.workloads import Started, Workload

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]


def _model(d: Path) -> Path:
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["Tiny"], "num_hidden_layers": 2}')
    (d / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0, "b": 1}}}')
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 256)
    return d


def _checkpointed(
    nodes: Nodes,
    tmp_path: Path,
    started: Started,
    model: Path,
    *flags: str,
    marker: Path | None = None,
) -> tuple[Node, Workload, str]:
    """A node whose workload ``ctr`` (a counter that runs until stopped) declares
    ``model_dir = model``, and the id of a checkpoint of it."""
    pid_file = tmp_path / "counter.pid"
    section = workload_section("ctr", pid_file, marker=marker, extra=f'model_dir = "{model}"\n')
    node = nodes.make("a", extra_config=section).start()
    w = started(workloads.start_counter(tmp_path / "run", steps=0))
    pid_file.write_text(f"{w.pid}\n")
    w.wait_steps(3)
    ck = node.cli("checkpoint", "--workload", "ctr", *flags, "--wait", "--json")
    assert ck.rc == 0, ck.stderr
    return node, w, str(ck.json["checkpoint_id"])


def test_changed_weights_give_a_model_reason_and_a_cold_start(
    nodes: Nodes, tmp_path: Path, started: Started
) -> None:
    model = _model(tmp_path / "model")
    marker = tmp_path / "cold-started"
    a, w, cid = _checkpointed(nodes, tmp_path, started, model, marker=marker)
    w.reap()

    digest = DigestCache(None).directory_digest(model)
    stamp = a.cli("show", cid, "--json").json["stamp"]
    assert stamp["model"]["dir"] == str(model)
    assert stamp["model"]["dir_source"] == "config"
    assert stamp["model"]["digest"] == digest.digest
    assert (stamp["model"]["files"], stamp["model"]["bytes"]) == (3, digest.bytes)
    # The node keeps each file's hash in its state dir, for the next checkpoint and the gate.
    assert (a.state_dir / CACHE_NAME).is_file()

    same = a.cli("compat", cid, "--json")
    assert same.rc == 0, same.stderr
    assert same.json["compatible"] is True

    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1000] ^= 0xFF  # one byte, the size unchanged
    weights.write_bytes(bytes(data))
    now = DigestCache(None).directory_digest(model).digest
    message = (
        f"model files differ in {model}: checkpoint digest {digest.digest[:12]}, here {now[:12]}"
    )

    other = a.cli("compat", cid, "--json")
    assert other.rc == 1, other.stderr  # the `incompatible` exit code (docs/api.md)
    assert other.json["compatible"] is False
    assert other.json["reasons"] == [
        {
            "field": "model.digest",
            "expected": digest.digest[:12],
            "actual": now[:12],
            "message": message,
        }
    ]

    rs = a.cli("restore", cid, "--wait", "--json")
    assert_cold_started(rs, [message], marker, w)
    assert [r["field"] for r in rs.json["reason_details"]] == ["model.digest"]


def test_a_missing_model_directory_is_a_reason(
    nodes: Nodes, tmp_path: Path, started: Started
) -> None:
    model = _model(tmp_path / "model")
    a, _, cid = _checkpointed(nodes, tmp_path, started, model, "--leave-running")

    model.rename(tmp_path / "moved")
    out = a.cli("compat", cid, "--json")
    assert out.rc == 1, out.stderr
    (reason,) = out.json["reasons"]
    assert reason["field"] == "model.digest" and reason["actual"] == "missing"
    assert reason["message"].startswith(f"model directory cannot be read here: {model} (")
