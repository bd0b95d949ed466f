"""A real tmpfs for tests that need a small or read-only file system (a full disk, EROFS)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``where`` (created) with mount ``options`` (``size=1m``,
    ``ro,size=1m``) until the block ends; skips the test where none can be mounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=False
    ).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)
