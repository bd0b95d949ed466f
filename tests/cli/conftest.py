"""The ``cli`` fixture of the CLI tests: a ``Cli`` on a fresh store and keys (``_cli.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli._cli import Cli, make_cli


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return make_cli(tmp_path)
