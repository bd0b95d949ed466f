"""Pieces of a ``gpusnapd.toml`` for the tests that run real daemons on the tests' workloads."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def workload_section(
    name: str,
    pid_file: Path,
    *,
    revision: str = "r1",
    marker: Path | None = None,
    extra: str = "",
) -> str:
    """A ``[[workload]]`` for the counter or tree workload (tests/support/workloads.py).

    Its engine is ``hashchain 1`` and its model ``org/counter`` at ``revision``: the model
    build the node runs, so two nodes of different revisions make a restore cold-start. With
    ``marker``, the cold-start command writes ``cold`` there, so a test can see that it ran.
    ``extra``: more keys of the table.
    """
    start = ""
    if marker is not None:
        command = [sys.executable, "-c", f"open({str(marker)!r}, 'w').write('cold')"]
        start = f'start = {{ command = {json.dumps(command)}, cwd = "/" }}\n'
    return f"""
[[workload]]
name = "{name}"
pid_file = "{pid_file}"
engine = {{ name = "hashchain", version = "1" }}
model = {{ name = "org/counter", revision = "{revision}" }}
{start}{extra}"""
