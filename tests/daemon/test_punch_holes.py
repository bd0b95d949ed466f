"""The probe that decides whether a restore may pass CRIU ``--auto-dedup``."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from gpusnap.daemon.host.criu import can_punch_holes


def test_local_disk_and_tmpfs_can_punch_holes(tmp_path: Path) -> None:
    assert can_punch_holes(tmp_path)
    if os.access("/dev/shm", os.W_OK):
        assert can_punch_holes(Path("/dev/shm"))
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone


def test_a_filesystem_that_cannot_is_said_so(tmp_path: Path) -> None:
    # procfs takes no new files at all; a missing directory neither.
    assert not can_punch_holes(Path("/proc"))
    assert not can_punch_holes(tmp_path / "missing")


def test_a_refused_punch_is_said_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class NoPunch:
        def fallocate(self, *args: object) -> int:
            return -1  # what libc returns with errno EOPNOTSUPP

    # host/criu.py looks CDLL up on the ctypes module at each call.
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: NoPunch())
    assert not can_punch_holes(tmp_path)
