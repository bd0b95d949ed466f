"""CRIU's own account of a dump (``stats-dump``), read from a checkpoint's parts.

CRIU writes ``stats-dump`` beside the images it dumps (podman exports it at the top of its
archive, runc leaves it in ``criu/``). Its ``freezing_time`` and ``frozen_time`` are what the
container saw: from the first frozen task to the last one running again (or killed). The file
is a CRIU image: its magic numbers, then one length-prefixed ``StatsEntry`` protobuf message
whose field 1 is the ``DumpStatsEntry`` (criu/images/stats.proto). Only varints are read, so no
protobuf schema is needed.
"""

from __future__ import annotations

from pathlib import Path

from gpusnap.daemon.host.criuimg import entries, fields

STATS_NAME = "stats-dump"
_STATS_MAGIC = 0x57093306
# DumpStatsEntry field numbers (criu/images/stats.proto)
_DUMP_FIELDS = {
    1: "freezing_time",
    2: "frozen_time",
    3: "memdump_time",
    4: "memwrite_time",
    5: "pages_scanned",
    6: "pages_skipped_parent",
    7: "pages_written",
}


def parse_dump_stats(data: bytes) -> dict[str, int]:
    """The dump statistics in a ``stats-dump`` image (microseconds and page counts); empty
    when ``data`` is not one."""
    try:
        found = entries(data, _STATS_MAGIC)
        if not found:
            return {}
        dump = fields(found[0]).get(1)
        if not isinstance(dump, bytes):
            return {}
        return {
            _DUMP_FIELDS[k]: v
            for k, v in fields(dump).items()
            if k in _DUMP_FIELDS and isinstance(v, int)
        }
    except ValueError:
        return {}


def dump_stats(directory: Path, names: list[str]) -> dict[str, int]:
    """The statistics of the first ``stats-dump`` among ``names`` (paths in ``directory``)."""
    for rel in names:
        if rel == STATS_NAME or rel.endswith("/" + STATS_NAME):
            try:
                return parse_dump_stats((directory / rel).read_bytes())
            except OSError:
                return {}
    return {}


def pause_seconds(stats: dict[str, int]) -> float | None:
    """What the container was frozen for, by CRIU's account; None when it did not say."""
    if "frozen_time" not in stats:
        return None
    return (stats.get("freezing_time", 0) + stats["frozen_time"]) / 1e6
