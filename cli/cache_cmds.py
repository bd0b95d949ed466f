"""``gpusnap cache stats|prune``: the node's chunk cache, directly (no daemon needed).

The cache is the directory ``--cache-dir`` names, else ``GPUSNAP_CACHE_DIR``, else the
daemon's default ``[cache] dir`` (``/var/lib/gpusnap/cache``). ``gpusnap store pull`` uses the
same one (``open_pull_cache``), so a pull by hand on a node shares the daemon's cache.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from gpusnap.cli._common import Subparsers, add_command, add_group, common_parser
from gpusnap.cli._output import emit, human_bytes, out, print_json, render_table
from gpusnap.cli.plan.command import parse_bytes
from gpusnap.errors import EXIT_OK, GpusnapError, NotFound
from gpusnap.storage.cache import DEFAULT_CACHE_DIR, CacheStats, ChunkCache

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "GPUSNAP_CACHE_DIR"


def register(subparsers: Subparsers) -> None:
    sub = add_group(
        subparsers,
        "cache",
        "the node's chunk cache (no daemon needed)",
        "Look at or shrink the node's chunk cache; no daemon needed.",
    )
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--cache-dir",
        metavar="DIR",
        type=Path,
        help=f"the chunk cache (env {CACHE_DIR_ENV}; default {DEFAULT_CACHE_DIR}, the "
        "daemon's [cache] dir)",
    )
    parents = [common_parser(), where]
    add_command(sub, "stats", cmd_stats, "entries, bytes, budget, hits and misses", parents)
    p = add_command(sub, "prune", cmd_prune, "evict least recently used chunks", parents)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--to", type=parse_bytes, metavar="BYTES", help="keep at most this much (e.g. 10GiB)"
    )
    target.add_argument("--all", action="store_true", help="evict everything")


def cache_dir(explicit: Path | None) -> Path:
    """The cache directory: ``explicit``, else ``GPUSNAP_CACHE_DIR``, else the daemon's."""
    if explicit is not None:
        return explicit
    from_env = os.environ.get(CACHE_DIR_ENV)
    return Path(from_env) if from_env else DEFAULT_CACHE_DIR


def open_pull_cache(explicit: Path | None, *, disabled: bool) -> ChunkCache | None:
    """The chunk cache ``gpusnap store pull`` uses, or ``None``.

    A directory named (``--cache-dir``, ``GPUSNAP_CACHE_DIR``) is made if missing and must
    open. The daemon's default is used only where it exists (a node the daemon runs on) and
    only if it opens: a pull on another machine runs without a cache rather than failing.
    """
    if disabled:
        return None
    named = explicit is not None or bool(os.environ.get(CACHE_DIR_ENV))
    directory = cache_dir(explicit)
    if named:
        return ChunkCache(directory)
    try:
        return ChunkCache(directory, create=False)
    except NotFound:
        return None
    except GpusnapError as err:
        log.warning("pulling without the node's chunk cache: %s", err)
        return None


def _open(args: argparse.Namespace) -> ChunkCache:
    """An existing cache (a mistyped directory is ``NotFound``, not an empty cache)."""
    return ChunkCache(cache_dir(args.cache_dir), create=False)


def cmd_stats(args: argparse.Namespace) -> int:
    with _open(args) as cache:
        stats = cache.stats()
    return emit(args.json, stats.as_dict(), lambda: render_stats(stats))


def render_stats(stats: CacheStats) -> str:
    share = f" ({100 * stats.bytes / stats.max_bytes:.0f}%)" if stats.max_bytes else ""
    writing = f", {stats.writing} being written" if stats.writing else ""
    lines = [
        f"cache    {stats.dir}",
        f"held     {human_bytes(stats.bytes)} of {human_bytes(stats.max_bytes)}{share} "
        f"in {stats.entries} chunks{writing}",
        f"hits     {stats.hits} ({human_bytes(stats.bytes_hit)}), misses {stats.misses}",
        f"added    {human_bytes(stats.bytes_added)}; evicted {stats.evicted} chunks; "
        f"dropped {stats.dropped} that failed their checks",
    ]
    if stats.stores:
        rows = [
            [s.scope, str(s.entries), human_bytes(s.bytes), s.store or "-"] for s in stats.stores
        ]
        table = render_table(["SCOPE", "CHUNKS", "BYTES", "STORE"], rows)
        lines.extend(["stores", *("  " + line for line in table.splitlines())])
    return "\n".join(lines)


def cmd_prune(args: argparse.Namespace) -> int:
    target = 0 if args.all else int(args.to)
    with _open(args) as cache:
        result = cache.prune(target)
    if args.json:
        print_json(result.as_dict())
        return EXIT_OK
    out(
        f"evicted {result.entries_evicted} chunks ({human_bytes(result.bytes_freed)}); "
        f"{human_bytes(result.bytes_left)} left"
    )
    return EXIT_OK
