"""Parsing a daemon config that must be refused: the one-line message, for tests to match."""

from __future__ import annotations

from typing import Any

import pytest

from gpusnap.daemon.config.file import parse_config
from gpusnap.errors import InvalidArgument

# What every config needs unless it turns verification off; parse_config does not read it.
STORE = {"key_file": "/etc/gpusnap/signing.key"}


def config_error(data: dict[str, Any]) -> str:
    """The message ``parse_config`` refuses ``data`` (plus ``[store]``) with; one line."""
    with pytest.raises(InvalidArgument) as info:
        parse_config({"store": STORE, **data})
    message = str(info.value)
    assert "\n" not in message
    return message
