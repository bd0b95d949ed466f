"""Who is writing into the chunk cache, and whether they still live.

Every process that puts into a cache marks what it has reserved (a row) and what it is
writing (a temp file) with its *writer token*: the host's boot id, its pid and its start
time (``/proc/<pid>/stat`` field 22, so that a recycled pid is not mistaken for the writer).
Opening the cache removes what dead writers left: nothing they were writing is ever used,
and the budget they reserved is given back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gpusnap.storage.index import current_boot_id

# Process states that will never write again (a SIGKILLed writer not yet reaped is a zombie).
_DEAD_STATES = frozenset({"Z", "X", "x"})


def process_start_time(pid: int) -> str | None:
    """The start time of a live process ``pid`` (clock ticks since boot), or ``None``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')'.
    fields = text.rpartition(")")[2].split()
    if len(fields) < 20 or fields[0] in _DEAD_STATES:
        return None
    return fields[19]


@dataclass(frozen=True)
class WriterToken:
    """One process writing into a cache: ``<boot id>/<pid>/<start time>``."""

    boot_id: str
    pid: int
    start: str

    @classmethod
    def mine(cls) -> WriterToken:
        pid = os.getpid()
        return cls(current_boot_id(), pid, process_start_time(pid) or "0")

    @classmethod
    def parse(cls, text: str) -> WriterToken | None:
        boot_id, _, rest = text.partition("/")
        pid, _, start = rest.partition("/")
        if not boot_id or not pid.isdigit() or not start:
            return None
        return cls(boot_id, int(pid), start)

    def __str__(self) -> str:
        return f"{self.boot_id}/{self.pid}/{self.start}"

    def temp_prefix(self) -> str:
        """What this writer's temp file names start with (no ``/``: they are one name)."""
        return f"{self.boot_id[:8]}-{self.pid}-{self.start}-"

    def alive(self) -> bool:
        return self.boot_id == current_boot_id() and process_start_time(self.pid) == self.start


def temp_writer_alive(name: str) -> bool:
    """Whether the writer of the temp file ``name`` (``<boot8>-<pid>-<start>-<n>``) lives."""
    boot8, pid, start, *_rest = [*name.split("-"), "", "", ""]
    return (
        pid.isdigit() and current_boot_id()[:8] == boot8 and process_start_time(int(pid)) == start
    )
