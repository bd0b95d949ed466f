"""How ``gpusnap show ID`` (through the daemon) and ``gpusnap store show ID`` print a manifest.

One rendering for both, from ``Manifest.to_dict()``: the summary, the stamp as an indented tree
(the files the process had open or mapped as a table, their ``mtime_ns`` as a time), and the
image's files with their mode and chunk count. The process's environment is part of the stamp
and of the spec (a cold start needs it), and it holds secrets (tokens, keys): both the text and
``--json`` show its variables' names only, with the values ``null``, unless ``--show-env``.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Iterator
from typing import Any

from gpusnap.cli._output import human_bytes, render_table, when
from gpusnap.proto.wire import redact_env

__all__ = ["ENV_NOTE", "add_show_env", "redact_env", "render_manifest"]

WIDTH = 100
ENV_NOTE = "values hidden; --show-env shows them"


def add_show_env(parser: argparse.ArgumentParser) -> None:
    """``--show-env`` on a command that shows a manifest."""
    parser.add_argument(
        "--show-env",
        action="store_true",
        help="show the values of the process's environment variables (they may be secrets)",
    )


def render_manifest(m: dict[str, Any]) -> str:
    """A manifest as a person reads it (pass it through ``redact_env`` first unless the
    environment is to be shown)."""
    files: list[dict[str, Any]] = m.get("files") or []
    totals: dict[str, Any] = m.get("totals") or {}
    size = totals.get("bytes_total", sum(int(f["size"]) for f in files))
    chunks = totals.get("chunks_total", sum(_chunk_count(f) for f in files))
    stamp: dict[str, Any] = m.get("stamp") or {}
    lines = [
        f"checkpoint  {m['checkpoint_id']}",
        f"workload    {m['workload']}",
        f"created     {when(m['created_at'])}",
        f"parent      {m.get('parent') or '-'}",
        f"size        {human_bytes(size)} in {len(files)} files, {chunks} chunks",
        f"schema      {m.get('schema_version', '-')}",
    ]
    if stamp:
        lines.append("stamp")
        lines.extend(_tree(stamp, 1))
    else:
        lines.append("stamp       (empty)")
    if files:
        lines.append("files")
        rows = [
            [_mode(f.get("mode")), human_bytes(int(f["size"])), str(_chunk_count(f)), f["path"]]
            for f in files
        ]
        table = render_table(["MODE", "SIZE", "CHUNKS", "PATH"], rows)
        lines.extend("  " + line for line in table.splitlines())
    return "\n".join(lines)


def _tree(node: dict[str, Any], depth: int) -> Iterator[str]:
    pad = "  " * depth
    for key in sorted(node):
        value = node[key]
        if key == "env" and isinstance(value, dict):
            yield from _env(value, hidden=bool(node.get("env_hidden")), pad=pad)
        elif key == "env_hidden":
            continue
        elif key == "files" and isinstance(value, list) and all(_is_file(v) for v in value):
            yield f"{pad}files ({len(value)}, open or mapped at the dump)"
            yield from _watched(value, pad + "  ")
        elif isinstance(value, dict):
            yield f"{pad}{key}" if value else f"{pad}{key}: -"
            yield from _tree(value, depth + 1)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            yield f"{pad}{key} ({len(value)})"
            for item in value:
                yield f"{pad}  - " + ", ".join(f"{k}={_scalar(item[k])}" for k in sorted(item))
        else:
            yield from _wrapped(f"{key}: ", _scalar(value), pad)


def _env(env: dict[str, Any], *, hidden: bool, pad: str) -> Iterator[str]:
    if hidden or all(v is None for v in env.values()):
        yield from _wrapped(f"env ({len(env)}, {ENV_NOTE}): ", " ".join(sorted(env)), pad)
        return
    yield f"{pad}env ({len(env)})"
    for name in sorted(env):
        yield f"{pad}  {name}={env[name]}"


def _is_file(v: object) -> bool:
    return isinstance(v, dict) and "path" in v and "kind" in v


def _watched(files: list[dict[str, Any]], pad: str) -> Iterator[str]:
    rows = [
        [
            str(f.get("kind", "-")),
            human_bytes(int(f["size"])) if isinstance(f.get("size"), int) else "-",
            when(f["mtime_ns"] / 1e9) if isinstance(f.get("mtime_ns"), int) else "-",
            str(f["path"]),
        ]
        for f in files
    ]
    for line in render_table(["KIND", "SIZE", "MODIFIED", "PATH"], rows).splitlines():
        yield pad + line


def _wrapped(head: str, text: str, pad: str) -> Iterator[str]:
    lines = textwrap.wrap(
        text,
        WIDTH,
        initial_indent=pad + head,
        subsequent_indent=pad + "  ",
        break_long_words=False,
        break_on_hyphens=False,
    )
    yield from lines or [pad + head.rstrip()]


def _scalar(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return " ".join(_scalar(v) for v in value) if value else "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_scalar(value[k])}" for k in sorted(value)) or "-"
    return str(value)


def _chunk_count(f: dict[str, Any]) -> int:
    count = f.get("chunk_count")
    return count if isinstance(count, int) else len(f.get("chunks") or [])


def _mode(value: Any) -> str:
    if isinstance(value, int):
        return f"{value & 0o7777:04o}"
    return "-" if value is None else str(value)
