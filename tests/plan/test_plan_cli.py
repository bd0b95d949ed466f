"""``gpusnap plan`` run as an operator runs it: a real subprocess, real files, real stores."""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from pathlib import Path

import pytest

from gpusnap.storage import BackendOptions, open_backend
from tests.cli._cli import Cli
from tests.plan._plan import CONFIGS, GiB
from tests.support.moto_server import MotoServer

EXIT_FAILURE, EXIT_USAGE, EXIT_NOT_FOUND = 1, 2, 3

PLAN_KEYS = {
    "kv_bytes_per_token",
    "state_bytes_per_session",
    "weights_bytes",
    "kv_pool_bytes",
    "checkpoint_bytes_full",
    "checkpoint_bytes_reclaim",
    "reclaim_fit",
    "layers",
}


@pytest.fixture
def cli() -> Cli:
    return Cli()


def _model_dir(tmp_path: Path, name: str, index: str | None = None) -> Path:
    """A model directory laid out as on the hub: config.json and the safetensors index."""
    d = tmp_path / name
    d.mkdir()
    shutil.copy(CONFIGS / f"{name}.json", d / "config.json")
    if index:
        shutil.copy(CONFIGS / f"{index}.safetensors.index.json", d / "model.safetensors.index.json")
    return d


def _one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1


def test_plan_json_has_every_named_key_per_gpu_and_per_node(cli: Cli, tmp_path: Path) -> None:
    model = _model_dir(tmp_path, "llama-3.1-70b", index="llama-3.1-70b")
    out = cli.ok(
        "plan",
        "--model",
        str(model),
        "--gpu-memory",
        "141GB",
        "--tp",
        "8",
        "--context",
        "8192",
        "--sessions",
        "40",
        "--bandwidth",
        "2.5GB/s",
        "--json",
    ).json()
    assert PLAN_KEYS <= set(out)
    assert out["layers"] == {"full_attention": 80}
    for key in PLAN_KEYS - {"reclaim_fit", "layers"}:
        assert out[key]["per_node"] == pytest.approx(8 * out[key]["per_gpu"], abs=8), key
    # The index's total_size, exactly: 70.6B parameters in bf16.
    assert out["weights_bytes"]["per_node"] == 141107412992
    assert out["weights_source"].endswith("model.safetensors.index.json")
    # vLLM: 0.9 of the GPU less the weights and the modelled overhead.
    pool = out["kv_pool_bytes"]["per_gpu"]
    expected = int(141e9 * 0.9) - 141107412992 // 8 - out["engine"]["overhead_bytes_per_gpu"]
    assert pool == expected
    assert out["sessions_capacity"] == pool // out["state_bytes_per_session"]["per_gpu"]
    # 40 sessions of 8192 tokens: 40 x 8192 x 320 KiB, plus 2 GiB of host pages per GPU.
    reclaim = out["checkpoint_bytes_reclaim"]["per_node"]
    assert reclaim == 40 * 8192 * 327680 + 8 * 2 * GiB
    full = out["checkpoint_bytes_full"]["per_node"]
    assert full > reclaim
    fit = out["reclaim_fit"]
    assert set(fit) == {"aws", "gcp", "azure"}
    assert fit["aws"]["deadline_seconds"] == 120
    assert fit["gcp"]["deadline_seconds"] == fit["azure"]["deadline_seconds"] == 30
    seconds = reclaim / 2.5e9
    assert fit["aws"]["upload_seconds"] == pytest.approx(seconds, abs=1e-3)
    assert fit["aws"]["fits"] is (seconds <= 120) and fit["gcp"]["fits"] is (seconds <= 30)


def test_plan_without_bandwidth_says_fit_is_unknown(cli: Cli) -> None:
    out = cli.ok("plan", "--model", str(CONFIGS / "mistral-7b-v0.1.json"), "--json").json()
    assert all(
        v["fits"] is None and v["upload_seconds"] is None for v in out["reclaim_fit"].values()
    )
    assert out["kv_pool_bytes"] is None and out["checkpoint_bytes_full"] is None
    assert out["layers"] == {"sliding_window": 32}


def test_plan_prints_a_table_for_a_person(cli: Cli, tmp_path: Path) -> None:
    model = _model_dir(tmp_path, "llama-3.1-8b", index="llama-3.1-8b")
    out = cli.ok("plan", "--model", str(model), "--gpu-memory", "80GiB", "--bandwidth", "1GB/s").out
    for text in ("full_attention", "kv pool", "checkpoint (reclaim)", "aws", "120 s", "azure"):
        assert text in out


def test_fp8_kv_halves_the_pool_per_session(cli: Cli) -> None:
    base = ["plan", "--model", str(CONFIGS / "llama-3.1-8b.json"), "--context", "4096", "--json"]
    bf16 = cli.ok(*base).json()["state_bytes_per_session"]["per_gpu"]
    fp8 = cli.ok(*base, "--kv-dtype", "fp8").json()["state_bytes_per_session"]["per_gpu"]
    assert fp8 * 2 == bf16


def test_sglang_pool_uses_its_static_fraction(cli: Cli, tmp_path: Path) -> None:
    model = _model_dir(tmp_path, "llama-3.1-8b", index="llama-3.1-8b")
    out = cli.ok(
        "plan", "--model", str(model), "--engine", "sglang", "--gpu-memory", "80GiB", "--json"
    ).json()
    assert out["engine"]["gpu_memory_utilization"] == 0.88  # SGLang's tp-1 default
    assert out["engine"]["block_size"] == 1
    assert out["kv_pool_bytes"]["per_gpu"] == int((80 * GiB - GiB) * 0.88) - 16060522496


# -- bandwidth measured against a store -------------------------------------------------


def test_store_bandwidth_is_measured_with_a_timed_upload_that_leaves_nothing(
    cli: Cli, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    existing = open_backend(f"file://{store}")  # a store as a node has it
    existing.put("keep", b"x")
    existing.close()
    before = sorted(p.name for p in store.rglob("*"))
    out = cli.ok(
        "plan",
        "--model",
        str(CONFIGS / "qwen3-32b.json"),
        "--store",
        f"file://{store}",
        "--probe-bytes",
        "4MiB",
        "--json",
    ).json()
    assert out["bandwidth_bytes_per_second"] > 0
    assert out["bandwidth_source"].startswith("measured: 4194304 bytes to file://")
    assert all(v["upload_seconds"] is not None for v in out["reclaim_fit"].values())
    assert sorted(p.name for p in store.rglob("*")) == before


def test_store_that_does_not_exist_is_not_found_and_not_created(cli: Cli, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    result = cli("plan", "--model", str(CONFIGS / "qwen3-32b.json"), "--store", f"file://{missing}")
    assert result.rc == EXIT_NOT_FOUND, str(result)
    assert _one_line(result.err) and not missing.exists()


@pytest.mark.s3
def test_s3_store_bandwidth_is_measured_over_http(moto_server: MotoServer, s3_bucket: str) -> None:
    # The credentials: moto_server's (tests/conftest.py), in the environment for the run.
    cli = Cli({"AWS_ENDPOINT_URL": moto_server.endpoint_url})
    out = cli.ok(
        "plan",
        "--model",
        str(CONFIGS / "deepseek-v3.json"),
        "--store",
        f"s3://{s3_bucket}/ckpt",
        "--probe-bytes",
        "2MiB",
        "--json",
    ).json()
    assert out["bandwidth_bytes_per_second"] > 0
    assert f"s3://{s3_bucket}/ckpt" in out["bandwidth_source"]
    backend = open_backend(
        f"s3://{s3_bucket}/ckpt", BackendOptions(endpoint_url=moto_server.endpoint_url)
    )
    try:
        assert list(backend.list("")) == []  # the probe objects are gone
    finally:
        backend.close()


# -- the plot -------------------------------------------------------------------------


def _png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR, after checking the signature and the chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, tag = struct.unpack(">I4s", data[8:16])
    assert tag == b"IHDR" and length == 13
    body = data[16:29]
    (crc,) = struct.unpack(">I", data[29:33])
    assert zlib.crc32(tag + body) == crc
    width, height = struct.unpack(">II", body[:8])
    return width, height


def test_plot_writes_a_png_of_sane_size(cli: Cli, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    out = cli.ok(
        "plan",
        "--model",
        str(CONFIGS / "gemma-3-27b-it.json"),
        "--bandwidth",
        "1GB/s",
        "--sessions",
        "8",
        "--plot",
        str(png),
        "--json",
    ).json()
    assert out["plot"] == str(png)
    data = png.read_bytes()
    width, height = _png_size(data)
    assert 400 <= width <= 4000 and 300 <= height <= 4000
    assert data.endswith(b"IEND\xaeB`\x82")


def test_plot_without_matplotlib_is_one_clear_line(cli: Cli, tmp_path: Path) -> None:
    # A package named matplotlib that fails to import stands in for an install without it.
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    path = os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")])
    png = tmp_path / "plan.png"
    result = cli(
        "plan",
        "--model",
        str(CONFIGS / "llama-2-7b.json"),
        "--plot",
        str(png),
        env={"PYTHONPATH": path},
    )
    assert result.rc == EXIT_FAILURE, str(result)
    assert _one_line(result.err) and "gpusnap[plot]" in result.err
    assert not png.exists()


# -- bad input ------------------------------------------------------------------------


def test_missing_model_is_not_found(cli: Cli, tmp_path: Path) -> None:
    result = cli("plan", "--model", str(tmp_path / "no-model"))
    assert result.rc == EXIT_NOT_FOUND, str(result)
    assert _one_line(result.err) and "no model config" in result.err


def test_config_that_is_not_json_is_a_usage_error(cli: Cli, tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    result = cli("plan", "--model", str(bad))
    assert result.rc == EXIT_USAGE, str(result)
    assert _one_line(result.err) and "not valid JSON" in result.err


def test_unknown_architecture_exits_1_naming_what_it_lacks(cli: Cli, tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["MysteryLM"], "num_hidden_layers": 12}))
    result = cli("plan", "--model", str(cfg), "--json")
    assert result.rc == EXIT_FAILURE, str(result)
    assert _one_line(result.err) and "lacks num_attention_heads" in result.err
    assert result.json()["kind"] == "unsupported"


@pytest.mark.parametrize(
    "argv",
    [
        ["--gpu-memory", "lots"],
        ["--gpu-memory-utilization", "1.5"],
        ["--tp", "0"],
        ["--engine", "trt"],
        ["--bandwidth", "1GB/s", "--store", "file:///tmp"],
    ],
)
def test_bad_flags_are_usage_errors(cli: Cli, argv: list[str]) -> None:
    result = cli("plan", "--model", str(CONFIGS / "llama-2-7b.json"), *argv)
    assert result.rc == EXIT_USAGE, str(result)


def test_a_pool_that_cannot_fit_the_weights_is_refused(cli: Cli, tmp_path: Path) -> None:
    model = _model_dir(tmp_path, "llama-3.1-70b", index="llama-3.1-70b")
    result = cli("plan", "--model", str(model), "--gpu-memory", "80GB")
    assert result.rc == EXIT_USAGE, str(result)
    assert _one_line(result.err) and "no room for a KV pool" in result.err


def test_weights_of_a_single_file_checkpoint_come_from_its_header(cli: Cli, tmp_path: Path) -> None:
    model = _model_dir(tmp_path, "llama-2-7b")
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F16", "shape": [4, 4], "data_offsets": [0, 32]},
        "b": {"dtype": "F16", "shape": [8], "data_offsets": [32, 48]},
    }
    raw = json.dumps(header).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(48))
    out = cli.ok("plan", "--model", str(model), "--json").json()
    assert out["weights_bytes"]["per_node"] == 48
    assert out["weights_source"].endswith("model.safetensors")


def test_an_index_without_total_size_is_a_usage_error(cli: Cli, tmp_path: Path) -> None:
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"weight_map": {}}))
    result = cli(
        "plan", "--model", str(CONFIGS / "llama-2-7b.json"), "--safetensors-index", str(index)
    )
    assert result.rc == EXIT_USAGE, str(result)
    assert _one_line(result.err) and "total_size" in result.err


def test_plan_needs_a_model_or_a_workload(cli: Cli) -> None:
    result = cli("plan")
    assert result.rc == EXIT_USAGE and "needs --model, --workload, or both" in result.err


def test_plot_without_a_model_is_a_usage_error(cli: Cli, tmp_path: Path) -> None:
    result = cli("plan", "--workload", "svc", "--plot", str(tmp_path / "p.png"))
    assert result.rc == EXIT_USAGE and "--plot needs --model" in result.err, str(result)


def test_plan_workload_without_a_daemon_exits_5_in_one_line(cli: Cli, tmp_path: Path) -> None:
    result = cli("--socket", str(tmp_path / "none.sock"), "plan", "--workload", "svc")
    assert result.rc == 5, str(result)
    assert len(result.err.strip().splitlines()) == 1 and "Traceback" not in result.err


def test_a_bad_workload_name_is_a_usage_error(cli: Cli) -> None:
    result = cli("plan", "--workload", "../etc")
    assert result.rc == EXIT_USAGE and "not a workload name" in result.err, str(result)
