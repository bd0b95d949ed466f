"""gpusnapd's config: every key checked, errors name the key in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.config import load_config, parse_config
from gpusnap.storage.errors import InvalidArgument


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(InvalidArgument) as info:
        parse_config(data)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_full_config_parses(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        """
[daemon]
socket = "/run/g/g.sock"
state_dir = "/var/lib/g"
[store]
url = "s3://bucket/prefix"
endpoint_url = "http://127.0.0.1:9000"
key_file = "/etc/gpusnap/signing.key"
retry_attempts = 2
[[workload]]
name = "llm"
pid_file = "/run/llm.pid"
engine = { name = "vllm", version = "0.11.0" }
model = { name = "org/model", revision = "abc123" }
start = { command = ["vllm", "serve"], cwd = "/srv", env = { K = "V" }, user = "svc" }
[[workload]]
name = "other"
match = "python .*serve"
engine = "probed"
[gpu]
driver = "none"
[metrics]
listen = "127.0.0.1:9400"
"""
    )
    c = load_config(cfg)
    assert c.daemon.socket == Path("/run/g/g.sock")
    assert c.store.options.endpoint_url == "http://127.0.0.1:9000"
    assert c.store.options.retry_attempts == 2
    llm = c.workload("llm")
    assert llm is not None and llm.model is not None and llm.start is not None
    assert llm.model.revision == "abc123"
    assert llm.start.command == ("vllm", "serve")
    other = c.workload("other")
    assert other is not None and other.engine_probed
    assert c.metrics.listen == "127.0.0.1:9400"


def test_an_unknown_key_is_named_with_a_suggestion() -> None:
    msg = _error({"workload": [{"name": "a"}, {"name": "llm", "pidfile": "/x"}]})
    assert msg == "config: [[workload]] #2 'llm': unknown key 'pidfile' (did you mean 'pid_file'?)"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"daemon": {"state_dir": "relative"}}, "key 'state_dir': must be an absolute path"),
        ({"store": {"url": "bucket"}}, "is not a URL"),
        ({"daemon": {"max_jobs": 0}}, "key 'max_jobs': must be at least 1"),
        ({"workload": [{"name": "a b"}]}, "is not a workload name"),
        ({"workload": [{"name": "a"}, {"name": "a"}]}, "used by another"),
        ({"workload": [{"name": "a", "engine": "guess"}]}, "key 'engine'"),
        ({"workload": [{"name": "a", "start": {"command": []}}]}, "key 'command'"),
        ({"workload": [{"name": "a", "match": "("}]}, "not a regular expression"),
        ({"gpu": {"driver": "rocm"}}, "must be one of auto, cuda, none"),
        ({"metrics": {"listen": "9400"}}, "must be HOST:PORT"),
        ({"bogus": {}}, "unknown section or key 'bogus'"),
    ],
)
def test_bad_values_are_refused_naming_the_key(data: dict[str, Any], expected: str) -> None:
    assert expected in _error(data)


def test_a_file_that_is_not_toml_is_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[daemon\n")
    with pytest.raises(InvalidArgument, match="not valid TOML"):
        load_config(cfg)


def test_staging_dir_and_criu_log_level_default_and_parse() -> None:
    default = parse_config({})
    assert default.daemon.staging_dir is None
    assert default.daemon.criu_log_level == 4
    cfg = parse_config({"daemon": {"staging_dir": "/dev/shm/gpusnap", "criu_log_level": 0}})
    assert cfg.daemon.staging_dir == Path("/dev/shm/gpusnap")
    assert cfg.daemon.criu_log_level == 0


@pytest.mark.parametrize("level", [5, -1, "4"])
def test_a_criu_log_level_outside_0_to_4_is_refused_naming_the_key(level: object) -> None:
    assert "criu_log_level" in _error({"daemon": {"criu_log_level": level}})
