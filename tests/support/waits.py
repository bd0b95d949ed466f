"""Waiting for what a test cannot be told about: a probe asked until it answers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from tests.support.daemons import HANG_GUARD

T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = HANG_GUARD) -> T:
    """Poll ``probe`` until it returns something other than None/False (a hang guard only)."""
    end = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)
