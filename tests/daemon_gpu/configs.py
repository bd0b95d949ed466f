"""Daemon configs for the GPU tables' tests: a minimal config with some TOML added, parsed."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from gpusnap.daemon.config.file import Config, parse_config
from gpusnap.errors import InvalidArgument


def parse_with(tmp_path: Path, extra: str) -> Config:
    """A minimal daemon config with ``extra`` TOML at its end, parsed (and checked)."""
    text = f"""
[daemon]
state_dir = "{tmp_path / "state"}"
[store]
url = "file://{tmp_path / "store"}"
verify = false
{extra}
"""
    return parse_config(tomllib.loads(text))


def config_error(tmp_path: Path, extra: str) -> str:
    """The message of the InvalidArgument that ``parse_with(tmp_path, extra)`` raises."""
    with pytest.raises(InvalidArgument) as caught:
        parse_with(tmp_path, extra)
    return str(caught.value)
