"""Key files are checked the way ssh checks its keys: a private key others may read or that is
not the daemon's own is refused, and so is a trusted key anyone but root may change or plant.
Through the real ``gpusnapd --check-config`` and a real daemon start."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpusnap.errors import InvalidArgument
from gpusnap.storage import generate_signing_key
from gpusnap.storage.keys import (
    export_public_key,
    generate_encryption_key,
    load_encryption_key,
    load_signing_key,
    load_trusted_keys,
)
from tests.support.daemons import Node, Nodes, gpusnapd

EXIT_USAGE = 2
NOBODY = 65534


def _check_config(node: Node) -> subprocess.CompletedProcess[str]:
    return gpusnapd("--config", str(node.config_path), "--check-config")


def _one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1


def _node_with(nodes: Nodes, store_extra: str = "") -> Node:
    node = nodes.make("a")
    node.write_config(
        f'url = "file://{nodes.store_dir}"\nkey_file = "{nodes.key_file}"\n{store_extra}'
    )
    return node


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_signing_key_others_may_read_is_refused_at_check_and_at_start(
    nodes: Nodes, mode: int
) -> None:
    node = _node_with(nodes)
    nodes.key_file.chmod(mode)
    for result in (
        _check_config(node),
        gpusnapd("--config", str(node.config_path)),  # a start, refused before serving
    ):
        assert result.returncode == EXIT_USAGE, result
        assert _one_line(result.stderr), result.stderr
        assert f"key_file: signing key file {nodes.key_file} is mode {mode:04o}" in result.stderr
        assert "must not be readable by group or others (chmod 600)" in result.stderr
    nodes.key_file.chmod(0o600)
    assert _check_config(node).returncode == 0


def test_a_signing_key_not_owned_by_the_daemons_user_is_refused(nodes: Nodes) -> None:
    node = _node_with(nodes)
    os.chown(nodes.key_file, NOBODY, -1)
    result = _check_config(node)
    assert result.returncode == EXIT_USAGE, result
    assert f"owned by uid {NOBODY}" in result.stderr, result.stderr


def test_an_encryption_key_others_may_read_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "enc.key"
    generate_encryption_key(key)
    key.chmod(0o644)
    with pytest.raises(InvalidArgument, match="is mode 0644"):
        load_encryption_key(key)


def _public_key_in(directory: Path, name: str, tmp_path: Path) -> Path:
    private = tmp_path / f"{name}.key"
    generate_signing_key(private)
    directory.mkdir(parents=True, exist_ok=True)
    public = directory / f"{name}.pub"
    export_public_key(private, public)
    return public


def test_a_trusted_keys_directory_anyone_may_write_is_refused(nodes: Nodes, tmp_path: Path) -> None:
    trusted = tmp_path / "trusted"
    _public_key_in(trusted, "other", tmp_path)
    trusted.chmod(0o1777)  # like /tmp: anyone may plant a .pub there
    node = _node_with(nodes, f'trusted_keys = ["{trusted}"]\n')
    result = _check_config(node)
    assert result.returncode == EXIT_USAGE, result
    assert f"trusted keys directory {trusted} is mode 1777" in result.stderr, result.stderr
    trusted.chmod(0o755)
    assert _check_config(node).returncode == 0, _check_config(node).stderr


def test_a_planted_public_key_in_a_world_writable_directory_is_not_trusted(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    planted = _public_key_in(shared, "planted", tmp_path)
    shared.chmod(0o777)
    with pytest.raises(InvalidArgument, match="must not be writable by group or others"):
        load_trusted_keys([planted])
    with pytest.raises(InvalidArgument, match="must not be writable by group or others"):
        load_trusted_keys([shared])


@pytest.mark.parametrize("change", ["group-writable", "not-root-or-own"])
def test_a_trusted_key_file_others_may_change_is_refused(tmp_path: Path, change: str) -> None:
    public = _public_key_in(tmp_path / "keys", "other", tmp_path)
    if change == "group-writable":
        public.chmod(0o664)
    else:
        os.chown(public, NOBODY, -1)
    with pytest.raises(InvalidArgument, match=f"trusted key file {public}"):
        load_trusted_keys([public])


def test_keys_made_by_keygen_pass_every_check(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    public = _public_key_in(keys, "node", tmp_path)
    assert load_signing_key(tmp_path / "node.key").private_key is not None
    assert len(load_trusted_keys([public, keys])) == 1
    copied = tmp_path / "copy"
    copied.mkdir()
    shutil.copy(public, copied / "node.pub")
    assert len(load_trusted_keys([copied])) == 1
