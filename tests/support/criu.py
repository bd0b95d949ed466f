"""This machine's CRIU for a test, or the test skipped saying why."""

from __future__ import annotations

import os

import pytest

from gpusnap.daemon.host.criu import Criu
from gpusnap.errors import Unsupported


def criu_or_skip() -> Criu:
    """A checked ``Criu``; skips the test without root or without a working CRIU >= 4."""
    if os.geteuid() != 0:
        pytest.skip("CRIU needs root; run the suite as root")
    criu = Criu()
    try:
        criu.check()
    except Unsupported as exc:
        pytest.skip(f"no working CRIU here ({exc}); run scripts/install-criu.sh")
    return criu
