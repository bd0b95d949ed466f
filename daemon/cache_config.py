"""The ``[cache]`` table of gpusnapd's config: the node's chunk cache (``storage/cache``).

Its keys (``enabled``, ``dir``, ``max_bytes``, ``seed``) are documented in ``docs/config.md``.
Kept apart from ``config.py`` (which imports ``CacheSection`` from here, so both names work)
so that module stays under 500 lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpusnap.daemon.config_table import Table


@dataclass(frozen=True)
class CacheSection:
    """The node's chunk cache (``storage/cache``): every pull on the node reads it first, the
    daemon's own checkpoints seed it, a standby prefetches into it."""

    enabled: bool = True
    dir: Path | None = None  # default: <state_dir>/cache
    max_bytes: int | None = None  # default: the budget recorded there, else 1/4 of its disk
    seed: bool = True  # the daemon's own checkpoints leave their chunks in it

    def directory(self, state_dir: Path) -> Path:
        return self.dir or (state_dir / "cache")


def parse_cache(t: Table) -> CacheSection:
    """``[cache]`` -> ``CacheSection``; an unknown key or a wrong type is ``InvalidArgument``."""
    d = CacheSection()
    # Read in the table's documented order, so that of two bad keys the first is named.
    enabled = t.boolean("enabled")
    directory = t.path("dir")
    max_bytes = t.integer("max_bytes", minimum=1)
    seed = t.boolean("seed")
    section = CacheSection(
        enabled=d.enabled if enabled is None else enabled,
        dir=directory,
        max_bytes=max_bytes,
        seed=d.seed if seed is None else seed,
    )
    t.done()
    return section
