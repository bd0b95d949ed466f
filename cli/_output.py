"""How the CLI talks to a person or a script: JSON, tables, sizes, errors (the progress line
is ``progress.py``).

Only the CLI entry point prints; everything here writes to streams it is given, so the
command modules stay testable and the libraries underneath never print.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

from gpusnap.errors import EXIT_OK, GpusnapError, exit_code_for

PROG = "gpusnap"


def out(text: str) -> None:
    """One line (or several) of a command's human output on stdout."""
    sys.stdout.write(text + "\n")


def emit(as_json: bool, data: Any, human: Callable[[], str], code: int = EXIT_OK) -> int:
    """A command's answer: ``data`` as JSON with ``--json``, else ``human()`` as text.
    Returns ``code``, the command's exit code."""
    if as_json:
        print_json(data)
    else:
        out(human())
    return code


def print_json(obj: Any, stream: TextIO | None = None) -> None:
    """One JSON document, one line, newline-terminated (easy to pipe into ``jq``)."""
    out = stream if stream is not None else sys.stdout
    out.write(json.dumps(obj, sort_keys=True, default=str) + "\n")
    out.flush()


def print_error(
    err: BaseException, *, as_json: bool, internal: bool = False, kind: str | None = None
) -> int:
    """Report ``err`` as one line on stderr (and a JSON object on stdout with ``--json``).

    Returns the exit code the error maps to.
    """
    message = " ".join(str(err).split()) or type(err).__name__
    code = exit_code_for(err)
    if internal:
        line = f"{PROG}: internal error: {type(err).__name__}: {message}"
    else:
        line = f"{PROG}: error: {message}"
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    if as_json:
        err_kind = kind or (err.kind if isinstance(err, GpusnapError) else "internal")
        print_json({"error": message, "kind": err_kind, "exit_code": code})
    return code


def when(value: Any) -> str:
    """A time (epoch seconds, ISO string or datetime) as ``YYYY-MM-DD HH:MM:SSZ``; ``-``
    when unknown."""
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    if isinstance(value, str) and value:
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return value
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        return parsed.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    return "-" if value in (None, "") else str(value)


def human_bytes(n: float) -> str:
    """Binary units, three significant digits: ``0 B``, ``512 B``, ``1.50 KiB``, ``2.00 GiB``."""
    if n < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024.0
        if value < 1024 or unit == "PiB":
            if value >= 100:
                return f"{value:.0f} {unit}"
            if value >= 10:
                return f"{value:.1f} {unit}"
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")


def human_seconds(seconds: float) -> str:
    """``0:07``, ``12:03``, ``1:02:03``."""
    s = max(0, int(seconds + 0.5))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces; no trailing blanks."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = []
    for row in [list(headers), *[list(r) for r in rows]]:
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
