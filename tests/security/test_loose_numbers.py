"""No loose numbers or strings in what an operator configures: nan, inf, sizes and counts out of
range, a NUL in a path, TOML nested past reason -- each refused by the real
``gpusnapd --check-config`` (or ``gpusnap``) in one line with the usage exit code, 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpusnap.storage import generate_signing_key
from tests.support.daemons import gpusnapd

EXIT_USAGE = 2
WORKLOAD = '[[workload]]\nname = "llm"\npid_file = "/run/llm.pid"\n'

# (table, key = value, what the message must say): one per key the issue names, and more.
BAD_CONFIGS = {
    "retry_deadline-nan": ("store", "retry_deadline = nan", "must be a finite number"),
    "connect_timeout-nan": ("store", "connect_timeout = nan", "must be a finite number"),
    "read_timeout-inf": ("store", "read_timeout = inf", "must be a finite number"),
    "retry_max_delay-inf": ("store", "retry_max_delay = inf", "must be a finite number"),
    "lock_timeout_s-nan": ("gpu", "lock_timeout_s = nan", "must be a finite number"),
    "copy_rate_gbps-nan": ("gpu", "copy_rate_gbps = nan", "must be a finite number"),
    "call_timeout_s-huge": ("gpu", "call_timeout_s = 1e300", "must be at most"),
    "workers-huge": ("store", "workers = 1000000000", "must be at most 1024"),
    "max_pool_connections-huge": ("store", "max_pool_connections = 99999", "must be at most"),
    "multipart_chunksize-1": ("store", "multipart_chunksize = 1", "must be at least 5242880"),
    "max_jobs-huge": ("daemon", "max_jobs = 100000000000000000000", "must be at most"),
    "checkpoint_interval-nan": (
        "workload",
        "checkpoint_interval = nan",
        "checkpoint_interval must be a number of seconds > 0",
    ),
    "hook-timeout_s-nan": (
        "workload",
        'hooks = { pre_checkpoint = { command = ["/bin/true"], timeout_s = nan } }',
        "must be a finite number",
    ),
    "socket-NUL": ("daemon", 'socket = "/run/gpusnap/a\\u0000b.sock"', "NUL"),
}


def _config(tmp_path: Path, table: str, line: str) -> Path:
    key = tmp_path / "signing.key"
    if not key.exists():
        generate_signing_key(key)
    sections = {
        "daemon": f'state_dir = "{tmp_path / "state"}"\n'
        + ("" if line.startswith("socket") else f'socket = "{tmp_path / "s.sock"}"\n'),
        "store": f'url = "file://{tmp_path / "store"}"\nkey_file = "{key}"\n',
        "gpu": 'driver = "none"\n',
    }
    text = "".join(
        f"[{name}]\n{body}{line + chr(10) if name == table else ''}\n"
        for name, body in sections.items()
    )
    if table == "workload":
        text += WORKLOAD + line + "\n"
    path = tmp_path / "gpusnapd.toml"
    path.write_text(text)
    return path


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    return gpusnapd("--config", str(path), "--check-config")


def test_the_base_config_of_these_tests_is_fine(tmp_path: Path) -> None:
    result = _check(_config(tmp_path, "gpu", ""))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("table", "line", "says"), BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_a_loose_number_or_string_in_the_config_is_refused_in_one_line(
    tmp_path: Path, table: str, line: str, says: str
) -> None:
    result = _check(_config(tmp_path, table, line))
    assert result.returncode == EXIT_USAGE, result
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert says in result.stderr, result.stderr


def test_a_config_of_deeply_nested_toml_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "gpusnapd.toml"
    path.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    result = _check(path)
    assert result.returncode == EXIT_USAGE, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
    assert "nested too deeply" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("drill", "reclaim", "--deadline", "inf"),
        ("drill", "reclaim", "--deadline", "nan"),
        ("drill", "reclaim", "--deadline", "1e400"),
        ("store", "ls", "--workers", "1000000000"),
        ("store", "ls", "--multipart-chunksize", "1"),
        ("store", "ls", "--retry-for", "99999999999d"),
    ],
    ids=["deadline-inf", "deadline-nan", "deadline-overflow", "workers", "chunksize", "retry-for"],
)
def test_a_loose_number_on_the_command_line_is_a_usage_error(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpusnap.cli.main", "--socket", str(tmp_path / "none"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == EXIT_USAGE, proc
    assert "Traceback" not in proc.stderr
