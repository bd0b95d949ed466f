"""gpusnapd's config: every key checked, errors name the key in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from gpusnap.daemon.config.file import load_config, parse_config
from gpusnap.errors import InvalidArgument
from gpusnap.storage import generate_encryption_key, generate_signing_key

# What every config needs unless it turns verification off; parse_config does not read it.
STORE = {"key_file": "/etc/gpusnap/signing.key"}


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(InvalidArgument) as info:
        parse_config(data)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_full_config_parses(tmp_path: Path) -> None:
    key = tmp_path / "signing.key"
    generate_signing_key(key)
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f"""
[daemon]
socket = "/run/g/g.sock"
state_dir = "/var/lib/g"
[store]
url = "s3://bucket/prefix"
endpoint_url = "http://127.0.0.1:9000"
key_file = "{key}"
retry_attempts = 2
[[workload]]
name = "llm"
pid_file = "/run/llm.pid"
engine = {{ name = "vllm", version = "0.11.0" }}
model = {{ name = "org/model", revision = "abc123" }}
model_dir = "/models/org-model"
start = {{ command = ["vllm", "serve"], cwd = "/srv", env = {{ K = "V" }}, user = "svc" }}
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
    assert llm.model_dir == Path("/models/org-model")
    assert llm.start.command == ("vllm", "serve")
    assert llm.start.checkpoint_ready  # the default: io_uring off for a cold start
    other = c.workload("other")
    assert other is not None and other.engine_probed
    assert c.metrics.listen == "127.0.0.1:9400"


def test_an_unknown_key_is_named_with_a_suggestion() -> None:
    msg = _error({"store": STORE, "workload": [{"name": "a"}, {"name": "llm", "pidfile": "/x"}]})
    assert msg == "config: [[workload]] #2 'llm': unknown key 'pidfile' (did you mean 'pid_file'?)"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"daemon": {"state_dir": "relative"}}, "key 'state_dir': must be an absolute path"),
        ({"store": {"url": "bucket"}}, "is not a URL"),
        ({"daemon": {"max_jobs": 0}}, "key 'max_jobs': must be at least 1"),
        ({"workload": [{"name": "a b"}]}, "is not a workload name"),
        ({"workload": [{"name": "llm\n"}]}, "is not a workload name"),
        ({"workload": [{"name": "a"}, {"name": "a"}]}, "used by another"),
        ({"workload": [{"name": "a", "engine": "guess"}]}, "key 'engine'"),
        ({"workload": [{"name": "a", "start": {"command": []}}]}, "key 'command'"),
        (
            {"workload": [{"name": "a", "start": {"command": ["x"], "checkpoint_ready": 1}}]},
            "key 'checkpoint_ready': must be true or false",
        ),
        ({"workload": [{"name": "a", "match": "("}]}, "not a regular expression"),
        ({"workload": [{"name": "a", "model_dir": "m"}]}, "key 'model_dir': must be an absolute"),
        ({"gpu": {"driver": "rocm"}}, "must be one of auto, cuda, none"),
        ({"metrics": {"listen": "9400"}}, "must be HOST:PORT"),
        ({"bogus": {}}, "unknown section or key 'bogus'"),
    ],
)
def test_bad_values_are_refused_naming_the_key(data: dict[str, Any], expected: str) -> None:
    assert expected in _error({"store": STORE, **data})


def test_a_file_that_is_not_toml_is_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[daemon\n")
    with pytest.raises(InvalidArgument, match="not valid TOML"):
        load_config(cfg)


def test_staging_dir_and_criu_log_level_default_and_parse() -> None:
    default = parse_config({"store": STORE})
    assert default.daemon.staging_dir is None
    assert default.daemon.criu_log_level == 4
    daemon = {"staging_dir": "/dev/shm/gpusnap", "criu_log_level": 0}
    cfg = parse_config({"store": STORE, "daemon": daemon})
    assert cfg.daemon.staging_dir == Path("/dev/shm/gpusnap")
    assert cfg.daemon.criu_log_level == 0


@pytest.mark.parametrize("level", [5, -1, "4"])
def test_a_criu_log_level_outside_0_to_4_is_refused_naming_the_key(level: object) -> None:
    assert "criu_log_level" in _error({"store": STORE, "daemon": {"criu_log_level": level}})


def test_upload_during_dump_defaults_on_and_parses() -> None:
    assert parse_config({"store": STORE}).daemon.upload_during_dump is True
    off = parse_config({"store": STORE, "daemon": {"upload_during_dump": False}})
    assert off.daemon.upload_during_dump is False
    assert "upload_during_dump" in _error({"store": STORE, "daemon": {"upload_during_dump": "yes"}})


# --- a store section that could never work is refused at load, naming the key -----------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("ftp://example.com/x", "[store] url: unknown scheme 'ftp'"),
        ("file://relative/path", "[store] url: 'file://relative/path' must name an absolute"),
        ("s3:///prefix", "[store] url: 's3:///prefix' names no bucket"),
    ],
)
def test_a_store_url_that_cannot_work_is_refused(url: str, expected: str) -> None:
    assert expected in _error({"store": {**STORE, "url": url}})


def test_a_config_without_a_signing_key_is_refused_unless_verification_is_off() -> None:
    assert "[store] missing key 'key_file'" in _error({})
    assert "verify = false" in _error({})
    off = parse_config({"store": {"verify": False}})
    assert off.store.key_file is None and not off.store.verify


def _write_rsa_key(path: Path) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


@pytest.mark.parametrize(
    ("key", "make", "expected"),
    [
        ("key_file", None, "[store] key_file: signing key file {path} does not exist"),
        ("key_file", "garbage", "[store] key_file: signing key file {path} is not a readable"),
        ("key_file", "rsa", "[store] key_file: signing key file {path} is not an Ed25519 key"),
        ("encryption_key_file", None, "[store] encryption_key_file: encryption key file {path}"),
        ("encryption_key_file", "16 bytes", "{path} must hold exactly 32 bytes"),
    ],
)
def test_a_key_file_that_is_missing_or_not_a_key_is_refused_at_load(
    tmp_path: Path, key: str, make: str | None, expected: str
) -> None:
    signing = tmp_path / "signing.key"
    generate_signing_key(signing)
    path = tmp_path / "the.key"
    if make == "garbage":
        path.write_bytes(b"not a key\n")
    elif make == "rsa":
        _write_rsa_key(path)
    elif make == "16 bytes":
        path.write_bytes(bytes(16))
    if path.exists():
        path.chmod(0o600)  # a key others may read is refused for that reason first
    cfg = tmp_path / "c.toml"
    store = {"key_file": str(signing), key: str(path)}
    cfg.write_text("[store]\n" + "".join(f'{k} = "{v}"\n' for k, v in store.items()))
    with pytest.raises(InvalidArgument) as info:
        load_config(cfg)
    message = str(info.value)
    assert "\n" not in message
    assert expected.format(path=path) in message


def test_working_key_files_load(tmp_path: Path) -> None:
    signing, encryption = tmp_path / "signing.key", tmp_path / "encryption.key"
    generate_signing_key(signing)
    generate_encryption_key(encryption)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[store]\nkey_file = "{signing}"\nencryption_key_file = "{encryption}"\n')
    assert load_config(cfg).store.encryption_key_file == encryption


def test_a_socket_path_too_long_for_a_unix_socket_is_refused() -> None:
    long_path = "/run/" + "s" * 100 + "/gpusnapd.sock"
    message = _error({"store": STORE, "daemon": {"socket": long_path}})
    assert "config: [daemon]: key 'socket': path too long for a unix socket (119 > 107" in message
    assert parse_config({"store": STORE, "daemon": {"socket": "/run/" + "s" * 102}})


def test_a_workload_with_no_finder_is_kept_for_pid_checkpoints_and_standby_restores() -> None:
    # No pid_file/systemd_unit/match is legitimate: it declares the engine, model and cold-start
    # spec of a workload checkpointed with --pid, or restored here from another node.
    data = {"store": STORE, "workload": [{"name": "llm", "start": {"command": ["serve"]}}]}
    llm = parse_config(data).workload("llm")
    assert llm is not None and llm.start is not None and llm.pid_file is None
