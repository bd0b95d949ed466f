"""The bounds every number the daemon reads from its config file has, whichever package parses
the table: the config package and reclaim (whose tables the config parses through it) alike."""

from __future__ import annotations

import math
from typing import Any

# Bounds every numeric key has unless it names tighter ones: no count or size we read comes
# near 2**53 (beyond it a float loses integers), no time, rate or duration near 10**9
# (31 years of seconds).
MAX_INTEGER = 2**53
MAX_NUMBER = 1e9


def is_finite_number(value: Any) -> bool:
    """A TOML number that is neither nan nor infinite (nor a bool, which Python calls an int)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
